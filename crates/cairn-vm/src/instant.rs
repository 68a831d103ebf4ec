//! Instant recovery (PBS's live-restore): a VM version served at once from lazy, writable
//! exports of its disks (data fetched on demand, writes kept in local overlays), and what the
//! VM wrote since committed back as a new VM version.
//!
//! `cairn vm start` serves each disk `VM/DISK` under its image name from one export process
//! and prints the recorded QEMU command line pointed at them; `cairn vm commit` asks each
//! running export of the VM to COMMIT its overlay (with the VM paused over QMP when given, so
//! that every disk is taken at one point in time) and binds the disk versions as a VM version.

use std::path::Path;
use std::time::{Duration, Instant};

use cairn_engine::vm::{publish_vm, vm_history, NewVmVersion};
use cairn_export::control::{self, Request};
use cairn_format::vm::{Freeze, VmDisk, VmVersion};
use cairn_format::Id;
use cairn_repo::Repo;
use serde_json::{json, Value};

use crate::config::{qemu_args_on, RestoredDisk};
use crate::error::{VmError, VmResult};
use crate::qmp::Qmp;

/// The export specs (`VM/DISK@SEQ=VM/DISK`) that serve every disk of `v`, and the recorded
/// QEMU command line pointed at them on `socket`, with notes for what could not be pointed.
pub fn start_plan(v: &VmVersion, socket: &Path) -> (Vec<String>, Vec<String>, Vec<String>) {
    let mut specs = Vec::new();
    let mut disks = Vec::new();
    for d in &v.disks {
        let image = VmVersion::disk_image(&v.vm, &d.name);
        specs.push(format!("{image}@{}={image}", d.seq));
        disks.push(RestoredDisk {
            name: d.name.clone(),
            path: format!("nbd+unix:///{image}?socket={}", socket.display()).into(),
            format: "raw".into(),
        });
    }
    let (args, notes) = match v.config_kind {
        cairn_format::vm::ConfigKind::QemuArgs => qemu_args_on(&v.config, &disks),
        _ => (
            Vec::new(),
            vec!["no QEMU command line was recorded: attach the exports by hand".into()],
        ),
    };
    (specs, args, notes)
}

/// What `vm commit` did.
#[derive(Debug, Clone)]
pub struct Committed {
    pub id: Id,
    pub record: VmVersion,
    /// Each disk's COMMIT reply (image, seq, id, new and stored bytes).
    pub disks: Vec<Value>,
    /// How long the VM was paused (zero without QMP).
    pub paused_for: Duration,
}

/// Commits what the VM running on the exports of `vm` wrote as a new VM version. With
/// `qmp`, the VM is paused (its writes drained to the exports) for the disks' COMMITs and
/// resumed after, whatever happened.
pub async fn commit_running(
    repo: &Repo,
    vm: &str,
    qmp: Option<&Path>,
    message: &str,
) -> VmResult<Committed> {
    let run = cairn_export::lifecycle::run_dir();
    let prefix = format!("{vm}/");
    let exports: Vec<_> = cairn_export::lifecycle::live_exports(&run)
        .await
        .map_err(|e| VmError::State(format!("the running exports cannot be listed: {e}")))?
        .into_iter()
        .filter(|e| e.state.name.starts_with(&prefix) && e.state.writable)
        .collect();
    if exports.is_empty() {
        return Err(VmError::State(format!(
            "no writable export of VM {vm} is running (`cairn vm start {vm}` serves one)"
        )));
    }
    // The VM version the exports started from: its disks' nodes and configuration carry over.
    let started: Vec<String> = exports.iter().map(|e| e.state.id.clone()).collect();
    let base = vm_history(repo, vm)
        .await?
        .into_iter()
        .find(|(_, v)| {
            v.disks
                .iter()
                .all(|d| started.contains(&d.version.to_hex()))
        })
        .map(|(_, v)| v)
        .ok_or_else(|| {
            VmError::State(format!(
                "the running exports of VM {vm} serve no VM version of it (started from {})",
                started.join(", ")
            ))
        })?;
    let mut monitor = match qmp {
        Some(path) => Some(Qmp::connect(path).await?),
        None => None,
    };
    let paused = Instant::now();
    if let Some(m) = monitor.as_mut() {
        m.execute("stop", json!({})).await?;
    }
    let time_ns = cairn_repo::session::now_ns();
    let mut replies = Vec::new();
    let mut failed = None;
    for d in &base.disks {
        let image = VmVersion::disk_image(vm, &d.name);
        let req = Request::Commit {
            image: image.clone(),
            message: format!("{}{vm} at {time_ns}", cairn_engine::vm::DISK_MESSAGE_PREFIX),
            // The export's base may be older than the image's newest version (the VM was
            // started from an older one): the new version continues from it.
            force: true,
        };
        match control::request(&image, req).await {
            Ok(v) => replies.push(v),
            Err(e) => {
                failed = Some(VmError::State(format!("{image}: {e}")));
                break;
            }
        }
    }
    let mut paused_for = Duration::ZERO;
    if let Some(m) = monitor.as_mut() {
        let resumed = m.execute("cont", json!({})).await;
        paused_for = paused.elapsed();
        resumed?;
    }
    if let Some(e) = failed {
        return Err(e);
    }
    let mut disks = Vec::new();
    for (d, reply) in base.disks.iter().zip(&replies) {
        let id: Id = reply["id"]
            .as_str()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| VmError::State(format!("{}: COMMIT replied {reply}", d.name)))?;
        disks.push(VmDisk {
            name: d.name.clone(),
            version: id,
            seq: reply["seq"].as_u64().unwrap_or(0),
            node: d.node.clone(),
            checkpoint: String::new(),
        });
    }
    let (id, record) = publish_vm(
        repo,
        NewVmVersion {
            vm: vm.to_string(),
            time_ns,
            config_kind: base.config_kind,
            config: base.config.clone(),
            disks,
            memory: None,
            freeze: Freeze::NotTried,
            freeze_ns: paused_for.as_nanos() as u64,
            message: message.to_string(),
        },
    )
    .await?;
    Ok(Committed {
        id,
        record,
        disks: replies,
        paused_for,
    })
}

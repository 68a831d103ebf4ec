//! The hypervisor side of a backup for a QEMU driven directly over its QMP socket: scratch
//! ("fleece") nodes, one QMP transaction, checkpoint bitmaps, NBD exports from QEMU's own
//! server, and the guest agent reached through its chardev socket.

use std::path::{Path, PathBuf};
use std::time::Duration;

use cairn_format::vm::ConfigKind;
use serde_json::json;

use crate::agent::{Agent, FreezeStatus};
use crate::block::{self, Disk, Fleece, READ_BITMAP};
use crate::error::{VmError, VmResult};
use crate::hypervisor::{DiskInfo, Frozen, Hypervisor, Reader, CHECKPOINT_PREFIX};
use crate::qmp::Qmp;

/// A QEMU over QMP, with its guest agent when one is given.
pub struct Qemu {
    socket: PathBuf,
    qmp: Qmp,
    agent_path: Option<PathBuf>,
    agent: Option<Agent>,
    /// Why the agent could not be reached, when it could not.
    agent_error: Option<String>,
    agent_timeout: Duration,
    scratch: PathBuf,
    /// Names this VM's scratch files and NBD socket apart from other VMs'.
    vm_key: String,
    /// QEMU's view of the disks backed up, in the order given to the backup.
    disks: Vec<Disk>,
    fleeces: Vec<Fleece>,
    nbd_socket: PathBuf,
    nbd_started: bool,
    /// What `check_running` undid of an interrupted backup, for `clean_stale` to report.
    undone: Vec<String>,
}

impl Qemu {
    /// Connects to the QMP socket (the guest agent is connected in `clean_stale`).
    pub async fn connect(
        socket: &Path,
        agent: Option<PathBuf>,
        agent_timeout: Duration,
        scratch: &Path,
        vm_key: &str,
    ) -> VmResult<Qemu> {
        Ok(Qemu {
            socket: socket.to_path_buf(),
            qmp: Qmp::connect(socket).await?,
            agent_path: agent,
            agent: None,
            agent_error: None,
            agent_timeout,
            scratch: scratch.to_path_buf(),
            vm_key: vm_key.to_string(),
            disks: Vec::new(),
            fleeces: Vec::new(),
            nbd_socket: scratch.join(format!("cairn-nbd-{vm_key}.sock")),
            nbd_started: false,
            undone: Vec::new(),
        })
    }

    /// QEMU's own view of disk `name`.
    fn disk(&self, name: &str) -> VmResult<&Disk> {
        self.disks
            .iter()
            .find(|d| d.name == name)
            .ok_or_else(|| VmError::State(format!("disk {name} is gone from QEMU")))
    }
}

impl Hypervisor for Qemu {
    fn describe(&self) -> String {
        format!("the QEMU behind {}", self.socket.display())
    }

    fn lock_key(&self) -> String {
        let path = std::fs::canonicalize(&self.socket).unwrap_or_else(|_| self.socket.clone());
        format!("qemu:{}", path.display())
    }

    async fn check_running(&mut self) -> VmResult<()> {
        // A guest an interrupted memory save left paused runs again first.
        if crate::memory::resume(&mut self.qmp, &self.vm_key).await? {
            self.undone
                .push("a guest paused to save its memory (resumed)".into());
        }
        let status = self.qmp.execute("query-status", json!({})).await?;
        let state = status["status"].as_str().unwrap_or("unknown").to_string();
        match state.as_str() {
            "running" | "paused" | "prelaunch" => Ok(()),
            _ => Err(VmError::State(format!(
                "{} is {state}: a backup needs a running or paused VM",
                self.describe()
            ))),
        }
    }

    async fn clean_stale(&mut self) -> Vec<String> {
        let mut out = std::mem::take(&mut self.undone);
        out.extend(block::clean_stale(&mut self.qmp, &self.scratch, &self.vm_key).await);
        if let Some(path) = &self.agent_path {
            match Agent::connect(path, self.agent_timeout).await {
                Ok(mut agent) => {
                    if let Ok(FreezeStatus::Frozen) = agent.status().await {
                        let _ = agent.thaw().await;
                        out.push("a frozen guest (thawed)".into());
                    }
                    self.agent = Some(agent);
                }
                Err(e) => self.agent_error = Some(e.to_string()),
            }
        }
        out
    }

    async fn disks(&mut self, say: &(dyn Fn(String) + Send + Sync)) -> VmResult<Vec<DiskInfo>> {
        let mut disks = block::disks(&mut self.qmp).await?;
        for disk in &mut disks {
            // A checkpoint QEMU could not save (it stopped without closing the image) may
            // miss writes, and can only be removed.
            let bad: Vec<String> = disk
                .checkpoints()
                .filter(|b| b.inconsistent)
                .map(|b| b.name.clone())
                .collect();
            if !bad.is_empty() {
                block::remove_bitmaps(&mut self.qmp, disk, &bad).await?;
                say(format!(
                    "{}: removed checkpoint(s) {} that QEMU left inconsistent (it stopped \
                     without saving them)",
                    disk.name,
                    bad.join(", ")
                ));
                disk.bitmaps.retain(|b| !b.inconsistent);
            }
            if !disk.persistent_bitmaps() {
                say(format!(
                    "{}: a {} disk keeps no checkpoint across QEMU restarts: after one, the \
                     next backup reads it whole (qcow2 keeps them)",
                    disk.name, disk.format
                ));
            }
        }
        let out = disks
            .iter()
            .map(|d| DiskInfo {
                name: d.name.clone(),
                node: d.node.clone(),
                format: d.format.clone(),
                size: d.size,
                checkpoints: d.checkpoints().map(|b| b.name.clone()).collect(),
            })
            .collect();
        self.disks = disks;
        Ok(out)
    }

    async fn prepare(&mut self, disks: &[DiskInfo]) -> VmResult<()> {
        // Ours either way (started now, or left by a killed backup): stopped at teardown.
        block::start_nbd_server(&mut self.qmp, &self.nbd_socket).await?;
        self.nbd_started = true;
        for (i, info) in disks.iter().enumerate() {
            let fleece = Fleece::new(i, &self.scratch, &self.vm_key);
            let disk = self.disk(&info.name)?.clone();
            self.fleeces.push(fleece.clone());
            block::add_fleece(&mut self.qmp, &disk, &fleece).await?;
        }
        Ok(())
    }

    async fn freeze(&mut self, _timeout: Duration) -> (Frozen, Option<String>) {
        let Some(agent) = self.agent.as_mut() else {
            return match &self.agent_error {
                None => (
                    Frozen::NoAgent,
                    Some(
                        "no guest agent given (--guest-agent): the disks are crash-consistent, \
                         as after a power cut, not frozen"
                            .into(),
                    ),
                ),
                Some(e) => (
                    Frozen::NoAnswer,
                    Some(format!(
                        "{e}: backing up without a freeze (crash-consistent, as after a power cut)"
                    )),
                ),
            };
        };
        match agent.freeze().await {
            Ok(n) => {
                tracing::info!(filesystems = n, "guest frozen");
                (Frozen::Yes, None)
            }
            Err(e) => {
                // A freeze that timed out may still happen: thaw regardless.
                let _ = agent.thaw().await;
                self.agent = None;
                (
                    Frozen::NoAnswer,
                    Some(format!(
                        "{e}: backing up without a freeze (crash-consistent)"
                    )),
                )
            }
        }
    }

    async fn thaw(&mut self, _timeout: Duration) {
        if let Some(agent) = self.agent.as_mut() {
            if let Err(e) = agent.thaw().await {
                // Said loudly: a guest left frozen stops writing.
                tracing::error!("{e}: the guest may still be frozen; the next backup thaws it");
            }
        }
    }

    async fn point_in_time(
        &mut self,
        disks: &[DiskInfo],
        _since: &[Option<String>],
        checkpoint: &str,
    ) -> VmResult<()> {
        let ours: Vec<Disk> = disks
            .iter()
            .map(|d| self.disk(&d.name).cloned())
            .collect::<VmResult<_>>()?;
        let pairs: Vec<(&Disk, &Fleece)> = ours.iter().zip(&self.fleeces).collect();
        block::point_in_time(&mut self.qmp, &pairs, checkpoint).await
    }

    async fn save_memory(&mut self) -> VmResult<crate::memory::Saved> {
        let prefix = block::scratch_prefix(&self.vm_key);
        let file = self.scratch.join(format!("{prefix}memory"));
        let socket = self.scratch.join(format!("{prefix}migration.sock"));
        let saved = crate::memory::save(&mut self.qmp, &self.vm_key, &file, &socket).await?;
        for fleece in self.fleeces.clone() {
            block::activate(&mut self.qmp, &fleece).await?;
        }
        Ok(saved)
    }

    async fn resume(&mut self) {
        if let Err(e) = crate::memory::resume(&mut self.qmp, &self.vm_key).await {
            // Said loudly: a guest left paused does nothing.
            tracing::error!("{e}: the guest may still be paused; the next backup resumes it");
        }
    }

    async fn expose(
        &mut self,
        disks: &[DiskInfo],
        since: &[Option<String>],
    ) -> VmResult<Vec<Reader>> {
        let mut out = Vec::new();
        for (i, (info, since)) in disks.iter().zip(since).enumerate() {
            let disk = self.disk(&info.name)?.clone();
            let fleece = self.fleeces[i].clone();
            // Every older checkpoint: the changes since the last published version's point in
            // time, even when backups failed since (their checkpoints are still there).
            if since.is_some() {
                block::add_read_bitmap(&mut self.qmp, &disk, &info.checkpoints).await?;
            }
            block::export(&mut self.qmp, &fleece, since.is_some()).await?;
            out.push(Reader {
                url: format!(
                    "nbd+unix:///{}?socket={}",
                    fleece.export,
                    self.nbd_socket.display()
                ),
                bitmap: since.as_ref().map(|_| READ_BITMAP.to_string()),
            });
        }
        Ok(out)
    }

    async fn teardown(&mut self) {
        for line in block::clean_stale(&mut self.qmp, &self.scratch, &self.vm_key).await {
            tracing::debug!("teardown: {line}");
        }
        if self.nbd_started {
            if let Err(e) = self.qmp.execute("nbd-server-stop", json!({})).await {
                tracing::warn!("nbd-server-stop: {e}");
            }
            let _ = std::fs::remove_file(&self.nbd_socket);
        }
    }

    async fn drop_checkpoints(&mut self, disks: &[DiskInfo], keep: &str) -> VmResult<()> {
        for info in disks {
            let disk = self.disk(&info.name)?.clone();
            let old: Vec<String> = disk
                .checkpoints()
                .map(|b| b.name.clone())
                .filter(|n| n != keep && n.starts_with(CHECKPOINT_PREFIX))
                .collect();
            block::remove_bitmaps(&mut self.qmp, &disk, &old).await?;
        }
        Ok(())
    }

    async fn config(&mut self) -> (ConfigKind, String) {
        match qemu_args(self.qmp.pid()) {
            Some(args) => (ConfigKind::QemuArgs, args),
            None => (ConfigKind::None, String::new()),
        }
    }
}

/// The QEMU command line of process `pid`, one argument per line.
fn qemu_args(pid: Option<u32>) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{}/cmdline", pid?)).ok()?;
    let args: Vec<String> = raw
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    Some(args.join("\n"))
}

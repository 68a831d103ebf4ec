//! `cairn vm backup`: one VM or several, and what a backup reports.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use cairn_format::vm::Freeze;
use cairn_repo::SessionKind;
use cairn_vm::backup::{backup, backup_all, BackupOptions, BackupReport, Target};
use serde_json::{json, Value};

use super::history::vm_json;
use super::unwrap;
use crate::cli::VmBackupArgs;
use crate::context::Context;
use crate::output::{bytes, print_json};

pub(super) async fn run_backup(ctx: &Context, args: VmBackupArgs) -> Result<ExitCode> {
    if !(args.agent_timeout.is_finite() && args.agent_timeout > 0.0) {
        return Err(cairn_engine::EngineError::BadInput(format!(
            "--agent-timeout must be a positive number of seconds, not {}",
            args.agent_timeout
        ))
        .into());
    }
    let rate_limit = match args.rate_limit {
        Some(r) if r.is_finite() && r > 0.0 => Some((r * 1024.0 * 1024.0) as u64),
        Some(r) => {
            return Err(cairn_engine::EngineError::BadInput(format!(
                "--rate-limit must be a positive number of MiB/s, not {r}"
            ))
            .into())
        }
        None => None,
    };
    let bad = |m: String| anyhow::Error::from(cairn_engine::EngineError::BadInput(m));
    if args.connect.is_some() && args.domain.is_empty() && !args.all {
        return Err(bad("--connect goes with --domain or --all".into()));
    }
    if args.guest_agent.is_some() && args.qmp.len() != 1 {
        return Err(bad("--guest-agent goes with one --qmp".into()));
    }
    let scratch_dir = args.scratch_dir.unwrap_or_else(default_scratch);
    // (VM name, target) for every VM of the run.
    let mut targets: Vec<(String, Target)> = Vec::new();
    let libvirt = |domain: String| Target::Libvirt {
        domain,
        connect: args.connect.clone(),
        scratch_dir: scratch_dir.clone(),
    };
    if !args.qmp.is_empty() {
        let single = args.qmp.len() == 1 && args.vm.is_some();
        for q in &args.qmp {
            let (vm, socket) = match (single, q.split_once('=')) {
                (true, _) => (args.vm.clone().unwrap_or_default(), q.as_str()),
                (false, Some((vm, path))) if !vm.is_empty() => (vm.to_string(), path),
                _ => {
                    return Err(bad(format!(
                        "--qmp {q}: name the VM (VM=PATH) when several are backed up, or \
                         give its name before the options"
                    )))
                }
            };
            let target = Target::Qmp {
                socket: socket.into(),
                agent: args.guest_agent.clone(),
                scratch_dir: scratch_dir.clone(),
            };
            targets.push((vm, target));
        }
    } else {
        let domains = match args.all {
            true => cairn_vm::libvirt::running_domains(args.connect.clone())
                .await
                .map_err(unwrap)?,
            false => args.domain.clone(),
        };
        if args.vm.is_some() && domains.len() != 1 {
            return Err(bad(
                "several domains are each backed up as the VM of their name: give no VM name"
                    .into(),
            ));
        }
        if domains.is_empty() {
            return Err(bad("no libvirt domain is running".into()));
        }
        for d in domains {
            targets.push((args.vm.clone().unwrap_or_else(|| d.clone()), libvirt(d)));
        }
    }
    for (vm, _) in &targets {
        cairn_format::name::validate_image_name(vm)
            .map_err(|e| anyhow::anyhow!(cairn_engine::EngineError::from(e)))?;
    }
    let batch = targets.len() > 1 || args.all;
    let dedup = crate::commands::commit::dedup_mode(args.dedup);
    let options: Vec<BackupOptions> = targets
        .into_iter()
        .map(|(vm, target)| BackupOptions {
            vm,
            target,
            agent_timeout: Duration::from_secs_f64(args.agent_timeout),
            only: args.disks.clone(),
            message: args.message.clone(),
            dedup,
            rate_limit,
            memory: args.memory,
        })
        .collect();
    let repo = ctx.open_as(SessionKind::Commit).await?;
    let say = |line: String| ctx.warn(&line);
    if !batch {
        let report = backup(repo.clone(), &options[0], &say)
            .await
            .map_err(unwrap)?;
        match ctx.json {
            true => print_json(&backup_json(&report)),
            false => print_backup(&report),
        }
        cairn_engine::gc::compact::after_commit(&repo).await;
        return Ok(ExitCode::SUCCESS);
    }
    let items = backup_all(repo.clone(), &options, &say).await;
    cairn_engine::gc::compact::after_commit(&repo).await;
    if ctx.json {
        let all: Vec<Value> = items
            .iter()
            .map(|i| match &i.result {
                Ok(r) => backup_json(r),
                Err(e) => json!({"vm": i.vm, "error": e.to_string()}),
            })
            .collect();
        print_json(&Value::Array(all));
    } else {
        for r in items.iter().filter_map(|i| i.result.as_ref().ok()) {
            print_backup(r);
        }
    }
    let failed: Vec<&str> = items
        .iter()
        .filter(|i| i.result.is_err())
        .map(|i| i.vm.as_str())
        .collect();
    match failed.is_empty() {
        true => Ok(ExitCode::SUCCESS),
        false => Err(anyhow::anyhow!(
            "{} of {} VM backups failed: {}",
            failed.len(),
            items.len(),
            failed.join(", ")
        )),
    }
}

fn default_scratch() -> std::path::PathBuf {
    std::env::var_os("TMPDIR")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| "/var/tmp".into())
}

pub(super) fn freeze_text(f: Freeze) -> &'static str {
    match f {
        Freeze::NotTried => "not frozen (no guest agent)",
        Freeze::Frozen => "frozen by the guest agent",
        Freeze::NoAnswer => "not frozen (the guest agent did not answer)",
    }
}

pub(super) fn freeze_code(f: Freeze) -> &'static str {
    match f {
        Freeze::NotTried => "not_tried",
        Freeze::Frozen => "frozen",
        Freeze::NoAnswer => "no_answer",
    }
}

/// A backup's report as JSON.
fn backup_json(r: &BackupReport) -> Value {
    let disks: Vec<Value> = r
        .disks
        .iter()
        .map(|d| {
            json!({
                "disk": d.name,
                "image": d.image,
                "seq": d.record.seq,
                "id": d.id.to_hex(),
                "incremental": d.full_because.is_none(),
                "full_because": d.full_because,
                "dirty_bytes": d.dirty_bytes,
                "read_bytes": d.read_bytes,
                "logical_bytes": d.record.logical_size,
                "new_chunk_bytes": d.record.stats.new_chunk_bytes,
                "stored_bytes": d.record.stats.stored_bytes,
                "duration_s": d.duration.as_secs_f64(),
            })
        })
        .collect();
    let mut v = vm_json(&r.id, &r.record);
    v["disks"] = Value::Array(disks);
    if let Some(m) = &r.memory {
        v["memory_state"] = json!({
            "image": m.version.image,
            "seq": m.version.record.seq,
            "id": m.version.id.to_hex(),
            "ram_bytes": m.ram_bytes,
            "stream_bytes": m.stream_bytes,
            "data_bytes": m.data_pages * m.page_size as u64,
            "new_chunk_bytes": m.version.record.stats.new_chunk_bytes,
            "stored_bytes": m.version.record.stats.stored_bytes,
            "downtime_s": m.downtime.as_secs_f64(),
            "copy_s": m.copy.as_secs_f64(),
            "duration_s": m.version.duration.as_secs_f64(),
        });
    }
    v["paused_s"] = json!(r.paused_for.as_secs_f64());
    v["point_in_time_s"] = json!(r.point_in_time.as_secs_f64());
    v["duration_s"] = json!(r.total.as_secs_f64());
    v
}

fn print_backup(r: &BackupReport) {
    outln!(
        "{}@{} {}: {} disk(s), {}; point in time in {:.1} ms, guest paused {:.1} ms; {:.1} s in all",
        r.record.vm,
        r.record.seq,
        r.id.short(),
        r.disks.len(),
        freeze_text(r.record.freeze),
        r.point_in_time.as_secs_f64() * 1e3,
        r.paused_for.as_secs_f64() * 1e3,
        r.total.as_secs_f64()
    );
    for d in &r.disks {
        let how = match &d.full_because {
            None => format!("incremental: {} dirty", bytes(d.dirty_bytes)),
            Some(_) => "full".to_string(),
        };
        outln!(
            "  {}@{}  {}, read {}, new {}, stored {} in {:.1} s",
            d.image,
            d.record.seq,
            how,
            bytes(d.read_bytes),
            bytes(d.record.stats.new_chunk_bytes),
            bytes(d.record.stats.stored_bytes),
            d.duration.as_secs_f64()
        );
    }
    if let Some(m) = &r.memory {
        outln!(
            "  {}@{}  memory {} RAM ({} in pages with data), stream {}, new {}, stored {}; \
             copied in {:.1} s, last pass {:.0} ms",
            m.version.image,
            m.version.record.seq,
            bytes(m.ram_bytes),
            bytes(m.data_pages * m.page_size as u64),
            bytes(m.stream_bytes),
            bytes(m.version.record.stats.new_chunk_bytes),
            bytes(m.version.record.stats.stored_bytes),
            m.copy.as_secs_f64(),
            m.downtime.as_secs_f64() * 1e3
        );
    }
}

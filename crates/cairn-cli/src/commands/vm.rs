//! `cairn vm`: whole-VM backups (over QMP) and the VM versions they publish.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use cairn_engine::vm::{prune_vm, remove_vm_versions, resolve_vm, vm_history, VmSpec};
use cairn_format::vm::{ConfigKind, Freeze, VmVersion};
use cairn_format::Id;
use cairn_repo::SessionKind;
use cairn_vm::backup::{backup, backup_all, BackupOptions, BackupReport, Target};
use cairn_vm::VmError;
use serde_json::{json, Value};

use crate::cli::{VmAction, VmArgs, VmBackupArgs, VmDiskFormat, VmPruneArgs};
use crate::context::Context;
use crate::output::{bytes, print_json, time};

pub async fn run(ctx: &Context, args: VmArgs) -> Result<ExitCode> {
    match args.action {
        VmAction::Backup(args) => run_backup(ctx, args).await,
        VmAction::Log { vm } => log(ctx, &vm).await,
        VmAction::Show { spec, config } => show(ctx, &spec, config).await,
        VmAction::List => list(ctx).await,
        VmAction::Rm { versions, no_gc } => rm(ctx, &versions, no_gc).await,
        VmAction::Prune(args) => prune(ctx, args).await,
        VmAction::Diff { a, b } => diff(ctx, &a, &b).await,
        VmAction::Tag { spec, name, delete } => tag(ctx, &spec, &name, delete).await,
        VmAction::Start {
            spec,
            socket,
            no_memory,
        } => start(ctx, &spec, socket, no_memory).await,
        VmAction::Commit { vm, qmp, message } => commit(ctx, &vm, qmp.as_deref(), &message).await,
        VmAction::Restore {
            spec,
            to,
            format,
            force,
            no_memory,
            define,
            connect,
        } => {
            let libvirt = (define, connect);
            restore(ctx, &spec, &to, format, force, no_memory, libvirt).await
        }
    }
}

/// A VM error as the CLI reports it: repository and engine errors keep their own kinds.
fn unwrap(e: VmError) -> anyhow::Error {
    match e {
        VmError::Engine(e) => e.into(),
        VmError::Repo(e) => e.into(),
        other => other.into(),
    }
}

async fn run_backup(ctx: &Context, args: VmBackupArgs) -> Result<ExitCode> {
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

fn freeze_text(f: Freeze) -> &'static str {
    match f {
        Freeze::NotTried => "not frozen (no guest agent)",
        Freeze::Frozen => "frozen by the guest agent",
        Freeze::NoAnswer => "not frozen (the guest agent did not answer)",
    }
}

fn freeze_code(f: Freeze) -> &'static str {
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

fn vm_json(id: &Id, v: &VmVersion) -> Value {
    json!({
        "vm": v.vm,
        "seq": v.seq,
        "id": id.to_hex(),
        "parent": v.parent.map(|p| p.to_hex()),
        "time": time(v.time_ns),
        "time_ns": v.time_ns,
        "message": v.message,
        "freeze": freeze_code(v.freeze),
        "freeze_s": v.freeze_ns as f64 / 1e9,
        "memory": v.memory.map(|m| m.to_hex()),
        "disks": v.disks.iter().map(|d| json!({
            "disk": d.name,
            "image": VmVersion::disk_image(&v.vm, &d.name),
            "seq": d.seq,
            "id": d.version.to_hex(),
            "node": d.node,
            "checkpoint": d.checkpoint,
        })).collect::<Vec<_>>(),
    })
}

async fn log(ctx: &Context, vm: &str) -> Result<ExitCode> {
    cairn_format::name::validate_image_name(vm)
        .map_err(|e| anyhow::anyhow!(cairn_engine::EngineError::from(e)))?;
    let repo = ctx.open().await?;
    let versions = vm_history(&repo, vm).await?;
    let tags = repo.vm_tags(vm).await?;
    let tags_of = |id: &Id| -> Vec<String> {
        tags.iter()
            .filter(|(_, t)| t == id)
            .map(|(n, _)| n.clone())
            .collect()
    };
    if ctx.json {
        print_json(&Value::Array(
            versions
                .iter()
                .map(|(id, v)| {
                    let mut j = vm_json(id, v);
                    j["tags"] = json!(tags_of(id));
                    j
                })
                .collect(),
        ));
        return Ok(ExitCode::SUCCESS);
    }
    for (id, v) in &versions {
        let disks: Vec<String> = v
            .disks
            .iter()
            .map(|d| format!("{}@{}", d.name, d.seq))
            .collect();
        let names = tags_of(id);
        let tag_text = match names.is_empty() {
            true => String::new(),
            false => format!("({}) ", names.join(", ")),
        };
        outln!(
            "{}@{:<4} {}  {}  {}  [{}]  {tag_text}{}",
            v.vm,
            v.seq,
            id.short(),
            time(v.time_ns),
            freeze_code(v.freeze),
            disks.join(" "),
            v.message
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn show(ctx: &Context, spec: &str, config: bool) -> Result<ExitCode> {
    let spec = VmSpec::parse(spec)?;
    let repo = ctx.open().await?;
    let (id, v) = resolve_vm(&repo, &spec).await?;
    if ctx.json {
        let mut out = vm_json(&id, &v);
        out["config_kind"] = json!(match v.config_kind {
            ConfigKind::None => "none",
            ConfigKind::LibvirtXml => "libvirt_xml",
            ConfigKind::QemuArgs => "qemu_args",
        });
        out["config"] = json!(v.config);
        print_json(&out);
        return Ok(ExitCode::SUCCESS);
    }
    outln!("VM version {}@{} ({})", v.vm, v.seq, id);
    outln!("  time     {}", time(v.time_ns));
    outln!(
        "  freeze   {}{}",
        freeze_text(v.freeze),
        match v.freeze {
            Freeze::Frozen => format!(", {:.1} ms", v.freeze_ns as f64 / 1e6),
            _ => String::new(),
        }
    );
    if !v.message.is_empty() {
        outln!("  message  {}", v.message);
    }
    if let Some(memory) = v.memory {
        match repo.load_version(&memory).await {
            Ok(r) => outln!(
                "  memory   {}@{}  ({}, {}: `cairn vm restore` resumes the guest)",
                r.image,
                r.seq,
                memory.short(),
                bytes(r.logical_size)
            ),
            Err(e) => outln!(
                "  memory   {} (its record cannot be read: {e})",
                memory.short()
            ),
        }
    }
    for d in &v.disks {
        outln!(
            "  disk     {}  {}@{}  ({}, node {}, checkpoint {})",
            d.name,
            VmVersion::disk_image(&v.vm, &d.name),
            d.seq,
            d.version.short(),
            d.node,
            if d.checkpoint.is_empty() {
                "none"
            } else {
                &d.checkpoint
            }
        );
    }
    match (config, v.config_kind) {
        (_, ConfigKind::None) => outln!("  config   none recorded"),
        (false, _) => outln!("  config   recorded (--config prints it)"),
        (true, _) => {
            outln!("  config:");
            for line in v.config.lines() {
                outln!("    {line}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn list(ctx: &Context) -> Result<ExitCode> {
    let repo = ctx.open().await?;
    let vms = repo.vms().await?;
    if ctx.json {
        print_json(&json!(vms));
    } else {
        for vm in vms {
            outln!("{vm}");
        }
    }
    Ok(ExitCode::SUCCESS)
}

async fn rm(ctx: &Context, versions: &[String], no_gc: bool) -> Result<ExitCode> {
    let specs = versions
        .iter()
        .map(|v| VmSpec::parse(v))
        .collect::<Result<Vec<_>, _>>()?;
    let repo = ctx.open_as(SessionKind::Edit).await?;
    let removed = remove_vm_versions(&repo, &specs).await?;
    let freed = match no_gc {
        true => None,
        false => crate::commands::gc::free_deleted(ctx, &repo).await,
    };
    if ctx.json {
        print_json(&json!({
            "versions": removed.iter().map(|r| {
                let mut v = vm_json(&r.id, &r.record);
                v["removed_disks"] = json!(r.disks.iter().map(|(id, d)| json!({
                    "image": d.image, "seq": d.seq, "id": id.to_hex(),
                })).collect::<Vec<_>>());
                v
            }).collect::<Vec<_>>(),
            "gc": freed.as_ref().map(crate::commands::gc::report_json),
        }));
        return Ok(ExitCode::SUCCESS);
    }
    for r in &removed {
        let disks: Vec<String> = r
            .disks
            .iter()
            .map(|(_, d)| format!("{}@{}", d.image, d.seq))
            .collect();
        outln!(
            "removed {}@{} {}  {}  disks: {}",
            r.record.vm,
            r.record.seq,
            r.id.short(),
            time(r.record.time_ns),
            match disks.is_empty() {
                true => "none (others still bind them)".to_string(),
                false => disks.join(" "),
            }
        );
    }
    match &freed {
        Some(r) => outln!("{}", crate::commands::gc::report_line(r)),
        None => outln!("{}", crate::commands::rm::GC_HINT),
    }
    Ok(ExitCode::SUCCESS)
}

async fn restore(
    ctx: &Context,
    spec: &str,
    dir: &std::path::Path,
    format: VmDiskFormat,
    force: bool,
    no_memory: bool,
    (define, connect): (Option<String>, Option<String>),
) -> Result<ExitCode> {
    use cairn_engine::restore::{restore, RestoreOptions, RestoreTarget};
    use cairn_vm::config::{qemu_args_on, shell_line, with_incoming, RestoredDisk};
    let spec = VmSpec::parse(spec)?;
    let repo = ctx.open_as(SessionKind::Restore).await?;
    let (id, v) = resolve_vm(&repo, &spec).await?;
    std::fs::create_dir_all(dir)
        .map_err(|e| anyhow::anyhow!("cannot create {}: {e}", dir.display()))?;
    let ext = match format {
        VmDiskFormat::Raw => "raw",
        VmDiskFormat::Qcow2 => "qcow2",
    };
    let started = std::time::Instant::now();
    let mut restored = Vec::new();
    let mut reports = Vec::new();
    for d in &v.disks {
        let record = repo.load_version(&d.version).await?;
        let path = dir.join(format!("{}.{ext}", d.name));
        let target = match format {
            VmDiskFormat::Raw => RestoreTarget::Path(path.clone()),
            VmDiskFormat::Qcow2 => RestoreTarget::Qcow2(path.clone()),
        };
        let options = RestoreOptions {
            force,
            ..Default::default()
        };
        let stats = restore(repo.clone(), &record, target, options).await?;
        reports.push(json!({
            "disk": d.name,
            "image": record.image,
            "seq": record.seq,
            "output": path.display().to_string(),
            "format": ext,
            "logical_bytes": stats.logical_bytes,
            "data_bytes": stats.data_bytes,
            "fetched_bytes": stats.fetched_bytes,
        }));
        restored.push(RestoredDisk {
            name: d.name.clone(),
            path,
            format: ext.to_string(),
        });
    }
    let state = match (v.memory, no_memory) {
        (Some(memory), false) => {
            Some(restore_memory(&repo, &memory, &dir.join("memory.state"), force).await?)
        }
        _ => None,
    };
    let (args, mut notes) = match v.config_kind {
        ConfigKind::QemuArgs => qemu_args_on(&v.config, &restored),
        ConfigKind::LibvirtXml => (Vec::new(), Vec::new()),
        ConfigKind::None => (
            Vec::new(),
            vec!["no QEMU command line was recorded: attach the disks by hand".to_string()],
        ),
    };
    let args = match args.is_empty() {
        true => args,
        false => with_incoming(args, state.as_ref().map(|(p, _)| p.as_path())),
    };
    let domain = match v.config_kind {
        ConfigKind::LibvirtXml => {
            let name = define
                .clone()
                .unwrap_or_else(|| format!("{}-restored", v.vm));
            let (xml, more) = cairn_vm::config::domain_xml_on(&v.config, &name, &restored)
                .map_err(|e| anyhow::anyhow!("the recorded domain XML: {e}"))?;
            notes.extend(more);
            let path = dir.join("domain.xml");
            std::fs::write(&path, xml)
                .map_err(|e| anyhow::anyhow!("cannot write {}: {e}", path.display()))?;
            if let Some(name) = &define {
                cairn_vm::libvirt::define(connect.clone(), name, &path)
                    .await
                    .map_err(unwrap)?;
            }
            Some((name, path))
        }
        _ if define.is_some() => {
            return Err(cairn_engine::EngineError::BadInput(format!(
                "--define: {}@{} was not backed up through libvirt (no domain XML recorded)",
                v.vm, v.seq
            ))
            .into())
        }
        _ => None,
    };

    if let (Some((path, _)), true) = (&state, args.is_empty()) {
        notes.push(format!(
            "start QEMU as the VM was, with `-incoming 'exec:cat {}'`",
            path.display()
        ));
    }
    for note in &notes {
        ctx.warn(note);
    }
    if ctx.json {
        print_json(&json!({
            "vm": v.vm,
            "seq": v.seq,
            "id": id.to_hex(),
            "disks": reports,
            "memory_state": state.as_ref().map(|(p, n)| json!({
                "output": p.display().to_string(),
                "stream_bytes": n,
            })),
            "qemu_args": args,
            "domain": domain.as_ref().map(|(n, p)| json!({
                "name": n,
                "xml": p.display().to_string(),
                "defined": define.is_some(),
            })),
            "notes": notes,
            "duration_s": started.elapsed().as_secs_f64(),
        }));
        return Ok(ExitCode::SUCCESS);
    }
    for (r, d) in reports.iter().zip(&restored) {
        outln!(
            "{}@{} -> {} ({})",
            r["image"].as_str().unwrap_or(""),
            r["seq"],
            d.path.display(),
            bytes(r["logical_bytes"].as_u64().unwrap_or(0))
        );
    }
    if let Some((path, n)) = &state {
        outln!(
            "memory state -> {} ({}): the guest resumes where it was",
            path.display(),
            bytes(*n)
        );
    }
    match (&domain, define.is_some()) {
        (Some((name, _)), true) => outln!("defined libvirt domain {name} (`virsh start {name}`)"),
        (Some((name, path)), false) => outln!(
            "domain XML for {name}: {} (`virsh define` it, or restore with --define NAME)",
            path.display()
        ),
        (None, _) => {}
    }
    if !args.is_empty() {
        outln!("run it with:");
        outln!("{}", shell_line(&args));
    }
    Ok(ExitCode::SUCCESS)
}

/// Writes the memory state `memory` names to `path` as QEMU's migration stream (its image is
/// restored beside it first, holes and all, and removed after); the path and length.
async fn restore_memory(
    repo: &std::sync::Arc<cairn_repo::Repo>,
    memory: &Id,
    path: &std::path::Path,
    force: bool,
) -> Result<(std::path::PathBuf, u64)> {
    use cairn_engine::restore::{restore, RestoreOptions, RestoreTarget};
    let path = path.to_path_buf();
    if path.exists() && !force {
        return Err(cairn_engine::EngineError::Exists(format!(
            "{} exists (--force replaces it)",
            path.display()
        ))
        .into());
    }
    let record = repo.load_version(memory).await?;
    let image = path.with_extension("image.part");
    let _ = std::fs::remove_file(&image);
    restore(
        repo.clone(),
        &record,
        RestoreTarget::Path(image.clone()),
        RestoreOptions::default(),
    )
    .await?;
    let (from, to) = (image.clone(), path.clone());
    let written = tokio::task::spawn_blocking(move || {
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::File::open(&from)?;
        let part = to.with_extension("state.part");
        let out = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&part)?;
        let n = cairn_vm::migration::emit(&file, &out)
            .map_err(|e| std::io::Error::other(format!("{}: {e}", record.image)))?;
        out.sync_all()?;
        std::fs::rename(&part, &to)?;
        Ok::<u64, std::io::Error>(n)
    })
    .await?;
    let _ = std::fs::remove_file(&image);
    let n = written.map_err(|e| anyhow::anyhow!("memory state {}: {e}", path.display()))?;
    Ok((path, n))
}

async fn prune(ctx: &Context, args: VmPruneArgs) -> Result<ExitCode> {
    let policy = args.keep.policy();
    if policy.is_empty() {
        return Err(cairn_engine::EngineError::BadInput(
            "refusing to remove every VM version: give at least one --keep-* option".into(),
        )
        .into());
    }
    let repo = ctx.open_as(SessionKind::Edit).await?;
    let vms = match &args.vm {
        Some(vm) => vec![vm.clone()],
        None => repo.vms().await?,
    };
    let (mut rows, mut removed) = (Vec::new(), 0usize);
    for vm in &vms {
        for (d, time_ns) in prune_vm(&repo, vm, &policy, args.dry_run).await? {
            removed += usize::from(!d.keep);
            if ctx.json {
                rows.push(json!({
                    "vm": vm, "seq": d.seq, "id": d.id.to_hex(), "time": time(time_ns),
                    "keep": d.keep, "reasons": d.reasons,
                }));
            } else {
                outln!(
                    "{:<6} {vm}@{:<4} {}  {}  {}",
                    if d.keep { "keep" } else { "remove" },
                    d.seq,
                    d.id.short(),
                    time(time_ns),
                    d.reasons.join(", ")
                );
            }
        }
    }
    let freed = match args.dry_run || args.no_gc || removed == 0 {
        true => None,
        false => crate::commands::gc::free_deleted(ctx, &repo).await,
    };
    if ctx.json {
        print_json(&json!({
            "versions": rows,
            "gc": freed.as_ref().map(crate::commands::gc::report_json),
        }));
    } else if let Some(r) = &freed {
        outln!("{}", crate::commands::gc::report_line(r));
    } else if args.dry_run {
        outln!("dry run: nothing was changed");
    }
    Ok(ExitCode::SUCCESS)
}

async fn diff(ctx: &Context, a: &str, b: &str) -> Result<ExitCode> {
    let (sa, sb) = (VmSpec::parse(a)?, VmSpec::parse(b)?);
    let repo = ctx.open().await?;
    let (ida, va) = resolve_vm(&repo, &sa).await?;
    let (idb, vb) = resolve_vm(&repo, &sb).await?;
    let mut disks = Vec::new();
    for d in &vb.disks {
        let rb = repo.load_version(&d.version).await?;
        match va.disks.iter().find(|x| x.name == d.name) {
            None => disks.push(json!({"disk": d.name, "status": "added",
                                      "b_seq": d.seq, "b_size_bytes": rb.logical_size})),
            Some(old) => {
                let ra = repo.load_version(&old.version).await?;
                let r = cairn_engine::diff::diff(&repo, &ra, &rb).await?;
                disks.push(json!({
                    "disk": d.name,
                    "status": if r.changed_bytes == 0 && ra.logical_size == rb.logical_size {
                        "same"
                    } else {
                        "changed"
                    },
                    "a_seq": old.seq, "b_seq": d.seq,
                    "changed_bytes": r.changed_bytes,
                    "ranges": r.ranges.len(),
                    "a_size_bytes": ra.logical_size, "b_size_bytes": rb.logical_size,
                }));
            }
        }
    }
    for d in va
        .disks
        .iter()
        .filter(|x| !vb.disks.iter().any(|y| y.name == x.name))
    {
        disks.push(json!({"disk": d.name, "status": "removed", "a_seq": d.seq}));
    }
    let config_changed = va.config != vb.config;
    if ctx.json {
        print_json(&json!({
            "a": {"vm": va.vm, "seq": va.seq, "id": ida.to_hex()},
            "b": {"vm": vb.vm, "seq": vb.seq, "id": idb.to_hex()},
            "disks": disks,
            "config_changed": config_changed,
        }));
        return Ok(ExitCode::SUCCESS);
    }
    outln!("{}@{} -> {}@{}", va.vm, va.seq, vb.vm, vb.seq);
    for d in &disks {
        let name = d["disk"].as_str().unwrap_or("");
        match d["status"].as_str() {
            Some("added") => outln!("  {name}: added"),
            Some("removed") => outln!("  {name}: removed"),
            Some("same") => outln!("  {name}: unchanged (@{} -> @{})", d["a_seq"], d["b_seq"]),
            _ => outln!(
                "  {name}: {} changed in {} range(s) (@{} -> @{})",
                bytes(d["changed_bytes"].as_u64().unwrap_or(0)),
                d["ranges"],
                d["a_seq"],
                d["b_seq"]
            ),
        }
    }
    if config_changed {
        outln!("  config: changed (`cairn vm show --config` shows each)");
    }
    Ok(ExitCode::SUCCESS)
}

async fn tag(ctx: &Context, spec: &str, name: &str, delete: bool) -> Result<ExitCode> {
    let spec = VmSpec::parse(spec)?;
    let repo = ctx.open_as(SessionKind::Edit).await?;
    if delete {
        if spec.is_pinned() {
            return Err(cairn_engine::EngineError::BadInput(format!(
                "--delete takes the VM and the tag name (`cairn vm tag --delete {} {name}`), \
                 not {spec}",
                spec.vm
            ))
            .into());
        }
        repo.delete_vm_tag(&spec.vm, name).await?;
        if ctx.json {
            print_json(&json!({"vm": spec.vm, "tag": name, "deleted": true}));
        } else {
            outln!("deleted tag {name} of VM {}", spec.vm);
        }
        return Ok(ExitCode::SUCCESS);
    }
    let (id, v) = resolve_vm(&repo, &spec).await?;
    repo.create_vm_tag(&v.vm, name, &id).await?;
    if ctx.json {
        let mut j = vm_json(&id, &v);
        j["tag"] = json!(name);
        print_json(&j);
    } else {
        outln!("tagged {}@{} ({}) as {name}", v.vm, v.seq, id.short());
    }
    Ok(ExitCode::SUCCESS)
}

/// `cairn export`'s flags, parsed on their own: `vm start` serves its disks through the same
/// command, with every default it has.
#[derive(clap::Parser)]
struct ExportOnly {
    #[command(flatten)]
    args: crate::cli::ExportArgs,
}

async fn start(
    ctx: &Context,
    spec: &str,
    socket: Option<std::path::PathBuf>,
    no_memory: bool,
) -> Result<ExitCode> {
    use clap::Parser;
    let spec = VmSpec::parse(spec)?;
    let (v, socket, state) = {
        let repo = ctx.open().await?;
        let (_, v) = resolve_vm(&repo, &spec).await?;
        let socket = match socket {
            Some(s) => s,
            None => {
                let run = cairn_export::lifecycle::run_dir();
                cairn_export::lifecycle::ensure_private_dir(&run)?;
                run.join(format!(
                    "vm-{}.sock",
                    cairn_export::lifecycle::file_key(&v.vm)
                ))
            }
        };
        let state = match (v.memory, no_memory) {
            (Some(memory), false) => {
                let root = crate::commands::exports::overlay_root();
                cairn_export::lifecycle::ensure_private_dir(&root)?;
                let path = root.join(format!(
                    "vm-{}.memory.state",
                    cairn_export::lifecycle::file_key(&v.vm)
                ));
                Some(restore_memory(&repo, &memory, &path, true).await?)
            }
            _ => None,
        };
        (v, socket, state)
    };
    let (specs, args, notes) = cairn_vm::instant::start_plan(&v, &socket);
    let args = match args.is_empty() {
        true => args,
        false => cairn_vm::config::with_incoming(args, state.as_ref().map(|(p, _)| p.as_path())),
    };
    for note in &notes {
        ctx.warn(note);
    }
    if ctx.json {
        print_json(&json!({
            "vm": v.vm, "seq": v.seq, "socket": socket.display().to_string(),
            "exports": specs, "qemu_args": args,
            "memory_state": state.as_ref().map(|(p, _)| p.display().to_string()),
        }));
    } else if !args.is_empty() {
        outln!(
            "serving {}@{} on {}; run the VM with:",
            v.vm,
            v.seq,
            socket.display()
        );
        outln!("{}", cairn_vm::config::shell_line(&args));
    }
    let mut argv: Vec<String> = vec!["cairn vm start".into()];
    argv.extend(specs);
    argv.extend([
        "--writable".to_string(),
        "--socket".to_string(),
        socket.display().to_string(),
    ]);
    let export = ExportOnly::try_parse_from(argv)?;
    crate::commands::export::run(ctx, export.args).await
}

async fn commit(
    ctx: &Context,
    vm: &str,
    qmp: Option<&std::path::Path>,
    message: &str,
) -> Result<ExitCode> {
    cairn_format::name::validate_image_name(vm)
        .map_err(|e| anyhow::anyhow!(cairn_engine::EngineError::from(e)))?;
    if qmp.is_none() {
        ctx.warn(
            "no --qmp: the disks are committed one after another while the guest runs, so \
             they may not be one point in time",
        );
    }
    let repo = ctx.open_as(SessionKind::Commit).await?;
    let done = cairn_vm::instant::commit_running(&repo, vm, qmp, message)
        .await
        .map_err(unwrap)?;
    if ctx.json {
        let mut v = vm_json(&done.id, &done.record);
        v["paused_s"] = json!(done.paused_for.as_secs_f64());
        v["commits"] = json!(done.disks);
        print_json(&v);
    } else {
        outln!(
            "{}@{} {}: {} disk(s) committed{}",
            done.record.vm,
            done.record.seq,
            done.id.short(),
            done.disks.len(),
            match qmp {
                Some(_) => format!(", VM paused {:.1} ms", done.paused_for.as_secs_f64() * 1e3),
                None => String::new(),
            }
        );
        for c in &done.disks {
            outln!(
                "  {}@{}  new {}, stored {}",
                c["image"].as_str().unwrap_or(""),
                c["seq"],
                bytes(c["new_chunk_bytes"].as_u64().unwrap_or(0)),
                bytes(c["stored_bytes"].as_u64().unwrap_or(0))
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

//! `cairn vm restore`: every disk of a VM version written out, its memory state beside
//! them, and the VM defined again (libvirt) or its QEMU command line printed.

use std::process::ExitCode;

use anyhow::Result;
use cairn_engine::vm::{resolve_vm, VmSpec};
use cairn_format::vm::ConfigKind;
use cairn_format::Id;
use cairn_repo::SessionKind;
use serde_json::json;

use super::unwrap;
use crate::cli::VmDiskFormat;
use crate::context::Context;
use crate::output::{bytes, print_json};

pub(super) async fn restore(
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
pub(super) async fn restore_memory(
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

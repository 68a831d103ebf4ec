//! A VM's history: `vm log`, `show`, `list`, `rm`, `prune`, `diff` and `tag`.

use std::process::ExitCode;

use anyhow::Result;
use cairn_engine::vm::{prune_vm, remove_vm_versions, resolve_vm, vm_history, VmSpec};
use cairn_format::vm::{ConfigKind, Freeze, VmVersion};
use cairn_format::Id;
use cairn_repo::SessionKind;
use serde_json::{json, Value};

use super::backup::{freeze_code, freeze_text};
use crate::cli::VmPruneArgs;
use crate::context::Context;
use crate::output::{bytes, print_json, time};

pub(super) fn vm_json(id: &Id, v: &VmVersion) -> Value {
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

pub(super) async fn log(ctx: &Context, vm: &str) -> Result<ExitCode> {
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

pub(super) async fn show(ctx: &Context, spec: &str, config: bool) -> Result<ExitCode> {
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

pub(super) async fn list(ctx: &Context) -> Result<ExitCode> {
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

pub(super) async fn rm(ctx: &Context, versions: &[String], no_gc: bool) -> Result<ExitCode> {
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

pub(super) async fn prune(ctx: &Context, args: VmPruneArgs) -> Result<ExitCode> {
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

pub(super) async fn diff(ctx: &Context, a: &str, b: &str) -> Result<ExitCode> {
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

pub(super) async fn tag(ctx: &Context, spec: &str, name: &str, delete: bool) -> Result<ExitCode> {
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

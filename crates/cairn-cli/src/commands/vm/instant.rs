//! Instant recovery: `cairn vm start` serves a VM version's disks from lazy exports, and
//! `cairn vm commit` records what the VM wrote to them as a new VM version.

use std::process::ExitCode;

use anyhow::Result;
use cairn_engine::vm::{resolve_vm, VmSpec};
use cairn_repo::SessionKind;
use serde_json::json;

use super::history::vm_json;
use super::restore::restore_memory;
use super::unwrap;
use crate::context::Context;
use crate::output::{bytes, print_json};

/// `cairn export`'s flags, parsed on their own: `vm start` serves its disks through the same
/// command, with every default it has.
#[derive(clap::Parser)]
struct ExportOnly {
    #[command(flatten)]
    args: crate::cli::ExportArgs,
}

pub(super) async fn start(
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

pub(super) async fn commit(
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

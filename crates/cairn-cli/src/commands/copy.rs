//! `cairn copy --from SRC [IMAGE[@REF]…]`: versions from another repository into --repo.

use std::process::ExitCode;

use anyhow::{bail, Result};
use cairn_engine::copy::copy;
use cairn_engine::resolve::VersionSpec;
use cairn_repo::SessionKind;
use serde_json::json;

use crate::cli::CopyArgs;
use crate::context::Context;
use crate::output::{bytes, print_json};
use crate::password::{PasswordSource, COPY_SOURCE};
use crate::progress::Ticker;

pub async fn run(ctx: &Context, args: CopyArgs) -> Result<ExitCode> {
    let specs = args
        .specs
        .iter()
        .map(|s| VersionSpec::parse(s))
        .collect::<Result<Vec<_>, _>>()?;
    let password = PasswordSource {
        file: args.from_password_file.clone(),
        command: args.from_password_command.clone(),
        names: &COPY_SOURCE,
    };
    let source = ctx
        .open_other(&args.from, SessionKind::Read, &password)
        .await?;
    let dest = ctx.open_as(SessionKind::Commit).await?;
    if source.config().repo_id == dest.config().repo_id {
        bail!(
            "--from {} is the destination repository itself: nothing to copy",
            args.from
        );
    }
    let (progress, ticker) = Ticker::for_work(ctx.progress);
    let report = copy(source, dest, &specs, progress).await;
    drop(ticker);
    let report = report?;
    // Damaged source versions were skipped and the rest copied: exit 3 names them.
    let status = if report.damaged.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    };
    // The destination numbers an image's versions itself: a version copied without the ones
    // before it (or after some were deleted there) takes another number.
    let renumbered = report
        .copied
        .iter()
        .filter(|c| c.seq != c.source_seq)
        .count();
    if ctx.json {
        print_json(&json!({
            "copied": report.copied.iter().map(|c| json!({
                "image": c.image,
                "source_seq": c.source_seq,
                "source_id": c.source.to_hex(),
                "seq": c.seq,
                "id": c.id.to_hex(),
            })).collect::<Vec<_>>(),
            "renumbered": renumbered,
            "present": report.present,
            "tags_created": report.tags_created,
            "tags_conflicting": report.tags_conflicting,
            "profiles_copied": report.profiles_copied,
            "read_bytes": report.read_bytes,
            "stored_bytes": report.stored_bytes,
            "damaged": report.damaged.iter().map(|(image, seq, id, why)| json!({
                "image": image,
                "seq": seq,
                "id": id.to_hex(),
                "reason": why,
            })).collect::<Vec<_>>(),
            "vm_versions": {
                "copied": report.vms.copied.iter().map(|(vm, from, to)| json!({
                    "vm": vm,
                    "source_seq": from,
                    "seq": to,
                })).collect::<Vec<_>>(),
                "present": report.vms.present,
                "not_copied": report.vms.incomplete.iter().map(|(vm, seq, why)| json!({
                    "vm": vm,
                    "seq": seq,
                    "reason": why,
                })).collect::<Vec<_>>(),
            },
        }));
        return Ok(status);
    }
    for c in &report.copied {
        outln!(
            "copied {}@{} to {}@{} {}",
            c.image,
            c.source_seq,
            c.image,
            c.seq,
            c.id.short()
        );
    }
    if renumbered > 0 {
        outln!(
            "{renumbered} version(s) numbered differently here (the destination numbers each \
             image's versions in order; times, messages and tags are kept)"
        );
    }
    for tag in &report.tags_conflicting {
        ctx.note(&format!(
            "tag {tag} exists in the destination for another version: left as it is"
        ));
    }
    outln!(
        "{} version(s) copied, {} already there, {} tag(s) created; read {}, stored {}",
        report.copied.len(),
        report.present,
        report.tags_created,
        bytes(report.read_bytes),
        bytes(report.stored_bytes)
    );
    if report.profiles_copied > 0 {
        outln!("{} boot profile(s) copied", report.profiles_copied);
    }
    for (vm, from, to) in &report.vms.copied {
        outln!("copied VM {vm}@{from} to {vm}@{to}");
    }
    if !report.vms.copied.is_empty() || report.vms.present > 0 {
        outln!(
            "{} VM version(s) copied, {} already there",
            report.vms.copied.len(),
            report.vms.present
        );
    }
    for (vm, seq, why) in &report.vms.incomplete {
        outln!("VM {vm}@{seq} and the ones after it not copied: {why}");
    }
    for (image, seq, id, why) in &report.damaged {
        outln!(
            "not copied: {image}@{seq} ({}) cannot be read: {why}",
            id.short()
        );
    }
    if !report.damaged.is_empty() {
        outln!(
            "{} damaged version(s) not copied (see `cairn verify` in the source); the rest was",
            report.damaged.len()
        );
    }
    Ok(status)
}

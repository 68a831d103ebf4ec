//! `cairn verify [IMAGE[@REF]…] [--read-data-subset N%|K/N]`.

use cairn_repo::SessionKind;
use std::process::ExitCode;

use anyhow::{anyhow, Result};
use cairn_engine::resolve::{history, resolve, VersionSpec};
use cairn_engine::verify::{verify_with, PackSubset, VerifyOptions};
use serde_json::json;

use crate::cli::VerifyArgs;
use crate::context::Context;
use crate::output::{bytes, print_json};
use crate::progress::Ticker;

pub async fn run(ctx: &Context, args: VerifyArgs) -> Result<ExitCode> {
    let subset = match &args.read_data_subset {
        Some(s) => PackSubset::parse(s).map_err(|e| anyhow!("--read-data-subset {e}"))?,
        None => PackSubset::All,
    };
    let repo = ctx.open_as(SessionKind::Verify).await?;
    let mut versions = Vec::new();
    for target in &args.targets {
        let spec = VersionSpec::parse(target)?;
        if spec.reference.is_some() {
            versions.push(resolve(&repo, &spec).await?);
        } else {
            versions.extend(history(&repo, &spec.image).await?);
        }
    }
    let (progress, ticker) = Ticker::for_work(ctx.progress);
    let report = verify_with(
        repo,
        &VerifyOptions {
            versions,
            subset,
            progress,
        },
    )
    .await;
    drop(ticker);
    let report = report?;
    if ctx.json {
        print_json(&json!({
            "clean": report.is_clean(),
            "packs_in_scope": report.packs_in_scope,
            "packs_checked": report.packs_checked,
            "blobs_checked": report.blobs_checked,
            "read_bytes": report.read_bytes,
            "versions_checked": report.versions_checked,
            "vm_versions_checked": report.vm_versions_checked,
            "problems": report.problems,
            "damaged_versions": report.damaged_versions.iter().map(|d| json!({
                "image": d.image,
                "seq": d.seq,
                "id": d.id.to_hex(),
                "reason": d.reason,
            })).collect::<Vec<_>>(),
            "damaged_metadata": report.damaged_metadata.iter().map(|d| json!({
                "key": d.key,
                "problem": d.problem,
            })).collect::<Vec<_>>(),
            "quarantined": report.quarantined,
            "packs_with_quarantined_copies": report.packs_with_quarantined,
            "notes": report.notes,
            "unindexed_packs": report.unindexed_packs.iter().map(|p| p.to_hex()).collect::<Vec<_>>(),
            "rescuable_packs": report.rescuable_packs.iter().map(|p| p.to_hex()).collect::<Vec<_>>(),
        }));
    } else {
        let subset = if report.packs_checked < report.packs_in_scope {
            format!(" of {} in scope", report.packs_in_scope)
        } else {
            String::new()
        };
        outln!(
            "checked {} packs{subset} ({}), {} blobs, {} versions{}",
            report.packs_checked,
            bytes(report.read_bytes),
            report.blobs_checked,
            report.versions_checked,
            match report.vm_versions_checked {
                0 => String::new(),
                n => format!(", {n} VM versions"),
            }
        );
        for p in &report.problems {
            outln!("problem: {p}");
        }
        for d in &report.damaged_metadata {
            outln!("damaged metadata: {d}");
        }
        for d in &report.damaged_versions {
            outln!(
                "damaged: {}@{} ({}): {}",
                d.image,
                d.seq,
                d.id.short(),
                d.reason
            );
        }
        if report.packs_with_quarantined > 0 {
            outln!(
                "{} packs hold copies quarantined earlier (not used; `cairn gc --repair` \
                 rewrites them)",
                report.packs_with_quarantined
            );
        }
        for n in &report.notes {
            outln!("note: {n}");
        }
        if !report.unindexed_packs.is_empty() {
            outln!(
                "{} packs are named by no index run (left by killed commits, or their index \
                 run was lost): `cairn repair` indexes them again, `cairn gc` deletes those no \
                 version needs",
                report.unindexed_packs.len()
            );
        }
        if report.is_clean() {
            outln!("no problems found");
        } else {
            outln!(
                "{} problems, {} damaged versions, {} damaged metadata objects{}",
                report.problems.len(),
                report.damaged_versions.len(),
                report.damaged_metadata.len(),
                if report.quarantined > 0 {
                    format!(
                        "; {} damaged blob copies quarantined (committing their content again, \
                         or `cairn repair --from IMAGE_FILE`, heals the versions)",
                        report.quarantined
                    )
                } else {
                    String::new()
                }
            );
            if !report.damaged_metadata.is_empty() {
                outln!(
                    "run `cairn repair` to rebuild damaged heads and set unreadable records aside"
                );
            }
        }
    }
    Ok(if report.is_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    })
}

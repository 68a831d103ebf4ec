//! `cairn repair [--from IMAGE_FILE] [--dry-run]`: rebuild what damage left behind and report
//! what stays lost (see `cairn_engine::repair`).

use cairn_repo::SessionKind;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use cairn_engine::repair::{repair, RepairOptions, RepairReport};
use cairn_engine::source::{open_image, ImageSource, ReadPolicy, Source, SourceFormat};
use serde_json::json;

use crate::cli::{RepairArgs, SourceFormatArg};
use crate::context::Context;
use crate::output::{bytes, print_json};

pub async fn run(ctx: &Context, args: RepairArgs) -> Result<ExitCode> {
    let from = args.from.clone().map(|path| {
        let format = match args.format {
            SourceFormatArg::Auto => SourceFormat::Auto,
            SourceFormatArg::Raw => SourceFormat::Raw,
            SourceFormatArg::Qcow2 => SourceFormat::Qcow2,
        };
        Box::new(move || {
            let image = open_image(&path, format, ReadPolicy::default())?;
            Ok(Box::new(ImageSource::new(image)?) as Box<dyn Source>)
        }) as cairn_engine::repair::SourceOpener
    });
    if let (Some(path), Some(open)) = (&args.from, &from) {
        open()
            .map_err(|e| anyhow::anyhow!("{e}"))
            .map_err(|e| e.context(format!("cannot read {}", path.display())))?;
    }
    let repo = ctx.open_as(SessionKind::Repair).await?;
    let report = repair(
        &repo,
        RepairOptions {
            dry_run: args.dry_run,
            from,
        },
    )
    .await?;
    if ctx.json {
        print_json(&report_json(&report));
    } else {
        print_text(&report, args.from.as_ref());
    }
    Ok(if report.is_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    })
}

fn report_json(r: &RepairReport) -> serde_json::Value {
    json!({
        "dry_run": r.dry_run,
        "clean": r.is_clean(),
        "records_set_aside": r.records_set_aside,
        "heads_rebuilt": r.heads_rebuilt.iter().map(|(image, head)| json!({
            "image": image,
            "head": head,
        })).collect::<Vec<_>>(),
        "vm_heads_rebuilt": r.vm_heads_rebuilt.iter().map(|(vm, head)| json!({
            "vm": vm,
            "head": head,
        })).collect::<Vec<_>>(),
        "tags_lost": r.tags_lost,
        "index_runs_set_aside": r.index_runs_set_aside,
        "packs_checked": r.packs_checked,
        "packs_reindexed": r.packs_reindexed,
        "blobs_reindexed": r.blobs_reindexed,
        "packs_rescued": r.packs_rescued,
        "groups_rescued": r.groups_rescued,
        "blobs_restored": r.blobs_restored,
        "restored_bytes": r.restored_bytes,
        "blobs_lost": r.blobs_lost,
        "lost_versions": r.lost_versions.iter().map(|v| json!({
            "image": v.image,
            "seq": v.seq,
            "id": v.id.to_hex(),
            "missing_blobs": v.missing_blobs,
        })).collect::<Vec<_>>(),
    })
}

fn print_text(r: &RepairReport, from: Option<&PathBuf>) {
    let would = if r.dry_run { "would " } else { "" };
    for s in &r.records_set_aside {
        outln!("{would}set aside version record {s}");
    }
    for (image, head) in &r.heads_rebuilt {
        match head {
            Some(h) => outln!("{would}rebuild the head of {image}: now {h}"),
            None => outln!("{would}remove the head of {image}: no intact version is left"),
        }
    }
    for (vm, head) in &r.vm_heads_rebuilt {
        outln!("{would}rebuild the head of VM {vm}: now {head}");
    }
    for t in &r.tags_lost {
        outln!("{would}set aside the unreadable tag {t}");
    }
    for i in &r.index_runs_set_aside {
        outln!("{would}set aside index file {i}");
    }
    if r.packs_reindexed > 0 {
        outln!(
            "{would}index {} blobs from the trailers of {} packs",
            r.blobs_reindexed,
            r.packs_reindexed
        );
    }
    if r.packs_rescued > 0 {
        outln!(
            "{would}store {} groups of {} damaged packs again (read from their group frames \
             or trailers) and set the damaged packs aside under damaged/; until the next \
             `cairn gc --repair` drops them from the index, commits check what they reuse",
            r.groups_rescued,
            r.packs_rescued
        );
    }
    if let Some(path) = from {
        outln!(
            "stored {} lost blobs ({}) again from {}",
            r.blobs_restored,
            bytes(r.restored_bytes),
            path.display()
        );
    }
    if r.is_clean() {
        outln!("nothing is lost: every live version can be restored intact");
    } else {
        for v in &r.lost_versions {
            outln!(
                "still damaged: {}@{} ({}): {} blobs lost",
                v.image,
                v.seq,
                v.id.short(),
                v.missing_blobs
            );
        }
        outln!(
            "{} blobs are lost, affecting {} versions: commit their content again, or run \
             `cairn repair --from IMAGE_FILE` with a disk that holds it; `cairn restore \
             --allow-damage` restores the rest",
            r.blobs_lost,
            r.lost_versions.len()
        );
    }
}

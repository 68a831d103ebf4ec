//! `cairn relayout IMAGE@V --alpha A [--dry-run]`: store a version's most scattered segments
//! again, contiguously (see `cairn_engine::relayout`).

use std::process::ExitCode;

use anyhow::Result;
use cairn_engine::relayout::relayout;
use cairn_engine::resolve::{resolve, VersionSpec};
use cairn_engine::stats::VersionLayout;
use cairn_repo::SessionKind;
use serde_json::json;

use crate::cli::RelayoutArgs;
use crate::context::Context;
use crate::output::{bytes, print_json};
use crate::progress::Ticker;

pub async fn run(ctx: &Context, args: RelayoutArgs) -> Result<ExitCode> {
    let spec = VersionSpec::parse(&args.spec)?;
    let repo = ctx.open_adding(SessionKind::Repair).await?;
    let (_, record) = resolve(&repo, &spec).await?;
    let (progress, ticker) = Ticker::for_work(ctx.progress);
    let r = relayout(&repo, &record, args.alpha, args.dry_run, progress).await;
    drop(ticker);
    let r = r?;
    let layout = |l: &VersionLayout| {
        json!({
            "reads": l.reads,
            "reads_per_gib": l.reads_per_gib(),
            "packs": l.packs,
            "groups": l.groups,
        })
    };
    if ctx.json {
        print_json(&json!({
            "image": record.image,
            "seq": record.seq,
            "alpha": args.alpha,
            "dry_run": args.dry_run,
            "batches": r.batches,
            "scattered_batches": r.scattered,
            "chosen_batches": r.chosen,
            "groups_copied": r.groups_copied,
            "bytes_copied": r.bytes_copied,
            "packs_written": r.packs_written,
            "before": layout(&r.before),
            "after": layout(&r.after),
        }));
        return Ok(ExitCode::SUCCESS);
    }
    outln!(
        "{}@{}: {} of {} batches of segments are read in more than one request; {} chosen (alpha {})",
        record.image,
        record.seq,
        r.scattered,
        r.batches,
        r.chosen,
        args.alpha
    );
    if args.dry_run {
        outln!(
            "dry run: would copy {} groups ({} stored); nothing written (restore reads now {}, {:.1} per GiB)",
            r.groups_copied,
            bytes(r.bytes_copied),
            r.before.reads,
            r.before.reads_per_gib()
        );
    } else {
        outln!(
            "copied {} groups ({} stored) into {} packs; restore reads {} -> {} ({:.1} -> {:.1} per GiB)",
            r.groups_copied,
            bytes(r.bytes_copied),
            r.packs_written,
            r.before.reads,
            r.after.reads,
            r.before.reads_per_gib(),
            r.after.reads_per_gib()
        );
        if r.bytes_copied > 0 {
            outln!("the old copies stay in their packs until `cairn gc --repair` repacks them");
        }
    }
    Ok(ExitCode::SUCCESS)
}

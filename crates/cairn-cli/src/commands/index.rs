//! `cairn index compact`: merges a format 2 repository's index runs.

use std::process::ExitCode;

use anyhow::Result;
use cairn_engine::gc::compact::{compact, CompactOptions, CompactReport};
use cairn_repo::SessionKind;
use serde_json::{json, Value};

use super::gc::protocol_options;
use crate::cli::{IndexAction, IndexArgs};
use crate::context::Context;
use crate::output::{bytes, print_json};
use crate::progress::Ticker;

pub async fn run(ctx: &Context, args: IndexArgs) -> Result<ExitCode> {
    let IndexAction::Compact(args) = args.action;
    let repo = ctx.open_as(SessionKind::Gc).await?;
    let (progress, ticker) = Ticker::for_work(ctx.progress);
    let options = CompactOptions {
        all: args.all,
        max_tier: None,
        gc: protocol_options(
            ctx,
            args.dry_run,
            args.stale_after,
            args.wait_limit,
            progress,
        ),
    };
    let r = compact(&repo, &options).await;
    drop(ticker);
    let r = r?;
    if ctx.json {
        print_json(&report_json(&r));
    } else {
        outln!("{}", report_line(&r));
    }
    Ok(ExitCode::SUCCESS)
}

fn report_json(r: &CompactReport) -> Value {
    json!({
        "dry_run": r.dry_run,
        "runs_before": r.runs_before,
        "runs_after": r.runs_after,
        "merges": r.merges,
        "runs_merged": r.runs_merged,
        "entries_before": r.entries_before,
        "entries_after": r.entries_after,
        "before_bytes": r.before_bytes,
        "after_bytes": r.after_bytes,
        "read_bytes": r.read_bytes,
        "written_bytes": r.written_bytes,
        "waited_s": r.waited_s,
        "duration_s": r.duration_s,
    })
}

fn report_line(r: &CompactReport) -> String {
    let verb = if r.dry_run { "would merge" } else { "merged" };
    if r.merges == 0 {
        return format!(
            "nothing to merge: {} index run{} ({})",
            r.runs_before,
            if r.runs_before == 1 { "" } else { "s" },
            bytes(r.before_bytes)
        );
    }
    let sizes = if r.dry_run {
        String::new()
    } else {
        format!(
            ", {} -> {}; read {}, wrote {}",
            bytes(r.before_bytes),
            bytes(r.after_bytes),
            bytes(r.read_bytes),
            bytes(r.written_bytes)
        )
    };
    format!(
        "{verb} {} index runs into {} ({} -> {} runs{sizes}) in {:.1} s",
        r.runs_merged, r.merges, r.runs_before, r.runs_after, r.duration_s
    )
}

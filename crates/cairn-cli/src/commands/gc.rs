//! `cairn gc [--repair]`, and the fast deletion that `rm` and `prune` run after deleting.

use cairn_repo::SessionKind;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Result};
use cairn_engine::gc::{gc, GcMode, GcOptions, GcReport, WaitNotice};
use cairn_engine::progress::WorkProgress;
use cairn_repo::Repo;
use serde_json::{json, Value};

use crate::cli::GcArgs;
use crate::context::Context;
use crate::output::{bytes, print_json};
use crate::progress::Ticker;

pub async fn run(ctx: &Context, args: GcArgs) -> Result<ExitCode> {
    if !(0.0..=1.0).contains(&args.repack_threshold) {
        bail!("--repack-threshold must be between 0 and 1");
    }
    let repo = ctx.open_as(SessionKind::Gc).await?;
    let (progress, ticker) = Ticker::for_work(ctx.progress);
    let options = GcOptions {
        mode: if args.repair || args.recompress.is_some() {
            GcMode::Repair
        } else {
            GcMode::Fast
        },
        repack_threshold: args.repack_threshold,
        repack_small: !args.no_repack_small,
        recompress: args.recompress,
        ..protocol_options(
            ctx,
            args.dry_run,
            args.stale_after,
            args.wait_limit,
            progress,
        )
    };
    let r = gc(&repo, &options).await;
    drop(ticker);
    let r = r?;
    if ctx.json {
        print_json(&report_json(&r));
    } else {
        outln!("{}", report_line(&r));
        if r.rescued_blobs > 0 {
            outln!(
                "{} blobs were kept because concurrent commits started using them",
                r.rescued_blobs
            );
        }
        if r.groups_rebuilt > 0 {
            outln!(
                "{} damaged groups were rebuilt from other copies of their chunks",
                r.groups_rebuilt
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Frees the space of the versions just deleted (fast deletion, merging small packs as `gc`
/// does, waiting at most a minute for older sessions). The deletion itself already stands, so a GC that cannot run now is a
/// warning, not a failure: the next `cairn gc` frees the space.
pub async fn free_deleted(ctx: &Context, repo: &Arc<Repo>) -> Option<GcReport> {
    let (progress, ticker) = Ticker::for_work(ctx.progress);
    let options = GcOptions {
        repack_small: true,
        wait_limit: Duration::from_secs(60),
        on_wait: wait_notice(ctx),
        progress,
        ..Default::default()
    };
    let r = gc(repo, &options).await;
    drop(ticker);
    match r {
        Ok(r) => Some(r),
        Err(e) => {
            eprintln!("warning: space not reclaimed now ({e}); run `cairn gc` later");
            None
        }
    }
}

/// The options of a command that publishes a GC plan (gc, index compact): a dry run or not,
/// when another session counts as dead, how long to wait for older ones (saying so), and
/// the progress counters.
pub(crate) fn protocol_options(
    ctx: &Context,
    dry_run: bool,
    stale_after_s: u64,
    wait_limit_s: u64,
    progress: Option<Arc<WorkProgress>>,
) -> GcOptions {
    GcOptions {
        dry_run,
        stale_after: Duration::from_secs(stale_after_s),
        wait_limit: Duration::from_secs(wait_limit_s),
        on_wait: wait_notice(ctx),
        progress,
        ..Default::default()
    }
}

/// Says on stderr (unless --quiet) what a GC is waiting for.
fn wait_notice(ctx: &Context) -> Option<WaitNotice> {
    if ctx.quiet {
        return None;
    }
    Some(Arc::new(|sessions: &[String]| {
        eprintln!(
            "gc: waiting for {} older session{} to finish before deleting: {}",
            sessions.len(),
            if sessions.len() == 1 { "" } else { "s" },
            sessions.join("; ")
        );
    }))
}

pub fn report_json(r: &GcReport) -> Value {
    json!({
        "mode": r.mode.name(),
        "dry_run": r.dry_run,
        "live_versions": r.live_versions,
        "live_blobs": r.live_blobs,
        "freed_versions": r.freed_versions,
        "dead_blobs": r.dead_blobs,
        "packs_deleted": r.packs_deleted,
        "packs_repacked": r.packs_repacked,
        "packs_recompressed": r.packs_recompressed,
        "packs_written": r.packs_written,
        "orphan_packs_deleted": r.orphan_packs_deleted,
        "orphan_packs_reindexed": r.orphan_packs_reindexed,
        "orphan_packs_kept": r.orphan_packs_kept,
        "index_runs_replaced": r.index_runs_replaced,
        "rescued_blobs": r.rescued_blobs,
        "small_packs": r.small_packs,
        "duplicate_blobs": r.duplicate_blobs,
        "duplicate_packs": r.duplicate_packs,
        "groups_rebuilt": r.groups_rebuilt,
        "temporaries_removed": r.temporaries_removed,
        "temporary_bytes_removed": r.temporary_bytes_removed,
        "partial_files_removed": r.partial_files_removed,
        "partial_bytes_removed": r.partial_bytes_removed,
        "orphan_records_removed": r.orphan_records_removed,
        "profiles_removed": r.profiles_removed,
        "before_bytes": r.before_bytes,
        "after_bytes": r.after_bytes,
        "reclaimed_bytes": r.reclaimed(),
        "repacked_bytes": r.repacked_bytes,
        "metadata_read_bytes": r.metadata_read_bytes,
        "trailers_read": r.trailers_read,
        "index_read_bytes": r.index_read_bytes,
        "summary_bytes": r.summary_bytes,
        "summaries_read": r.summaries_read,
        "records_read": r.records_read,
        "record_bundle_bytes": r.record_bundle_bytes,
        "waited_s": r.waited_s,
        "duration_s": r.duration_s,
        "phases_s": r
            .phases
            .iter()
            .map(|(name, s)| (name.to_string(), json!(s)))
            .collect::<serde_json::Map<_, _>>(),
    })
}

pub fn report_line(r: &GcReport) -> String {
    let mut line = main_line(r);
    let mut extra = Vec::new();
    if r.duplicate_blobs > 0 {
        extra.push(format!(
            "{} groups and nodes stored more than once (by commits that ran at once) found in {} packs",
            r.duplicate_blobs, r.duplicate_packs
        ));
    }
    if r.orphan_packs_deleted > 0 && r.mode == GcMode::Fast {
        extra.push(format!(
            "{} packs of interrupted commits deleted",
            r.orphan_packs_deleted
        ));
    }
    if r.packs_recompressed > 0 {
        extra.push(format!(
            "{} packs {} to compress their groups again",
            r.packs_recompressed,
            if r.dry_run {
                "would be copied"
            } else {
                "copied"
            }
        ));
    }
    if r.orphan_packs_reindexed > 0 {
        extra.push(format!(
            "{} packs no index run named hold data of live versions (a lost index run): {}",
            r.orphan_packs_reindexed,
            if r.dry_run {
                "would be indexed again"
            } else {
                "indexed again"
            }
        ));
    }
    if r.orphan_packs_kept > 0 {
        extra.push(format!(
            "{} packs no index run names have an unreadable trailer: kept (see `cairn verify`)",
            r.orphan_packs_kept
        ));
    }
    if r.temporaries_removed > 0 {
        extra.push(format!(
            "{} temporary files of killed processes removed ({})",
            r.temporaries_removed,
            bytes(r.temporary_bytes_removed)
        ));
    }
    if r.partial_files_removed > 0 {
        extra.push(format!(
            "{} partial files of killed restores removed ({})",
            r.partial_files_removed,
            bytes(r.partial_bytes_removed)
        ));
    }
    if r.orphan_records_removed > 0 {
        extra.push(format!(
            "{} unpublished version records removed",
            r.orphan_records_removed
        ));
    }
    if r.profiles_removed > 0 {
        extra.push(format!(
            "{} boot profiles of removed images removed",
            r.profiles_removed
        ));
    }
    if !extra.is_empty() {
        line.push_str("; ");
        line.push_str(&extra.join("; "));
    }
    line
}

fn main_line(r: &GcReport) -> String {
    let verb = if r.dry_run {
        "would reclaim"
    } else {
        "reclaimed"
    };
    let head = format!(
        "{verb} {} ({} → {})",
        bytes(r.reclaimed()),
        bytes(r.before_bytes),
        bytes(r.after_bytes)
    );
    match r.mode {
        GcMode::Fast if r.freed_versions == 0 && r.reclaimed() == 0 => {
            "nothing to free: no version was deleted since the last gc".to_string()
        }
        GcMode::Fast if r.freed_versions == 0 => format!(
            "{head}: no version was deleted since the last gc; {} packs deleted, {} repacked ({} copied)",
            r.packs_deleted,
            r.packs_repacked,
            bytes(r.repacked_bytes),
        ),
        GcMode::Fast => format!(
            "{head}: freed {} deleted {}, {} dead blobs; {} packs deleted, {} repacked ({} copied); read {} of summaries and {} of manifests in {:.2} s",
            r.freed_versions,
            if r.freed_versions == 1 { "version" } else { "versions" },
            r.dead_blobs,
            r.packs_deleted,
            r.packs_repacked,
            bytes(r.repacked_bytes),
            bytes(r.summary_bytes),
            bytes(r.metadata_read_bytes),
            r.duration_s,
        ),
        GcMode::Repair => format!(
            "{head}: {} live versions, {} live blobs, {} dead blobs; {} packs deleted, {} repacked ({} copied), {} orphan packs deleted; read {} of metadata in {:.2} s",
            r.live_versions,
            r.live_blobs,
            r.dead_blobs,
            r.packs_deleted,
            r.packs_repacked,
            bytes(r.repacked_bytes),
            r.orphan_packs_deleted,
            bytes(r.metadata_read_bytes),
            r.duration_s,
        ),
    }
}

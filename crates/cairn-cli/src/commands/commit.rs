//! `cairn commit`: a full commit of any source, or an incremental one when the source can
//! say what changed (a qcow2 overlay on a known parent, an NBD dirty bitmap).

use cairn_repo::SessionKind;
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use cairn_engine::commit::incremental::IncrementalStats;
use cairn_engine::commit::plan::{
    commit_planned, plan_commit, CommitPlan, CommitSource, PlannedCommit,
};
use cairn_engine::commit::{CommitOptions, CommitProgress, CommitResult, DedupMode};
use cairn_engine::file_lock::lock_holder;
use cairn_engine::resolve::{resolve, VersionSpec};
use cairn_engine::source::{
    open_image, InterruptibleStdin, RateLimited, ReadPolicy, SourceFormat, StreamSource,
};
use cairn_format::name::validate_image_name;
use cairn_image::DiskImage;
use cairn_nbd::client::NbdImage;
use cairn_repo::Repo;

use crate::cli::{CommitArgs, DedupArg, SourceFormatArg};
use crate::context::Context;
use crate::output::{bytes, print_json, rate, version_json};
use crate::progress::Ticker;
use crate::provenance::{FileIdentity, Provenance};

pub fn is_nbd_url(s: &str) -> bool {
    s.starts_with("nbd://") || s.starts_with("nbd+unix://") || s.starts_with("nbds")
}

pub async fn run(ctx: &Context, args: CommitArgs) -> Result<ExitCode> {
    validate_image_name(&args.image).map_err(|e| anyhow::anyhow!("invalid {e}"))?;
    if let Some(export) = &args.from_export {
        return crate::commands::export::commit_from(
            ctx,
            &args.image,
            export,
            &args.message,
            args.force,
        )
        .await;
    }
    let spec = args
        .source
        .clone()
        .expect("clap requires SOURCE without --from-export");
    let policy = ReadPolicy {
        rate_limit: match args.rate_limit {
            Some(r) if r.is_finite() && r > 0.0 => Some((r * 1024.0 * 1024.0) as u64),
            Some(r) => bail!("--rate-limit must be a positive number of MiB/s, not {r}"),
            None => None,
        },
        drop_cache: !args.keep_cache,
        direct: args.direct,
    };
    if let Some(marker) = crate::in_place_marker::find(Path::new(&spec)) {
        bail!("will not commit {spec}: {}", marker.describe());
    }
    let identity_before = FileIdentity::settled(Path::new(&spec));
    let source = open_source(&spec, &args, policy)?;
    if let (CommitSource::Local(_), Some(holder)) = (&source, lock_holder(Path::new(&spec))) {
        ctx.warn(&format!(
            "{spec} is in use: {holder}. A running guest may write while cairn reads, so the \
             version may not be one point in time: stop the VM, or back it up with \
             `cairn vm backup` (one point in time while it runs)"
        ));
    }
    let local = matches!(source, CommitSource::Local(_));
    let repo = ctx.open_as(SessionKind::Commit).await?;
    let parent = match &args.parent {
        Some(p) => Some(resolve(&repo, &VersionSpec::parse(p)?).await?),
        None => None,
    };
    let provenance = Provenance::for_repo(&repo.config().repo_id);
    let plan = plan_commit(&repo, &args.image, source, parent, &provenance).await?;

    let started = Instant::now();
    let planned = planned_commit(ctx, repo.clone(), &args, plan).await?;
    let (result, read_bytes) = (planned.result, planned.read_bytes);
    let (incremental, because) = match planned.incremental {
        Some((stats, because)) => (Some(stats), Some(because)),
        None => (None, None),
    };
    let elapsed = started.elapsed();
    if local {
        // This file now holds this version: an overlay on it commits incrementally.
        provenance.record(Path::new(&spec), identity_before, &result.id);
    }
    let fetches = repo.v2().map(|r| (r.fetches(), r.filter_memory()));
    report(
        ctx,
        &result,
        incremental,
        read_bytes,
        because,
        elapsed,
        fetches,
    );
    // The version is published and reported: what follows only tidies the index.
    if !args.no_compact {
        cairn_engine::gc::compact::after_commit(&repo).await;
    }
    Ok(ExitCode::SUCCESS)
}

fn open_source(spec: &str, args: &CommitArgs, policy: ReadPolicy) -> Result<CommitSource> {
    if spec == "-" {
        if args.parent.is_some() || args.dirty_bitmap.is_some() {
            bail!("--parent and --dirty-bitmap need a file or NBD source, not standard input");
        }
        return Ok(CommitSource::Stream(Box::new(StreamSource::new(
            "stdin",
            InterruptibleStdin,
        ))));
    }
    if is_nbd_url(spec) {
        if args.format == SourceFormatArg::Qcow2 {
            bail!("an NBD export is read as raw guest data; --format qcow2 does not apply");
        }
        if args.direct {
            bail!("--direct applies to local files and block devices, not to NBD exports");
        }
        let nbd = NbdImage::connect(spec, args.dirty_bitmap.as_deref())?;
        let dirty = match &args.dirty_bitmap {
            Some(bitmap) => Some((bitmap.clone(), nbd.dirty_extents()?)),
            None => None,
        };
        let image: Arc<dyn DiskImage> = match policy.rate_limit {
            Some(r) => Arc::new(RateLimited::new(Box::new(nbd), r)),
            None => Arc::new(nbd),
        };
        return Ok(CommitSource::Nbd { image, dirty });
    }
    if args.dirty_bitmap.is_some() {
        bail!(
            "--dirty-bitmap reads QEMU's dirty bitmap over NBD: SOURCE must be an nbd:// or \
             nbd+unix:// URL, not {spec}"
        );
    }
    let format = match args.format {
        SourceFormatArg::Auto => SourceFormat::Auto,
        SourceFormatArg::Raw => SourceFormat::Raw,
        SourceFormatArg::Qcow2 => SourceFormat::Qcow2,
    };
    Ok(CommitSource::Local(open_image(
        Path::new(spec),
        format,
        policy,
    )?))
}

/// The plan's commit, with a progress line while a full commit reads.
async fn planned_commit(
    ctx: &Context,
    repo: Arc<Repo>,
    args: &CommitArgs,
    plan: CommitPlan,
) -> Result<PlannedCommit> {
    let progress = Arc::new(CommitProgress::default());
    let ticker = match &plan {
        CommitPlan::Full(source) => {
            let (p1, p2) = (progress.clone(), progress.clone());
            let total = Arc::new(AtomicU64::new(source.data_hint().unwrap_or(0)));
            Some(Ticker::start(
                ctx.progress,
                total,
                move || p1.read.load(Ordering::Relaxed),
                move || {
                    let read = p2.read.load(Ordering::Relaxed).max(1);
                    let new = p2.new_bytes.load(Ordering::Relaxed);
                    format!(
                        "new {} ({:.1}%)",
                        bytes(new),
                        new as f64 * 100.0 / read as f64
                    )
                },
            ))
        }
        CommitPlan::Incremental { .. } => None,
    };
    let options = CommitOptions {
        message: args.message.clone(),
        workers: args.threads,
        progress: Some(progress),
        dedup: dedup_mode(args.dedup),
        ..Default::default()
    };
    let planned = commit_planned(repo, &args.image, plan, options).await;
    drop(ticker);
    Ok(planned?)
}

/// The flag's mode, else the process default (`CAIRN_DEDUP`, else bounded).
pub(crate) fn dedup_mode(arg: Option<DedupArg>) -> DedupMode {
    match arg {
        Some(DedupArg::Exact) => DedupMode::Exact,
        Some(DedupArg::Bounded) => DedupMode::Bounded,
        None => DedupMode::default(),
    }
}

fn report(
    ctx: &Context,
    result: &CommitResult,
    incremental: Option<IncrementalStats>,
    read_bytes: u64,
    because: Option<String>,
    elapsed: std::time::Duration,
    fetches: Option<(cairn_repo::v2::Fetches, (u64, usize))>,
) {
    let r = &result.record;
    if ctx.json {
        let mut v = version_json(&result.id, r, &[]);
        v["duration_s"] = serde_json::json!(elapsed.as_secs_f64());
        v["read_bytes"] = serde_json::json!(read_bytes);
        v["reused_segments"] = serde_json::json!(result.reused_segments);
        v["parent_chunks"] = serde_json::json!(result.dedup.parent);
        v["similar_chunks"] = serde_json::json!(result.dedup.similar);
        v["index_chunks"] = serde_json::json!(result.dedup.index);
        v["hook_lookups"] = serde_json::json!(result.dedup.hook_lookups);
        // What this process read of the repository's format 2 objects (index sections, pack
        // trailers, groups): how much a commit's dedup cost in reads.
        v["fetched"] = match fetches {
            Some((f, (filter_bytes, unfiltered))) => serde_json::json!({
                "index_sections": f.sections,
                "trailers": f.trailers,
                "groups": f.groups,
                "group_bytes": f.group_bytes,
                "index_filter_bytes": filter_bytes,
                "index_runs_without_filter": unfiltered,
            }),
            None => serde_json::Value::Null,
        };
        v["incremental"] = match (incremental, &because) {
            (Some(s), Some(b)) => serde_json::json!({
                "changed_bytes": s.changed_bytes,
                "basis": b,
            }),
            _ => serde_json::Value::Null,
        };
        print_json(&v);
        return;
    }
    let how = match (&because, incremental) {
        (Some(b), Some(s)) => format!(
            " — incremental: {b}, {} changed, {} read",
            bytes(s.changed_bytes),
            bytes(read_bytes)
        ),
        _ => String::new(),
    };
    outln!(
        "committed {}@{} {} — {} logical, {} data, {} new{}, {} stored{}, in {:.2} s ({}){how}",
        r.image,
        r.seq,
        result.id.short(),
        bytes(r.logical_size),
        bytes(r.stats.data_bytes),
        bytes(r.stats.new_chunk_bytes),
        dedup_note(&r.stats),
        bytes(r.stats.stored_bytes),
        compression_note(&r.stats),
        elapsed.as_secs_f64(),
        rate(read_bytes, elapsed),
    );
}

/// " (93.1% deduplicated)": the share of the data found already stored.
fn dedup_note(s: &cairn_format::version::CommitStats) -> String {
    if s.data_bytes == 0 {
        return String::new();
    }
    let found = s.data_bytes.saturating_sub(s.new_chunk_bytes);
    format!(
        " ({:.1}% deduplicated)",
        found as f64 * 100.0 / s.data_bytes as f64
    )
}

/// " (2.41× compressed)": new data against what storing it took (metadata included).
fn compression_note(s: &cairn_format::version::CommitStats) -> String {
    if s.new_chunk_bytes == 0 || s.stored_bytes == 0 {
        return String::new();
    }
    format!(
        " ({:.2}× compressed)",
        s.new_chunk_bytes as f64 / s.stored_bytes as f64
    )
}

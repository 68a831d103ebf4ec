//! `cairn restore IMAGE@V TARGET --in-place`: TARGET becomes version V where it is, with
//! only what differs written (`cairn_engine::restore::in_place`). This layer decides what
//! TARGET is known to hold (the provenance records, unless a marker says an earlier run was
//! cut short), keeps the marker around the writes (`in_place_marker.rs`), and records the
//! result.

use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use cairn_engine::restore::in_place::{
    restore_in_place, InPlaceMethod, InPlaceOptions, InPlaceTarget,
};
use cairn_engine::restore::RestoreProgress;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::Repo;
use serde_json::json;

use crate::cli::{OutputFormatArg, RestoreArgs};
use crate::context::Context;
use crate::in_place_marker;
use crate::output::{bytes, print_json};
use crate::progress::Ticker;
use crate::provenance::{FileIdentity, Provenance};

pub(super) async fn run(
    ctx: &Context,
    args: &RestoreArgs,
    repo: Arc<Repo>,
    id: Id,
    record: VersionRecord,
) -> Result<ExitCode> {
    let target_path = args.output.as_path();
    if target_path.as_os_str() == "-" {
        bail!("--in-place needs an existing file or block device, not standard output");
    }
    if args.format == Some(OutputFormatArg::Qcow2) {
        bail!("--in-place writes raw images and block devices, not --format qcow2");
    }
    super::refuse_export_files(target_path).await?;
    let provenance = Provenance::for_repo(&repo.config().repo_id);
    let torn = in_place_marker::find(target_path);
    if let Some(m) = torn.as_ref().filter(|m| m.running()) {
        bail!(
            "will not restore to {}: {}",
            target_path.display(),
            m.describe()
        );
    }
    // What TARGET holds, if cairn knows: a version it committed or restored there, the file
    // unchanged since (and not torn by an in-place restore cut short).
    let held = match (args.compare, &torn) {
        (false, None) => provenance.lookup(target_path),
        _ => None,
    };
    let holds = match held {
        Some(u) => match repo.load_version(&u).await {
            Ok(r) => Some((u, r)),
            Err(e) => {
                tracing::info!(
                    "{} held version {u}, which cannot be loaded ({e}): comparing",
                    target_path.display()
                );
                None
            }
        },
        None => None,
    };
    let target = InPlaceTarget::open(target_path, &record, args.resize, holds.is_some())?;
    let version = format!("{}@{}", record.image, record.seq);
    let marker = in_place_marker::begin(target_path, &version, &id.to_hex())?;
    provenance.forget(target_path);

    let progress = Arc::new(RestoreProgress::default());
    let ticker = {
        let p = progress.clone();
        Ticker::start(
            ctx.progress,
            Arc::new(AtomicU64::new(record.logical_size)),
            move || p.done.load(Ordering::Relaxed),
            String::new,
        )
    };
    let regular = target.is_regular_file();
    let started = Instant::now();
    let options = InPlaceOptions {
        holds: holds.as_ref().map(|(_, r)| r.clone()),
        progress: Some(progress),
        ..Default::default()
    };
    let stats = restore_in_place(repo, &record, target, options).await;
    drop(ticker);
    let stats = stats?; // the marker stays: TARGET may be torn
    let elapsed = started.elapsed();
    if regular {
        // As after a full restore: the file holds V, stamped with V's time, unless someone
        // wrote to it since.
        let now = FileIdentity::of(target_path).filter(|i| i.mtime_ns() == record.time_ns);
        provenance.record(target_path, now, &id);
    }
    marker.finish();

    let from = holds
        .as_ref()
        .map(|(u, r)| (u.to_hex(), format!("{}@{}", r.image, r.seq)));
    if ctx.json {
        print_json(&json!({
            "id": id.to_hex(),
            "image": record.image,
            "seq": record.seq,
            "output": target_path.display().to_string(),
            "in_place": true,
            "method": stats.method.as_str(),
            "held": from.as_ref().map(|(id, _)| id),
            "finished_interrupted": torn.is_some(),
            "resized_from": stats.resized_from,
            "logical_bytes": stats.logical_bytes,
            "target_read_bytes": stats.target_read_bytes,
            "segments_unchanged": stats.segments_unchanged,
            "written_bytes": stats.written_bytes,
            "zeroed_bytes": stats.zeroed_bytes,
            "fetched_bytes": stats.fetched_bytes,
            "reads": stats.reads,
            "duration_s": elapsed.as_secs_f64(),
        }));
        return Ok(ExitCode::SUCCESS);
    }
    let how = match (stats.method, &from) {
        (InPlaceMethod::Diff, Some((_, u))) => {
            format!("what differs from {u}, which it held (not read)")
        }
        _ => format!(
            "what differs after comparing {}",
            bytes(stats.target_read_bytes)
        ),
    };
    outln!(
        "restored {version} into {} in place — wrote {} and zeroed {} of {}: {how}; fetched {} \
         in {:.2} s{}{}",
        target_path.display(),
        bytes(stats.written_bytes),
        bytes(stats.zeroed_bytes),
        bytes(stats.logical_bytes),
        bytes(stats.fetched_bytes),
        elapsed.as_secs_f64(),
        match stats.resized_from {
            Some(was) => format!("; resized from {}", bytes(was)),
            None => String::new(),
        },
        match torn {
            Some(_) => "; an interrupted in-place restore is finished",
            None => "",
        }
    );
    Ok(ExitCode::SUCCESS)
}

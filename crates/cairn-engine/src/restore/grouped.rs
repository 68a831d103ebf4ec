//! Restore of a format 2 version: the leaf map from the interior nodes, then a rolling window
//! of leaves read in parallel — each leaf's group runs through the repository's
//! [`V2Reader`](cairn_repo::v2::V2Reader), whose group cache decodes a group once however
//! many runs of it the window reads — and written in segment order (stdout needs the order;
//! files and devices take it at no cost).

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::Repo;

use super::{
    write_file, write_qcow2, write_stdout, write_zeros, RestoreOptions, RestoreProgress,
    RestoreStats, Sink,
};
use crate::error::{EngineError, EngineResult};
use crate::segment::read_segment;
use crate::tree::leaf_map;

/// Restores `version` of a format 2 repository into `sink`.
pub(super) async fn run_grouped(
    repo: &Arc<Repo>,
    version: &VersionRecord,
    sink: &Sink,
    options: &RestoreOptions,
    progress: &RestoreProgress,
    path: &Path,
) -> EngineResult<RestoreStats> {
    if options.allow_damage {
        repo.require_format_1("restore --allow-damage")?;
    }
    let reader = repo
        .v2()
        .ok_or_else(|| EngineError::internal("restore", "format 2 restore of format 1"))?;
    let before = reader.fetches();
    let seg = u64::from(version.segment_size);
    let leaves: Vec<(u64, Id)> = leaf_map(repo, version).await?.into_iter().collect();
    let mut stats = RestoreStats {
        logical_bytes: version.logical_size,
        ..Default::default()
    };
    let mut done_to = 0u64;
    // A rolling window: `parallel_reads` leaves in flight, the next started as soon as the
    // oldest is written (not when the slowest of a batch is), written in segment order.
    let window = options.parallel_reads.max(1);
    let mut pending = leaves.iter().copied();
    let mut in_flight = std::collections::VecDeque::with_capacity(window);
    let spawn = |(index, id): (u64, Id)| {
        let repo = repo.clone();
        let len = seg.min(version.logical_size.saturating_sub(index * seg));
        (
            index,
            tokio::spawn(async move { read_segment(&repo, &id, len).await }),
        )
    };
    in_flight.extend(pending.by_ref().take(window).map(spawn));
    while let Some((index, task)) = in_flight.pop_front() {
        crate::interrupt::check()?;
        let (data, stored) = task
            .await
            .map_err(|e| EngineError::internal("restore task", e))??;
        in_flight.extend(pending.next().map(spawn));
        let off = index * seg;
        write_zeros(sink, done_to, off, path)?;
        match sink {
            Sink::File { file, zeros_needed } => write_file(file, !zeros_needed, &data, off, path)?,
            Sink::Qcow2 { writer } => write_qcow2(writer, &data, off)?,
            Sink::Stdout { .. } => write_stdout(&data)?,
        }
        done_to = off + data.len() as u64;
        stats.data_bytes += stored;
        progress.done.store(done_to, Ordering::Relaxed);
        let now = reader.fetches();
        progress.fetched.store(
            now.group_bytes.saturating_sub(before.group_bytes),
            Ordering::Relaxed,
        );
    }
    write_zeros(sink, done_to, version.logical_size, path)?;
    let after = reader.fetches();
    stats.fetched_bytes = after.group_bytes - before.group_bytes;
    stats.reads = after.groups - before.groups;
    Ok(stats)
}

//! The restore loop: the leaf map from the interior nodes, then a rolling window of batches
//! of consecutive leaves read in parallel (`segment::read_segments`: in format 2 a batch's
//! leaves, then all their group runs, in as few ranged reads as their places allow) and
//! written in segment order (stdout needs the order; files and devices take it at no cost).
//!
//! With `allow_damage`, what cannot be read is zeros and listed: a group run no copy of
//! which is readable (each slot's chunk is tried wherever else it is stored first; format
//! 1: any chunk of the segment), a leaf, or an interior node (every segment under it).

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::Repo;

use super::{
    merge_ranges, start_writeback, write_file, write_qcow2, write_qcow2_overlay, write_stdout,
    write_zeros, DamagedRange, RestoreOptions, RestoreProgress, RestoreStats, Sink,
};
use crate::error::{EngineError, EngineResult};
use crate::segment::{
    read_segment_allowing_damage, read_segments, read_segments_seeded, SegmentRead,
};
use crate::tree::{leaf_map, readable_leaf_map};

/// Leaves a restore reads together (their leaves and groups in as few reads as their places
/// allow): 4 segments, so a window of 8 reads holds 32 MiB of segments at most.
pub(crate) const LEAVES_PER_READ: usize = 4;

/// Bytes of a file or device written between two requests to start their writeback.
const WRITEBACK_EVERY: u64 = 32 << 20;

/// Restores `version` into `sink`.
pub(super) async fn run(
    repo: Arc<Repo>,
    version: &VersionRecord,
    sink: &Sink,
    options: &RestoreOptions,
    progress: &RestoreProgress,
    path: &Path,
) -> EngineResult<RestoreStats> {
    let repo = &repo;
    let _spare = SpareBuffers;
    let before = Fetched::of(repo);
    let seg = u64::from(version.segment_size);
    let mut stats = RestoreStats {
        logical_bytes: version.logical_size,
        ..Default::default()
    };
    let mut damaged = Vec::new();
    let tolerant = options.allow_damage;
    let leaves = if tolerant {
        let mut skipped = Vec::new();
        let map = readable_leaf_map(repo, version, &mut skipped).await?;
        for (first, count, reason) in skipped {
            damaged.push(segments_range(version, first, count, reason));
        }
        map
    } else {
        leaf_map(repo, version).await?
    };
    let leaves: Vec<(u64, Id)> = leaves.into_iter().collect();
    let mut done_to = 0u64;
    let mut written_back = 0u64;
    let mut segments_read = 0u64;
    // A rolling window: `parallel_reads` batches of leaves in flight, the next started as
    // soon as the oldest is written (not when the slowest of a window is), written in
    // segment order. A batch's leaves and groups are read together (`read_segments`: a few
    // large reads rather than two small ones a leaf); with `allow_damage` a batch is a leaf.
    let window = options.parallel_reads.max(1);
    let batch = if tolerant { 1 } else { LEAVES_PER_READ };
    let mut pending = leaves.chunks(batch);
    let mut in_flight = std::collections::VecDeque::with_capacity(window);
    let len_of = |index: u64| seg.min(version.logical_size.saturating_sub(index * seg));
    let spawn = |batch: &[(u64, Id)]| {
        let repo = repo.clone();
        let seeds = options.seeds.clone();
        let indexes: Vec<u64> = batch.iter().map(|(index, _)| *index).collect();
        let wanted: Vec<(Id, u64)> = batch.iter().map(|&(i, id)| (id, len_of(i))).collect();
        (
            indexes.clone(),
            tokio::spawn(async move {
                if !tolerant && !seeds.is_empty() {
                    let at: Vec<(Id, u64, u64)> = wanted
                        .iter()
                        .zip(&indexes)
                        .map(|(&(id, len), &i)| (id, len, i * seg))
                        .collect();
                    return read_segments_seeded(&repo, &at, &seeds).await;
                }
                if !tolerant {
                    return read_segments(&repo, &wanted).await;
                }
                let (id, len) = wanted[0];
                match read_segment_allowing_damage(&repo, &id, len).await {
                    // The leaf itself is lost: the whole segment is.
                    Err(e) if e.is_damage() => Ok(vec![SegmentRead {
                        data: vec![0; len as usize],
                        damaged: vec![(0, len, e.to_string())],
                        ..Default::default()
                    }]),
                    other => other.map(|read| vec![read]),
                }
            }),
        )
    };
    in_flight.extend(pending.by_ref().take(window).map(spawn));
    while let Some((indexes, task)) = in_flight.pop_front() {
        crate::interrupt::check()?;
        let reads = task
            .await
            .map_err(|e| EngineError::internal("restore task", e))??;
        in_flight.extend(pending.next().map(spawn));
        for (index, read) in indexes.into_iter().zip(reads) {
            let SegmentRead {
                data,
                stored,
                damaged: lost,
                seeded,
            } = read;
            stats.seeded_bytes += seeded;
            let off = index * seg;
            damaged.extend(lost.into_iter().map(|(at, len, reason)| DamagedRange {
                offset: off + at,
                len,
                reason,
            }));
            write_zeros(sink, done_to, off, path)?;
            match sink {
                Sink::File { file, zeros_needed } => {
                    write_file(file, !zeros_needed, &data, off, path)?
                }
                Sink::Qcow2 { writer, base: None } => write_qcow2(writer, &data, off)?,
                Sink::Qcow2 {
                    writer,
                    base: Some(base),
                } => write_qcow2_overlay(writer, base.as_ref(), &data, off)?,
                Sink::Stdout => write_stdout(&data)?,
            }
            done_to = off + data.len() as u64;
            crate::segment::give_back(data);
            if let Sink::File { file, .. } = sink {
                if done_to - written_back >= WRITEBACK_EVERY {
                    start_writeback(file, written_back, done_to);
                    written_back = done_to;
                }
            }
            stats.data_bytes += stored;
            segments_read += 1;
            progress.done.store(done_to, Ordering::Relaxed);
            let now = Fetched::of(repo).since(&before, stats.data_bytes, segments_read);
            progress.fetched.store(now.bytes, Ordering::Relaxed);
        }
    }
    write_zeros(sink, done_to, version.logical_size, path)?;
    let fetched = Fetched::of(repo).since(&before, stats.data_bytes, segments_read);
    stats.fetched_bytes = fetched.bytes;
    stats.reads = fetched.reads;
    stats.damaged = merge_ranges(damaged);
    Ok(stats)
}

/// Frees the segment buffers a restore gave back when it ends, however it ends.
struct SpareBuffers;

impl Drop for SpareBuffers {
    fn drop(&mut self) {
        crate::segment::drop_spare_buffers();
    }
}

/// What a restore fetched: format 2 counts group bytes and ranged reads (its reader keeps
/// the counts); format 1 counts the stored bytes of its chunks and a read per segment.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Fetched {
    pub(super) bytes: u64,
    pub(super) reads: u64,
}

impl Fetched {
    pub(super) fn of(repo: &Repo) -> Fetched {
        repo.v2().map_or_else(Fetched::default, |reader| {
            let f = reader.fetches();
            Fetched {
                bytes: f.group_bytes,
                reads: f.groups,
            }
        })
    }

    /// What was fetched since `before`; on format 1 (no reader counts), the `stored` bytes
    /// of the `segments` read.
    pub(super) fn since(self, before: &Fetched, stored: u64, segments: u64) -> Fetched {
        match self.bytes == 0 && self.reads == 0 {
            true => Fetched {
                bytes: stored,
                reads: segments,
            },
            false => Fetched {
                bytes: self.bytes - before.bytes,
                reads: self.reads - before.reads,
            },
        }
    }
}

/// Segments `first .. first + count` of `version` as a byte range (clipped to the image).
fn segments_range(version: &VersionRecord, first: u64, count: u64, reason: String) -> DamagedRange {
    let seg = u64::from(version.segment_size);
    let offset = first.saturating_mul(seg).min(version.logical_size);
    let end = first
        .saturating_add(count)
        .saturating_mul(seg)
        .min(version.logical_size);
    DamagedRange {
        offset,
        len: end - offset,
        reason,
    }
}

//! Rebuilding the touched segments of a patch: each is materialized — its base leaf's group
//! runs read through the repository's `V2Reader` (a group decoded once, whatever runs of it the
//! segment uses), the changed blocks laid over them — and handed to the commit
//! pipeline, which dedups it per 4 KiB chunk against the index runs (so the base's unchanged
//! chunks are found, not stored) and builds its new leaf. Untouched segments keep their leaf
//! ids, unread; the tree is rebuilt over the full map, so only the paths to changed leaves
//! are new.
//!
//! Reading the touched segments' base data is the price of leaves that name groups rather
//! than chunks (a changed 4 KiB block cannot be spliced into a run without its neighbours'
//! ids); it is bounded by the touched segments, never the image.

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cairn_format::config::RepoConfig;
use cairn_format::leaf_v2::{RunExtent, RunLeaf};
use cairn_format::version::CommitStats;
use cairn_format::Id;
use cairn_repo::Repo;
use crossbeam_channel::{Receiver, Sender};
use tokio::runtime::Handle;

use super::PatchSource;
use crate::commit::base_summary::read_leaf;
use crate::commit::parent::ParentLeaves;
use crate::commit::pipeline::run_segments;
use crate::commit::{CommitOptions, CommitProgress, PipelineOutput};
use crate::error::{EngineError, EngineResult};
use crate::source::Segment;
use crate::tree::TreeLeaf;

/// Runs format 2's pipeline over the touched segments of `tasks`; `leaves` is the base's
/// segment → leaf map. The output's stats are the rebuilt segments' only.
pub(super) fn run(
    ctx: &Context<'_>,
    tasks: &[SegmentTask],
    leaves: BTreeMap<u64, TreeLeaf>,
) -> EngineResult<PipelineOutput> {
    let progress = CommitProgress::default();
    let feed = |tx: Sender<Segment>, _recycle: &Receiver<Vec<u8>>, cancel: &AtomicBool| {
        let r = feed_segments(ctx, tasks, &tx, cancel);
        if r.is_err() {
            cancel.store(true, Ordering::Relaxed);
        }
        r.map(|()| ctx.new_size)
    };
    // A patch sends only the segments it touched, which differ from the base's: no whole
    // leaf is reused, but their chunks are found in the base's leaf of the same segment.
    let parent = ParentLeaves::by_segment_only(&leaves);
    run_segments(
        ctx.repo.clone(),
        ctx.handle.clone(),
        feed,
        leaves,
        &CommitOptions {
            dedup: ctx.dedup,
            ..Default::default()
        },
        &progress,
        &parent,
    )
}

fn feed_segments(
    ctx: &Context<'_>,
    tasks: &[SegmentTask],
    tx: &Sender<Segment>,
    cancel: &AtomicBool,
) -> EngineResult<()> {
    for task in tasks {
        if cancel.load(Ordering::Relaxed) {
            break;
        }
        let data = materialize(ctx, task)?;
        if tx
            .send(Segment {
                index: task.segment,
                data,
            })
            .is_err()
        {
            break; // the workers stopped: their error is reported
        }
    }
    Ok(())
}

/// The new bytes of `task`'s segment: the base's, with the changed blocks over them.
fn materialize(ctx: &Context<'_>, task: &SegmentTask) -> EngineResult<Vec<u8>> {
    let seg = u64::from(ctx.config.segment_size);
    let start = task.segment * seg;
    let len = seg.min(ctx.new_size - start) as usize;
    let mut data = vec![0u8; len];
    if let Some(leaf) = task.base_leaf {
        let mut at = 0usize;
        for e in base_leaf(ctx.repo, &ctx.handle, &leaf)?.extents() {
            let n = e.len() as usize;
            if let RunExtent::Run {
                group,
                first,
                count,
                ..
            } = *e
            {
                let reader = v2(ctx.repo)?;
                let bytes = ctx
                    .handle
                    .block_on(reader.read_group_run(&group, first, count))?;
                if bytes.len() != n || at + n > len {
                    return Err(EngineError::Manifest(format!(
                        "leaf {leaf}: slots {first}..{} of group {group} hold {} bytes at \
                         {at}, the leaf says {n} in a segment of {len}",
                        u32::from(first) + u32::from(count),
                        bytes.len()
                    )));
                }
                data[at..at + n].copy_from_slice(&bytes);
            }
            at += n;
        }
    }
    lay_blocks(ctx, &task.blocks, start, &mut data)?;
    Ok(data)
}

/// The chunks and data bytes the base leaves of the touched segments hold (what the patch
/// replaces in the base's figures).
pub(super) async fn old_stats(
    repo: &Arc<Repo>,
    tasks: &[SegmentTask],
) -> EngineResult<CommitStats> {
    let mut old = CommitStats::default();
    for leaf in tasks.iter().filter_map(|t| t.base_leaf) {
        for e in read_leaf(repo, &leaf).await?.extents() {
            if let RunExtent::Run { count, len, .. } = *e {
                old.chunks += u64::from(count);
                old.data_bytes += u64::from(len);
            }
        }
    }
    Ok(old)
}

fn base_leaf(repo: &Repo, handle: &tokio::runtime::Handle, id: &Id) -> EngineResult<RunLeaf> {
    handle.block_on(read_leaf(repo, id))
}

fn v2(repo: &Repo) -> EngineResult<&Arc<cairn_repo::v2::V2Reader>> {
    repo.v2()
        .ok_or_else(|| EngineError::internal("patch", "format 2 patch of format 1"))
}

/// A segment to rebuild.
pub(super) struct SegmentTask {
    pub(super) segment: u64,
    pub(super) base_leaf: Option<Id>,
    /// Changed blocks overlapping the segment, sorted.
    pub(super) blocks: Vec<u64>,
}

/// What every touched segment's rebuild shares.
pub(super) struct Context<'a> {
    pub(super) repo: &'a Arc<Repo>,
    pub(super) handle: Handle,
    pub(super) config: &'a RepoConfig,
    pub(super) patch: &'a dyn PatchSource,
    pub(super) block_size: u64,
    pub(super) new_size: u64,
    /// The dedup mode of the touched segments.
    pub(super) dedup: crate::commit::DedupMode,
}

/// Lays the changed `blocks` over `buf`, the bytes of the image from `start` (each block
/// clipped to the buffer).
pub(super) fn lay_blocks(
    ctx: &Context<'_>,
    blocks: &[u64],
    start: u64,
    buf: &mut [u8],
) -> EngineResult<()> {
    let end = start + buf.len() as u64;
    for &b in blocks {
        let data = read_block(ctx, b)?;
        let block_start = b * ctx.block_size;
        let lo = block_start.max(start);
        let hi = (block_start + data.len() as u64).min(end);
        buf[(lo - start) as usize..(hi - start) as usize]
            .copy_from_slice(&data[(lo - block_start) as usize..(hi - block_start) as usize]);
    }
    Ok(())
}

/// Reads a changed block and checks its length.
fn read_block(ctx: &Context<'_>, index: u64) -> EngineResult<Vec<u8>> {
    crate::interrupt::check()?;
    let data = ctx
        .patch
        .read_block(index)
        .map_err(|source| EngineError::PatchRead { index, source })?;
    let expected = (ctx.new_size - index * ctx.block_size).min(ctx.block_size);
    if data.len() as u64 != expected {
        return Err(EngineError::PatchRead {
            index,
            source: io::Error::new(
                io::ErrorKind::InvalidData,
                format!("{} bytes read where {expected} were expected", data.len()),
            ),
        });
    }
    Ok(data)
}

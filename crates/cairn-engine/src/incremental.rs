//! Commit only what changed since a parent version, when the source can say what changed:
//! a qcow2 overlay (its own clusters, CloudVS §3.6) or an NBD export with a dirty bitmap
//! (QEMU's changed-block tracking, VM-centric dedup's dirty segments).
//!
//! The changed extents are read from the source in blocks and committed with
//! [`crate::patch::commit_patch`] on top of the parent: everything else is shared with the
//! parent without being read, so the cost is proportional to the change.
//!
//! Correctness rests on one premise the caller vouches for: outside the changed extents,
//! the source holds exactly the parent version's bytes (the overlay's backing file *is* the
//! parent; the bitmap was created when the parent was taken).

use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cairn_format::config::Chunker;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_image::{Allocation, DiskImage};
use cairn_repo::Repo;

use crate::commit::CommitResult;
use crate::error::{EngineError, EngineResult};
use crate::patch::{commit_patch, PatchOptions, PatchSource};

/// Bytes per changed block when the repository's chunker does not dictate them (FastCDC):
/// the qcow2 default cluster and QEMU's default dirty-bitmap granularity.
const DEFAULT_BLOCK: u32 = 64 * 1024;

/// The extents of an image that the layers above `depth` define (data or zeros): what a
/// qcow2 overlay chain changed relative to the layer at `depth`. Sorted `(start, end)`.
pub fn layer_changes(image: &dyn DiskImage, depth: usize) -> EngineResult<Vec<(u64, u64)>> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    for run in image.map()? {
        if run.depth >= depth || run.alloc == Allocation::Unallocated {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.1 == run.start => last.1 = run.end(),
            _ => out.push((run.start, run.end())),
        }
    }
    Ok(out)
}

/// What an incremental commit read.
#[derive(Debug, Clone, Copy, Default)]
pub struct IncrementalStats {
    /// Bytes in the changed extents.
    pub changed_bytes: u64,
    /// Bytes read from the source (changed extents rounded out to blocks).
    pub read_bytes: u64,
}

/// Commits `source` as a new version of `image`, reading only `changed` (sorted or not;
/// `(start, end)` byte ranges) and taking everything else from `parent`.
pub async fn commit_changes(
    repo: Arc<Repo>,
    image: &str,
    parent: (Id, VersionRecord),
    source: Arc<dyn DiskImage>,
    changed: &[(u64, u64)],
    message: &str,
) -> EngineResult<(CommitResult, IncrementalStats)> {
    let size = source.size();
    if size < parent.1.logical_size {
        return Err(EngineError::BadRef(format!(
            "{} has {size} bytes but its parent {}@{} has {}: an incremental commit cannot \
             shrink an image",
            source.describe(),
            parent.1.image,
            parent.1.seq,
            parent.1.logical_size
        )));
    }
    let config = repo.config();
    let block_size = match config.chunker {
        Chunker::Fixed => config.chunk_size,
        Chunker::FastCdc => DEFAULT_BLOCK,
    };
    let bs = block_size as u64;
    let mut blocks = Vec::new();
    let mut changed_bytes = 0;
    for &(start, end) in changed {
        let end = end.min(size);
        if start >= end {
            continue;
        }
        changed_bytes += end - start;
        blocks.extend(start / bs..end.div_ceil(bs));
    }
    blocks.sort_unstable();
    blocks.dedup();
    let patch = ChangedBlocks {
        source,
        block_size,
        blocks,
        read: AtomicU64::new(0),
    };
    let result = commit_patch(
        repo,
        image,
        Some(parent),
        size,
        &patch,
        PatchOptions {
            message: message.to_string(),
        },
    )
    .await?;
    let stats = IncrementalStats {
        changed_bytes,
        read_bytes: patch.read.load(Ordering::Relaxed),
    };
    Ok((result, stats))
}

/// The changed blocks of a disk image, as a [`PatchSource`].
struct ChangedBlocks {
    source: Arc<dyn DiskImage>,
    block_size: u32,
    blocks: Vec<u64>,
    read: AtomicU64,
}

impl PatchSource for ChangedBlocks {
    fn block_size(&self) -> u32 {
        self.block_size
    }
    fn changed_blocks(&self) -> Vec<u64> {
        self.blocks.clone()
    }
    fn read_block(&self, index: u64) -> io::Result<Vec<u8>> {
        let bs = self.block_size as u64;
        let start = index * bs;
        let len = bs.min(self.source.size() - start) as usize;
        let mut buf = vec![0u8; len];
        self.source
            .read_at(&mut buf, start)
            .map_err(|e| io::Error::other(e.to_string()))?;
        self.read.fetch_add(len as u64, Ordering::Relaxed);
        Ok(buf)
    }
}

//! Commit only what changed since a parent version, when the source can say what changed:
//! a qcow2 overlay (its own clusters, CloudVS §3.6) or an NBD export with a dirty bitmap
//! (QEMU's changed-block tracking, VM-centric dedup's dirty segments).
//!
//! The changed extents are read from the source in blocks and committed with
//! [`super::patch::commit_patch`] on top of the parent: everything else is shared with the
//! parent without being read, so the cost is proportional to the change.
//!
//! Correctness rests on one premise the caller vouches for: outside the changed extents,
//! the source holds exactly the parent version's bytes (the overlay's backing file *is* the
//! parent; the bitmap was created when the parent was taken).

use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cairn_format::config::Chunker;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_image::{Allocation, DiskImage};
use cairn_repo::Repo;

use super::patch::{commit_patch, PatchOptions, PatchSource};
use super::CommitResult;
use crate::error::{EngineError, EngineResult};
use crate::tree::leaf_refs;

/// Bytes per changed block when the repository's chunker does not dictate them (FastCDC):
/// the qcow2 default cluster and QEMU's default dirty-bitmap granularity.
const DEFAULT_BLOCK: u32 = 64 * 1024;

/// What a source says changed: ranges to read, and ranges it defines as zeros (which need
/// no reading). Sorted, non-overlapping `(start, end)` pairs each.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    pub data: Vec<(u64, u64)>,
    pub zeros: Vec<(u64, u64)>,
}

impl Changes {
    /// Only data ranges (a dirty bitmap: what it marks must be read).
    pub fn data(data: Vec<(u64, u64)>) -> Changes {
        Changes {
            data,
            zeros: Vec::new(),
        }
    }
}

/// What the layers above `depth` of an image define (data or zeros): what a qcow2 overlay
/// chain changed relative to the layer at `depth`.
pub fn layer_changes(image: &dyn DiskImage, depth: usize) -> EngineResult<Changes> {
    fn push(v: &mut Vec<(u64, u64)>, start: u64, end: u64) {
        match v.last_mut() {
            Some(last) if last.1 == start => last.1 = end,
            _ => v.push((start, end)),
        }
    }
    let mut out = Changes::default();
    for run in image.map()? {
        if run.depth >= depth {
            continue;
        }
        match run.alloc {
            Allocation::Data => push(&mut out.data, run.start, run.end()),
            Allocation::Zero => push(&mut out.zeros, run.start, run.end()),
            Allocation::Unallocated => {}
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

/// Commits `source` as a new version of `image`, reading only `changes.data` and taking
/// everything else from `parent`.
///
/// Zero ranges are not read. Where the parent is known to be zero too (segments absent from
/// its tree, bytes past its end) they are no change at all and are dropped: `qemu-img
/// convert -B` marks every zero area of its input as zero clusters in the overlay, which
/// would otherwise touch every segment.
pub async fn commit_changes(
    repo: Arc<Repo>,
    image: &str,
    parent: (Id, VersionRecord),
    source: Arc<dyn DiskImage>,
    changes: &Changes,
    message: &str,
    dedup: super::DedupMode,
) -> EngineResult<(CommitResult, IncrementalStats)> {
    let size = source.size();
    if size < parent.1.logical_size {
        return Err(EngineError::BadInput(format!(
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
    // Zero ranges that change something: inside segments the parent holds.
    let parent_leaves = leaf_refs(&repo, &parent.1).await?;
    let seg = parent.1.segment_size.max(1) as u64;
    let mut zeros = Vec::new();
    for &(start, end) in &changes.zeros {
        let end = end.min(parent.1.logical_size);
        let mut pos = start;
        while pos < end {
            let next = ((pos / seg) + 1) * seg;
            if parent_leaves.contains_key(&(pos / seg)) {
                let piece_end = next.min(end);
                match zeros.last_mut() {
                    Some((_, e)) if *e == pos => *e = piece_end,
                    _ => zeros.push((pos, piece_end)),
                }
            }
            pos = next;
        }
    }
    let mut blocks = Vec::new();
    let mut changed_bytes = 0;
    for &(start, end) in changes.data.iter().chain(&zeros) {
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
        zeros,
        read: AtomicU64::new(0),
        windows: Mutex::new(HashMap::new()),
    };
    let result = commit_patch(
        repo,
        image,
        Some(parent),
        size,
        &patch,
        PatchOptions {
            message: message.to_string(),
            base_leaves: Some(parent_leaves),
            time_ns: None,
            dedup,
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
    /// Ranges known to be zeros (sorted): blocks inside one are not read.
    zeros: Vec<(u64, u64)>,
    read: AtomicU64,
    /// Windows being read or not fully handed out yet (see `read_block`).
    windows: Mutex<HashMap<u64, Arc<Mutex<Option<Window>>>>>,
}

/// The changed blocks of one aligned window of the source, read together.
struct Window {
    blocks: HashMap<u64, Vec<u8>>,
}

/// Changed blocks are read a window at a time: one `read_at` per run of adjacent changed
/// blocks in the window instead of one per block. Over NBD a request costs a round trip,
/// and blocks are as small as chunks (16 KiB by default).
const WINDOW: u64 = 1 << 20;

impl ChangedBlocks {
    fn is_zero_block(&self, start: u64, end: u64) -> bool {
        let i = self.zeros.partition_point(|&(_, e)| e <= start);
        self.zeros
            .get(i)
            .is_some_and(|&(s, e)| s <= start && end <= e)
    }

    fn block_range(&self, index: u64) -> (u64, u64) {
        let bs = self.block_size as u64;
        let start = index * bs;
        (start, (start + bs).min(self.source.size()))
    }

    /// Reads every changed, non-zero block of window `w`, in runs of adjacent blocks.
    fn read_window(&self, w: u64) -> io::Result<Window> {
        let bs = self.block_size as u64;
        let per = (WINDOW / bs).max(1);
        let first = self.blocks.partition_point(|&b| b < w * per);
        let last = self.blocks.partition_point(|&b| b < (w + 1) * per);
        let wanted: Vec<u64> = self.blocks[first..last]
            .iter()
            .copied()
            .filter(|&b| {
                let (s, e) = self.block_range(b);
                !self.is_zero_block(s, e)
            })
            .collect();
        let mut blocks = HashMap::new();
        let mut i = 0;
        while i < wanted.len() {
            let mut j = i + 1;
            while j < wanted.len() && wanted[j] == wanted[j - 1] + 1 {
                j += 1;
            }
            let start = self.block_range(wanted[i]).0;
            let end = self.block_range(wanted[j - 1]).1;
            let mut buf = vec![0u8; (end - start) as usize];
            self.source
                .read_at(&mut buf, start)
                .map_err(|e| io::Error::other(e.to_string()))?;
            self.read.fetch_add(end - start, Ordering::Relaxed);
            for &b in &wanted[i..j] {
                let (s, e) = self.block_range(b);
                blocks.insert(b, buf[(s - start) as usize..(e - start) as usize].to_vec());
            }
            i = j;
        }
        Ok(Window { blocks })
    }
}

impl PatchSource for ChangedBlocks {
    fn block_size(&self) -> u32 {
        self.block_size
    }
    fn changed_blocks(&self) -> Vec<u64> {
        self.blocks.clone()
    }
    fn read_block(&self, index: u64) -> io::Result<Vec<u8>> {
        let (start, end) = self.block_range(index);
        if self.is_zero_block(start, end) {
            return Ok(vec![0u8; (end - start) as usize]);
        }
        let w = index * self.block_size as u64 / WINDOW;
        // One reader per window: the others wait for it and take their blocks from it.
        let slot = self
            .windows
            .lock()
            .expect("window lock")
            .entry(w)
            .or_default()
            .clone();
        let mut slot = slot.lock().expect("window slot lock");
        if slot.is_none() {
            *slot = Some(self.read_window(w)?);
        }
        let win = slot.as_mut().expect("window just read");
        let data = match win.blocks.remove(&index) {
            Some(d) => d,
            None => {
                // Asked for twice: read it alone.
                let mut buf = vec![0u8; (end - start) as usize];
                self.source
                    .read_at(&mut buf, start)
                    .map_err(|e| io::Error::other(e.to_string()))?;
                self.read.fetch_add(end - start, Ordering::Relaxed);
                buf
            }
        };
        if win.blocks.is_empty() {
            self.windows.lock().expect("window lock").remove(&w);
        }
        Ok(data)
    }
}

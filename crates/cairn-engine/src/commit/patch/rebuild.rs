//! Rebuilding the touched segments of a patch: each worker turns a segment's base leaf plus
//! its changed blocks into a new leaf (the fast path replaces whole chunks, otherwise the
//! segment is materialized and re-chunked), the blobs go to commit's packer, and the tree is
//! built over the full segment → leaf map.

use std::collections::{BTreeMap, HashSet};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use cairn_format::config::{Chunker, RepoConfig};
use cairn_format::node::{Extent, Leaf};
use cairn_format::pack::BlobKind;
use cairn_format::summary::ProbeKey;
use cairn_format::version::CommitStats;
use cairn_format::Id;
use cairn_repo::Repo;
use crossbeam_channel::{bounded, Sender};
use tokio::runtime::Handle;
use tokio::task::JoinSet;

use super::PatchSource;
use crate::chunker::{chunk_ranges, is_zero};
use crate::commit::{encode, pack_blobs, CommitProgress, Dedup, EncodedBlob};
use crate::error::{EngineError, EngineResult};
use crate::tree::{build_tree, read_leaf, segment_count, TreeLeaf};

/// Base chunk reads in flight while materializing one segment.
const READS_IN_FLIGHT: usize = 16;

/// A segment to rebuild.
pub(super) struct SegmentTask {
    pub(super) segment: u64,
    pub(super) base_leaf: Option<Id>,
    /// Changed blocks overlapping the segment, sorted.
    pub(super) blocks: Vec<u64>,
}

pub(super) struct Context<'a> {
    pub(super) repo: &'a Arc<Repo>,
    pub(super) handle: Handle,
    pub(super) config: &'a RepoConfig,
    pub(super) patch: &'a dyn PatchSource,
    pub(super) block_size: u64,
    pub(super) new_size: u64,
    pub(super) base_size: u64,
    /// Format 2's dedup mode for the touched segments.
    pub(super) dedup: crate::commit::DedupMode,
}

/// Summary keys of what the rebuilt segments and the tree refer to.
#[derive(Default)]
pub(super) struct Keys {
    /// Chunks of the rebuilt leaves.
    pub(super) chunks: Vec<ProbeKey>,
    /// Chunks of the base's versions of the rebuilt leaves (to bracket the new tree's count
    /// of distinct chunks).
    pub(super) old_chunks: Vec<ProbeKey>,
    /// Every interior node of the new tree.
    pub(super) interior: Vec<ProbeKey>,
}

pub(super) struct Built {
    pub(super) root: Option<Id>,
    pub(super) height: u8,
    /// Figures of the rebuilt segments: before (base) and after.
    pub(super) old: CommitStats,
    pub(super) new: CommitStats,
    pub(super) keys: Keys,
    pub(super) packs: Vec<(Id, Vec<cairn_format::pack::BlobEntry>)>,
    pub(super) pack_bytes: u64,
    pub(super) reused: HashSet<Id>,
}

/// What one worker made of one segment.
struct SegmentOut {
    segment: u64,
    leaf: Option<Id>,
    chunks: Vec<ProbeKey>,
    old_chunks: Vec<ProbeKey>,
    old: CommitStats,
    new: CommitStats,
}

/// Rebuilds the touched segments on worker threads, then the tree, with the blobs going to
/// commit's packer. Runs on a blocking thread; `leaves` is updated to the new tree's map.
pub(super) fn run(
    ctx: &Context<'_>,
    tasks: &[SegmentTask],
    leaves: &mut BTreeMap<u64, TreeLeaf>,
) -> EngineResult<Built> {
    let workers = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .min(tasks.len())
        .max(1);
    let (blob_tx, blob_rx) = bounded::<EncodedBlob>(workers * 16);
    let dedup = Dedup::new(ctx.repo, None);
    let next = AtomicUsize::new(0);
    let cancel = AtomicBool::new(false);
    let progress = CommitProgress::default();

    std::thread::scope(|s| -> EngineResult<Built> {
        let packer = {
            let (repo, handle, config, progress) =
                (ctx.repo.clone(), ctx.handle.clone(), ctx.config, &progress);
            s.spawn(move || pack_blobs(repo, handle, config, blob_rx, 3, progress))
        };
        let mut handles = Vec::new();
        for _ in 0..workers {
            let (blob_tx, dedup, next, cancel) = (blob_tx.clone(), &dedup, &next, &cancel);
            handles.push(s.spawn(move || -> EngineResult<Vec<SegmentOut>> {
                let mut outs = Vec::new();
                while !cancel.load(Ordering::Relaxed) {
                    let Some(task) = tasks.get(next.fetch_add(1, Ordering::Relaxed)) else {
                        break;
                    };
                    match rebuild_segment(ctx, dedup, task, &blob_tx) {
                        Ok(out) => outs.push(out),
                        Err(e) => {
                            cancel.store(true, Ordering::Relaxed);
                            return Err(e);
                        }
                    }
                }
                Ok(outs)
            }));
        }

        let mut worker_error = None;
        let mut old = CommitStats::default();
        let mut new = CommitStats::default();
        let mut keys = Keys::default();
        for h in handles {
            match h.join().expect("patch worker panicked") {
                Err(e) => {
                    worker_error.get_or_insert(e);
                }
                Ok(outs) => {
                    for o in outs {
                        match o.leaf {
                            Some(id) => leaves.insert(o.segment, TreeLeaf::from(id)),
                            None => leaves.remove(&o.segment),
                        };
                        keys.chunks.extend(o.chunks);
                        keys.old_chunks.extend(o.old_chunks);
                        old.add_chunks(&o.old);
                        new.add_chunks(&o.new);
                    }
                }
            }
        }
        let tree = worker_error.is_none().then(|| {
            build_tree(
                leaves,
                segment_count(ctx.new_size, ctx.config.segment_size),
                ctx.config.fanout,
                Id::of,
                |id, bytes| {
                    keys.interior.push(ProbeKey::of(&id));
                    if dedup.claim(&id) {
                        // A send fails only if the packer stopped; its error is reported below.
                        let _ = blob_tx.send(encode(id, BlobKind::Node, &bytes, ctx.config));
                    }
                },
            )
        });
        drop(blob_tx);
        let packed = packer.join().expect("packer thread panicked");
        // The root cause first: a store error makes the workers fail with "packer stopped".
        let (packs, pack_bytes) = packed?;
        if let Some(e) = worker_error {
            return Err(e);
        }
        let (root, height) = tree.expect("built when no error");
        Ok(Built {
            root,
            height,
            old,
            new,
            keys,
            packs,
            pack_bytes,
            reused: std::mem::take(&mut *dedup.reused.lock().expect("dedup lock")),
        })
    })
}

/// How a chunk slot of a segment is filled on the fast path.
enum Slot {
    Block(u64),
    Zero,
    Base(Id),
}

fn rebuild_segment(
    ctx: &Context<'_>,
    dedup: &Dedup<'_>,
    task: &SegmentTask,
    blob_tx: &Sender<EncodedBlob>,
) -> EngineResult<SegmentOut> {
    let segment_size = ctx.config.segment_size as u64;
    let start = task.segment * segment_size;
    let new_len = (ctx.new_size - start).min(segment_size) as usize;
    let old_len = ctx.base_size.saturating_sub(start).min(segment_size) as usize;
    let base = match &task.base_leaf {
        None => {
            // An absent leaf: the segment is all zeros.
            let mut zeros = Leaf::default();
            zeros.push(Extent::Zero {
                len: old_len as u32,
            });
            zeros
        }
        Some(id) => {
            let leaf = ctx.handle.block_on(read_leaf(ctx.repo, id))?;
            if leaf.len() != old_len as u64 {
                return Err(EngineError::Manifest(format!(
                    "leaf {id} of segment {} covers {} bytes where {old_len} were expected",
                    task.segment,
                    leaf.len()
                )));
            }
            leaf
        }
    };
    let mut old = CommitStats::default();
    let mut old_chunks = Vec::new();
    for e in &base.extents {
        if let Extent::Chunk { id, len } = e {
            old.chunks += 1;
            old.data_bytes += *len as u64;
            old_chunks.push(ProbeKey::of(id));
        }
    }

    let mut b = LeafBuilder {
        ctx,
        dedup,
        blob_tx,
        leaf: Leaf::default(),
        chunks: Vec::new(),
        stats: CommitStats::default(),
    };
    match fast_plan(ctx, task, &base, new_len, old_len) {
        Some(plan) => {
            for (slot, len) in plan {
                match slot {
                    Slot::Zero => b.leaf.push(Extent::Zero { len }),
                    Slot::Base(id) => b.reuse(id, len),
                    Slot::Block(index) => b.add(&read_block(ctx, index)?)?,
                }
            }
        }
        None => {
            let data = materialize(ctx, task, &base, start, new_len)?;
            for r in chunk_ranges(ctx.config, &data) {
                b.add(&data[r])?;
            }
        }
    }
    let LeafBuilder {
        leaf,
        chunks,
        stats,
        ..
    } = b;

    let leaf_id = if leaf.is_all_zero() {
        None
    } else {
        let bytes = leaf.encode();
        let id = Id::of(&bytes);
        if dedup.claim(&id) {
            blob_tx
                .send(encode(id, BlobKind::Node, &bytes, ctx.config))
                .map_err(|_| EngineError::internal("packer", "stopped early"))?;
        }
        Some(id)
    };
    Ok(SegmentOut {
        segment: task.segment,
        leaf: leaf_id,
        chunks,
        old_chunks,
        old,
        new: stats,
    })
}

/// The new leaf of a segment, chunk by chunk, as `commit` builds it.
struct LeafBuilder<'a> {
    ctx: &'a Context<'a>,
    dedup: &'a Dedup<'a>,
    blob_tx: &'a Sender<EncodedBlob>,
    leaf: Leaf,
    chunks: Vec<ProbeKey>,
    stats: CommitStats,
}

impl LeafBuilder<'_> {
    /// A chunk of new data: a zero run if it is all zeros, else stored unless the repository
    /// (or this commit) already has it.
    fn add(&mut self, data: &[u8]) -> EngineResult<()> {
        let len = data.len() as u32;
        if is_zero(data) {
            self.leaf.push(Extent::Zero { len });
            return Ok(());
        }
        let id = Id::of(data);
        self.push_chunk(id, len);
        if self.dedup.claim(&id) {
            self.stats.new_chunks += 1;
            self.stats.new_chunk_bytes += len as u64;
            self.blob_tx
                .send(encode(id, BlobKind::Data, data, self.ctx.config))
                .map_err(|_| EngineError::internal("packer", "stopped early"))?;
        }
        Ok(())
    }

    /// A base chunk kept as it is (referred to, not stored).
    fn reuse(&mut self, id: Id, len: u32) {
        self.dedup.reused.lock().expect("dedup lock").insert(id);
        self.push_chunk(id, len);
    }

    fn push_chunk(&mut self, id: Id, len: u32) {
        self.leaf.push(Extent::Chunk { id, len });
        self.chunks.push(ProbeKey::of(&id));
        self.stats.chunks += 1;
        self.stats.data_bytes += len as u64;
    }
}

/// The fast path's plan for a segment (slot, length), or `None` if some slot cannot be
/// filled without reading base data: the chunker is not fixed, blocks are not chunks, a base
/// chunk does not line up with its slot (a grown last chunk) or may not be reused (a pending
/// GC is deleting it).
fn fast_plan(
    ctx: &Context<'_>,
    task: &SegmentTask,
    base: &Leaf,
    new_len: usize,
    old_len: usize,
) -> Option<Vec<(Slot, u32)>> {
    let chunk = ctx.config.chunk_size as usize;
    if ctx.config.chunker != Chunker::Fixed || ctx.block_size != chunk as u64 {
        return None;
    }
    let first_block = task.segment * (ctx.config.segment_size as u64 / chunk as u64);
    // Base extents with their start offsets.
    let mut extents = Vec::with_capacity(base.extents.len());
    let mut pos = 0usize;
    for e in &base.extents {
        extents.push((pos, *e));
        pos += e.len() as usize;
    }
    let mut cursor = 0;
    let mut plan = Vec::with_capacity(new_len.div_ceil(chunk));
    for (k, slot_start) in (0..new_len).step_by(chunk).enumerate() {
        let slot_end = (slot_start + chunk).min(new_len);
        let len = (slot_end - slot_start) as u32;
        let block = first_block + k as u64;
        if task.blocks.binary_search(&block).is_ok() {
            plan.push((Slot::Block(block), len));
            continue;
        }
        if slot_start >= old_len {
            plan.push((Slot::Zero, len)); // past the base's end: zeros
            continue;
        }
        while extents[cursor].0 + extents[cursor].1.len() as usize <= slot_start {
            cursor += 1;
        }
        let (ext_start, ext) = extents[cursor];
        let ext_end = ext_start + ext.len() as usize;
        match ext {
            Extent::Zero { .. } if ext_end >= slot_end.min(old_len) => plan.push((Slot::Zero, len)),
            Extent::Chunk { id, .. }
                if ext_start == slot_start && ext_end == slot_end && ctx.repo.has_blob(&id) =>
            {
                plan.push((Slot::Base(id), len))
            }
            _ => return None,
        }
    }
    Some(plan)
}

/// The new contents of a segment: the base's (chunks fully overwritten by the patch are not
/// read), zeros past its end, and the changed blocks over them.
fn materialize(
    ctx: &Context<'_>,
    task: &SegmentTask,
    base: &Leaf,
    start: u64,
    new_len: usize,
) -> EngineResult<Vec<u8>> {
    let end = start + new_len as u64;
    // The changed ranges of the segment, merged (segment offsets).
    let mut covered: Vec<(usize, usize)> = Vec::new();
    for &b in &task.blocks {
        let lo = (b * ctx.block_size).max(start) - start;
        let hi = ((b + 1) * ctx.block_size).min(end) - start;
        match covered.last_mut() {
            Some(last) if last.1 >= lo as usize => last.1 = last.1.max(hi as usize),
            _ => covered.push((lo as usize, hi as usize)),
        }
    }
    let overwritten = |a: usize, b: usize| covered.iter().any(|&(lo, hi)| lo <= a && b <= hi);

    let mut buf = vec![0u8; new_len];
    let mut wanted = Vec::new();
    let mut pos = 0usize;
    for e in &base.extents {
        let len = e.len() as usize;
        if let Extent::Chunk { id, .. } = e {
            if !overwritten(pos, pos + len) {
                wanted.push((pos, len, *id));
            }
        }
        pos += len;
    }
    let repo = ctx.repo;
    let read = ctx.handle.block_on(async {
        let mut out = Vec::with_capacity(wanted.len());
        for batch in wanted.chunks(READS_IN_FLIGHT) {
            let mut set = JoinSet::new();
            for &(pos, len, id) in batch {
                let repo = repo.clone();
                set.spawn(async move { repo.read_blob(&id).await.map(|d| (pos, len, id, d)) });
            }
            while let Some(r) = set.join_next().await {
                out.push(r.map_err(|e| EngineError::internal("chunk reader", e))??);
            }
        }
        Ok::<_, EngineError>(out)
    })?;
    for (pos, len, id, data) in read {
        if data.len() != len {
            return Err(EngineError::Manifest(format!(
                "chunk {id} has {} bytes where its leaf says {len}",
                data.len()
            )));
        }
        buf[pos..pos + len].copy_from_slice(&data);
    }
    lay_blocks(ctx, &task.blocks, start, &mut buf)?;
    Ok(buf)
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

//! COMMIT of a patch: a new version made of a base version plus a set of changed fixed-size
//! blocks (BlobSeer's COMMIT with shadowing; the writable NBD export commits its overlay this
//! way).
//!
//! Only what changed is read and stored:
//! - the base's segment → leaf map comes from its interior nodes alone (no leaf, no chunk);
//! - a segment without changed blocks keeps its leaf id, unread;
//! - a touched segment reads its base leaf (metadata). With the fixed chunker and blocks of
//!   the chunk size, a changed block replaces the base chunk at the same index exactly, so no
//!   base chunk data is read; otherwise (FastCDC, other block sizes, a base chunk that does
//!   not line up, a grown last segment) the segment is materialized — base chunks not fully
//!   overwritten are read — and re-chunked like `commit` would;
//! - the tree is rebuilt with [`build_tree`] over the full map, so every unchanged interior
//!   node gets its old id (content addressing) and only the paths to changed leaves are new.
//!
//! The leaves produced are exactly the ones `commit` would produce for the same content, so
//! a patched version shares its nodes with a full commit of the same image bytes.
//! Publication is shared with `commit`: packs → index → reference summary → version → head.

use std::collections::{BTreeMap, HashSet};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use cairn_format::config::{Chunker, RepoConfig};
use cairn_format::name::validate_image_name;
use cairn_format::node::{Extent, Leaf};
use cairn_format::pack::BlobKind;
use cairn_format::summary::{probes_for, Bloom, ProbeKey, Summary, BITS_PER_NODE, NODE_PROBES};
use cairn_format::version::{CommitStats, VersionRecord};
use cairn_format::Id;
use cairn_repo::Repo;
use crossbeam_channel::{bounded, Sender};
use tokio::runtime::{Handle, RuntimeFlavor};
use tokio::task::JoinSet;

use crate::chunker::{chunk_ranges, is_zero};
use crate::commit::{
    encode, pack_blobs, publish, CommitProgress, CommitResult, Dedup, EncodedBlob, PipelineOutput,
};
use crate::error::{EngineError, EngineResult};
use crate::tree::{build_tree, read_interior, read_leaf, segment_count};

/// Changed blocks to commit on top of a base. Block `i` covers bytes
/// `[i*block_size, (i+1)*block_size) ∩ [0, new_size)`.
pub trait PatchSource: Send + Sync {
    /// Bytes per block. Blocks of the repository's chunk size with the fixed chunker give the
    /// fast path (no base data read); any other size works but materializes touched segments.
    fn block_size(&self) -> u32;
    /// Indexes of the changed blocks (sorted and deduplicated by the caller or not: they are
    /// sorted and deduplicated here).
    fn changed_blocks(&self) -> Vec<u64>;
    /// The full new contents of a changed block: `block_size` bytes, or fewer for the last
    /// block of the image.
    fn read_block(&self, index: u64) -> io::Result<Vec<u8>>;
}

#[derive(Debug, Clone, Default)]
pub struct PatchOptions {
    pub message: String,
    /// The base's segment → leaf map, when the caller has already loaded it (an incremental
    /// commit needs it first to drop zero writes over absent segments): saves walking the
    /// base's interior nodes a second time. Must be `leaf_map` of the base passed along.
    pub base_leaves: Option<BTreeMap<u64, Id>>,
}

/// Base chunk reads in flight while materializing one segment.
const READS_IN_FLIGHT: usize = 16;
/// Manifest node reads in flight while loading a tree's leaf map or leaves.
const NODE_READS_IN_FLIGHT: usize = 32;

/// The version a patch applies to: its size, its segment → leaf map (interior nodes only)
/// and its figures; an empty base for a new image.
struct PatchBase {
    origin: Option<Id>,
    size: u64,
    leaves: BTreeMap<u64, Id>,
    stats: CommitStats,
    root: Option<Id>,
}

impl PatchBase {
    async fn open(
        repo: &Arc<Repo>,
        config: &RepoConfig,
        base: Option<&(Id, VersionRecord)>,
        new_size: u64,
        options: &mut PatchOptions,
    ) -> EngineResult<PatchBase> {
        let Some((id, record)) = base else {
            return Ok(PatchBase {
                origin: None,
                size: new_size,
                leaves: BTreeMap::new(),
                stats: CommitStats::default(),
                root: None,
            });
        };
        if record.root.is_some()
            && (record.segment_size != config.segment_size || record.fanout != config.fanout)
        {
            return Err(EngineError::BadRef(format!(
                "cannot patch {}@{}: its tree geometry (segment size {}, fanout {}) is not the \
                 repository's (segment size {}, fanout {})",
                record.image,
                record.seq,
                record.segment_size,
                record.fanout,
                config.segment_size,
                config.fanout
            )));
        }
        if new_size < record.logical_size {
            return Err(EngineError::BadRef(format!(
                "cannot patch {}@{} to {new_size} bytes: it has {} bytes and shrinking is not \
                 supported",
                record.image, record.seq, record.logical_size
            )));
        }
        let leaves = match options.base_leaves.take() {
            Some(leaves) => leaves,
            None => leaf_map(repo, record).await?,
        };
        Ok(PatchBase {
            origin: Some(*id),
            size: record.logical_size,
            leaves,
            stats: record.stats,
            root: record.root,
        })
    }
}

/// The segments to rebuild and the changed blocks of each (sorted, deduplicated), plus the
/// changed blocks themselves: every segment a changed block touches, the base's partial last
/// segment of a grown image, and every base leaf this session may not reuse (a pending GC is
/// deleting it).
fn segment_tasks(
    repo: &Repo,
    patch: &dyn PatchSource,
    new_size: u64,
    segment_size: u64,
    base_size: u64,
    leaves: &BTreeMap<u64, Id>,
) -> EngineResult<(Vec<SegmentTask>, Vec<u64>)> {
    let block_size = patch.block_size() as u64;
    let mut blocks = patch.changed_blocks();
    blocks.sort_unstable();
    blocks.dedup();
    let block_count = new_size.div_ceil(block_size);
    if let Some(&last) = blocks.last() {
        if last >= block_count {
            return Err(EngineError::BadInput(format!(
                "patch block {last} is past the end of the image ({new_size} bytes, {block_count} \
                 blocks of {block_size})"
            )));
        }
    }
    let mut touched: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for &b in &blocks {
        let start = b * block_size;
        let end = (start + block_size).min(new_size);
        for seg in start / segment_size..=(end - 1) / segment_size {
            touched.entry(seg).or_default().push(b);
        }
    }
    // A grown image: the base's last segment, if partial, gets longer (its last chunk too).
    if new_size > base_size && !base_size.is_multiple_of(segment_size) {
        let seg = base_size / segment_size;
        if leaves.contains_key(&seg) {
            touched.entry(seg).or_default();
        }
    }
    // A base leaf this session may not reuse (a pending GC is deleting it) is rewritten, and
    // its chunks are checked the same way.
    for (&seg, leaf) in leaves {
        if !repo.has_blob(leaf) {
            touched.entry(seg).or_default();
        }
    }
    let tasks = touched
        .into_iter()
        .map(|(segment, blocks)| SegmentTask {
            segment,
            base_leaf: leaves.get(&segment).copied(),
            blocks,
        })
        .collect();
    Ok((tasks, blocks))
}

/// Publishes a new version of `image` whose contents are `base` (`None` = all zeros) with the
/// changed blocks of `patch` applied, of size `new_size` (≥ the base's size: an image may
/// grow, the new bytes are zeros unless patched; shrinking is refused).
///
/// The parent is the current head of `image` (re-parenting on a lost race, like `commit`);
/// when `image` has no head yet, the parent is the base version and the seq 1, like a clone,
/// so the new image's history starts at the base.
///
/// Stats: `data_bytes` and `chunks` are the base's figures adjusted by the touched segments
/// (exact when the base's are); `new_chunks`, `new_chunk_bytes` and `stored_bytes` are exact
/// for this commit.
///
/// Needs a multi-threaded tokio runtime (hashing, compression and `read_block` run on
/// blocking threads borrowing `patch`). A `read_block` error fails the commit and publishes
/// nothing.
pub async fn commit_patch(
    repo: Arc<Repo>,
    image: &str,
    base: Option<(Id, VersionRecord)>,
    new_size: u64,
    patch: &dyn PatchSource,
    mut options: PatchOptions,
) -> EngineResult<CommitResult> {
    validate_image_name(image)?;
    let time_ns = cairn_repo::session::now_ns();
    let handle = Handle::current();
    if handle.runtime_flavor() != RuntimeFlavor::MultiThread {
        return Err(EngineError::internal(
            "commit_patch",
            "needs a multi-threaded tokio runtime",
        ));
    }
    let config = repo.config().clone();
    let block_size = patch.block_size() as u64;
    if block_size == 0 {
        return Err(EngineError::BadInput("patch block size is 0".into()));
    }
    let segment_size = config.segment_size as u64;

    let PatchBase {
        origin,
        size: base_size,
        mut leaves,
        stats: base_stats,
        root: base_root,
    } = PatchBase::open(&repo, &config, base.as_ref(), new_size, &mut options).await?;
    let (tasks, blocks) = segment_tasks(&repo, patch, new_size, segment_size, base_size, &leaves)?;
    // Leaves kept as they are: referred to without being stored.
    let mut reused: HashSet<Id> = leaves
        .iter()
        .filter(|(seg, _)| tasks.binary_search_by_key(seg, |t| &t.segment).is_err())
        .map(|(_, id)| *id)
        .collect();
    let untouched_leaves = reused.len();

    let ctx = Context {
        repo: &repo,
        handle: handle.clone(),
        config: &config,
        patch,
        block_size,
        new_size,
        base_size,
    };
    let built = tokio::task::block_in_place(|| run(&ctx, &tasks, &mut leaves))?;
    reused.extend(built.reused);

    let root = built.root;
    let summary = match root {
        None => None,
        Some(_) => Some(
            summarize(
                &repo,
                base_root,
                &leaves,
                &tasks,
                &built.keys,
                untouched_leaves,
            )
            .await?,
        ),
    };
    let stats = CommitStats {
        data_bytes: (base_stats.data_bytes + built.new.data_bytes)
            .saturating_sub(built.old.data_bytes),
        chunks: (base_stats.chunks + built.new.chunks).saturating_sub(built.old.chunks),
        new_chunks: built.new.new_chunks,
        new_chunk_bytes: built.new.new_chunk_bytes,
        stored_bytes: 0,
    };
    tracing::debug!(
        image,
        segments = tasks.len(),
        blocks = blocks.len(),
        new_chunks = stats.new_chunks,
        "patch built"
    );
    let out = PipelineOutput {
        root,
        summary,
        height: built.height,
        size: new_size,
        stats,
        packs: built.packs,
        pack_bytes: built.pack_bytes,
        reused,
    };
    publish(
        &repo,
        image,
        out,
        time_ns,
        &options.message,
        origin,
        &CommitProgress::default(),
    )
    .await
}

/// A segment to rebuild.
struct SegmentTask {
    segment: u64,
    base_leaf: Option<Id>,
    /// Changed blocks overlapping the segment, sorted.
    blocks: Vec<u64>,
}

struct Context<'a> {
    repo: &'a Arc<Repo>,
    handle: Handle,
    config: &'a RepoConfig,
    patch: &'a dyn PatchSource,
    block_size: u64,
    new_size: u64,
    base_size: u64,
}

/// Summary keys of what the rebuilt segments and the tree refer to.
#[derive(Default)]
struct Keys {
    /// Chunks of the rebuilt leaves.
    chunks: Vec<ProbeKey>,
    /// Chunks of the base's versions of the rebuilt leaves (to bracket the new tree's count
    /// of distinct chunks).
    old_chunks: Vec<ProbeKey>,
    /// Every interior node of the new tree.
    interior: Vec<ProbeKey>,
}

struct Built {
    root: Option<Id>,
    height: u8,
    /// Figures of the rebuilt segments: before (base) and after.
    old: CommitStats,
    new: CommitStats,
    keys: Keys,
    packs: Vec<(Id, Vec<cairn_format::pack::BlobEntry>)>,
    pack_bytes: u64,
    reused: HashSet<Id>,
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
fn run(
    ctx: &Context<'_>,
    tasks: &[SegmentTask],
    leaves: &mut BTreeMap<u64, Id>,
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
                            Some(id) => leaves.insert(o.segment, id),
                            None => leaves.remove(&o.segment),
                        };
                        keys.chunks.extend(o.chunks);
                        keys.old_chunks.extend(o.old_chunks);
                        for (sum, part) in [(&mut old, &o.old), (&mut new, &o.new)] {
                            sum.data_bytes += part.data_bytes;
                            sum.chunks += part.chunks;
                            sum.new_chunks += part.new_chunks;
                            sum.new_chunk_bytes += part.new_chunk_bytes;
                        }
                    }
                }
            }
        }
        let tree = worker_error.is_none().then(|| {
            build_tree(
                leaves,
                segment_count(ctx.new_size, ctx.config.segment_size),
                ctx.config.fanout,
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
    for &b in &task.blocks {
        let data = read_block(ctx, b)?;
        let block_start = b * ctx.block_size;
        let lo = block_start.max(start);
        let hi = (block_start + data.len() as u64).min(end);
        buf[(lo - start) as usize..(hi - start) as usize]
            .copy_from_slice(&data[(lo - block_start) as usize..(hi - block_start) as usize]);
    }
    Ok(buf)
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

/// The segment → leaf map of a version, read from its interior nodes only (level by level,
/// several reads in flight).
pub async fn leaf_map(repo: &Arc<Repo>, record: &VersionRecord) -> EngineResult<BTreeMap<u64, Id>> {
    let Some(root) = record.root else {
        return Ok(BTreeMap::new());
    };
    let f = record.fanout as u64;
    let mut frontier: Vec<(u64, Id)> = vec![(0, root)];
    for level in (1..=record.height).rev() {
        let mut next = Vec::new();
        for batch in frontier.chunks(NODE_READS_IN_FLIGHT) {
            let mut set = JoinSet::new();
            for &(index, id) in batch {
                let repo = repo.clone();
                set.spawn(
                    async move { read_interior(&repo, &id, level).await.map(|n| (index, n)) },
                );
            }
            while let Some(r) = set.join_next().await {
                let (index, node) = r.map_err(|e| EngineError::internal("node reader", e))??;
                next.extend(
                    node.children
                        .iter()
                        .map(|&(slot, child)| (index * f + slot as u64, child)),
                );
            }
        }
        frontier = next;
    }
    Ok(frontier.into_iter().collect())
}

/// The reference summary of the new tree. It must contain every chunk and node of the tree
/// (GC's fast deletion trusts it); a superset is safe.
///
/// When every leaf was rebuilt, it is built from the keys at hand. Otherwise the base's
/// summary is reused if its filters have the geometry `Summary::build` would choose for the
/// new tree (the count of distinct chunks is bracketed between "the base's minus the chunks
/// the rebuilt leaves dropped" and "the base's plus the ones they gained"; both ends must
/// agree; the base's count is exact when its summary was built by `commit`): the
/// new chunks and nodes are OR-ed into it, and stale ids of replaced chunks and nodes only add
/// false positives. Otherwise it is rebuilt by reading every leaf of the new tree (metadata).
async fn summarize(
    repo: &Arc<Repo>,
    base_root: Option<Id>,
    leaves: &BTreeMap<u64, Id>,
    tasks: &[SegmentTask],
    keys: &Keys,
    untouched_leaves: usize,
) -> EngineResult<Summary> {
    let bits = repo.config().summary_bits;
    let mut nodes: Vec<ProbeKey> = leaves.values().map(ProbeKey::of).collect();
    nodes.extend(&keys.interior);
    nodes.sort_unstable();
    nodes.dedup();
    if untouched_leaves == 0 {
        return Ok(Summary::build(keys.chunks.clone(), nodes, bits));
    }
    let mut new_chunks = keys.chunks.clone();
    new_chunks.sort_unstable();
    new_chunks.dedup();
    let mut old_chunks = keys.old_chunks.clone();
    old_chunks.sort_unstable();
    old_chunks.dedup();
    // With U the untouched leaves' chunks, T and T' the rebuilt leaves' before and after:
    // |U ∪ T| - |T \ T'| <= |U ∪ T'| <= |U ∪ T| + |T' \ T|.
    let removed = old_chunks
        .iter()
        .filter(|k| new_chunks.binary_search(k).is_err())
        .count() as u64;
    let added = new_chunks
        .iter()
        .filter(|k| old_chunks.binary_search(k).is_err())
        .count() as u64;

    if let Some(root) = base_root {
        match repo.load_summary(&root).await {
            Ok(Some((mut summary, _))) => {
                let low = summary.chunk_items.saturating_sub(removed);
                let high = summary.chunk_items + added;
                let chunk_geometry =
                    |n| Bloom::with_capacity(n, bits as u16, probes_for(bits)).geometry();
                let node_geometry =
                    Bloom::with_capacity(nodes.len() as u64, BITS_PER_NODE, NODE_PROBES).geometry();
                let g = chunk_geometry(low);
                if g == chunk_geometry(high)
                    && g == summary.chunks.geometry()
                    && node_geometry == summary.nodes.geometry()
                {
                    for k in &new_chunks {
                        summary.chunks.insert(*k);
                    }
                    for k in &nodes {
                        summary.nodes.insert(*k);
                    }
                    // An estimate of the distinct chunks (for sizing and the leak estimate).
                    summary.chunk_items = (summary.chunk_items + added).saturating_sub(removed);
                    summary.node_items = nodes.len() as u64;
                    return Ok(summary);
                }
            }
            Ok(None) => tracing::debug!(%root, "base has no reference summary; rebuilding"),
            Err(e) => tracing::warn!(%root, "{e}; rebuilding the reference summary"),
        }
    }

    // Rebuild: the chunks of every leaf kept from the base (the rebuilt ones are in `keys`).
    let kept: Vec<Id> = leaves
        .iter()
        .filter(|(seg, _)| tasks.binary_search_by_key(seg, |t| &t.segment).is_err())
        .map(|(_, id)| *id)
        .collect();
    let mut chunks = new_chunks;
    for batch in kept.chunks(NODE_READS_IN_FLIGHT) {
        let mut set = JoinSet::new();
        for &id in batch {
            let repo = repo.clone();
            set.spawn(async move { read_leaf(&repo, &id).await });
        }
        while let Some(r) = set.join_next().await {
            let leaf = r.map_err(|e| EngineError::internal("leaf reader", e))??;
            chunks.extend(leaf.extents.iter().filter_map(|e| match e {
                Extent::Chunk { id, .. } => Some(ProbeKey::of(id)),
                Extent::Zero { .. } => None,
            }));
        }
    }
    Ok(Summary::build(chunks, nodes, bits))
}

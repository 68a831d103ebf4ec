//! The commit pipeline: dedup decides per chunk (4 KiB by default, the file systems' block
//! size), compression works per group of a segment's neighbouring new chunks (the VM-centric
//! paper's chunk groups, `002_…` §3.1).
//!
//! ```text
//!  reader ──segments──▶ workers (×N) ─────────────groups─────────────▶ packer ──packs──▶ uploads
//!  (`reader`)           chunk, zero-detect, BLAKE3,                     data groups and nodes
//!                       dedup (this commit, `dedup/`'s tiers),          in separate packs
//!                       new chunks into groups, zstd per group
//!                            │
//!                            └──leaves (group runs)──▶ collector ──▶ tree ──▶ index run ──▶ version ──▶ ref
//! ```
//! A worker builds and compresses the groups of its own segment, so compression runs on every
//! core and a group holds neighbours on disk. A leaf names group ids, known once a group is
//! built; a chunk another worker of this commit claimed first waits for that worker's group.
//! A worker publishes where every chunk of its segment went before it waits for anyone, so
//! every wait ends (or the commit is cancelled). Publication is `publish`'s: packs, index
//! run, summary, version record, head.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use cairn_format::config::RepoConfig;
use cairn_format::crypto::MasterKey;
use cairn_format::group::{group_id, Group, GroupBuilder};
use cairn_format::group_summary::{GroupSummary, Resolved, SummaryBuilder};
use cairn_format::index_run;
use cairn_format::leaf_v2::{RunExtent, RunLeaf};
use cairn_format::version::CommitStats;
use cairn_format::Id;
use cairn_repo::v2::{GroupLocation, GroupPacker, Placement, V2Reader};
use cairn_repo::{Repo, RepoResult};
use crossbeam_channel::{bounded, Receiver, Sender};
use tokio::runtime::Handle;

use super::claims::{Claimed, Claims};
use super::dedup::{DedupMode, DedupTally, SegmentDedup};
use super::packing::Uploader;
use super::parent::ParentLeaves;
use super::pending_entries::{PendingEntries, PendingRun};
use super::reader::read_all;
use super::{CommitOptions, CommitProgress};
use crate::chunker::{chunk_ranges, is_zero};
use crate::error::{EngineError, EngineResult};
use crate::source::{Segment, Source};
use crate::tree::{build_tree, segment_count, TreeLeaf};

/// A built tree whose packs are durable, ready for [`super::publish`].
pub(crate) struct PipelineOutput {
    pub root: Option<Id>,
    /// The tree's reference summary (groups' slots and nodes the tree uses; fast deletion
    /// trusts it).
    pub group_summary: Option<GroupSummary>,
    /// The base's summary resolved, when read: `group_summary` is stored as a delta from it.
    pub summary_base: Option<Resolved>,
    pub height: u8,
    pub size: u64,
    pub stats: CommitStats,
    /// The commit's index run: where its chunks, groups and nodes are.
    pub run: super::pending_entries::PendingRun,
    pub pack_bytes: u64,
    /// Manifest nodes the tree refers to without storing them.
    pub reused: HashSet<Id>,
    /// Segments whose parent's leaf was reused as it is (the parent fast path).
    pub reused_segments: u64,
    /// What each dedup tier found in changed segments.
    pub dedup: super::dedup::DedupTally,
    /// Leaves of the parent reused unread (the fast path), one entry per segment
    /// that reuses one: what they use is not in `group_summary` yet
    /// (`base_summary::complete_summary` adds it).
    pub unread_leaves: Vec<Id>,
}

/// What the packer stores: the data groups a worker built from one segment (sent together,
/// so they lie side by side in a pack and a restore reads a leaf's groups in one request), or
/// a manifest node.
enum Packable {
    Groups(Vec<Group>),
    Node(Id, Vec<u8>),
}

/// What one worker learned about one segment.
struct SegmentResult {
    index: u64,
    leaf: Option<TreeLeaf>,
    /// The leaf's group runs (group, first slot, count), for the reference summary; empty
    /// for a parent's leaf reused unread (`unread`).
    runs: Vec<(Id, u16, u16)>,
    stats: CommitStats,
    /// The parent's leaf, reused (the fast path).
    reused: bool,
    /// Reused without reading it: its runs come from the parent's summary.
    unread: bool,
}

/// What a commit's workers share: where the chunks this commit stores went, and which nodes
/// it stores.
pub(super) struct GroupDedup<'a> {
    pub(super) reader: &'a V2Reader,
    handle: &'a Handle,
    /// Set when any part of the commit failed: a lookup in flight is abandoned (on a hung
    /// store it would otherwise hold the failed commit for its whole retry budget).
    cancel: &'a AtomicBool,
    /// Chunks this commit stores: their place once their group is built (`None` before).
    claims: Mutex<Claims>,
    placed: Condvar,
    nodes: Mutex<HashSet<Id>>,
    /// Groups found to have a good copy storing every slot (the fast path's check, once).
    complete_groups: Mutex<HashSet<Id>>,
    reused_nodes: Mutex<HashSet<Id>>,
}

/// A chunk this commit claimed before: placed, or another worker's to wait for (its claim
/// is kept until the wait ends, `Claims::find`).
fn before(p: Option<Placement>) -> Claim {
    p.map_or(Claim::Elsewhere, Claim::At)
}

/// What a worker does with a chunk.
enum Claim {
    /// Stored already by this commit: refer to it.
    At(Placement),
    /// Stored before this commit, found by an index lookup: refer to it.
    Indexed(Placement),
    /// Another worker of this commit stores it: wait for its place.
    Elsewhere,
    /// New: this worker stores it.
    Mine,
}

impl GroupDedup<'_> {
    /// Runs a lookup of the repository's index to completion, or until the commit is
    /// cancelled.
    pub(super) fn ask<T>(
        &self,
        lookup: impl std::future::Future<Output = RepoResult<T>>,
    ) -> EngineResult<T> {
        let cancel = self.cancel;
        self.handle.block_on(async {
            tokio::select! {
                r = lookup => r.map_err(EngineError::from),
                () = async {
                    while !cancel.load(Ordering::Relaxed) {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                } => Err(EngineError::internal("worker", "stopped early")),
            }
        })
    }

    /// Claims chunk `id`, which the tiers before did not find: stored by this commit
    /// already, else (exact mode) found by an index lookup, else this worker's to store.
    fn claim(&self, id: &Id, mode: DedupMode) -> EngineResult<Claim> {
        let turns = {
            let mut claims = self.claims.lock().expect("dedup lock");
            if let Some(p) = claims.find(id) {
                return Ok(before(p));
            }
            claims.turns()
        };
        if mode == DedupMode::Exact {
            if let Some(p) = self.ask(self.reader.find_chunk(id))? {
                return Ok(Claim::Indexed(p));
            }
        }
        let mut claims = self.claims.lock().expect("dedup lock");
        Ok(match claims.claim_after_miss(id, turns) {
            Claimed::Before(p) => before(p),
            Claimed::New => Claim::Mine,
        })
    }

    /// Whether this commit stores chunk `id` (placed or not yet).
    pub(super) fn is_claimed(&self, id: &Id) -> bool {
        self.claims.lock().expect("dedup lock").contains(id)
    }

    /// Records that `ids` are slots 0.. of group `group`.
    fn place(&self, ids: &[Id], group: Id) {
        self.claims.lock().expect("dedup lock").place(ids, group);
        self.placed.notify_all();
    }

    /// Where another worker put `id` (waits until its group is built).
    fn wait(&self, id: &Id, cancel: &AtomicBool) -> EngineResult<Placement> {
        let mut claims = self.claims.lock().expect("dedup lock");
        loop {
            if let Some(Some(p)) = claims.get(id) {
                claims.done_waiting(id);
                return Ok(p);
            }
            if cancel.load(Ordering::Relaxed) {
                return Err(EngineError::internal("worker", "stopped early"));
            }
            claims = self
                .placed
                .wait_timeout(claims, Duration::from_millis(50))
                .expect("dedup lock")
                .0;
        }
    }

    /// True if the caller must store manifest node `id` (not in the repository, not claimed).
    fn claim_node(&self, id: &Id) -> EngineResult<bool> {
        if self.nodes.lock().expect("dedup lock").contains(id) {
            return Ok(false);
        }
        if self.handle.block_on(self.reader.find_chunk(id))?.is_some() {
            self.reused_nodes.lock().expect("dedup lock").insert(*id);
            return Ok(false);
        }
        Ok(self.nodes.lock().expect("dedup lock").insert(*id))
    }
}

/// Chunks, hashes, groups and stores `source` and builds its tree; publishes nothing.
/// Segments whose bytes equal a leaf of `parent` reuse it (the parent fast path).
pub(crate) fn run_pipeline(
    repo: Arc<Repo>,
    handle: Handle,
    mut source: Box<dyn Source>,
    options: &CommitOptions,
    progress: &CommitProgress,
    parent: &ParentLeaves,
) -> EngineResult<PipelineOutput> {
    let config = repo.config().clone();
    let feed = |tx: Sender<Segment>, recycle: &Receiver<Vec<u8>>, cancel: &AtomicBool| {
        read_all(source.as_mut(), &config, tx, recycle, cancel, progress)
    };
    run_segments(
        repo,
        handle,
        feed,
        BTreeMap::new(),
        options,
        progress,
        parent,
    )
}

/// What feeds the workers segments: the whole image (a full commit) or only a patch's
/// touched segments. Returns the image's size; sets `cancel` when it fails.
pub(crate) trait Feed:
    FnOnce(Sender<Segment>, &Receiver<Vec<u8>>, &AtomicBool) -> EngineResult<u64> + Send
{
}

impl<F> Feed for F where
    F: FnOnce(Sender<Segment>, &Receiver<Vec<u8>>, &AtomicBool) -> EngineResult<u64> + Send
{
}

/// The format 2 pipeline over the segments `feed` sends; `leaves` holds the leaves of the
/// segments it does not send (a patch's untouched segments; empty for a full commit). A
/// segment sent replaces its entry (or removes it, if it is all zeros now). The stats are
/// the sent segments' only.
pub(crate) fn run_segments(
    repo: Arc<Repo>,
    handle: Handle,
    feed: impl Feed,
    mut leaves: BTreeMap<u64, TreeLeaf>,
    options: &CommitOptions,
    progress: &CommitProgress,
    parent: &ParentLeaves,
) -> EngineResult<PipelineOutput> {
    let config = repo.config().clone();
    let group_size = config
        .v2
        .ok_or_else(|| EngineError::internal("commit", "format 2 pipeline on format 1"))?
        .group_size as usize;
    let reader = repo
        .v2()
        .cloned()
        .ok_or_else(|| EngineError::internal("commit", "format 2 repository without reader"))?;
    let workers = match options.workers {
        0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
        n => n,
    };
    let (seg_tx, seg_rx) = bounded::<Segment>(workers * 2);
    let (recycle_tx, recycle_rx) = bounded::<Vec<u8>>(workers * 4);
    let (pack_tx, pack_rx) = bounded::<Packable>(workers * 8);
    let (result_tx, result_rx) = bounded::<SegmentResult>(workers * 4);
    let cancel = AtomicBool::new(false);
    let dedup = GroupDedup {
        reader: &reader,
        handle: &handle,
        cancel: &cancel,
        claims: Mutex::new(options.claims(|| scratch_dir(&repo, &handle))?),
        placed: Condvar::new(),
        nodes: Mutex::new(HashSet::new()),
        complete_groups: Mutex::new(HashSet::new()),
        reused_nodes: Mutex::new(HashSet::new()),
    };

    let cancel = &cancel;
    std::thread::scope(|s| -> EngineResult<PipelineOutput> {
        let read = s.spawn(|| feed(seg_tx, &recycle_rx, cancel));
        let mut worker_handles = Vec::new();
        for _ in 0..workers {
            let worker = Worker {
                config: &config,
                key: repo.key(),
                group_size,
                dedup: &dedup,
                parent,
                pack_tx: pack_tx.clone(),
                cancel,
                progress,
            };
            let (seg_rx, result_tx, recycle_tx) =
                (seg_rx.clone(), result_tx.clone(), recycle_tx.clone());
            worker_handles.push(s.spawn(move || {
                let r = worker.run(&seg_rx, &result_tx, &recycle_tx, options.dedup);
                if r.is_err() {
                    cancel.store(true, Ordering::Relaxed);
                }
                r
            }));
        }
        drop((seg_rx, result_tx, recycle_tx));
        let packer = {
            let (repo, handle, config) = (repo.clone(), handle.clone(), &config);
            let uploads = options.uploads.unwrap_or(repo.store_hints().uploads);
            s.spawn(move || {
                let r = pack_groups(&repo, &handle, config, pack_rx, uploads, progress);
                if r.is_err() {
                    cancel.store(true, Ordering::Relaxed);
                }
                r
            })
        };

        let mut stats = CommitStats::default();
        let mut reused_segments = 0;
        // The reference summary: the sent segments' runs here, every node of the tree below.
        let mut summary = SummaryBuilder::counted();
        let mut unread_leaves = Vec::new();
        for r in result_rx {
            reused_segments += u64::from(r.reused);
            if let (true, Some(leaf)) = (r.unread, &r.leaf) {
                unread_leaves.push(leaf.id);
            }
            match r.leaf {
                Some(leaf) => leaves.insert(r.index, leaf),
                None => leaves.remove(&r.index),
            };
            for (group, first, count) in &r.runs {
                summary.add_run(group, *first, *count);
            }
            stats.add_chunks(&r.stats);
        }
        // The root cause first: the source, then the store (packer), then a worker's own
        // error before a worker that only stopped because another failed.
        let read = read.join().expect("reader thread panicked");
        let mut worker_errors = Vec::new();
        let mut tally = DedupTally::default();
        for w in worker_handles {
            match w.join().expect("worker thread panicked") {
                Ok(t) => tally.add(&t),
                Err(e) => worker_errors.push(e),
            }
        }
        worker_errors.sort_by_key(|e| matches!(e, EngineError::Internal { .. }));
        // The claims served the workers only: freed before the packer, done once the tree's
        // nodes are sent, reads back its index entries (`pending_entries`).
        drop(std::mem::take(
            &mut *dedup.claims.lock().expect("dedup lock"),
        ));
        let size = *read.as_ref().unwrap_or(&0);
        let mut tree_error = None;
        // Not after a failure elsewhere (the packer's upload): the tree's node lookups would
        // wait on a store that is failing, for nothing.
        let failed = cancel.load(Ordering::Relaxed);
        let tree = (read.is_ok() && worker_errors.is_empty() && !failed).then(|| {
            build_tree(
                &leaves,
                segment_count(size, config.segment_size),
                config.fanout,
                |bytes| repo.id_of(bytes),
                |id, bytes| {
                    summary.add_node(&id);
                    match dedup.claim_node(&id) {
                        // A send fails only if the packer stopped; its error is reported
                        // below.
                        Ok(true) => drop(pack_tx.send(Packable::Node(id, bytes))),
                        Ok(false) => {}
                        Err(e) => {
                            tree_error.get_or_insert(e);
                        }
                    }
                },
            )
        });
        drop(pack_tx);
        let packed = packer.join().expect("packer thread panicked");
        read?;
        let (run, pack_bytes) = packed?;
        if let Some(e) = worker_errors.into_iter().next().or(tree_error) {
            return Err(e);
        }
        let (root, height) =
            tree.ok_or_else(|| EngineError::internal("commit", "stopped before its tree"))?;
        for leaf in leaves.values() {
            summary.add_node(&leaf.id);
        }
        Ok(PipelineOutput {
            root,
            group_summary: root.map(|_| summary.finish().expect("a summary of adds only")),
            summary_base: None,
            height,
            size,
            stats,
            run,
            pack_bytes,
            reused: std::mem::take(&mut *dedup.reused_nodes.lock().expect("dedup lock")),
            reused_segments,
            dedup: tally,
            unread_leaves,
        })
    })
}

/// One worker's view of the shared state.
struct Worker<'a> {
    config: &'a RepoConfig,
    /// An encrypted repository's key: chunk and node ids keyed, groups sealed.
    key: Option<&'a MasterKey>,
    group_size: usize,
    dedup: &'a GroupDedup<'a>,
    /// The parent's leaves by segment digest and by segment.
    parent: &'a ParentLeaves,
    pack_tx: Sender<Packable>,
    cancel: &'a AtomicBool,
    progress: &'a CommitProgress,
}

/// A chunk of a segment, before its leaf is built.
enum Item {
    Zero(u32),
    At(Placement, u32),
    /// Slot `slot` of the segment's `group`-th group (this worker's).
    Mine {
        group: usize,
        slot: u16,
        len: u32,
    },
    /// Stored by another worker of this commit.
    Elsewhere(Id, u32),
}

/// The groups a worker builds from one segment's new chunks.
struct SegmentGroups {
    builder: GroupBuilder,
    /// Chunk ids of the open group, by slot.
    open: Vec<Id>,
    /// Ids of the groups built so far, in order.
    built: Vec<Id>,
    /// The groups built so far, for the packer once the segment is done.
    finished: Vec<Group>,
}

impl Worker<'_> {
    fn run(
        &self,
        seg_rx: &Receiver<Segment>,
        result_tx: &Sender<SegmentResult>,
        recycle_tx: &Sender<Vec<u8>>,
        mode: DedupMode,
    ) -> EngineResult<DedupTally> {
        let mut tiers = SegmentDedup::new(self.dedup, self.parent, mode);
        for seg in seg_rx {
            if self.cancel.load(Ordering::Relaxed) {
                break;
            }
            let result = self.segment(&seg, &mut tiers)?;
            let _ = recycle_tx.try_send(seg.data);
            result_tx
                .send(result)
                .map_err(|_| EngineError::internal("collector", "stopped early"))?;
        }
        Ok(tiers.tally)
    }

    fn segment(&self, seg: &Segment, tiers: &mut SegmentDedup) -> EngineResult<SegmentResult> {
        let digest = self.id_of(&seg.data);
        if let Some(reused) = self.reuse(seg.index, &digest)? {
            return Ok(reused);
        }
        let mut stats = CommitStats::default();
        let mut items = Vec::new();
        let mut groups = SegmentGroups {
            builder: GroupBuilder::new(self.group_size),
            open: Vec::new(),
            built: Vec::new(),
            finished: Vec::new(),
        };
        let ranges = chunk_ranges(self.config, &seg.data);
        let ids: Vec<Option<Id>> = ranges
            .iter()
            .map(|r| {
                let data = &seg.data[r.clone()];
                (!is_zero(data)).then(|| self.id_of(data))
            })
            .collect();
        let known = tiers.locate(seg.index, &ids)?;
        for ((r, id), known) in ranges.into_iter().zip(ids).zip(known) {
            let data = &seg.data[r];
            let len = data.len() as u32;
            let Some(id) = id else {
                items.push(Item::Zero(len));
                continue;
            };
            stats.chunks += 1;
            stats.data_bytes += u64::from(len);
            if let Some(p) = known {
                items.push(Item::At(p, len));
                continue;
            }
            match self.dedup.claim(&id, tiers.mode)? {
                Claim::At(p) => items.push(Item::At(p, len)),
                Claim::Indexed(p) => {
                    tiers.tally.index += 1;
                    items.push(Item::At(p, len));
                }
                Claim::Elsewhere => items.push(Item::Elsewhere(id, len)),
                Claim::Mine => {
                    if groups.builder.is_full_for(data.len()) {
                        self.close_group(&mut groups)?;
                    }
                    items.push(Item::Mine {
                        group: groups.built.len(),
                        slot: groups.open.len() as u16,
                        len,
                    });
                    groups.builder.push(id, data);
                    groups.open.push(id);
                    stats.new_chunks += 1;
                    stats.new_chunk_bytes += u64::from(len);
                    self.progress
                        .new_bytes
                        .fetch_add(u64::from(len), Ordering::Relaxed);
                }
            }
        }
        self.close_group(&mut groups)?;
        if !groups.finished.is_empty() {
            self.send(Packable::Groups(std::mem::take(&mut groups.finished)))?;
        }

        // Every chunk of this segment has its place now; only then wait for other workers'.
        let mut leaf = RunLeaf::default();
        for item in items {
            let run = |p: Placement, len| RunExtent::Run {
                group: p.group,
                first: p.slot,
                count: 1,
                len,
            };
            leaf.push(match item {
                Item::Zero(len) => RunExtent::Zero { len },
                Item::At(p, len) => run(p, len),
                Item::Mine { group, slot, len } => run(
                    Placement {
                        group: groups.built[group],
                        slot,
                    },
                    len,
                ),
                Item::Elsewhere(id, len) => run(self.dedup.wait(&id, self.cancel)?, len),
            });
        }
        let tree_leaf = if leaf.is_all_zero() {
            None
        } else {
            leaf.set_digest(digest);
            let bytes = leaf.encode();
            let id = self.id_of(&bytes);
            if self.dedup.claim_node(&id)? {
                self.send(Packable::Node(id, bytes))?;
            }
            Some(TreeLeaf {
                id,
                digest: leaf.leaf_digest(),
            })
        };
        let runs = match tree_leaf {
            None => Vec::new(),
            Some(_) => leaf.group_runs().collect(),
        };
        Ok(SegmentResult {
            index: seg.index,
            leaf: tree_leaf,
            runs,
            stats,
            reused: false,
            unread: false,
        })
    }

    /// The parent fast path: the parent's leaf for a segment whose bytes have `digest`, if
    /// there is one. The parent is live, so what its leaves name is stored (a GC that
    /// removed it meanwhile is caught by the stale-GC guard at publication). A leaf reused
    /// unread was loaded only when nothing the parent uses has a quarantined copy
    /// (`ParentLeaves::load`); of a leaf read, a group with a quarantined copy must have a
    /// good copy storing the run, else the segment is committed as any other, which stores
    /// again what is damaged.
    fn reuse(&self, index: u64, digest: &Id) -> EngineResult<Option<SegmentResult>> {
        let Some(parent) = self.parent.get(digest) else {
            return Ok(None);
        };
        let reused = |runs: Vec<(Id, u16, u16)>, unread| {
            self.dedup
                .reused_nodes
                .lock()
                .expect("dedup lock")
                .insert(parent.id);
            Ok(Some(SegmentResult {
                index,
                leaf: Some(TreeLeaf {
                    id: parent.id,
                    digest: Some(parent.digest),
                }),
                runs,
                stats: CommitStats {
                    chunks: u64::from(parent.digest.chunks),
                    data_bytes: u64::from(parent.digest.data_bytes),
                    ..CommitStats::default()
                },
                reused: true,
                unread,
            }))
        };
        let Some(leaf) = &parent.leaf else {
            return reused(Vec::new(), true);
        };
        let reader = self.dedup.reader;
        for (group, first, count) in leaf.group_runs() {
            if !reader.has_quarantined_copy(&group)
                || self
                    .dedup
                    .complete_groups
                    .lock()
                    .expect("dedup lock")
                    .contains(&group)
            {
                continue;
            }
            let wanted = [(first, count)];
            match self.dedup.ask(reader.locate_group_storing(&group, &wanted)) {
                Ok(loc) if loc.stores(&wanted) => {
                    let all = [(0, slot_count(&loc))];
                    if loc.stores(&all) {
                        self.dedup
                            .complete_groups
                            .lock()
                            .expect("dedup lock")
                            .insert(group);
                    }
                }
                Ok(_) => return Ok(None),
                Err(EngineError::Repo(e)) if e.is_damage() => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        let runs: Vec<(Id, u16, u16)> = leaf.group_runs().collect();
        reused(runs, false)
    }

    /// Compresses the open group and records where its chunks went (other workers waiting
    /// for one of them go on now; the packer gets the segment's groups together).
    fn close_group(&self, groups: &mut SegmentGroups) -> EngineResult<()> {
        if groups.builder.is_empty() {
            return Ok(());
        }
        let builder = std::mem::replace(&mut groups.builder, GroupBuilder::new(self.group_size));
        let group = builder.finish(self.config.compression, self.key);
        let gid = group_id(&group.desc.chunks, self.key);
        self.dedup.place(&groups.open, gid);
        groups.open.clear();
        groups.built.push(gid);
        groups.finished.push(group);
        Ok(())
    }

    fn id_of(&self, data: &[u8]) -> Id {
        self.key.map_or_else(|| Id::of(data), |k| k.id_of(data))
    }

    fn send(&self, p: Packable) -> EngineResult<()> {
        self.pack_tx
            .send(p)
            .map_err(|_| EngineError::internal("packer", "stopped early"))
    }
}

/// How many slots the group at `loc` has.
fn slot_count(loc: &GroupLocation) -> u16 {
    loc.trailer.groups[loc.group as usize].desc.chunks.len() as u16
}

/// Where a commit's scratch files go: beside the packs when the store stages files (a local
/// repository: the file system sized for the data), else `None`.
fn scratch_dir(repo: &Repo, handle: &Handle) -> EngineResult<Option<std::path::PathBuf>> {
    let staged = handle.block_on(repo.stage_scratch())?;
    Ok(staged.and_then(|f| f.path().parent().map(std::path::Path::to_path_buf)))
}

/// Packs groups and nodes (in separate packs, so a version's tree is read from few places),
/// stores full packs, at most `uploads` at a time. Returns the index entries of every chunk,
/// group and node stored (8 bytes an id, held in a staged file until the end:
/// `pending_entries`), and the bytes written.
fn pack_groups(
    repo: &Arc<Repo>,
    handle: &Handle,
    config: &RepoConfig,
    rx: Receiver<Packable>,
    uploads: usize,
    progress: &CommitProgress,
) -> EngineResult<(PendingRun, u64)> {
    let mut uploader = Uploader::new(repo, handle, uploads, progress);
    let mut pending = PendingEntries::new(handle.block_on(repo.stage_scratch())?);
    let group_size = config.v2.map_or(64 << 10, |v| v.group_size) as usize;
    let packer = || {
        let (repo, handle) = (repo.clone(), handle.clone());
        GroupPacker::new(
            repo.key().cloned(),
            config.compression,
            group_size,
            config.pack_target as usize,
        )
        .staged(Box::new(move || handle.block_on(repo.stage_pack())))
    };
    let (mut data, mut nodes) = (packer(), packer());
    loop {
        // While waiting for work, notice a failed upload at once: the workers may be slow to
        // send more (their lookups wait on the same failing store).
        let p = match rx.recv_timeout(std::time::Duration::from_millis(50)) {
            Ok(p) => p,
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                uploader.reap()?;
                continue;
            }
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => break,
        };
        let mut full = Vec::new();
        match p {
            Packable::Groups(groups) => {
                for group in groups {
                    full.extend(data.push_group(group)?.1);
                }
            }
            Packable::Node(id, bytes) => full.extend(nodes.push_node(id, &bytes)?),
        }
        for pack in full {
            let keys = pending.add(keys_of(pack.ids))?;
            uploader.start(pack.id, pack.bytes, keys)?;
        }
    }
    for pack in [data.finish()?, nodes.finish()?].into_iter().flatten() {
        let keys = pending.add(keys_of(pack.ids))?;
        uploader.start(pack.id, pack.bytes, keys)?;
    }
    let (packs, written) = uploader.finish()?;
    Ok((pending.into_run(packs), written))
}

/// The index keys of a finished pack's ids (what its run entries hold).
fn keys_of(ids: Vec<Id>) -> Vec<u64> {
    ids.iter().map(index_run::key_of).collect()
}

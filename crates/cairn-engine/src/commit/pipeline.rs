//! The commit pipeline's stages before packing: the reader (sparse-aware, segment by
//! segment), the workers (chunk, zero-detect, BLAKE3, dedup, encode) and the collector that
//! builds the tree from the workers' leaves.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cairn_format::config::RepoConfig;
use cairn_format::group_summary::GroupSummary;
use cairn_format::node::{Extent, Leaf};
use cairn_format::pack::{BlobEntry, BlobKind};
use cairn_format::summary::{ProbeKey, Summary};
use cairn_format::version::CommitStats;
use cairn_format::Id;
use cairn_repo::Repo;
use crossbeam_channel::{bounded, Receiver, Sender};
use tokio::runtime::Handle;

use super::packing::{encode, pack_blobs, EncodedBlob};
use super::{CommitOptions, CommitProgress};
use crate::chunker::{chunk_ranges, is_zero};
use crate::error::{EngineError, EngineResult};
use crate::source::{Segment, Source};
use crate::tree::{build_tree, segment_count, TreeLeaf};

/// A built tree whose packs are durable, ready for [`super::publish`].
pub(crate) struct PipelineOutput {
    pub root: Option<Id>,
    /// The reference summary of the tree (for fast deletion).
    pub summary: Option<Summary>,
    /// Format 2's reference summary (groups' slots and nodes the tree uses).
    pub group_summary: Option<GroupSummary>,
    pub height: u8,
    pub size: u64,
    pub stats: CommitStats,
    pub packs: Vec<(Id, Vec<BlobEntry>)>,
    /// Format 2: the commit's index run: where its chunks, groups and nodes are (`packs` is
    /// then empty).
    pub run: super::pending_entries::PendingRun,
    pub pack_bytes: u64,
    /// Blobs (format 2: manifest nodes) the tree refers to without storing them.
    pub reused: HashSet<Id>,
    /// Format 2: segments whose parent's leaf was reused as it is (the parent fast path).
    pub reused_segments: u64,
    /// Format 2: what each dedup tier found in changed segments.
    pub dedup: super::dedup::DedupTally,
    /// Format 2: leaves of the parent reused unread (the fast path), one entry per segment
    /// that reuses one: what they use is not in `group_summary` yet
    /// (`base_summary::complete_summary` adds it).
    pub unread_leaves: Vec<Id>,
}

/// What one worker learned about one segment.
struct SegmentResult {
    index: u64,
    leaf: Option<Id>,
    /// Summary keys of the segment's chunks.
    chunks: Vec<ProbeKey>,
    stats: CommitStats,
}

/// Shared state of the workers: which blobs are stored or being stored by this commit.
pub(crate) struct Dedup<'a> {
    pub repo: &'a Repo,
    pub claimed: Mutex<HashSet<Id>>,
    /// Blobs this commit refers to without storing them (found in the repository).
    pub reused: Mutex<HashSet<Id>>,
    /// Repair from a source: store only these blobs (the ones versions need and lack).
    pub only: Option<HashSet<Id>>,
}

impl<'a> Dedup<'a> {
    pub fn new(repo: &'a Repo, only: Option<HashSet<Id>>) -> Self {
        Dedup {
            repo,
            claimed: Mutex::new(HashSet::new()),
            reused: Mutex::new(HashSet::new()),
            only,
        }
    }

    /// True if the caller must store `id`: it is neither in the repository nor already
    /// claimed by another worker of this commit (and, when repairing, it is wanted).
    pub fn claim(&self, id: &Id) -> bool {
        if self.repo.has_blob(id) {
            self.reused.lock().expect("dedup lock").insert(*id);
            return false;
        }
        if self.only.as_ref().is_some_and(|only| !only.contains(id)) {
            return false;
        }
        self.claimed.lock().expect("dedup lock").insert(*id)
    }
}

/// Chunks, hashes and stores `source` (only the blobs in `only`, if given) and builds its
/// tree; publishes nothing.
pub(crate) fn run_pipeline(
    repo: Arc<Repo>,
    handle: Handle,
    mut source: Box<dyn Source>,
    options: &CommitOptions,
    progress: &CommitProgress,
    only: Option<HashSet<Id>>,
) -> EngineResult<PipelineOutput> {
    let config = repo.config().clone();
    let workers = match options.workers {
        0 => std::thread::available_parallelism().map_or(2, |n| n.get()),
        n => n,
    };
    let (seg_tx, seg_rx) = bounded::<Segment>(workers * 2);
    let (recycle_tx, recycle_rx) = bounded::<Vec<u8>>(workers * 4);
    let (blob_tx, blob_rx) = bounded::<EncodedBlob>(workers * 16);
    let (result_tx, result_rx) = bounded::<SegmentResult>(workers * 4);
    let cancel = AtomicBool::new(false);
    let dedup = Dedup::new(&repo, only);

    std::thread::scope(|s| -> EngineResult<PipelineOutput> {
        let reader = s.spawn(|| {
            read_all(
                source.as_mut(),
                &config,
                seg_tx,
                &recycle_rx,
                &cancel,
                progress,
            )
        });
        let mut worker_handles = Vec::new();
        for _ in 0..workers {
            let (seg_rx, blob_tx, result_tx, recycle_tx) = (
                seg_rx.clone(),
                blob_tx.clone(),
                result_tx.clone(),
                recycle_tx.clone(),
            );
            let (config, dedup, cancel) = (&config, &dedup, &cancel);
            worker_handles.push(s.spawn(move || {
                let r = hash_segments(
                    config,
                    dedup,
                    &seg_rx,
                    &blob_tx,
                    &result_tx,
                    &recycle_tx,
                    cancel,
                    progress,
                );
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
            s.spawn(move || pack_blobs(repo, handle, config, blob_rx, uploads, progress))
        };

        // Collector: gather leaf ids in segment order.
        let mut leaves = BTreeMap::new();
        let mut stats = CommitStats::default();
        let mut chunk_keys = Vec::new();
        for r in result_rx {
            if let Some(leaf) = r.leaf {
                leaves.insert(r.index, TreeLeaf::from(leaf));
            }
            chunk_keys.extend(r.chunks);
            stats.add_chunks(&r.stats);
        }
        // Report the root cause: a source error first, then a store (packer) error, and only
        // then a worker's own error (workers fail with "packer stopped" when the packer does).
        let read = reader.join().expect("reader thread panicked");
        let mut worker_error = None;
        for w in worker_handles {
            if let Err(e) = w.join().expect("worker thread panicked") {
                worker_error.get_or_insert(e);
            }
        }
        let size = *read.as_ref().unwrap_or(&0);
        let ok_so_far = read.is_ok() && worker_error.is_none();
        let mut node_keys: Vec<ProbeKey> = leaves.values().map(|l| ProbeKey::of(&l.id)).collect();
        let tree = ok_so_far.then(|| {
            build_tree(
                &leaves,
                segment_count(size, config.segment_size),
                config.fanout,
                Id::of,
                |id, bytes| {
                    node_keys.push(ProbeKey::of(&id));
                    if dedup.claim(&id) {
                        // A send fails only if the packer stopped; its error is reported below.
                        let _ = blob_tx.send(encode(id, BlobKind::Node, &bytes, &config));
                    }
                },
            )
        });
        drop(blob_tx);
        let packed = packer.join().expect("packer thread panicked");
        read?;
        let (packs, pack_bytes) = packed?;
        if let Some(e) = worker_error {
            return Err(e);
        }
        let (root, height) = tree.expect("built when no error");
        let summary = root.map(|_| Summary::build(chunk_keys, node_keys, config.summary_bits));
        Ok(PipelineOutput {
            reused_segments: 0,
            dedup: Default::default(),
            unread_leaves: Vec::new(),
            root,
            summary,
            group_summary: None,
            height,
            size,
            stats,
            packs,
            run: Default::default(),
            pack_bytes,
            reused: std::mem::take(&mut *dedup.reused.lock().expect("dedup lock")),
        })
    })
}

/// The reader stage: sends every segment of `source`, then returns its size (an error if the
/// size changed while it was read). Any error sets `cancel`.
pub(crate) fn read_all(
    source: &mut dyn Source,
    config: &RepoConfig,
    seg_tx: Sender<Segment>,
    recycle_rx: &Receiver<Vec<u8>>,
    cancel: &AtomicBool,
    progress: &CommitProgress,
) -> EngineResult<u64> {
    let r = read_source(source, config, &seg_tx, recycle_rx, cancel, progress);
    drop(seg_tx);
    let r = r.and_then(|()| {
        let size = source.final_size();
        match source.size_now() {
            Some(now) if now != size => Err(EngineError::SourceResized {
                what: source.describe(),
                was: size,
                now,
            }),
            _ => Ok(size),
        }
    });
    if r.is_err() {
        cancel.store(true, Ordering::Relaxed);
    }
    r
}

fn read_source(
    source: &mut dyn Source,
    config: &RepoConfig,
    seg_tx: &Sender<Segment>,
    recycle_rx: &Receiver<Vec<u8>>,
    cancel: &AtomicBool,
    progress: &CommitProgress,
) -> EngineResult<()> {
    while !cancel.load(Ordering::Relaxed) {
        crate::interrupt::check()?;
        let buf = recycle_rx.try_recv().unwrap_or_default();
        let Some(seg) = source.next_segment(config.segment_size, buf)? else {
            return Ok(());
        };
        progress
            .read
            .fetch_add(seg.data.len() as u64, Ordering::Relaxed);
        if seg_tx.send(seg).is_err() {
            break; // workers stopped; their error is reported
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn hash_segments(
    config: &RepoConfig,
    dedup: &Dedup<'_>,
    seg_rx: &Receiver<Segment>,
    blob_tx: &Sender<EncodedBlob>,
    result_tx: &Sender<SegmentResult>,
    recycle_tx: &Sender<Vec<u8>>,
    cancel: &AtomicBool,
    progress: &CommitProgress,
) -> EngineResult<()> {
    let stopped = || EngineError::internal("packer", "stopped early");
    for seg in seg_rx {
        if cancel.load(Ordering::Relaxed) {
            break;
        }
        let mut stats = CommitStats::default();
        let mut leaf = Leaf::default();
        let mut chunks = Vec::new();
        for r in chunk_ranges(config, &seg.data) {
            let data = &seg.data[r];
            let len = data.len() as u32;
            if is_zero(data) {
                leaf.push(Extent::Zero { len });
                continue;
            }
            let id = Id::of(data);
            leaf.push(Extent::Chunk { id, len });
            chunks.push(ProbeKey::of(&id));
            stats.chunks += 1;
            stats.data_bytes += len as u64;
            if dedup.claim(&id) {
                stats.new_chunks += 1;
                stats.new_chunk_bytes += len as u64;
                progress.new_bytes.fetch_add(len as u64, Ordering::Relaxed);
                blob_tx
                    .send(encode(id, BlobKind::Data, data, config))
                    .map_err(|_| stopped())?;
            }
        }
        let leaf_id = if leaf.is_all_zero() {
            None
        } else {
            let bytes = leaf.encode();
            let id = Id::of(&bytes);
            if dedup.claim(&id) {
                blob_tx
                    .send(encode(id, BlobKind::Node, &bytes, config))
                    .map_err(|_| stopped())?;
            }
            Some(id)
        };
        let _ = recycle_tx.try_send(seg.data);
        result_tx
            .send(SegmentResult {
                index: seg.index,
                leaf: leaf_id,
                chunks,
                stats,
            })
            .map_err(|_| EngineError::internal("collector", "stopped early"))?;
    }
    Ok(())
}

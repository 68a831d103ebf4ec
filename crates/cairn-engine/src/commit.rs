//! COMMIT: turn a source into a new version.
//!
//! The pipeline keeps every core busy on one image with bounded memory:
//!
//! ```text
//!  reader ──segments──▶ workers (×N) ──new blobs──▶ packer ──packs──▶ uploads (bounded)
//!  (sparse-aware)       chunk, zero-detect,          two pack builders    put_if_absent
//!                       BLAKE3, dedup, zstd          (data / nodes)
//!                            │
//!                            └──leaf ids──▶ collector ──▶ tree ──▶ index ──▶ version ──▶ ref
//! ```
//! Channels are bounded, so a slow stage stalls the ones before it (back-pressure) and memory
//! stays at a few segments per worker plus the packs in flight. Publication is ordered —
//! packs, then the index file and the tree's reference summary, then the version record,
//! then the ref by compare-and-swap — so
//! a crash or error at any point leaves only unreferenced objects behind, never a version
//! that points at missing data.

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cairn_format::config::RepoConfig;
use cairn_format::name::validate_image_name;
use cairn_format::node::{Extent, Leaf};
use cairn_format::pack::{encode_blob, BlobEncoding, BlobEntry, BlobKind, PackBuilder};
use cairn_format::refs;
use cairn_format::summary::{ProbeKey, Summary};
use cairn_format::version::{CommitStats, VersionRecord};
use cairn_format::Id;
use cairn_repo::{Repo, RepoError, RepoResult};
use crossbeam_channel::{bounded, Receiver, Sender};
use tokio::runtime::Handle;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use crate::chunker::{chunk_ranges, is_zero};
use crate::error::{EngineError, EngineResult};
use crate::source::{Segment, Source};
use crate::tree::{build_tree, segment_count};

/// Live counters of a running commit, for progress display.
#[derive(Debug, Default)]
pub struct CommitProgress {
    /// Bytes the source will read, when known in advance.
    pub total: AtomicU64,
    /// Bytes read from the source so far.
    pub read: AtomicU64,
    /// Plain bytes of chunks that were new to the repository.
    pub new_bytes: AtomicU64,
    /// Bytes written to the store so far.
    pub stored: AtomicU64,
}

#[derive(Debug, Clone, Default)]
pub struct CommitOptions {
    pub message: String,
    /// Hashing/compression threads; 0 = one per core.
    pub workers: usize,
    /// Packs uploading at once (default: the store's hint).
    pub uploads: Option<usize>,
    pub progress: Option<Arc<CommitProgress>>,
}

/// The published version.
#[derive(Debug, Clone)]
pub struct CommitResult {
    pub id: Id,
    pub record: VersionRecord,
}

/// Commits `source` as a new version of `image`.
pub async fn commit(
    repo: Arc<Repo>,
    image: &str,
    source: Box<dyn Source>,
    options: CommitOptions,
) -> EngineResult<CommitResult> {
    validate_image_name(image)?;
    let time_ns = cairn_repo::session::now_ns();
    let progress = options.progress.clone().unwrap_or_default();
    if let Some(n) = source.data_hint() {
        progress.total.store(n, Ordering::Relaxed);
    }
    let handle = Handle::current();
    let out = {
        let repo = repo.clone();
        let options = options.clone();
        let progress = progress.clone();
        tokio::task::spawn_blocking(move || {
            run_pipeline(repo, handle, source, &options, &progress, None)
        })
        .await
        .map_err(|e| EngineError::internal("pipeline thread", e))??
    };

    publish(
        &repo,
        image,
        out,
        time_ns,
        &options.message,
        None,
        &progress,
    )
    .await
}

/// GC safety, last line of defence: a GC whose plan this session did not see, and whose
/// cutoff is after this session started, normally waits for it. If such a GC finished anyway
/// (it judged this process dead, e.g. after a long stall), check that every blob the new
/// version reuses (refers to without storing it) still exists before publishing anything
/// that refers to it.
pub(crate) async fn check_stale_gc(repo: &Repo, reused: &HashSet<Id>) -> EngineResult<()> {
    if let Some((cutoff_ns, plan)) = repo.last_gc().await? {
        if cutoff_ns >= repo.session_started_ns() && !repo.saw_plan(&plan) {
            let present = repo.indexed_blobs_now().await?;
            let missing = reused.iter().filter(|id| !present.contains(id)).count();
            if missing > 0 {
                return Err(EngineError::RacedGc { missing });
            }
        }
    }
    Ok(())
}

/// Publishes a version whose packs are durable: checks the stale-GC guard, then writes the
/// index file, the reference summary, the version record and swaps the head ref, in that
/// order. The parent is the image's head when the ref is swapped; an image without a head
/// gets `origin` as parent (None for a plain first commit, the source version for a version
/// derived from another image's, like a clone) and seq 1.
pub(crate) async fn publish(
    repo: &Repo,
    image: &str,
    out: PipelineOutput,
    time_ns: i64,
    message: &str,
    origin: Option<Id>,
    progress: &CommitProgress,
) -> EngineResult<CommitResult> {
    check_stale_gc(repo, &out.reused).await?;

    // Publication step 2: the index file, once every pack is durable; then the tree's
    // reference summary, which every published version must have (fast deletion trusts it).
    let mut index_bytes = repo.put_index(out.packs).await?;
    if let (Some(root), Some(summary)) = (&out.root, &out.summary) {
        index_bytes += repo.put_summary(root, summary).await?;
    }
    let mut stats = out.stats;
    stats.stored_bytes = out.pack_bytes + index_bytes;
    progress.stored.fetch_add(index_bytes, Ordering::Relaxed);

    // Steps 3 and 4: version record, then the head ref by compare-and-swap. A lost race
    // means another commit of the same image won: re-parent onto it and try again (the
    // record we wrote for the old parent stays unreferenced, for GC).
    const ATTEMPTS: u32 = 64;
    for attempt in 0..ATTEMPTS {
        let head = repo.head(image).await?;
        let (parent, seq) = match &head {
            Some(h) => (
                Some(h.version),
                repo.load_version(&h.version).await?.seq + 1,
            ),
            None => (origin, 1),
        };
        let mut record = VersionRecord {
            image: image.to_string(),
            seq,
            parent,
            time_ns,
            logical_size: out.size,
            root: out.root,
            height: out.height,
            segment_size: repo.config().segment_size,
            fanout: repo.config().fanout,
            stats,
            message: message.to_string(),
        };
        // The record's length does not depend on the figure, so it can count itself and the ref.
        let own = record.encode().len() as u64 + refs::encode(&Id::ZERO).len() as u64;
        record.stats.stored_bytes += own;
        let (id, _) = repo.put_version(&record).await?;
        match repo.swap_head(image, head.as_ref(), &id).await {
            Ok(true) => {
                progress.stored.fetch_add(own, Ordering::Relaxed);
                tracing::info!(image, seq, %id, attempt, "committed");
                return Ok(CommitResult { id, record });
            }
            // Another commit moved the head first: the record no ref will ever name is taken
            // back (its time makes it unique to this commit, so nothing else refers to it).
            // After an error the swap may still have happened (a request cut off after the
            // server acted), so the record stays; what is left is removed by the exact GC.
            Ok(false) => repo.delete_unpublished_version(&id).await,
            Err(e) => return Err(e.into()),
        }
        tracing::debug!(image, attempt, "head moved during commit; retrying");
    }
    Err(RepoError::Contention {
        image: image.to_string(),
        attempts: ATTEMPTS,
    }
    .into())
}

/// A built tree whose packs are durable, ready for [`publish`].
pub(crate) struct PipelineOutput {
    pub root: Option<Id>,
    /// The reference summary of the tree (for fast deletion).
    pub summary: Option<Summary>,
    pub height: u8,
    pub size: u64,
    pub stats: CommitStats,
    pub packs: Vec<(Id, Vec<BlobEntry>)>,
    pub pack_bytes: u64,
    pub reused: HashSet<Id>,
}

/// A blob ready to be packed.
pub(crate) struct EncodedBlob {
    id: Id,
    kind: BlobKind,
    encoding: BlobEncoding,
    stored: Vec<u8>,
    raw_len: u32,
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
            let r = read_source(
                source.as_mut(),
                &config,
                &seg_tx,
                &recycle_rx,
                &cancel,
                progress,
            );
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
                leaves.insert(r.index, leaf);
            }
            chunk_keys.extend(r.chunks);
            stats.data_bytes += r.stats.data_bytes;
            stats.chunks += r.stats.chunks;
            stats.new_chunks += r.stats.new_chunks;
            stats.new_chunk_bytes += r.stats.new_chunk_bytes;
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
        let mut node_keys: Vec<ProbeKey> = leaves.values().map(ProbeKey::of).collect();
        let tree = ok_so_far.then(|| {
            build_tree(
                &leaves,
                segment_count(size, config.segment_size),
                config.fanout,
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
            root,
            summary,
            height,
            size,
            stats,
            packs,
            pack_bytes,
            reused: std::mem::take(&mut *dedup.reused.lock().expect("dedup lock")),
        })
    })
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

pub(crate) fn encode(id: Id, kind: BlobKind, plain: &[u8], config: &RepoConfig) -> EncodedBlob {
    let (stored, encoding) = encode_blob(plain, config.compression);
    EncodedBlob {
        id,
        kind,
        encoding,
        stored,
        raw_len: plain.len() as u32,
    }
}

/// A stored pack: its final id, its blobs, the bytes written.
type Uploaded = (Id, Vec<BlobEntry>, u64);
type Upload = JoinHandle<RepoResult<Uploaded>>;

/// A pack written by this commit and the blobs in it.
pub(crate) type PackedPack = (Id, Vec<BlobEntry>);

/// Packs blobs (data and manifest nodes in separate packs, so a version's tree is read from
/// few places) and uploads full packs, at most `uploads` at a time.
pub(crate) fn pack_blobs(
    repo: Arc<Repo>,
    handle: Handle,
    config: &RepoConfig,
    blob_rx: Receiver<EncodedBlob>,
    uploads: usize,
    progress: &CommitProgress,
) -> EngineResult<(Vec<PackedPack>, u64)> {
    let limit = Arc::new(Semaphore::new(uploads.max(1)));
    let mut in_flight = Uploads {
        handle: &handle,
        list: Vec::new(),
    };
    let mut packs = Vec::new();
    let mut written = 0u64;
    let mut data = PackBuilder::new();
    let mut nodes = PackBuilder::new();
    let target = config.pack_target as usize;

    let flush = |builder: &mut PackBuilder,
                 packs: &mut Vec<PackedPack>,
                 in_flight: &mut Vec<Upload>,
                 written: &mut u64|
     -> EngineResult<()> {
        let (id, bytes, entries) = std::mem::take(builder).finish();
        let permit = handle
            .block_on(limit.clone().acquire_owned())
            .map_err(|e| EngineError::internal("upload limiter", e))?;
        let repo = repo.clone();
        in_flight.push(handle.spawn(async move {
            let r = repo.put_pack(&id, bytes).await;
            drop(permit);
            r.map(|(id, n)| (id, entries, n))
        }));
        // Reap finished uploads so an error surfaces early.
        let mut i = 0;
        while i < in_flight.len() {
            if in_flight[i].is_finished() {
                let (id, entries, n) = join_upload(&handle, in_flight.swap_remove(i), progress)?;
                packs.push((id, entries));
                *written += n;
            } else {
                i += 1;
            }
        }
        Ok(())
    };

    for blob in blob_rx {
        let builder = match blob.kind {
            BlobKind::Data => &mut data,
            BlobKind::Node => &mut nodes,
        };
        builder.push(
            blob.id,
            blob.kind,
            blob.encoding,
            &blob.stored,
            blob.raw_len,
        );
        if builder.len() >= target {
            flush(builder, &mut packs, &mut in_flight.list, &mut written)?;
        }
    }
    for builder in [&mut data, &mut nodes] {
        if !builder.is_empty() {
            flush(builder, &mut packs, &mut in_flight.list, &mut written)?;
        }
    }
    while !in_flight.list.is_empty() {
        let upload = in_flight.list.remove(0);
        let (id, entries, n) = join_upload(&handle, upload, progress)?;
        packs.push((id, entries));
        written += n;
    }
    Ok((packs, written))
}

/// Pack uploads still running. On an early return (an error) they are cancelled and waited
/// for, so that when a failed commit returns, every pack it stored is known to
/// `Repo::discard_unindexed_packs` and none lands later.
struct Uploads<'h> {
    handle: &'h Handle,
    list: Vec<Upload>,
}

impl Drop for Uploads<'_> {
    fn drop(&mut self) {
        for upload in self.list.drain(..) {
            upload.abort();
            let _ = self.handle.block_on(upload);
        }
    }
}

fn join_upload(
    handle: &Handle,
    upload: Upload,
    progress: &CommitProgress,
) -> EngineResult<Uploaded> {
    let done = handle
        .block_on(upload)
        .map_err(|e| EngineError::internal("upload task", e))??;
    progress.stored.fetch_add(done.2, Ordering::Relaxed);
    Ok(done)
}

//! The read-only base of an export: one stored version, read lazily.
//!
//! Opening reads only the root of the version's tree; the interior nodes that map segments to
//! leaves (`segment_map`) and the leaves themselves are read the first time a segment under
//! them is touched, and kept. A chunk comes from the host-wide cache, or else from the
//! repository (verified against its id) and then goes into the cache, whose own thread writes
//! it to disk off the reader's path (`ContentCache::put_behind`); after a miss the following
//! chunks are fetched in the background (read-ahead), as BlobSeer's on-demand mirroring does.
//! Zero extents never touch the repository.
//!
//! A format 2 version's leaves name runs of slots of compressed groups: a piece is a run, its
//! chunks' ids come from the group's descriptor (the pack trailer, cached by the repository's
//! `V2Reader`), the host-wide cache is asked per chunk, and a miss fetches and decodes the
//! whole group once (the reader's group cache) and puts every chunk of the run into the
//! host-wide cache. Read-ahead then means the next `readahead` groups.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use cairn_engine::segment::Seeds;
use cairn_format::leaf_v2::{RunExtent, RunLeaf};
use cairn_format::node::Extent;
use cairn_format::version::VersionRecord;
use cairn_format::{FormatError, Id};
use cairn_repo::tree_walk::{decode_leaf, NodeReader};
use cairn_repo::v2::{GroupLocation, V2Reader};
use cairn_repo::{Repo, RepoError};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::{ExportError, ExportResult};
use crate::segment_map::SegmentMap;

use crate::stats::ExportStats;
use cairn_repo::ContentCache;

/// One extent of a loaded leaf, with its offset in the image.
#[derive(Debug, Clone, Copy)]
pub struct Piece {
    pub offset: u64,
    pub len: u32,
    pub data: PieceData,
}

/// Where a piece's bytes come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PieceData {
    /// Zeros by the manifest: never fetched.
    Zero,
    /// A format 1 chunk.
    Chunk(Id),
    /// Slots `first .. first + count` of a format 2 group.
    Run { group: Id, first: u16, count: u16 },
}

impl std::fmt::Display for PieceData {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PieceData::Zero => write!(f, "a zero extent"),
            PieceData::Chunk(id) => write!(f, "chunk {id}"),
            PieceData::Run {
                group,
                first,
                count,
            } => write!(
                f,
                "slots {first}..{} of group {group}",
                u32::from(*first) + u32::from(*count)
            ),
        }
    }
}

impl Piece {
    /// Zeros by the manifest.
    pub fn is_zero(&self) -> bool {
        self.data == PieceData::Zero
    }
}

pub struct Base {
    repo: Arc<Repo>,
    cache: Arc<ContentCache>,
    stats: Arc<ExportStats>,
    id: Id,
    record: VersionRecord,
    /// Segment index → leaf id, read on demand.
    segments: SegmentMap,
    leaves: RwLock<HashMap<u64, Arc<Vec<Piece>>>>,
    readahead: usize,
    /// Local images whose bytes are served instead of fetching them, where each chunk's bytes
    /// there have the chunk's id (`export --seed`).
    seeds: Option<Seeds>,
    /// Fetches nobody waits for (read-ahead, a boot profile's prefetch), stopped with the
    /// export so that none meets a runtime shutting down and reports a failure that is not one.
    background: TaskTracker,
    stopping: CancellationToken,
}

/// Reads a blob; if its pack is gone (a GC repacked it: GC does not wait for exports), re-reads
/// the index once and tries again.
async fn read_blob(repo: &Repo, id: &Id) -> ExportResult<Vec<u8>> {
    let r = match repo.read_blob(id).await {
        Err(RepoError::PackMissing { .. } | RepoError::BlobMissing { .. }) => {
            tracing::info!(blob = %id, "pack gone; re-reading the index");
            repo.refresh_index().await?;
            repo.read_blob(id).await
        }
        other => other,
    };
    record_damage(repo, r).await
}

/// Reads blobs in one coalesced batch, with the same retry as [`read_blob`].
async fn read_blobs(repo: &Arc<Repo>, ids: &[Id]) -> ExportResult<Vec<Vec<u8>>> {
    let r = match repo.read_blobs(ids).await {
        Err(RepoError::PackMissing { .. } | RepoError::BlobMissing { .. }) => {
            repo.refresh_index().await?;
            repo.read_blobs(ids).await
        }
        other => other,
    };
    record_damage(repo, r).await
}

/// A read that found damage has quarantined the damaged copy in this process; an export runs
/// for days, so the marker is written now rather than at exit (the next commit that meets
/// the content then stores it again).
async fn record_damage<T>(repo: &Repo, r: Result<T, RepoError>) -> ExportResult<T> {
    match r {
        Ok(v) => Ok(v),
        Err(e) => {
            if e.is_damage() {
                // The NBD client only sees EIO: the operator learns of the damage here.
                tracing::warn!("damaged data, the client gets an I/O error: {e}");
                if let Err(f) = repo.flush_quarantine().await {
                    tracing::warn!("could not record the damaged blob: {f}");
                }
            }
            Err(e.into())
        }
    }
}

/// Reads manifest nodes for an export, counting them as metadata fetched.
struct ExportNodes<'a> {
    repo: &'a Repo,
    stats: &'a ExportStats,
}

impl NodeReader for ExportNodes<'_> {
    type Error = ExportError;
    async fn read_node(&mut self, id: &Id) -> ExportResult<Vec<u8>> {
        let raw = read_blob(self.repo, id).await?;
        self.stats
            .metadata_bytes_fetched
            .fetch_add(raw.len() as u64, Ordering::Relaxed);
        Ok(raw)
    }
}

impl Base {
    /// Opens version `id` (reading its interior nodes).
    pub async fn open(
        repo: Arc<Repo>,
        cache: Arc<ContentCache>,
        stats: Arc<ExportStats>,
        id: Id,
        record: VersionRecord,
        readahead: usize,
    ) -> ExportResult<Base> {
        let mut reader = ExportNodes {
            repo: &repo,
            stats: &stats,
        };
        let segments = SegmentMap::open(&mut reader, &record).await?;
        Ok(Base {
            repo,
            cache,
            stats,
            id,
            record,
            segments,
            leaves: RwLock::new(HashMap::new()),
            readahead,
            seeds: None,
            background: TaskTracker::new(),
            stopping: CancellationToken::new(),
        })
    }

    /// Serves chunks from `seeds` where they hold them (checked by id), before fetching.
    pub fn with_seeds(mut self, seeds: Seeds) -> Base {
        self.seeds = (!seeds.is_empty()).then_some(seeds);
        self
    }

    pub fn id(&self) -> Id {
        self.id
    }

    /// Runs `work` in the background until it ends or [`Self::stop_background`] is called.
    pub fn spawn_background<F>(&self, work: F)
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        let stopping = self.stopping.clone();
        self.background.spawn(async move {
            tokio::select! {
                biased;
                _ = stopping.cancelled() => {}
                _ = work => {}
            }
        });
    }

    /// Stops the background work and waits (a few seconds at most) until it has stopped.
    pub async fn stop_background(&self) {
        self.stopping.cancel();
        self.background.close();
        let _ = tokio::time::timeout(Duration::from_secs(5), self.background.wait()).await;
    }

    pub fn record(&self) -> &VersionRecord {
        &self.record
    }

    pub fn size(&self) -> u64 {
        self.record.logical_size
    }

    pub fn segment_size(&self) -> u64 {
        self.record.segment_size as u64
    }

    /// The pieces of segment `seg` (loading its leaf on first use).
    pub async fn pieces(&self, seg: u64) -> ExportResult<Arc<Vec<Piece>>> {
        if let Some(p) = self.leaves.read().expect("leaves lock").get(&seg) {
            return Ok(p.clone());
        }
        let start = seg * self.segment_size();
        let seg_len = self.segment_size().min(self.size().saturating_sub(start)) as u32;
        let mut pieces = Vec::new();
        let mut reader = ExportNodes {
            repo: &self.repo,
            stats: &self.stats,
        };
        if let Some(leaf_id) = self.segments.leaf(&mut reader, seg).await? {
            let raw = reader.read_node(&leaf_id).await?;
            let mut at = start;
            let mut push = |len: u32, data: PieceData| {
                pieces.push(Piece {
                    offset: at,
                    len,
                    data,
                });
                at += u64::from(len);
            };
            if self.repo.v2().is_some() {
                let leaf = RunLeaf::decode(&raw)
                    .map_err(|e| RepoError::corrupt(format!("manifest node {leaf_id}"), e))?;
                for e in leaf.extents() {
                    match *e {
                        RunExtent::Zero { len } => push(len, PieceData::Zero),
                        RunExtent::Run {
                            group,
                            first,
                            count,
                            len,
                        } => push(
                            len,
                            PieceData::Run {
                                group,
                                first,
                                count,
                            },
                        ),
                    }
                }
            } else {
                for e in decode_leaf(&leaf_id, &raw)?.extents {
                    match e {
                        Extent::Zero { len } => push(len, PieceData::Zero),
                        Extent::Chunk { id, len } => push(len, PieceData::Chunk(id)),
                    }
                }
            }
        }
        // Whatever the leaf does not cover (or the whole segment, with no leaf) is zeros.
        let covered: u64 = pieces.iter().map(|p| u64::from(p.len)).sum();
        if covered < u64::from(seg_len) {
            pieces.push(Piece {
                offset: start + covered,
                len: (u64::from(seg_len) - covered) as u32,
                data: PieceData::Zero,
            });
        }
        let pieces = Arc::new(pieces);
        self.leaves
            .write()
            .expect("leaves lock")
            .insert(seg, pieces.clone());
        Ok(pieces)
    }

    /// The pieces overlapping [offset, offset + len).
    pub async fn pieces_in(&self, offset: u64, len: u64) -> ExportResult<Vec<Piece>> {
        let end = (offset + len).min(self.size());
        let mut out = Vec::new();
        if offset >= end {
            return Ok(out);
        }
        let ss = self.segment_size();
        for seg in offset / ss..=(end - 1) / ss {
            for p in self.pieces(seg).await?.iter() {
                if p.offset < end && p.offset + p.len as u64 > offset {
                    out.push(*p);
                }
            }
        }
        Ok(out)
    }

    /// A chunk from the host-wide cache, checked against its id as this repository makes
    /// them (keyed when encrypted).
    fn cached(&self, id: &Id) -> Option<Vec<u8>> {
        self.cache.get_with(id, |d| self.repo.id_of(d))
    }

    /// A chunk's bytes: from the cache, or fetched from the repository (once, however many
    /// readers ask at the same time).
    pub async fn chunk(&self, id: &Id) -> ExportResult<Arc<Vec<u8>>> {
        if let Some(data) = self.cached(id) {
            self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(Arc::new(data));
        }
        let deadline = ContentCache::fetch_deadline();
        let guard = self
            .cache
            .lock_fetch_until(id, deadline, || self.cache.contains(id))
            .await;
        let result = match self.cached(id) {
            Some(data) => {
                self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
                Ok(Arc::new(data))
            }
            None => {
                self.stats.cache_misses.fetch_add(1, Ordering::Relaxed);
                match read_blob(&self.repo, id).await {
                    Ok(data) => {
                        self.stats.chunks_fetched.fetch_add(1, Ordering::Relaxed);
                        self.stats
                            .bytes_fetched
                            .fetch_add(data.len() as u64, Ordering::Relaxed);
                        self.cache.put_behind(id, &data);
                        Ok(Arc::new(data))
                    }
                    Err(e) => {
                        self.stats.fetch_errors.fetch_add(1, Ordering::Relaxed);
                        tracing::error!(chunk = %id, "fetch failed: {e}");
                        Err(e)
                    }
                }
            }
        };
        drop(guard);
        result
    }

    /// The bytes of slots `first .. first + count` of format 2 group `group`, and whether
    /// the host-wide cache held all of them. A miss fetches the group (once, however many
    /// readers ask: the reader's group cache) and puts the run's chunks into the host-wide
    /// cache.
    pub async fn run(
        &self,
        group: &Id,
        first: u16,
        count: u16,
    ) -> ExportResult<(Arc<Vec<u8>>, bool)> {
        self.run_at(None, group, first, count).await
    }

    /// [`Self::run`] for a run at image offset `at`, where seeds are looked at (after the
    /// cache, before the store).
    pub async fn run_at(
        &self,
        at: Option<u64>,
        group: &Id,
        first: u16,
        count: u16,
    ) -> ExportResult<(Arc<Vec<u8>>, bool)> {
        let result = self.run_uncounted(at, group, first, count).await;
        if let Err(e) = &result {
            self.stats.fetch_errors.fetch_add(1, Ordering::Relaxed);
            tracing::error!(%group, "fetch failed: {e}");
        }
        result
    }

    /// [`Self::run_once`]; if a pack it needs is gone (a GC repacked it: GC does not wait
    /// for exports), re-reads the index runs once and tries again.
    async fn run_uncounted(
        &self,
        at: Option<u64>,
        group: &Id,
        first: u16,
        count: u16,
    ) -> ExportResult<(Arc<Vec<u8>>, bool)> {
        match self.run_once(at, group, first, count).await {
            Err(ExportError::Repo(
                RepoError::PackMissing { .. } | RepoError::BlobMissing { .. },
            )) => {
                tracing::info!(%group, "pack gone; re-reading the index runs");
                self.repo.refresh_index().await?;
                self.run_once(at, group, first, count).await
            }
            other => other,
        }
    }

    /// The bytes of `slots` (a run at image offset `at`) from the seeds, each chunk from the
    /// first seed whose bytes there have its id; `None` unless every chunk is found.
    async fn seeded_run(
        &self,
        at: u64,
        slots: &[cairn_format::group::GroupChunk],
    ) -> Option<Vec<u8>> {
        let seeds = self.seeds.clone()?;
        let len: usize = slots.iter().map(|c| c.len as usize).sum();
        let images = tokio::task::spawn_blocking(move || seeds.read(at, len))
            .await
            .ok()?;
        let mut out = Vec::with_capacity(len);
        let mut pos = 0;
        for c in slots {
            let end = pos + c.len as usize;
            let found = images
                .iter()
                .map(|img| &img[pos..end])
                .find(|bytes| self.repo.id_of(bytes) == c.id)?;
            out.extend_from_slice(found);
            pos = end;
        }
        self.stats
            .seeded_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
        Some(out)
    }

    async fn run_once(
        &self,
        at: Option<u64>,
        group: &Id,
        first: u16,
        count: u16,
    ) -> ExportResult<(Arc<Vec<u8>>, bool)> {
        let reader = self
            .repo
            .v2()
            .ok_or_else(|| RepoError::internal("export", "a group run in a format 1 repository"))?;
        let wanted = [(first, count)];
        let loc = match reader.locate_group_storing(group, &wanted).await {
            Ok(loc) if loc.stores(&wanted) => loc,
            // No good copy stores the run: each slot's chunk from wherever else it is.
            Ok(_) | Err(RepoError::Quarantined { .. }) => {
                return self.run_elsewhere(reader, group, first, count).await
            }
            Err(e) => return record_damage(&self.repo, Err(e)).await,
        };
        let desc = &loc.trailer.groups[loc.group as usize].desc;
        let range = usize::from(first)..usize::from(first) + usize::from(count);
        let slots = desc
            .chunks
            .get(range)
            .filter(|s| s.iter().all(|c| c.stored))
            .ok_or_else(|| {
                RepoError::corrupt(
                    format!("group {group}"),
                    FormatError::invalid(
                        "group",
                        format!(
                            "a leaf names slots {first}..{} of {} (or slots no longer stored)",
                            u32::from(first) + u32::from(count),
                            desc.chunks.len()
                        ),
                    ),
                )
            })?;
        if let Some(data) = self.cached_run(slots) {
            self.stats
                .cache_hits
                .fetch_add(u64::from(count), Ordering::Relaxed);
            return Ok((Arc::new(data), true));
        }
        // One fetch of a group at a time in this process: a reader that meets a fetch in
        // progress (a profile's prefetch, another client) waits for it and then finds the
        // run cached, instead of fetching the group again.
        let deadline = ContentCache::fetch_deadline();
        let in_cache = || {
            slots
                .iter()
                .all(|c| !c.stored || self.cache.contains(&c.id))
        };
        let _guard = self.cache.lock_fetch_until(group, deadline, in_cache).await;
        self.fetch_run(at, group, first, count, reader, &loc, slots)
            .await
    }

    /// The run's bytes if the cache holds every chunk of it.
    fn cached_run(&self, slots: &[cairn_format::group::GroupChunk]) -> Option<Vec<u8>> {
        let mut data = Vec::with_capacity(slots.iter().map(|c| c.len as usize).sum());
        for c in slots {
            data.extend_from_slice(&self.cached(&c.id)?);
        }
        Some(data)
    }

    /// [`Self::run_once`] past the cache, under the group's fetch lock: the cache again (a
    /// fetch that held the lock may have filled it), the seeds, then the store.
    #[allow(clippy::too_many_arguments)]
    async fn fetch_run(
        &self,
        at: Option<u64>,
        group: &Id,
        first: u16,
        count: u16,
        reader: &V2Reader,
        loc: &cairn_repo::v2::GroupLocation,
        slots: &[cairn_format::group::GroupChunk],
    ) -> ExportResult<(Arc<Vec<u8>>, bool)> {
        if let Some(data) = self.cached_run(slots) {
            self.stats
                .cache_hits
                .fetch_add(u64::from(count), Ordering::Relaxed);
            return Ok((Arc::new(data), true));
        }
        let desc = &loc.trailer.groups[loc.group as usize].desc;
        if let Some(at) = at {
            if let Some(bytes) = self.seeded_run(at, slots).await {
                return Ok((Arc::new(bytes), true));
            }
        }
        self.stats
            .cache_misses
            .fetch_add(u64::from(count), Ordering::Relaxed);
        let (opened, fetched) = match reader.open_group_counted(&loc.trailer, loc.group).await {
            Ok(opened) => opened,
            // A vanished pack is a GC's repack (the caller re-reads the index runs); other
            // damage quarantines this copy and reads the slots elsewhere.
            Err(e) if e.is_damage() && !matches!(e, RepoError::PackMissing { .. }) => {
                reader.quarantine_group(loc, &e.to_string());
                tracing::warn!("damaged group, reading its chunks from other copies: {e}");
                return self.run_elsewhere(reader, group, first, count).await;
            }
            Err(e) => return record_damage(&self.repo, Err(e)).await,
        };
        if fetched {
            self.stats.chunks_fetched.fetch_add(
                desc.chunks.iter().filter(|c| c.stored).count() as u64,
                Ordering::Relaxed,
            );
            self.stats
                .bytes_fetched
                .fetch_add(opened.plain().len() as u64, Ordering::Relaxed);
        }
        let bytes = opened
            .slots(usize::from(first), usize::from(count))
            .map_err(|e| RepoError::corrupt(format!("group {group}"), e))?;
        let mut at = 0;
        for c in slots {
            let chunk = &bytes[at..at + c.len as usize];
            at += c.len as usize;
            self.cache.put_behind(&c.id, chunk);
        }
        Ok((Arc::new(bytes.to_vec()), false))
    }

    /// Slots `first .. first + count` of `group` when no good copy of the group stores
    /// them: [`V2Reader::read_group_run`]'s fallback to each chunk's other copies (not put
    /// in the host-wide cache: it is rare, and the slots' ids are the damaged copy's word).
    async fn run_elsewhere(
        &self,
        reader: &V2Reader,
        group: &Id,
        first: u16,
        count: u16,
    ) -> ExportResult<(Arc<Vec<u8>>, bool)> {
        let bytes =
            record_damage(&self.repo, reader.read_group_run(group, first, count).await).await?;
        self.stats
            .bytes_fetched
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok((Arc::new(bytes.to_vec()), false))
    }

    /// Reads [offset, offset + buf.len()) of the base into `buf`. A miss starts read-ahead of
    /// the chunks that follow the range.
    pub async fn read(self: &Arc<Self>, offset: u64, buf: &mut [u8]) -> ExportResult<()> {
        let end = offset + buf.len() as u64;
        let pieces = self.pieces_in(offset, buf.len() as u64).await?;
        let mut missed = false;
        // Fetch the chunks of the range concurrently.
        let mut tasks = tokio::task::JoinSet::new();
        for p in &pieces {
            let me = self.clone();
            let p = *p;
            match p.data {
                PieceData::Zero => {
                    let overlap = (p.offset + p.len as u64).min(end) - p.offset.max(offset);
                    self.stats
                        .zero_bytes_read
                        .fetch_add(overlap, Ordering::Relaxed);
                }
                PieceData::Chunk(id) => {
                    let miss = !self.cache.contains(&id);
                    tasks.spawn(async move { me.chunk(&id).await.map(|d| (p, d, miss)) });
                }
                PieceData::Run {
                    group,
                    first,
                    count,
                } => {
                    tasks.spawn(async move {
                        let (d, hit) = me.run_at(Some(p.offset), &group, first, count).await?;
                        Ok::<_, ExportError>((p, d, !hit))
                    });
                }
            }
        }
        buf.fill(0);
        while let Some(r) = tasks.join_next().await {
            let (p, data, miss) = r??;
            missed |= miss;
            if data.len() != p.len as usize {
                return Err(ExportError::PieceSize {
                    piece: p.data.to_string(),
                    got: data.len(),
                    want: p.len,
                });
            }
            let from = p.offset.max(offset);
            let to = (p.offset + p.len as u64).min(end);
            buf[(from - offset) as usize..(to - offset) as usize]
                .copy_from_slice(&data[(from - p.offset) as usize..(to - p.offset) as usize]);
        }
        if missed && self.readahead > 0 {
            self.read_ahead(end);
        }
        Ok(())
    }

    /// Fetches, in the background, the next `readahead` chunks after `from`.
    fn read_ahead(self: &Arc<Self>, from: u64) {
        let me = self.clone();
        self.spawn_background(async move {
            let span = me.readahead as u64 * 4 * 1024 * 1024; // upper bound of chunk sizes
            let Ok(pieces) = me.pieces_in(from, span.min(me.segment_size() * 2)).await else {
                return;
            };
            let ahead = pieces.iter().filter(|p| p.offset >= from);
            if me.repo.v2().is_some() {
                return me.read_ahead_groups(ahead).await;
            }
            let ids: Vec<Id> = ahead
                .filter_map(|p| match p.data {
                    PieceData::Chunk(id) => Some(id),
                    _ => None,
                })
                .take(me.readahead)
                .collect();
            // Take the fetch lock of each chunk not cached yet, without waiting: a chunk whose
            // lock is held is being fetched by a reader already, and a reader that comes
            // later waits for this batch and then finds the chunk cached. Fetched once either
            // way.
            let mut missing = Vec::new();
            let mut guards = Vec::new();
            for id in ids {
                if me.cache.contains(&id) {
                    continue;
                }
                if let Some(guard) = me.cache.try_lock_fetch(&id) {
                    // Not fetched while we looked.
                    if !me.cache.contains(&id) {
                        missing.push(id);
                        guards.push(guard);
                    }
                }
            }
            if missing.is_empty() {
                return;
            }
            // One batch: neighbours in a pack come in one ranged read (what makes read-ahead
            // pay on S3, where each request is a round trip).
            me.stats
                .readahead_chunks
                .fetch_add(missing.len() as u64, Ordering::Relaxed);
            match read_blobs(&me.repo, &missing).await {
                Ok(chunks) => {
                    for (id, data) in missing.iter().zip(chunks) {
                        me.stats.chunks_fetched.fetch_add(1, Ordering::Relaxed);
                        me.stats
                            .bytes_fetched
                            .fetch_add(data.len() as u64, Ordering::Relaxed);
                        me.cache.put_behind(id, &data);
                    }
                }
                // Read-ahead is a guess: a failure here surfaces when the data is really read.
                Err(e) => tracing::debug!("read-ahead: {e}"),
            }
            drop(guards);
        });
    }

    /// Format 2 read-ahead: the runs of the next `readahead` groups, fetched concurrently
    /// (each group once, whatever runs of it follow).
    async fn read_ahead_groups(self: &Arc<Self>, ahead: impl Iterator<Item = &Piece>) {
        let mut groups: Vec<Id> = Vec::new();
        let mut tasks = tokio::task::JoinSet::new();
        for p in ahead {
            let PieceData::Run {
                group,
                first,
                count,
            } = p.data
            else {
                continue;
            };
            if !groups.contains(&group) {
                if groups.len() == self.readahead {
                    break;
                }
                groups.push(group);
            }
            let me = self.clone();
            tasks.spawn(async move {
                match me.run(&group, first, count).await {
                    Ok((_, false)) => {
                        me.stats
                            .readahead_chunks
                            .fetch_add(u64::from(count), Ordering::Relaxed);
                    }
                    Ok((_, true)) => {}
                    // Read-ahead is a guess: a failure surfaces when the data is really read.
                    Err(e) => tracing::debug!("read-ahead: {e}"),
                }
            });
        }
        while tasks.join_next().await.is_some() {}
    }

    /// Loads into the cache every chunk of `ranges` (a boot profile's next reads), fetching
    /// the groups they need with as few reads as possible: neighbouring groups of one pack
    /// come in one ranged read ([`V2Reader::open_groups`]), where [`Self::prefetch`] fetches
    /// group by group. The groups are locked while they are fetched, as a reader's fetch
    /// locks its group, so a guest read that needs one waits for it instead of fetching it
    /// again. A run that needs another path (seeds, a damaged or partial copy, format 1)
    /// takes the reader's.
    pub async fn prefetch_batch(self: &Arc<Self>, ranges: &[(u64, u64)]) -> ExportResult<()> {
        let reader = match self.repo.v2() {
            Some(reader) if self.seeds.is_none() => reader,
            _ => {
                for &(offset, len) in ranges {
                    self.prefetch(offset, len).await?;
                }
                return Ok(());
            }
        };
        let mut wanted: Vec<(GroupLocation, Id, u16, u16)> = Vec::new();
        for &(offset, len) in ranges {
            for p in self.pieces_in(offset, len).await? {
                let PieceData::Run {
                    group,
                    first,
                    count,
                } = p.data
                else {
                    continue;
                };
                let runs = [(first, count)];
                match reader.locate_group_storing(&group, &runs).await {
                    Ok(loc) if loc.stores(&runs) => {
                        if !self.run_cached(&loc, first, count) {
                            wanted.push((loc, group, first, count));
                        }
                    }
                    _ => {
                        self.run_at(Some(p.offset), &group, first, count).await?;
                    }
                }
            }
        }
        let mut groups: Vec<Id> = wanted.iter().map(|w| w.1).collect();
        groups.sort();
        groups.dedup();
        // In id order, as every batch takes them: two batches never wait on each other.
        // One deadline for the batch: other processes' fetches hold it up by at most one wait.
        let deadline = ContentCache::fetch_deadline();
        let mut guards = Vec::with_capacity(groups.len());
        for g in &groups {
            let runs: Vec<_> = wanted.iter().filter(|w| w.1 == *g).collect();
            let in_cache = || {
                runs.iter()
                    .all(|(loc, _, first, count)| self.run_cached(loc, *first, *count))
            };
            guards.push(self.cache.lock_fetch_until(g, deadline, in_cache).await);
        }
        // What a reader fetched while this batch waited for its locks is not fetched again.
        wanted.retain(|(loc, _, first, count)| !self.run_cached(loc, *first, *count));
        self.fetch_batch(reader, &wanted).await
    }

    /// Whether the cache holds every chunk of slots `first .. first + count` of the group at
    /// `loc` (a slot out of range or not stored counts as not held).
    fn run_cached(&self, loc: &GroupLocation, first: u16, count: u16) -> bool {
        let desc = &loc.trailer.groups[loc.group as usize].desc;
        let range = usize::from(first)..usize::from(first) + usize::from(count);
        desc.chunks
            .get(range)
            .is_some_and(|slots| slots.iter().all(|c| c.stored && self.cache.contains(&c.id)))
    }

    /// Fetches the groups of `wanted` together and puts each run's chunks in the cache.
    async fn fetch_batch(
        &self,
        reader: &V2Reader,
        wanted: &[(GroupLocation, Id, u16, u16)],
    ) -> ExportResult<()> {
        let locations: Vec<GroupLocation> = wanted.iter().map(|w| w.0.clone()).collect();
        // Groups already open (a reader's, moments ago) are not fetched: not counted.
        let mut counted: Vec<Id> = wanted
            .iter()
            .filter(|(loc, ..)| reader.is_open(&loc.trailer.pack, loc.group))
            .map(|w| w.1)
            .collect();
        let opened = record_damage(&self.repo, reader.open_groups(&locations).await).await?;
        for ((loc, group, first, count), opened) in wanted.iter().zip(opened) {
            let desc = &loc.trailer.groups[loc.group as usize].desc;
            if !counted.contains(group) {
                counted.push(*group);
                self.stats.chunks_fetched.fetch_add(
                    desc.chunks.iter().filter(|c| c.stored).count() as u64,
                    Ordering::Relaxed,
                );
                self.stats
                    .bytes_fetched
                    .fetch_add(opened.plain().len() as u64, Ordering::Relaxed);
            }
            self.stats
                .cache_misses
                .fetch_add(u64::from(*count), Ordering::Relaxed);
            let bytes = opened
                .slots(usize::from(*first), usize::from(*count))
                .map_err(|e| RepoError::corrupt(format!("group {group}"), e))?;
            let range = usize::from(*first)..usize::from(*first) + usize::from(*count);
            let mut at = 0;
            for c in &desc.chunks[range] {
                self.cache
                    .put_behind(&c.id, &bytes[at..at + c.len as usize]);
                at += c.len as usize;
            }
        }
        Ok(())
    }

    /// Loads into the cache every chunk of [offset, offset + len) (NBD_CMD_CACHE).
    pub async fn prefetch(self: &Arc<Self>, offset: u64, len: u64) -> ExportResult<()> {
        for p in self.pieces_in(offset, len).await? {
            match p.data {
                PieceData::Zero => {}
                PieceData::Chunk(id) => {
                    self.chunk(&id).await?;
                }
                PieceData::Run {
                    group,
                    first,
                    count,
                } => {
                    self.run_at(Some(p.offset), &group, first, count).await?;
                }
            }
        }
        Ok(())
    }
}

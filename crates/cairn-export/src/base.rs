//! The read-only base of an export: one stored version, read lazily.
//!
//! Opening reads only the interior manifest nodes (one per 256 segments), which map each
//! segment to its leaf. Leaves are read the first time a segment is touched and kept. A chunk
//! comes from the host-wide cache, or else from the repository (verified against its id) and
//! then goes into the cache; after a miss the following chunks are fetched in the background
//! (read-ahead), as BlobSeer's on-demand mirroring does. Zero extents never touch the
//! repository.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};

use cairn_format::node::Extent;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::tree_walk::{decode_leaf, walk_tree, NodeAt, NodeReader, TreeVisitor};
use cairn_repo::{Repo, RepoError};

use crate::error::{ExportError, ExportResult};

use crate::stats::ExportStats;
use cairn_repo::ContentCache;

/// One extent of a loaded leaf, with its offset in the image.
#[derive(Debug, Clone, Copy)]
pub struct Piece {
    pub offset: u64,
    pub len: u32,
    /// None: zeros.
    pub chunk: Option<Id>,
}

pub struct Base {
    repo: Arc<Repo>,
    cache: Arc<ContentCache>,
    stats: Arc<ExportStats>,
    id: Id,
    record: VersionRecord,
    /// Segment index → leaf id (absent: all zeros).
    leaf_ids: HashMap<u64, Id>,
    leaves: RwLock<HashMap<u64, Arc<Vec<Piece>>>>,
    readahead: usize,
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
        repo.require_format_1("export")?;
        let leaf_ids = Self::segment_map(&repo, &record, &stats).await?;
        Ok(Base {
            repo,
            cache,
            stats,
            id,
            record,
            leaf_ids,
            leaves: RwLock::new(HashMap::new()),
            readahead,
        })
    }

    /// Segment index → leaf id, from the interior nodes (leaves are read on first use).
    async fn segment_map(
        repo: &Repo,
        record: &VersionRecord,
        stats: &ExportStats,
    ) -> ExportResult<HashMap<u64, Id>> {
        /// Records where each leaf is without reading it.
        struct LeafIds(HashMap<u64, Id>);
        impl TreeVisitor<ExportError> for LeafIds {
            fn enter(&mut self, at: &NodeAt) -> bool {
                if at.level == 0 {
                    self.0.insert(at.index, at.id);
                }
                at.level > 0
            }
        }
        let mut leaves = LeafIds(HashMap::new());
        if let Some(root) = record.root {
            let mut reader = ExportNodes { repo, stats };
            walk_tree(&mut reader, root, record.height, record.fanout, &mut leaves).await?;
        }
        Ok(leaves.0)
    }

    pub fn id(&self) -> Id {
        self.id
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
        match self.leaf_ids.get(&seg) {
            None => pieces.push(Piece {
                offset: start,
                len: seg_len,
                chunk: None,
            }),
            Some(leaf_id) => {
                let mut reader = ExportNodes {
                    repo: &self.repo,
                    stats: &self.stats,
                };
                let leaf = decode_leaf(leaf_id, &reader.read_node(leaf_id).await?)?;
                let mut at = start;
                for e in leaf.extents {
                    let (len, chunk) = match e {
                        Extent::Zero { len } => (len, None),
                        Extent::Chunk { id, len } => (len, Some(id)),
                    };
                    pieces.push(Piece {
                        offset: at,
                        len,
                        chunk,
                    });
                    at += len as u64;
                }
                let end = start + seg_len as u64;
                if at < end {
                    pieces.push(Piece {
                        offset: at,
                        len: (end - at) as u32,
                        chunk: None,
                    });
                }
            }
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

    /// A chunk's bytes: from the cache, or fetched from the repository (once, however many
    /// readers ask at the same time).
    pub async fn chunk(&self, id: &Id) -> ExportResult<Arc<Vec<u8>>> {
        if let Some(data) = self.cache.get(id) {
            self.stats.cache_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(Arc::new(data));
        }
        let lock = self.cache.fetch_lock(id);
        let guard = lock.lock().await;
        let result = match self.cache.get(id) {
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
                        if let Err(e) = self.cache.put(id, &data) {
                            tracing::warn!("chunk cache: {e}");
                        }
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
        drop(lock);
        self.cache.release_fetch_lock(id);
        result
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
            if p.chunk.is_none() {
                let overlap = (p.offset + p.len as u64).min(end) - p.offset.max(offset);
                self.stats
                    .zero_bytes_read
                    .fetch_add(overlap, Ordering::Relaxed);
            }
            if let Some(id) = p.chunk {
                if !self.cache.contains(&id) {
                    missed = true;
                }
                let me = self.clone();
                let p = *p;
                tasks.spawn(async move { me.chunk(&id).await.map(|d| (p, d)) });
            }
        }
        buf.fill(0);
        while let Some(r) = tasks.join_next().await {
            let (p, data) = r??;
            if data.len() != p.len as usize {
                return Err(ExportError::ChunkSize {
                    id: p.chunk.expect("chunk"),
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
        tokio::spawn(async move {
            let span = me.readahead as u64 * 4 * 1024 * 1024; // upper bound of chunk sizes
            let Ok(pieces) = me.pieces_in(from, span.min(me.segment_size() * 2)).await else {
                return;
            };
            let ids: Vec<Id> = pieces
                .iter()
                .filter(|p| p.offset >= from)
                .filter_map(|p| p.chunk)
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
                if let Ok(guard) = me.cache.fetch_lock(&id).try_lock_owned() {
                    if me.cache.contains(&id) {
                        // Fetched while we looked.
                        drop(guard);
                        me.cache.release_fetch_lock(&id);
                        continue;
                    }
                    missing.push(id);
                    guards.push(guard);
                }
            }
            let release = |me: &Base, guards: Vec<_>, ids: &[Id]| {
                drop(guards);
                for id in ids {
                    me.cache.release_fetch_lock(id);
                }
            };
            if missing.is_empty() {
                release(&me, guards, &missing);
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
                        if let Err(e) = me.cache.put(id, &data) {
                            tracing::warn!("chunk cache: {e}");
                        }
                    }
                }
                // Read-ahead is a guess: a failure here surfaces when the data is really read.
                Err(e) => tracing::debug!("read-ahead: {e}"),
            }
            release(&me, guards, &missing);
        });
    }

    /// Loads into the cache every chunk of [offset, offset + len) (NBD_CMD_CACHE).
    pub async fn prefetch(self: &Arc<Self>, offset: u64, len: u64) -> ExportResult<()> {
        for p in self.pieces_in(offset, len).await? {
            if let Some(id) = p.chunk {
                self.chunk(&id).await?;
            }
        }
        Ok(())
    }
}

//! The NBD backend of one export: a stored version read lazily through the chunk cache, and,
//! for writable exports, the local overlay that takes the writes (whole blocks of the
//! repository's chunk size; a partial write first fills its block from below).
//!
//! A COMMIT pauses I/O (every request holds the `io` lock shared; the commit holds it alone),
//! flushes the overlay, publishes base + overlay as a new version, then continues on that
//! version with an empty overlay.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use cairn_engine::commit::patch::{commit_patch, PatchOptions, PatchSource};
use cairn_engine::commit::CommitResult;
use cairn_nbd::{Export, Extent};
use cairn_overlay::Overlay;
use cairn_repo::Repo;

use crate::base::Base;
use crate::error::{ExportError, ExportResult};
use crate::profile::Recorder;
use crate::stats::ExportStats;

pub struct VersionExport {
    base: RwLock<Arc<Base>>,
    overlay: Option<Arc<Overlay>>,
    stats: Arc<ExportStats>,
    /// Shared by every request, exclusive for a commit.
    io: tokio::sync::RwLock<()>,
    /// Serializes writes (a partial-block write is a read-modify-write of its block).
    writes: tokio::sync::Mutex<()>,
    /// Set by [`VersionExport::shutdown`]: every later request fails with `ESHUTDOWN`.
    closed: AtomicBool,
    /// Records the client's first reads as a boot profile (`export --record-profile`).
    recorder: Option<Arc<Recorder>>,
}

fn shutting_down() -> io::Error {
    io::Error::from_raw_os_error(libc::ESHUTDOWN)
}

impl VersionExport {
    /// A read-only export of `base`.
    pub fn new(base: Base, stats: Arc<ExportStats>) -> VersionExport {
        Self::with_overlay(base, None, stats)
    }

    /// An export of `base` taking writes into `overlay` (None: read-only).
    pub fn with_overlay(
        base: Base,
        overlay: Option<Arc<Overlay>>,
        stats: Arc<ExportStats>,
    ) -> VersionExport {
        VersionExport {
            base: RwLock::new(Arc::new(base)),
            overlay,
            stats,
            io: tokio::sync::RwLock::new(()),
            writes: tokio::sync::Mutex::new(()),
            closed: AtomicBool::new(false),
            recorder: None,
        }
    }

    /// Records the client's reads in `recorder` (a boot profile).
    pub fn with_recorder(mut self, recorder: Arc<Recorder>) -> VersionExport {
        self.recorder = Some(recorder);
        self
    }

    /// Lets a request in (shared with other requests, never during a commit or after
    /// [`shutdown`](Self::shutdown)).
    async fn enter(&self) -> io::Result<tokio::sync::RwLockReadGuard<'_, ()>> {
        let guard = self.io.read().await;
        if self.closed.load(Ordering::SeqCst) {
            return Err(shutting_down());
        }
        Ok(guard)
    }

    /// Stops the export for good: waits for the requests in progress, refuses every later
    /// one (`ESHUTDOWN`), and flushes the overlay durably, so that every write a client
    /// was told about is found again by the next export of this overlay.
    pub async fn shutdown(&self) -> io::Result<()> {
        let _paused = self.io.write().await;
        self.closed.store(true, Ordering::SeqCst);
        self.base().stop_background().await;
        Ok(self.flush_overlay().await?)
    }

    pub fn base(&self) -> Arc<Base> {
        self.base.read().expect("base lock").clone()
    }

    pub fn overlay(&self) -> Option<&Arc<Overlay>> {
        self.overlay.as_ref()
    }

    pub fn stats(&self) -> &Arc<ExportStats> {
        &self.stats
    }

    fn writable(&self) -> ExportResult<&Arc<Overlay>> {
        self.overlay.as_ref().ok_or(ExportError::ReadOnly)
    }

    fn block_size(&self) -> u64 {
        self.overlay
            .as_ref()
            .map_or(u64::MAX, |o| o.block_size() as u64)
    }

    /// Reads [offset, offset + buf.len()): held blocks from the overlay, the rest from the base.
    async fn read_into(&self, base: &Arc<Base>, offset: u64, buf: &mut [u8]) -> ExportResult<()> {
        let Some(overlay) = &self.overlay else {
            return base.read(offset, buf).await;
        };
        let bs = self.block_size();
        let end = offset + buf.len() as u64;
        let mut at = offset;
        while at < end {
            let block = at / bs;
            let block_end = ((block + 1) * bs).min(end);
            if overlay.holds(block) {
                let slice = &mut buf[(at - offset) as usize..(block_end - offset) as usize];
                if overlay.read_if_held(block, (at - block * bs) as u32, slice)? {
                    at = block_end;
                    continue;
                }
            }
            // A run of blocks the overlay does not hold: one base read.
            let mut run_end = block_end;
            while run_end < end && !overlay.holds(run_end / bs) {
                run_end = ((run_end / bs + 1) * bs).min(end);
            }
            base.read(
                at,
                &mut buf[(at - offset) as usize..(run_end - offset) as usize],
            )
            .await?;
            at = run_end;
        }
        Ok(())
    }

    /// Writes `data` at `offset` (None: zeros) into the overlay, block by block.
    async fn write_range(&self, offset: u64, len: u64, data: Option<&[u8]>) -> ExportResult<()> {
        let overlay = self.writable()?.clone();
        let base = self.base();
        let bs = self.block_size();
        let end = offset + len;
        let _serial = self.writes.lock().await;
        let mut at = offset;
        while at < end {
            let block = at / bs;
            let start = block * bs;
            let block_len = overlay.block_len(block);
            let block_end = (start + block_len).min(end);
            let piece = |from: u64, to: u64| {
                data.map(|d| &d[(from - offset) as usize..(to - offset) as usize])
            };
            if at == start && block_end == start + block_len {
                match piece(at, block_end) {
                    Some(bytes) => overlay.write_block(block, bytes)?,
                    None => overlay.zero_blocks(block, 1)?,
                }
            } else {
                // Partial block: fill it from below first.
                let mut full = vec![0u8; block_len as usize];
                self.read_into(&base, start, &mut full).await?;
                let dst = &mut full[(at - start) as usize..(block_end - start) as usize];
                match piece(at, block_end) {
                    Some(bytes) => dst.copy_from_slice(bytes),
                    None => dst.fill(0),
                }
                overlay.write_block(block, &full)?;
            }
            at = block_end;
        }
        self.stats.writes.fetch_add(1, Ordering::Relaxed);
        self.stats.bytes_written.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    async fn flush_overlay(&self) -> ExportResult<()> {
        if let Some(overlay) = &self.overlay {
            let overlay = overlay.clone();
            tokio::task::spawn_blocking(move || overlay.flush()).await??;
            self.stats.flushes.fetch_add(1, Ordering::Relaxed);
        }
        Ok(())
    }

    /// COMMIT: publishes base + overlay as a new version of `image` (a new image starts its
    /// history at the base version), then serves that version with an empty overlay.
    /// `repo` must be a session opened for this commit (so that GC's plan protocol covers it).
    ///
    /// Into an image whose newest version is not the base (an export of an older version,
    /// or the image moved on since), the new version would silently drop every change made
    /// after the base: refused unless `force`. Forced, the new version's parent is the
    /// image's newest (its history stays one line, nothing becomes unreachable) and its
    /// content is the base's with the export's writes: a rollback, said in its message.
    pub async fn commit(
        &self,
        repo: Arc<Repo>,
        image: &str,
        mut message: String,
        force: bool,
        readahead: usize,
        cache: Arc<cairn_repo::ContentCache>,
    ) -> ExportResult<CommitResult> {
        let overlay = self.writable()?.clone();
        let _paused = self.io.write().await;
        if self.closed.load(Ordering::SeqCst) {
            return Err(ExportError::Stopping);
        }
        let base = self.base();
        if let Some(head) = repo.head(image).await? {
            if head.version != base.id() {
                let newest = repo.load_version(&head.version).await?;
                let served = base.record();
                let what = format!("{}@{}", served.image, served.seq);
                if !force {
                    return Err(ExportError::BaseNotNewest(format!(
                        "the export serves {what}, but the newest version of {image} is @{}: \
                         committing would make a newest version without the changes since; \
                         commit into a new image (`cairn commit NEW_IMAGE --from-export ...`), \
                         or pass --force to roll {image} back to {what} plus the export's writes",
                        newest.seq
                    )));
                }
                let note = format!("rolls back to {what} (the newest was @{})", newest.seq);
                message = match message.is_empty() {
                    true => note,
                    false => format!("{message} ({note})"),
                };
            }
        }
        self.flush_overlay().await?;
        let patch = OverlayPatch(overlay.clone());
        let result = commit_patch(
            repo.clone(),
            image,
            Some((base.id(), base.record().clone())),
            base.size(),
            &patch,
            PatchOptions {
                message,
                ..PatchOptions::default()
            },
        )
        .await?;
        let next = Base::open(
            repo,
            cache,
            self.stats.clone(),
            result.id,
            result.record.clone(),
            readahead,
        )
        .await?;
        overlay.reset(&result.id.to_hex())?;
        let old = std::mem::replace(&mut *self.base.write().expect("base lock"), Arc::new(next));
        old.stop_background().await;
        Ok(result)
    }
}

/// The overlay's held blocks as a patch on the base.
struct OverlayPatch(Arc<Overlay>);

impl PatchSource for OverlayPatch {
    fn block_size(&self) -> u32 {
        self.0.block_size()
    }

    fn changed_blocks(&self) -> Vec<u64> {
        self.0.held_blocks()
    }

    fn read_block(&self, index: u64) -> io::Result<Vec<u8>> {
        let mut buf = vec![0u8; self.0.block_len(index) as usize];
        self.0
            .read_block(index, 0, &mut buf)
            .map_err(|e| io::Error::from(ExportError::from(e)))?;
        Ok(buf)
    }
}

#[async_trait]
impl Export for VersionExport {
    fn size(&self) -> u64 {
        self.base().size()
    }

    fn read_only(&self) -> bool {
        self.overlay.is_none()
    }

    fn multi_conn(&self) -> bool {
        // Every connection of this process shares one overlay: a flush covers all writes.
        true
    }

    fn client_attached(&self, attached: bool) {
        let clients = &self.stats().clients;
        match attached {
            true => clients.fetch_add(1, Ordering::Relaxed),
            false => clients.fetch_sub(1, Ordering::Relaxed),
        };
    }

    async fn read(&self, offset: u64, len: u32) -> io::Result<Bytes> {
        let _io = self.enter().await?;
        let _timing = self
            .recorder
            .as_ref()
            .map(|r| r.record(offset, u64::from(len)));
        let base = self.base();
        let mut buf = BytesMut::zeroed(len as usize);
        self.read_into(&base, offset, &mut buf).await?;
        self.stats.reads.fetch_add(1, Ordering::Relaxed);
        self.stats
            .bytes_read
            .fetch_add(len as u64, Ordering::Relaxed);
        Ok(buf.freeze())
    }

    async fn write(&self, offset: u64, data: Bytes, fua: bool) -> io::Result<()> {
        let _io = self.enter().await?;
        self.write_range(offset, data.len() as u64, Some(&data))
            .await?;
        if fua {
            self.flush_overlay().await?;
        }
        Ok(())
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        _may_trim: bool,
        fua: bool,
    ) -> io::Result<()> {
        let _io = self.enter().await?;
        self.write_range(offset, len as u64, None).await?;
        if fua {
            self.flush_overlay().await?;
        }
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u32) -> io::Result<()> {
        // Trimmed ranges read back as zeros (allowed: their contents become unspecified).
        let _io = self.enter().await?;
        Ok(self.write_range(offset, len as u64, None).await?)
    }

    async fn flush(&self) -> io::Result<()> {
        let _io = self.enter().await?;
        Ok(self.flush_overlay().await?)
    }

    async fn cache(&self, offset: u64, len: u32) -> io::Result<()> {
        let _io = self.enter().await?;
        Ok(self.base().prefetch(offset, len as u64).await?)
    }

    async fn block_status(&self, offset: u64, len: u32) -> io::Result<Vec<Extent>> {
        let _io = self.enter().await?;
        let base = self.base();
        let end = offset + len as u64;
        let bs = self.block_size();
        let mut out: Vec<Extent> = Vec::new();
        let mut push = |len: u64, zero: bool| match out.last_mut() {
            Some(last) if last.hole == zero && last.zero == zero => last.len += len as u32,
            _ => out.push(Extent {
                len: len as u32,
                hole: zero,
                zero,
            }),
        };
        for p in base.pieces_in(offset, len as u64).await? {
            let from = p.offset.max(offset);
            let to = (p.offset + p.len as u64).min(end);
            match &self.overlay {
                None => push(to - from, p.is_zero()),
                Some(overlay) => {
                    // Blocks the overlay holds are data whatever the base says.
                    let mut at = from;
                    while at < to {
                        let block_end = ((at / bs + 1) * bs).min(to);
                        let zero = p.is_zero() && !overlay.holds(at / bs);
                        push(block_end - at, zero);
                        at = block_end;
                    }
                }
            }
        }
        Ok(out)
    }
}

//! Encoding blobs and packing them: data and manifest nodes go to separate packs (a version's
//! tree is read from few places), full packs upload while the next fill, with a bound on how
//! many are in flight.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use cairn_format::Id;
use cairn_repo::v2::PackBytes;
use cairn_repo::{Repo, RepoResult};
use tokio::runtime::Handle;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use super::CommitProgress;
use crate::error::{EngineError, EngineResult};

/// A stored pack: its final id, what the caller attached to it, the bytes written.
type Uploaded<T> = (Id, T, u64);

/// Stores finished packs in the background, at most `limit` at a time, and collects them.
/// On an early return (an error, an interrupt) the uploads still running are waited for, not
/// cancelled, so that when a failed commit returns every pack it stored is known to
/// `Repo::discard_unindexed_packs` and none lands later. A cancelled PUT whose body had gone
/// out can still complete on the server (seen with MinIO: a pack stored after its commit had
/// failed), and a local write in a blocking thread runs on when its task is dropped. Each
/// upload is bounded by the store's own timeouts, so the wait is too.
pub(crate) struct Uploader<'h, T> {
    repo: &'h Arc<Repo>,
    handle: &'h Handle,
    limit: Arc<Semaphore>,
    progress: &'h CommitProgress,
    running: Vec<JoinHandle<RepoResult<Uploaded<T>>>>,
    /// Set by an upload that failed, before it gives back its slot: the packer waiting for
    /// that slot then stops instead of starting an upload that would only be waited for.
    failed: Arc<AtomicBool>,
    done: Vec<(Id, T)>,
    written: u64,
}

impl<'h, T: Send + 'static> Uploader<'h, T> {
    pub(crate) fn new(
        repo: &'h Arc<Repo>,
        handle: &'h Handle,
        uploads: usize,
        progress: &'h CommitProgress,
    ) -> Self {
        Uploader {
            repo,
            handle,
            limit: Arc::new(Semaphore::new(uploads.max(1))),
            progress,
            running: Vec::new(),
            failed: Arc::new(AtomicBool::new(false)),
            done: Vec::new(),
            written: 0,
        }
    }

    /// Starts storing pack `id` (waiting while `limit` uploads run); reaps the uploads that
    /// finished, so an error surfaces early.
    pub(crate) fn start(
        &mut self,
        id: Id,
        bytes: impl Into<PackBytes>,
        with: T,
    ) -> EngineResult<()> {
        let bytes = bytes.into();
        let permit = self
            .handle
            .block_on(self.limit.clone().acquire_owned())
            .map_err(|e| EngineError::internal("upload limiter", e))?;
        if self.failed.load(Ordering::Acquire) {
            drop(permit);
            self.join_all()?;
            // Only an upload's error sets the flag, and its error was not yet taken (a taken
            // error ends the commit), so `join_all` returned it.
            return Err(EngineError::internal(
                "upload",
                "a failed upload left no error",
            ));
        }
        let repo = self.repo.clone();
        let failed = self.failed.clone();
        self.running.push(self.handle.spawn(async move {
            let r = repo.put_pack(&id, bytes).await;
            if r.is_err() {
                failed.store(true, Ordering::Release);
            }
            drop(permit);
            r.map(|(id, n)| (id, with, n))
        }));
        self.reap()
    }

    /// Takes in the uploads that finished; the first that failed is the error. A packer
    /// waiting for work calls it now and then, so a failing store stops the commit at once
    /// rather than at the next pack.
    pub(crate) fn reap(&mut self) -> EngineResult<()> {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].is_finished() {
                let upload = self.running.swap_remove(i);
                self.join(upload)?;
            } else {
                i += 1;
            }
        }
        Ok(())
    }

    fn join(&mut self, upload: JoinHandle<RepoResult<Uploaded<T>>>) -> EngineResult<()> {
        let (id, with, n) = self
            .handle
            .block_on(upload)
            .map_err(|e| EngineError::internal("upload task", e))??;
        self.progress.stored.fetch_add(n, Ordering::Relaxed);
        self.done.push((id, with));
        self.written += n;
        Ok(())
    }

    /// Waits for every upload: the stored packs (final ids) and the bytes written.
    pub(crate) fn finish(mut self) -> EngineResult<(Vec<(Id, T)>, u64)> {
        self.join_all()?;
        Ok((std::mem::take(&mut self.done), self.written))
    }

    /// Waits for the uploads in order; the first that failed is the error (`Drop` waits for
    /// the rest).
    fn join_all(&mut self) -> EngineResult<()> {
        while !self.running.is_empty() {
            let upload = self.running.remove(0);
            self.join(upload)?;
        }
        Ok(())
    }
}

impl<T> Drop for Uploader<'_, T> {
    fn drop(&mut self) {
        // Waited for, not aborted: see the type's documentation. A pack that an upload stored
        // is in the repository's unindexed set, which the failed commit then discards.
        for upload in self.running.drain(..) {
            let _ = self.handle.block_on(upload);
        }
    }
}

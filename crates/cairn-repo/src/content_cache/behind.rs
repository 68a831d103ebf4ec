//! Stores in the background, off the reader's path.
//!
//! A cold read of an export stores each fetched 4 KiB chunk as a file of its own (create,
//! write, rename). Done on the read's path, those writes made a cold replay of a recorded boot
//! 15× slower than the same reads without them (5.6 s against 0.37 s, `bench/boot_profile.py`).
//! Here an object goes into a pending map, which the cache's reads consult first, and one
//! thread per cache writes the files in order. When the thread is more than [`QUEUE`] objects
//! behind, a new object is not cached at all (counted in `dropped`): the cache is a
//! best-effort copy of what the repository holds, and a reader must never wait for it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, Sender, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use cairn_format::Id;

use super::host_lock::HostLocks;
use super::usage::Usage;

/// Objects queued at most (16 MiB of 4 KiB chunks, 64 MiB of format 1's).
pub(super) const QUEUE: usize = 4096;

enum Msg {
    Put(Id),
    Flush(Sender<()>),
    /// Lets go of another process's wait for `Id` once what was queued before is on disk.
    Unlock(Arc<HostLocks>, Id),
}

type Pending = Arc<Mutex<HashMap<Id, Arc<[u8]>>>>;

/// The background writer of one cache.
#[derive(Default)]
pub(super) struct Behind {
    pending: Pending,
    channel: Mutex<Option<(SyncSender<Msg>, JoinHandle<()>)>>,
    dropped: AtomicU64,
}

impl std::fmt::Debug for Behind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Behind")
            .field("dropped", &self.dropped.load(Ordering::Relaxed))
            .finish_non_exhaustive()
    }
}

impl Behind {
    /// A queued object's bytes (the caller checks them against the id, as it checks files).
    pub(super) fn get(&self, id: &Id) -> Option<Arc<[u8]>> {
        self.pending.lock().expect("pending lock").get(id).cloned()
    }

    pub(super) fn contains(&self, id: &Id) -> bool {
        self.pending.lock().expect("pending lock").contains_key(id)
    }

    /// Objects not cached because the writer was too far behind.
    pub(super) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Queues `data` to be stored as `id` in `dir` by the writer thread (started on first
    /// use), which counts what it stores in `usage`. Never waits: a full queue drops it.
    pub(super) fn put(&self, dir: &Path, usage: &Arc<Usage>, id: &Id, data: &[u8]) {
        let sender = {
            let mut channel = self.channel.lock().expect("writer lock");
            if channel.is_none() {
                match self.start(dir.to_path_buf(), usage.clone()) {
                    Ok(started) => *channel = Some(started),
                    Err(e) => {
                        tracing::warn!("cannot start the cache's writer: {e}");
                        return;
                    }
                }
            }
            channel.as_ref().map(|(tx, _)| tx.clone())
        };
        let Some(tx) = sender else { return };
        {
            let mut pending = self.pending.lock().expect("pending lock");
            if pending.contains_key(id) {
                return;
            }
            pending.insert(*id, Arc::from(data));
        }
        match tx.try_send(Msg::Put(*id)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                self.pending.lock().expect("pending lock").remove(id);
                self.dropped.fetch_add(1, Ordering::Relaxed);
            }
            Err(TrySendError::Disconnected(_)) => {
                self.pending.lock().expect("pending lock").remove(id);
            }
        }
    }

    fn start(
        &self,
        dir: PathBuf,
        usage: Arc<Usage>,
    ) -> std::io::Result<(SyncSender<Msg>, JoinHandle<()>)> {
        let (tx, rx) = sync_channel(QUEUE);
        let pending = self.pending.clone();
        let handle = std::thread::Builder::new()
            .name("cache-writer".into())
            .spawn(move || write_loop(rx, pending, dir, usage))?;
        Ok((tx, handle))
    }

    /// The writer's queue, if it runs.
    fn sender(&self) -> Option<SyncSender<Msg>> {
        self.channel
            .lock()
            .expect("writer lock")
            .as_ref()
            .map(|(tx, _)| tx.clone())
    }

    /// Waits until everything queued before the call is on disk.
    pub(super) fn flush(&self) {
        if let Some(tx) = self.sender() {
            let (ack, done) = std::sync::mpsc::channel();
            // Blocking send: a flush waits its turn behind the queued objects.
            if tx.send(Msg::Flush(ack)).is_ok() {
                let _ = done.recv();
            }
        }
    }

    /// Lets go of the host lock of `id` once everything queued before the call is on disk
    /// (at once when nothing is queued, or the queue is full: the next fetcher then finds
    /// less cached, never wrong bytes).
    pub(super) fn unlock_after(&self, host: Arc<HostLocks>, id: &Id) {
        let Some(tx) = self.sender() else {
            host.unlock(id);
            return;
        };
        match tx.try_send(Msg::Unlock(host, *id)) {
            Ok(()) => {}
            Err(TrySendError::Full(Msg::Unlock(host, id)))
            | Err(TrySendError::Disconnected(Msg::Unlock(host, id))) => host.unlock(&id),
            Err(_) => unreachable!("the message sent is an unlock"),
        }
    }

    /// Writes what is queued and stops the thread.
    pub(super) fn close(&self) {
        let started = self.channel.lock().expect("writer lock").take();
        if let Some((tx, handle)) = started {
            drop(tx);
            let _ = handle.join();
        }
    }
}

fn write_loop(rx: Receiver<Msg>, pending: Pending, dir: PathBuf, usage: Arc<Usage>) {
    for msg in rx {
        match msg {
            Msg::Put(id) => {
                let data = pending.lock().expect("pending lock").get(&id).cloned();
                if let Some(data) = data {
                    // The cache's owner starts its scans (one at a time) when this count
                    // makes one due.
                    match super::store_file(&dir, &id, &data) {
                        Ok(true) => usage.add(data.len() as u64),
                        Ok(false) => {}
                        Err(e) => tracing::warn!("chunk cache: {e}"),
                    }
                }
                pending.lock().expect("pending lock").remove(&id);
            }
            Msg::Flush(ack) => {
                let _ = ack.send(());
            }
            Msg::Unlock(host, id) => host.unlock(&id),
        }
    }
}

//! Fetch locks shared by every process that uses one cache directory, so that N exports
//! starting on one host fetch each group once, not up to N times.
//!
//! A lock is an OFD write lock on one byte of `<cache>/fetch.lock`, at an offset taken from
//! the object's id (40 bits: two ids share a byte once in ~10^12 pairs, and a shared byte
//! only makes one fetch wait for another). OFD locks belong to an open file description, so
//! the kernel drops them when a process dies, and a process's own locks never conflict with
//! one another: within a process the cache's in-process lock serializes fetches of one id
//! first. The lock is a hint: a fetch that cannot take it in [`WAIT`] goes ahead without it,
//! and what is cached is verified against its id whoever wrote it.

use std::fs::File;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::Duration;

use cairn_format::Id;

/// How long a fetch waits for another process's fetch of the same object before it fetches
/// the object itself.
pub(super) const WAIT: Duration = Duration::from_secs(5);

/// The open lock file of one cache directory.
#[derive(Debug)]
pub(super) struct HostLocks {
    file: File,
}

impl HostLocks {
    /// Opens (creating, private) `<dir>/fetch.lock`.
    pub(super) fn open(dir: &Path) -> io::Result<HostLocks> {
        let file = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(dir.join("fetch.lock"))?;
        Ok(HostLocks { file })
    }

    /// Takes the lock of `id` if no other process holds it.
    pub(super) fn try_lock(&self, id: &Id) -> io::Result<bool> {
        match self.set(id, libc::F_WRLCK) {
            Ok(()) => Ok(true),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Takes the lock of `id`, polling while another process holds it, for at most [`WAIT`]:
    /// false when it was not taken (the caller fetches without it).
    pub(super) async fn lock(&self, id: &Id) -> bool {
        let mut pause = Duration::from_millis(1);
        let give_up = tokio::time::Instant::now() + WAIT;
        loop {
            match self.try_lock(id) {
                Ok(true) => return true,
                Ok(false) if tokio::time::Instant::now() < give_up => {}
                Ok(false) => {
                    tracing::debug!(%id, "another process's fetch lock held past {WAIT:?}");
                    return false;
                }
                Err(e) => {
                    tracing::debug!(%id, "fetch lock: {e}");
                    return false;
                }
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(16));
        }
    }

    /// Lets go of the lock of `id`.
    pub(super) fn unlock(&self, id: &Id) {
        if let Err(e) = self.set(id, libc::F_UNLCK) {
            tracing::debug!(%id, "fetch unlock: {e}");
        }
    }

    fn set(&self, id: &Id, kind: libc::c_int) -> io::Result<()> {
        let b = id.as_bytes();
        let offset = i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], 0, 0, 0]);
        let lock = libc::flock {
            l_type: kind as libc::c_short,
            l_whence: libc::SEEK_SET as libc::c_short,
            l_start: offset as libc::off_t,
            l_len: 1,
            l_pid: 0,
        };
        nix::fcntl::fcntl(&self.file, nix::fcntl::FcntlArg::F_OFD_SETLK(&lock))
            .map(drop)
            .map_err(io::Error::from)
    }
}

//! Fetch locks shared by every process that uses one cache directory, so that N exports
//! starting on one host fetch each group once, not up to N times.
//!
//! A lock is an OFD write lock on one byte of `<cache>/fetch.lock`, at an offset taken from
//! the object's id (40 bits: two ids share a byte once in ~10^12 pairs, and a shared byte
//! only makes one fetch wait for another). OFD locks belong to an open file description, so
//! the kernel drops them when a process dies, and a process's own locks never conflict with
//! one another: within a process the cache's in-process lock serializes fetches of one id
//! first. The lock is a hint: a fetch that cannot take it in [`WAIT`] (one deadline for a
//! batch of groups) goes ahead without it, and what is cached is verified against its id
//! whoever wrote it.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use cairn_format::Id;

/// How long a fetch waits for another process's fetch of the same object before it fetches
/// the object itself.
pub(super) const WAIT: Duration = Duration::from_secs(5);
/// The lock file's name in the cache directory.
pub(super) const FILE: &str = "fetch.lock";

/// When a wait that starts now gives up.
pub(super) fn deadline() -> tokio::time::Instant {
    tokio::time::Instant::now() + WAIT
}

/// The open lock file of one cache directory.
#[derive(Debug)]
pub(super) struct HostLocks {
    file: File,
    /// Holds per lock byte in this process. Locking a byte again through the same open file
    /// is no new lock, so a byte is unlocked only when its last hold goes: an unlock the cache
    /// thread runs late must not free a byte this process has taken again since.
    holds: Mutex<HashMap<i64, u32>>,
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
            .open(dir.join(FILE))?;
        Ok(HostLocks {
            file,
            holds: Mutex::new(HashMap::new()),
        })
    }

    /// Takes the lock of `id` if no other process holds it.
    pub(super) fn try_lock(&self, id: &Id) -> io::Result<bool> {
        let byte = byte(id);
        let mut holds = self.holds.lock().expect("lock holds");
        if let Some(n) = holds.get_mut(&byte) {
            *n += 1;
            return Ok(true);
        }
        match self.set(byte, libc::F_WRLCK) {
            Ok(()) => {
                holds.insert(byte, 1);
                Ok(true)
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EAGAIN) | Some(libc::EACCES)) => {
                Ok(false)
            }
            Err(e) => Err(e),
        }
    }

    /// Takes the lock of `id`, polling while another process holds it, until `deadline` or
    /// until `done` says the wait is pointless: false when it was not taken (the caller
    /// checks the cache and fetches without it).
    pub(super) async fn lock(
        &self,
        id: &Id,
        deadline: tokio::time::Instant,
        done: &impl Fn() -> bool,
    ) -> bool {
        let mut pause = Duration::from_millis(1);
        loop {
            match self.try_lock(id) {
                Ok(true) => return true,
                Ok(false) if tokio::time::Instant::now() < deadline && !done() => {}
                Ok(false) => {
                    tracing::debug!(%id, "another process's fetch lock: not waiting longer");
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

    /// Gives up one hold of the lock of `id`; the last lets the byte go.
    pub(super) fn unlock(&self, id: &Id) {
        let byte = byte(id);
        let mut holds = self.holds.lock().expect("lock holds");
        match holds.get_mut(&byte) {
            Some(n) if *n > 1 => *n -= 1,
            Some(_) => {
                holds.remove(&byte);
                if let Err(e) = self.set(byte, libc::F_UNLCK) {
                    tracing::debug!(%id, "fetch unlock: {e}");
                }
            }
            None => {}
        }
    }

    fn set(&self, byte: i64, kind: libc::c_int) -> io::Result<()> {
        let lock = libc::flock {
            l_type: kind as libc::c_short,
            l_whence: libc::SEEK_SET as libc::c_short,
            l_start: byte as libc::off_t,
            l_len: 1,
            l_pid: 0,
        };
        nix::fcntl::fcntl(&self.file, nix::fcntl::FcntlArg::F_OFD_SETLK(&lock))
            .map(drop)
            .map_err(io::Error::from)
    }
}

/// The byte of the lock file that stands for `id`: 40 bits of it.
fn byte(id: &Id) -> i64 {
    let b = id.as_bytes();
    i64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], 0, 0, 0])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_byte_is_let_go_only_with_its_last_hold() {
        // Two opens of the lock file stand for two processes.
        let dir = tempfile::tempdir().unwrap();
        let (one, two) = (
            HostLocks::open(dir.path()).unwrap(),
            HostLocks::open(dir.path()).unwrap(),
        );
        let id = Id::of(b"group");
        assert!(one.try_lock(&id).unwrap());
        assert!(!two.try_lock(&id).unwrap());
        // Taken again in the first process before its late unlock of the first hold runs.
        assert!(one.try_lock(&id).unwrap());
        one.unlock(&id);
        assert!(!two.try_lock(&id).unwrap(), "still held once");
        one.unlock(&id);
        assert!(two.try_lock(&id).unwrap());
        two.unlock(&id);
        two.unlock(&id); // one unlock too many does nothing
        assert!(one.try_lock(&id).unwrap());
    }
}

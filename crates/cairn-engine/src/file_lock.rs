//! Whether another process holds a lock on a file: QEMU locks the images of a running VM
//! (OFD byte-range locks), so a lock means "a VM is using this disk". Restore refuses to
//! replace such a file; commit warns that what it reads may change under it.

use std::fmt;
use std::fs::File;
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// A lock another process holds on a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LockHolder {
    /// The holder's pid, when the kernel says (an OFD lock has none).
    pub pid: Option<u32>,
}

impl fmt::Display for LockHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.pid {
            Some(pid) => write!(f, "process {pid} holds a lock on it (a running VM?)"),
            None => write!(
                f,
                "another process holds a lock on it (QEMU locks the images of a running VM)"
            ),
        }
    }
}

/// Who holds a POSIX or OFD lock on the file at `path`, if anyone. `None` too when the file
/// cannot be opened or its file system cannot tell.
pub fn lock_holder(path: &Path) -> Option<LockHolder> {
    let file = File::open(path).ok()?;
    // SAFETY: `flock` is a plain C struct for which all-zero is a valid value.
    let mut probe: libc::flock = unsafe { std::mem::zeroed() };
    probe.l_type = libc::F_WRLCK as libc::c_short;
    probe.l_whence = libc::SEEK_SET as libc::c_short;
    probe.l_start = 0;
    probe.l_len = 0; // to the end, however far
                     // SAFETY: `file` owns a valid descriptor for the whole call and `probe` is a valid flock
                     // the kernel may overwrite; F_OFD_GETLK takes no other pointer.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_GETLK, &mut probe) };
    if rc != 0 || probe.l_type == libc::F_UNLCK as libc::c_short {
        return None;
    }
    Some(LockHolder {
        pid: u32::try_from(probe.l_pid).ok().filter(|p| *p > 0),
    })
}

/// Takes an OFD write lock over the whole of `file` (open for writing), held until the file
/// is closed: `false` when another process holds a lock on any of it. QEMU takes its locks
/// the same way, so a VM started on the file meanwhile is refused rather than reading it
/// half-written.
pub fn lock_whole_file(file: &File) -> std::io::Result<bool> {
    // SAFETY: `flock` is a plain C struct for which all-zero is a valid value.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = libc::F_WRLCK as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = 0;
    lock.l_len = 0; // to the end, however far
                    // SAFETY: `file` owns a valid descriptor for the whole call and `lock` is a valid flock
                    // the kernel only reads.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &lock) };
    if rc == 0 {
        return Ok(true);
    }
    let e = std::io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EACCES) => Ok(false),
        _ => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lock_held_through_another_description_is_seen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.raw");
        std::fs::write(&path, [0u8; 4096]).unwrap();
        assert_eq!(lock_holder(&path), None);
        let held = File::open(&path).unwrap();
        // SAFETY: as above; a read lock on bytes 100..101, as QEMU takes them.
        let mut lock: libc::flock = unsafe { std::mem::zeroed() };
        lock.l_type = libc::F_RDLCK as libc::c_short;
        lock.l_whence = libc::SEEK_SET as libc::c_short;
        lock.l_start = 100;
        lock.l_len = 1;
        // SAFETY: `held` owns a valid descriptor; `lock` is a valid flock.
        let rc = unsafe { libc::fcntl(held.as_raw_fd(), libc::F_OFD_SETLK, &lock) };
        assert_eq!(rc, 0);
        assert_eq!(lock_holder(&path), Some(LockHolder { pid: None }));
        drop(held);
        assert_eq!(lock_holder(&path), None);
    }
}

//! The space reserve of a local repository: a file of preallocated blocks that only deletion
//! may use, so that a repository on a full file system can still be cured from inside.
//!
//! On a full disk every write fails, including the few small ones that freeing space needs
//! (a session ref, a deletion marker, a GC plan, a rewritten index file). So `cairn init`
//! preallocates `.cairn-reserve` (32 MiB by default). Commits never touch it: they fail
//! cleanly when the disk is full. A store opened for deletion (`rm`, `prune`, `gc`,
//! `repair`) that meets `ENOSPC` truncates the reserve to its 4 KiB header and retries once;
//! after a GC has freed space the reserve is reallocated to its recorded size.
//!
//! Layout: a 4 KiB header `cairn space reserve: <bytes>\n` padded with zeros, then the
//! preallocated blocks. The header records the size, so truncating the data never loses it.

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

/// File name of the reserve in the repository root.
pub const RESERVE_NAME: &str = ".cairn-reserve";
const HEADER_LEN: u64 = 4096;

pub(super) fn path(root: &Path) -> PathBuf {
    root.join(RESERVE_NAME)
}

/// Creates the reserve with `size` bytes of preallocated blocks (0: no reserve).
pub(super) fn create(root: &Path, size: u64) -> io::Result<()> {
    if size == 0 {
        return Ok(());
    }
    let mut header = format!("cairn space reserve: {size}\n").into_bytes();
    header.resize(HEADER_LEN as usize, 0);
    let mut f = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path(root))?;
    f.write_all(&header)?;
    allocate(&f, size)?;
    f.sync_all()
}

/// The recorded size of the reserve and its current length, if there is one.
fn state(root: &Path) -> Option<(u64, u64)> {
    let mut f = File::open(path(root)).ok()?;
    let mut header = vec![0u8; HEADER_LEN as usize];
    let n = f.read(&mut header).ok()?;
    let text = std::str::from_utf8(&header[..n]).ok()?;
    let size = text
        .strip_prefix("cairn space reserve: ")?
        .split('\n')
        .next()?
        .parse()
        .ok()?;
    let len = f.metadata().ok()?.len();
    Some((size, len))
}

/// Gives the reserve's blocks back to the file system. Returns the bytes freed (0 if there
/// was no reserve or it was already released).
pub(super) fn release(root: &Path) -> u64 {
    let Some((_, len)) = state(root) else {
        return 0;
    };
    if len <= HEADER_LEN {
        return 0;
    }
    match OpenOptions::new().write(true).open(path(root)) {
        Ok(f) if f.set_len(HEADER_LEN).is_ok() && f.sync_all().is_ok() => len - HEADER_LEN,
        _ => 0,
    }
}

/// Reallocates a released reserve to its recorded size, if the space is there (best effort:
/// on a still-full disk it stays released).
pub(super) fn replenish(root: &Path) -> io::Result<bool> {
    let Some((size, len)) = state(root) else {
        return Ok(false);
    };
    if len >= HEADER_LEN + size {
        return Ok(false);
    }
    let f = OpenOptions::new().write(true).open(path(root))?;
    match allocate(&f, size) {
        Ok(()) => {
            f.sync_all()?;
            Ok(true)
        }
        Err(e) => {
            let _ = f.set_len(HEADER_LEN);
            Err(e)
        }
    }
}

/// Preallocates `size` bytes after the header (written as zeros where the file system
/// cannot preallocate).
fn allocate(f: &File, size: u64) -> io::Result<()> {
    let total = (HEADER_LEN + size) as libc::off_t;
    // SAFETY: `f` owns a valid descriptor for the whole call; posix_fallocate takes only
    // integers.
    let rc = unsafe { libc::posix_fallocate(f.as_raw_fd(), 0, total) };
    match rc {
        0 => Ok(()),
        libc::EOPNOTSUPP | libc::EINVAL => {
            let zeros = vec![0u8; 1 << 20];
            let mut left = size;
            let mut w = f;
            use std::io::Seek;
            w.seek(io::SeekFrom::Start(HEADER_LEN))?;
            while left > 0 {
                let n = left.min(zeros.len() as u64) as usize;
                w.write_all(&zeros[..n])?;
                left -= n as u64;
            }
            Ok(())
        }
        e => Err(io::Error::from_raw_os_error(e)),
    }
}

/// Whether an I/O error means the file system is full.
pub(crate) fn is_full(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
}

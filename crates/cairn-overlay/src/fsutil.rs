//! Small filesystem helpers: atomic replace, positional I/O, hole punching.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crate::OverlayError;

/// fsyncs a directory so renames and creations in it are durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), OverlayError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| OverlayError::io("fsync directory", dir, e))
}

/// Replaces `dir/name` atomically and durably: write `name.tmp`, fsync, rename, fsync dir.
pub(crate) fn atomic_write(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), OverlayError> {
    let tmp = dir.join(format!("{name}.tmp"));
    let dst = dir.join(name);
    let mut f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| OverlayError::io("create", &tmp, e))?;
    f.write_all(bytes)
        .and_then(|()| f.sync_all())
        .map_err(|e| OverlayError::io("write", &tmp, e))?;
    drop(f);
    fs::rename(&tmp, &dst).map_err(|e| OverlayError::io("rename into place", &dst, e))?;
    sync_dir(dir)
}

/// Reads a whole metadata file; a missing file is a corruption (it is always written before
/// the manifest that references it).
pub(crate) fn read_meta_file(path: &Path) -> Result<Vec<u8>, OverlayError> {
    fs::read(path).map_err(|e| {
        if e.kind() == io::ErrorKind::NotFound {
            OverlayError::corrupt(path, "missing")
        } else {
            OverlayError::io("read", path, e)
        }
    })
}

pub(crate) fn open_rw(path: &Path, create_new: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true).write(true).mode(0o600);
    if create_new {
        o.create_new(true);
    }
    o.open(path)
}

/// Fills `buf` from `offset`; bytes past the end of the file read as zeros (sparse tail).
pub(crate) fn read_at_zero_fill(
    file: &File,
    mut buf: &mut [u8],
    mut offset: u64,
) -> io::Result<()> {
    while !buf.is_empty() {
        match file.read_at(buf, offset) {
            Ok(0) => {
                buf.fill(0);
                return Ok(());
            }
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Makes `offset..offset+len` read as zeros: punches a hole where the filesystem supports
/// it, otherwise writes zeros (only up to the end of the file; past it reads are zero).
pub(crate) fn zero_range(file: &File, offset: u64, len: u64) -> io::Result<()> {
    if len == 0 {
        return Ok(());
    }
    #[cfg(target_os = "linux")]
    {
        use std::os::fd::AsRawFd;
        if let (Ok(o), Ok(l)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) {
            // SAFETY: plain syscall on a valid, owned descriptor.
            let r = unsafe {
                libc::fallocate(
                    file.as_raw_fd(),
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                    o,
                    l,
                )
            };
            if r == 0 {
                return Ok(());
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) | Some(libc::EINVAL) => {}
                _ => return Err(e),
            }
        }
    }
    let file_len = file.metadata()?.len();
    let end = (offset + len).min(file_len);
    let zeros = vec![0u8; 1 << 20];
    let mut pos = offset;
    while pos < end {
        let n = (end - pos).min(zeros.len() as u64) as usize;
        file.write_all_at(&zeros[..n], pos)?;
        pos += n as u64;
    }
    Ok(())
}

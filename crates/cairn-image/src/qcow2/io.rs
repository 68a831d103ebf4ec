//! Positional reads of a host file: a real file (`pread`) or an in-memory byte slice (the
//! fuzz entry point). The qcow2 parser is written against [`HostIo`] so that `open` and
//! `parse_bytes` share every check.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;

/// A host file that can be read at any offset from several threads at once.
pub(crate) trait HostIo: Send + Sync {
    /// The host file's length in bytes (fixed when opened).
    fn len(&self) -> u64;
    /// Fills `buf` from `offset`; a read past the end is an error.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Data was read from `[offset, offset + len)` and will not be needed again soon.
    fn done_with(&self, _offset: u64, _len: u64) {}
}

/// A regular file or block device read with `pread`.
pub(crate) struct FileIo {
    file: File,
    len: u64,
    drop_cache: bool,
}

impl FileIo {
    pub(crate) fn new(file: File, len: u64, drop_cache: bool) -> FileIo {
        FileIo {
            file,
            len,
            drop_cache,
        }
    }
    pub(crate) fn file(&self) -> &File {
        &self.file
    }
}

impl HostIo for FileIo {
    fn len(&self) -> u64 {
        self.len
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileExt::read_exact_at(&self.file, buf, offset)
    }
    fn done_with(&self, offset: u64, len: u64) {
        if !self.drop_cache || len == 0 {
            return;
        }
        let (Ok(off), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
            return;
        };
        // SAFETY: posix_fadvise only takes a file descriptor we own (kept open by `self.file`
        // for the duration of the call) and two integers; it touches no memory of ours. Its
        // result is advisory, so a failure is ignored.
        unsafe {
            libc::posix_fadvise(self.file.as_raw_fd(), off, len, libc::POSIX_FADV_DONTNEED);
        }
    }
}

/// An image held in memory.
pub(crate) struct SliceIo<'a>(pub(crate) &'a [u8]);

impl HostIo for SliceIo<'_> {
    fn len(&self) -> u64 {
        self.0.len() as u64
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let eof = || {
            io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "read past the end of the bytes",
            )
        };
        let start = usize::try_from(offset).map_err(|_| eof())?;
        let end = start.checked_add(buf.len()).ok_or_else(eof)?;
        let src = self.0.get(start..end).ok_or_else(eof)?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

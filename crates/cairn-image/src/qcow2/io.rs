//! Positional reads of a host file: a real file (`pread`) or an in-memory byte slice (the
//! fuzz entry point). The qcow2 parser is written against [`HostIo`] so that `open` and
//! `parse_bytes` share every check.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;

/// A host file that can be read at any offset from several threads at once.
pub(crate) trait HostIo: Send + Sync {
    /// The host file's length in bytes (fixed when opened).
    fn len(&self) -> u64;
    /// Fills `buf` from `offset`; a read past the end is an error.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
}

/// A regular file or block device read with `pread`.
pub(crate) struct FileIo {
    file: File,
    len: u64,
    drop_cache: bool,
    polite: crate::pagecache::Polite,
}

impl Drop for FileIo {
    fn drop(&mut self) {
        if self.drop_cache {
            self.polite.finish(&self.file);
        }
    }
}

impl FileIo {
    pub(crate) fn new(file: File, len: u64, drop_cache: bool) -> FileIo {
        if drop_cache {
            // No readahead: pages it brought in would look "cached before" to the polite
            // check (see `crate::raw`).
            crate::raw::advise(&file, libc::POSIX_FADV_RANDOM);
        }
        FileIo {
            file,
            len,
            drop_cache,
            polite: Default::default(),
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
        if self.drop_cache {
            // Pages this read brings into the page cache are dropped again; pages that were
            // cached before (a running VM's) stay (see `crate::pagecache`).
            self.polite.read(&self.file, offset, buf.len() as u64, || {
                FileExt::read_exact_at(&self.file, buf, offset)
            })
        } else {
            FileExt::read_exact_at(&self.file, buf, offset)
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

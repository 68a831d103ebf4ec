//! A version's bytes as a blocking reader, for parsers that are not async (the partition
//! tables, the ext4 reader). Reads go through an export's [`Base`]: lazy, verified, cached
//! host-wide. Call it from a blocking thread (`spawn_blocking`), never from the runtime.
//! Anything else that reads at offsets ([`ReadAt`]: bytes in memory, for the fuzz tests)
//! can stand in for the version.

use std::io::{self, Read, Seek, SeekFrom};
use std::sync::Arc;

use cairn_export::Base;
use tokio::runtime::Handle;

/// Bytes read at offsets, blocking.
pub trait ReadAt: Send + Sync {
    fn size(&self) -> u64;
    /// Fills `buf` from `offset` (the caller keeps within [`Self::size`]).
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
}

/// A stored version, read lazily.
struct VersionBytes {
    base: Arc<Base>,
    rt: Handle,
}

impl ReadAt for VersionBytes {
    fn size(&self) -> u64 {
        self.base.size()
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.rt
            .block_on(self.base.read(offset, buf))
            .map_err(io::Error::other)
    }
}

impl ReadAt for Vec<u8> {
    fn size(&self) -> u64 {
        self.len() as u64
    }

    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let at = offset as usize;
        buf.copy_from_slice(&self[at..at + buf.len()]);
        Ok(())
    }
}

/// A window `[start, start + len)` of a version, with a cursor for `Read + Seek`.
#[derive(Clone)]
pub struct DiskReader {
    source: Arc<dyn ReadAt>,
    start: u64,
    len: u64,
    pos: u64,
}

impl DiskReader {
    /// The whole version.
    pub fn new(base: Arc<Base>, rt: Handle) -> DiskReader {
        DiskReader::over(Arc::new(VersionBytes { base, rt }))
    }

    /// The whole of `source`.
    pub fn over(source: Arc<dyn ReadAt>) -> DiskReader {
        let len = source.size();
        DiskReader {
            source,
            start: 0,
            len,
            pos: 0,
        }
    }

    /// `[start, start + len)` of this window (clamped to it), its cursor at 0.
    pub fn window(&self, start: u64, len: u64) -> DiskReader {
        let start = start.min(self.len);
        DiskReader {
            start: self.start + start,
            len: len.min(self.len - start),
            pos: 0,
            ..self.clone()
        }
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Fills `buf` from `offset` of the window; reading past its end is an error.
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        if offset
            .checked_add(buf.len() as u64)
            .is_none_or(|end| end > self.len)
        {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "{} bytes at {offset} are past the end ({} bytes)",
                    buf.len(),
                    self.len
                ),
            ));
        }
        self.source.read_at(self.start + offset, buf)
    }
}

impl Read for DiskReader {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = (buf.len() as u64).min(self.len.saturating_sub(self.pos)) as usize;
        self.read_at(self.pos, &mut buf[..n])?;
        self.pos += n as u64;
        Ok(n)
    }
}

impl Seek for DiskReader {
    fn seek(&mut self, to: SeekFrom) -> io::Result<u64> {
        let pos = match to {
            SeekFrom::Start(p) => Some(p),
            SeekFrom::End(d) => self.len.checked_add_signed(d),
            SeekFrom::Current(d) => self.pos.checked_add_signed(d),
        };
        self.pos =
            pos.ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "seek before 0"))?;
        Ok(self.pos)
    }
}

impl ext4_view::Ext4Read for DiskReader {
    fn read(
        &mut self,
        start_byte: u64,
        dst: &mut [u8],
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync + 'static>> {
        Ok(self.read_at(start_byte, dst)?)
    }
}

//! The backend side: what the server serves.
//!
//! [`Export`] is deliberately byte-oriented and protocol-free so that
//! cairn's engine can implement it over lazily fetched images; the server
//! does all bounds and permission checks before calling it.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use bytes::Bytes;

/// One `base:allocation` extent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    /// Length in bytes; must be non-zero.
    pub len: u32,
    /// Not allocated (`NBD_STATE_HOLE`).
    pub hole: bool,
    /// Reads as zeroes (`NBD_STATE_ZERO`).
    pub zero: bool,
}

impl Extent {
    /// The `base:allocation` status flags of this extent.
    pub fn flags(&self) -> u32 {
        let mut f = 0;
        if self.hole {
            f |= crate::protocol::NBD_STATE_HOLE;
        }
        if self.zero {
            f |= crate::protocol::NBD_STATE_ZERO;
        }
        f
    }
}

/// A block device the server can serve.
///
/// The server guarantees that every call has `offset + len <= size()`,
/// `len > 0`, that write-type calls only happen when `read_only()` is false,
/// and that `read`/`write` lengths are at most 32 MiB. Calls may arrive
/// concurrently.
#[async_trait::async_trait]
pub trait Export: Send + Sync + 'static {
    /// Size in bytes.
    fn size(&self) -> u64;
    /// Whether the export refuses writes (advertised as `NBD_FLAG_READ_ONLY`).
    fn read_only(&self) -> bool;
    /// Whether NBD_FLAG_CAN_MULTI_CONN may be advertised (all connections
    /// see each other's flushed writes).
    fn multi_conn(&self) -> bool {
        false
    }
    /// A client entered (`true`) or left (`false`) the transmission phase on this export,
    /// so that the export can tell whether anyone is using it (rolling a writable export
    /// back under a running guest is unsafe).
    fn client_attached(&self, attached: bool) {
        let _ = attached;
    }
    /// Preferred block size (advertised with NBD_INFO_BLOCK_SIZE: minimum 1,
    /// preferred this, maximum 32 MiB). Must be a power of two >= 512.
    fn preferred_block_size(&self) -> u32 {
        4096
    }
    /// Read exactly `len` bytes at `offset`.
    async fn read(&self, offset: u64, len: u32) -> io::Result<Bytes>;
    /// Write `data` at `offset`; with `fua`, persist before returning.
    async fn write(&self, offset: u64, data: Bytes, fua: bool) -> io::Result<()>;
    /// Make `len` bytes at `offset` read as zero; `may_trim` allows
    /// deallocating them.
    async fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        may_trim: bool,
        fua: bool,
    ) -> io::Result<()>;
    /// Discard hint; contents of the range are unspecified afterwards.
    async fn trim(&self, offset: u64, len: u32) -> io::Result<()>;
    /// Persist all completed writes.
    async fn flush(&self) -> io::Result<()>;
    /// Prefetch hint (NBD_CMD_CACHE).
    async fn cache(&self, offset: u64, len: u32) -> io::Result<()>;
    /// base:allocation status from `offset`, covering at most `len` bytes
    /// (at least one extent, may stop early).
    async fn block_status(&self, offset: u64, len: u32) -> io::Result<Vec<Extent>>;
}

/// Allocation-tracking granularity of [`MemoryExport`].
pub const MEMORY_BLOCK: u64 = 4096;

struct MemoryInner {
    data: Vec<u8>,
    /// One flag per [`MEMORY_BLOCK`]: ever written (and not since trimmed).
    written: Vec<bool>,
}

/// A `Vec<u8>`-backed export for tests and examples.
///
/// Tracks which 4 KiB blocks were written so that `block_status` has
/// something realistic to report: never-written blocks are hole+zero,
/// written blocks are allocated data.
pub struct MemoryExport {
    inner: Mutex<MemoryInner>,
    read_only: AtomicBool,
    multi_conn: bool,
}

impl MemoryExport {
    /// A zero-filled export of `size` bytes, entirely unallocated.
    pub fn new(size: usize) -> Self {
        Self::with_data(vec![0; size], vec![false; blocks_for(size)])
    }

    /// An export with initial contents. Blocks containing a non-zero byte
    /// count as written (allocated); all-zero blocks are holes.
    pub fn from_vec(data: Vec<u8>) -> Self {
        let written = data
            .chunks(MEMORY_BLOCK as usize)
            .map(|c| c.iter().any(|&b| b != 0))
            .collect();
        Self::with_data(data, written)
    }

    fn with_data(data: Vec<u8>, written: Vec<bool>) -> Self {
        MemoryExport {
            inner: Mutex::new(MemoryInner { data, written }),
            read_only: AtomicBool::new(false),
            multi_conn: true,
        }
    }

    /// Builder form of [`MemoryExport::set_read_only`].
    pub fn read_only(self, ro: bool) -> Self {
        self.set_read_only(ro);
        self
    }

    /// Switch the export between read-only and writable (affects new
    /// connections' flags and all subsequent write checks).
    pub fn set_read_only(&self, ro: bool) {
        self.read_only.store(ro, Ordering::SeqCst);
    }

    /// A copy of the current contents.
    pub fn contents(&self) -> Vec<u8> {
        self.lock().data.clone()
    }

    /// Per-4 KiB-block "written" flags.
    pub fn written_blocks(&self) -> Vec<bool> {
        self.lock().written.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, MemoryInner> {
        // A panic while holding the lock cannot leave the Vec inconsistent
        // in a way that matters for a test double; keep serving.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn range(&self, inner: &MemoryInner, offset: u64, len: u32) -> io::Result<(usize, usize)> {
        let end = offset
            .checked_add(len as u64)
            .filter(|&e| e <= inner.data.len() as u64)
            .ok_or_else(|| io::Error::from_raw_os_error(libc::EINVAL))?;
        Ok((offset as usize, end as usize))
    }

    fn check_writable(&self) -> io::Result<()> {
        if self.read_only.load(Ordering::SeqCst) {
            Err(io::Error::from_raw_os_error(libc::EPERM))
        } else {
            Ok(())
        }
    }

    /// Zero `[start, end)`; mark blocks written, or (if `dealloc`) mark
    /// fully covered blocks unwritten.
    fn zero_range(inner: &mut MemoryInner, start: usize, end: usize, dealloc: bool) {
        inner.data[start..end].fill(0);
        let bs = MEMORY_BLOCK as usize;
        if dealloc {
            let first_full = start.div_ceil(bs);
            let last_full = if end == inner.data.len() {
                blocks_for(end)
            } else {
                end / bs
            };
            for b in first_full..last_full.max(first_full) {
                inner.written[b] = false;
            }
        } else {
            for b in start / bs..blocks_for(end) {
                inner.written[b] = true;
            }
        }
    }
}

fn blocks_for(bytes: usize) -> usize {
    bytes.div_ceil(MEMORY_BLOCK as usize)
}

#[async_trait::async_trait]
impl Export for MemoryExport {
    fn size(&self) -> u64 {
        self.lock().data.len() as u64
    }

    fn read_only(&self) -> bool {
        self.read_only.load(Ordering::SeqCst)
    }

    fn multi_conn(&self) -> bool {
        self.multi_conn
    }

    async fn read(&self, offset: u64, len: u32) -> io::Result<Bytes> {
        let inner = self.lock();
        let (s, e) = self.range(&inner, offset, len)?;
        Ok(Bytes::copy_from_slice(&inner.data[s..e]))
    }

    async fn write(&self, offset: u64, data: Bytes, _fua: bool) -> io::Result<()> {
        self.check_writable()?;
        let len =
            u32::try_from(data.len()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
        let mut inner = self.lock();
        let (s, e) = self.range(&inner, offset, len)?;
        inner.data[s..e].copy_from_slice(&data);
        for b in s / MEMORY_BLOCK as usize..blocks_for(e) {
            inner.written[b] = true;
        }
        Ok(())
    }

    async fn write_zeroes(
        &self,
        offset: u64,
        len: u32,
        may_trim: bool,
        _fua: bool,
    ) -> io::Result<()> {
        self.check_writable()?;
        let mut inner = self.lock();
        let (s, e) = self.range(&inner, offset, len)?;
        Self::zero_range(&mut inner, s, e, may_trim);
        Ok(())
    }

    async fn trim(&self, offset: u64, len: u32) -> io::Result<()> {
        self.check_writable()?;
        let mut inner = self.lock();
        let (s, e) = self.range(&inner, offset, len)?;
        Self::zero_range(&mut inner, s, e, true);
        Ok(())
    }

    async fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    async fn cache(&self, offset: u64, len: u32) -> io::Result<()> {
        let inner = self.lock();
        self.range(&inner, offset, len).map(|_| ())
    }

    async fn block_status(&self, offset: u64, len: u32) -> io::Result<Vec<Extent>> {
        let inner = self.lock();
        let (s, e) = self.range(&inner, offset, len)?;
        let bs = MEMORY_BLOCK as usize;
        let mut out: Vec<Extent> = Vec::new();
        let mut pos = s;
        while pos < e {
            let block_end = ((pos / bs + 1) * bs).min(e);
            let written = inner.written[pos / bs];
            let piece = (block_end - pos) as u32;
            match out.last_mut() {
                Some(last) if last.hole != written => last.len += piece,
                _ => out.push(Extent {
                    len: piece,
                    hole: !written,
                    zero: !written,
                }),
            }
            pos = block_end;
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn memory_export_tracks_allocation() {
        let m = MemoryExport::new(5 * 4096);
        assert_eq!(
            m.block_status(0, 5 * 4096).await.unwrap(),
            vec![Extent {
                len: 5 * 4096,
                hole: true,
                zero: true
            }]
        );
        m.write(4096 + 10, Bytes::from_static(b"hello"), false)
            .await
            .unwrap();
        assert_eq!(&m.read(4096 + 10, 5).await.unwrap()[..], b"hello");
        let st = m.block_status(100, 5 * 4096 - 100).await.unwrap();
        assert_eq!(
            st,
            vec![
                Extent {
                    len: 4096 - 100,
                    hole: true,
                    zero: true
                },
                Extent {
                    len: 4096,
                    hole: false,
                    zero: false
                },
                Extent {
                    len: 3 * 4096,
                    hole: true,
                    zero: true
                },
            ]
        );
        m.trim(4096, 4096).await.unwrap();
        assert_eq!(m.written_blocks(), vec![false; 5]);
        m.write_zeroes(0, 10, false, false).await.unwrap();
        assert!(m.written_blocks()[0]);
        assert!(m.read(5 * 4096 - 1, 2).await.is_err());
        m.set_read_only(true);
        let err = m
            .write(0, Bytes::from_static(b"x"), false)
            .await
            .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM));
    }

    #[test]
    fn from_vec_marks_nonzero_blocks() {
        let mut data = vec![0u8; 3 * 4096 + 100];
        data[4096] = 1;
        data[3 * 4096 + 5] = 1;
        let m = MemoryExport::from_vec(data);
        assert_eq!(m.written_blocks(), vec![false, true, false, true]);
    }
}

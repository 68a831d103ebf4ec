//! The NBD backend of one export: a stored version, read lazily through the chunk cache.

use std::io;
use std::sync::atomic::Ordering;
use std::sync::{Arc, RwLock};

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use cairn_nbd::{Export, Extent};

use crate::base::Base;
use crate::stats::ExportStats;

pub struct VersionExport {
    base: RwLock<Arc<Base>>,
    stats: Arc<ExportStats>,
}

impl VersionExport {
    pub fn new(base: Base, stats: Arc<ExportStats>) -> VersionExport {
        VersionExport {
            base: RwLock::new(Arc::new(base)),
            stats,
        }
    }

    pub fn base(&self) -> Arc<Base> {
        self.base.read().expect("base lock").clone()
    }

    pub fn stats(&self) -> &Arc<ExportStats> {
        &self.stats
    }
}

fn read_only() -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, "the export is read-only")
}

#[async_trait]
impl Export for VersionExport {
    fn size(&self) -> u64 {
        self.base().size()
    }

    fn read_only(&self) -> bool {
        true
    }

    fn multi_conn(&self) -> bool {
        true
    }

    async fn read(&self, offset: u64, len: u32) -> io::Result<Bytes> {
        let base = self.base();
        let mut buf = BytesMut::zeroed(len as usize);
        base.read(offset, &mut buf).await?;
        self.stats.reads.fetch_add(1, Ordering::Relaxed);
        self.stats
            .bytes_read
            .fetch_add(len as u64, Ordering::Relaxed);
        Ok(buf.freeze())
    }

    async fn write(&self, _offset: u64, _data: Bytes, _fua: bool) -> io::Result<()> {
        Err(read_only())
    }

    async fn write_zeroes(&self, _: u64, _: u32, _: bool, _: bool) -> io::Result<()> {
        Err(read_only())
    }

    async fn trim(&self, _: u64, _: u32) -> io::Result<()> {
        Err(read_only())
    }

    async fn flush(&self) -> io::Result<()> {
        Ok(())
    }

    async fn cache(&self, offset: u64, len: u32) -> io::Result<()> {
        self.base().prefetch(offset, len as u64).await
    }

    async fn block_status(&self, offset: u64, len: u32) -> io::Result<Vec<Extent>> {
        let base = self.base();
        let end = offset + len as u64;
        let mut out: Vec<Extent> = Vec::new();
        for p in base.pieces_in(offset, len as u64).await? {
            let from = p.offset.max(offset);
            let to = (p.offset + p.len as u64).min(end);
            let zero = p.chunk.is_none();
            match out.last_mut() {
                Some(last) if last.hole == zero && last.zero == zero => {
                    last.len += (to - from) as u32
                }
                _ => out.push(Extent {
                    len: (to - from) as u32,
                    hole: zero,
                    zero,
                }),
            }
        }
        Ok(out)
    }
}

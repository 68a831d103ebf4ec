//! One qcow2 file: its L1 table, L2 tables (through a bounded cache), cluster descriptors and
//! compressed clusters. What the file does not define is left to the caller (the backing
//! chain lives in `reader.rs`).

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use super::header::{corrupt, parse_header, read_error, Compression, Header};
use super::io::HostIo;
use super::layout::ENTRY_OFFSET_MASK;
use crate::error::ImageResult;

/// L1 entry: bits 9-55 hold the L2 table offset, bit 63 is "copied"; the rest is reserved.
const L1E_RESERVED_MASK: u64 = 0x7f00_0000_0000_01ff;
/// Standard L2 entry: bit 0 "reads as zeros" (v3), bits 9-55 host offset, bit 62
/// compressed, bit 63 copied; bits 1-8 and 56-61 reserved.
const L2E_RESERVED_MASK: u64 = 0x3f00_0000_0000_01fe;
const L2E_ZERO: u64 = 1;
const L2E_COMPRESSED: u64 = 1 << 62;

/// Bytes of L2 tables one file keeps cached (16 MiB of 64 KiB tables map 128 GiB).
const L2_CACHE_BYTES: u64 = 16 << 20;
/// At most this many tables (small clusters would otherwise mean a long eviction scan).
const L2_CACHE_MAX_TABLES: u64 = 1024;
/// Decompressed clusters kept (a read of a compressed cluster in small pieces decompresses
/// it once).
const COMPRESSED_CACHE_CLUSTERS: usize = 4;
/// zstd frames may not need a window larger than this (8 MiB, four times the largest
/// cluster), so a hostile frame cannot make the decoder allocate more.
const ZSTD_MAX_WINDOW_LOG: u32 = 23;

/// What one guest cluster of this file is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cluster {
    /// Not defined here: the backing file (if any) defines it.
    Unallocated,
    /// Reads as zeros.
    Zero,
    /// Stored uncompressed at this host offset (of the segment's first byte).
    Data(u64),
    /// Stored compressed: `len` bytes (at most; clamped at the end of the file) at `host`.
    Compressed { host: u64, len: u64 },
}

struct L2Cache {
    tables: HashMap<u64, (Arc<[u64]>, u64)>,
    tick: u64,
    cap: usize,
}

/// A compressed cluster: (host offset, length).
type CompressedKey = (u64, u64);

struct CompressedCache {
    /// Most recently used first: ((host offset, length), decompressed cluster).
    clusters: Vec<(CompressedKey, Arc<[u8]>)>,
}

/// An open qcow2 file (no backing chain).
pub(crate) struct Qcow2File<R: HostIo> {
    pub(crate) io: R,
    pub(crate) path: PathBuf,
    pub(crate) header: Header,
    /// The L1 entries that cover the virtual size, each validated.
    l1: Vec<u64>,
    l2_cache: Mutex<L2Cache>,
    compressed_cache: Mutex<CompressedCache>,
}

impl<R: HostIo> Qcow2File<R> {
    /// Parses the header and the L1 table and validates every L1 entry: reserved bits clear,
    /// L2 tables aligned, inside the file, and no table used twice.
    pub(crate) fn open(io: R, path: PathBuf) -> ImageResult<Self> {
        let header = parse_header(&io, &path)?;
        let cs = header.cluster_size();
        let file_len = io.len();
        // Bounded by MAX_L1_BYTES and by the file's length (checked in parse_header).
        let mut raw = vec![0u8; (header.l1_entries * 8) as usize];
        io.read_exact_at(&mut raw, header.l1_table_offset)
            .map_err(|e| read_error(&path, e))?;
        let l1: Vec<u64> = raw
            .chunks_exact(8)
            .map(|c| u64::from_be_bytes(c.try_into().expect("8-byte chunk")))
            .collect();
        drop(raw);
        let mut seen = HashSet::new();
        for (i, &e) in l1.iter().enumerate() {
            let guest = i as u64 * header.l1_coverage();
            if e & L1E_RESERVED_MASK != 0 {
                return Err(corrupt(
                    &path,
                    format!(
                        "L1 entry 0x{e:016x} for guest offset 0x{guest:x} has reserved bits set"
                    ),
                ));
            }
            let off = e & ENTRY_OFFSET_MASK;
            if off == 0 {
                continue;
            }
            if off & (cs - 1) != 0 {
                return Err(corrupt(
                    &path,
                    format!(
                        "L2 table at 0x{off:x} for guest offset 0x{guest:x} is not aligned to the cluster size"
                    ),
                ));
            }
            if off.checked_add(cs).is_none_or(|end| end > file_len) {
                return Err(corrupt(
                    &path,
                    format!(
                        "L2 table at 0x{off:x} for guest offset 0x{guest:x} is past the end of the file (0x{file_len:x} bytes): truncated?"
                    ),
                ));
            }
            if !seen.insert(off) {
                return Err(corrupt(
                    &path,
                    format!(
                        "L2 table at 0x{off:x} is used twice in the L1 table (again for guest offset 0x{guest:x})"
                    ),
                ));
            }
        }
        let cap = (L2_CACHE_BYTES / cs).clamp(4, L2_CACHE_MAX_TABLES) as usize;
        Ok(Qcow2File {
            io,
            path,
            header,
            l1,
            l2_cache: Mutex::new(L2Cache {
                tables: HashMap::new(),
                tick: 0,
                cap,
            }),
            compressed_cache: Mutex::new(CompressedCache {
                clusters: Vec::new(),
            }),
        })
    }

    pub(crate) fn size(&self) -> u64 {
        self.header.size
    }

    pub(crate) fn cluster_size(&self) -> u64 {
        self.header.cluster_size()
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The L2 table of L1 entry `index`, or `None` when the entry is unallocated.
    fn l2_table(&self, index: u64) -> ImageResult<Option<Arc<[u64]>>> {
        let entry = usize::try_from(index)
            .ok()
            .and_then(|i| self.l1.get(i))
            .copied()
            .ok_or_else(|| {
                corrupt(
                    &self.path,
                    format!("no L1 entry {index} (internal: guest offset beyond the L1 table)"),
                )
            })?;
        let off = entry & ENTRY_OFFSET_MASK;
        if off == 0 {
            return Ok(None);
        }
        {
            let mut cache = self.l2_cache.lock().unwrap_or_else(PoisonError::into_inner);
            cache.tick += 1;
            let tick = cache.tick;
            if let Some((table, used)) = cache.tables.get_mut(&index) {
                *used = tick;
                return Ok(Some(table.clone()));
            }
        }
        // Read outside the lock: two threads may read the same table once each, harmlessly.
        let cs = self.cluster_size() as usize;
        let mut raw = vec![0u8; cs];
        self.io
            .read_exact_at(&mut raw, off)
            .map_err(|e| read_error(&self.path, e))?;
        let table: Arc<[u64]> = raw
            .chunks_exact(8)
            .map(|c| u64::from_be_bytes(c.try_into().expect("8-byte chunk")))
            .collect();
        let mut cache = self.l2_cache.lock().unwrap_or_else(PoisonError::into_inner);
        if cache.tables.len() >= cache.cap && !cache.tables.contains_key(&index) {
            let oldest = cache
                .tables
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| *k);
            if let Some(k) = oldest {
                cache.tables.remove(&k);
            }
        }
        let tick = cache.tick;
        cache.tables.insert(index, (table.clone(), tick));
        Ok(Some(table))
    }

    /// Decodes and validates the L2 entry of the guest cluster starting at `guest`.
    fn decode(&self, entry: u64, guest: u64) -> ImageResult<Cluster> {
        let cb = self.header.cluster_bits;
        let cs = self.cluster_size();
        let file_len = self.io.len();
        if entry & L2E_COMPRESSED != 0 {
            let x = 62 - (cb - 8);
            let host = entry & ((1u64 << x) - 1);
            let sectors = (entry >> x) & ((1u64 << (cb - 8)) - 1);
            let len = (sectors + 1) * 512 - (host & 511);
            if host >= file_len {
                return Err(corrupt(
                    &self.path,
                    format!(
                        "compressed cluster at 0x{host:x} for guest offset 0x{guest:x} is past the end of the file (0x{file_len:x} bytes): truncated?"
                    ),
                ));
            }
            return Ok(Cluster::Compressed { host, len });
        }
        if entry & L2E_RESERVED_MASK != 0 {
            return Err(corrupt(
                &self.path,
                format!(
                    "L2 entry 0x{entry:016x} for guest offset 0x{guest:x} has reserved bits set"
                ),
            ));
        }
        let host = entry & ENTRY_OFFSET_MASK;
        let zero = self.header.version >= 3 && entry & L2E_ZERO != 0;
        if host & (cs - 1) != 0 {
            return Err(corrupt(
                &self.path,
                format!(
                    "data cluster at 0x{host:x} for guest offset 0x{guest:x} is not aligned to the cluster size"
                ),
            ));
        }
        if zero {
            return Ok(Cluster::Zero);
        }
        if host == 0 {
            return Ok(Cluster::Unallocated);
        }
        // Every guest-visible byte of the cluster must be in the file (the last cluster of an
        // image whose size is not a multiple of the cluster size may be short).
        let visible = cs.min(self.size() - guest);
        if host.checked_add(visible).is_none_or(|end| end > file_len) {
            return Err(corrupt(
                &self.path,
                format!(
                    "data cluster at 0x{host:x} for guest offset 0x{guest:x} is past the end of the file (0x{file_len:x} bytes): truncated?"
                ),
            ));
        }
        Ok(Cluster::Data(host))
    }

    /// Calls `f(start, end, cluster)` for consecutive segments covering `[start, end)`
    /// (`end <= size()`): one per guest cluster, or one per L1 entry that is unallocated. For
    /// `Data`, the host offset is that of `start` (inside the cluster).
    pub(crate) fn walk(
        &self,
        start: u64,
        end: u64,
        f: &mut dyn FnMut(u64, u64, Cluster) -> ImageResult<()>,
    ) -> ImageResult<()> {
        let cs = self.cluster_size();
        let coverage = self.header.l1_coverage();
        let entries = cs / 8;
        let end = end.min(self.size());
        let mut pos = start;
        while pos < end {
            let l1_index = pos / coverage;
            let l1_end = end.min((l1_index + 1).saturating_mul(coverage));
            let Some(table) = self.l2_table(l1_index)? else {
                f(pos, l1_end, Cluster::Unallocated)?;
                pos = l1_end;
                continue;
            };
            while pos < l1_end {
                let cluster_start = pos & !(cs - 1);
                let seg_end = l1_end.min(cluster_start + cs);
                let entry = table[((pos / cs) % entries) as usize];
                let cluster = match self.decode(entry, cluster_start)? {
                    Cluster::Data(host) => Cluster::Data(host + (pos - cluster_start)),
                    c => c,
                };
                f(pos, seg_end, cluster)?;
                pos = seg_end;
            }
        }
        Ok(())
    }

    /// The decompressed guest cluster of a compressed descriptor (cached).
    pub(crate) fn compressed_cluster(
        &self,
        host: u64,
        len: u64,
        guest: u64,
    ) -> ImageResult<Arc<[u8]>> {
        let key = (host, len);
        {
            let mut cache = self
                .compressed_cache
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if let Some(i) = cache.clusters.iter().position(|(k, _)| *k == key) {
                let hit = cache.clusters.remove(i);
                let data = hit.1.clone();
                cache.clusters.insert(0, hit);
                return Ok(data);
            }
        }
        let data: Arc<[u8]> = self.decompress(host, len, guest)?.into();
        let mut cache = self
            .compressed_cache
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        cache.clusters.insert(0, (key, data.clone()));
        cache.clusters.truncate(COMPRESSED_CACHE_CLUSTERS);
        Ok(data)
    }

    /// Reads and decompresses one compressed cluster (not cached).
    pub(crate) fn decompress(&self, host: u64, len: u64, guest: u64) -> ImageResult<Vec<u8>> {
        let file_len = self.io.len();
        // `len` is at most twice the cluster size; the end of the file may cut it.
        let avail = len.min(file_len.saturating_sub(host));
        let mut input = vec![0u8; avail as usize];
        self.io
            .read_exact_at(&mut input, host)
            .map_err(|e| read_error(&self.path, e))?;
        let cs = self.cluster_size() as usize;
        let mut out = vec![0u8; cs];
        let result = match self.header.compression {
            Compression::Deflate => inflate(&input, &mut out),
            Compression::Zstd => unzstd(&input, &mut out),
        };
        result.map_err(|why| {
            corrupt(
                &self.path,
                format!(
                    "compressed cluster at 0x{host:x} for guest offset 0x{guest:x} does not decompress: {why}"
                ),
            )
        })?;
        Ok(out)
    }
}

thread_local! {
    static INFLATE: RefCell<flate2::Decompress> = RefCell::new(flate2::Decompress::new(false));
    static ZSTD: RefCell<Option<zstd::stream::raw::Decoder<'static>>> = const { RefCell::new(None) };
}

/// Raw deflate into exactly `out.len()` bytes. Like QEMU, the output must be filled; the
/// input may hold more (it is known only to the sector).
fn inflate(input: &[u8], out: &mut [u8]) -> Result<(), String> {
    INFLATE.with(|d| {
        let mut d = d.borrow_mut();
        d.reset(false);
        loop {
            let (before_in, before_out) = (d.total_in(), d.total_out());
            let in_pos = before_in as usize;
            let out_pos = before_out as usize;
            let status = d
                .decompress(
                    &input[in_pos..],
                    &mut out[out_pos..],
                    flate2::FlushDecompress::Finish,
                )
                .map_err(|e| format!("deflate: {e}"))?;
            let produced = d.total_out() as usize;
            if produced == out.len() {
                return Ok(());
            }
            let progressed = d.total_in() != before_in || d.total_out() != before_out;
            if status == flate2::Status::StreamEnd || !progressed {
                return Err(format!(
                    "deflate data ends after {produced} bytes, not a whole cluster of {}",
                    out.len()
                ));
            }
        }
    })
}

/// zstd into exactly `out.len()` bytes: the frame(s) must fill the cluster and end there; the
/// input may be followed by padding.
fn unzstd(input: &[u8], out: &mut [u8]) -> Result<(), String> {
    use zstd::stream::raw::{DParameter, InBuffer, Operation, OutBuffer};
    ZSTD.with(|z| {
        let mut z = z.borrow_mut();
        if z.is_none() {
            let mut d = zstd::stream::raw::Decoder::new().map_err(|e| format!("zstd: {e}"))?;
            d.set_parameter(DParameter::WindowLogMax(ZSTD_MAX_WINDOW_LOG))
                .map_err(|e| format!("zstd: {e}"))?;
            *z = Some(d);
        }
        let d = z.as_mut().expect("decoder just made");
        d.reinit().map_err(|e| format!("zstd: {e}"))?;
        let cap = out.len();
        let mut inb = InBuffer::around(input);
        let mut outb = OutBuffer::around(out);
        let mut hint = 1;
        while outb.pos() < cap {
            let (in_before, out_before) = (inb.pos(), outb.pos());
            hint = d
                .run(&mut inb, &mut outb)
                .map_err(|e| format!("zstd: {e}"))?;
            if inb.pos() == in_before && outb.pos() == out_before {
                return Err(format!(
                    "zstd data ends after {} bytes, not a whole cluster of {cap}",
                    outb.pos()
                ));
            }
        }
        if hint != 0 {
            // The cluster is full; the frame must end here (its checksum may still be unread).
            let mut none = [0u8; 0];
            let mut empty = OutBuffer::around(&mut none[..]);
            hint = d
                .run(&mut inb, &mut empty)
                .map_err(|e| format!("zstd: {e}"))?;
            if hint != 0 {
                return Err(format!("zstd data is longer than a cluster of {cap} bytes"));
            }
        }
        Ok(())
    })
}

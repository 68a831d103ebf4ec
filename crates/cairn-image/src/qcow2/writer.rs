//! The compact qcow2 writer.
//!
//! Layout of a finished image (every host cluster is in use, so refcounts are all 1 and
//! there is nothing to leak):
//!
//! ```text
//! cluster 0            header (version 3, 104-byte header, end-of-extensions marker)
//! clusters 1..d        guest data, in the order it was first written (append-only)
//! next                 L2 tables (only those with an allocated cluster), one cluster each
//! next                 the L1 table (contiguous, cluster aligned)
//! next                 refcount blocks (16-bit refcounts), covering every cluster above
//!                      and themselves
//! next                 the refcount table (contiguous, cluster aligned)
//! ```
//!
//! While writing, only data clusters are appended; the guest→host map lives in memory as
//! one lazily allocated table per L1 entry (the future L2 tables), so a huge sparse image
//! costs memory only for the parts written. Metadata and the header are written by
//! [`Qcow2Writer::finish`]; until then the file has no qcow2 magic, so an interrupted
//! restore never leaves a file that looks like a valid image.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

use super::layout::{
    COPIED, MAX_CLUSTER_BITS, MAX_HOST_OFFSET, MAX_L1_BYTES, MAX_REFTABLE_BYTES, MIN_CLUSTER_BITS,
};
use crate::detect::QCOW2_MAGIC;
use crate::error::{ImageError, ImageResult};

const VERSION: u32 = 3;
/// The v3 header without the optional compression-type byte (which then defaults to zlib).
const HEADER_LENGTH: u32 = 104;
/// 16-bit refcounts.
const REFCOUNT_ORDER: u32 = 4;
const REFCOUNT_BYTES: u64 = 2;

/// In-memory host map entry of a cluster that reads as zeros without data (the L2 entry's
/// zero flag): never a host offset, which is a multiple of the cluster size.
const ZERO_CLUSTER: u64 = 1;
/// The L2 entry flag "reads as zeros" (qcow2 v3).
const OFLAG_ZERO: u64 = 1;
/// The header extension naming the backing file's format.
const EXT_BACKING_FORMAT: u32 = 0xe279_2aca;

/// The image an overlay reads its unallocated clusters from.
#[derive(Debug, Clone)]
pub struct Backing {
    /// As written into the header (QEMU resolves a relative name from the overlay's
    /// directory).
    pub file: String,
    /// Its format as QEMU names it: `raw` or `qcow2`.
    pub format: &'static str,
}

/// Writes a qcow2 v3 image whose never-written clusters stay unallocated.
/// `write_at` may be called from several threads, at any offsets, in any order.
pub struct Qcow2Writer {
    file: File,
    path: PathBuf,
    backing: Option<Backing>,
    /// The guest size writes are limited to.
    size: u64,
    /// `size` rounded up to whole 512-byte sectors: the virtual size in the header.
    header_size: u64,
    cluster_bits: u32,
    /// log2 of the entries per L2 table (`cluster_bits - 3`).
    l2_bits: u32,
    l1_size: u64,
    state: Mutex<State>,
}

struct State {
    /// One slot per L1 entry: the host offset of each guest cluster it covers (0 = not
    /// allocated), allocated on the first write into its range.
    l2: Vec<Option<Box<[u64]>>>,
    /// Where the next data cluster goes (the end of the used part of the host file).
    next_host: u64,
}

/// One cluster-sized (or smaller) piece of a write: `data[start..end]` goes to guest cluster
/// `cluster` at byte `in_cluster` of it.
struct Piece {
    cluster: u64,
    in_cluster: u64,
    start: usize,
    end: usize,
    zero: bool,
}

impl Qcow2Writer {
    /// Starts an image of `size` guest bytes in `file` (empty, opened read+write), with
    /// clusters of `1 << cluster_bits` bytes. `path` is for messages.
    pub fn create(file: File, path: &Path, size: u64, cluster_bits: u32) -> ImageResult<Self> {
        Self::create_overlay(file, path, size, cluster_bits, None)
    }

    /// Like [`Qcow2Writer::create`], with a backing file: clusters never written read from
    /// it. Only [`Qcow2Writer::write_whole`] and [`Qcow2Writer::zero_cluster`] then keep the
    /// guest's bytes right (a partly written fresh cluster would read zeros elsewhere, not
    /// the backing file's bytes).
    pub fn create_overlay(
        file: File,
        path: &Path,
        size: u64,
        cluster_bits: u32,
        backing: Option<Backing>,
    ) -> ImageResult<Self> {
        let unsupported = |what: String| ImageError::Unsupported {
            path: path.to_path_buf(),
            what,
        };
        if !(MIN_CLUSTER_BITS..=MAX_CLUSTER_BITS).contains(&cluster_bits) {
            return Err(unsupported(format!(
                "a qcow2 cluster size of 2^{cluster_bits} bytes (cluster_bits must be \
                 {MIN_CLUSTER_BITS}..={MAX_CLUSTER_BITS})"
            )));
        }
        let l2_bits = cluster_bits - 3;
        let l1_size = size.div_ceil(1u64 << (cluster_bits + l2_bits));
        if let Some(b) = &backing {
            let header = HEADER_LENGTH as u64 + 8 + 8 + 8 + b.file.len() as u64;
            if b.file.is_empty() || header > 1u64 << cluster_bits {
                return Err(unsupported(format!(
                    "a backing file name of {} bytes",
                    b.file.len()
                )));
            }
        }
        if l1_size * 8 > MAX_L1_BYTES {
            return Err(unsupported(format!(
                "a qcow2 image of {size} bytes with {}-byte clusters (its L1 table would \
                 exceed QEMU's limit of {MAX_L1_BYTES} bytes; use larger clusters)",
                1u64 << cluster_bits
            )));
        }
        // QEMU sees images in 512-byte sectors and ignores a partial last sector, so the
        // header records the size rounded up (as `qemu-img create` does); the extra bytes
        // read as zeros. Writes stay limited to `size`.
        let Some(header_size) = size.checked_next_multiple_of(512) else {
            return Err(unsupported(format!("a qcow2 image of {size} bytes")));
        };
        // Fresh clusters must read as zeros: start from an empty file.
        file.set_len(0).map_err(|source| ImageError::Io {
            op: "truncate",
            path: path.to_path_buf(),
            source,
        })?;
        Ok(Qcow2Writer {
            file,
            path: path.to_path_buf(),
            backing,
            size,
            header_size,
            cluster_bits,
            l2_bits,
            l1_size,
            state: Mutex::new(State {
                l2: (0..l1_size).map(|_| None).collect(),
                // Cluster 0 is the header.
                next_host: 1u64 << cluster_bits,
            }),
        })
    }

    /// Writes guest bytes at `offset`. Clusters touched for the first time are allocated;
    /// a full-cluster write of zeros to an unallocated cluster allocates nothing.
    ///
    /// More generally, a piece of all zeros that falls into a not-yet-allocated cluster is
    /// skipped (fresh clusters read as zeros, whether or not they get allocated later).
    pub fn write_at(&self, data: &[u8], offset: u64) -> ImageResult<()> {
        self.write_pieces(data, offset, false)
    }

    /// Writes guest bytes at `offset` (cluster aligned) covering whole clusters (the last
    /// may end at the image's end), allocating each even where it is all zeros: what an
    /// overlay writes where its backing file's bytes differ.
    pub fn write_whole(&self, data: &[u8], offset: u64) -> ImageResult<()> {
        let cluster = 1u64 << self.cluster_bits;
        let end = offset + data.len() as u64;
        if !offset.is_multiple_of(cluster) || (!end.is_multiple_of(cluster) && end != self.size) {
            return Err(self.io_error(
                "write",
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{} bytes at {offset} are not whole clusters", data.len()),
                ),
            ));
        }
        self.write_pieces(data, offset, true)
    }

    /// Makes the cluster at `offset` (aligned) read as zeros without data (the zero flag),
    /// whatever the backing file holds there.
    pub fn zero_cluster(&self, offset: u64) -> ImageResult<()> {
        if !offset.is_multiple_of(1u64 << self.cluster_bits) || offset >= self.size {
            return Err(self.io_error("write", self.past_end(0, offset)));
        }
        let cluster = offset >> self.cluster_bits;
        let index = (cluster >> self.l2_bits) as usize;
        let slot = (cluster & ((1 << self.l2_bits) - 1)) as usize;
        let entries = 1usize << self.l2_bits;
        let mut state = self.lock();
        let table = state.l2[index].get_or_insert_with(|| vec![0u64; entries].into_boxed_slice());
        if table[slot] == 0 {
            table[slot] = ZERO_CLUSTER;
        }
        Ok(())
    }

    fn write_pieces(&self, data: &[u8], offset: u64, allocate_zeros: bool) -> ImageResult<()> {
        let end = offset
            .checked_add(data.len() as u64)
            .filter(|&end| end <= self.size)
            .ok_or_else(|| self.io_error("write", self.past_end(data.len(), offset)))?;
        if data.is_empty() {
            return Ok(());
        }
        let cluster_size = 1u64 << self.cluster_bits;
        let mut pieces = Vec::with_capacity(
            (((end - 1) >> self.cluster_bits) - (offset >> self.cluster_bits) + 1) as usize,
        );
        let mut pos = offset;
        while pos < end {
            let in_cluster = pos & (cluster_size - 1);
            let piece_end = end.min(pos - in_cluster + cluster_size);
            let (start, stop) = ((pos - offset) as usize, (piece_end - offset) as usize);
            pieces.push(Piece {
                cluster: pos >> self.cluster_bits,
                in_cluster,
                start,
                end: stop,
                zero: is_zero(&data[start..stop]),
            });
            pos = piece_end;
        }

        // Look up (and allocate) host clusters under the lock; write outside it.
        let mut hosts = Vec::with_capacity(pieces.len());
        {
            let mut state = self.lock();
            for piece in &pieces {
                let host =
                    self.host_cluster(&mut state, piece.cluster, allocate_zeros || !piece.zero)?;
                hosts.push(host);
            }
        }

        // Merge pieces that are contiguous on the host too (fresh clusters of one write are
        // allocated back to back) into one pwrite each.
        let mut run: Option<(u64, usize, usize)> = None; // (host offset, data start, data end)
        for (piece, &host) in pieces.iter().zip(&hosts) {
            if host == 0 {
                continue;
            }
            let host_pos = host + piece.in_cluster;
            match &mut run {
                Some((run_host, run_start, run_end))
                    if *run_end == piece.start
                        && *run_host + (*run_end - *run_start) as u64 == host_pos =>
                {
                    *run_end = piece.end;
                }
                _ => {
                    if let Some((h, s, e)) = run.take() {
                        self.pwrite(&data[s..e], h)?;
                    }
                    run = Some((host_pos, piece.start, piece.end));
                }
            }
        }
        if let Some((h, s, e)) = run {
            self.pwrite(&data[s..e], h)?;
        }
        Ok(())
    }

    /// Writes the metadata (L2 tables, L1 table, refcounts, header), syncs, and returns the
    /// file.
    pub fn finish(mut self) -> ImageResult<File> {
        let state = self
            .state
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let (l2_tables, mut end) = (std::mem::take(&mut state.l2), state.next_host);
        let cb = self.cluster_bits;
        let cluster_size = 1u64 << cb;

        // L2 tables.
        let mut l1 = vec![0u64; self.l1_size as usize];
        let mut buf = vec![0u8; cluster_size as usize];
        for (index, table) in l2_tables.iter().enumerate() {
            let Some(table) = table else { continue };
            for (entry, &host) in buf.chunks_exact_mut(8).zip(table.iter()) {
                let value = match host {
                    0 => 0,
                    ZERO_CLUSTER => OFLAG_ZERO,
                    host => host | COPIED,
                };
                entry.copy_from_slice(&value.to_be_bytes());
            }
            self.pwrite_meta(&buf, end)?;
            l1[index] = end | COPIED;
            end += cluster_size;
        }
        drop(l2_tables);

        // L1 table.
        let l1_offset = if l1.is_empty() { 0 } else { end };
        if !l1.is_empty() {
            let bytes: Vec<u8> = l1.iter().flat_map(|e| e.to_be_bytes()).collect();
            self.pwrite_meta(&bytes, end)?;
            end += (bytes.len() as u64).div_ceil(cluster_size) << cb;
        }

        // Refcounts: find the number of refcount blocks and table clusters that cover all
        // clusters, themselves included.
        let used = end >> cb;
        let per_block = cluster_size / REFCOUNT_BYTES;
        let per_table_cluster = cluster_size / 8;
        let (mut blocks, mut table_clusters) = (0u64, 0u64);
        loop {
            let total = used + blocks + table_clusters;
            let need_blocks = total.div_ceil(per_block);
            let need_table = need_blocks.div_ceil(per_table_cluster).max(1);
            if (need_blocks, need_table) == (blocks, table_clusters) {
                break;
            }
            // Both only grow, so this reaches the fixpoint.
            blocks = blocks.max(need_blocks);
            table_clusters = table_clusters.max(need_table);
        }
        let total = used + blocks + table_clusters;
        if table_clusters << cb > MAX_REFTABLE_BYTES || total << cb > MAX_HOST_OFFSET {
            return Err(ImageError::Unsupported {
                path: self.path.clone(),
                what: format!(
                    "a qcow2 file of {total} clusters of {cluster_size} bytes (its refcount \
                     table would exceed QEMU's limits; use larger clusters)"
                ),
            });
        }
        let blocks_offset = end;
        for block in 0..blocks {
            let first = block * per_block;
            let ones = total.saturating_sub(first).min(per_block) as usize;
            buf.fill(0);
            for entry in buf.chunks_exact_mut(REFCOUNT_BYTES as usize).take(ones) {
                entry.copy_from_slice(&1u16.to_be_bytes());
            }
            self.pwrite_meta(&buf, end)?;
            end += cluster_size;
        }
        let table_offset = end;
        let mut table = vec![0u8; (table_clusters << cb) as usize];
        for (block, entry) in table.chunks_exact_mut(8).take(blocks as usize).enumerate() {
            entry.copy_from_slice(&(blocks_offset + ((block as u64) << cb)).to_be_bytes());
        }
        self.pwrite_meta(&table, end)?;
        end += table_clusters << cb;
        debug_assert_eq!(end, total << cb);

        // Header, last.
        // With a backing file: its format as an extension, then the end marker, then its
        // name (unpadded), all in cluster 0.
        let name = self.backing.as_ref().map(|b| b.file.as_bytes());
        let extensions = match &self.backing {
            Some(b) => 8 + b.format.len().next_multiple_of(8),
            None => 0,
        };
        let name_at = HEADER_LENGTH as usize + extensions + 8;
        let mut header = vec![0u8; name_at + name.map_or(0, |n| n.len())];
        let mut put = |at: usize, bytes: &[u8]| header[at..at + bytes.len()].copy_from_slice(bytes);
        put(0, &QCOW2_MAGIC);
        put(4, &VERSION.to_be_bytes());
        if let (Some(b), Some(name)) = (&self.backing, name) {
            put(8, &(name_at as u64).to_be_bytes());
            put(16, &(name.len() as u32).to_be_bytes());
            let at = HEADER_LENGTH as usize;
            put(at, &EXT_BACKING_FORMAT.to_be_bytes());
            put(at + 4, &(b.format.len() as u32).to_be_bytes());
            put(at + 8, b.format.as_bytes());
            put(name_at, name);
        }
        put(20, &cb.to_be_bytes());
        put(24, &self.header_size.to_be_bytes());
        // 32: crypt_method = 0
        put(36, &(self.l1_size as u32).to_be_bytes());
        put(40, &l1_offset.to_be_bytes());
        put(48, &table_offset.to_be_bytes());
        put(56, &(table_clusters as u32).to_be_bytes());
        // 60: nb_snapshots, 64: snapshots_offset, 72/80/88: feature bits = 0
        put(96, &REFCOUNT_ORDER.to_be_bytes());
        put(100, &HEADER_LENGTH.to_be_bytes());
        // After the extensions: the end-of-extensions marker (type 0, length 0), 8 zeros.
        self.pwrite_meta(&header, 0)?;

        self.file
            .set_len(end)
            .map_err(|e| self.io_error("truncate", e))?;
        self.file.sync_all().map_err(|e| self.io_error("sync", e))?;
        Ok(self.file)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic elsewhere cannot leave the map inconsistent (each update is one store).
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The host offset of guest `cluster`, allocating it at the end of the file if it has
    /// none and `allocate`; 0 if unallocated.
    fn host_cluster(&self, state: &mut State, cluster: u64, allocate: bool) -> ImageResult<u64> {
        let index = (cluster >> self.l2_bits) as usize;
        let slot = (cluster & ((1 << self.l2_bits) - 1)) as usize;
        if let Some(table) = &state.l2[index] {
            let host = match table[slot] {
                ZERO_CLUSTER => 0, // reads as zeros; data written now allocates it
                host => host,
            };
            if host != 0 || !allocate {
                return Ok(host);
            }
        } else if !allocate {
            return Ok(0);
        }
        let host = state.next_host;
        if host >= MAX_HOST_OFFSET {
            return Err(self.io_error(
                "write",
                io::Error::new(io::ErrorKind::FileTooLarge, "qcow2 host file too large"),
            ));
        }
        state.next_host += 1 << self.cluster_bits;
        let entries = 1usize << self.l2_bits;
        state.l2[index].get_or_insert_with(|| vec![0u64; entries].into_boxed_slice())[slot] = host;
        Ok(host)
    }

    fn pwrite(&self, data: &[u8], at: u64) -> ImageResult<()> {
        self.file
            .write_all_at(data, at)
            .map_err(|e| self.io_error("write", e))
    }

    fn pwrite_meta(&self, data: &[u8], at: u64) -> ImageResult<()> {
        self.file
            .write_all_at(data, at)
            .map_err(|e| self.io_error("write qcow2 metadata to", e))
    }

    fn past_end(&self, len: usize, offset: u64) -> io::Error {
        io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{len} bytes at offset {offset} go past the end of the {}-byte image",
                self.size
            ),
        )
    }

    fn io_error(&self, op: &'static str, source: io::Error) -> ImageError {
        ImageError::Io {
            op,
            path: self.path.clone(),
            source,
        }
    }
}

/// Whether `data` is all zeros (fast: compares 16 bytes at a time, stops at the first
/// non-zero).
fn is_zero(data: &[u8]) -> bool {
    let mut chunks = data.chunks_exact(16);
    chunks
        .by_ref()
        .all(|c| u128::from_ne_bytes(c.try_into().unwrap()) == 0)
        && chunks.remainder().iter().all(|&b| b == 0)
}

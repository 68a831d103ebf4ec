//! The local, writable overlay of a writable NBD export.
//!
//! An [`Overlay`] sits on top of a read-only base image of `size` bytes and records, at a
//! granularity of `block_size` bytes (the repository's chunk size), which blocks have been
//! written and what they now contain. Writes always cover whole blocks (the caller fills a
//! partial block from the base first); reads ask [`Overlay::holds`] and read held blocks
//! from the overlay, the rest from the base.
//!
//! # Layers (iROW)
//!
//! Following iROW ("improved Redirect-on-Write"), the overlay is a stack of *layers*. Each
//! layer is a bitmap (one bit per block) plus a sparse data file in which block `i` lives at
//! offset `i * block_size`. The top layer is writable; the layers below it are frozen
//! snapshots. A *merged table* (one `u16` per block: the index of the topmost layer holding
//! it, or none) is rebuilt from the bitmaps at open and kept up to date in memory, so a read
//! is one table lookup however long the chain is.
//!
//! * [`snapshot`](Overlay::snapshot) freezes the top layer under a name and starts a new
//!   empty top: no data is copied, the merged table is unchanged.
//! * [`rollback`](Overlay::rollback) drops every layer above the snapshot (later snapshots
//!   included) and starts a new empty top over it; the snapshot itself stays.
//! * [`delete_snapshot`](Overlay::delete_snapshot) merges the snapshot's layer into the
//!   layer above it (blocks the upper layer does not hold are copied up; if the upper layer
//!   is empty the lower layer's files are simply adopted) and drops it; contents are
//!   unchanged.
//!
//! # Managing overlays from outside
//!
//! [`Overlay::inspect`] reads what a directory holds (base, snapshots, blocks held as of the
//! last flush) without opening or locking it; [`Overlay::open_rebasing_empty`] opens an
//! overlay and, if it sits on another base but holds nothing (no block, no snapshot), moves
//! it onto the requested base; [`Overlay::discard`] deletes an overlay no process holds
//! (manifest first), refusing a directory with files that are not the overlay's.
//!
//! # On-disk layout
//!
//! All files live in the overlay directory:
//!
//! | file | content |
//! |---|---|
//! | `meta.json` | the manifest: format, size, block size, base version id, the next layer id and the layer stack (bottom first; each `{id, snapshot}`; the top has no snapshot name), wrapped as `{"blake3": <hex of the body's JSON>, "body": {...}}` |
//! | `layer-<id>.data` | the layer's sparse data file; block `i` at offset `i * block_size`; zeroed blocks are holes |
//! | `layer-<id>.bitmap` | the layer's bitmap: header, dense or sparse payload, BLAKE3 trailer (see `bitmap.rs`) |
//! | `lock` | `flock`ed while an `Overlay` has the directory open |
//! | `*.tmp` | temporaries of atomic replacements; removed at open |
//!
//! Layer ids are never reused. Files of layers the manifest does not list are leftovers of
//! an interrupted operation and are deleted at open.
//!
//! Every metadata file is replaced atomically: write `<name>.tmp`, fsync it, rename it over
//! `<name>`, fsync the directory. Every metadata file is checksummed; a missing, truncated or
//! corrupted one makes [`Overlay::open`] fail with [`OverlayError::Corrupt`] naming the file.
//!
//! # Durability and crash safety
//!
//! A write goes to the top layer's data file at once but its bit reaches the on-disk bitmap
//! only at the next flush, so after a crash a block written since the last flush is simply
//! not held (reads fall back to the layers below or the base). [`Overlay::flush`] first
//! fdatasyncs the top data file and only then replaces the top bitmap: when a bit is on disk,
//! its data is too. Overwriting a block that was already held at the last flush happens in
//! place, so a crash before the next flush may leave that block with its old, its new or
//! (if the crash tears the write) mixed content, exactly like a disk without a write cache
//! flush. Dropping an `Overlay` does *not* flush.
//!
//! The manifest is the commit point of every metadata operation; each one creates or changes
//! the files the new manifest needs *before* writing it, and deletes files the old manifest
//! needed only *after*:
//!
//! * **snapshot**: flush the top (sync data, write bitmap); create the new top's data file
//!   and empty bitmap; write the manifest (old top named, new top pushed). A crash before the
//!   rename leaves the old manifest plus unreferenced files (deleted at next open).
//! * **rollback**: create the new top's files; write the manifest (layers above the snapshot
//!   removed); delete the removed layers' files.
//! * **delete_snapshot** of layer `k` with upper layer `u`: flush the top; then either
//!   (`u` empty) write the manifest with `u` removed and `k` taking `u`'s place and name, then
//!   delete `u`'s files; or copy the blocks of `k` that `u` lacks into `u`'s data file at
//!   offsets `u` does not hold (invisible), fdatasync it, replace `u`'s bitmap with `u ∪ k`
//!   (from now on `u` shows exactly what `k` showed beneath it, so the old manifest still
//!   reads identically), write the manifest without `k`, delete `k`'s files.
//! * **reset**: create a new empty layer; write the manifest (new base, only that layer);
//!   delete all old layers' files.
//!
//! snapshot and delete_snapshot flush first, so they also make every earlier write durable;
//! rollback and reset discard the top layer's writes, flushed or not. If a data fdatasync or a manifest replacement fails, the on-disk state is
//! uncertain, so the overlay turns *failed* ([`OverlayError::Failed`]) and refuses further
//! writes and metadata operations (except [`reset`](Overlay::reset)) until it is reopened.
//!
//! # Concurrency
//!
//! `Overlay` is `Send + Sync`. Reads run in parallel under a read lock; a write does its
//! `pwrite` under the read lock and takes the write lock only to set a new bit (and retries
//! if a metadata operation replaced the top layer in between). Flushes and metadata
//! operations take the write lock. Only one `Overlay` may have a directory open at a time.

mod bitmap;
mod error;
mod fsutil;
mod layer_files;
mod manage;
mod meta;
mod snapshots;

use std::collections::HashSet;
use std::fs::{self, File};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

use bitmap::Bitmap;
pub use error::OverlayError;
use fsutil::{atomic_write, read_at_zero_fill, read_meta_file, zero_range};
use layer_files::{bitmap_name, check_no_lost_layers, create_layer, data_name, gc, lock_dir};
pub use manage::OverlayInfo;
use meta::{LayerMeta, Meta};

/// Smallest allowed block size.
pub const MIN_BLOCK_SIZE: u32 = 4096;
/// Largest allowed block size.
pub const MAX_BLOCK_SIZE: u32 = 4 << 20;
/// Most layers a stack can have (the merged table stores layer indexes as `u16`).
pub const MAX_LAYERS: usize = u16::MAX as usize;

/// Merged-table entry of a block no layer holds.
const NONE: u16 = u16::MAX;
const META_FILE: &str = "meta.json";
const LOCK_FILE: &str = "lock";
/// Upper bound on blocks per image (the merged table is 2 bytes per block).
const MAX_BLOCKS: u64 = 1 << 36;

/// What an overlay holds, for status displays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OverlayStats {
    /// Blocks held by some layer (what a commit would store).
    pub blocks_held: u64,
    /// Bytes of those blocks (the last block of the image may be short).
    pub held_bytes: u64,
    /// Layers in the stack, the writable top included (snapshots + 1).
    pub layers: usize,
    /// Bytes the layers' data files occupy on disk (holes excluded).
    pub data_bytes_allocated: u64,
}

struct Layer {
    id: u64,
    /// Snapshot name; `None` for the top layer.
    name: Option<String>,
    file: File,
    bitmap: Bitmap,
}

struct State {
    base: String,
    next_layer_id: u64,
    /// Bottom first; the last one is the writable top.
    layers: Vec<Layer>,
    /// Per block: index into `layers` of the topmost layer holding it, or `NONE`.
    table: Vec<u16>,
    /// Entries of `table` that are not `NONE`.
    held: u64,
    /// The top bitmap has bits not yet on disk.
    bitmap_dirty: bool,
    /// Bumped by every metadata operation; writers retry if it moved under them.
    epoch: u64,
    /// Set when the on-disk state became uncertain (see the crate docs).
    failed: Option<String>,
}

/// A writable overlay over a read-only base image. See the [crate docs](crate).
pub struct Overlay {
    dir: PathBuf,
    size: u64,
    block_size: u32,
    nblocks: u64,
    /// The top data file has writes not yet fdatasynced.
    data_dirty: AtomicBool,
    state: RwLock<State>,
    /// Holds the directory's `flock` for the overlay's lifetime.
    _lock: File,
}

impl std::fmt::Debug for Overlay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Overlay")
            .field("dir", &self.dir)
            .field("size", &self.size)
            .field("block_size", &self.block_size)
            .finish_non_exhaustive()
    }
}

fn build_table(layers: &[Layer], nblocks: u64) -> (Vec<u16>, u64) {
    let mut table = vec![NONE; nblocks as usize];
    for (i, l) in layers.iter().enumerate() {
        for b in l.bitmap.iter() {
            table[b as usize] = i as u16;
        }
    }
    let held = table.iter().filter(|&&e| e != NONE).count() as u64;
    (table, held)
}

impl Overlay {
    /// Creates or reopens the overlay in `dir` (created if missing) for an image of `size`
    /// bytes in blocks of `block_size` bytes over the base version `base`.
    ///
    /// Reopening with a different size, block size or base is refused with
    /// [`OverlayError::Mismatch`] naming both values. A missing, truncated or corrupted
    /// metadata file is refused with [`OverlayError::Corrupt`] naming the file.
    pub fn open(
        dir: &Path,
        size: u64,
        block_size: u32,
        base: &str,
    ) -> Result<Overlay, OverlayError> {
        if !block_size.is_power_of_two() || !(MIN_BLOCK_SIZE..=MAX_BLOCK_SIZE).contains(&block_size)
        {
            return Err(OverlayError::InvalidBlockSize(block_size));
        }
        let nblocks = size.div_ceil(block_size as u64);
        if nblocks > MAX_BLOCKS {
            return Err(OverlayError::TooLarge { size, block_size });
        }
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|e| OverlayError::io("create directory", dir, e))?;
        let lock = lock_dir(dir)?;
        let meta_path = dir.join(META_FILE);
        let exists = meta_path
            .try_exists()
            .map_err(|e| OverlayError::io("stat", &meta_path, e))?;

        let overlay = |state| Overlay {
            dir: dir.to_path_buf(),
            size,
            block_size,
            nblocks,
            data_dirty: AtomicBool::new(false),
            state: RwLock::new(state),
            _lock: lock,
        };

        if !exists {
            // Fresh overlay, or a crash during creation (which leaves at most an empty
            // layer-0 data file and its bitmap). Anything more means the manifest was lost:
            // refuse rather than silently start over.
            check_no_lost_layers(dir, &meta_path)?;
            gc(dir, &HashSet::new());
            let layer = create_layer(dir, 0, nblocks)?;
            let meta = Meta {
                format: meta::FORMAT.into(),
                version: meta::VERSION,
                size,
                block_size,
                base: base.to_string(),
                next_layer_id: 1,
                layers: vec![LayerMeta {
                    id: 0,
                    snapshot: None,
                }],
            };
            atomic_write(dir, META_FILE, &meta.encode())?;
            tracing::debug!(dir = %dir.display(), size, block_size, base, "created overlay");
            return Ok(overlay(State {
                base: base.to_string(),
                next_layer_id: 1,
                layers: vec![layer],
                table: vec![NONE; nblocks as usize],
                held: 0,
                bitmap_dirty: false,
                epoch: 0,
                failed: None,
            }));
        }

        let meta = Meta::decode(&read_meta_file(&meta_path)?, &meta_path)?;
        let mismatch = |field, stored: String, requested: String| OverlayError::Mismatch {
            path: dir.to_path_buf(),
            field,
            stored,
            requested,
        };
        if meta.size != size {
            return Err(mismatch("size", meta.size.to_string(), size.to_string()));
        }
        if meta.block_size != block_size {
            return Err(mismatch(
                "block size",
                meta.block_size.to_string(),
                block_size.to_string(),
            ));
        }
        if meta.base != base {
            return Err(mismatch(
                "base",
                format!("{:?}", meta.base),
                format!("{base:?}"),
            ));
        }
        let mut layers = Vec::with_capacity(meta.layers.len());
        for lm in &meta.layers {
            let dpath = dir.join(data_name(lm.id));
            let file = fsutil::open_rw(&dpath, false).map_err(|e| {
                if e.kind() == std::io::ErrorKind::NotFound {
                    OverlayError::corrupt(&dpath, "missing")
                } else {
                    OverlayError::io("open", &dpath, e)
                }
            })?;
            let bpath = dir.join(bitmap_name(lm.id));
            let bitmap = Bitmap::decode(&read_meta_file(&bpath)?, &bpath, lm.id, nblocks)?;
            layers.push(Layer {
                id: lm.id,
                name: lm.snapshot.clone(),
                file,
                bitmap,
            });
        }
        gc(dir, &meta.layers.iter().map(|l| l.id).collect());
        let (table, held) = build_table(&layers, nblocks);
        tracing::debug!(dir = %dir.display(), layers = layers.len(), held, "opened overlay");
        Ok(overlay(State {
            base: meta.base,
            next_layer_id: meta.next_layer_id,
            layers,
            table,
            held,
            bitmap_dirty: false,
            epoch: 0,
            failed: None,
        }))
    }

    /// The block size in bytes.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// The image size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Number of blocks of the image (the last one may be short).
    pub fn block_count(&self) -> u64 {
        self.nblocks
    }

    /// The base version id the overlay sits on.
    pub fn base(&self) -> String {
        self.read().base.clone()
    }

    /// The overlay directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Length of block `block` in bytes (`block_size`, or less for the last block).
    pub fn block_len(&self, block: u64) -> u64 {
        let start = block.saturating_mul(self.block_size as u64);
        self.size.saturating_sub(start).min(self.block_size as u64)
    }

    /// Whether some layer holds block `block` — one table lookup. False past the end.
    pub fn holds(&self, block: u64) -> bool {
        self.holding_layer(block).is_some()
    }

    /// Index (0 = bottom) of the topmost layer holding `block`, straight from the merged
    /// table; `None` if no layer holds it.
    pub fn holding_layer(&self, block: u64) -> Option<usize> {
        if block >= self.nblocks {
            return None;
        }
        let e = self.read().table[block as usize];
        (e != NONE).then_some(e as usize)
    }

    /// Reads `buf.len()` bytes at `offset_in_block` within `block` from the layer holding
    /// it. [`OverlayError::NotHeld`] if no layer does (read the base instead).
    pub fn read_block(
        &self,
        block: u64,
        offset_in_block: u32,
        buf: &mut [u8],
    ) -> Result<(), OverlayError> {
        if self.read_if_held(block, offset_in_block, buf)? {
            Ok(())
        } else {
            Err(OverlayError::NotHeld { block })
        }
    }

    /// Like [`read_block`](Self::read_block) but atomic with the "is it held" check: returns
    /// `false` (and leaves `buf` alone) if no layer holds the block.
    pub fn read_if_held(
        &self,
        block: u64,
        offset_in_block: u32,
        buf: &mut [u8],
    ) -> Result<bool, OverlayError> {
        self.check_block(block)?;
        let block_len = self.block_len(block);
        if offset_in_block as u64 + buf.len() as u64 > block_len {
            return Err(OverlayError::ReadOutsideBlock {
                block,
                offset: offset_in_block,
                len: buf.len() as u64,
                block_len,
            });
        }
        let st = self.read();
        let e = st.table[block as usize];
        if e == NONE {
            return Ok(false);
        }
        let layer = &st.layers[e as usize];
        let pos = block * self.block_size as u64 + offset_in_block as u64;
        read_at_zero_fill(&layer.file, buf, pos)
            .map_err(|err| OverlayError::io("read", self.dir.join(data_name(layer.id)), err))?;
        Ok(true)
    }

    /// Writes a whole block into the top layer. `data.len()` must be the block's length
    /// ([`block_len`](Self::block_len)). An all-zero block is stored as a hole.
    /// Durable only after the next [`flush`](Self::flush).
    pub fn write_block(&self, block: u64, data: &[u8]) -> Result<(), OverlayError> {
        self.check_block(block)?;
        let expected = self.block_len(block);
        if data.len() as u64 != expected {
            return Err(OverlayError::BadLength {
                block,
                expected,
                got: data.len() as u64,
            });
        }
        let zero = data.iter().all(|&b| b == 0);
        let pos = block * self.block_size as u64;
        loop {
            let epoch = {
                let st = self.read();
                check_failed(&st)?;
                let top = st.layers.last().expect("at least one layer");
                let r = if zero {
                    zero_range(&top.file, pos, expected)
                } else {
                    top.file.write_all_at(data, pos)
                };
                r.map_err(|e| OverlayError::io("write", self.dir.join(data_name(top.id)), e))?;
                self.data_dirty.store(true, Ordering::SeqCst);
                if top.bitmap.get(block) {
                    return Ok(());
                }
                st.epoch
            };
            let mut st = self.write();
            if st.epoch != epoch {
                // A metadata operation replaced or merged into the top layer between our
                // pwrite and now: do the write again on the current top.
                continue;
            }
            mark_held(&mut st, block, 1);
            return Ok(());
        }
    }

    /// Marks `count` blocks from `first` as zero in the top layer (write zeroes / trim):
    /// they become held and read as zeros; their storage is a hole where the filesystem can
    /// punch one. Durable only after the next [`flush`](Self::flush).
    pub fn zero_blocks(&self, first: u64, count: u64) -> Result<(), OverlayError> {
        if count == 0 {
            return Ok(());
        }
        let end = first
            .checked_add(count)
            .filter(|&e| e <= self.nblocks)
            .ok_or(OverlayError::BlockOutOfRange {
                block: first.saturating_add(count - 1),
                blocks: self.nblocks,
            })?;
        let mut st = self.write();
        check_failed(&st)?;
        let top = st.layers.last().expect("at least one layer");
        let pos = first * self.block_size as u64;
        let len = (end * self.block_size as u64).min(self.size) - pos;
        zero_range(&top.file, pos, len)
            .map_err(|e| OverlayError::io("zero", self.dir.join(data_name(top.id)), e))?;
        self.data_dirty.store(true, Ordering::SeqCst);
        mark_held(&mut st, first, count);
        Ok(())
    }

    /// Makes every write so far durable: fdatasync the top data file, then replace the top
    /// layer's bitmap atomically.
    pub fn flush(&self) -> Result<(), OverlayError> {
        let mut st = self.write();
        self.flush_locked(&mut st)
    }

    /// Sorted indexes of the blocks held by any layer (what a commit must store).
    pub fn held_blocks(&self) -> Vec<u64> {
        let st = self.read();
        st.table
            .iter()
            .enumerate()
            .filter(|(_, &e)| e != NONE)
            .map(|(i, _)| i as u64)
            .collect()
    }

    /// Counts of what the overlay holds.
    pub fn stats(&self) -> OverlayStats {
        let st = self.read();
        let bs = self.block_size as u64;
        let mut held_bytes = st.held * bs;
        if self.nblocks > 0 && st.table[self.nblocks as usize - 1] != NONE {
            held_bytes -= bs - self.block_len(self.nblocks - 1);
        }
        let data_bytes_allocated = st
            .layers
            .iter()
            .filter_map(|l| l.file.metadata().ok())
            .map(|m| m.blocks() * 512)
            .sum();
        OverlayStats {
            blocks_held: st.held,
            held_bytes,
            layers: st.layers.len(),
            data_bytes_allocated,
        }
    }

    fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().unwrap_or_else(|e| e.into_inner())
    }

    fn write(&self) -> RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|e| e.into_inner())
    }

    fn check_block(&self, block: u64) -> Result<(), OverlayError> {
        if block >= self.nblocks {
            return Err(OverlayError::BlockOutOfRange {
                block,
                blocks: self.nblocks,
            });
        }
        Ok(())
    }

    fn flush_locked(&self, st: &mut State) -> Result<(), OverlayError> {
        check_failed(st)?;
        let top = st.layers.last().expect("at least one layer");
        if self.data_dirty.swap(false, Ordering::SeqCst) {
            if let Err(e) = top.file.sync_data() {
                let err = OverlayError::io("fdatasync", self.dir.join(data_name(top.id)), e);
                st.failed = Some(err.to_string());
                return Err(err);
            }
        }
        if st.bitmap_dirty {
            atomic_write(&self.dir, &bitmap_name(top.id), &top.bitmap.encode(top.id))?;
            st.bitmap_dirty = false;
        }
        Ok(())
    }

    fn meta_of(&self, st: &State) -> Meta {
        Meta {
            format: meta::FORMAT.into(),
            version: meta::VERSION,
            size: self.size,
            block_size: self.block_size,
            base: st.base.clone(),
            next_layer_id: st.next_layer_id,
            layers: st
                .layers
                .iter()
                .map(|l| LayerMeta {
                    id: l.id,
                    snapshot: l.name.clone(),
                })
                .collect(),
        }
    }

    /// Writes the manifest (the commit point). On failure the on-disk manifest may be the
    /// old or the new one, so the overlay turns failed until reopened.
    fn commit(&self, st: &mut State, meta: &Meta) -> Result<(), OverlayError> {
        atomic_write(&self.dir, META_FILE, &meta.encode()).inspect_err(|e| {
            st.failed = Some(e.to_string());
        })
    }

    /// Deletes a layer the manifest no longer lists. Failures only leave garbage that the
    /// next open removes.
    fn remove_layer_files(&self, layer: Layer) {
        drop(layer.file);
        for name in [data_name(layer.id), bitmap_name(layer.id)] {
            let p = self.dir.join(name);
            if let Err(e) = fs::remove_file(&p) {
                tracing::warn!(path = %p.display(), error = %e, "cannot remove overlay layer file");
            }
        }
    }
}

fn check_failed(st: &State) -> Result<(), OverlayError> {
    match &st.failed {
        Some(why) => Err(OverlayError::Failed(why.clone())),
        None => Ok(()),
    }
}

/// Sets blocks `first..first+count` in the top bitmap and the merged table.
fn mark_held(st: &mut State, first: u64, count: u64) {
    let top_index = (st.layers.len() - 1) as u16;
    let top = st.layers.last_mut().expect("at least one layer");
    for b in first..first + count {
        if top.bitmap.set(b) {
            st.bitmap_dirty = true;
        }
        let e = &mut st.table[b as usize];
        if *e == NONE {
            st.held += 1;
        }
        *e = top_index;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_is_send_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<Overlay>();
    }
}

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
//! Following iROW ("improved Redirect-on-Write"), the overlay is a tree of *layers*. Each
//! layer is a bitmap (one bit per block) plus a sparse data file in which block `i` lives at
//! offset `i * block_size`, and names the layer below it (its parent; none on the base). One
//! layer is writable (the *current* one); the others are frozen snapshots, or deleted
//! snapshots that layers above still read through. Reads go through the path from the
//! current layer down to the base: a *merged table* (one `u16` per block: the slot of the
//! topmost layer on that path holding it, or none) is built from the bitmaps at open and
//! kept up to date in memory, so a read is one table lookup however deep the path is.
//!
//! * [`snapshot`](Overlay::snapshot) freezes the current layer under a name and starts a new
//!   empty layer on it: no data is copied, the merged table is unchanged.
//! * [`rollback`](Overlay::rollback) drops the current layer (the writes since the last
//!   snapshot) and starts a new empty one on the snapshot. Other snapshots stay: those taken
//!   after it become a branch a later rollback returns to. The merged table is recomputed
//!   only for the blocks of the layers the path leaves and enters.
//! * [`delete_snapshot`](Overlay::delete_snapshot) marks the snapshot deleted (iROW's
//!   virtual deletion) and tidies it: blocks every layer on it holds can never be read again
//!   and are dropped from its bitmap and punched out of its data file; a deleted layer no
//!   layer sits on goes (and so, in turn, may its deleted parent); one with a single layer on
//!   it is merged with that layer, copying the smaller of the two. Contents are unchanged.
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
//! | `meta.json` | the manifest (version 2): format, size, block size, base version id, the next layer id, the current layer's id, and every layer by id (each `{id, parent, snapshot, deleted}`; the current and deleted layers have no snapshot name), wrapped as `{"blake3": <hex of the body's JSON>, "body": {...}}`. Version 1 held a stack (`{id, snapshot}`, bottom first, the last one writable) and is read as a chain |
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
//! * **rollback**: create the new current layer's files; write the manifest (the old current
//!   layer removed); delete its files; tidy its parent if that is a deleted snapshot.
//! * **delete_snapshot**: flush; write the manifest with the layer marked deleted; tidy it.
//! * **tidy** of deleted layer `k` (also run at open, so an interrupted one finishes):
//!   flush; with no layer on `k`, write the manifest without it and delete its files. Else
//!   replace `k`'s bitmap without the blocks every layer on it holds, then punch them out of
//!   its data file (nothing reads them whatever the manifest says). With one layer `u` on
//!   it, merge: copy `u`'s blocks into `k`'s data file, or the blocks of `k` that `u` lacks
//!   into `u`'s (either way where nothing reads them yet), fdatasync, replace the receiving
//!   layer's bitmap with the union (the old manifest still reads identically), then write the
//!   manifest with the receiving layer in `u`'s place (name, children, writable role) and
//!   delete the other's files.
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
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use bitmap::Bitmap;
pub use error::OverlayError;
use fsutil::{atomic_write, read_at_zero_fill, read_meta_file, zero_range};
use layer_files::{bitmap_name, check_no_lost_layers, create_layer, data_name, gc, lock_dir};
pub use manage::OverlayInfo;
use meta::{LayerMeta, Meta};
pub use snapshots::SnapshotInfo;

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
    /// Layers in the snapshot tree: snapshots, the writable layer, and deleted snapshots
    /// that layers above still read through.
    pub layers: usize,
    /// Bytes the layers' data files occupy on disk (holes excluded).
    pub data_bytes_allocated: u64,
    /// Blocks copied into the current layer on read (copy-on-demand) since open.
    pub copied_on_read: u64,
}

struct Layer {
    id: u64,
    /// Slot of the layer below; `None` on the base.
    parent: Option<usize>,
    /// Snapshot name; `None` for the writable layer and deleted ones.
    name: Option<String>,
    /// A deleted snapshot that layers above still read through (virtual deletion).
    deleted: bool,
    file: File,
    bitmap: Bitmap,
}

struct State {
    base: String,
    next_layer_id: u64,
    /// Every layer of the snapshot tree, by slot (the merged table names slots); `None` is a
    /// free slot. Slots are reused, layer ids never.
    layers: Vec<Option<Layer>>,
    /// Slot of the writable layer (the top of the path reads go through).
    current: usize,
    /// Per block: slot of the topmost layer on the current path holding it, or `NONE`.
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
    /// Copy-on-demand: a block read from a layer this many layers or more below the current
    /// one is copied into the current layer (0: off).
    copy_on_read: AtomicU16,
    /// Blocks copied up on read since open.
    copied_on_read: AtomicU64,
    state: RwLock<State>,
    /// Space being freed in the background (freeing a file's extents can take longer than the
    /// operation that made them garbage): files of layers the manifest no longer lists, and
    /// blocks punched out of a deleted layer (tagged with its id, so that nothing is copied
    /// into that layer before they are done). Joined on drop.
    background: Mutex<Vec<(Option<u64>, std::thread::JoinHandle<()>)>>,
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

impl State {
    fn layer(&self, slot: usize) -> &Layer {
        self.layers[slot].as_ref().expect("a slot in use")
    }

    fn layer_mut(&mut self, slot: usize) -> &mut Layer {
        self.layers[slot].as_mut().expect("a slot in use")
    }

    /// The writable layer.
    fn top(&self) -> &Layer {
        self.layer(self.current)
    }

    /// Slots from `slot` down to the base.
    fn path_from(&self, slot: usize) -> Vec<usize> {
        let mut path = vec![slot];
        while let Some(p) = self.layer(*path.last().expect("not empty")).parent {
            path.push(p);
        }
        path
    }

    /// Slots of the layers straight on top of `slot`.
    fn children(&self, slot: usize) -> Vec<usize> {
        self.slots()
            .filter(|&s| self.layer(s).parent == Some(slot))
            .collect()
    }

    /// Slots in use, in slot order.
    fn slots(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.layers.len()).filter(|&s| self.layers[s].is_some())
    }

    /// Puts `layer` in a free slot.
    fn insert(&mut self, layer: Layer) -> usize {
        match self.layers.iter().position(Option::is_none) {
            Some(s) => {
                self.layers[s] = Some(layer);
                s
            }
            None => {
                self.layers.push(Some(layer));
                self.layers.len() - 1
            }
        }
    }

    /// Whether another layer fits (the merged table names slots in a `u16`).
    fn has_room(&self) -> Result<(), OverlayError> {
        let used = self.slots().count();
        if used >= MAX_LAYERS {
            return Err(OverlayError::TooManyLayers(used));
        }
        Ok(())
    }

    /// The slot of the topmost layer on the current path holding `block`.
    fn holder_on(&self, path: &[usize], block: u64) -> u16 {
        path.iter()
            .find(|&&s| self.layer(s).bitmap.get(block))
            .map_or(NONE, |&s| s as u16)
    }
}

/// The merged table of the current path, and how many blocks it holds.
fn build_table(st: &State, nblocks: u64) -> (Vec<u16>, u64) {
    let mut table = vec![NONE; nblocks as usize];
    for &slot in st.path_from(st.current).iter().rev() {
        for b in st.layer(slot).bitmap.iter() {
            table[b as usize] = slot as u16;
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
            copy_on_read: AtomicU16::new(0),
            copied_on_read: AtomicU64::new(0),
            background: Mutex::new(Vec::new()),
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
                current: 0,
                layers: vec![LayerMeta {
                    id: 0,
                    parent: None,
                    snapshot: None,
                    deleted: false,
                }],
            };
            atomic_write(dir, META_FILE, &meta.encode())?;
            tracing::debug!(dir = %dir.display(), size, block_size, base, "created overlay");
            return Ok(overlay(State {
                base: base.to_string(),
                next_layer_id: 1,
                layers: vec![Some(layer)],
                current: 0,
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
        let mut slot_of = std::collections::HashMap::new();
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
            slot_of.insert(lm.id, layers.len());
            layers.push(Some(Layer {
                id: lm.id,
                // Validated: a parent is listed, and listed before its children.
                parent: lm.parent.map(|p| slot_of[&p]),
                name: lm.snapshot.clone(),
                deleted: lm.deleted,
                file,
                bitmap,
            }));
        }
        gc(dir, &meta.layers.iter().map(|l| l.id).collect());
        let mut state = State {
            base: meta.base,
            next_layer_id: meta.next_layer_id,
            layers,
            current: slot_of[&meta.current],
            table: Vec::new(),
            held: 0,
            bitmap_dirty: false,
            epoch: 0,
            failed: None,
        };
        let (table, held) = build_table(&state, nblocks);
        state.table = table;
        state.held = held;
        tracing::debug!(dir = %dir.display(), layers = meta.layers.len(), held, "opened overlay");
        let overlay = overlay(state);
        // An interrupted deletion may have left deleted layers to tidy.
        {
            let mut st = overlay.write();
            let deleted: Vec<usize> = st.slots().filter(|&s| st.layer(s).deleted).collect();
            for slot in deleted {
                if st.layers[slot].is_some() {
                    overlay.tidy(&mut st, slot)?;
                }
            }
        }
        Ok(overlay)
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
        let layer = st.layer(e as usize);
        let pos = block * self.block_size as u64 + offset_in_block as u64;
        read_at_zero_fill(&layer.file, buf, pos)
            .map_err(|err| OverlayError::io("read", self.dir.join(data_name(layer.id)), err))?;
        let min_depth = self.copy_on_read.load(Ordering::Relaxed);
        let deep = min_depth > 0
            && e as usize != st.current
            && st
                .path_from(st.current)
                .iter()
                .position(|&s| s == e as usize)
                .is_some_and(|d| d >= min_depth as usize);
        drop(st);
        if deep {
            if let Err(err) = self.copy_up(block, e as usize) {
                // The read itself succeeded; only the copy is lost.
                tracing::warn!(dir = %self.dir.display(), block, error = %err, "copy-on-read failed");
            }
        }
        Ok(true)
    }

    /// Copy-on-demand (iROW): from now on, a block read from a layer `depth` or more layers
    /// below the current one is copied into the current layer, so later reads of it, and
    /// deletions of the snapshots below, no longer depend on those layers. `0` turns it off.
    /// The copy is durable, like a write, at the next flush.
    pub fn set_copy_on_read(&self, depth: u16) {
        self.copy_on_read.store(depth, Ordering::Relaxed);
    }

    /// Copies `block`, which layer `slot` holds for the current path, into the current layer.
    fn copy_up(&self, block: u64, slot: usize) -> Result<(), OverlayError> {
        let mut st = self.write();
        check_failed(&st)?;
        if st.table[block as usize] != slot as u16 || slot == st.current {
            return Ok(()); // written or moved meanwhile
        }
        let len = self.block_len(block) as usize;
        let pos = block * self.block_size as u64;
        let mut buf = vec![0u8; len];
        let src = st.layer(slot);
        read_at_zero_fill(&src.file, &mut buf, pos)
            .map_err(|e| OverlayError::io("read", self.dir.join(data_name(src.id)), e))?;
        let top = st.top();
        let r = if buf.iter().all(|&b| b == 0) {
            zero_range(&top.file, pos, len as u64)
        } else {
            top.file.write_all_at(&buf, pos)
        };
        r.map_err(|e| OverlayError::io("write", self.dir.join(data_name(top.id)), e))?;
        self.data_dirty.store(true, Ordering::SeqCst);
        mark_held(&mut st, block, 1);
        // A guest write that did its pwrite before this copy and has not marked its block
        // yet must do it again, or the copy would stand in its place.
        st.epoch += 1;
        self.copied_on_read.fetch_add(1, Ordering::Relaxed);
        Ok(())
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
                let top = st.top();
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
        let top = st.top();
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
            .slots()
            .filter_map(|s| st.layer(s).file.metadata().ok())
            .map(|m| m.blocks() * 512)
            .sum();
        OverlayStats {
            blocks_held: st.held,
            held_bytes,
            layers: st.slots().count(),
            data_bytes_allocated,
            copied_on_read: self.copied_on_read.load(Ordering::Relaxed),
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
        let top = st.top();
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
            current: st.top().id,
            layers: {
                let mut layers: Vec<LayerMeta> = st
                    .slots()
                    .map(|s| {
                        let l = st.layer(s);
                        LayerMeta {
                            id: l.id,
                            parent: l.parent.map(|p| st.layer(p).id),
                            snapshot: l.name.clone(),
                            deleted: l.deleted,
                        }
                    })
                    .collect();
                layers.sort_by_key(|l| l.id);
                layers
            },
        }
    }

    /// Writes the manifest (the commit point). On failure the on-disk manifest may be the
    /// old or the new one, so the overlay turns failed until reopened.
    fn commit(&self, st: &mut State, meta: &Meta) -> Result<(), OverlayError> {
        atomic_write(&self.dir, META_FILE, &meta.encode()).inspect_err(|e| {
            st.failed = Some(e.to_string());
        })
    }

    /// Deletes, in the background, a layer the manifest no longer lists (its id is never
    /// used again). Failures only leave garbage that the next open removes.
    fn remove_layer_files(&self, layer: Layer) {
        let paths = [data_name(layer.id), bitmap_name(layer.id)].map(|n| self.dir.join(n));
        let remove = move || {
            drop(layer.file);
            for p in paths {
                match fs::remove_file(&p) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        tracing::warn!(path = %p.display(), error = %e, "cannot remove overlay layer file")
                    }
                }
            }
        };
        self.in_background(None, remove);
    }

    /// Runs `work`, which only frees space, on a thread of its own; `layer` is the layer whose
    /// data file it changes, if any. Where no thread can be started, runs it here.
    fn in_background(&self, layer: Option<u64>, work: impl FnOnce() + Send + 'static) {
        let mut pending = self.background.lock().unwrap_or_else(|e| e.into_inner());
        pending.retain(|(_, h)| !h.is_finished());
        let work = std::sync::Arc::new(Mutex::new(Some(work)));
        let run = {
            let work = work.clone();
            move || {
                let w = work.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some(w) = w {
                    w();
                }
            }
        };
        match std::thread::Builder::new()
            .name("overlay-free".into())
            .spawn(run)
        {
            Ok(h) => pending.push((layer, h)),
            Err(e) => {
                tracing::debug!(error = %e, "no thread to free overlay space: freeing it now");
                drop(pending);
                let w = work.lock().unwrap_or_else(|e| e.into_inner()).take();
                if let Some(w) = w {
                    w();
                }
            }
        }
    }

    /// Waits until the space being freed in the background (files of dropped layers, blocks
    /// of deleted snapshots nothing reads) is free.
    pub fn settle(&self) {
        let pending =
            std::mem::take(&mut *self.background.lock().unwrap_or_else(|e| e.into_inner()));
        for (_, h) in pending {
            let _ = h.join();
        }
    }

    /// Waits until nothing in the background changes layer `id`'s data file.
    fn settle_layer(&self, id: u64) {
        let mine: Vec<_> = {
            let mut pending = self.background.lock().unwrap_or_else(|e| e.into_inner());
            let (mine, rest) = std::mem::take(&mut *pending)
                .into_iter()
                .partition(|(l, _)| *l == Some(id));
            *pending = rest;
            mine
        };
        for (_, h) in mine {
            let _ = h.join();
        }
    }
}

impl Drop for Overlay {
    /// Waits for the space being freed, so that whoever opens the directory next finds only
    /// the overlay's files.
    fn drop(&mut self) {
        self.settle();
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
    let top_index = st.current as u16;
    let top = st.layers[st.current].as_mut().expect("the writable layer");
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

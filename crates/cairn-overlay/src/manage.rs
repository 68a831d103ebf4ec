//! Managing overlays from outside: inspect one without opening it, reopen one on another
//! base when it holds nothing, and discard one that no process holds.

use std::fs;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::bitmap::Bitmap;
use crate::fsutil::{read_meta_file, sync_dir};
use crate::layer_files::{bitmap_name, data_name, is_overlay_file, lock_dir};
use crate::meta::Meta;
use crate::{Overlay, OverlayError, LOCK_FILE, META_FILE};

/// What an overlay directory holds, read from its files without opening (or locking) it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OverlayInfo {
    pub dir: PathBuf,
    /// Image size and block size in bytes.
    pub size: u64,
    pub block_size: u32,
    /// The base version id the overlay sits on.
    pub base: String,
    /// Snapshot names, oldest first.
    pub snapshots: Vec<String>,
    /// Layers in the snapshot tree, the writable layer and deleted snapshots included.
    pub layers: usize,
    /// Blocks the current state holds (the writable layer and the snapshots under it) as of
    /// the last flush, and their bytes.
    pub blocks_held: u64,
    pub held_bytes: u64,
    /// Bytes the layers' data files occupy on disk.
    pub data_bytes_allocated: u64,
}

impl Overlay {
    /// Reads what the overlay in `dir` holds (as of its last flush) without opening it, so it
    /// works while a process has it open. [`OverlayError::NotAnOverlay`] if `dir` has no
    /// manifest.
    pub fn inspect(dir: &Path) -> Result<OverlayInfo, OverlayError> {
        let meta_path = dir.join(META_FILE);
        let mut attempt = 0;
        loop {
            let bytes = match fs::read(&meta_path) {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(OverlayError::NotAnOverlay {
                        path: dir.to_path_buf(),
                    })
                }
                Err(e) => return Err(OverlayError::io("read", &meta_path, e)),
            };
            match inspect_with(dir, &Meta::decode(&bytes, &meta_path)?) {
                Ok(info) => return Ok(info),
                // A process holding the overlay may have replaced its layers between our
                // reads: read the new manifest again (a few times).
                Err(e) if attempt < 3 && fs::read(&meta_path).ok().as_ref() != Some(&bytes) => {
                    tracing::debug!(dir = %dir.display(), error = %e, "overlay changed while inspected");
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Opens the overlay in `dir` like [`Overlay::open`], but an overlay on another base that
    /// holds nothing (no written block, no snapshot) is moved onto `base` instead of refused:
    /// nothing in it depends on its base. Returns the old base when it did that. An overlay
    /// holding writes or snapshots is refused with [`OverlayError::Mismatch`] as by `open`.
    pub fn open_rebasing_empty(
        dir: &Path,
        size: u64,
        block_size: u32,
        base: &str,
    ) -> Result<(Overlay, Option<String>), OverlayError> {
        match Overlay::open(dir, size, block_size, base) {
            Ok(o) => Ok((o, None)),
            Err(mismatch @ OverlayError::Mismatch { field: "base", .. }) => {
                let meta_path = dir.join(META_FILE);
                let meta = Meta::decode(&read_meta_file(&meta_path)?, &meta_path)?;
                let o = Overlay::open(dir, size, block_size, &meta.base)?;
                if o.stats().blocks_held > 0 || !o.snapshots().is_empty() {
                    return Err(mismatch);
                }
                o.reset(base)?;
                tracing::info!(dir = %dir.display(), old = %meta.base, new = base, "empty overlay moved to a new base");
                Ok((o, Some(meta.base)))
            }
            Err(e) => Err(e),
        }
    }

    /// Deletes the overlay in `dir` and the directory itself. Refused with
    /// [`OverlayError::Locked`] while a process has it open, and with
    /// [`OverlayError::ForeignFile`] (deleting nothing) if the directory holds a file that
    /// is not the overlay's. The manifest goes first, so an interrupted discard leaves no
    /// overlay, only files that the next discard or open removes.
    pub fn discard(dir: &Path) -> Result<(), OverlayError> {
        let meta_path = dir.join(META_FILE);
        match fs::symlink_metadata(&meta_path) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(OverlayError::NotAnOverlay {
                    path: dir.to_path_buf(),
                })
            }
            Err(e) => return Err(OverlayError::io("stat", &meta_path, e)),
        }
        let lock = lock_dir(dir)?;
        let mut files = Vec::new();
        for entry in fs::read_dir(dir).map_err(|e| OverlayError::io("list", dir, e))? {
            let entry = entry.map_err(|e| OverlayError::io("list", dir, e))?;
            let name = entry.file_name();
            match name.to_str() {
                Some(n) if is_overlay_file(n) => files.push(entry.path()),
                _ => return Err(OverlayError::ForeignFile { path: entry.path() }),
            }
        }
        fs::remove_file(&meta_path).map_err(|e| OverlayError::io("remove", &meta_path, e))?;
        sync_dir(dir)?;
        for f in files {
            if f != meta_path && f.file_name() != Some(LOCK_FILE.as_ref()) {
                fs::remove_file(&f).map_err(|e| OverlayError::io("remove", &f, e))?;
            }
        }
        let lock_path = dir.join(LOCK_FILE);
        fs::remove_file(&lock_path).map_err(|e| OverlayError::io("remove", &lock_path, e))?;
        drop(lock);
        fs::remove_dir(dir).map_err(|e| OverlayError::io("remove directory", dir, e))?;
        tracing::debug!(dir = %dir.display(), "overlay discarded");
        Ok(())
    }
}

fn inspect_with(dir: &Path, meta: &Meta) -> Result<OverlayInfo, OverlayError> {
    let nblocks = meta.size.div_ceil(meta.block_size as u64);
    let mut held = Bitmap::new(nblocks);
    let mut allocated = 0;
    let mut on_path = std::collections::HashSet::new();
    let mut at = Some(meta.current);
    while let Some(id) = at {
        on_path.insert(id);
        at = meta
            .layers
            .iter()
            .find(|l| l.id == id)
            .and_then(|l| l.parent);
    }
    for l in &meta.layers {
        let bpath = dir.join(bitmap_name(l.id));
        let bitmap = Bitmap::decode(&read_meta_file(&bpath)?, &bpath, l.id, nblocks)?;
        if on_path.contains(&l.id) {
            held.union_with(&bitmap);
        }
        let dpath = dir.join(data_name(l.id));
        allocated += fs::metadata(&dpath)
            .map_err(|e| OverlayError::io("stat", &dpath, e))?
            .blocks()
            * 512;
    }
    let blocks_held = held.count();
    let bs = meta.block_size as u64;
    let mut held_bytes = blocks_held * bs;
    if nblocks > 0 && held.get(nblocks - 1) {
        held_bytes -= bs - (meta.size - (nblocks - 1) * bs);
    }
    Ok(OverlayInfo {
        dir: dir.to_path_buf(),
        size: meta.size,
        block_size: meta.block_size,
        base: meta.base.clone(),
        snapshots: meta
            .layers
            .iter()
            .filter_map(|l| l.snapshot.clone())
            .collect(),
        layers: meta.layers.len(),
        blocks_held,
        held_bytes,
        data_bytes_allocated: allocated,
    })
}

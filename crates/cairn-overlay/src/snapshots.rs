//! iROW snapshots of the overlay: freeze the top layer, roll back to a snapshot, merge a
//! snapshot away, or start over on a new base. The manifest write is each operation's commit
//! point (see the crate docs for the order of file operations).

use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;

use crate::fsutil::{atomic_write, read_at_zero_fill, zero_range};
use crate::layer_files::{bitmap_name, create_layer, data_name};
use crate::meta::{LayerMeta, Meta};
use crate::{
    build_table, check_failed, Layer, Overlay, OverlayError, State, MAX_LAYERS, META_FILE, NONE,
};

impl Overlay {
    /// Snapshot names, oldest first.
    pub fn snapshots(&self) -> Vec<String> {
        let st = self.read();
        st.layers.iter().filter_map(|l| l.name.clone()).collect()
    }

    /// iROW snapshot: flushes, freezes the top layer under `name` and starts a new empty top
    /// layer. No data is copied and the merged table does not change.
    pub fn snapshot(&self, name: &str) -> Result<(), OverlayError> {
        validate_name(name)?;
        let mut st = self.write();
        check_failed(&st)?;
        if st.layers.iter().any(|l| l.name.as_deref() == Some(name)) {
            return Err(OverlayError::SnapshotExists(name.to_string()));
        }
        if st.layers.len() >= MAX_LAYERS {
            return Err(OverlayError::TooManyLayers(st.layers.len()));
        }
        self.flush_locked(&mut st)?;
        let new_id = st.next_layer_id;
        let new_top = create_layer(&self.dir, new_id, self.nblocks)?;
        let mut meta = self.meta_of(&st);
        meta.layers.last_mut().expect("top").snapshot = Some(name.to_string());
        meta.layers.push(LayerMeta {
            id: new_id,
            snapshot: None,
        });
        meta.next_layer_id = new_id + 1;
        self.commit(&mut st, &meta)?;
        st.layers.last_mut().expect("top").name = Some(name.to_string());
        st.layers.push(new_top);
        st.next_layer_id = new_id + 1;
        st.epoch += 1;
        tracing::debug!(dir = %self.dir.display(), name, layers = st.layers.len(), "overlay snapshot");
        Ok(())
    }

    /// Discards every layer above snapshot `name` — writes since it (flushed or not) and
    /// later snapshots — so reads see the image as it was at the snapshot. The snapshot
    /// itself stays, under a new empty top layer.
    pub fn rollback(&self, name: &str) -> Result<(), OverlayError> {
        let mut st = self.write();
        check_failed(&st)?;
        let k = find_snapshot(&st, name)?;
        let new_id = st.next_layer_id;
        let new_top = create_layer(&self.dir, new_id, self.nblocks)?;
        let mut meta = self.meta_of(&st);
        meta.layers.truncate(k + 1);
        meta.layers.push(LayerMeta {
            id: new_id,
            snapshot: None,
        });
        meta.next_layer_id = new_id + 1;
        self.commit(&mut st, &meta)?;
        let removed: Vec<Layer> = st.layers.drain(k + 1..).collect();
        st.layers.push(new_top);
        st.next_layer_id = new_id + 1;
        st.epoch += 1;
        st.bitmap_dirty = false;
        self.data_dirty.store(false, Ordering::SeqCst);
        let (table, held) = build_table(&st.layers, self.nblocks);
        st.table = table;
        st.held = held;
        drop(st);
        for l in removed {
            self.remove_layer_files(l);
        }
        tracing::debug!(dir = %self.dir.display(), name, "overlay rollback");
        Ok(())
    }

    /// Deletes snapshot `name`; what it and the layers above it show stays visible. Its
    /// layer is merged into the layer above: if that one is empty it adopts the snapshot's
    /// files, otherwise the blocks it lacks are copied up. Flushes first.
    pub fn delete_snapshot(&self, name: &str) -> Result<(), OverlayError> {
        let mut st = self.write();
        check_failed(&st)?;
        let k = find_snapshot(&st, name)?;
        let u = k + 1; // exists: the top layer has no name
        let top = st.layers.len() - 1;
        self.flush_locked(&mut st)?;
        let mut meta = self.meta_of(&st);
        let gone = if st.layers[u].bitmap.count() == 0 {
            // Adopt: layer k takes u's place and name; u's (empty) files go.
            meta.layers[k].snapshot = meta.layers[u].snapshot.take();
            meta.layers.remove(u);
            self.commit(&mut st, &meta)?;
            let up = st.layers.remove(u);
            st.layers[k].name = up.name.clone();
            up
        } else {
            let to_copy: Vec<u64> = {
                let upper = &st.layers[u].bitmap;
                st.layers[k]
                    .bitmap
                    .iter()
                    .filter(|&b| !upper.get(b))
                    .collect()
            };
            let mut merged = st.layers[u].bitmap.clone();
            {
                let (lower, upper) = (&st.layers[k], &st.layers[u]);
                let upath = self.dir.join(data_name(upper.id));
                let mut buf = vec![0u8; self.block_size as usize];
                for &b in &to_copy {
                    let len = self.block_len(b) as usize;
                    let pos = b * self.block_size as u64;
                    read_at_zero_fill(&lower.file, &mut buf[..len], pos).map_err(|e| {
                        OverlayError::io("read", self.dir.join(data_name(lower.id)), e)
                    })?;
                    let r = if buf[..len].iter().all(|&x| x == 0) {
                        zero_range(&upper.file, pos, len as u64)
                    } else {
                        upper.file.write_all_at(&buf[..len], pos)
                    };
                    r.map_err(|e| OverlayError::io("write", &upath, e))?;
                    merged.set(b);
                }
                if let Err(e) = upper.file.sync_data() {
                    let err = OverlayError::io("fdatasync", &upath, e);
                    st.failed = Some(err.to_string());
                    return Err(err);
                }
                // u now shows what k showed beneath it: the old manifest reads the same.
                atomic_write(&self.dir, &bitmap_name(upper.id), &merged.encode(upper.id))?;
            }
            meta.layers.remove(k);
            self.commit(&mut st, &meta)?;
            st.layers[u].bitmap = merged;
            if u == top {
                st.bitmap_dirty = false;
            }
            st.layers.remove(k)
        };
        for e in st.table.iter_mut() {
            if *e != NONE && *e as usize > k {
                *e -= 1;
            }
        }
        st.epoch += 1;
        drop(st);
        self.remove_layer_files(gone);
        tracing::debug!(dir = %self.dir.display(), name, "overlay snapshot deleted");
        Ok(())
    }

    /// After a commit made the overlay's contents a new base version: drops every layer and
    /// snapshot and starts empty over `new_base`. Also clears a failed state.
    pub fn reset(&self, new_base: &str) -> Result<(), OverlayError> {
        let mut st = self.write();
        let new_id = st.next_layer_id;
        let new_top = create_layer(&self.dir, new_id, self.nblocks)?;
        let meta = Meta {
            base: new_base.to_string(),
            next_layer_id: new_id + 1,
            layers: vec![LayerMeta {
                id: new_id,
                snapshot: None,
            }],
            ..self.meta_of(&st)
        };
        // Not `commit`: a failed overlay may reset, and a failure here keeps it failed.
        if let Err(e) = atomic_write(&self.dir, META_FILE, &meta.encode()) {
            st.failed = Some(e.to_string());
            return Err(e);
        }
        let removed = std::mem::replace(&mut st.layers, vec![new_top]);
        st.base = new_base.to_string();
        st.next_layer_id = new_id + 1;
        st.table.fill(NONE);
        st.held = 0;
        st.bitmap_dirty = false;
        st.failed = None;
        st.epoch += 1;
        self.data_dirty.store(false, Ordering::SeqCst);
        drop(st);
        for l in removed {
            self.remove_layer_files(l);
        }
        tracing::debug!(dir = %self.dir.display(), new_base, "overlay reset");
        Ok(())
    }
}

fn validate_name(name: &str) -> Result<(), OverlayError> {
    let bad = |reason| {
        Err(OverlayError::InvalidName {
            name: name.to_string(),
            reason,
        })
    };
    if name.is_empty() {
        return bad("empty");
    }
    if name.len() > 255 {
        return bad("longer than 255 bytes");
    }
    if name.chars().any(char::is_control) {
        return bad("contains control characters");
    }
    Ok(())
}

fn find_snapshot(st: &State, name: &str) -> Result<usize, OverlayError> {
    st.layers
        .iter()
        .position(|l| l.name.as_deref() == Some(name))
        .ok_or_else(|| OverlayError::NoSuchSnapshot(name.to_string()))
}

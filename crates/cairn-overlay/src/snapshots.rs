//! iROW snapshots of the overlay, as a tree: freeze the writable layer, roll back to any
//! snapshot (branching, the other branches kept), delete a snapshot, or start over on a new
//! base. The manifest write is each operation's commit point (see the crate docs for the order
//! of file operations).
//!
//! None of them copies data or walks the image: create writes one empty layer, rollback
//! recomputes the merged table only for the blocks the layers it leaves and enters hold, and
//! delete marks the layer deleted (iROW's virtual deletion). What a deleted layer holds that
//! every layer above it also holds can never be read again, so it is reclaimed at once by
//! bitmap operations (punched out of its data file); a deleted layer nothing reads through
//! any more goes, and one with a single layer above is merged with it, copying the smaller of
//! the two (bounded by what was written since the snapshot, not by the image).

use std::collections::HashSet;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;

use crate::bitmap::Bitmap;
use crate::fsutil::{atomic_write, read_at_zero_fill, zero_range};
use crate::layer_files::{bitmap_name, create_layer, data_name};
use crate::{check_failed, Overlay, OverlayError, State, NONE};

/// One snapshot of the tree, for listings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotInfo {
    pub name: String,
    /// The snapshot this one was taken on top of (its nearest snapshot ancestor that is not
    /// deleted); `None` if it sits on the base.
    pub parent: Option<String>,
    /// Whether the writable layer reads through it (it is an ancestor of the current state).
    pub current_path: bool,
    /// Blocks its own layer holds (written between its parent snapshot and it).
    pub blocks: u64,
}

impl Overlay {
    /// Snapshot names, oldest first (a parent always before its children).
    pub fn snapshots(&self) -> Vec<String> {
        self.snapshot_tree().into_iter().map(|s| s.name).collect()
    }

    /// The snapshot tree, oldest first (a parent always before its children).
    pub fn snapshot_tree(&self) -> Vec<SnapshotInfo> {
        let st = self.read();
        let on_path: HashSet<usize> = st.path_from(st.current).into_iter().collect();
        let mut out: Vec<(u64, SnapshotInfo)> = st
            .slots()
            .filter_map(|s| {
                let l = st.layer(s);
                let name = l.name.clone()?;
                let mut p = l.parent;
                while let Some(ps) = p {
                    if !st.layer(ps).deleted {
                        break;
                    }
                    p = st.layer(ps).parent;
                }
                Some((
                    l.id,
                    SnapshotInfo {
                        name,
                        parent: p.and_then(|ps| st.layer(ps).name.clone()),
                        current_path: on_path.contains(&s),
                        blocks: l.bitmap.count(),
                    },
                ))
            })
            .collect();
        out.sort_by_key(|(id, _)| *id);
        out.into_iter().map(|(_, s)| s).collect()
    }

    /// iROW snapshot: flushes, freezes the writable layer under `name` and starts a new empty
    /// writable layer on it. No data is copied and the merged table does not change.
    pub fn snapshot(&self, name: &str) -> Result<(), OverlayError> {
        validate_name(name)?;
        let mut st = self.write();
        check_failed(&st)?;
        if find_snapshot(&st, name).is_ok() {
            return Err(OverlayError::SnapshotExists(name.to_string()));
        }
        st.has_room()?;
        self.flush_locked(&mut st)?;
        let new_id = st.next_layer_id;
        let mut new_top = create_layer(&self.dir, new_id, self.nblocks)?;
        new_top.parent = Some(st.current);
        let mut meta = self.meta_of(&st);
        let old_top_id = st.top().id;
        meta.layers
            .iter_mut()
            .find(|l| l.id == old_top_id)
            .expect("listed")
            .snapshot = Some(name.to_string());
        meta.layers.push(crate::meta::LayerMeta {
            id: new_id,
            parent: Some(old_top_id),
            snapshot: None,
            deleted: false,
        });
        meta.current = new_id;
        meta.next_layer_id = new_id + 1;
        self.commit(&mut st, &meta)?;
        let old = st.current;
        st.layer_mut(old).name = Some(name.to_string());
        st.current = st.insert(new_top);
        st.next_layer_id = new_id + 1;
        st.epoch += 1;
        tracing::debug!(dir = %self.dir.display(), name, "overlay snapshot");
        Ok(())
    }

    /// Discards the writes made since the last snapshot (flushed or not) and makes snapshot
    /// `name` the state reads see, under a new empty writable layer. Every snapshot stays:
    /// those taken after `name` on the way here become a branch that a later rollback can
    /// return to. Its work is bounded by the blocks of the layers it leaves and enters.
    pub fn rollback(&self, name: &str) -> Result<(), OverlayError> {
        let mut st = self.write();
        check_failed(&st)?;
        let k = find_snapshot(&st, name)?;
        let new_id = st.next_layer_id;
        let mut new_top = create_layer(&self.dir, new_id, self.nblocks)?;
        new_top.parent = Some(k);
        let old_top = st.current;
        let old_top_id = st.top().id;
        let mut meta = self.meta_of(&st);
        meta.layers.retain(|l| l.id != old_top_id);
        meta.layers.push(crate::meta::LayerMeta {
            id: new_id,
            parent: Some(st.layer(k).id),
            snapshot: None,
            deleted: false,
        });
        meta.current = new_id;
        meta.next_layer_id = new_id + 1;
        self.commit(&mut st, &meta)?;

        // The blocks whose holder may change: those of the layers left and entered.
        let old_path = st.path_from(old_top);
        let new_below = st.path_from(k);
        let entered: HashSet<usize> = new_below.iter().copied().collect();
        let left: Vec<usize> = old_path
            .iter()
            .copied()
            .filter(|s| !entered.contains(s))
            .collect();
        let common: HashSet<usize> = old_path.iter().copied().collect();
        let moved: Vec<usize> = left
            .iter()
            .copied()
            .chain(new_below.iter().copied().filter(|s| !common.contains(s)))
            .collect();
        let old_parent = st.layer(old_top).parent;
        let removed = st.layers[old_top].take().expect("the writable layer");
        st.current = st.insert(new_top);
        st.next_layer_id = new_id + 1;
        st.epoch += 1;
        st.bitmap_dirty = false;
        self.data_dirty.store(false, Ordering::SeqCst);
        // Each block of a layer left or entered (a block of two of them is simply seen twice).
        let mut table = std::mem::take(&mut st.table);
        let mut held = st.held as i64;
        let mut recomputed = 0u64;
        for &s in &moved {
            let bitmap = match s == old_top {
                true => &removed.bitmap,
                false => &st.layer(s).bitmap,
            };
            for b in bitmap.iter() {
                let after = st.holder_on(&new_below, b);
                let e = &mut table[b as usize];
                held += i64::from(after != NONE) - i64::from(*e != NONE);
                *e = after;
                recomputed += 1;
            }
        }
        st.table = table;
        st.held = held as u64;
        self.remove_layer_files(removed);
        if let Some(p) = old_parent {
            self.tidy(&mut st, p)?;
        }
        tracing::debug!(dir = %self.dir.display(), name, blocks = recomputed, "overlay rollback");
        Ok(())
    }

    /// Deletes snapshot `name`; what the layers above it show stays the same. A snapshot
    /// nothing sits on goes at once; one that others read through is marked deleted (iROW's
    /// virtual deletion) and tidied: what every layer above holds is reclaimed, and a single
    /// layer above is merged with it. Flushes first.
    pub fn delete_snapshot(&self, name: &str) -> Result<(), OverlayError> {
        let mut st = self.write();
        check_failed(&st)?;
        let k = find_snapshot(&st, name)?;
        self.flush_locked(&mut st)?;
        let mut meta = self.meta_of(&st);
        let id = st.layer(k).id;
        let entry = meta.layers.iter_mut().find(|l| l.id == id).expect("listed");
        entry.snapshot = None;
        entry.deleted = true;
        self.commit(&mut st, &meta)?;
        let l = st.layer_mut(k);
        l.name = None;
        l.deleted = true;
        st.epoch += 1;
        self.tidy(&mut st, k)?;
        tracing::debug!(dir = %self.dir.display(), name, "overlay snapshot deleted");
        Ok(())
    }

    /// Tidies deleted layer `slot` (and, when it goes, its deleted ancestors): one no layer
    /// sits on goes; of one that others sit on, the blocks all of them hold are reclaimed, and
    /// if only one sits on it the two are merged.
    pub(crate) fn tidy(&self, st: &mut State, mut slot: usize) -> Result<(), OverlayError> {
        // Reclaiming trusts the layers above: their bits must be on disk before a block below
        // them is punched out.
        self.flush_locked(st)?;
        loop {
            if !st.layer(slot).deleted {
                return Ok(());
            }
            let children = st.children(slot);
            if children.is_empty() {
                let parent = st.layer(slot).parent;
                let mut meta = self.meta_of(st);
                let id = st.layer(slot).id;
                meta.layers.retain(|l| l.id != id);
                self.commit(st, &meta)?;
                let gone = st.layers[slot].take().expect("in use");
                st.epoch += 1;
                self.remove_layer_files(gone);
                match parent {
                    Some(p) => {
                        slot = p;
                        continue;
                    }
                    None => return Ok(()),
                }
            }
            self.reclaim_hidden(st, slot, &children)?;
            match children[..] {
                // The merged layer may itself be a deleted one: tidy it in turn.
                [only] => slot = self.merge(st, slot, only)?,
                _ => return Ok(()),
            }
        }
    }

    /// Drops from deleted layer `slot` the blocks every layer on it holds: nothing can read
    /// them any more. The bitmap goes first, then the data is punched out.
    fn reclaim_hidden(
        &self,
        st: &mut State,
        slot: usize,
        children: &[usize],
    ) -> Result<(), OverlayError> {
        let mut hidden =
            Bitmap::intersection(&st.layer(slot).bitmap, &st.layer(children[0]).bitmap);
        for &c in &children[1..] {
            hidden.intersect_with(&st.layer(c).bitmap);
        }
        if hidden.count() == 0 {
            return Ok(());
        }
        let layer = st.layer_mut(slot);
        layer.bitmap.subtract(&hidden);
        if let Err(e) = atomic_write(
            &self.dir,
            &bitmap_name(layer.id),
            &layer.bitmap.encode(layer.id),
        ) {
            layer.bitmap.union_with(&hidden);
            return Err(e);
        }
        let bs = self.block_size as u64;
        // One punch across runs with only holes between them (blocks the layer never held
        // read as holes already): a layer written over whole is freed in one call.
        let mut spans: Vec<(u64, u64)> = Vec::new();
        for (first, n) in hidden.runs() {
            match spans.last_mut() {
                Some((start, end)) if !layer.bitmap.any_in(*end, first) => *end = first + n,
                _ => spans.push((first, first + n)),
            }
        }
        // Nothing reads these blocks any more, so they are punched out in the background (a
        // merge into this layer waits for it: `settle_layer`).
        let (id, size, dir) = (layer.id, self.size, self.dir.clone());
        match layer.file.try_clone() {
            Ok(file) => self.in_background(Some(id), move || {
                for (start, end) in spans {
                    let pos = start * bs;
                    let len = ((end - start) * bs).min(size - pos);
                    if let Err(e) = zero_range(&file, pos, len) {
                        // Only space is lost: the blocks are no longer listed.
                        tracing::warn!(dir = %dir.display(), error = %e, "cannot punch out reclaimed overlay blocks");
                        break;
                    }
                }
            }),
            Err(e) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "cannot punch out reclaimed overlay blocks")
            }
        }
        tracing::debug!(dir = %self.dir.display(), blocks = hidden.count(), "reclaimed hidden blocks of a deleted snapshot");
        Ok(())
    }

    /// Merges deleted layer `lower` with `upper`, the one layer on it, copying the smaller:
    /// an empty `lower` just goes; otherwise `upper`'s blocks move down into `lower`, which
    /// takes `upper`'s place, or `lower`'s blocks that `upper` lacks move up.
    /// Returns the slot of the layer that stays.
    fn merge(&self, st: &mut State, lower: usize, upper: usize) -> Result<usize, OverlayError> {
        let (lower_n, upper_n) = (
            st.layer(lower).bitmap.count(),
            st.layer(upper).bitmap.count(),
        );
        let (from, into, blocks) = if lower_n == 0 {
            (lower, upper, Bitmap::new(self.nblocks))
        } else if upper_n <= lower_n {
            (upper, lower, st.layer(upper).bitmap.clone())
        } else {
            let mut b = st.layer(lower).bitmap.clone();
            b.subtract(&st.layer(upper).bitmap);
            (lower, upper, b)
        };
        // Copy into `into` where nothing reads yet (blocks `upper` hides, or that `upper`
        // lacks and will only show once its bitmap lists them), then list them; not before
        // blocks being punched out of it are.
        if blocks.count() > 0 {
            self.settle_layer(st.layer(into).id);
        }
        self.copy_blocks(st, from, into, &blocks)?;
        if blocks.count() > 0 {
            let l = st.layer_mut(into);
            l.bitmap.union_with(&blocks);
            // Until the manifest says otherwise, `into`'s new blocks are ones nothing reads
            // (see above), so listing them in memory already is harmless.
            atomic_write(&self.dir, &bitmap_name(l.id), &l.bitmap.encode(l.id))?;
        }
        // The layer that stays takes the place of `upper`: its name, its children, and the
        // writable role; it sits where `lower` sat.
        let (from_id, into_id) = (st.layer(from).id, st.layer(into).id);
        let (upper_name, upper_deleted) = (st.layer(upper).name.clone(), st.layer(upper).deleted);
        let lower_parent = st.layer(lower).parent;
        let mut meta = self.meta_of(st);
        meta.layers.retain(|l| l.id != from_id);
        let lower_parent_id = lower_parent.map(|p| st.layer(p).id);
        for l in &mut meta.layers {
            if l.id == into_id {
                l.snapshot = upper_name.clone();
                l.deleted = upper_deleted;
                l.parent = lower_parent_id;
            } else if l.parent == Some(from_id) {
                l.parent = Some(into_id);
            }
        }
        if meta.current == from_id {
            meta.current = into_id;
        }
        self.commit(st, &meta)?;

        let children = st.children(from);
        for c in children.into_iter().filter(|&c| c != into) {
            st.layer_mut(c).parent = Some(into);
        }
        if st.current == from {
            st.current = into;
        }
        let from_bits = st.layer(from).bitmap.clone();
        for b in from_bits.iter() {
            if st.table[b as usize] == from as u16 {
                st.table[b as usize] = into as u16;
            }
        }
        let l = st.layer_mut(into);
        l.name = upper_name;
        l.deleted = upper_deleted;
        l.parent = lower_parent;
        let gone = st.layers[from].take().expect("in use");
        st.epoch += 1;
        self.remove_layer_files(gone);
        tracing::debug!(dir = %self.dir.display(), copied = blocks.count(), "merged a deleted snapshot");
        Ok(into)
    }

    /// Copies `blocks` from layer `from`'s data file into layer `into`'s, then syncs it.
    fn copy_blocks(
        &self,
        st: &mut State,
        from: usize,
        into: usize,
        blocks: &Bitmap,
    ) -> Result<(), OverlayError> {
        if blocks.count() == 0 {
            return Ok(());
        }
        let (src, dst) = (st.layer(from), st.layer(into));
        let dpath = self.dir.join(data_name(dst.id));
        let mut buf = vec![0u8; self.block_size as usize];
        for b in blocks.iter() {
            let len = self.block_len(b) as usize;
            let pos = b * self.block_size as u64;
            read_at_zero_fill(&src.file, &mut buf[..len], pos)
                .map_err(|e| OverlayError::io("read", self.dir.join(data_name(src.id)), e))?;
            let r = if buf[..len].iter().all(|&x| x == 0) {
                zero_range(&dst.file, pos, len as u64)
            } else {
                dst.file.write_all_at(&buf[..len], pos)
            };
            r.map_err(|e| OverlayError::io("write", &dpath, e))?;
        }
        if let Err(e) = dst.file.sync_data() {
            let err = OverlayError::io("fdatasync", &dpath, e);
            st.failed = Some(err.to_string());
            return Err(err);
        }
        Ok(())
    }

    /// After a commit made the overlay's contents a new base version: drops every layer and
    /// snapshot and starts empty over `new_base`. Also clears a failed state.
    pub fn reset(&self, new_base: &str) -> Result<(), OverlayError> {
        let mut st = self.write();
        let new_id = st.next_layer_id;
        let new_top = create_layer(&self.dir, new_id, self.nblocks)?;
        let meta = crate::meta::Meta {
            base: new_base.to_string(),
            next_layer_id: new_id + 1,
            current: new_id,
            layers: vec![crate::meta::LayerMeta {
                id: new_id,
                parent: None,
                snapshot: None,
                deleted: false,
            }],
            ..self.meta_of(&st)
        };
        // Not `commit`: a failed overlay may reset, and a failure here keeps it failed.
        if let Err(e) = atomic_write(&self.dir, crate::META_FILE, &meta.encode()) {
            st.failed = Some(e.to_string());
            return Err(e);
        }
        let removed = std::mem::replace(&mut st.layers, vec![Some(new_top)]);
        st.current = 0;
        st.base = new_base.to_string();
        st.next_layer_id = new_id + 1;
        st.table.fill(NONE);
        st.held = 0;
        st.bitmap_dirty = false;
        st.failed = None;
        st.epoch += 1;
        self.data_dirty.store(false, Ordering::SeqCst);
        drop(st);
        for l in removed.into_iter().flatten() {
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

/// The slot of the snapshot named `name` (deleted ones have no name).
fn find_snapshot(st: &State, name: &str) -> Result<usize, OverlayError> {
    st.slots()
        .find(|&s| st.layer(s).name.as_deref() == Some(name))
        .ok_or_else(|| OverlayError::NoSuchSnapshot(name.to_string()))
}

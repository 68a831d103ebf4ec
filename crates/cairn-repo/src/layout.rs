//! Layout markers: which packs `cairn relayout` wrote.
//!
//! A relayout stores second copies of a version's most scattered groups (same ids, same
//! bytes) side by side, in the order a restore of the version reads them, and marks each
//! pack it writes with an empty object `layout/<pack>/<time>`. Where a group has several
//! copies, readers ([`crate::v2::V2Reader::locate_group_storing`]) and GC prefer the copy in
//! a marked pack, the latest relayout's first (a time, unlike the order of index runs, stays
//! the same when runs are merged), so the new layout is what restores read and what GC
//! keeps; the other copies become dead bytes in their packs, given back when GC repacks
//! them. A marker is advisory in both directions (a wrong or missing one only moves which
//! copy is read), so GC deletes the markers of packs that are gone, and a reader that cannot
//! list them reads any copy.

use std::collections::HashMap;

use bytes::Bytes;
use cairn_format::{keys, Id};

use crate::error::RepoResult;
use crate::repository::Repo;

impl Repo {
    /// Marks `pack` as laid out at `time` (ns; a relayout's start, or the latest of the
    /// layout copies a GC repacked into it): after the pack is stored, before the index run
    /// that names it (a marker whose pack no run names is a leftover GC deletes).
    pub async fn put_layout_marker(&self, pack: &Id, time: u64) -> RepoResult<()> {
        self.store()
            .put_if_absent(&keys::layout(pack, time), Bytes::new())
            .await?;
        if let Some(reader) = self.v2() {
            reader.add_layout_pack(*pack, time);
        }
        Ok(())
    }

    /// Every layout marker, as (pack, time).
    pub async fn layout_markers(&self) -> RepoResult<Vec<(Id, u64)>> {
        list_layout_markers(self.store().as_ref()).await
    }

    /// The packs layout markers name, each with its latest time.
    pub async fn layout_packs(&self) -> RepoResult<HashMap<Id, u64>> {
        Ok(latest(self.layout_markers().await?))
    }

    /// Removes a marker of a pack that is gone.
    pub async fn delete_layout_marker(&self, pack: &Id, time: u64) -> RepoResult<()> {
        self.store().delete(&keys::layout(pack, time)).await?;
        Ok(())
    }
}

/// The layout markers in `store` (keys that name none are skipped).
pub(crate) async fn list_layout_markers(
    store: &dyn cairn_store::ObjectStore,
) -> RepoResult<Vec<(Id, u64)>> {
    Ok(store
        .list_keys(keys::LAYOUT)
        .await?
        .iter()
        .filter_map(|key| keys::parse_layout(key))
        .collect())
}

/// Each pack's latest marker time.
pub(crate) fn latest(markers: Vec<(Id, u64)>) -> HashMap<Id, u64> {
    let mut packs = HashMap::new();
    for (pack, time) in markers {
        let t = packs.entry(pack).or_insert(time);
        *t = (*t).max(time);
    }
    packs
}

//! What a GC run counts as live: the index as GC read it (`Snapshot`), and the marks of
//! every group slot and manifest node live versions use — exact (`Marks`, from walking every
//! live tree) or a superset (the live trees' reference summaries) behind one trait.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use cairn_format::group_summary::GroupSummary;
use cairn_format::leaf_v2::RunLeaf;
use cairn_format::pack::BlobKind;
use cairn_format::slots::SlotSet;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::tree_walk::{walk_tree, GroupedTreeNodes, NodeReader};
use cairn_repo::v2::{PackTrailer, V2Reader};
use cairn_repo::{Repo, RepoError};

use super::unreadable_live_tree;
use crate::error::{EngineError, EngineResult};

/// What GC read of the index: every run in the store (pending plans ignored: GC must see
/// everything), and the trailer of every pack they name that exists.
pub(super) struct Snapshot {
    pub(super) reader: V2Reader,
    pub(super) runs: Vec<Id>,
    /// Packs some run names (whether they exist or not), each with the position of the
    /// first run naming it (`V2Reader::packs_by_run`).
    pub(super) named: HashMap<Id, usize>,
    pub(super) trailers: BTreeMap<Id, Arc<PackTrailer>>,
    /// Packs a relayout wrote (`cairn_repo::layout`), with their times: their copies are the
    /// ones kept, the latest first.
    pub(super) layout: HashMap<Id, u64>,
}

impl Snapshot {
    /// Reads every run's meta; a damaged run fails it.
    pub(super) async fn load(repo: &Repo) -> EngineResult<Snapshot> {
        let (reader, _) = repo.v2_view_all().await.map_err(|e| match e {
            RepoError::IndexDamaged(damaged) => incomplete(damaged),
            e => e.into(),
        })?;
        let runs = reader.run_ids();
        // A pack table that cannot be read stops GC like a damaged run: a pack it names must
        // not pass for one no run names.
        let named = match reader.packs_by_run().await {
            Ok(packs) => packs,
            Err(e) if e.is_damage() => return Err(incomplete(e.to_string())),
            Err(e) => return Err(e.into()),
        };
        let layout = repo.layout_packs().await?;
        Ok(Snapshot {
            reader,
            runs,
            named,
            trailers: BTreeMap::new(),
            layout,
        })
    }

    /// Reads the trailer of every named pack that exists (in `pack_sizes`), or of those in
    /// `only`; a damaged one fails it (a missing one holds nothing to keep: verify reports
    /// it).
    pub(super) async fn read_trailers(
        &mut self,
        pack_sizes: &HashMap<Id, u64>,
        only: Option<&HashSet<Id>>,
    ) -> EngineResult<()> {
        let mut named: Vec<Id> = self
            .named
            .keys()
            .filter(|p| only.is_none_or(|o| o.contains(*p)))
            .copied()
            .collect();
        named.sort();
        for pack in named.iter().filter(|p| pack_sizes.contains_key(*p)) {
            crate::interrupt::check()?;
            let trailer = self.reader.trailer(pack).await.map_err(|e| match e {
                e if e.is_damage() => incomplete(e.to_string()),
                e => e.into(),
            })?;
            self.trailers.insert(*pack, trailer);
        }
        Ok(())
    }
}

/// GC refuses to act on a partial view of the index.
pub(super) fn incomplete(damage: String) -> EngineError {
    EngineError::Gc(format!(
        "{damage}; gc acts only on a complete index: run `cairn repair`, which rebuilds it from \
         the packs; nothing was deleted"
    ))
}

/// What the live versions use, as GC asks it: exactly (marks from walking the trees) or as
/// the reference summaries say (a superset: a false "used" keeps something dead).
pub(super) trait Liveness {
    fn node_used(&self, id: &Id) -> bool;
    /// The slots of data group `id` that are used (`None`: none).
    fn used_slots(&self, group: &Id) -> Option<Cow<'_, SlotSet>>;

    /// The used slots of group `g` of `trailer` (`None` for a node group: used whole).
    fn live_slots(&self, trailer: &PackTrailer, g: u32) -> Option<SlotSet> {
        match trailer.groups[g as usize].kind {
            BlobKind::Node => None,
            BlobKind::Data => {
                let gid = trailer.group_id(g).expect("a group of this trailer");
                Some(
                    self.used_slots(&gid)
                        .map(Cow::into_owned)
                        .unwrap_or_default(),
                )
            }
        }
    }
}

impl Liveness for Marks {
    fn node_used(&self, id: &Id) -> bool {
        self.nodes.contains(id)
    }
    fn used_slots(&self, group: &Id) -> Option<Cow<'_, SlotSet>> {
        self.slots.get(group).map(Cow::Borrowed)
    }
}

impl Liveness for GroupSummary {
    fn node_used(&self, id: &Id) -> bool {
        self.has_node(id)
    }
    fn used_slots(&self, group: &Id) -> Option<Cow<'_, SlotSet>> {
        self.slots(group)
    }
}

/// What a set of versions uses: manifest nodes, and slots of groups.
#[derive(Default)]
pub(super) struct Marks {
    pub(super) nodes: HashSet<Id>,
    pub(super) slots: HashMap<Id, SlotSet>,
}

impl Marks {
    /// Marks every node of `record`'s tree and every group slot its leaves name, reading each
    /// node once (through `reader`: checked against its id).
    pub(super) async fn mark_version(
        &mut self,
        reader: &V2Reader,
        record: &VersionRecord,
        bytes_read: &mut u64,
    ) -> EngineResult<()> {
        let Some(root) = record.root else {
            return Ok(());
        };
        let mut nodes = Nodes { reader, bytes_read };
        let mut visitor = GroupedTreeNodes {
            nodes: std::mem::take(&mut self.nodes),
            ..Default::default()
        };
        let walked = walk_tree(&mut nodes, root, record.height, record.fanout, &mut visitor).await;
        self.nodes = visitor.nodes;
        walked.map_err(|e| unreadable_live_tree(record, e))?;
        for leaf in visitor.leaves {
            let raw = nodes
                .read_node(&leaf)
                .await
                .map_err(|e| unreadable_live_tree(record, e))?;
            let leaf = RunLeaf::decode(&raw).map_err(|e| {
                unreadable_live_tree(
                    record,
                    RepoError::corrupt(format!("manifest node {leaf}"), e).into(),
                )
            })?;
            for (group, first, count) in leaf.group_runs() {
                self.slots
                    .entry(group)
                    .or_default()
                    .insert_run(first, count);
            }
        }
        Ok(())
    }
}

/// Reads manifest nodes through the repository's reader, counting the bytes.
pub(super) struct Nodes<'a> {
    pub(super) reader: &'a V2Reader,
    pub(super) bytes_read: &'a mut u64,
}

impl NodeReader for Nodes<'_> {
    type Error = EngineError;
    async fn read_node(&mut self, id: &Id) -> EngineResult<Vec<u8>> {
        crate::interrupt::check()?;
        let raw = self.reader.read_chunk(id).await?;
        *self.bytes_read += raw.len() as u64;
        Ok(raw.to_vec())
    }
}

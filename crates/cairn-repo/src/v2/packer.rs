//! Packing a commit's new chunks into groups and packs (format v2): chunks go into the open
//! group in the order the commit meets them (neighbours on disk stay neighbours in a group,
//! which is what a later read of the same region wants), a group closes at its size limit and
//! goes into the open pack, a pack closes at its size limit and is handed back to be stored.
//! Manifest nodes are groups of one chunk of kind node, in the same packs.
//!
//! A chunk's place (its group id and slot) is known when its group closes; the leaf builder
//! asks for it by the ticket `push` returned. A caller that builds and compresses groups
//! itself (the commit's workers, several at once) hands them over finished
//! ([`GroupPacker::push_group`]).

use std::collections::{HashMap, HashSet};

use cairn_format::config::Compression;
use cairn_format::crypto::MasterKey;
use cairn_format::group::{group_id, Group, GroupBuilder};
use cairn_format::pack::BlobKind;
use cairn_format::pack_v2::PackWriter;
use cairn_format::Id;

/// Where a chunk is stored: slot `slot` of group `group`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub group: Id,
    pub slot: u16,
}

/// A finished pack to store, and the ids (chunks, nodes, groups) the index run must name for
/// it once it is stored under its final id.
#[derive(Debug)]
pub struct FinishedPack {
    pub id: Id,
    pub bytes: Vec<u8>,
    pub ids: Vec<Id>,
}

/// Packs chunks into groups and groups into packs.
pub struct GroupPacker {
    key: Option<MasterKey>,
    compression: Compression,
    group_limit: usize,
    pack_limit: usize,
    group: GroupBuilder,
    /// Tickets of the chunks in the open group, by slot.
    group_tickets: Vec<usize>,
    pack: PackWriter,
    pack_ids: Vec<Id>,
    /// Per ticket, where the chunk went (`None` while its group is open).
    placements: Vec<Option<Placement>>,
    tickets: HashMap<Id, usize>,
    nodes: HashSet<Id>,
}

/// Bytes to reserve for a pack: the limit, the group that crosses it and the trailer of
/// chunks of 4 KiB (37 bytes each; a pack of smaller stored chunks reserves the rest when it
/// closes).
fn pack_capacity(pack_limit: usize, group_limit: usize) -> usize {
    pack_limit + group_limit + pack_limit / 4096 * 40 + 4096
}

impl GroupPacker {
    /// A packer of groups of up to `group_limit` plain bytes in packs of about `pack_limit`
    /// stored bytes, sealed under `key` if there is one.
    pub fn new(
        key: Option<MasterKey>,
        compression: Compression,
        group_limit: usize,
        pack_limit: usize,
    ) -> GroupPacker {
        GroupPacker {
            pack: PackWriter::with_capacity(key.is_some(), pack_capacity(pack_limit, group_limit)),
            key,
            compression,
            group_limit,
            pack_limit,
            group: GroupBuilder::new(group_limit),
            group_tickets: Vec::new(),
            pack_ids: Vec::new(),
            placements: Vec::new(),
            tickets: HashMap::new(),
            nodes: HashSet::new(),
        }
    }

    /// Adds chunk `id` (whose plain bytes are `data`) and returns its ticket (the earlier
    /// ticket if the chunk was pushed before) and a pack to store if one filled up.
    pub fn push(&mut self, id: Id, data: &[u8]) -> (usize, Option<FinishedPack>) {
        if let Some(&ticket) = self.tickets.get(&id) {
            return (ticket, None);
        }
        let mut full = None;
        if self.group.is_full_for(data.len()) {
            full = self.close_group();
        }
        let ticket = self.placements.len();
        self.placements.push(None);
        self.tickets.insert(id, ticket);
        self.group.push(id, data);
        self.group_tickets.push(ticket);
        (ticket, full)
    }

    /// Adds a group built elsewhere (finished: compressed, sealed if the packer seals) and
    /// returns its id and a pack to store if one filled up.
    pub fn push_group(&mut self, group: Group) -> (Id, Option<FinishedPack>) {
        let gid = group_id(&group.desc.chunks, self.key.as_ref());
        self.pack_ids.push(gid);
        self.pack_ids.extend(group.desc.chunks.iter().map(|c| c.id));
        self.pack.push(BlobKind::Data, group);
        (gid, self.close_pack_if_full())
    }

    /// Adds a manifest node (a group of its own) and returns a pack to store if one filled.
    pub fn push_node(&mut self, id: Id, data: &[u8]) -> Option<FinishedPack> {
        if !self.nodes.insert(id) {
            return None;
        }
        let mut b = GroupBuilder::new(data.len());
        b.push(id, data);
        let group = b.finish(self.compression, self.key.as_ref());
        self.pack_ids.push(id);
        self.pack.push(BlobKind::Node, group);
        self.close_pack_if_full()
    }

    /// Where the chunk of `ticket` is stored, once its group is closed.
    pub fn placement(&self, ticket: usize) -> Option<Placement> {
        self.placements.get(ticket).copied().flatten()
    }

    /// Closes the open group (and the pack, if that fills it).
    pub fn close_group(&mut self) -> Option<FinishedPack> {
        if self.group.is_empty() {
            return None;
        }
        let builder = std::mem::replace(&mut self.group, GroupBuilder::new(self.group_limit));
        let group = builder.finish(self.compression, self.key.as_ref());
        let tickets = std::mem::take(&mut self.group_tickets);
        let (gid, full) = self.push_group(group);
        for (slot, ticket) in tickets.into_iter().enumerate() {
            self.placements[ticket] = Some(Placement {
                group: gid,
                slot: slot as u16,
            });
        }
        full
    }

    fn close_pack_if_full(&mut self) -> Option<FinishedPack> {
        if self.pack.len() >= self.pack_limit {
            self.close_pack()
        } else {
            None
        }
    }

    fn close_pack(&mut self) -> Option<FinishedPack> {
        if self.pack.is_empty() {
            return None;
        }
        let room = pack_capacity(self.pack_limit, self.group_limit);
        let writer = std::mem::replace(
            &mut self.pack,
            PackWriter::with_capacity(self.key.is_some(), room),
        );
        let (id, bytes, _) = writer.finish(self.key.as_ref());
        Some(FinishedPack {
            id,
            bytes,
            ids: std::mem::take(&mut self.pack_ids),
        })
    }

    /// Closes the open group and pack: the last pack to store, if any. Every ticket has its
    /// placement afterwards.
    pub fn finish(&mut self) -> Option<FinishedPack> {
        let full = self.close_group();
        debug_assert!(full.is_none() || self.pack.is_empty());
        full.or_else(|| self.close_pack())
    }
}

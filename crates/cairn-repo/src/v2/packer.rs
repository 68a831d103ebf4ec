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
//!
//! A pack is written as it fills, into a file the store publishes without copying it when
//! the store can (a local repository: [`ObjectStore::stage`]), else into memory; a commit
//! that keeps several packs uploading at once then holds none of them in memory.

use std::collections::{HashMap, HashSet};
use std::io::BufWriter;

use cairn_format::config::Compression;
use cairn_format::crypto::MasterKey;
use cairn_format::group::{group_id, Group, GroupBuilder};
use cairn_format::pack::BlobKind;
use cairn_format::pack_v2::PackWriter;
use cairn_format::Id;
use cairn_store::StagedFile;

use crate::RepoResult;

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
    pub bytes: PackBytes,
    pub ids: Vec<Id>,
}

/// Where a finished pack's bytes are.
#[derive(Debug)]
pub enum PackBytes {
    Memory(Vec<u8>),
    /// In a staged file of the store, to publish as it is ([`crate::Repo::put_pack`]).
    Staged(StagedFile),
}

impl From<Vec<u8>> for PackBytes {
    fn from(bytes: Vec<u8>) -> PackBytes {
        PackBytes::Memory(bytes)
    }
}

/// Makes a fresh staged file for a pack, or says the store has none (`None`).
pub type Stager = Box<dyn FnMut() -> RepoResult<Option<StagedFile>> + Send>;

/// Appends of a staged pack go out in pieces of this size (groups are ~64 KiB, nodes less).
const STAGED_BUFFER: usize = 256 << 10;

/// A pack being filled: in a staged file when the store gave one, else in memory.
pub enum OpenPack {
    Memory(PackWriter),
    Staged(PackWriter<BufWriter<StagedFile>>),
}

impl OpenPack {
    /// A pack written into `staged` if there is one, else into memory (room reserved for
    /// `capacity` bytes).
    pub fn new(
        staged: Option<StagedFile>,
        key: Option<&MasterKey>,
        capacity: usize,
    ) -> RepoResult<OpenPack> {
        Ok(match staged {
            Some(file) => {
                let error = file.errors();
                let out = BufWriter::with_capacity(STAGED_BUFFER, file);
                OpenPack::Staged(PackWriter::to_writer(out, key).map_err(|e| error("write", e))?)
            }
            None => OpenPack::Memory(PackWriter::with_capacity(key, capacity)),
        })
    }

    /// Bytes of groups so far.
    pub fn len(&self) -> usize {
        match self {
            OpenPack::Memory(w) => w.len(),
            OpenPack::Staged(w) => w.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        match self {
            OpenPack::Memory(w) => w.is_empty(),
            OpenPack::Staged(w) => w.is_empty(),
        }
    }

    /// Appends a finished group.
    pub fn push(&mut self, kind: BlobKind, group: Group) -> RepoResult<()> {
        match self {
            OpenPack::Memory(w) => w.push(kind, group),
            OpenPack::Staged(w) => w
                .try_push(kind, group)
                .map_err(|e| w.writer().get_ref().error("write", e))?,
        }
        Ok(())
    }

    /// Closes the pack: its id and bytes, to store with [`crate::Repo::put_pack`].
    pub fn finish(self) -> RepoResult<(Id, PackBytes)> {
        Ok(match self {
            OpenPack::Memory(w) => {
                let (id, bytes, _) = w.finish();
                (id, PackBytes::Memory(bytes))
            }
            OpenPack::Staged(w) => {
                let error = w.writer().get_ref().errors();
                let (id, out, _) = w.try_finish().map_err(|e| error("write", e))?;
                let file = out
                    .into_inner()
                    .map_err(|e| error("write", e.into_error()))?;
                (id, PackBytes::Staged(file))
            }
        })
    }
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
    /// The pack being filled, opened by the first group it gets.
    pack: Option<OpenPack>,
    stager: Option<Stager>,
    pack_ids: Vec<Id>,
    /// Per ticket, where the chunk went (`None` while its group is open).
    placements: Vec<Option<Placement>>,
    tickets: HashMap<Id, usize>,
    nodes: HashSet<Id>,
}

/// Bytes to reserve for a pack: the limit, the group that crosses it and the trailer of
/// chunks of 4 KiB (37 bytes each; a pack of smaller stored chunks reserves the rest when it
/// closes).
pub fn pack_capacity(pack_limit: usize, group_limit: usize) -> usize {
    pack_limit + group_limit + pack_limit / 4096 * 40 + 4096
}

impl GroupPacker {
    /// A packer of groups of up to `group_limit` plain bytes in packs of about `pack_limit`
    /// stored bytes, sealed under `key` if there is one, built in memory.
    pub fn new(
        key: Option<MasterKey>,
        compression: Compression,
        group_limit: usize,
        pack_limit: usize,
    ) -> GroupPacker {
        GroupPacker {
            pack: None,
            stager: None,
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

    /// Builds packs in the files `stager` makes (when it makes one) instead of in memory.
    pub fn staged(mut self, stager: Stager) -> GroupPacker {
        self.stager = Some(stager);
        self
    }

    /// The open pack, opened if there is none.
    fn open_pack(&mut self) -> RepoResult<&mut OpenPack> {
        if self.pack.is_none() {
            let staged = match &mut self.stager {
                Some(stage) => stage()?,
                None => None,
            };
            let capacity = pack_capacity(self.pack_limit, self.group_limit);
            self.pack = Some(OpenPack::new(staged, self.key.as_ref(), capacity)?);
        }
        Ok(self.pack.as_mut().expect("opened"))
    }

    /// Adds chunk `id` (whose plain bytes are `data`) and returns its ticket (the earlier
    /// ticket if the chunk was pushed before) and a pack to store if one filled up.
    pub fn push(&mut self, id: Id, data: &[u8]) -> RepoResult<(usize, Option<FinishedPack>)> {
        if let Some(&ticket) = self.tickets.get(&id) {
            return Ok((ticket, None));
        }
        let mut full = None;
        if self.group.is_full_for(data.len()) {
            full = self.close_group()?;
        }
        let ticket = self.placements.len();
        self.placements.push(None);
        self.tickets.insert(id, ticket);
        self.group.push(id, data);
        self.group_tickets.push(ticket);
        Ok((ticket, full))
    }

    /// Adds a group built elsewhere (finished: compressed, sealed if the packer seals) and
    /// returns its id and a pack to store if one filled up.
    pub fn push_group(&mut self, group: Group) -> RepoResult<(Id, Option<FinishedPack>)> {
        let gid = group_id(&group.desc.chunks, self.key.as_ref());
        let ids = std::iter::once(gid).chain(group.desc.chunks.iter().map(|c| c.id));
        let ids: Vec<Id> = ids.collect();
        self.open_pack()?.push(BlobKind::Data, group)?;
        self.pack_ids.extend(ids);
        Ok((gid, self.close_pack_if_full()?))
    }

    /// Adds a manifest node (a group of its own) and returns a pack to store if one filled.
    pub fn push_node(&mut self, id: Id, data: &[u8]) -> RepoResult<Option<FinishedPack>> {
        if !self.nodes.insert(id) {
            return Ok(None);
        }
        let mut b = GroupBuilder::new(data.len());
        b.push(id, data);
        let group = b.finish(self.compression, self.key.as_ref());
        self.open_pack()?.push(BlobKind::Node, group)?;
        self.pack_ids.push(id);
        self.close_pack_if_full()
    }

    /// Where the chunk of `ticket` is stored, once its group is closed.
    pub fn placement(&self, ticket: usize) -> Option<Placement> {
        self.placements.get(ticket).copied().flatten()
    }

    /// Closes the open group (and the pack, if that fills it).
    pub fn close_group(&mut self) -> RepoResult<Option<FinishedPack>> {
        if self.group.is_empty() {
            return Ok(None);
        }
        let builder = std::mem::replace(&mut self.group, GroupBuilder::new(self.group_limit));
        let group = builder.finish(self.compression, self.key.as_ref());
        let tickets = std::mem::take(&mut self.group_tickets);
        let (gid, full) = self.push_group(group)?;
        for (slot, ticket) in tickets.into_iter().enumerate() {
            self.placements[ticket] = Some(Placement {
                group: gid,
                slot: slot as u16,
            });
        }
        Ok(full)
    }

    fn close_pack_if_full(&mut self) -> RepoResult<Option<FinishedPack>> {
        if self
            .pack
            .as_ref()
            .is_some_and(|p| p.len() >= self.pack_limit)
        {
            self.close_pack()
        } else {
            Ok(None)
        }
    }

    fn close_pack(&mut self) -> RepoResult<Option<FinishedPack>> {
        let Some(pack) = self.pack.take().filter(|p| !p.is_empty()) else {
            return Ok(None);
        };
        let (id, bytes) = pack.finish()?;
        Ok(Some(FinishedPack {
            id,
            bytes,
            ids: std::mem::take(&mut self.pack_ids),
        }))
    }

    /// Closes the open group and pack: the last pack to store, if any. Every ticket has its
    /// placement afterwards.
    pub fn finish(&mut self) -> RepoResult<Option<FinishedPack>> {
        let full = self.close_group()?;
        debug_assert!(full.is_none() || self.pack.is_none());
        match full {
            Some(pack) => Ok(Some(pack)),
            None => self.close_pack(),
        }
    }
}

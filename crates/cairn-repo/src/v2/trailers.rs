//! Pack trailers, read once per pack and kept: what a v2 pack holds (its groups and every
//! slot's chunk id), looked up by group id or chunk id. An index run only says a pack *may*
//! hold an id (an 8-byte key); the trailer's full ids decide.

use std::sync::Arc;

use cairn_format::group::group_id;
use cairn_format::id_hash::IdMap;
use cairn_format::pack::{BlobKind, FOOTER_LEN};
use cairn_format::pack_v2::{self, PackGroup, HEADER_LEN};
use cairn_format::{keys, FormatError, Id};

use super::tail::HeadAndTail;
use super::{sealed_error, Cost, V2Reader};
use crate::error::{RepoError, RepoResult};

/// How much of a pack's end the first read fetches: the trailer of a 16 MiB pack of 4 KiB
/// chunks is about 150 KiB.
const TAIL_GUESS: u64 = 256 << 10;

/// Where a chunk (or a manifest node) is stored: a group of a pack and its slot there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotRef {
    pub group: u32,
    pub slot: u16,
}

/// A pack's trailer, checked, with its group ids computed.
#[derive(Debug)]
pub struct PackTrailer {
    pub pack: Id,
    pub groups: Vec<PackGroup>,
    /// Each group's id, by position.
    group_ids: Vec<Id>,
    by_group: IdMap<u32>,
    by_chunk: IdMap<SlotRef>,
}

impl PackTrailer {
    fn new(pack: Id, groups: Vec<PackGroup>, reader: &V2Reader) -> PackTrailer {
        let mut by_group = IdMap::with_capacity_and_hasher(groups.len(), Default::default());
        let mut by_chunk = IdMap::default();
        let mut group_ids = Vec::with_capacity(groups.len());
        for (g, group) in groups.iter().enumerate() {
            let gid = group_id(&group.desc.chunks, reader.key());
            group_ids.push(gid);
            by_group.entry(gid).or_insert(g as u32);
            for (slot, c) in group.desc.chunks.iter().enumerate() {
                if c.stored {
                    by_chunk.entry(c.id).or_insert(SlotRef {
                        group: g as u32,
                        slot: slot as u16,
                    });
                }
            }
        }
        PackTrailer {
            pack,
            groups,
            group_ids,
            by_group,
            by_chunk,
        }
    }

    /// The group whose id (a hash of its slot list) is `id`.
    pub fn group(&self, id: &Id) -> Option<u32> {
        self.by_group.get(id).copied()
    }

    /// The id of the group at position `group` (as in a [`SlotRef`] of this trailer).
    pub fn group_id(&self, group: u32) -> Option<Id> {
        self.group_ids.get(group as usize).copied()
    }

    /// What an index run names for this pack, as (id, pack): every data group and each
    /// chunk it stores, and the manifest nodes `node` accepts.
    pub fn index_entries(&self, node: impl Fn(&Id) -> bool) -> Vec<(Id, Id)> {
        let mut out = Vec::new();
        for (g, group) in self.groups.iter().enumerate() {
            match group.kind {
                BlobKind::Node => {
                    let id = group.desc.chunks[0].id;
                    if node(&id) {
                        out.push((id, self.pack));
                    }
                }
                BlobKind::Data => {
                    out.push((self.group_ids[g], self.pack));
                    out.extend(
                        group
                            .desc
                            .chunks
                            .iter()
                            .filter(|c| c.stored)
                            .map(|c| (c.id, self.pack)),
                    );
                }
            }
        }
        out
    }

    /// Where the chunk or node `id` is stored in this pack (slots GC dropped do not count).
    pub fn chunk(&self, id: &Id) -> Option<SlotRef> {
        self.by_chunk.get(id).copied()
    }
}

impl Cost for PackTrailer {
    fn cost(&self) -> u64 {
        let chunks: usize = self.groups.iter().map(|g| g.desc.chunks.len()).sum();
        // The descriptors (41 bytes a slot) and the two maps (about 64 bytes an entry).
        (chunks * (41 + 64) + self.groups.len() * (64 + 64 + 32)) as u64
    }
}

impl V2Reader {
    /// The trailer of `pack`, from the cache or read (the tail of the pack and its header).
    pub async fn trailer(&self, pack: &Id) -> RepoResult<Arc<PackTrailer>> {
        self.trailers
            .get_or_insert_async(pack, self.read_trailer(pack))
            .await
    }

    async fn read_trailer(&self, pack: &Id) -> RepoResult<Arc<PackTrailer>> {
        self.fetched
            .trailers
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let key = keys::pack(pack);
        let store = &*self.store;
        let found =
            HeadAndTail::read(store, &key, HEADER_LEN, HEADER_LEN + FOOTER_LEN, TAIL_GUESS).await?;
        let Some(obj) = found else {
            // Damage, unless a GC repacked it since this reader read its runs: a long-lived
            // reader re-reads the runs (`Repo::refresh_index`) and asks again.
            return Err(RepoError::PackMissing {
                pack: *pack,
                id: *pack,
            });
        };
        let sealed = pack_v2::parse_header(&obj.head).map_err(|e| RepoError::corrupt(&key, e))?;
        if sealed != self.key.is_some() {
            let why = if sealed {
                "the pack is sealed but the repository is not encrypted"
            } else {
                "the pack is not sealed but the repository is encrypted"
            };
            return Err(RepoError::corrupt(&key, FormatError::invalid("pack", why)));
        }
        let footer = pack_v2::parse_footer(&obj.tail).map_err(|e| RepoError::corrupt(&key, e))?;
        let range = footer
            .trailer_range(obj.len)
            .map_err(|e| RepoError::corrupt(&key, e))?;
        let start = range.start;
        let stored = obj.bytes(store, &key, range).await?;
        let groups = pack_v2::parse_trailer(&stored, &footer, sealed, start, self.key())
            .map_err(|e| sealed_error(&key, e))?;
        Ok(Arc::new(PackTrailer::new(*pack, groups, self)))
    }
}

//! Pack trailers, read once per pack and kept: what a v2 pack holds (its groups and every
//! slot's chunk id), looked up by group id or chunk id. An index run only says a pack *may*
//! hold an id (an 8-byte key); the trailer's full ids decide.

use std::sync::{Arc, Mutex, Weak};

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

/// A stored slot of a trailer, by the first 8 bytes of its chunk id: the trailer's chunk
/// lookup is a binary search over these (16 bytes a slot) that checks the full id in the
/// group's descriptor, where a hash map of full ids took about 64 bytes a slot and held
/// every id a second time. A cache of trailers holds nearly twice as many in the same bytes.
#[derive(Debug, Clone, Copy)]
struct KeyedSlot {
    key: u64,
    group: u32,
    slot: u16,
}

/// A pack's trailer, checked, with its group ids computed.
#[derive(Debug)]
pub struct PackTrailer {
    pub pack: Id,
    pub groups: Vec<PackGroup>,
    /// Each group's id, by position.
    group_ids: Vec<Id>,
    /// The positions ordered by group id (of a group listed twice, the first position
    /// first), searched by halves: 4 bytes a group, where a map to positions took 46 to 92
    /// at its load — a node pack's trailer holds a group per node.
    by_group: Vec<u32>,
    /// Every stored slot, by key; slots of one key in trailer order.
    by_key: Vec<KeyedSlot>,
}

impl PackTrailer {
    fn new(pack: Id, groups: Vec<PackGroup>, reader: &V2Reader) -> PackTrailer {
        let mut by_key = Vec::with_capacity(groups.iter().map(|g| g.desc.chunks.len()).sum());
        let mut group_ids = Vec::with_capacity(groups.len());
        for (g, group) in groups.iter().enumerate() {
            let gid = group_id(&group.desc.chunks, reader.key());
            group_ids.push(gid);
            for (slot, c) in group.desc.chunks.iter().enumerate() {
                if c.stored {
                    by_key.push(KeyedSlot {
                        key: c.id.prefix_u64(),
                        group: g as u32,
                        slot: slot as u16,
                    });
                }
            }
        }
        // Stable: a chunk stored twice in the pack is found at its first slot.
        by_key.sort_by_key(|s| s.key);
        let by_group = positions_by_id(&group_ids);
        PackTrailer {
            pack,
            groups,
            group_ids,
            by_group,
            by_key,
        }
    }

    /// The group whose id (a hash of its slot list) is `id`.
    pub fn group(&self, id: &Id) -> Option<u32> {
        let ids = &self.group_ids;
        let at = self.by_group.partition_point(|g| ids[*g as usize] < *id);
        self.by_group
            .get(at)
            .copied()
            .filter(|g| ids[*g as usize] == *id)
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
        let key = id.prefix_u64();
        let first = self.by_key.partition_point(|s| s.key < key);
        self.by_key[first..]
            .iter()
            .take_while(|s| s.key == key)
            .find(|s| self.groups[s.group as usize].desc.chunks[usize::from(s.slot)].id == *id)
            .map(|s| SlotRef {
                group: s.group,
                slot: s.slot,
            })
    }
}

/// The positions of `ids` ordered by id; of an id listed twice, the first position first.
fn positions_by_id(ids: &[Id]) -> Vec<u32> {
    let mut positions: Vec<u32> = (0..ids.len() as u32).collect();
    // Stable: equal ids keep their order.
    positions.sort_by(|a, b| ids[*a as usize].cmp(&ids[*b as usize]));
    positions
}

impl PackTrailer {
    /// What a decoded trailer of `slots` slots in `groups` groups costs in the reader's
    /// cache: the descriptors (41 bytes a slot), the keyed slots (16), and per group its
    /// id, its position in id order and its descriptor's own fields (with its slot list's
    /// allocation).
    pub const fn held_bytes(slots: u64, groups: u64) -> u64 {
        slots * (41 + 16) + groups * (32 + 4 + 64)
    }
}

impl Cost for PackTrailer {
    fn cost(&self) -> u64 {
        let slots: usize = self.groups.iter().map(|g| g.desc.chunks.len()).sum();
        PackTrailer::held_bytes(slots as u64, self.groups.len() as u64)
    }
}

/// Trailers someone still holds outside the cache (a commit worker's recent packs), found
/// again through a weak reference instead of read again. A commit's trailer cache is small
/// because its workers hold their working set (`CacheLimits::for_commit`); without this,
/// a trailer a worker held but the cache had let go was read a second time by the worker's
/// other tier (a hook lookup) and held twice.
#[derive(Debug, Default)]
pub(super) struct HeldTrailers {
    inner: Mutex<HeldMap>,
}

#[derive(Debug, Default)]
struct HeldMap {
    by_pack: IdMap<Weak<PackTrailer>>,
    /// Entries past which the dropped ones are cleared (a weak reference keeps a few hundred
    /// bytes of its trailer until then).
    prune_at: usize,
}

impl HeldTrailers {
    fn get(&self, pack: &Id) -> Option<Arc<PackTrailer>> {
        let inner = self.inner.lock().expect("held trailers lock");
        inner.by_pack.get(pack)?.upgrade()
    }

    fn note(&self, trailer: &Arc<PackTrailer>) {
        let mut inner = self.inner.lock().expect("held trailers lock");
        inner.by_pack.insert(trailer.pack, Arc::downgrade(trailer));
        if inner.by_pack.len() > inner.prune_at {
            inner.by_pack.retain(|_, t| t.strong_count() > 0);
            inner.prune_at = (inner.by_pack.len() * 2).max(64);
        }
    }
}

impl V2Reader {
    /// The trailer of `pack`, from the cache or read (the tail of the pack and its header).
    pub async fn trailer(&self, pack: &Id) -> RepoResult<Arc<PackTrailer>> {
        self.trailers
            .get_or_insert_async(pack, async {
                if let Some(held) = self.held_trailers.get(pack) {
                    return Ok(held);
                }
                let read = self.read_trailer(pack).await?;
                self.held_trailers.note(&read);
                Ok(read)
            })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn trailer(n: u32) -> Arc<PackTrailer> {
        Arc::new(PackTrailer {
            pack: Id::of(&n.to_le_bytes()),
            groups: Vec::new(),
            group_ids: Vec::new(),
            by_group: Vec::new(),
            by_key: Vec::new(),
        })
    }

    /// A group is found by its id at its first position, and an id the pack lacks is not
    /// found, whatever its place among the others.
    #[test]
    fn a_group_is_found_by_id_at_its_first_position() {
        let id = |n: u8| Id([n; 32]);
        let group_ids = vec![id(5), id(2), id(9), id(2), id(7)];
        let t = PackTrailer {
            pack: id(0),
            groups: Vec::new(),
            by_group: positions_by_id(&group_ids),
            group_ids,
            by_key: Vec::new(),
        };
        assert_eq!(t.group(&id(5)), Some(0));
        assert_eq!(t.group(&id(2)), Some(1));
        assert_eq!(t.group(&id(9)), Some(2));
        assert_eq!(t.group(&id(7)), Some(4));
        for absent in [1, 3, 6, 8, 10] {
            assert_eq!(t.group(&id(absent)), None, "{absent}");
        }
        assert_eq!(t.group_id(3), Some(id(2)));
    }

    /// A trailer is found again while someone holds it, not once it is dropped; the
    /// references to dropped trailers are cleared as more are noted, so they do not pile up.
    #[test]
    fn held_trailers_are_found_while_held_and_forgotten_after() {
        let held = HeldTrailers::default();
        let kept = trailer(0);
        held.note(&kept);
        let found = held.get(&kept.pack).expect("held by `kept`");
        assert!(Arc::ptr_eq(&found, &kept));
        drop(found);
        let pack = kept.pack;
        drop(kept);
        assert!(held.get(&pack).is_none());

        let kept: Vec<_> = (1..=10).map(trailer).collect();
        kept.iter().for_each(|t| held.note(t));
        for n in 11..10_000 {
            held.note(&trailer(n));
        }
        let entries = held.inner.lock().unwrap().by_pack.len();
        assert!(
            entries <= 128,
            "{entries} references kept for 10 live trailers"
        );
        assert!(kept.iter().all(|t| held.get(&t.pack).is_some()));
    }
}

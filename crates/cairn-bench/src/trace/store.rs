//! The simulated repository: packs of chunk ids (no data), and where each chunk is stored.
//!
//! A pack is what a commit wrote, in order, [`PACK_CHUNKS`] chunks to a pack, kept as the
//! extents of consecutive origins it holds (a commit stores a file's new blocks one after
//! another, so a pack of 4,096 chunks is a few extents, not 4,096 entries). It answers the
//! similar tier as a pack trailer does ([`StoredPack`]).
//!
//! The index is modelled, not cairn's index runs: the disjoint extents of every origin stored,
//! each with the pack that stored it first. It answers "which pack stores this chunk" exactly,
//! as a lookup in the runs does; what such a lookup costs in the real runs (filters, fence
//! keys, sections, trailers) is counted by `memory.rs` from the lookups made here.

use std::collections::BTreeMap;
use std::sync::Arc;

use cairn_engine::commit::dedup::similar::StoredPack;
use cairn_format::Id;
use cairn_repo::v2::Placement;

use super::fleet::origin_of;

/// Chunks a pack holds: a 16 MiB pack of 4 KiB chunks.
pub const PACK_CHUNKS: u32 = 4096;
/// Chunks a group holds (a group is a trailer's unit of placement).
pub const GROUP_CHUNKS: u32 = 16;

/// A pack's id as the engine sees it: its number, in the first bytes.
fn pack_id(n: u32) -> Id {
    let mut b = [0u8; 32];
    b[..4].copy_from_slice(&n.to_le_bytes());
    b[31] = 0xa5;
    Id(b)
}

/// A group's id: its pack and position.
fn group_id(pack: u32, group: u32) -> Id {
    let mut b = [0u8; 32];
    b[..4].copy_from_slice(&pack.to_le_bytes());
    b[4..8].copy_from_slice(&group.to_le_bytes());
    b[31] = 0x5a;
    Id(b)
}

/// A pack: the extents of origins it stores, sorted, each with its first slot.
#[derive(Debug)]
pub struct TracePack {
    pub number: u32,
    /// `(first origin, length, first slot)`, sorted by origin.
    extents: Vec<(u64, u32, u32)>,
}

impl TracePack {
    /// The slot of origin `p` in this pack.
    fn slot_of(&self, p: u64) -> Option<u32> {
        let at = self.extents.partition_point(|e| e.0 <= p);
        let &(first, len, slot) = self.extents.get(at.checked_sub(1)?)?;
        (p < first + len as u64).then(|| slot + (p - first) as u32)
    }
}

impl StoredPack for TracePack {
    fn pack_id(&self) -> Id {
        pack_id(self.number)
    }

    fn place(&self, id: &Id) -> Option<Placement> {
        let slot = self.slot_of(origin_of(id))?;
        Some(Placement {
            group: group_id(self.number, slot / GROUP_CHUNKS),
            slot: (slot % GROUP_CHUNKS) as u16,
        })
    }
}

/// Every pack written, and where each origin is stored.
#[derive(Default)]
pub struct Store {
    packs: Vec<Arc<TracePack>>,
    /// Disjoint extents of stored origins: first → (end, pack).
    located: BTreeMap<u64, (u64, u32)>,
    /// Chunks stored, duplicates included.
    pub stored_chunks: u64,
}

impl Store {
    /// The pack storing origin `p`, if any.
    pub fn locate(&self, p: u64) -> Option<Arc<TracePack>> {
        let (_, &(end, pack)) = self.located.range(..=p).next_back()?;
        (p < end).then(|| self.packs[pack as usize].clone())
    }

    pub fn packs(&self) -> usize {
        self.packs.len()
    }

    /// Extents the location map holds (its memory in this harness, not cairn's).
    pub fn located_extents(&self) -> usize {
        self.located.len()
    }

    /// Publishes packs a commit wrote: their chunks become locatable (a commit's own packs are
    /// not, until it publishes, as in cairn).
    pub fn publish(&mut self, packs: Vec<PackBuilder>) {
        for b in packs {
            let number = self.packs.len() as u32;
            let mut extents = b.extents;
            self.stored_chunks += b.chunks as u64;
            for &(first, len, _) in &extents {
                self.cover(first, first + len as u64, number);
            }
            extents.sort_unstable();
            self.packs.push(Arc::new(TracePack { number, extents }));
        }
    }

    /// Records `[start, end)` as stored in `pack`, where no earlier pack stores it.
    fn cover(&mut self, start: u64, end: u64, pack: u32) {
        let mut at = start;
        // An extent that begins before `start` may cover its beginning.
        if let Some((_, &(e, _))) = self.located.range(..=at).next_back() {
            at = at.max(e);
        }
        while at < end {
            let next = self
                .located
                .range(at..end)
                .next()
                .map(|(&s, &(e, _))| (s, e));
            match next {
                Some((s, e)) => {
                    if s > at {
                        self.located.insert(at, (s, pack));
                    }
                    at = e;
                }
                None => {
                    self.located.insert(at, (end, pack));
                    at = end;
                }
            }
        }
    }
}

/// A pack being written by a commit.
#[derive(Default)]
pub struct PackBuilder {
    extents: Vec<(u64, u32, u32)>,
    pub chunks: u32,
}

impl PackBuilder {
    pub fn is_full(&self) -> bool {
        self.chunks >= PACK_CHUNKS
    }

    pub fn push(&mut self, p: u64) {
        match self.extents.last_mut() {
            Some((first, len, _)) if *first + *len as u64 == p => *len += 1,
            _ => self.extents.push((p, 1, self.chunks)),
        }
        self.chunks += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::{chunk_id, packed};

    fn pack(origins: impl IntoIterator<Item = u64>) -> PackBuilder {
        let mut b = PackBuilder::default();
        for p in origins {
            b.push(p);
        }
        b
    }

    #[test]
    fn the_first_pack_that_stores_an_origin_locates_it() {
        let mut s = Store::default();
        s.publish(vec![pack((10..20).chain(40..45))]);
        s.publish(vec![pack((5..50).chain([100]))]);
        let at = |p| s.locate(p).map(|t| t.number);
        assert_eq!(at(4), None);
        assert_eq!(at(5), Some(1));
        assert_eq!(at(10), Some(0));
        assert_eq!(at(19), Some(0));
        assert_eq!(at(20), Some(1));
        assert_eq!(at(44), Some(0));
        assert_eq!(at(45), Some(1));
        assert_eq!(at(100), Some(1));
        assert_eq!(at(101), None);
        assert_eq!(s.stored_chunks, 15 + 46);
    }

    #[test]
    fn a_pack_places_the_chunks_it_stores_by_slot() {
        let mut s = Store::default();
        s.publish(vec![pack(
            [packed(2, 9)]
                .into_iter()
                .chain((0..20).map(|c| packed(1, c))),
        )]);
        let t = s.locate(packed(1, 17)).expect("stored");
        let p = t.place(&chunk_id(packed(1, 17))).expect("placed");
        // Slot 18 of the pack: group 1, slot 2.
        assert_eq!((p.group, p.slot), (group_id(0, 1), 2));
        assert!(t.place(&chunk_id(packed(1, 20))).is_none());
        assert!(t.place(&chunk_id(packed(2, 9))).is_some());
    }
}

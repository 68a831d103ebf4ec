//! Tier 2 of dedup: similar data, found through the packs that store it.
//!
//! A segment's *hooks* are the smallest keys among its chunks that the tiers before did not
//! find, looked up one at a time (at most [`HOOKS`]), each the smallest still not found once
//! the packs of the ones before were probed. Chunk ids are uniform hashes, so two chunk sets that share a fraction
//! `f` of their chunks share their smallest key with probability about `f` (min-hash,
//! Broder 1997): a segment whose changed chunks are stored anywhere finds one of them in a
//! few lookups. The index locates a hook's pack; the pack's trailer lists every chunk
//! stored in it, which are the chunks committed beside the hook — a moved file's other
//! blocks, a clone's neighbouring data. That is the VM-centric paper's similarity search
//! (`002_…` §3.1) with the pack as the unit it loads, where the paper loads segment
//! recipes; cairn's trailers are cached per pack already, so a hit costs one lookup and
//! no new structure on disk.
//!
//! A worker keeps the last [`RECENT`] packs that found chunks and probes them first: the
//! next segments of a moved region are in the same packs, and cost no lookup at all.
//!
//! What is trusted is what an index lookup trusts: a slot a trailer says its group copy
//! stores, in a copy not quarantined.

use std::collections::VecDeque;
use std::sync::Arc;

use cairn_format::Id;
use cairn_repo::v2::{PackTrailer, Placement, V2Reader};
use cairn_repo::RepoResult;

/// Hooks a segment looks up at most: a segment whose chunks lie in up to four packs finds
/// them all, and one of new data costs four lookups, not one a chunk (256 in 1 MiB).
pub(crate) const HOOKS: usize = 4;

/// Packs a worker keeps probing after they found chunks.
pub(crate) const RECENT: usize = 8;

/// The next hook of a segment: the smallest key among its chunks not found yet (`found[i]`
/// is `None`, `ids[i]` is not) and not `tried`.
pub(crate) fn next_hook(
    ids: &[Option<Id>],
    found: &[Option<Placement>],
    tried: &[Id],
) -> Option<Id> {
    ids.iter()
        .zip(found)
        .filter_map(|(id, f)| id.as_ref().filter(|_| f.is_none()))
        .filter(|id| !tried.contains(id))
        .min_by_key(|id| (id.prefix_u64(), **id))
        .copied()
}

/// The pack that stores hook `id`, if the index locates a good copy.
pub(crate) async fn hook_pack(reader: &V2Reader, id: &Id) -> RepoResult<Option<Arc<PackTrailer>>> {
    match reader.locate_chunk(id).await {
        Ok((trailer, _)) => Ok(Some(trailer)),
        Err(e) if e.is_damage() => Ok(None),
        Err(e) => Err(e),
    }
}

/// The packs one worker probes, most recently useful first.
#[derive(Debug, Default)]
pub(crate) struct SimilarPacks {
    packs: VecDeque<Arc<PackTrailer>>,
}

impl SimilarPacks {
    /// Adds `trailer` at the front (the oldest falls off); `false` if it was held already.
    pub(crate) fn learn(&mut self, trailer: Arc<PackTrailer>) -> bool {
        if let Some(at) = self.packs.iter().position(|t| t.pack == trailer.pack) {
            let t = self.packs.remove(at).expect("a held pack");
            self.packs.push_front(t);
            return false;
        }
        self.packs.push_front(trailer);
        self.packs.truncate(RECENT);
        true
    }

    /// Fills `found` for the chunks the first `packs` packs store in a good copy; returns
    /// how many it found. A pack that found any moves to the front.
    pub(crate) fn probe(
        &mut self,
        reader: &V2Reader,
        ids: &[Option<Id>],
        found: &mut [Option<Placement>],
        packs: usize,
    ) -> u64 {
        let mut n = 0;
        let mut useful = Vec::new();
        for (at, trailer) in self.packs.iter().take(packs).enumerate() {
            if reader.is_quarantined_copy(&trailer.pack, &trailer.pack) {
                continue;
            }
            let before = n;
            for (f, id) in found.iter_mut().zip(ids) {
                let (None, Some(id)) = (&f, id) else {
                    continue;
                };
                let Some(slot) = trailer.chunk(id) else {
                    continue;
                };
                let group = trailer
                    .group_id(slot.group)
                    .expect("a group of this trailer");
                if reader.is_quarantined_copy(&trailer.pack, &group) {
                    continue;
                }
                *f = Some(Placement {
                    group,
                    slot: slot.slot,
                });
                n += 1;
            }
            if n > before {
                useful.push(at);
            }
        }
        // Most useful last, so it ends up in front.
        for at in useful.into_iter().rev() {
            if let Some(t) = self.packs.remove(at) {
                self.packs.push_front(t);
            }
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(key: u64, tail: u8) -> Id {
        let mut b = [tail; 32];
        b[..8].copy_from_slice(&key.to_le_bytes());
        Id(b)
    }

    #[test]
    fn the_next_hook_is_the_smallest_key_not_found_nor_tried() {
        let p = Placement {
            group: Id::ZERO,
            slot: 0,
        };
        let ids = [
            Some(id(5, 0)),
            None,
            Some(id(1, 0)),
            Some(id(3, 0)),
            Some(id(3, 0)),
            Some(id(9, 0)),
            Some(id(2, 0)),
            Some(id(7, 0)),
        ];
        let found = [None, None, Some(p), None, None, None, None, None];
        // Key 1 was found (not a hook); key 3 occurs twice (one hook).
        let mut tried = Vec::new();
        while let Some(h) = next_hook(&ids, &found, &tried) {
            tried.push(h);
        }
        assert_eq!(tried, [id(2, 0), id(3, 0), id(5, 0), id(7, 0), id(9, 0)]);
        assert_eq!(next_hook(&ids, &[Some(p); 8], &[]), None);
    }
}

//! Tier 2 of dedup: similar data, found through the packs that store it.
//!
//! A segment's *hooks* are the smallest keys among its chunks that the tiers before did not
//! find, looked up one at a time, each the smallest still not found once the packs of the
//! ones before were probed, until [`HOOKS`] in a row found no new pack (or [`MAX_HOOKS`]
//! were looked up). Chunk ids are uniform hashes, so two chunk sets that share a fraction
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

use super::DedupTally;

/// Hooks in a row that may find nothing before a segment stops looking: a segment of new
/// data costs four lookups, not one a chunk (256 in 1 MiB).
pub const HOOKS: usize = 4;

/// Hooks a segment looks up at most. A hook that finds a pack does not count against
/// [`HOOKS`], so a segment whose chunks lie in many packs (small files from many places)
/// keeps finding them, up to this many lookups (the trace benchmark's fragmented fleet
/// stored 1.119× exact at 10 VMs with four hooks in all, 1.0009× with this; BENCHMARKS.md, *Studies behind the design*).
pub const MAX_HOOKS: usize = 32;

/// Packs a worker keeps probing after they found chunks.
pub const RECENT: usize = 8;

/// A pack as this tier sees it: which chunks it stores, and where. A commit's packs are
/// [`PackTrailer`]s read from the store; the trace benchmark (`cairn-trace`) gives its
/// simulated packs the same face, so both run this module's search.
pub trait StoredPack {
    /// The pack's id.
    fn pack_id(&self) -> Id;
    /// Where this pack stores chunk `id` (its group's id and slot), if it does.
    fn place(&self, id: &Id) -> Option<Placement>;
}

impl StoredPack for PackTrailer {
    fn pack_id(&self) -> Id {
        self.pack
    }

    fn place(&self, id: &Id) -> Option<Placement> {
        let slot = self.chunk(id)?;
        let group = self.group_id(slot.group).expect("a group of this trailer");
        Some(Placement {
            group,
            slot: slot.slot,
        })
    }
}

/// What the similar tier asks of the repository around it.
pub trait SimilarSource {
    type Pack: StoredPack;
    type Error;
    /// Whether this commit stores chunk `id` itself (a hook it need not look up).
    fn stored_by_this_commit(&self, id: &Id) -> bool;
    /// The pack that stores chunk `id` in a good copy, found through the index (`None` if
    /// none does).
    fn hook_pack(&self, id: &Id) -> Result<Option<Arc<Self::Pack>>, Self::Error>;
    /// Whether the copy of group `group` in pack `pack` may be used (not quarantined);
    /// asked with `group == pack` for the pack as a whole.
    fn good_copy(&self, pack: &Id, group: &Id) -> bool;
    /// Hooks a segment looks up at most (the trace benchmark tries others).
    fn hooks(&self) -> usize {
        HOOKS
    }
}

/// Tier 2 for one segment: fills `found[i]` for the chunks `ids[i]` that the worker's recent
/// packs, then the packs of the segment's hooks, store; counts what it found and the hooks
/// it looked up in `tally`. It stops after [`HOOKS`] hooks in a row found no new pack, or
/// after [`MAX_HOOKS`].
pub fn search_similar<S: SimilarSource>(
    source: &S,
    similar: &mut SimilarPacks<S::Pack>,
    ids: &[Option<Id>],
    found: &mut [Option<Placement>],
    tally: &mut DedupTally,
) -> Result<(), S::Error> {
    tally.similar += similar.probe(source, ids, found, RECENT);
    // One hook at a time, each the smallest key still not found: a segment whose chunks
    // lie in two packs finds the second through the chunks the first did not hold.
    let mut tried = Vec::new();
    let mut misses = 0;
    while misses < source.hooks() && tried.len() < MAX_HOOKS {
        let Some(hook) = next_hook(ids, found, &tried) else {
            break;
        };
        tried.push(hook);
        if source.stored_by_this_commit(&hook) {
            continue;
        }
        tally.hook_lookups += 1;
        match source.hook_pack(&hook)? {
            Some(pack) if similar.learn(pack.clone()) => {
                // Only the new pack: the others were probed already.
                tally.similar += similar.probe(source, ids, found, 1);
                misses = 0;
            }
            _ => misses += 1,
        }
    }
    Ok(())
}

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
#[derive(Debug)]
pub struct SimilarPacks<P> {
    packs: VecDeque<Arc<P>>,
}

impl<P> Default for SimilarPacks<P> {
    fn default() -> Self {
        SimilarPacks {
            packs: VecDeque::new(),
        }
    }
}

impl<P: StoredPack> SimilarPacks<P> {
    /// Adds `pack` at the front (the oldest falls off); `false` if it was held already.
    pub fn learn(&mut self, pack: Arc<P>) -> bool {
        let id = pack.pack_id();
        if let Some(at) = self.packs.iter().position(|t| t.pack_id() == id) {
            let t = self.packs.remove(at).expect("a held pack");
            self.packs.push_front(t);
            return false;
        }
        self.packs.push_front(pack);
        self.packs.truncate(RECENT);
        true
    }

    /// The packs held, most recently useful first.
    pub fn held(&self) -> impl Iterator<Item = &Arc<P>> {
        self.packs.iter()
    }

    /// Fills `found` for the chunks the first `packs` packs store in a good copy; returns
    /// how many it found. A pack that found any moves to the front.
    pub fn probe<S: SimilarSource<Pack = P>>(
        &mut self,
        source: &S,
        ids: &[Option<Id>],
        found: &mut [Option<Placement>],
        packs: usize,
    ) -> u64 {
        let mut n = 0;
        let mut useful = Vec::new();
        for (at, pack) in self.packs.iter().take(packs).enumerate() {
            let pack_id = pack.pack_id();
            if !source.good_copy(&pack_id, &pack_id) {
                continue;
            }
            let before = n;
            for (f, id) in found.iter_mut().zip(ids) {
                let (None, Some(id)) = (&f, id) else {
                    continue;
                };
                let Some(p) = pack.place(id) else {
                    continue;
                };
                if !source.good_copy(&pack_id, &p.group) {
                    continue;
                }
                *f = Some(p);
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

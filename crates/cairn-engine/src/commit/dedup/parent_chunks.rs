//! Chunk-level dedup against the parent's leaf at the same offset: the VM-centric paper's
//! first tier (`002_…` §3.1, "the parent segment at the same offset"). A segment whose bytes
//! changed a little misses the whole-leaf fast path (`parent`), yet most of its 4 KiB chunks
//! are still the parent's. One read of the parent's leaf and of its groups' descriptors (from
//! the pack trailers, cached per pack) gives their ids and slots, so those chunks are found
//! with a hash-map probe instead of an index lookup each — a lookup that asks every index run
//! and costs far more when it hits than when it misses (a 64 GiB re-commit after scattered
//! writes spent most of its 11 s on hits). Only chunks not found here go on to the next tiers
//! (`super`).
//!
//! What is trusted is what the index path trusts: a group copy this session's index locates,
//! not quarantined, that still stores the slots (the parent is live, so GC kept them; a GC
//! this commit did not see is caught by the stale-GC guard, which checks every slot the new
//! version's reference summary lists). A parent leaf or group that cannot be read or located only means no help here.
//!
//! A group is first looked for in the packs where the worker found its last parent groups
//! (`RecentPacks`: trailers of packs this session's index named), then through the index:
//! the parent was written in image order, so the next segment's leaf names groups in the same
//! few packs. A re-commit of a 256 GiB image located a million parent groups, each an index
//! lookup and, once the run outgrew the piece cache, a section read.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use cairn_format::leaf_v2::RunLeaf;
use cairn_format::Id;
use cairn_repo::v2::{GroupLocation, PackTrailer, Placement, V2Reader};
use cairn_repo::RepoResult;

/// Parent leaves of a worker after which a recent pack that none of them used is let go.
const WINDOW: u64 = 16;

/// Packs a worker holds at most, however many its latest parent leaves used.
const MAX_RECENT: usize = 32;

/// The packs where a worker found the groups of its latest parent leaves, with their
/// trailers: its working set (Denning's: what the last [`WINDOW`] leaves used), most recent
/// first. A parent written in image order names groups of one or two packs a segment; a fixed
/// eight held six trailers of packs the re-commit had passed (half a MiB each for full packs
/// of compressible 4 KiB chunks), and the trailer cache held more. A parent with a history of
/// scattered changes names a base pack and a pack per version each segment, all needed again
/// by the next one, which a fixed two lost at each segment (BENCHMARKS.md, *Studies behind the design*: 5,000 trailer
/// reads instead of 130 with a 2 MiB cache).
#[derive(Debug)]
pub(crate) struct RecentPacks<T = Arc<PackTrailer>> {
    /// (pack, what is held of it, the leaf that last used it).
    packs: VecDeque<(Id, T, u64)>,
    /// Parent leaves loaded so far.
    leaves: u64,
}

impl<T> Default for RecentPacks<T> {
    fn default() -> Self {
        RecentPacks {
            packs: VecDeque::new(),
            leaves: 0,
        }
    }
}

impl<T> RecentPacks<T> {
    /// A new parent leaf: the packs none of the last [`WINDOW`] leaves used are let go.
    fn next_leaf(&mut self) {
        self.leaves += 1;
        let leaves = self.leaves;
        self.packs.retain(|(_, _, used)| used + WINDOW >= leaves);
    }

    /// The first answer `ask` gives of a held pack, most recent first; that pack counts as
    /// used by this leaf.
    fn find<R>(&mut self, mut ask: impl FnMut(&T) -> Option<R>) -> Option<R> {
        let (i, found) = self
            .packs
            .iter()
            .enumerate()
            .find_map(|(i, (_, held, _))| Some((i, ask(held)?)))?;
        let (pack, held, _) = self.packs.remove(i).expect("found there");
        self.packs.push_front((pack, held, self.leaves));
        Some(found)
    }

    /// Holds `held` of `pack`, used by this leaf.
    fn learn(&mut self, pack: Id, held: T) {
        self.packs.retain(|(p, _, _)| *p != pack);
        self.packs.push_front((pack, held, self.leaves));
        self.packs.truncate(MAX_RECENT);
    }
}

/// The chunks of one parent leaf, by id: where each is stored, as a leaf names it.
#[derive(Debug, Default)]
pub(crate) struct ParentChunks(HashMap<Id, Placement>);

impl ParentChunks {
    /// The chunks leaf `leaf` names in group copies that are good and store them; empty if the
    /// leaf cannot be read. An error of the store fails the call.
    pub(crate) async fn load(
        reader: &V2Reader,
        leaf: &Id,
        recent: &mut RecentPacks,
    ) -> RepoResult<ParentChunks> {
        recent.next_leaf();
        let held = recent.packs.iter().map(|(_, trailer, _)| trailer);
        let read = reader.read_node_once_near(leaf, held).await;
        let raw = match read {
            Ok((raw, node_pack)) => {
                recent.learn(node_pack.pack, node_pack);
                raw
            }
            Err(e) if e.is_damage() => {
                tracing::debug!(%leaf, "{e}; no chunk-level parent dedup for its segment");
                return Ok(ParentChunks::default());
            }
            Err(e) => return Err(e),
        };
        let Ok(leaf) = RunLeaf::decode(&raw) else {
            return Ok(ParentChunks::default());
        };
        let mut chunks = HashMap::new();
        for (group, first, count) in leaf.group_runs() {
            let wanted = [(first, count)];
            let in_recent = recent.find(|trailer: &Arc<PackTrailer>| {
                let loc = GroupLocation {
                    trailer: trailer.clone(),
                    group: trailer.group(&group)?,
                };
                (!reader.is_quarantined(&loc) && loc.stores(&wanted)).then_some(loc)
            });
            let loc = match in_recent {
                Some(loc) => loc,
                None => match reader.locate_group_storing(&group, &wanted).await {
                    Ok(loc) if !reader.is_quarantined(&loc) && loc.stores(&wanted) => {
                        recent.learn(loc.trailer.pack, loc.trailer.clone());
                        loc
                    }
                    Ok(_) => continue,
                    Err(e) if e.is_damage() => continue,
                    Err(e) => return Err(e),
                },
            };
            let Ok(run) = loc.run_chunks(first, count) else {
                continue;
            };
            for (i, chunk) in run.iter().enumerate() {
                chunks.entry(chunk.id).or_insert(Placement {
                    group,
                    slot: first + i as u16,
                });
            }
        }
        Ok(ParentChunks(chunks))
    }

    /// Where chunk `id` is stored, if the parent's leaf names it.
    pub(crate) fn get(&self, id: &Id) -> Option<Placement> {
        self.0.get(id).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pack(n: u8) -> Id {
        Id::of(&[n])
    }

    /// Leaves that each use the packs `uses` names (looked up, learned when not held), and
    /// how many were learned: a learned pack is a trailer read.
    fn run(recent: &mut RecentPacks<u8>, leaves: &[Vec<u8>]) -> usize {
        let mut learned = 0;
        for uses in leaves {
            recent.next_leaf();
            for &p in uses {
                if recent.find(|held| (*held == p).then_some(())).is_none() {
                    recent.learn(pack(p), p);
                    learned += 1;
                }
            }
        }
        learned
    }

    /// A parent in image order: each pack is learned once, and the packs passed are let go
    /// once no leaf of the window used them, so two are held at the end, not eight.
    #[test]
    fn packs_a_sequential_parent_has_passed_are_let_go() {
        let mut recent = RecentPacks::default();
        let leaves: Vec<Vec<u8>> = (0..200u32).map(|i| vec![(i / 10) as u8]).collect();
        assert_eq!(run(&mut recent, &leaves), 20);
        assert_eq!(recent.packs.len(), 2);
        assert_eq!(recent.packs[0].0, pack(19));
    }

    /// A parent with a history: every leaf uses the base pack of its place and a few packs of
    /// each version, some only every few leaves. None is learned twice while the window
    /// holds it, however many there are.
    #[test]
    fn a_scattered_working_set_is_held_whole() {
        let mut recent = RecentPacks::default();
        let leaves: Vec<Vec<u8>> = (0..100u8)
            .map(|i| {
                let mut uses = vec![100 + i / 50];
                uses.extend((0..12u8).filter(|v| (i + v) % (1 + v % 4) == 0));
                uses
            })
            .collect();
        assert_eq!(run(&mut recent, &leaves), 2 + 12);
        assert_eq!(recent.packs.len(), 12 + 1);
    }

    /// A pack unused for more than the window is learned again when a leaf needs it.
    #[test]
    fn a_pack_unused_for_the_window_is_learned_again() {
        let mut recent = RecentPacks::default();
        let mut leaves = vec![vec![1u8]];
        leaves.extend((0..WINDOW).map(|_| vec![2]));
        leaves.push(vec![1]);
        assert_eq!(run(&mut recent, &leaves), 3);
        let mut recent = RecentPacks::default();
        leaves.remove(1);
        assert_eq!(run(&mut recent, &leaves), 2);
    }
}

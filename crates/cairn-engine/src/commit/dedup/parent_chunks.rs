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

/// Packs a worker remembers where it found parent groups.
const RECENT_PACKS: usize = 8;

/// The trailers of the packs where a worker found its latest parent groups, most recent
/// first.
#[derive(Debug, Default)]
pub(crate) struct RecentPacks {
    trailers: VecDeque<Arc<PackTrailer>>,
}

impl RecentPacks {
    /// A good copy of `group` storing `wanted` in one of the recent packs.
    fn find(
        &mut self,
        reader: &V2Reader,
        group: &Id,
        wanted: &[(u16, u16)],
    ) -> Option<GroupLocation> {
        let (i, loc) = self.trailers.iter().enumerate().find_map(|(i, trailer)| {
            let loc = GroupLocation {
                trailer: trailer.clone(),
                group: trailer.group(group)?,
            };
            (!reader.is_quarantined(&loc) && loc.stores(wanted)).then_some((i, loc))
        })?;
        if i > 0 {
            let t = self.trailers.remove(i).expect("found there");
            self.trailers.push_front(t);
        }
        Some(loc)
    }

    fn learn(&mut self, trailer: &Arc<PackTrailer>) {
        self.trailers.retain(|t| t.pack != trailer.pack);
        self.trailers.push_front(trailer.clone());
        self.trailers.truncate(RECENT_PACKS);
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
        let raw = match reader.read_chunk_once(leaf).await {
            Ok(raw) => raw,
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
            let loc = match recent.find(reader, &group, &wanted) {
                Some(loc) => loc,
                None => match reader.locate_group_storing(&group, &wanted).await {
                    Ok(loc) if !reader.is_quarantined(&loc) && loc.stores(&wanted) => {
                        recent.learn(&loc.trailer);
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

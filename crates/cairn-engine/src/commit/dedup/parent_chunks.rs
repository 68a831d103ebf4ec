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
//! this commit did not see is caught by the stale-GC guard, to which every slot reused here is
//! reported). A parent leaf or group that cannot be read or located only means no help here.

use std::collections::HashMap;

use cairn_format::leaf_v2::RunLeaf;
use cairn_format::Id;
use cairn_repo::v2::{Placement, V2Reader};
use cairn_repo::RepoResult;

/// The chunks of one parent leaf, by id: where each is stored, as a leaf names it.
#[derive(Debug, Default)]
pub(crate) struct ParentChunks(HashMap<Id, Placement>);

impl ParentChunks {
    /// The chunks leaf `leaf` names in group copies that are good and store them; empty if the
    /// leaf cannot be read. An error of the store fails the call.
    pub(crate) async fn load(reader: &V2Reader, leaf: &Id) -> RepoResult<ParentChunks> {
        let raw = match reader.read_chunk(leaf).await {
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
            let loc = match reader.locate_group_storing(&group, &wanted).await {
                Ok(loc) if !reader.is_quarantined(&loc) && loc.stores(&wanted) => loc,
                Ok(_) => continue,
                Err(e) if e.is_damage() => continue,
                Err(e) => return Err(e),
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

//! Damaged groups in GC: a quarantined copy of a group is no copy. A live group
//! whose every copy is quarantined is rebuilt — same slot list, so the same id that leaves
//! name — from good copies of its live slots' chunks stored elsewhere (a commit that met
//! the same data stored them again), and written with the repacked groups; the damaged
//! copy's pack can then go. A live group that cannot be rebuilt (some live slot has no good
//! copy anywhere) or a live node without a good copy pins its pack: kept as it is, so that
//! nothing readable is lost and `repair --from IMAGE` can still heal it.
//!
//! Without the rebuild, a version healed by a later commit would depend on that commit's
//! chunks through the read fallback only (no tree names them), and GC would drop them the
//! day that commit's version is deleted.

use std::collections::{HashMap, HashSet};

use cairn_format::group::{Group, GroupBuilder};
use cairn_format::pack::BlobKind;
use cairn_format::Id;
use cairn_repo::Repo;

use super::liveness::{Liveness, Snapshot};
use crate::error::EngineResult;

/// What GC does about quarantined copies of live groups and nodes.
#[derive(Default)]
pub(super) struct Damaged {
    /// Rebuilt groups (by id), each with the slots it stores: written with the repacked ones.
    pub rebuilt: Vec<(Id, Group)>,
    /// Packs kept as they are: they hold the only (damaged) copy of something live that
    /// could not be rebuilt.
    pub pinned: HashSet<Id>,
    /// Packs holding a quarantined copy: rewritten without it (unless pinned).
    pub holding: HashSet<Id>,
}

impl Damaged {
    /// Finds the quarantined copies among `snapshot`'s packs and rebuilds the live groups
    /// that have no good copy.
    pub(super) async fn find(
        repo: &Repo,
        snapshot: &Snapshot,
        live: &(dyn Liveness + Sync),
    ) -> EngineResult<Damaged> {
        let reader = &snapshot.reader;
        let mut out = Damaged::default();
        let mut done: HashSet<Id> = HashSet::new();
        for (pack, trailer) in &snapshot.trailers {
            for (g, group) in trailer.groups.iter().enumerate() {
                let gid = trailer.group_id(g as u32).expect("a group of this trailer");
                if !reader.is_quarantined_copy(pack, &gid) {
                    continue;
                }
                out.holding.insert(*pack);
                match group.kind {
                    BlobKind::Node => {
                        let node = group.desc.chunks[0].id;
                        if live.node_used(&node) && reader.locate_chunk(&node).await.is_err() {
                            out.pinned.insert(*pack);
                        }
                    }
                    BlobKind::Data => {
                        let Some(used) = live.used_slots(&gid) else {
                            continue; // dead: goes with its pack
                        };
                        let runs = used.runs();
                        let good = reader.group_copies(&gid).await.is_ok_and(|copies| {
                            copies
                                .iter()
                                .any(|c| !reader.is_quarantined(c) && c.stores(&runs))
                        });
                        if good || done.contains(&gid) {
                            continue;
                        }
                        // Each live slot's chunk from a good copy elsewhere.
                        let mut bytes: HashMap<usize, bytes::Bytes> = HashMap::new();
                        let mut complete = true;
                        for (slot, c) in group.desc.chunks.iter().enumerate() {
                            if !used.contains(slot) {
                                continue;
                            }
                            match reader.read_chunk(&c.id).await {
                                Ok(b) => {
                                    bytes.insert(slot, b);
                                }
                                Err(e) if e.is_damage() => {
                                    complete = false;
                                    break;
                                }
                                Err(e) => return Err(e.into()),
                            }
                        }
                        if !complete {
                            tracing::warn!(
                                group = %gid, pack = %pack,
                                "a live group's only copy is damaged and some of its chunks are \
                                 stored nowhere else; its pack is kept (`cairn repair --from \
                                 IMAGE` may restore them)"
                            );
                            out.pinned.insert(*pack);
                            continue;
                        }
                        let rebuilt = GroupBuilder::rebuild(&group.desc, |slot| {
                            bytes.get(&slot).map(|b| &b[..])
                        })
                        .finish(repo.config().compression, repo.key());
                        tracing::info!(group = %gid, "rebuilt a damaged group from other copies of its chunks");
                        done.insert(gid);
                        out.rebuilt.push((gid, rebuilt));
                    }
                }
            }
        }
        Ok(out)
    }
}

//! Fast deletion's scope: the packs that may hold what the versions deleted since the last GC
//! used, found through the index by key, so that GC reads their trailers and no others.

use std::collections::HashSet;

use cairn_format::Id;
use cairn_repo::Repo;

use super::group_summaries::LiveUse;
use super::liveness::{incomplete, Snapshot};
use crate::error::EngineResult;
use crate::live::{LiveVersions, RecordSource};

/// The packs fast deletion must read: those the index names for a node or a group slot that
/// the deleted versions `unfreed` used and no live version uses (`live`), and those holding
/// a quarantined copy (so damaged groups are still rebuilt). Every other pack holds nothing
/// that died since the last GC, so its trailer is not read and its index entries are kept as
/// they are. `None` (read every pack) when a deleted version's summary is missing or
/// damaged: what died cannot be told without it.
pub(super) async fn affected_packs(
    repo: &Repo,
    records: &mut RecordSource,
    snapshot: &Snapshot,
    used: &LiveUse,
    unfreed: &[Id],
    versions: &LiveVersions,
) -> EngineResult<Option<HashSet<Id>>> {
    let live = &used.live;
    let live_roots: HashSet<Id> = versions.live.values().filter_map(|r| r.root).collect();
    let mut dead_keys: Vec<u64> = Vec::new();
    let mut done = HashSet::new();
    for v in unfreed {
        let Ok(record) = records.load(repo, v).await else {
            return Ok(None);
        };
        let Some(root) = record.root.filter(|r| !live_roots.contains(r)) else {
            continue;
        };
        if !done.insert(root) {
            continue;
        }
        let loaded;
        let summary = match used.gone.get(&root) {
            Some(summary) => summary,
            None => match repo.load_group_summary(&root).await {
                Ok(Some((summary, _))) => {
                    loaded = summary;
                    &loaded
                }
                Ok(None) => return Ok(None),
                Err(e) if e.is_damage() => return Ok(None),
                Err(e) => return Err(e.into()),
            },
        };
        dead_keys.extend(summary.nodes().iter().filter(|k| !live.has_node_key(**k)));
        for (key, slots) in summary.groups() {
            let still = live.slots_of_key(key);
            if still.is_none_or(|l| slots.iter().any(|s| !l.contains(usize::from(s)))) {
                dead_keys.push(key);
            }
        }
    }
    dead_keys.sort_unstable();
    dead_keys.dedup();
    let mut packs = HashSet::new();
    for key in dead_keys {
        packs.extend(packs_for_key(snapshot, key).await?);
    }
    packs.extend(
        repo.quarantine_markers()
            .await?
            .into_iter()
            .map(|(pack, _)| pack),
    );
    Ok(Some(packs))
}

/// Groups and manifest nodes stored more than once, and the packs their copies are in.
#[derive(Default)]
pub(super) struct Duplicates {
    pub(super) blobs: u64,
    pub(super) packs: HashSet<Id>,
}

/// The packs holding a second copy of a group or node that trees committed since the last GC
/// brought in (`fresh`, keys): commits that ran at once each stored the new data none of them
/// had published yet, under the same ids (a group id names the chunk list, a node id its
/// bytes). Every copy's pack is returned, so that the plan keeps one copy (`PackPlan`) and
/// the others go with the repacking of their packs. A key that only shares its 8 bytes with
/// another's costs a trailer read, nothing more: copies are matched by full id in the
/// trailers.
pub(super) async fn duplicate_packs(
    snapshot: &Snapshot,
    fresh: &[u64],
) -> EngineResult<Duplicates> {
    let mut found = Duplicates::default();
    for &key in fresh {
        let packs = packs_for_key(snapshot, key).await?;
        if packs.len() > 1 {
            found.blobs += 1;
            found.packs.extend(packs);
        }
    }
    Ok(found)
}

/// The packs the index names for `key`; an unreadable run stops GC (it acts only on a
/// complete index).
async fn packs_for_key(snapshot: &Snapshot, key: u64) -> EngineResult<Vec<Id>> {
    crate::interrupt::check()?;
    snapshot
        .reader
        .packs_for_key(key)
        .await
        .map_err(|e| match e {
            e if e.is_damage() => incomplete(e.to_string()),
            e => e.into(),
        })
}

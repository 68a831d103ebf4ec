//! Verify's format 2 half: the same steps as format 1's (packs, records and heads, trees),
//! with packs checked group by group and leaves of group runs checked against the pack
//! trailers that hold their groups.
//!
//! - Every index run is read whole and every section checked.
//! - Each pack in scope is read whole ([`V2Reader::check_pack`]): its id, its trailer, every
//!   group opened and every stored chunk and node hashed against its id. A damaged group's id
//!   and the ids it stores are the "bad blobs" the tree walk meets.
//! - Each leaf's group runs must be located by an index run, name slots the group stores, and
//!   hold the bytes the leaf says; a group found damaged makes the version damaged.
//!
//! A damaged group is quarantined (as format 1 quarantines a damaged blob): no commit dedups
//! against it any more, so the next commit that meets its chunks stores them again — and a
//! version whose damaged group's slots all have good copies elsewhere (by chunk id) reads
//! through them, so it is intact: damage heals. A pack damaged only in groups quarantined
//! before this run is counted (`packs_with_quarantined`), not reported: the next
//! `gc --repair` rewrites it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cairn_format::leaf_v2::{RunExtent, RunLeaf};
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::tree_walk::{walk_tree, GroupedTreeNodes};
use cairn_repo::v2::V2Reader;
use cairn_repo::{Repo, RepoError};
use tokio::task::JoinSet;

use super::{VerifyOptions, VerifyReport};
use crate::error::{EngineError, EngineResult};
use crate::progress::{self, Unit};

/// How many packs are read and checked at once.
const PACKS_IN_FLIGHT: usize = 4;

/// The packs in the store that no index run names, in id order: left by killed commits
/// (garbage `gc` deletes), or named by a run that was lost (`repair` and `gc` index them
/// again when live versions need them).
pub(crate) async fn unindexed_packs(repo: &Repo, named: &[Id]) -> EngineResult<Vec<Id>> {
    let named: HashSet<&Id> = named.iter().collect();
    let mut out: Vec<Id> = repo
        .pack_sizes()
        .await?
        .into_keys()
        .filter(|p| !named.contains(p))
        .collect();
    out.sort();
    Ok(out)
}

/// Step 1 in format 2: reads the packs in scope whole and checks them; returns the ids that
/// cannot be read (damaged groups and what they store) with the reason.
pub(super) async fn check_packs(
    repo: &Arc<Repo>,
    reader: &Arc<V2Reader>,
    versions: &[(Id, VersionRecord)],
    scoped: bool,
    options: &VerifyOptions,
    report: &mut VerifyReport,
) -> EngineResult<HashMap<Id, String>> {
    // Every run a lookup may ask, whole (a damaged section otherwise shows only as the
    // versions whose ids it holds).
    report.problems.extend(reader.check_runs().await?);
    let packs = if scoped {
        packs_used(repo, reader, versions).await
    } else {
        let named = reader.readable_packs().await?;
        report.unindexed_packs = unindexed_packs(repo, &named).await?;
        named
    };
    report.packs_in_scope = packs.len() as u64;
    let packs: Vec<Id> = packs
        .into_iter()
        .filter(|p| options.subset.includes(p))
        .collect();
    progress::start(
        &options.progress,
        "reading packs",
        Unit::Items,
        packs.len() as u64,
    );
    let mut bad = HashMap::new();
    let mut tasks = JoinSet::new();
    let mut pending = packs.into_iter();
    loop {
        crate::interrupt::check()?;
        while tasks.len() < PACKS_IN_FLIGHT {
            let Some(pack) = pending.next() else { break };
            let reader = reader.clone();
            tasks.spawn(async move { (pack, reader.check_pack(&pack).await) });
        }
        let Some(done) = tasks.join_next().await else {
            break;
        };
        let (pack, check) = done.map_err(|e| EngineError::internal("verify task", e))?;
        let check = check?;
        report.packs_checked += 1;
        if check.rescuable {
            report.rescuable_packs.push(pack);
        }
        if check.missing {
            // What it held is unknown (its trailer went with it): the pack is quarantined
            // whole, and reported once; the versions that need it are named below.
            let known = !reader.quarantine_copy(&pack, &pack, 0, "missing");
            match known {
                true => report.packs_with_quarantined += 1,
                false => {
                    report.quarantined += 1;
                    report.problems.extend(check.problems);
                }
            }
            progress::add(&options.progress, 1);
            continue;
        }
        if !check.readable || check.foreign {
            // Its trailer cannot be read, or its bytes are another pack's: what it holds is
            // unknown, so it is quarantined whole (no commit reuses a leaf that may name it
            // until its content is stored again).
            let why = if check.foreign {
                "foreign bytes"
            } else {
                "unreadable"
            };
            reader.quarantine_copy(&pack, &pack, 0, why);
        }
        report.blobs_checked += check.chunks;
        report.read_bytes += check.bytes;
        // Damaged only where earlier runs found it: known, and not used.
        let known = !check.damaged_groups.is_empty()
            && check.problems.len() <= check.damaged_groups.len() + 1
            && check
                .damaged_groups
                .iter()
                .all(|(group, _, _)| reader.is_quarantined_copy(&pack, group));
        if known {
            report.packs_with_quarantined += 1;
        } else {
            report.problems.extend(check.problems);
        }
        for (group, offset, reason) in &check.damaged_groups {
            if reader.quarantine_copy(&pack, group, *offset, reason) {
                report.quarantined += 1;
            }
        }
        // Copies quarantined earlier that read intact now (a transient fault, or a pack
        // put back) are trusted again.
        if check.readable && !check.foreign {
            for group in reader.quarantined_in(&pack) {
                if !check.damaged_groups.iter().any(|(g, _, _)| *g == group) {
                    reader.release_quarantine(&pack, &group).await?;
                }
            }
        }
        bad.extend(check.bad);
        progress::add(&options.progress, 1);
    }
    Ok(bad)
}

/// The packs that hold what `versions` use (their nodes and groups), as far as their trees
/// can be read and their ids located (what cannot be is reported by the tree walk).
async fn packs_used(
    repo: &Arc<Repo>,
    reader: &V2Reader,
    versions: &[(Id, VersionRecord)],
) -> Vec<Id> {
    let mut used = GroupedTreeNodes {
        skip_unreadable: true,
        ..Default::default()
    };
    let mut nodes: &Repo = repo;
    for (_, record) in versions {
        let Some(root) = record.root else { continue };
        let walk = walk_tree(&mut nodes, root, record.height, record.fanout, &mut used);
        if let Err(e) = walk.await {
            tracing::debug!("reading the tree of {}@{}: {e}", record.image, record.seq);
        }
    }
    let mut packs = HashSet::new();
    let mut groups = HashSet::new();
    for id in &used.nodes {
        if let Ok((trailer, _)) = reader.locate_chunk(id).await {
            packs.insert(trailer.pack);
        }
    }
    for leaf in &used.leaves {
        let Ok(raw) = repo.read_blob(leaf).await else {
            continue;
        };
        if let Ok(leaf) = RunLeaf::decode(&raw) {
            groups.extend(leaf.groups());
        }
    }
    for group in &groups {
        if let Ok(loc) = reader.locate_group(group).await {
            packs.insert(loc.trailer.pack);
        }
    }
    let mut packs: Vec<Id> = packs.into_iter().collect();
    packs.sort_unstable();
    packs
}

/// Whether every chunk of slots `first .. first + count` of group `group` (as a quarantined
/// copy's trailer lists them) has a good copy somewhere; the first that has none fails.
async fn slots_elsewhere(
    reader: &V2Reader,
    group: &Id,
    first: u16,
    count: u16,
) -> Result<(), RepoError> {
    let chunks = reader.run_chunks(group, first, count).await?;
    for c in &chunks {
        reader.locate_chunk(&c.id).await?;
    }
    Ok(())
}

/// What is wrong with the leaf of group runs `id` (`raw`, read and checked), if anything.
pub(super) async fn check_run_leaf(
    reader: &V2Reader,
    bad: &HashMap<Id, String>,
    id: &Id,
    raw: &[u8],
    record: &VersionRecord,
) -> Option<String> {
    let leaf = match RunLeaf::decode(raw) {
        Ok(leaf) => leaf,
        Err(e) => return Some(format!("manifest node {id}: {e}")),
    };
    if leaf.len() > u64::from(record.segment_size) {
        return Some(format!("manifest leaf {id} is longer than a segment"));
    }
    for extent in leaf.extents() {
        let RunExtent::Run {
            group,
            first,
            count,
            len,
        } = *extent
        else {
            continue;
        };
        let loc = match reader.locate_group_storing(&group, &[(first, count)]).await {
            Ok(loc) => loc,
            // Every copy damaged: intact still if each slot's chunk has a good copy elsewhere
            // (a later commit stored it again), which is where reads then take it from.
            Err(RepoError::Quarantined { .. }) => {
                match slots_elsewhere(reader, &group, first, count).await {
                    Ok(()) => continue,
                    Err(e) => {
                        return Some(match bad.get(&group) {
                            Some(reason) => format!("group damaged: {reason}"),
                            None => format!("group {group}: {e}"),
                        })
                    }
                }
            }
            Err(RepoError::BlobMissing { .. }) => {
                return Some(format!("group {group} is missing from every index run"))
            }
            Err(e) => return Some(format!("group {group}: {e}")),
        };
        let desc = &loc.trailer.groups[loc.group as usize].desc;
        let slots = desc
            .chunks
            .get(usize::from(first)..usize::from(first) + usize::from(count));
        let held = match slots {
            Some(slots) if slots.iter().all(|c| c.stored) => {
                slots.iter().map(|c| u64::from(c.len)).sum::<u64>()
            }
            _ => {
                return Some(format!(
                    "leaf {id} names slots {first}..{} of group {group}, which stores {} slots \
                     (or not all of these)",
                    u32::from(first) + u32::from(count),
                    desc.chunks.len()
                ))
            }
        };
        if held != u64::from(len) {
            return Some(format!(
                "leaf {id}: slots {first}..{} of group {group} hold {held} bytes, the leaf \
                 says {len}",
                u32::from(first) + u32::from(count)
            ));
        }
    }
    None
}

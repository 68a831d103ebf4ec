//! What stays lost after `cairn repair`: the chunks and nodes live versions need that no
//! good copy holds, and per version how many.

use std::collections::{BTreeMap, HashSet};

use cairn_format::leaf_v2::RunLeaf;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::tree_walk::{walk_tree, NodeAt, TreeVisitor};
use cairn_repo::v2::V2Reader;
use cairn_repo::{Repo, RepoError};

use super::LostVersion;
use crate::error::{EngineError, EngineResult};
use crate::live::LiveVersions;

/// What live versions need that no good copy holds: the chunks of group runs neither a good
/// copy of their group nor a good copy of the chunk elsewhere stores (a group no trailer
/// describes counts as itself), and unreadable manifest nodes; and per version how many.
/// Locations only are checked (damage nobody has read yet is `verify`'s to find).
pub(super) async fn lost_blobs(
    repo: &Repo,
    live: &LiveVersions,
) -> EngineResult<(HashSet<Id>, Vec<LostVersion>)> {
    let reader = repo
        .v2()
        .ok_or_else(|| EngineError::internal("repair", "format 2 repair of format 1"))?;
    let mut lost: HashSet<Id> = HashSet::new();
    let mut per_version = Vec::new();
    // Leaf (or unreadable node) → what is lost under it: versions share them.
    let mut memo: BTreeMap<Id, Vec<Id>> = BTreeMap::new();
    for (id, record) in in_order(live) {
        let Some(root) = record.root else { continue };
        let mut visit = Leaves::default();
        let mut nodes = repo;
        walk_tree(&mut nodes, root, record.height, record.fanout, &mut visit).await?;
        let mut mine: HashSet<Id> = visit.unreadable.iter().copied().collect();
        for leaf in visit.leaves {
            let found = match memo.get(&leaf) {
                Some(found) => found,
                None => {
                    let found = lost_in_leaf(repo, reader, &leaf).await?;
                    memo.entry(leaf).or_insert(found)
                }
            };
            mine.extend(found.iter().copied());
        }
        tally(&mut lost, &mut per_version, id, record, mine);
    }
    Ok((lost, per_version))
}

/// What is lost under leaf `id`: itself if it cannot be read, else the chunks of its runs
/// that no good copy holds.
async fn lost_in_leaf(repo: &Repo, reader: &V2Reader, id: &Id) -> EngineResult<Vec<Id>> {
    let leaf = match repo.read_blob(id).await {
        Ok(raw) => {
            RunLeaf::decode(&raw).map_err(|e| RepoError::corrupt(format!("manifest node {id}"), e))
        }
        Err(e) => Err(e),
    };
    let leaf = match leaf {
        Ok(leaf) => leaf,
        Err(e) if e.is_damage() => return Ok(vec![*id]),
        Err(e) => return Err(e.into()),
    };
    let mut lost = Vec::new();
    for (group, first, count) in leaf.group_runs() {
        let wanted = [(first, count)];
        match reader.locate_group_storing(&group, &wanted).await {
            Ok(loc) if loc.stores(&wanted) => continue,
            Ok(_) => {}
            Err(e) if e.is_damage() => {}
            Err(e) => return Err(e.into()),
        }
        // No good copy of the group stores the run: each slot's chunk, wherever it is.
        let chunks = match reader.run_chunks(&group, first, count).await {
            Ok(chunks) => chunks,
            Err(e) if e.is_damage() => {
                lost.push(group); // no trailer describes it
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        for c in &chunks {
            match reader.locate_chunk(&c.id).await {
                Ok(_) => {}
                Err(e) if e.is_damage() => lost.push(c.id),
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(lost)
}

/// The leaves of a format 2 tree (unread), and the interior nodes that cannot be read.
#[derive(Default)]
struct Leaves {
    leaves: Vec<Id>,
    unreadable: Vec<Id>,
}

impl TreeVisitor<RepoError> for Leaves {
    fn enter(&mut self, at: &NodeAt) -> bool {
        if at.level == 0 {
            self.leaves.push(at.id);
            return false;
        }
        true
    }

    fn unreadable(&mut self, at: &NodeAt, e: RepoError) -> Result<(), RepoError> {
        if !e.is_damage() {
            return Err(e);
        }
        self.unreadable.push(at.id);
        Ok(())
    }
}

/// The live versions by image and number.
fn in_order(live: &LiveVersions) -> Vec<(&Id, &VersionRecord)> {
    let mut records: Vec<(&Id, &VersionRecord)> = live.live.iter().collect();
    records.sort_by(|a, b| (&a.1.image, a.1.seq).cmp(&(&b.1.image, b.1.seq)));
    records
}

/// Adds what version `id` lacks (`mine`) to the totals.
fn tally(
    lost: &mut HashSet<Id>,
    per_version: &mut Vec<LostVersion>,
    id: &Id,
    record: &VersionRecord,
    mine: HashSet<Id>,
) {
    if mine.is_empty() {
        return;
    }
    lost.extend(mine.iter().copied());
    per_version.push(LostVersion {
        image: record.image.clone(),
        seq: record.seq,
        id: *id,
        missing_blobs: mine.len() as u64,
    });
}

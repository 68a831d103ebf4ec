//! Reference summaries on the GC side: what the live versions use, read from one
//! merged summary per image (`cairn_format::merged_summary`) kept up with the summaries of
//! trees deleted or committed since (`cairn_format::group_summary`), instead of walking
//! every tree. A missing or damaged summary is rebuilt from its tree, counted as a commit
//! writes it (and stored again, unless dry run).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use cairn_format::group_summary::{GroupSummary, SummaryBuilder};
use cairn_format::leaf_v2::RunLeaf;
use cairn_format::merged_summary::{tree_changes, MergedSummary};
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::tree_walk::{decode_interior, NodeReader};
use cairn_repo::v2::V2Reader;
use cairn_repo::{Repo, RepoError};

use super::live_set::LiveSet;
use super::liveness::Nodes;
use super::summary_bases::SummaryBases;
use super::{unreadable_live_tree, GcOptions, GcReport};
use crate::commit::base_summary::add_leaf;
use crate::error::{EngineError, EngineResult};
use crate::live::LiveVersions;
use crate::progress::{self, Unit};

/// What the live trees use, and the summaries read on the way of trees no longer live.
pub(super) struct LiveUse {
    /// What every live tree uses, asked of the images' merges.
    pub(super) live: LiveSet,
    /// Summaries of trees subtracted from a merge, by root (fast deletion's `affected_packs`
    /// needs those of the deleted versions: they are not read twice).
    pub(super) gone: HashMap<Id, GroupSummary>,
    /// The chains the merges named as read, and name now.
    pub(super) bases: SummaryBases,
    /// Keys of the groups and nodes that trees committed since the last GC brought into
    /// their image's merge (sorted, no repeats): the only ones a concurrent commit can have
    /// stored a second copy of since then (`affected::duplicate_packs`).
    pub(super) fresh_keys: Vec<u64>,
}

/// What every live tree uses, through one merged summary per image
/// (`cairn_format::merged_summary`): a merge's trees that are no longer live are subtracted,
/// live trees it does not count are added (their own summaries read), and the merge is
/// written back for the next GC (unless dry run). So a GC reads one object per image plus
/// the summaries of trees deleted or committed since the last GC, not one per live version.
/// A merge that is damaged, or counts a tree whose summary is gone or changed, is built
/// again from its trees' summaries.
pub(super) async fn live_summary(
    repo: &Repo,
    reader: &V2Reader,
    live: &LiveVersions,
    options: &GcOptions,
    report: &mut GcReport,
) -> EngineResult<LiveUse> {
    // Each image's live trees, with a version that has the tree (to rebuild its summary).
    let mut images: BTreeMap<&str, BTreeMap<Id, &VersionRecord>> = BTreeMap::new();
    for record in live.live.values() {
        if let Some(root) = record.root {
            let trees = images.entry(record.image.as_str()).or_default();
            trees.entry(root).or_insert(record);
        }
    }
    let mut stored: BTreeMap<String, Vec<(String, MergedSummary)>> = BTreeMap::new();
    let mut obsolete: Vec<String> = Vec::new();
    let mut bases = SummaryBases::default();
    for (key, merged, len) in repo.merged_summaries().await? {
        report.summary_bytes += len;
        report.summaries_read += 1;
        if let Ok(m) = &merged {
            bases.read(m);
        }
        match merged {
            Ok(m) if images.contains_key(m.image.as_str()) => {
                stored.entry(m.image.clone()).or_default().push((key, m));
            }
            Ok(_) => obsolete.push(key), // no live tree left in its image
            Err(e) if e.is_damage() => {
                tracing::warn!("{e}; building the merged summary again");
                // Deleted now, not with the obsolete ones: the merge built again may have
                // its content id, and would not be written over it.
                if !options.dry_run {
                    repo.delete_merged_summary(&key).await?;
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    progress::start(
        &options.progress,
        "loading live summaries",
        Unit::Items,
        images.len() as u64,
    );
    let mut gone = HashMap::new();
    let mut fresh_keys = Vec::new();
    let mut merges = Vec::with_capacity(images.len());
    for (image, trees) in &images {
        progress::add(&options.progress, 1);
        let live_roots: BTreeSet<Id> = trees.keys().copied().collect();
        // A GC killed between writing a merge and deleting the one it replaces leaves two:
        // the one with the fewest trees to subtract is used, the others deleted.
        let mut candidates = stored.remove(*image).unwrap_or_default();
        candidates.sort_by_cached_key(|(_, m)| tree_changes(m, &live_roots).0.len());
        let mut kept: Option<(String, MergedSummary, bool)> = None;
        for (key, mut merged) in candidates {
            if kept.is_none() {
                if let Some(changed) =
                    subtract_gone(repo, &mut merged, &live_roots, &mut gone, report).await?
                {
                    kept = Some((key, merged, changed));
                    continue;
                }
            }
            obsolete.push(key);
        }
        let (old_key, mut merged, mut changed) = match kept {
            Some((key, merged, changed)) => (Some(key), merged, changed),
            None => (None, MergedSummary::new(image), true),
        };
        for root in tree_changes(&merged, &live_roots).1 {
            let (summary, chain) =
                ensure_group_summary(repo, reader, trees[&root], !options.dry_run, report).await?;
            fresh_keys.extend(
                summary
                    .groups()
                    .map(|(key, _)| key)
                    .filter(|key| merged.slots_of_key(*key).is_none()),
            );
            fresh_keys.extend(
                summary
                    .nodes()
                    .iter()
                    .filter(|key| !merged.has_node_key(**key)),
            );
            merged.add_tree(&root, &summary, &chain);
            changed = true;
        }
        bases.kept(&merged);
        if changed && !options.dry_run {
            let (key, _) = repo.put_merged_summary(&merged).await?;
            obsolete.extend(old_key.filter(|old| *old != key));
        }
        merges.push(merged);
    }
    if !options.dry_run {
        for key in obsolete {
            repo.delete_merged_summary(&key).await?;
        }
    }
    fresh_keys.sort_unstable();
    fresh_keys.dedup();
    Ok(LiveUse {
        live: LiveSet::new(merges),
        gone,
        bases,
        fresh_keys,
    })
}

/// Subtracts from `merged` the trees it counts that are not in `live_roots`, each with its
/// own summary (kept in `gone`). `Some(changed)`, or `None` when a tree cannot be subtracted
/// (its summary is missing, damaged, or not the one the merge counted): the merge is then
/// dropped and built again.
async fn subtract_gone(
    repo: &Repo,
    merged: &mut MergedSummary,
    live_roots: &BTreeSet<Id>,
    gone: &mut HashMap<Id, GroupSummary>,
    report: &mut GcReport,
) -> EngineResult<Option<bool>> {
    let (to_subtract, _) = tree_changes(merged, live_roots);
    for root in &to_subtract {
        if !gone.contains_key(root) {
            match repo.load_group_summary(root).await {
                Ok(Some((summary, read))) => {
                    report.summary_bytes += read;
                    report.summaries_read += 1;
                    gone.insert(*root, summary);
                }
                Ok(None) => {
                    tracing::warn!(image = %merged.image, %root, "the merged summary counts a tree without a summary; building it again");
                    return Ok(None);
                }
                Err(e) if e.is_damage() => {
                    tracing::warn!(image = %merged.image, "{e}; building the merged summary again");
                    return Ok(None);
                }
                Err(e) => return Err(e.into()),
            }
        }
        if let Err(e) = merged.remove_tree(root, &gone[root]) {
            tracing::warn!(image = %merged.image, "merged summary: {e}; building it again");
            return Ok(None);
        }
    }
    Ok(Some(!to_subtract.is_empty()))
}

/// The summary of `record`'s tree and the chain it is resolved through; rebuilt by walking
/// the tree (every node read through `reader` and checked) when it or its chain is missing
/// or damaged, and stored whole if `store_rebuilt`. A tree that cannot be read fails it:
/// nothing may be deleted on an incomplete summary.
async fn ensure_group_summary(
    repo: &Repo,
    reader: &V2Reader,
    record: &VersionRecord,
    store_rebuilt: bool,
    report: &mut GcReport,
) -> EngineResult<(GroupSummary, Vec<Id>)> {
    let root = record
        .root
        .expect("only versions with a tree have summaries");
    let mut damaged = false;
    match repo.resolve_group_summary(&root).await {
        Ok(Some((mut resolved, read))) => {
            report.summary_bytes += read;
            report.summaries_read += 1;
            resolved.chain.pop(); // its own root
            return Ok((resolved.summary, resolved.chain));
        }
        Ok(None) => tracing::warn!(%root, "no reference summary; rebuilding it"),
        Err(e) if e.is_damage() => {
            tracing::warn!(%root, "{e}; rebuilding the reference summary");
            damaged = true;
        }
        Err(e) => return Err(e.into()),
    }
    let summary = counted_summary(reader, record, &mut report.metadata_read_bytes)
        .await
        .map_err(|e| unreadable_live_tree(record, e))?;
    if store_rebuilt {
        if damaged {
            repo.delete_summary(&root).await?; // summaries are put-if-absent
        }
        repo.put_group_summary(&root, &summary, None).await?;
    }
    Ok((summary, Vec::new()))
}

/// The counted summary of `record`'s tree, from the tree: every node, and a reference per run
/// of each leaf occurrence, as the commit that made the tree counts them — so the next commit
/// can derive its own from it. Level by level from the root, each distinct node is read once
/// and carries how many times it occurs (a subtree that occurs twice counts its leaves
/// twice).
async fn counted_summary(
    reader: &V2Reader,
    record: &VersionRecord,
    bytes_read: &mut u64,
) -> EngineResult<GroupSummary> {
    let mut summary = SummaryBuilder::counted();
    let Some(root) = record.root else {
        return Ok(GroupSummary::counted());
    };
    let mut nodes = Nodes { reader, bytes_read };
    let mut level_nodes: HashMap<Id, u64> = HashMap::from([(root, 1)]);
    for level in (1..=record.height).rev() {
        let mut below: HashMap<Id, u64> = HashMap::new();
        for (id, n) in &level_nodes {
            let raw = nodes.read_node(id).await?;
            let node = decode_interior(id, level, &raw).map_err(EngineError::from)?;
            summary.add_node(id);
            for (_, child) in &node.children {
                *below.entry(*child).or_default() += n;
            }
        }
        level_nodes = below;
    }
    for (id, n) in &level_nodes {
        let raw = nodes.read_node(id).await?;
        let leaf = RunLeaf::decode(&raw)
            .map_err(|e| RepoError::corrupt(format!("manifest node {id}"), e))?;
        summary.add_node(id);
        add_leaf(&mut summary, &leaf, *n);
    }
    Ok(summary.finish().expect("a summary of adds only"))
}

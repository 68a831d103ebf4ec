//! Format 2's reference summaries on the GC side: what the live versions use, read from one
//! summary per live tree (`cairn_format::group_summary`) instead of walking every tree. A
//! missing or damaged summary is rebuilt from its tree, counted as a commit writes it (and
//! stored again, unless dry run).

use std::collections::{HashMap, HashSet};

use cairn_format::group_summary::GroupSummary;
use cairn_format::leaf_v2::RunLeaf;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::tree_walk::{decode_interior, NodeReader};
use cairn_repo::v2::V2Reader;
use cairn_repo::{Repo, RepoError};

use super::grouped::Nodes;
use super::{unreadable_live_tree, GcOptions, GcReport};
use crate::commit::base_summary::add_leaf;
use crate::error::{EngineError, EngineResult};
use crate::live::LiveVersions;
use crate::progress::{self, Unit};

/// The union of the summaries of every live tree.
pub(super) async fn live_summary(
    repo: &Repo,
    reader: &V2Reader,
    live: &LiveVersions,
    options: &GcOptions,
    report: &mut GcReport,
) -> EngineResult<GroupSummary> {
    let mut records: Vec<&VersionRecord> = live.live.values().collect();
    records.sort_by_key(|r| r.root);
    progress::start(
        &options.progress,
        "loading live summaries",
        Unit::Items,
        records.len() as u64,
    );
    let mut merged = GroupSummary::default();
    let mut roots = HashSet::new();
    for record in records {
        progress::add(&options.progress, 1);
        let Some(root) = record.root else { continue };
        if roots.insert(root) {
            let summary =
                ensure_group_summary(repo, reader, record, !options.dry_run, report).await?;
            merged.merge(&summary);
        }
    }
    Ok(merged)
}

/// The summary of `record`'s tree; rebuilt by walking the tree (every node read through
/// `reader` and checked) when it is missing or damaged, and stored if `store_rebuilt`. A
/// tree that cannot be read fails it: nothing may be deleted on an incomplete summary.
async fn ensure_group_summary(
    repo: &Repo,
    reader: &V2Reader,
    record: &VersionRecord,
    store_rebuilt: bool,
    report: &mut GcReport,
) -> EngineResult<GroupSummary> {
    let root = record
        .root
        .expect("only versions with a tree have summaries");
    let mut damaged = false;
    match repo.load_group_summary(&root).await {
        Ok(Some((summary, read))) => {
            report.summary_bytes += read;
            return Ok(summary);
        }
        Ok(None) => tracing::warn!(%root, "no reference summary; rebuilding it"),
        Err(e) if e.is_damage() => {
            tracing::warn!(%root, "{e}; rebuilding the reference summary");
            damaged = true;
        }
        Err(e) => return Err(e.into()),
    }
    let summary = counted_summary(reader, record, &mut report.metadata_bytes_read)
        .await
        .map_err(|e| unreadable_live_tree(record, e))?;
    if store_rebuilt {
        if damaged {
            repo.delete_summary(&root).await?; // summaries are put-if-absent
        }
        repo.put_group_summary(&root, &summary).await?;
    }
    Ok(summary)
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
    let mut summary = GroupSummary::counted();
    let Some(root) = record.root else {
        return Ok(summary);
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
    Ok(summary)
}

//! A format 2 tree's reference summary when the commit reused leaves of a base version
//! without reading them (the parent fast path finds them by the digests its level-1 nodes
//! carry; a patch keeps its untouched segments' leaves). What those leaves use comes from the
//! base's own summary instead, which is counted (`cairn_format::group_summary`: a reference
//! per leaf occurrence per run): the base's counts, minus the base's leaf occurrences that
//! are not among the reused ones, plus reused occurrences the base did not have, are exactly
//! what the reused leaves use. Only the leaves of those two differences are read — the ones
//! a commit changed — never the ones it kept, and the summary stays exact: fast deletion
//! leaks nothing through it.
//!
//! Without a counted base summary (one written before counts existed) or when the
//! differences are the larger set, the reused leaves themselves are read; the new summary is
//! counted either way, so the next commit takes the cheap path.

use std::collections::HashMap;
use std::sync::Arc;

use cairn_format::group_summary::{GroupSummary, Resolved, SummaryBuilder};
use cairn_format::leaf_v2::RunLeaf;
use cairn_format::Id;
use cairn_repo::{Repo, RepoError};

use crate::error::EngineResult;

/// The base's summary resolved from its chain (the new tree's summary is stored as a delta
/// from it), or `None` (logged) when it is missing or cannot be read: the caller then reads
/// the leaves it would have covered, and the new summary is stored whole.
pub(crate) async fn load_base_summary(repo: &Repo, root: Option<Id>) -> Option<Resolved> {
    let root = root?;
    match repo.resolve_group_summary(&root).await {
        Ok(Some((resolved, _))) => Some(resolved),
        Ok(None) => {
            tracing::debug!(%root, "base has no reference summary; its leaves are read");
            None
        }
        Err(e) => {
            tracing::warn!(%root, "{e}; the base's leaves are read instead of its summary");
            None
        }
    }
}

/// Completes the counted `summary` — every node of the new tree and a reference per run of
/// each leaf occurrence this commit built or read — with the references of the `unread` leaf
/// occurrences (one entry per segment that reuses a base leaf unread). `base_leaves` lists
/// the base tree's leaf occurrences (one entry per segment with a leaf) and `base` is its
/// summary (copied: it is also what the new summary's delta is taken against).
pub(crate) async fn complete_summary(
    repo: &Arc<Repo>,
    base: Option<&Resolved>,
    unread: &[Id],
    base_leaves: &[Id],
    summary: &mut GroupSummary,
) -> EngineResult<()> {
    if unread.is_empty() {
        return Ok(());
    }
    let unread = occurrences(unread);
    if let Some(base) = base.map(|b| &b.summary).filter(|s| s.is_counted()) {
        let in_base = occurrences(base_leaves);
        let surplus = |of: &HashMap<Id, u64>, over: &HashMap<Id, u64>| -> Vec<(Id, u64)> {
            of.iter()
                .filter_map(|(id, &n)| {
                    let m = over.get(id).copied().unwrap_or(0);
                    (n > m).then(|| (*id, n - m))
                })
                .collect()
        };
        let dropped = surplus(&in_base, &unread);
        let added = surplus(&unread, &in_base);
        if dropped.len() + added.len() <= unread.len() {
            if let Some(reused) = derive(repo, base.clone(), &dropped, &added).await? {
                summary.merge(&reused);
                return Ok(());
            }
        } else {
            tracing::debug!(
                changed = dropped.len() + added.len(),
                reused = unread.len(),
                "more leaves changed than were reused: the reused ones are read"
            );
        }
    }
    let mut reused = SummaryBuilder::from(std::mem::take(summary));
    for (id, n) in &unread {
        add_leaf(&mut reused, &read_leaf(repo, id).await?, *n);
    }
    *summary = reused.finish().expect("a summary of adds only");
    Ok(())
}

/// What the reused leaves use, from the `base`'s counted summary: minus the `dropped` leaf
/// occurrences, plus the `added` ones. `None` (logged) when a dropped leaf cannot be read or
/// the base's summary does not hold its references (it does not describe its tree): the
/// caller reads the reused leaves instead.
async fn derive(
    repo: &Repo,
    mut base: GroupSummary,
    dropped: &[(Id, u64)],
    added: &[(Id, u64)],
) -> EngineResult<Option<GroupSummary>> {
    // The base's nodes are not the new tree's (the new summary lists all of its own).
    base.clear_nodes();
    let mut base = SummaryBuilder::from(base);
    for (id, n) in dropped {
        let leaf = match read_leaf(repo, id).await {
            Ok(leaf) => leaf,
            // A dropped leaf this session cannot read (a pending GC is deleting it: its
            // version is gone).
            Err(e) if e.is_damage() => {
                tracing::debug!(%id, "{e}; the reused leaves are read instead");
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        for _ in 0..*n {
            for (group, first, count) in leaf.group_runs() {
                base.remove_run(&group, first, count);
            }
        }
    }
    for (id, n) in added {
        add_leaf(&mut base, &read_leaf(repo, id).await?, *n);
    }
    match base.finish() {
        Ok(reused) => Ok(Some(reused)),
        Err(e) => {
            tracing::warn!("base summary: {e}; the reused leaves are read instead");
            Ok(None)
        }
    }
}

/// Adds `n` references to every run of `leaf` (`n` occurrences of it in a tree).
pub(crate) fn add_leaf(summary: &mut SummaryBuilder, leaf: &RunLeaf, n: u64) {
    for _ in 0..n {
        for (group, first, count) in leaf.group_runs() {
            summary.add_run(&group, first, count);
        }
    }
}

/// How many times each id occurs.
fn occurrences(ids: &[Id]) -> HashMap<Id, u64> {
    let mut out = HashMap::with_capacity(ids.len());
    for id in ids {
        *out.entry(*id).or_default() += 1;
    }
    out
}

/// Reads and decodes the v2 leaf `id` (read once: not cached).
pub(crate) async fn read_leaf(repo: &Repo, id: &Id) -> EngineResult<RunLeaf> {
    let raw = repo.read_node_once(id).await?;
    Ok(RunLeaf::decode(&raw).map_err(|e| RepoError::corrupt(format!("manifest node {id}"), e))?)
}

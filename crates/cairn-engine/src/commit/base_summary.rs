//! A format 2 tree's reference summary when the commit reused leaves of a base version
//! without reading them (the parent fast path finds them by the digests its level-1 nodes
//! carry; a patch keeps its untouched segments' leaves). What those leaves use comes from the
//! base's own summary instead, merged in as a superset: the slots the base used and the new
//! tree may not are counted as stale (listed, perhaps no longer used: a leak fast deletion
//! tolerates, never a loss). Once stale slots would pass [`STALE_BOUND`] of the table, the
//! reused leaves are read and the summary is exact again, so the leak stays bounded and its
//! cost amortized.

use std::sync::Arc;

use cairn_format::group_summary::GroupSummary;
use cairn_format::leaf_v2::RunLeaf;
use cairn_format::Id;
use cairn_repo::{Repo, RepoError};

use crate::error::EngineResult;

/// Stale slots a merged summary may carry, as a fraction of the slots it lists (1/N). Each
/// stale slot is data fast deletion keeps until `gc --repair`: at 1/8 the GC stress test's
/// leak check measured 1.27–1.85% of the repository left to the exact pass, at 1/32
/// 0.45–0.79%, at 1/64 0.16% (exact summaries: 0%). 1/64 keeps that leak well under its 1%
/// bound; a commit that changes more than ~1.5% of an image's slots since the last exact
/// summary then reads the reused leaves (as every commit did before level-1 digests).
const STALE_BOUND: u64 = 64;

/// The base's summary, or `None` (logged) when it is missing or cannot be read: the caller
/// then reads the leaves it would have covered.
pub(crate) async fn load_base_summary(repo: &Repo, root: Option<Id>) -> Option<GroupSummary> {
    let root = root?;
    match repo.load_group_summary(&root).await {
        Ok(Some((summary, _))) => Some(summary),
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

/// Completes `summary` — every node of the new tree and the group runs of the leaves this
/// commit built — with what the `unexpanded` leaves use: `base` (the summary of the version
/// they come from) merged in, its stale count raised by the slots of the `replaced` base
/// leaves (no longer in the new tree) that no built leaf uses; or, without a base summary or
/// past [`STALE_BOUND`], the `unexpanded` leaves read one by one.
pub(crate) async fn complete_summary(
    repo: &Arc<Repo>,
    base: Option<GroupSummary>,
    unexpanded: &[Id],
    replaced: &[Id],
    summary: &mut GroupSummary,
) -> EngineResult<()> {
    if unexpanded.is_empty() {
        return Ok(());
    }
    if let Some(mut base) = base {
        let mut stale = Some(0u64);
        for id in replaced.iter().filter(|id| !summary.has_node(id)) {
            // A dropped leaf this session cannot read (a pending GC is deleting it: its
            // version is gone) leaves its stale slots unknown: the summary is made exact.
            let leaf = match read_leaf(repo, id).await {
                Ok(leaf) => leaf,
                Err(e) if e.is_damage() => {
                    tracing::debug!(%id, "{e}; an exact reference summary instead");
                    stale = None;
                    break;
                }
                Err(e) => return Err(e),
            };
            for (group, first, count) in leaf.group_runs() {
                let used = summary.slots(&group);
                let run = usize::from(first)..usize::from(first) + usize::from(count);
                let dropped = run
                    .filter(|&s| !used.is_some_and(|u| u.contains(s)))
                    .count();
                stale = stale.map(|n| n + dropped as u64);
            }
        }
        base.stale_slots = stale.map_or(u64::MAX, |n| base.stale_slots.saturating_add(n));
        if base.stale_slots.saturating_mul(STALE_BOUND) <= base.slot_count() {
            // The base's nodes are not the new tree's (it lists all of its own).
            base.nodes.clear();
            summary.merge(&base);
            return Ok(());
        }
        tracing::debug!(
            stale = base.stale_slots,
            slots = base.slot_count(),
            "stale slots past the bound: the reused leaves are read for an exact summary"
        );
    }
    for id in unexpanded {
        for (group, first, count) in read_leaf(repo, id).await?.group_runs() {
            summary.add_run(&group, first, count);
        }
    }
    Ok(())
}

/// Reads and decodes the v2 leaf `id`.
pub(crate) async fn read_leaf(repo: &Repo, id: &Id) -> EngineResult<RunLeaf> {
    let raw = repo.read_blob(id).await?;
    Ok(RunLeaf::decode(&raw).map_err(|e| RepoError::corrupt(format!("manifest node {id}"), e))?)
}

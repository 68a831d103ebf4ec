//! Which reference summaries of trees no version has any more GC keeps: those a live tree's
//! summary, stored as a delta (`cairn_format::group_summary`, "delta"), is resolved through.
//! The merged summaries name each counted tree's chain (by root key), so fast deletion knows
//! them without reading the live trees' summaries; the chains of live trees no merge counts
//! (committed while GC ran, or every tree in the exact pass) are read from their summaries.

use std::collections::HashSet;

use cairn_format::group_summary::key_of;
use cairn_format::merged_summary::MergedSummary;
use cairn_format::Id;
use cairn_repo::Repo;

use crate::error::EngineResult;

#[derive(Debug, Default)]
pub(super) struct SummaryBases {
    /// Chains (root keys) the merges named when GC read them: summaries kept as bases until
    /// now, each judged again.
    before: HashSet<u64>,
    /// Keys of the roots the live trees' summaries are resolved through, as far as known.
    now: HashSet<u64>,
    /// Live roots whose chains `now` holds.
    covered: HashSet<Id>,
}

impl SummaryBases {
    /// Notes the chains of a merge as read from the store.
    pub(super) fn read(&mut self, merge: &MergedSummary) {
        self.before.extend(merge.chain_keys());
    }

    /// Notes the chains of a merge kept up to date: its trees' chains are known.
    pub(super) fn kept(&mut self, merge: &MergedSummary) {
        self.now.extend(merge.chain_keys());
        self.covered.extend(merge.trees());
    }

    /// Reads the chains of the `live_roots` not covered yet.
    pub(super) async fn cover(
        &mut self,
        repo: &Repo,
        live_roots: &HashSet<Id>,
    ) -> EngineResult<()> {
        for live in live_roots {
            if self.covered.insert(*live) {
                match repo.summary_chain(live).await {
                    Ok(chain) => self.now.extend(chain.iter().map(key_of)),
                    // A damaged summary is rebuilt whole: it needs no chain.
                    Err(e) if e.is_damage() => tracing::warn!(%live, "{e}"),
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(())
    }

    /// The keys of the summaries kept as bases until now that no live chain needs (after
    /// [`cover`]).
    ///
    /// [`cover`]: SummaryBases::cover
    pub(super) fn no_longer_needed(&mut self) -> HashSet<u64> {
        let before = std::mem::take(&mut self.before);
        before.difference(&self.now).copied().collect()
    }

    /// Whether a summary whose tree no live version has may be deleted (after [`cover`]):
    /// no live tree's summary is resolved through it.
    ///
    /// [`cover`]: SummaryBases::cover
    pub(super) fn needed(&self, root: &Id) -> bool {
        self.now.contains(&key_of(root))
    }
}

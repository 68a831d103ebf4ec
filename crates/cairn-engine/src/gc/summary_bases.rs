//! Which reference summaries of trees no version has any more GC keeps: those a live tree's
//! summary, stored as a delta (`cairn_format::group_summary`, "delta"), is resolved through.
//! The merged summaries name each counted tree's chain, so fast deletion knows them without
//! reading the live trees' summaries; the chains of live trees no merge counts (committed
//! while GC ran, or every tree in the exact pass) are read from their summaries.

use std::collections::HashSet;

use cairn_format::merged_summary::MergedSummary;
use cairn_format::Id;
use cairn_repo::Repo;

use crate::error::EngineResult;

#[derive(Debug, Default)]
pub(super) struct SummaryBases {
    /// Chains the merges named when GC read them: summaries kept as bases until now, each
    /// judged again.
    pub(super) before: HashSet<Id>,
    /// Roots the live trees' summaries are resolved through, as far as known.
    pub(super) now: HashSet<Id>,
    /// Live roots whose chains `now` holds.
    covered: HashSet<Id>,
}

impl SummaryBases {
    /// Notes the chains of a merge as read from the store.
    pub(super) fn read(&mut self, merge: &MergedSummary) {
        self.before.extend(merge.chain_roots());
    }

    /// Notes the chains of a merge kept up to date: its trees' chains are known.
    pub(super) fn kept(&mut self, merge: &MergedSummary) {
        self.now.extend(merge.chain_roots());
        self.covered.extend(merge.trees());
    }

    /// Whether the summary of `root` may be deleted: no live tree has it (`live_roots`) and
    /// no live tree's summary is resolved through it. Reads the chains of the live roots not
    /// covered yet, once.
    pub(super) async fn deletable(
        &mut self,
        repo: &Repo,
        live_roots: &HashSet<Id>,
        root: &Id,
    ) -> EngineResult<bool> {
        for live in live_roots {
            if self.covered.insert(*live) {
                match repo.summary_chain(live).await {
                    Ok(chain) => self.now.extend(chain),
                    // A damaged summary is rebuilt whole: it needs no chain.
                    Err(e) if e.is_damage() => tracing::warn!(%live, "{e}"),
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(!live_roots.contains(root) && !self.now.contains(root))
    }
}

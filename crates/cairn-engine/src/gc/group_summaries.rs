//! Format 2's reference summaries on the GC side: what the live versions use, read from one
//! summary per live tree (`cairn_format::group_summary`) instead of walking every tree. A
//! missing or damaged summary is rebuilt from its tree (and stored again, unless dry run).

use std::collections::HashSet;

use cairn_format::group_summary::GroupSummary;
use cairn_format::version::VersionRecord;
use cairn_repo::v2::V2Reader;
use cairn_repo::Repo;

use super::grouped::Marks;
use super::{GcOptions, GcReport};
use crate::error::EngineResult;
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
    let mut marks = Marks::default();
    marks
        .mark_version(reader, record, &mut report.metadata_bytes_read)
        .await?;
    let summary = marks.summary();
    if store_rebuilt {
        if damaged {
            repo.delete_summary(&root).await?; // summaries are put-if-absent
        }
        repo.put_group_summary(&root, &summary).await?;
    }
    Ok(summary)
}

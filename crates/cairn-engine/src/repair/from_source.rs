//! Step 4 of `cairn repair`: lost data stored again from a disk image (`--from`).

use std::sync::Arc;

use cairn_repo::Repo;

use super::RepairReport;
use crate::commit::parent::ParentLeaves;
use crate::commit::{run_pipeline, CommitOptions, CommitProgress, DedupMode};
use crate::error::{EngineError, EngineResult};
use crate::live::LiveVersions;
use crate::source::Source;

/// Step 4: if live versions lack anything, `source` goes through a commit's
/// pipeline without a version — every block and manifest node of it that the repository
/// holds no good copy of is stored (what no version needs is garbage for the next GC) — and
/// its packs are named by an index run. A damaged group's slots then read from these copies,
/// and the next GC rebuilds the group under its own id.
pub(super) async fn store_from(
    repo: &Arc<Repo>,
    live: &LiveVersions,
    source: Box<dyn Source>,
    dry_run: bool,
    report: &mut RepairReport,
) -> EngineResult<()> {
    let (wanted, _) = super::lost::lost_blobs(repo, live).await?;
    if wanted.is_empty() || dry_run {
        return Ok(());
    }
    let handle = tokio::runtime::Handle::current();
    let progress = Arc::new(CommitProgress::default());
    let out = {
        let (repo, progress) = (repo.clone(), progress.clone());
        tokio::task::spawn_blocking(move || {
            let none = ParentLeaves::default(); // every block the repository lacks is stored
            run_pipeline(
                repo,
                handle,
                source,
                // Exact: a block stored anywhere is found, not stored again.
                &CommitOptions {
                    dedup: DedupMode::Exact,
                    ..Default::default()
                },
                &progress,
                &none,
            )
        })
        .await
        .map_err(|e| EngineError::internal("repair thread", e))??
    };
    if !out.run.is_empty() {
        out.run.put(repo).await?;
    }
    let (still, _) = super::lost::lost_blobs(repo, live).await?;
    report.blobs_restored = wanted.difference(&still).count() as u64;
    report.restored_bytes = out.stats.new_chunk_bytes;
    Ok(())
}

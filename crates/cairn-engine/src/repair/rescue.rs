//! Step 3b of `cairn repair`: the groups of damaged packs stored again in new packs.

use cairn_format::{keys, Id};
use cairn_repo::Repo;

use super::RepairReport;
use crate::error::{EngineError, EngineResult};

/// or footer lost while its group frames give groups back, or a frame damaged while all else
/// reads — has the groups it can give stored again, as they are, in new packs (every id
/// recomputed or checked on the way, so a group keeps its own id or is not stored), named by
/// an index run; then it is quarantined whole and set aside (`damaged/packs/…`): nothing
/// reads it again, and no byte of it is deleted. What it held that no frame gave back stays
/// lost, named by the steps after this one.
pub(super) async fn rescue_packs(
    repo: &Repo,
    packs: &[Id],
    dry_run: bool,
    report: &mut RepairReport,
) -> EngineResult<()> {
    let reader = repo
        .v2()
        .ok_or_else(|| EngineError::internal("repair", "format 2 repair of format 1"))?;
    for pack in packs {
        crate::interrupt::check()?;
        let data = match repo.read_whole_pack(pack).await {
            Ok(data) => data,
            Err(e) if e.is_not_found() => continue,
            Err(e) => return Err(e.into()),
        };
        let key = repo.key().cloned();
        let groups = tokio::task::spawn_blocking(move || {
            cairn_repo::v2::rescuable_groups(&data, key.as_ref())
        })
        .await
        .map_err(|e| EngineError::internal("repair thread", e))?;
        if groups.is_empty() {
            continue;
        }
        report.packs_rescued += 1;
        report.groups_rescued += groups.len() as u64;
        if dry_run {
            continue;
        }
        let mut writer = crate::gc::repacker::Repacker::new(repo);
        for (kind, group) in groups {
            writer.push(kind, group, None).await?;
        }
        let entries = writer.finish().await?;
        repo.put_run_entries(entries, repo.key()).await?;
        reader.quarantine_copy(
            pack,
            pack,
            0,
            "set aside by repair: its groups are stored again",
        );
        repo.flush_quarantine().await?;
        repo.set_aside_object(&keys::pack(pack)).await?;
        tracing::info!(%pack, "damaged pack set aside: its groups are stored again");
    }
    if report.packs_rescued > 0 && !dry_run {
        repo.refresh_index().await?;
    }
    Ok(())
}

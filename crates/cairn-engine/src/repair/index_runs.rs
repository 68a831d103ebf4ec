//! Step 3 of `cairn repair`: index runs rebuilt from the pack trailers no intact run names.

use std::collections::HashSet;

use cairn_format::{keys, Id};
use cairn_repo::Repo;

use super::RepairReport;
use crate::error::EngineResult;

/// Step 3: every index run read whole and checked; if one is damaged, or a pack
/// is named by no run (its run lost), a run rebuilt from the trailers of the packs no intact
/// run names (every group and what it stores, every node) is published first, then the
/// damaged runs are set aside.
/// Groups found damaged on the way are indexed too — their trailers still say which chunk
/// each slot holds, which is what reads of their slots fall back on — and quarantined.
/// Returns the packs no run names whose trailers cannot be read (for [`rescue_packs`]).
pub(super) async fn repair_runs(
    repo: &Repo,
    dry_run: bool,
    report: &mut RepairReport,
) -> EngineResult<Vec<Id>> {
    let reader = repo.v2_reader(repo.key().cloned(), Default::default());
    let mut intact = Vec::new();
    let mut damaged = Vec::new();
    for run in repo.index_run_ids(&HashSet::new()).await? {
        crate::interrupt::check()?;
        match reader.check_run(&run).await? {
            None => intact.push(run),
            Some(problem) => damaged.push((keys::index_run(&run), problem)),
        }
    }
    for line in reader.add_runs(&intact).await? {
        // Checked whole just now: only a race with a GC could get here.
        tracing::warn!("{line}");
    }
    let unnamed = crate::verify::unindexed_packs(repo, &reader.packs().await?).await?;
    // A pack no run names is a killed commit's (garbage) or one whose run was lost (an
    // accidental delete, a partial copy, a lifecycle rule): indexing it costs a run entry
    // per block, losing it costs versions, so every readable one is indexed again (the next
    // `gc` deletes what no version needs).
    if damaged.is_empty() && unnamed.is_empty() {
        return Ok(Vec::new());
    }
    let mut locations: Vec<(Id, Id)> = Vec::new();
    let mut unreadable = Vec::new();
    for pack in unnamed {
        crate::interrupt::check()?;
        let check = reader.check_pack(&pack).await?;
        let trailer = match reader.trailer(&pack).await {
            Ok(trailer) => trailer,
            Err(e) if e.is_damage() => {
                // No readable trailer: nothing to index, but its frames may give groups back.
                unreadable.push(pack);
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        let entries = trailer.index_entries(|_| true);
        report.blobs_reindexed += entries.len() as u64;
        locations.extend(entries);
        if !dry_run {
            for (group, offset, reason) in &check.damaged_groups {
                reader.quarantine_copy(&pack, group, *offset, reason);
            }
        }
        report.packs_reindexed += 1;
    }
    report
        .index_runs_set_aside
        .extend(
            damaged
                .iter()
                .map(|(key, problem)| match problem.strip_prefix(key) {
                    Some(rest) => format!("{key}{rest}"),
                    None => format!("{key}: {problem}"),
                }),
        );
    if dry_run {
        return Ok(unreadable);
    }
    // The rebuilt run is durable before the damaged ones go, so that no moment passes
    // without a run naming these packs. Rebuilt from the same packs, a plain run may encode
    // exactly as a damaged one did before the damage — under that run's key (the hash of
    // its bytes as written), where the damaged bytes sit: then it is written as two runs
    // (packs split in halves, so other bytes), or, of one pack, once the damaged run is gone.
    let damaged_keys: HashSet<&str> = damaged.iter().map(|(k, _)| k.as_str()).collect();
    let whole = cairn_format::index_run::write_run(&locations, repo.key());
    let collides = damaged_keys.contains(keys::index_run(&Id::of(&whole)).as_str());
    let mut packs: Vec<Id> = locations.iter().map(|(_, p)| *p).collect();
    packs.sort_unstable();
    packs.dedup();
    let mut late = None;
    if !locations.is_empty() {
        match (collides, packs.len()) {
            (false, _) => {
                repo.put_index_run(&locations, repo.key()).await?;
            }
            (true, 1) => late = Some(locations),
            (true, n) => {
                let first: HashSet<Id> = packs[..n / 2].iter().copied().collect();
                let (a, b): (Vec<_>, Vec<_>) =
                    locations.into_iter().partition(|(_, p)| first.contains(p));
                repo.put_index_run(&a, repo.key()).await?;
                repo.put_index_run(&b, repo.key()).await?;
            }
        }
    }
    for (key, _) in &damaged {
        repo.set_aside_object(key).await?;
    }
    if let Some(locations) = late {
        repo.put_index_run(&locations, repo.key()).await?;
    }
    repo.flush_quarantine().await?;
    repo.refresh_index().await?;
    Ok(unreadable)
}

//! `cairn repair` on format 2: index runs rebuilt from pack trailers, lost data stored again
//! from a source, and what stays lost (see the steps in `mod.rs`).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use cairn_format::leaf_v2::RunLeaf;
use cairn_format::{keys, Id};
use cairn_repo::tree_walk::{walk_tree, NodeAt, TreeVisitor};
use cairn_repo::v2::V2Reader;
use cairn_repo::{Repo, RepoError};

use super::{in_order, tally, LostVersion, RepairReport};
use crate::commit::parent::ParentLeaves;
use crate::commit::{run_grouped_pipeline, CommitOptions, CommitProgress, DedupMode};
use crate::error::{EngineError, EngineResult};
use crate::live::LiveVersions;
use crate::source::Source;

/// Step 3 on format 2: every index run read whole and checked; if one is damaged, or a pack
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
        .index_files_set_aside
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

/// Step 3b on format 2: each damaged pack `verify` (or step 3) found rescuable — its trailer
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

/// Step 4 on format 2: if live versions lack anything, `source` goes through a commit's
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
    let (wanted, _) = lost_blobs(repo, live).await?;
    if wanted.is_empty() || dry_run {
        return Ok(());
    }
    let handle = tokio::runtime::Handle::current();
    let progress = Arc::new(CommitProgress::default());
    let out = {
        let (repo, progress) = (repo.clone(), progress.clone());
        tokio::task::spawn_blocking(move || {
            let none = ParentLeaves::default(); // every block the repository lacks is stored
            run_grouped_pipeline(
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
    let (still, _) = lost_blobs(repo, live).await?;
    report.blobs_restored = wanted.difference(&still).count() as u64;
    report.bytes_restored = out.stats.new_chunk_bytes;
    Ok(())
}

/// What live versions need that no good copy holds: the chunks of group runs neither a good
/// copy of their group nor a good copy of the chunk elsewhere stores (a group no trailer
/// describes counts as itself), and unreadable manifest nodes; and per version how many.
/// Locations only are checked (damage nobody has read yet is `verify`'s to find).
pub(super) async fn lost_blobs(
    repo: &Repo,
    live: &LiveVersions,
) -> EngineResult<(HashSet<Id>, Vec<LostVersion>)> {
    let reader = repo
        .v2()
        .ok_or_else(|| EngineError::internal("repair", "format 2 repair of format 1"))?;
    let mut lost: HashSet<Id> = HashSet::new();
    let mut per_version = Vec::new();
    // Leaf (or unreadable node) → what is lost under it: versions share them.
    let mut memo: BTreeMap<Id, Vec<Id>> = BTreeMap::new();
    for (id, record) in in_order(live) {
        let Some(root) = record.root else { continue };
        let mut visit = Leaves::default();
        let mut nodes = repo;
        walk_tree(&mut nodes, root, record.height, record.fanout, &mut visit).await?;
        let mut mine: HashSet<Id> = visit.unreadable.iter().copied().collect();
        for leaf in visit.leaves {
            let found = match memo.get(&leaf) {
                Some(found) => found,
                None => {
                    let found = lost_in_leaf(repo, reader, &leaf).await?;
                    memo.entry(leaf).or_insert(found)
                }
            };
            mine.extend(found.iter().copied());
        }
        tally(&mut lost, &mut per_version, id, record, mine);
    }
    Ok((lost, per_version))
}

/// What is lost under leaf `id`: itself if it cannot be read, else the chunks of its runs
/// that no good copy holds.
async fn lost_in_leaf(repo: &Repo, reader: &V2Reader, id: &Id) -> EngineResult<Vec<Id>> {
    let leaf = match repo.read_blob(id).await {
        Ok(raw) => {
            RunLeaf::decode(&raw).map_err(|e| RepoError::corrupt(format!("manifest node {id}"), e))
        }
        Err(e) => Err(e),
    };
    let leaf = match leaf {
        Ok(leaf) => leaf,
        Err(e) if e.is_damage() => return Ok(vec![*id]),
        Err(e) => return Err(e.into()),
    };
    let mut lost = Vec::new();
    for (group, first, count) in leaf.group_runs() {
        let wanted = [(first, count)];
        match reader.locate_group_storing(&group, &wanted).await {
            Ok(loc) if loc.stores(&wanted) => continue,
            Ok(_) => {}
            Err(e) if e.is_damage() => {}
            Err(e) => return Err(e.into()),
        }
        // No good copy of the group stores the run: each slot's chunk, wherever it is.
        let chunks = match reader.run_chunks(&group, first, count).await {
            Ok(chunks) => chunks,
            Err(e) if e.is_damage() => {
                lost.push(group); // no trailer describes it
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        for c in &chunks {
            match reader.locate_chunk(&c.id).await {
                Ok(_) => {}
                Err(e) if e.is_damage() => lost.push(c.id),
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(lost)
}

/// The leaves of a format 2 tree (unread), and the interior nodes that cannot be read.
#[derive(Default)]
struct Leaves {
    leaves: Vec<Id>,
    unreadable: Vec<Id>,
}

impl TreeVisitor<RepoError> for Leaves {
    fn enter(&mut self, at: &NodeAt) -> bool {
        if at.level == 0 {
            self.leaves.push(at.id);
            return false;
        }
        true
    }

    fn unreadable(&mut self, at: &NodeAt, e: RepoError) -> Result<(), RepoError> {
        if !e.is_damage() {
            return Err(e);
        }
        self.unreadable.push(at.id);
        Ok(())
    }
}

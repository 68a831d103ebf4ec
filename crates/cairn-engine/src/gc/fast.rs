//! Fast deletion (the VM-centric paper's approximate deletion, §3.2): free the unique blobs of
//! versions deleted since the last GC, judged by the reference summaries of the live versions
//! instead of a mark over the whole repository.
//!
//! Candidates come from walking each newly deleted version's tree. A node that some live
//! summary may contain is not descended into (if it is live, so is everything under it); a
//! node or chunk that every live summary rejects is dead for certain (Bloom filters have no
//! false negatives). A dead blob judged live by mistake stays stored — the leak that
//! `gc --repair` removes. Only the packs holding dead blobs are touched, and only the index
//! files naming those packs are rewritten.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use cairn_format::index::PackIndex;
use cairn_format::marker::{GcLeftover, GcPlan};
use cairn_format::node::Leaf;
use cairn_format::pack::BlobEntry;
use cairn_format::Id;
use cairn_repo::session::now_ns;
use cairn_repo::tree_walk::{walk_tree, NodeAt, TreeVisitor};
use cairn_repo::{BlobIndex, BlobLocation, Repo};

use super::leftovers::remove_stale_markers;
use super::summaries::{ensure_summary, LiveFilters, SummaryCheck};
use super::{
    delete_orphans, finish, orphan_packs, pack_payload, publish_and_wait, put_index, rescue,
    stored_bytes, sweep, write_pack, GcOptions, GcReport, Repacker, Snapshot, SnapshotReader,
};
use crate::error::{EngineError, EngineResult};
use crate::live::live_versions;
use crate::progress::{self, Unit};

/// Walks a deleted version's tree: a node or chunk every live summary rejects is dead; a
/// node some summary may hold is not descended into (if it is live, so is its subtree).
struct JudgeDeleted<'a> {
    seen: &'a mut HashSet<Id>,
    dead: &'a mut HashSet<Id>,
    filters: &'a LiveFilters,
    /// The GC's snapshot: a blob it does not hold was freed already.
    index: &'a BlobIndex,
    kept_by_summary: &'a mut u64,
}

impl TreeVisitor<EngineError> for JudgeDeleted<'_> {
    fn enter(&mut self, at: &NodeAt) -> bool {
        if !self.seen.insert(at.id) {
            return false;
        }
        if self.filters.maybe_node(&at.id) {
            *self.kept_by_summary += 1;
            return false;
        }
        if !self.index.contains(&at.id) {
            return false; // already freed
        }
        self.dead.insert(at.id);
        true
    }

    fn leaf(&mut self, _: &NodeAt, leaf: Leaf) -> EngineResult<()> {
        for id in leaf.chunk_ids() {
            if !self.seen.insert(id) {
                continue;
            }
            if self.filters.maybe_chunk(&id) {
                *self.kept_by_summary += 1;
            } else if self.index.contains(&id) {
                self.dead.insert(id);
            }
        }
        Ok(())
    }

    /// What an unreadable node of a deleted version refers to stays stored, for
    /// `gc --repair` (an interruption still ends the walk).
    fn unreadable(&mut self, at: &NodeAt, e: EngineError) -> EngineResult<()> {
        if matches!(e, EngineError::Interrupted { .. }) {
            return Err(e);
        }
        tracing::warn!(node = %at.id, "node of a deleted version unreadable ({e}); what it refers to is left to gc --repair");
        Ok(())
    }
}

pub(super) async fn run(repo: &Arc<Repo>, options: &GcOptions) -> EngineResult<GcReport> {
    let mut report = GcReport::default();
    // Refs first, then the index snapshot (as in the exact pass).
    let live = live_versions(repo).await?;
    report.live_versions = live.live.len() as u64;
    let freed = repo.freed_versions().await?;
    let mut pending: Vec<Id> = live.deleted.difference(&freed).copied().collect();
    pending.sort();
    // The pack listing is taken before the plan, for orphans (packs no index file names).
    let (bytes_before, pack_sizes) = stored_bytes(repo, None).await?;
    report.bytes_before = bytes_before;
    report.bytes_after = bytes_before;
    if pending.is_empty() && pack_sizes.keys().all(|p| repo.index().has_pack(p)) {
        return Ok(report); // nothing deleted, and every pack is indexed
    }
    let snapshot = Snapshot::load(repo).await?;
    let orphans = orphan_packs(&pack_sizes, &snapshot.packs());
    if pending.is_empty() && orphans.is_empty() {
        return Ok(report);
    }
    let store_rebuilt = !options.dry_run;

    // The live side: one summary per distinct live tree, merged per image (only needed to
    // judge the blobs of deleted versions).
    let mut filters = LiveFilters::default();
    let mut live_roots: HashSet<Id> = HashSet::new();
    let mut records: Vec<_> = live.live.iter().collect();
    records.sort_by_key(|(id, _)| **id);
    if pending.is_empty() {
        records.clear();
    }
    progress::start(
        &options.progress,
        "loading live summaries",
        Unit::Items,
        records.len() as u64,
    );
    for (_, record) in records {
        progress::add(&options.progress, 1);
        let Some(root) = record.root else { continue };
        if !live_roots.insert(root) {
            continue;
        }
        let e = ensure_summary(
            repo,
            &snapshot.index,
            record,
            SummaryCheck::Load,
            store_rebuilt,
        )
        .await?;
        report.summary_bytes += e.read;
        filters.add(&record.image, e.summary);
    }
    report.summary_fp_rate = filters.chunk_false_positive_rate();

    // The deleted side: walk each newly deleted tree, pruning subtrees a live summary claims.
    let mut dead: HashSet<Id> = HashSet::new();
    let mut seen: HashSet<Id> = HashSet::new();
    let mut processed = Vec::new();
    let mut pending_roots = Vec::new();
    progress::start(
        &options.progress,
        "judging deleted versions",
        Unit::Items,
        pending.len() as u64,
    );
    for version in &pending {
        progress::add(&options.progress, 1);
        let record = match repo.load_version(version).await {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(%version, "deleted version unreadable ({e}); left to gc --repair");
                continue;
            }
        };
        processed.push(*version);
        let Some(root) = record.root else { continue };
        pending_roots.push(root);
        if live_roots.contains(&root) {
            continue; // the same tree as a live version (a clone, an unchanged commit)
        }
        let mut reader = SnapshotReader {
            repo,
            index: &snapshot.index,
            bytes_read: &mut report.metadata_bytes_read,
        };
        let mut judge = JudgeDeleted {
            seen: &mut seen,
            dead: &mut dead,
            filters: &filters,
            index: &snapshot.index,
            kept_by_summary: &mut report.kept_by_summary,
        };
        walk_tree(&mut reader, root, record.height, record.fanout, &mut judge).await?;
    }
    // Dead blobs earlier fast deletions left in packs they did not repack: judged again, so
    // they are freed once their pack is worth repacking.
    let leftovers = if pending.is_empty() {
        Vec::new()
    } else {
        repo.gc_leftovers().await?
    };
    for id in leftovers.iter().flat_map(|(_, l)| &l.blobs) {
        if !seen.insert(*id) || !snapshot.index.contains(id) {
            continue;
        }
        if filters.maybe_chunk(id) || filters.maybe_node(id) {
            report.kept_by_summary += 1;
        } else {
            dead.insert(*id);
        }
    }
    drop(seen);

    // A dead GC's plan hides the index files it supersedes from every reader: a kept copy
    // listed only there would be found by no one, so surplus copies wait until the plan is
    // gone (the crash tests found it: half the runs lost a node otherwise).
    let surplus = if repo.gc_plans().await?.is_empty() {
        surplus_copies(repo, &snapshot, &pack_sizes, &dead).await?
    } else {
        HashSet::new()
    };
    report.surplus_copies = surplus.len() as u64;
    let is_dead =
        |pack: &Id, e: &BlobEntry| dead.contains(&e.id) || surplus.contains(&(*pack, e.id));

    // Which packs hold dead blobs or surplus copies, and what to do with each.
    let mut entries_of: HashMap<Id, BTreeMap<u32, BlobEntry>> = HashMap::new();
    for (_, file) in &snapshot.files {
        for p in &file.packs {
            if p.entries.iter().any(|e| is_dead(&p.pack, e)) {
                let map = entries_of.entry(p.pack).or_default();
                map.extend(p.entries.iter().map(|e| (e.offset, *e)));
            }
        }
    }
    let mut to_delete = Vec::new();
    let mut to_repack = Vec::new();
    let mut left: Vec<Id> = Vec::new();
    let mut freed_bytes = 0u64;
    for (pack, entries) in &entries_of {
        let Some(&size) = pack_sizes.get(pack) else {
            continue; // missing pack: verify's business
        };
        let live_bytes: u64 = entries
            .values()
            .filter(|e| !is_dead(pack, e))
            .map(|e| e.stored_len as u64)
            .sum();
        // A live blob whose only copy here is quarantined cannot be copied: keep the pack.
        let pinned = entries
            .values()
            .any(|e| !is_dead(pack, e) && repo.is_quarantined(pack, &e.id));
        if pinned {
            left.extend(
                entries
                    .values()
                    .filter(|e| dead.contains(&e.id))
                    .map(|e| e.id),
            );
        } else if live_bytes == 0 {
            to_delete.push(*pack);
            freed_bytes += size;
        } else if (live_bytes as f64)
            < options.repack_threshold * pack_payload(size, entries.len() as u64) as f64
        {
            to_repack.push(*pack);
            freed_bytes += size.saturating_sub(live_bytes);
        } else {
            left.extend(
                entries
                    .values()
                    .filter(|e| dead.contains(&e.id))
                    .map(|e| e.id),
            );
        }
    }
    left.sort();
    left.dedup();
    report.dead_left_in_packs = left.len() as u64;
    to_delete.sort();
    to_repack.sort();
    let doomed: HashSet<Id> = to_delete.iter().chain(&to_repack).copied().collect();
    let plan_dead: Vec<Id> = doomed
        .iter()
        .flat_map(|p| entries_of[p].values())
        .filter(|e| dead.contains(&e.id))
        .map(|e| e.id)
        .collect::<HashSet<_>>()
        .into_iter()
        .collect();
    report.dead_blobs = plan_dead.len() as u64;
    report.packs_deleted = to_delete.len() as u64;
    report.packs_repacked = to_repack.len() as u64;
    report.freed_versions = processed.len() as u64;
    if options.dry_run {
        let orphan_bytes: u64 = orphans.iter().map(|p| pack_sizes[p]).sum();
        report.bytes_after = report.bytes_before - freed_bytes - orphan_bytes;
        return Ok(report);
    }

    let mut written_index = HashSet::new();
    let mut superseded = Vec::new();
    if !doomed.is_empty() {
        // Repack the live blobs of the packs below the threshold.
        let mut replacement: Vec<PackIndex> = Vec::new();
        let mut repacker = Repacker::new(repo.config().pack_target as usize);
        let live_of = |pack: &Id| {
            entries_of[pack]
                .values()
                .filter(|e| !is_dead(pack, e))
                .copied()
                .collect::<Vec<BlobEntry>>()
        };
        let to_copy = to_repack
            .iter()
            .flat_map(live_of)
            .map(|e| e.range().end - e.range().start)
            .sum();
        progress::start(&options.progress, "repacking", Unit::Bytes, to_copy);
        for pack in &to_repack {
            let data = repo.read_whole_pack(pack).await?;
            for e in &live_of(pack) {
                let r = e.range();
                let stored = &data[r.start as usize..r.end as usize];
                // Verify before copying: never launder a corrupt blob into a new pack.
                repo.check_blob(
                    &BlobLocation {
                        pack: *pack,
                        entry: *e,
                    },
                    stored,
                )?;
                report.bytes_repacked += stored.len() as u64;
                progress::add(&options.progress, stored.len() as u64);
                if let Some(done) = repacker.push(e, stored) {
                    replacement.push(write_pack(repo, done).await?);
                }
            }
        }
        for done in repacker.finish() {
            replacement.push(write_pack(repo, done).await?);
        }
        report.packs_written = replacement.len() as u64;
        // Rewrite only the index files that name a doomed pack: their other packs as they
        // were, plus the new packs.
        for (id, file) in &snapshot.files {
            if file.packs.iter().any(|p| doomed.contains(&p.pack)) {
                superseded.push(*id);
                replacement.extend(
                    file.packs
                        .iter()
                        .filter(|p| !doomed.contains(&p.pack))
                        .cloned(),
                );
            }
        }
        written_index.insert(put_index(repo, replacement).await?);
        superseded.retain(|id| !written_index.contains(id));
        report.index_files_replaced = superseded.len() as u64;
    }

    let plan = GcPlan {
        created_ns: now_ns(),
        dead_blobs: plan_dead.clone(),
        superseded_index: superseded.clone(),
    };
    let published = publish_and_wait(repo, &plan, options, &mut report).await?;

    // Versions published meanwhile: rescue the dead blobs their summaries may contain.
    let live_now = live_versions(repo).await?;
    let mut newcomers = LiveFilters::default();
    let mut now_index = None;
    for (id, record) in &live_now.live {
        let Some(root) = record.root else { continue };
        if live.live.contains_key(id) || live_roots.contains(&root) {
            continue;
        }
        if now_index.is_none() {
            now_index = Some(Snapshot::load(repo).await?);
        }
        let index = &now_index.as_ref().expect("loaded").index;
        let e = ensure_summary(repo, index, record, SummaryCheck::Load, true).await?;
        newcomers.add(&record.image, e.summary);
    }
    let doomed_set: HashSet<Id> = to_delete.iter().chain(&to_repack).copied().collect();
    rescue(
        repo,
        &snapshot.index,
        &plan_dead,
        |id| newcomers.maybe_chunk(id) || newcomers.maybe_node(id),
        now_index.as_ref(),
        &doomed_set,
        &mut written_index,
        &mut report,
    )
    .await?;

    let doomed: Vec<Id> = to_delete.iter().chain(&to_repack).copied().collect();
    progress::start(&options.progress, "deleting", Unit::Items, 0);
    sweep(repo, &superseded, &written_index, &doomed).await?;
    delete_orphans(repo, &orphans, &mut report).await?;
    let live_roots_now: HashSet<Id> = live_now.live.values().filter_map(|r| r.root).collect();
    for root in &pending_roots {
        if !live_roots.contains(root) && !live_roots_now.contains(root) {
            repo.delete_summary(root).await?;
        }
    }
    for v in &processed {
        repo.mark_freed(v).await?;
    }
    // The new leftover list is durable before the lists it replaces go.
    if !left.is_empty() {
        repo.put_gc_leftover(&GcLeftover {
            created_ns: now_ns(),
            blobs: left,
        })
        .await?;
    }
    for (key, _) in &leftovers {
        repo.delete_gc_leftover(key).await?;
    }
    finish(repo, &published, options).await?;
    let (bytes_after, packs_after) = stored_bytes(repo, Some(&pack_sizes)).await?;
    report.bytes_after = bytes_after;
    remove_stale_markers(repo, &packs_after, true).await?;
    Ok(report)
}

/// Surplus copies, as (pack, blob): a live blob stored in more than one pack — a rescue that
/// raced a commit which saw the plan and stored its own copy, or two sessions storing the same
/// new data — is kept once, at the copy the snapshot's index locates, and only once that copy
/// is read back intact (a surplus copy is the redundancy a damaged keeper would need). Each
/// costs a lookup per indexed blob here; the keepers read are as many as the surplus copies.
async fn surplus_copies(
    repo: &Repo,
    snapshot: &Snapshot,
    pack_sizes: &HashMap<Id, u64>,
    dead: &HashSet<Id>,
) -> EngineResult<HashSet<(Id, Id)>> {
    let mut candidates: Vec<(Id, BlobLocation)> = Vec::new();
    for (_, file) in &snapshot.files {
        for p in &file.packs {
            for e in &p.entries {
                if dead.contains(&e.id) {
                    continue;
                }
                match snapshot.index.get(&e.id) {
                    Some(keeper)
                        if keeper.pack != p.pack && pack_sizes.contains_key(&keeper.pack) =>
                    {
                        candidates.push((p.pack, keeper))
                    }
                    _ => {}
                }
            }
        }
    }
    let mut surplus = HashSet::new();
    for (pack, keeper) in candidates {
        if surplus.contains(&(pack, keeper.entry.id)) {
            continue; // listed by two index files
        }
        let intact = match repo
            .read_pack_range(&keeper.pack, keeper.entry.range())
            .await
        {
            Ok(stored) => repo.check_blob(&keeper, &stored).is_ok(),
            Err(_) => false,
        };
        if intact {
            surplus.insert((pack, keeper.entry.id));
        } else {
            tracing::warn!(blob = %keeper.entry.id, pack = %keeper.pack, "a copy of a blob stored twice does not read back intact; both copies are kept for verify and gc --repair");
        }
    }
    Ok(surplus)
}

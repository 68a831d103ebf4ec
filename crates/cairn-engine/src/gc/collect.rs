//! One GC run: mark every group slot and manifest node a live
//! version uses, then delete packs that hold nothing live, rewrite packs below the repack
//! threshold with their live groups only — a group whose dead slots are worth it rewritten
//! without them (`GroupBuilder::repack`: same id, every slot still listed) — and consolidate
//! the index runs into one, under the deletion protocol of `gc/mod.rs` (lock, plan, wait,
//! re-check and rescue, sweep). What is live is decided in `liveness`, what becomes of each
//! pack in `pack_plan`, what commits reused meanwhile is copied back in `rescue`.
//!
//! What is live comes from walking every live tree (`gc --repair`: exact) or from the live
//! trees' reference summaries (`gc`: fast deletion, a superset; `group_summaries.rs`); the
//! plan, the copies and the protocol are the same for both ([`Liveness`]). Fast deletion acts
//! only when a version was deleted or committed since the last GC or a pack is not indexed:
//! versions committed since may hold groups that commits running at once each stored, and
//! the plan keeps one copy of each (`affected::duplicate_packs`).
//!
//! What the consolidated run names, so that nothing a reader can find is ever deleted:
//! - in a kept pack: every data group and chunk it stores (dead ones too: they stay stored,
//!   and a commit may dedup against them) and its live manifest nodes only (a dead leaf
//!   names groups this GC may delete, so it must not be reused);
//! - in a new pack: what was copied into it.
//!
//! Concurrent commits that reuse what this GC deletes — a dead group, a slot a rewritten
//! group dropped, a dead node — are found after the wait by marking the versions published
//! since, and those groups are copied from their old packs into rescue packs, named by a rescue
//! run, with the slots the live versions or the newcomers use (the rest dropped as a repack
//! drops them); readers prefer a copy of a group that stores the slots they want
//! (`V2Reader::locate_group_storing`).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cairn_format::index_run::RunEntries;
use cairn_format::marker::GcPlan;
use cairn_format::pack::BlobKind;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::session::now_ns;
use cairn_repo::v2::{PackTrailer, V2Reader};
use cairn_repo::Repo;

use super::affected::{affected_packs, duplicate_packs};
use super::group_summaries::live_summary;
use super::leftovers::{remove_orphan_records, remove_stale_markers};
use super::liveness::{incomplete, Liveness, Marks, Snapshot};
use super::pack_plan::{copy_group, PackPlan};
use super::phase::PhaseClock;
use super::rebuild::Damaged;
use super::records::GcRecords;
use super::repacker::Repacker;
use super::rescue::{rescue, Need};
use super::small_packs::small_packs;
use super::summary_bases::SummaryBases;
use super::{finish, publish_and_wait, stored_bytes, sweep, GcMode, GcOptions, GcReport};
use crate::error::{EngineError, EngineResult};
use crate::live::{live_versions_from, LiveVersions, RecordSource};
use crate::progress::{self, Unit};

pub(super) async fn run(repo: &Arc<Repo>, options: &GcOptions) -> EngineResult<GcReport> {
    let mut report = GcReport::default();
    let mut clock = PhaseClock::start();
    if !options.dry_run {
        let stale = repo.remove_stale_gc_plans().await?;
        if stale > 0 {
            tracing::info!(plans = stale, "removed the plans of gcs that died");
        }
    }
    clock.lap("stale plans", &mut report);
    // Refs first, then the index: a version's groups are indexed before its ref names it.
    // The packs are listed after the runs, so every pack a run names that exists is listed
    // (packs are durable before a run names them); a listed pack no run names is an orphan.
    let mut records = GcRecords::load(repo, options, &mut report).await?;
    clock.lap("record bundle read", &mut report);
    let live = live_versions_from(repo, &mut records.source).await?;
    clock.lap("history", &mut report);
    let mut snapshot = Snapshot::load(repo).await?;
    clock.lap("index runs", &mut report);
    let (before_bytes, pack_sizes) = stored_bytes(repo, None).await?;
    clock.lap("pack listing", &mut report);
    report.before_bytes = before_bytes;
    report.after_bytes = before_bytes;
    report.live_versions = live.live.len() as u64;
    let freed = repo.freed_versions().await?;
    clock.lap("freed list", &mut report);
    let unfreed: Vec<Id> = live.deleted.difference(&freed).copied().collect();
    // Fast deletion acts on what was deleted since the last GC (and on orphan packs); the
    // exact pass also finds leaks and consolidates the runs.
    let orphans_listed = pack_sizes.keys().any(|p| !snapshot.named.contains_key(p));
    let small = if options.repack_small {
        small_packs(
            &pack_sizes,
            &snapshot.named,
            u64::from(repo.config().pack_target),
        )
    } else {
        HashSet::new()
    };
    report.small_packs = small.len() as u64;
    if options.mode == GcMode::Fast
        && unfreed.is_empty()
        && !orphans_listed
        && small.is_empty()
        && !records.has_new(&live)
    {
        records.keep(repo, &live, options, &mut report).await?;
        clock.lap("record bundle", &mut report);
        return Ok(report);
    }
    let Judged {
        live_use,
        scope,
        live_groups,
        mut bases,
    } = judge_liveness(
        repo,
        options,
        &mut records.source,
        &snapshot,
        &live,
        &unfreed,
        &small,
        &mut report,
        &mut clock,
    )
    .await?;
    snapshot.read_trailers(&pack_sizes, scope.as_ref()).await?;
    report.trailers_read = snapshot.trailers.len() as u64;
    clock.lap("trailers", &mut report);
    let damaged = Damaged::find(repo, &snapshot, &*live_use).await?;
    clock.lap("damage", &mut report);
    let mut plan = PackPlan::new(
        &snapshot,
        &*live_use,
        &damaged,
        options.repack_threshold,
        &small,
    );
    clock.lap("plan", &mut report);
    if let Some(level) = options.recompress {
        report.packs_recompressed =
            super::recompress::select(repo, &snapshot, &mut plan, level).await?;
        clock.lap("recompression sample", &mut report);
    }
    report.groups_rebuilt = damaged.rebuilt.len() as u64;
    report.dead_blobs = plan.dead.len() as u64;
    report.packs_deleted = plan.to_delete.len() as u64;
    report.packs_repacked = plan.to_repack.len() as u64;
    report.index_runs_replaced = snapshot.runs.len() as u64;
    let Orphans {
        dead: orphans,
        adopted,
    } = judge_orphans(&snapshot, &pack_sizes, &*live_use, &mut report).await?;
    clock.lap("orphan packs", &mut report);
    if options.dry_run {
        report.after_bytes = before_bytes - freed_by(&plan, &orphans, &pack_sizes);
        records.keep(repo, &live, options, &mut report).await?;
        clock.lap("record bundle", &mut report);
        return Ok(report);
    }
    let nothing_to_do = plan.to_delete.is_empty()
        && plan.to_repack.is_empty()
        && damaged.rebuilt.is_empty()
        && orphans.is_empty()
        && adopted.is_empty()
        // The exact pass consolidates the runs; fast deletion with no deletion pending
        // (it looked for duplicate copies and found none worth a repack) leaves them to
        // compaction.
        && (snapshot.runs.len() <= 1 || (options.mode == GcMode::Fast && unfreed.is_empty()));
    if nothing_to_do {
        settle(
            repo,
            &mut records,
            &unfreed,
            &live,
            &mut bases,
            options,
            &mut report,
            &mut clock,
        )
        .await?;
        return Ok(report);
    }

    // Copy what survives of the packs to rewrite, then the consolidated run: kept packs as
    // they are (minus dead nodes), plus the new packs.
    let mut writer = repack(
        repo,
        options,
        &snapshot,
        &plan,
        &*live_use,
        damaged,
        &mut report,
    )
    .await?;
    let locations = writer.finish().await?;
    // A relayout's copies stay preferred in the packs they are repacked into: marked before
    // the run naming them is written.
    for (pack, time) in &writer.laid_out {
        repo.put_layout_marker(pack, *time).await?;
    }
    // The packs in the store as this GC knows them at its end: those listed at its start,
    // minus those it deletes, plus those it writes (`after_bytes` is counted from them rather
    // than from a second walk of the store's pack directories).
    let mut packs_now = pack_sizes.clone();
    packs_now.extend(writer.written.iter().copied());
    report.packs_written = writer.written.len() as u64;
    clock.lap("repack", &mut report);
    let mut written_runs = HashSet::new();
    written_runs.extend(
        write_run(
            repo,
            &snapshot,
            &plan,
            &adopted,
            &*live_use,
            scope.as_ref(),
            locations,
            &mut report,
        )
        .await?,
    );
    clock.lap("index run", &mut report);
    let superseded: Vec<Id> = snapshot
        .runs
        .iter()
        .filter(|id| !written_runs.contains(*id))
        .copied()
        .collect();

    let gc_plan = GcPlan {
        created_ns: now_ns(),
        dead_blobs: plan.dead.iter().copied().collect(),
        superseded_index: superseded.clone(),
    };
    let published = publish_and_wait(repo, &gc_plan, options, &mut report).await?;
    clock.lap("plan and wait", &mut report);

    // Versions published meanwhile may reuse what the plan deletes: rescue it.
    let doomed: Vec<Id> = plan
        .to_delete
        .iter()
        .chain(&plan.to_repack)
        .copied()
        .collect();
    let live_now = live_versions_from(repo, &mut records.source).await?;
    rescue_newcomers(
        repo,
        &snapshot,
        &live,
        &live_now,
        &*live_use,
        &mut written_runs,
        &mut packs_now,
        &mut report,
    )
    .await?;

    clock.lap("recheck", &mut report);
    progress::start(&options.progress, "deleting", Unit::Items, 0);
    sweep(repo, &superseded, &written_runs, &doomed).await?;
    clock.lap("sweep", &mut report);
    for pack in delete_orphans(repo, &orphans, &mut report)
        .await?
        .iter()
        .chain(&doomed)
    {
        packs_now.remove(pack);
    }
    settle(
        repo,
        &mut records,
        &unfreed,
        &live_now,
        &mut bases,
        options,
        &mut report,
        &mut clock,
    )
    .await?;
    finish(repo, &published, options).await?;
    clock.lap("finish", &mut report);
    report.after_bytes = packs_now.values().sum::<u64>() + repo.index_file_bytes().await?;
    clock.lap("index bytes after", &mut report);
    // Markers of copies whose pack is gone (repacked, deleted, or missing: the consolidated
    // run names only packs that exist).
    let nothing_lost = live_groups
        .as_ref()
        .is_some_and(|live| all_present(live, &snapshot, &adopted));
    remove_stale_markers(repo, &packs_now, nothing_lost).await?;
    clock.lap("stale markers", &mut report);
    Ok(report)
}

/// The packs in the store that no index run names, judged by what they hold.
struct Orphans {
    /// Packs that hold nothing a live version needs: left by commits and GCs that died
    /// before publishing their run. Deleted after the wait if still named by no run.
    dead: Vec<Id>,
    /// Packs that hold a group slot or node a live version uses and no run locates
    /// elsewhere: their run was lost (deleted by hand, a partial copy, a lifecycle rule).
    /// Never deleted; the consolidated run names them again.
    adopted: Vec<Arc<PackTrailer>>,
}

/// Reads the trailer of every pack no run names and decides what it is. A pack is deleted
/// only when GC can prove that nothing in it is needed: its trailer reads, and every group
/// slot and node in it that a live version uses is located in a pack a run names. A pack
/// whose trailer cannot be read is kept (`verify` names it, `repair` re-indexes what it can):
/// its being unnamed is no proof that it is dead.
async fn judge_orphans(
    snapshot: &Snapshot,
    pack_sizes: &HashMap<Id, u64>,
    live: &(dyn Liveness + Sync),
    report: &mut GcReport,
) -> EngineResult<Orphans> {
    let mut unnamed: Vec<Id> = pack_sizes
        .keys()
        .filter(|p| !snapshot.named.contains_key(p))
        .copied()
        .collect();
    unnamed.sort();
    let mut out = Orphans {
        dead: Vec::new(),
        adopted: Vec::new(),
    };
    for pack in unnamed {
        crate::interrupt::check()?;
        let trailer = match snapshot.reader.trailer(&pack).await {
            Ok(trailer) => trailer,
            Err(e) if e.is_damage() => {
                tracing::warn!(
                    "pack {pack} is named by no index run and its trailer cannot be read ({e}); \
                     kept: run `cairn verify` and `cairn repair`"
                );
                report.orphan_packs_kept += 1;
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if needed_elsewhere_unlocated(&snapshot.reader, &trailer, live).await? {
            tracing::info!(
                "pack {pack} is named by no index run but holds data of live versions (its index \
                 run was lost): indexed again"
            );
            report.orphan_packs_reindexed += 1;
            out.adopted.push(trailer);
        } else {
            out.dead.push(pack);
        }
    }
    Ok(out)
}

/// True if some group slot or node of `trailer` that a live version uses is located in no
/// pack the runs of `reader` name.
async fn needed_elsewhere_unlocated(
    reader: &V2Reader,
    trailer: &PackTrailer,
    live: &(dyn Liveness + Sync),
) -> EngineResult<bool> {
    for (g, group) in trailer.groups.iter().enumerate() {
        let missing = match group.kind {
            BlobKind::Node => {
                let node = group.desc.chunks[0].id;
                live.node_used(&node) && Need::Node(node).missing_in(reader).await?
            }
            BlobKind::Data => {
                let gid = trailer.group_id(g as u32).expect("a group of this trailer");
                match live.used_slots(&gid) {
                    Some(used) if !used.is_empty() => {
                        Need::Slots(gid, used.runs()).missing_in(reader).await?
                    }
                    _ => false,
                }
            }
        };
        if missing {
            return Ok(true);
        }
    }
    Ok(false)
}

/// The bookkeeping a GC that acted ends with: records no ref reaches (of unpublished
/// commits) removed, the space of the deleted versions (`unfreed`) marked given back with
/// their summaries deleted, and the record bundle written for the live versions.
#[allow(clippy::too_many_arguments)]
async fn settle(
    repo: &Arc<Repo>,
    records: &mut GcRecords,
    unfreed: &[Id],
    live: &LiveVersions,
    bases: &mut SummaryBases,
    options: &GcOptions,
    report: &mut GcReport,
    clock: &mut PhaseClock,
) -> EngineResult<()> {
    remove_orphan_records(repo, live, options, report).await?;
    clock.lap("orphan records", report);
    free_versions(repo, &mut records.source, unfreed, live, bases).await?;
    clock.lap("free versions", report);
    records.keep(repo, live, options, report).await?;
    clock.lap("record bundle", report);
    report.freed_versions = unfreed.len() as u64;
    Ok(())
}

/// The bytes a plan would free: packs deleted, the dead part of packs repacked, and orphans.
fn freed_by(plan: &PackPlan, orphans: &[Id], pack_sizes: &HashMap<Id, u64>) -> u64 {
    let doomed: u64 = plan.to_delete.iter().map(|p| pack_sizes[p]).sum();
    let repacked: u64 = plan
        .to_repack
        .iter()
        .map(|p| pack_sizes[p].saturating_sub(plan.live_bytes[p]))
        .sum();
    doomed + repacked + orphans.iter().map(|p| pack_sizes[p]).sum::<u64>()
}

/// Writes the consolidated run: the packs GC wrote (`locations`), the packs it keeps as they
/// are (minus dead nodes) and the orphans it adopts. Fast deletion names the packs it read
/// as they are now and every other entry as it was (`merge_runs_replacing`); the exact pass
/// writes the whole run. Returns the run written, if any.
#[allow(clippy::too_many_arguments)]
async fn write_run(
    repo: &Arc<Repo>,
    snapshot: &Snapshot,
    plan: &PackPlan,
    adopted: &[Arc<PackTrailer>],
    live_use: &(dyn Liveness + Send + Sync),
    scope: Option<&HashSet<Id>>,
    mut locations: RunEntries,
    report: &mut GcReport,
) -> EngineResult<Option<Id>> {
    for pack in &plan.kept {
        let entries = snapshot.trailers[pack].index_entries(|node| live_use.node_used(node));
        locations.add_pack(*pack, entries.iter().map(|(id, _)| id));
    }
    // Packs no run named that hold what a live version needs: named again, as they are.
    for trailer in adopted {
        let entries = trailer.index_entries(|node| live_use.node_used(node));
        locations.add_pack(trailer.pack, entries.iter().map(|(id, _)| id));
    }
    Ok(match scope {
        Some(read) => {
            let named: Vec<Id> = locations.packs().copied().collect();
            let merged = snapshot
                .reader
                .merge_runs_replacing(&snapshot.runs, read, locations)
                .await
                .map_err(|e| match e {
                    e if e.is_damage() => incomplete(e.to_string()),
                    e => e.into(),
                })?;
            report.index_read_bytes += merged.bytes_read;
            Some(repo.put_run_naming(merged.bytes, &named).await?.0)
        }
        None if !locations.is_empty() => Some(repo.put_run_entries(locations, repo.key()).await?.0),
        None => None,
    })
}

/// Whether every group in `live` is in a pack GC read or adopted (the exact pass): then no
/// quarantine marker is needed for a copy whose pack is gone.
fn all_present(live: &HashSet<Id>, snapshot: &Snapshot, adopted: &[Arc<PackTrailer>]) -> bool {
    let present: HashSet<Id> = snapshot
        .trailers
        .values()
        .chain(adopted)
        .flat_map(|t| (0..t.groups.len() as u32).filter_map(|g| t.group_id(g)))
        .collect();
    live.iter().all(|g| present.contains(g))
}

/// How GC judges what the live versions use, and what that judgement decided.
struct Judged {
    live_use: Box<dyn Liveness + Send + Sync>,
    /// The packs whose trailers fast deletion reads (`None`: every pack, as the exact pass).
    scope: Option<HashSet<Id>>,
    /// The exact pass: every group a live version uses, to tell whether any is lost.
    live_groups: Option<HashSet<Id>>,
    /// The summaries live chains are resolved through.
    bases: SummaryBases,
}

/// The exact pass marks every live tree; fast deletion reads the images' merged summaries
/// and scopes the packs to those the deleted versions' dead data is in (plus `small`).
#[allow(clippy::too_many_arguments)]
async fn judge_liveness(
    repo: &Arc<Repo>,
    options: &GcOptions,
    records: &mut RecordSource,
    snapshot: &Snapshot,
    live: &LiveVersions,
    unfreed: &[Id],
    small: &HashSet<Id>,
    report: &mut GcReport,
    clock: &mut PhaseClock,
) -> EngineResult<Judged> {
    let mut bases = SummaryBases::default();
    match options.mode {
        GcMode::Repair => {
            // The exact pass does not keep merged summaries up: it deletes them (before it
            // deletes the summaries of dead trees they may count), and the next fast
            // deletion builds them again. The chains they name are judged again first.
            for (_, merged, _) in repo.merged_summaries().await? {
                if let Ok(merged) = merged {
                    bases.read(&merged);
                }
            }
            if !options.dry_run {
                repo.delete_merged_summaries().await?;
            }
            let mut marks = Marks::default();
            progress::start(
                &options.progress,
                "marking live versions",
                Unit::Items,
                live.live.len() as u64,
            );
            for record in live.live.values() {
                progress::add(&options.progress, 1);
                marks
                    .mark_version(&snapshot.reader, record, &mut report.metadata_read_bytes)
                    .await?;
            }
            report.live_blobs = (marks.nodes.len() + marks.slots.len()) as u64;
            clock.lap("marking", report);
            Ok(Judged {
                live_groups: Some(marks.slots.keys().copied().collect()),
                live_use: Box::new(marks),
                scope: None,
                bases,
            })
        }
        GcMode::Fast => {
            let mut used = live_summary(repo, &snapshot.reader, live, options, report).await?;
            bases = std::mem::take(&mut used.bases);
            report.live_blobs = used.live.blobs();
            clock.lap("live summaries", report);
            let mut scope = affected_packs(repo, records, snapshot, &used, unfreed, live).await?;
            clock.lap("affected packs", report);
            if let Some(scope) = scope.as_mut() {
                scope.extend(small.iter().copied());
                let duplicates = duplicate_packs(snapshot, &used.fresh_keys).await?;
                report.duplicate_blobs = duplicates.blobs;
                report.duplicate_packs = duplicates.packs.len() as u64;
                scope.extend(duplicates.packs);
                clock.lap("duplicate copies", report);
            }
            Ok(Judged {
                live_use: Box::new(used.live),
                scope,
                live_groups: None,
                bases,
            })
        }
    }
}

/// The order packs are repacked in: a relayout's packs first, in the order it wrote them
/// (their layout times rise with it), so that their copies stay in the order a restore reads
/// them; then the others, by the run that names them.
fn repack_order<'p>(snapshot: &Snapshot, packs: &'p [Id]) -> Vec<&'p Id> {
    let mut order: Vec<&Id> = packs.iter().collect();
    order.sort_by_key(|p| {
        let layout = snapshot.layout.get(*p).copied().unwrap_or(u64::MAX);
        let run = snapshot.named.get(*p).copied().unwrap_or(usize::MAX);
        (layout, run, **p)
    });
    order
}

/// Copies what survives of the packs the plan rewrites, and the groups rebuilt from good
/// copies, into new packs. Returns the writer, to finish.
async fn repack<'a>(
    repo: &'a Arc<Repo>,
    options: &GcOptions,
    snapshot: &Snapshot,
    plan: &PackPlan,
    live_use: &(dyn Liveness + Send + Sync),
    damaged: Damaged,
    report: &mut GcReport,
) -> EngineResult<Repacker<'a>> {
    let mut writer = Repacker::new(repo);
    let to_copy: u64 = plan.to_repack.iter().map(|p| plan.live_bytes[p]).sum();
    progress::start(&options.progress, "repacking", Unit::Bytes, to_copy);
    for pack in repack_order(snapshot, &plan.to_repack) {
        let data = repo.read_whole_pack(pack).await?;
        let trailer = &snapshot.trailers[pack];
        let from_layout = snapshot.layout.get(pack).copied();
        let groups: Vec<u32> = plan.canonical_in[pack].clone();
        // Copies are made on every core (recompression is CPU work), stored in order.
        let copies = super::recompress::parallel_map(groups, |g| {
            let live = live_use.live_slots(trailer, g);
            let copied = copy_group(repo, trailer, g, &data, live.as_ref(), options.recompress);
            (g, live, copied)
        });
        for (g, live, copied) in copies {
            let group = &trailer.groups[g as usize];
            report.repacked_bytes += u64::from(group.desc.stored_len);
            progress::add(&options.progress, u64::from(group.desc.stored_len));
            writer
                .push_copy(group.kind, copied?, live.as_ref(), from_layout)
                .await?;
        }
    }
    for (_, group) in damaged.rebuilt {
        report.repacked_bytes += u64::from(group.desc.stored_len);
        writer.push(BlobKind::Data, group, None).await?;
    }
    Ok(writer)
}

/// Versions published while GC ran may reuse what its plan deletes: their trees are read
/// through every run (the superseded ones are still there), and what they use that the plan
/// deletes is stored again (`rescue`), its run and packs added to what GC wrote.
#[allow(clippy::too_many_arguments)]
async fn rescue_newcomers(
    repo: &Arc<Repo>,
    snapshot: &Snapshot,
    live: &LiveVersions,
    live_now: &LiveVersions,
    live_use: &(dyn Liveness + Send + Sync),
    written_runs: &mut HashSet<Id>,
    packs_now: &mut HashMap<Id, u64>,
    report: &mut GcReport,
) -> EngineResult<()> {
    let newcomers: Vec<&VersionRecord> = live_now
        .live
        .iter()
        .filter(|(id, _)| !live.live.contains_key(*id))
        .map(|(_, r)| r)
        .collect();
    if newcomers.is_empty() {
        return Ok(());
    }
    let everything = Snapshot::load(repo).await?;
    let mut used = Marks::default();
    for record in newcomers {
        used.mark_version(&everything.reader, record, &mut report.metadata_read_bytes)
            .await?;
    }
    let (now, _) = repo.v2_view().await?;
    if let Some((run, written)) = rescue(repo, snapshot, &now, &used, live_use, report).await? {
        written_runs.insert(run);
        packs_now.extend(written);
    }
    Ok(())
}

/// Records that the space of the deleted versions `unfreed` is given back, and deletes the
/// reference summaries of their trees, and those kept until now as bases of chains
/// (`bases.before`), that no live version has nor resolves its summary through.
async fn free_versions(
    repo: &Repo,
    records: &mut RecordSource,
    unfreed: &[Id],
    live: &LiveVersions,
    bases: &mut SummaryBases,
) -> EngineResult<()> {
    let live_roots: HashSet<Id> = live.live.values().filter_map(|r| r.root).collect();
    bases.cover(repo, &live_roots).await?;
    let mut candidates: Vec<Id> = Vec::new();
    for v in unfreed {
        if let Ok(record) = records.load(repo, v).await {
            candidates.extend(record.root);
        }
    }
    // Summaries kept as bases until now that no live chain needs any more are known by key:
    // their roots are listed (only then: usually a chain's bases are still needed).
    let before = bases.no_longer_needed();
    if !before.is_empty() {
        let listed = repo.summary_roots().await?;
        candidates.extend(
            listed
                .into_iter()
                .map(|(root, _)| root)
                .filter(|root| before.contains(&cairn_format::group_summary::key_of(root))),
        );
    }
    candidates.sort_unstable();
    candidates.dedup();
    for root in candidates {
        if !live_roots.contains(&root) && !bases.needed(&root) {
            repo.delete_summary(&root).await?;
        }
    }
    for v in unfreed {
        repo.mark_freed(v).await?;
    }
    Ok(())
}

/// Deletes the orphan packs (listed before the plan, named by no run then) that no run in the
/// store names now, after the wait: every session that could still have published a run
/// naming them has ended. Returns those it deleted.
async fn delete_orphans(
    repo: &Repo,
    orphans: &[Id],
    report: &mut GcReport,
) -> EngineResult<Vec<Id>> {
    let mut deleted = Vec::new();
    if orphans.is_empty() {
        return Ok(deleted);
    }
    // Every run in the store now, as GC's snapshot reads them.
    let named = match Snapshot::load(repo).await {
        Ok(now) => now.named,
        Err(EngineError::Gc(damaged)) => {
            tracing::warn!("{damaged}; orphan packs are left for the next gc");
            return Ok(deleted);
        }
        Err(e) => return Err(e),
    };
    for pack in orphans.iter().filter(|p| !named.contains_key(*p)) {
        repo.delete_orphan_pack(pack).await?;
        report.orphan_packs_deleted += 1;
        deleted.push(*pack);
    }
    Ok(deleted)
}

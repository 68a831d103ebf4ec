//! The exact pass (`cairn gc --repair`): mark every blob reachable from a live version, sweep
//! the rest. It removes what fast deletion leaked, packs left by crashed commits, and dead
//! blobs in packs fast deletion did not repack; it consolidates the index into one file and
//! writes the reference summary of any live tree that lacks one.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cairn_format::index::PackIndex;
use cairn_format::marker::GcPlan;
use cairn_format::node::Leaf;
use cairn_format::pack::BlobEntry;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::session::now_ns;
use cairn_repo::tree_walk::{walk_tree, NodeAt, TreeVisitor};
use cairn_repo::{BlobIndex, BlobLocation, Repo};

use super::leftovers::{remove_orphan_records, remove_stale_markers};
use super::summaries::{ensure_summary, SummaryCheck};
use super::{
    delete_orphans, finish, orphan_packs, pack_payload, publish_and_wait, put_index, rescue,
    sorted, stored_bytes, sweep, unreadable_live_tree, write_pack, GcOptions, GcReport, Repacker,
    Snapshot, SnapshotReader,
};
use crate::error::{EngineError, EngineResult};
use crate::live::live_versions;
use crate::progress::{self, Unit, WorkProgress};

pub(super) async fn run(repo: &Arc<Repo>, options: &GcOptions) -> EngineResult<GcReport> {
    let mut report = GcReport::default();

    // Mark. Refs are read before the index snapshot: a version's blobs are indexed before
    // its ref points at it, so the snapshot holds everything the marked versions use.
    let live = live_versions(repo).await?;
    let snapshot = Snapshot::load(repo).await?;
    // Leftover lists of fast deletion: this pass sweeps every dead blob, so they go too.
    let leftovers = repo.gc_leftovers().await?;
    let summaries_before = repo.summary_roots().await?;
    let mut marker = Marker::default();
    progress::start(
        &options.progress,
        "marking live versions",
        Unit::Items,
        live.live.len() as u64,
    );
    for record in live.live.values() {
        progress::add(&options.progress, 1);
        marker.mark_version(repo, &snapshot.index, record).await?;
    }
    report.live_versions = live.live.len() as u64;
    report.live_blobs = marker.live.len() as u64;

    // Plan: which copy of each live blob survives, and what happens to each pack.
    let (bytes_before, pack_sizes) = stored_bytes(repo, None).await?;
    report.bytes_before = bytes_before;
    let plan = PackPlan::new(
        &snapshot,
        &marker.live,
        &pack_sizes,
        &repo.quarantined(),
        options.repack_threshold,
    );
    let PackPlan {
        canonical,
        dead,
        live_bytes,
        indexed_packs,
        to_delete,
        to_repack,
        kept,
    } = plan;
    report.dead_blobs = dead.len() as u64;
    let orphans = orphan_packs(&pack_sizes, &indexed_packs);
    report.packs_deleted = to_delete.len() as u64;
    report.packs_repacked = to_repack.len() as u64;
    report.index_files_replaced = snapshot.files.len() as u64;
    report.metadata_bytes_read = marker.bytes_read;
    if options.dry_run {
        report.bytes_after = report.bytes_before
            - to_delete.iter().map(|p| pack_sizes[p]).sum::<u64>()
            - to_repack
                .iter()
                .map(|p| pack_sizes[p] - live_bytes[p])
                .sum::<u64>();
        return Ok(report);
    }

    // Summaries: every live tree must have one (fast deletion trusts them); write the missing
    // or damaged ones. Done before anything is deleted, while every live node is readable.
    let live_roots: HashSet<Id> = live.live.values().filter_map(|r| r.root).collect();
    let mut have: HashSet<Id> = summaries_before.iter().map(|(id, _)| *id).collect();
    for record in live.live.values() {
        let Some(root) = record.root else { continue };
        if have.insert(root) {
            report.summary_bytes +=
                ensure_summary(repo, &snapshot.index, record, SummaryCheck::Missing, true)
                    .await?
                    .written;
        }
    }
    let freed = repo.freed_versions().await?;
    let unfreed: Vec<Id> = live.deleted.difference(&freed).copied().collect();

    let nothing_to_do =
        to_delete.is_empty() && to_repack.is_empty() && orphans.is_empty() && dead.is_empty();
    if nothing_to_do && snapshot.files.len() <= 1 {
        for v in &unfreed {
            repo.mark_freed(v).await?;
        }
        remove_orphan_records(repo, &live, options, &mut report).await?;
        for (key, _) in &leftovers {
            repo.delete_gc_leftover(key).await?;
        }
        report.freed_versions = unfreed.len() as u64;
        report.bytes_after = report.bytes_before;
        return Ok(report);
    }

    // Write repacked packs, then the consolidated index (kept packs' live entries + new packs).
    let mut by_pack: HashMap<Id, Vec<BlobEntry>> = HashMap::new();
    for (pack, entry) in canonical.values() {
        by_pack.entry(*pack).or_default().push(*entry);
    }
    let mut consolidated: Vec<PackIndex> = kept
        .iter()
        .filter_map(|p| {
            by_pack.get(p).map(|e| PackIndex {
                pack: *p,
                entries: sorted(e),
            })
        })
        .collect();
    consolidated.extend(repack(repo, &to_repack, &by_pack, &mut report, &options.progress).await?);
    report.packs_written =
        (consolidated.len() - kept.iter().filter(|p| by_pack.contains_key(p)).count()) as u64;
    // An index file GC writes may be byte-identical to one it read: never supersede those.
    let mut written_index = HashSet::new();
    written_index.insert(put_index(repo, consolidated).await?);
    let superseded: Vec<Id> = snapshot
        .files
        .iter()
        .map(|(id, _)| *id)
        .filter(|id| !written_index.contains(id))
        .collect();

    let dead: Vec<Id> = dead.into_iter().collect();
    let plan = GcPlan {
        created_ns: now_ns(),
        dead_blobs: dead.clone(),
        superseded_index: superseded.clone(),
    };
    let published = publish_and_wait(repo, &plan, options, &mut report).await?;

    // Re-mark from the refs as they are now; rescue dead blobs that new versions use.
    // Refs first, then the index (as in the first mark): every version read is fully indexed.
    let live_now = live_versions(repo).await?;
    let now_index = Snapshot::load(repo).await?;
    for (id, record) in &live_now.live {
        if !live.live.contains_key(id) {
            marker.mark_version(repo, &now_index.index, record).await?;
        }
    }
    let doomed_set: HashSet<Id> = to_delete.iter().chain(&to_repack).copied().collect();
    rescue(
        repo,
        &snapshot.index,
        &dead,
        |id| marker.live.contains(id),
        Some(&now_index),
        &doomed_set,
        &mut written_index,
        &mut report,
    )
    .await?;

    let doomed: Vec<Id> = to_delete.iter().chain(&to_repack).copied().collect();
    progress::start(&options.progress, "deleting", Unit::Items, 0);
    sweep(repo, &superseded, &written_index, &doomed).await?;
    delete_orphans(repo, &orphans, &mut report).await?;
    remove_orphan_records(repo, &live_now, options, &mut report).await?;
    // Summaries of trees no live version has (deleted versions, crashed commits). Only those
    // listed before the plan: a commit that started later may be about to publish its tree.
    let live_roots_now: HashSet<Id> = live_now.live.values().filter_map(|r| r.root).collect();
    for (root, _) in &summaries_before {
        if !live_roots.contains(root) && !live_roots_now.contains(root) {
            repo.delete_summary(root).await?;
        }
    }
    for v in &unfreed {
        repo.mark_freed(v).await?;
    }
    report.freed_versions = unfreed.len() as u64;
    for (key, _) in &leftovers {
        repo.delete_gc_leftover(key).await?;
    }
    finish(repo, &published, options).await?;
    let (bytes_after, packs_after) = stored_bytes(repo, Some(&pack_sizes)).await?;
    report.bytes_after = bytes_after;
    remove_stale_markers(repo, &packs_after, true).await?;
    Ok(report)
}

/// What becomes of every pack, decided from the mark: which copy of each live blob
/// survives (`canonical`), which blobs are dead, and which packs are deleted (no live
/// bytes), repacked (below the threshold, or holding a quarantined copy) or kept.
struct PackPlan {
    canonical: HashMap<Id, (Id, BlobEntry)>,
    dead: HashSet<Id>,
    /// Stored bytes of the surviving copies, per pack.
    live_bytes: HashMap<Id, u64>,
    indexed_packs: HashSet<Id>,
    to_delete: Vec<Id>,
    to_repack: Vec<Id>,
    kept: Vec<Id>,
}

impl PackPlan {
    fn new(
        snapshot: &Snapshot,
        live: &HashSet<Id>,
        pack_sizes: &HashMap<Id, u64>,
        quarantined: &HashSet<(Id, Id)>,
        repack_threshold: f64,
    ) -> PackPlan {
        let mut canonical: HashMap<Id, (Id, BlobEntry)> = HashMap::new();
        let mut dead: HashSet<Id> = HashSet::new();
        let mut live_bytes: HashMap<Id, u64> = HashMap::new();
        // Entries each pack's index lists, to tell blob bytes from header and trailer overhead.
        let mut indexed_entries: HashMap<Id, u64> = HashMap::new();
        let mut indexed_packs: HashSet<Id> = HashSet::new();
        // Quarantined copies of live blobs: used only where no good copy exists, and then
        // their pack is kept as it is (never repacked: the copy would fail its check).
        let mut damaged_copies: Vec<(Id, BlobEntry)> = Vec::new();
        for (_, file) in &snapshot.files {
            for p in &file.packs {
                indexed_packs.insert(p.pack);
                if !pack_sizes.contains_key(&p.pack) {
                    continue; // missing pack: verify's business; its blobs have no copy here
                }
                *indexed_entries.entry(p.pack).or_default() += p.entries.len() as u64;
                for e in &p.entries {
                    if !live.contains(&e.id) {
                        dead.insert(e.id);
                    } else if quarantined.contains(&(p.pack, e.id)) {
                        damaged_copies.push((p.pack, *e));
                    } else if let Entry::Vacant(slot) = canonical.entry(e.id) {
                        slot.insert((p.pack, *e));
                        *live_bytes.entry(p.pack).or_default() += e.stored_len as u64;
                    }
                }
            }
        }
        let mut pinned: HashSet<Id> = HashSet::new();
        for (pack, e) in damaged_copies {
            if let Entry::Vacant(slot) = canonical.entry(e.id) {
                slot.insert((pack, e));
                *live_bytes.entry(pack).or_default() += e.stored_len as u64;
                pinned.insert(pack);
            }
        }
        let (mut to_delete, mut to_repack, mut kept) = (Vec::new(), Vec::new(), Vec::new());
        for pack in &indexed_packs {
            let Some(&size) = pack_sizes.get(pack) else {
                continue;
            };
            let lb = live_bytes.get(pack).copied().unwrap_or(0);
            let payload = pack_payload(size, indexed_entries.get(pack).copied().unwrap_or(0));
            // A pack holding a quarantined copy no longer matches its id: rewrite it (unless
            // that copy is the only one left), so the repository verifies clean again.
            let damaged = quarantined.iter().any(|(p, _)| p == pack);
            if pinned.contains(pack) {
                kept.push(*pack);
            } else if lb == 0 {
                to_delete.push(*pack);
            } else if damaged || (lb as f64) < repack_threshold * payload as f64 {
                to_repack.push(*pack);
            } else {
                kept.push(*pack);
            }
        }
        PackPlan {
            canonical,
            dead,
            live_bytes,
            indexed_packs,
            to_delete,
            to_repack,
            kept,
        }
    }
}

/// Copies the surviving blobs of `to_repack` (verified first: a corrupt blob is never
/// laundered into a new pack) into new packs; returns their index entries.
async fn repack(
    repo: &Repo,
    to_repack: &[Id],
    by_pack: &HashMap<Id, Vec<BlobEntry>>,
    report: &mut GcReport,
    progress: &Option<Arc<WorkProgress>>,
) -> EngineResult<Vec<PackIndex>> {
    let to_copy = to_repack
        .iter()
        .flat_map(|p| &by_pack[p])
        .map(|e| e.range().end - e.range().start)
        .sum();
    progress::start(progress, "repacking", Unit::Bytes, to_copy);
    let mut written = Vec::new();
    let mut repacker = Repacker::new(repo.config().pack_target as usize);
    for pack in to_repack {
        let data = repo.read_whole_pack(pack).await?;
        for e in sorted(&by_pack[pack]) {
            let r = e.range();
            let stored = &data[r.start as usize..r.end as usize];
            repo.check_blob(
                &BlobLocation {
                    pack: *pack,
                    entry: e,
                },
                stored,
            )?;
            report.bytes_repacked += stored.len() as u64;
            progress::add(progress, stored.len() as u64);
            if let Some(done) = repacker.push(&e, stored) {
                written.push(write_pack(repo, done).await?);
            }
        }
    }
    for done in repacker.finish() {
        written.push(write_pack(repo, done).await?);
    }
    Ok(written)
}

/// Collects the blobs reachable from versions, reading each manifest node once.
#[derive(Default)]
struct Marker {
    live: HashSet<Id>,
    bytes_read: u64,
}

impl Marker {
    async fn mark_version(
        &mut self,
        repo: &Repo,
        index: &BlobIndex,
        record: &VersionRecord,
    ) -> EngineResult<()> {
        let Some(root) = record.root else {
            return Ok(());
        };
        let mut reader = SnapshotReader {
            repo,
            index,
            bytes_read: &mut self.bytes_read,
        };
        walk_tree(
            &mut reader,
            root,
            record.height,
            record.fanout,
            &mut MarkLive(&mut self.live),
        )
        .await
        .map_err(|e| unreadable_live_tree(record, e))
    }
}

/// Marks every node and chunk of a tree live, skipping subtrees already marked.
struct MarkLive<'a>(&'a mut HashSet<Id>);

impl TreeVisitor<EngineError> for MarkLive<'_> {
    fn enter(&mut self, at: &NodeAt) -> bool {
        self.0.insert(at.id)
    }

    fn leaf(&mut self, _: &NodeAt, leaf: Leaf) -> EngineResult<()> {
        self.0.extend(leaf.chunk_ids());
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_format::index::IndexFile;
    use cairn_format::pack::{self, BlobEncoding, BlobKind};

    fn entry(tag: u8, offset: u32) -> BlobEntry {
        BlobEntry {
            id: Id::of(&[tag]),
            kind: BlobKind::Data,
            encoding: BlobEncoding::Raw,
            offset,
            stored_len: 1000,
            raw_len: 1000,
        }
    }

    /// A pack of `n` blobs of 1000 bytes, its exact size.
    fn pack(tags: &[u8]) -> (PackIndex, u64) {
        let entries: Vec<BlobEntry> = tags
            .iter()
            .enumerate()
            .map(|(i, t)| entry(*t, pack::HEADER_LEN as u32 + 1000 * i as u32))
            .collect();
        let size = (pack::HEADER_LEN + pack::FOOTER_LEN + entries.len() * pack::ENTRY_LEN) as u64
            + 1000 * entries.len() as u64;
        let id = Id::of(tags);
        (PackIndex { pack: id, entries }, size)
    }

    #[test]
    fn packs_are_kept_deleted_or_repacked_by_their_live_bytes() {
        // all live | all dead | 1 of 4 live | holds the only (quarantined) copy of live 30
        let packs = [
            pack(&[1, 2]),
            pack(&[10, 11]),
            pack(&[20, 21, 22, 23]),
            pack(&[30]),
        ];
        let ids: Vec<Id> = packs.iter().map(|(p, _)| p.pack).collect();
        let sizes: HashMap<Id, u64> = packs.iter().map(|(p, s)| (p.pack, *s)).collect();
        let snapshot = Snapshot {
            files: vec![(
                Id::of(b"index"),
                IndexFile {
                    packs: packs.iter().map(|(p, _)| p.clone()).collect(),
                },
            )],
            index: BlobIndex::new(),
        };
        let live: HashSet<Id> = [1u8, 2, 20, 30].iter().map(|t| Id::of(&[*t])).collect();
        let quarantined = HashSet::from([(ids[3], Id::of(&[30]))]);
        let plan = PackPlan::new(&snapshot, &live, &sizes, &quarantined, 0.5);
        assert_eq!(
            plan.kept.iter().collect::<HashSet<_>>(),
            HashSet::from([&ids[0], &ids[3]])
        );
        assert_eq!(plan.to_delete, vec![ids[1]]);
        assert_eq!(plan.to_repack, vec![ids[2]]);
        let dead: HashSet<Id> = [10u8, 11, 21, 22, 23]
            .iter()
            .map(|t| Id::of(&[*t]))
            .collect();
        assert_eq!(plan.dead, dead);
        assert_eq!(
            plan.canonical[&Id::of(&[30])].0,
            ids[3],
            "the quarantined copy, pinned"
        );
        assert_eq!(plan.live_bytes[&ids[2]], 1000);
    }
}

//! Damage heals instead of spreading, and damaged metadata never blocks work on the rest: a
//! damaged group copy is quarantined, the next commit of its data stores its chunks again,
//! every version using the group reads them from there, GC rebuilds the group under its own
//! id; `restore --allow-damage` zero-fills only what is lost; scoped and sampled verify;
//! `repair` rebuilds damaged index runs from the packs, heads and records, and stores lost
//! data again from a disk image; `diff` compares chunks.

use cairn_format::keys;
use std::sync::Arc;

use crate::common::*;
use cairn_engine::diff::diff;
use cairn_engine::gc::{gc, GcMode, GcOptions};
use cairn_engine::live::live_versions;
use cairn_engine::progress::WorkProgress;
use cairn_engine::repair::{repair, RepairOptions};
use cairn_engine::resolve::{history, history_checked, resolve, VersionSpec};
use cairn_engine::restore::{restore, RestoreOptions, RestoreStats, RestoreTarget};
use cairn_engine::source::open_path;
use cairn_engine::verify::{verify, verify_with, PackSubset, VerifyOptions};
use cairn_format::config::RepoConfig;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::Repo;
use cairn_store::{MemoryStore, ObjectStore};

fn healing_config() -> RepoConfig {
    RepoConfig {
        repo_id: [3; 16],
        segment_size: 1 << 20,
        pack_target: 1 << 20,
        ..RepoConfig::default_v2()
    }
}

async fn new_repo() -> (Arc<MemoryStore>, Arc<Repo>) {
    let store = Arc::new(MemoryStore::new());
    let repo = Arc::new(Repo::init(store.clone(), healing_config()).await.unwrap());
    (store, repo)
}

/// Reopens the repository as a new process would (closing the old one writes its
/// quarantine markers).
async fn reopen(store: &Arc<MemoryStore>, old: &Arc<Repo>) -> Arc<Repo> {
    old.close().await.unwrap();
    Arc::new(Repo::open(store.clone()).await.unwrap())
}

async fn resolved(repo: &Repo, spec: &str) -> (Id, VersionRecord) {
    resolve(repo, &VersionSpec::parse(spec).unwrap())
        .await
        .unwrap()
}

async fn version(repo: &Repo, spec: &str) -> VersionRecord {
    resolve(repo, &VersionSpec::parse(spec).unwrap())
        .await
        .unwrap()
        .1
}

/// The group holding the 4 KiB chunk `chunk`: (pack, group id, offset of the group in the
/// pack, slots it stores).
async fn group_of(repo: &Repo, chunk: &[u8]) -> (Id, Id, u32, usize) {
    let reader = repo.v2().unwrap();
    let (trailer, at) = reader.locate_chunk(&Id::of(chunk)).await.unwrap();
    let g = &trailer.groups[at.group as usize];
    (
        trailer.pack,
        trailer.group_id(at.group).unwrap(),
        g.offset,
        g.desc.chunks.len(),
    )
}

/// Flips a byte inside the stored bytes of the group that holds `chunk`; returns (pack,
/// group id, slots).
async fn damage_group_of(store: &MemoryStore, repo: &Repo, chunk: &[u8]) -> (Id, Id, usize) {
    let (pack, group, offset, slots) = group_of(repo, chunk).await;
    store.corrupt_object(&keys::pack(&pack), offset as usize + 40);
    (pack, group, slots)
}

async fn restore_allowing_damage(
    repo: &Arc<Repo>,
    record: &VersionRecord,
) -> (RestoreStats, Vec<u8>) {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.raw");
    let stats = restore(
        repo.clone(),
        record,
        RestoreTarget::Path(out.clone()),
        RestoreOptions {
            allow_damage: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    (stats, std::fs::read(&out).unwrap())
}

fn repair_gc() -> GcOptions {
    GcOptions {
        mode: GcMode::Repair,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_group_heals_when_its_content_is_committed_again() {
    let (store, repo) = new_repo().await;
    let data = noise(3 << 20, 7);
    commit_bytes(&repo, "vm", data.clone()).await;
    // The second group of segment 1 (blocks 272..287).
    let at = (1 << 20) + 16 * 4096;
    let (pack, group, slots) = damage_group_of(&store, &repo, &data[at..at + 4096]).await;
    assert_eq!(slots, 16, "64 KiB groups of incompressible 4 KiB chunks");

    // Nobody has read the damage yet: the same disk again dedups against it.
    let repo = reopen(&store, &repo).await;
    let v2 = commit_bytes(&repo, "vm", data.clone()).await;
    assert_eq!(v2.record.stats.new_chunks, 0);

    // verify finds it, names both versions, and quarantines the group.
    let repo = reopen(&store, &repo).await;
    let report = verify(repo.clone()).await.unwrap();
    let damaged: Vec<u64> = report.damaged_versions.iter().map(|d| d.seq).collect();
    assert_eq!(damaged, vec![1, 2], "{report:?}");
    assert_eq!(report.quarantined, 1);
    let markers = store.list("quarantine/").await.unwrap();
    assert_eq!(markers.len(), 1, "{markers:?}");
    assert_eq!(markers[0].key, keys::quarantine(&pack, &group));

    // The next commit, of the disk with block 256 changed, stores that block and the
    // group's 16 chunks again — in new groups (the changed block comes first in the
    // segment), not as a copy of the damaged one...
    let mut data3 = data.clone();
    data3[1 << 20..(1 << 20) + 4096].fill(9);
    let repo = reopen(&store, &repo).await;
    let v3 = commit_bytes(&repo, "vm", data3.clone()).await;
    assert_eq!(v3.record.stats.new_chunks, 17);
    assert_eq!(v3.record.stats.new_chunk_bytes, 17 * 4096);
    // The segment's other chunks come from the parent's leaf; never the quarantined group's.
    assert_eq!(v3.dedup.parent, 256 - 17);

    // ...which heals every version: they read those chunks by id; verify is clean (the
    // damaged pack is known, not a problem).
    let repo = reopen(&store, &repo).await;
    let report = verify(repo.clone()).await.unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.packs_with_quarantined, 1, "{report:?}");
    for (seq, want) in [(1, &data), (2, &data), (3, &data3)] {
        let r = version(&repo, &format!("vm@{seq}")).await;
        assert!(restore_bytes(&repo, &r).await.unwrap() == *want, "vm@{seq}");
    }

    // gc --repair rebuilds the group under its id and drops the damaged copy and its marker.
    let r = gc(&repo, &repair_gc()).await.unwrap();
    assert_eq!(r.groups_rebuilt, 1, "{r:?}");
    assert!(r.packs_repacked + r.packs_deleted >= 1, "{r:?}");
    let repo = reopen(&store, &repo).await;
    let report = verify(repo.clone()).await.unwrap();
    assert!(
        report.is_clean() && report.packs_with_quarantined == 0,
        "{report:?}"
    );
    assert!(store.list("quarantine/").await.unwrap().is_empty());
    let reader = repo.v2().unwrap();
    let copies = reader.group_copies(&group).await.unwrap();
    assert!(
        copies.iter().all(|c| c.stores(&[(0, 16)])),
        "the rebuilt group stores every slot"
    );

    // The healing lasts: with the version that stored the chunks again gone, the old ones
    // still read their group.
    cairn_engine::remove::remove_versions(&repo, &[VersionSpec::parse("vm@3").unwrap()])
        .await
        .unwrap();
    gc(&repo, &repair_gc()).await.unwrap();
    let repo = reopen(&store, &repo).await;
    assert!(verify(repo.clone()).await.unwrap().is_clean());
    for seq in 1..=2 {
        let r = version(&repo, &format!("vm@{seq}")).await;
        assert_eq!(restore_bytes(&repo, &r).await.unwrap(), data, "vm@{seq}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn similar_packs_never_lend_a_quarantined_group_to_another_image() {
    // A golden image, one of its groups damaged and quarantined; the same bytes committed as
    // an image of its own find everything else through the golden image's pack (the
    // similar-pack tier), and store that group's 16 chunks again.
    let (store, repo) = new_repo().await;
    let data = noise(3 << 20, 8);
    commit_bytes(&repo, "golden", data.clone()).await;
    let at = (2 << 20) + 32 * 4096;
    let (_, _, slots) = damage_group_of(&store, &repo, &data[at..at + 4096]).await;
    let repo = reopen(&store, &repo).await;
    assert_eq!(verify(repo.clone()).await.unwrap().quarantined, 1);
    let repo = reopen(&store, &repo).await;
    let clone = commit_bytes(&repo, "clone", data.clone()).await;
    assert_eq!(
        clone.record.stats.new_chunks, slots as u64,
        "{:?}",
        clone.dedup
    );
    assert_eq!(clone.dedup.similar, 3 * 256 - slots as u64);
    assert_eq!(clone.dedup.index, 0);
    assert!(restore_bytes(&repo, &clone.record).await.unwrap() == data);
    // The golden version reads the group's chunks from the clone's copy now.
    let golden = version(&repo, "golden").await;
    assert!(restore_bytes(&repo, &golden).await.unwrap() == data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_parent_fast_path_never_reuses_a_leaf_whose_group_is_damaged() {
    let (store, repo) = new_repo().await;
    let data = noise(3 << 20, 12);
    commit_bytes(&repo, "vm", data.clone()).await;
    let at = (1 << 20) + 40 * 4096;
    let (_, group, _) = damage_group_of(&store, &repo, &data[at..at + 4096]).await;
    // Before anyone read the damage, the same disk reuses every leaf (as format 1 dedups
    // against a damaged copy nobody has read).
    let repo = reopen(&store, &repo).await;
    let v2 = commit_bytes(&repo, "vm", data.clone()).await;
    assert_eq!(v2.reused_segments, 3);
    // Once verify has quarantined the group, the leaf naming it is not reused: its segment
    // is chunked, and the group's chunks are stored again.
    let repo = reopen(&store, &repo).await;
    assert_eq!(verify(repo.clone()).await.unwrap().quarantined, 1);
    let repo = reopen(&store, &repo).await;
    let v3 = commit_bytes(&repo, "vm", data.clone()).await;
    assert_eq!(v3.reused_segments, 2);
    assert_eq!(v3.record.stats.new_chunks, 16);
    // Stored in the same order, the chunks make a group with the same id: a good copy.
    let reader = repo.v2().unwrap();
    let copies = reader.group_copies(&group).await.unwrap();
    assert_eq!(copies.len(), 2);
    assert!(copies
        .iter()
        .any(|c| !reader.is_quarantined(c) && c.stores(&[(0, 16)])));
    let repo = reopen(&store, &repo).await;
    let report = verify(repo.clone()).await.unwrap();
    let damaged: Vec<u64> = report.damaged_versions.iter().map(|d| d.seq).collect();
    assert!(damaged.is_empty(), "healed by the new copies: {report:?}");
    assert!(restore_bytes(&repo, &v3.record).await.unwrap() == data);
}

/// A parent whose manifest nodes are damaged gives a commit neither its leaves (whole-leaf
/// reuse) nor their chunks (the changed segment's parent chunks): every chunk is found through
/// the index instead, and the new version is whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_over_a_parent_with_damaged_leaves_finds_its_chunks_through_the_index() {
    let (store, repo) = new_repo().await;
    let data = noise(3 << 20, 21);
    let v1 = commit_bytes(&repo, "vm", data.clone()).await;
    let leaf = cairn_engine::tree::leaf_map(&repo, &v1.record)
        .await
        .unwrap()[&1];
    let (trailer, at) = repo.v2().unwrap().locate_chunk(&leaf).await.unwrap();
    let offset = trailer.groups[at.group as usize].offset as usize;
    store.corrupt_object(&keys::pack(&trailer.pack), offset + 40);

    let repo = reopen(&store, &repo).await;
    let mut changed = data.clone();
    changed[(1 << 20) + 8192..(1 << 20) + 12288].fill(5);
    let v2 = commit_bytes(&repo, "vm", changed.clone()).await;
    assert_eq!(v2.dedup.parent, 0, "the damaged leaf lends nothing");
    assert_eq!(
        v2.record.stats.new_chunks, 1,
        "the rest found through the index"
    );
    assert!(restore_bytes(&repo, &v2.record).await.unwrap() == changed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_that_meets_damage_quarantines_it_and_allow_damage_restores_the_rest() {
    let (store, repo) = new_repo().await;
    let data = noise(3 << 20, 8);
    commit_bytes(&repo, "vm", data.clone()).await;
    let at = (2 << 20) + 5 * 4096;
    let (pack, group, _) = damage_group_of(&store, &repo, &data[at..at + 4096]).await;
    let repo = reopen(&store, &repo).await;
    let v1 = version(&repo, "vm@1").await;

    // A plain restore fails naming the pack and the group, and quarantines the copy.
    let err = restore_bytes(&repo, &v1).await.unwrap_err();
    assert!(
        err.contains(&keys::pack(&pack)) && err.contains("group"),
        "{err}"
    );

    // --allow-damage: everything else is restored; the group's 64 KiB are zeros and listed
    // (the copy is quarantined now: the reason names it).
    let (stats, got) = restore_allowing_damage(&repo, &v1).await;
    assert_eq!(stats.damaged.len(), 1, "{:?}", stats.damaged);
    let start = (2 << 20) as u64; // the group holds the segment's first 16 blocks
    assert_eq!(
        (stats.damaged[0].offset, stats.damaged[0].len),
        (start, 64 << 10)
    );
    assert!(
        stats.damaged[0]
            .reason
            .contains(&format!("{group} in pack {pack}"))
            && stats.damaged[0].reason.contains("quarantined"),
        "{}",
        stats.damaged[0].reason
    );
    let mut expected = data.clone();
    expected[start as usize..start as usize + (64 << 10)].fill(0);
    assert!(got == expected);

    // The marker reached the store when the repository was closed; dedup no longer trusts
    // the copy.
    let repo = reopen(&store, &repo).await;
    let markers = store.list("quarantine/").await.unwrap();
    assert_eq!(markers.len(), 1);
    assert_eq!(markers[0].key, keys::quarantine(&pack, &group));
    let reader = repo.v2().unwrap();
    assert!(reader
        .find_chunk(&Id::of(&data[at..at + 4096]))
        .await
        .unwrap()
        .is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_damage_zero_fills_a_lost_leaf_and_a_missing_pack() {
    let (store, repo) = new_repo().await;
    let data = noise(4 << 20, 9);
    let c = commit_bytes(&repo, "vm", data.clone()).await;
    // Damage the leaf of segment 2: its whole MiB is lost.
    let leaves = cairn_engine::tree::leaf_map(&repo, &c.record)
        .await
        .unwrap();
    let reader = repo.v2().unwrap();
    let (trailer, at) = reader.locate_chunk(&leaves[&2]).await.unwrap();
    let offset = trailer.groups[at.group as usize].offset;
    store.corrupt_object(&keys::pack(&trailer.pack), offset as usize + 3);
    // And lose the pack holding segment 0's first group.
    let (pack, _, _, _) = group_of(&repo, &data[..4096]).await;
    store.delete(&keys::pack(&pack)).await.unwrap();

    let repo = reopen(&store, &repo).await;
    let (stats, got) = restore_allowing_damage(&repo, &c.record).await;
    let mut expected = data.clone();
    for r in &stats.damaged {
        expected[r.offset as usize..(r.offset + r.len) as usize].fill(0);
    }
    assert!(got == expected);
    let ranges: Vec<(u64, u64)> = stats.damaged.iter().map(|d| (d.offset, d.len)).collect();
    assert!(ranges.contains(&(2 << 20, 1 << 20)), "{ranges:?}");
    assert!(ranges.iter().any(|r| r.0 == 0), "{ranges:?}");
    let lost: u64 = stats.damaged.iter().map(|d| d.len).sum();
    assert!(lost < data.len() as u64, "{ranges:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repair_rebuilds_a_damaged_index_run_from_the_packs() {
    let (store, repo) = new_repo().await;
    let data = noise(3 << 20, 60);
    let c = commit_bytes(&repo, "vm", data.clone()).await;
    let runs = store.list(keys::INDEX_RUNS).await.unwrap();
    assert_eq!(runs.len(), 1);
    // A byte of the run's meta (its pack table, fence keys and filter).
    store.corrupt_object(&runs[0].key, runs[0].size as usize - 60);
    let repo = reopen(&store, &repo).await;
    assert!(!verify(repo.clone()).await.unwrap().is_clean());
    // GC never acts on a partial view: it refuses, saying what to do.
    let err = gc(&repo, &repair_gc()).await.unwrap_err().to_string();
    assert!(
        err.contains(&runs[0].key) && err.contains("run `cairn repair`"),
        "{err}"
    );

    let report = repair(&repo, RepairOptions::default()).await.unwrap();
    assert_eq!(report.index_runs_set_aside.len(), 1, "{report:?}");
    assert!(report.blobs_reindexed > 0);
    assert!(report.is_clean(), "{:?}", report.lost_versions);
    assert!(
        store
            .list(&format!("damaged/{}", runs[0].key))
            .await
            .unwrap()
            .len()
            == 1
    );
    let repo = reopen(&store, &repo).await;
    assert!(verify(repo.clone()).await.unwrap().is_clean());
    assert_eq!(restore_bytes(&repo, &c.record).await.unwrap(), data);
    gc(&repo, &repair_gc()).await.unwrap();
    let repo = reopen(&store, &repo).await;
    assert!(verify(repo.clone()).await.unwrap().is_clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repair_from_a_source_stores_lost_chunks_and_nodes_again() {
    let (store, repo) = new_repo().await;
    let dir = tempfile::tempdir().unwrap();
    let data = noise(3 << 20, 70);
    let path = write_file(dir.path(), "disk.raw", &data);
    let c = commit_path(&repo, "vm", &path).await;
    // Lose a whole data pack (packs are 1 MiB here) and damage a leaf.
    let (lost_pack, _, _, _) = group_of(&repo, &data[..4096]).await;
    store.delete(&keys::pack(&lost_pack)).await.unwrap();
    let leaves = cairn_engine::tree::leaf_map(&repo, &c.record)
        .await
        .unwrap();
    let reader = repo.v2().unwrap();
    let (trailer, at) = reader.locate_chunk(&leaves[&2]).await.unwrap();
    let offset = trailer.groups[at.group as usize].offset;
    store.corrupt_object(&keys::pack(&trailer.pack), offset as usize + 2);
    let repo = reopen(&store, &repo).await;
    assert!(!verify(repo.clone()).await.unwrap().is_clean());
    let repo = reopen(&store, &repo).await;

    let without = repair(&repo, RepairOptions::default()).await.unwrap();
    assert!(!without.is_clean());
    assert_eq!(without.lost_versions.len(), 1);

    let from = path.clone();
    let report = repair(
        &repo,
        RepairOptions {
            from: Some(Box::new(move || open_path(&from))),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert!(report.blobs_restored > 0, "{report:?}");
    let repo = reopen(&store, &repo).await;
    let report = verify(repo.clone()).await.unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(restore_bytes(&repo, &c.record).await.unwrap(), data);

    // GC then rebuilds what it can under the old ids and keeps the version whole.
    gc(&repo, &repair_gc()).await.unwrap();
    let repo = reopen(&store, &repo).await;
    assert!(verify(repo.clone()).await.unwrap().is_clean());
    assert_eq!(restore_bytes(&repo, &c.record).await.unwrap(), data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn diff_compares_chunks_not_groups() {
    let (_store, repo) = new_repo().await;
    let a = noise(2 << 20, 11);
    let va = commit_bytes(&repo, "vm", a.clone()).await;
    // Version b: one block rewritten, and a block of other content copied over another (a
    // move: its chunk is found in a's group, so b's leaf names another group's slot there).
    let mut b = a.clone();
    b[5 * 4096..6 * 4096].fill(7);
    let moved = a[100 * 4096..101 * 4096].to_vec();
    b[300 * 4096..301 * 4096].copy_from_slice(&moved);
    let vb = commit_bytes(&repo, "vm", b.clone()).await;
    let report = diff(&repo, &va.record, &vb.record).await.unwrap();
    let ranges: Vec<(u64, u64)> = report.ranges.iter().map(|r| (r.offset, r.len)).collect();
    assert_eq!(ranges, vec![(5 * 4096, 4096), (300 * 4096, 4096)]);
    assert_eq!((report.chunks_added, report.chunks_removed), (2, 2));
    // A version with the same bytes committed again differs in nothing.
    let vc = commit_bytes(&repo, "vm", b).await;
    let report = diff(&repo, &vb.record, &vc.record).await.unwrap();
    assert!(report.ranges.is_empty(), "{report:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scoped_and_sampled_verify() {
    let (store, repo) = new_repo().await;
    let a = noise(2 << 20, 10);
    let b = noise(2 << 20, 11);
    commit_bytes(&repo, "a", a.clone()).await;
    commit_bytes(&repo, "b", b.clone()).await;
    damage_group_of(&store, &repo, &b[..4096]).await;
    let repo = reopen(&store, &repo).await;

    // Scoped to image a: clean, and only a's packs are read.
    let versions = history(&repo, "a").await.unwrap();
    let progress = Arc::new(WorkProgress::default());
    let report = verify_with(
        repo.clone(),
        &VerifyOptions {
            versions,
            subset: PackSubset::All,
            progress: Some(progress.clone()),
        },
    )
    .await
    .unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
    assert_eq!(report.versions_checked, 1);
    // Progress: the blob bytes of the packs read, then the one version's tree.
    let steps: Vec<(&str, u64, u64)> = progress
        .steps()
        .iter()
        .map(|r| (r.step.name, r.done, r.total))
        .collect();
    let (_, packed, _) = steps[0];
    assert!(packed > 0 && packed <= report.read_bytes, "{steps:?}");
    assert_eq!(
        steps,
        [("reading packs", packed, packed), ("walking trees", 1, 1)]
    );
    let full = verify(repo.clone()).await.unwrap();
    assert!(report.packs_checked < full.packs_checked);
    assert_eq!(full.damaged_versions.len(), 1);
    assert_eq!(full.damaged_versions[0].image, "b");

    // Parts 1/3 + 2/3 + 3/3 read every pack exactly once.
    let mut total = 0;
    for k in 1..=3 {
        let r = verify_with(
            repo.clone(),
            &VerifyOptions {
                versions: Vec::new(),
                subset: PackSubset::parse(&format!("{k}/3")).unwrap(),
                progress: None,
            },
        )
        .await
        .unwrap();
        total += r.packs_checked;
        assert_eq!(r.packs_in_scope, full.packs_in_scope);
    }
    assert_eq!(total, full.packs_checked);
    assert_eq!(PackSubset::parse("5%").unwrap(), PackSubset::Fraction(0.05));
    for bad in ["0%", "101%", "0/3", "4/3", "x", "1/0"] {
        assert!(PackSubset::parse(bad).is_err(), "{bad}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_version_record_is_one_finding_and_repair_sets_it_aside() {
    let (store, repo) = new_repo().await;
    let mut contents = Vec::new();
    for seed in 0..4u64 {
        let d = noise(2 << 20, 20 + seed);
        commit_bytes(&repo, "vm", d.clone()).await;
        contents.push(d);
    }
    let other = noise(2 << 20, 99);
    commit_bytes(&repo, "other", other.clone()).await;
    let (v2, _) = resolved(&repo, "vm@2").await;
    store.corrupt_object(&keys::version(&v2), 20);
    let repo = reopen(&store, &repo).await;

    // verify: exactly that record, by key; nothing else is damaged.
    let report = verify(repo.clone()).await.unwrap();
    assert!(!report.is_clean());
    let keys: Vec<&str> = report
        .damaged_metadata
        .iter()
        .map(|d| d.key.as_str())
        .collect();
    assert_eq!(keys, vec![keys::version(&v2).as_str()]);
    assert!(
        report.damaged_versions.is_empty(),
        "{:?}",
        report.damaged_versions
    );

    // Everything else lists, resolves and restores: the chain is broken at vm@2, and vm@1
    // below it is found by listing.
    let h = history_checked(&repo, "vm").await.unwrap();
    let seqs: Vec<u64> = h.versions.iter().map(|(_, r)| r.seq).collect();
    assert_eq!(seqs, vec![4, 3, 1]);
    assert_eq!(h.damage.len(), 1);
    for seq in [1u64, 3, 4] {
        let (_, r) = resolved(&repo, &format!("vm@{seq}")).await;
        assert_eq!(
            restore_bytes(&repo, &r).await.unwrap(),
            contents[seq as usize - 1]
        );
    }
    assert_eq!(history(&repo, "other").await.unwrap().len(), 1);

    // GC keeps everything that may be live (vm@1 is behind the break) and runs.
    for mode in [GcMode::Fast, GcMode::Repair] {
        gc(
            &repo,
            &GcOptions {
                mode,
                ..Default::default()
            },
        )
        .await
        .unwrap();
    }
    let repo = reopen(&store, &repo).await;
    let (_, r1) = resolved(&repo, "vm@1").await;
    assert_eq!(restore_bytes(&repo, &r1).await.unwrap(), contents[0]);

    // repair sets the record aside; verify is clean afterwards, the break is known.
    let report = repair(&repo, RepairOptions::default()).await.unwrap();
    assert_eq!(report.records_set_aside.len(), 1);
    assert!(report.is_clean(), "{:?}", report.lost_versions);
    assert!(store
        .head(&format!("damaged/{}", keys::version(&v2)))
        .await
        .unwrap()
        .is_some());
    let repo = reopen(&store, &repo).await;
    let report = verify(repo.clone()).await.unwrap();
    assert!(
        report.is_clean(),
        "{:?} {:?}",
        report.problems,
        report.damaged_metadata
    );
    let seqs: Vec<u64> = history(&repo, "vm")
        .await
        .unwrap()
        .iter()
        .map(|(_, r)| r.seq)
        .collect();
    assert_eq!(seqs, vec![4, 3, 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_head_is_rebuilt_from_the_newest_intact_version() {
    let (store, repo) = new_repo().await;
    let mut contents = Vec::new();
    for seed in 0..3u64 {
        let d = noise(2 << 20, 40 + seed);
        commit_bytes(&repo, "vm", d.clone()).await;
        contents.push(d);
    }
    commit_bytes(&repo, "other", noise(1 << 20, 5)).await;
    let head_key = keys::head("vm");
    store.corrupt_ref(&head_key, 12);
    let repo = reopen(&store, &repo).await;

    let live = live_versions(&repo).await.unwrap();
    assert_eq!(live.damage.len(), 1);
    assert_eq!(live.damage[0].key, format!("refs/{head_key}"));
    assert_eq!(
        live.live.len(),
        4,
        "every vm version is kept while the head is broken"
    );
    let report = verify(repo.clone()).await.unwrap();
    assert_eq!(report.damaged_metadata.len(), 1);
    // vm@2 can still be named (found by listing).
    let (_, r2) = resolved(&repo, "vm@2").await;
    assert_eq!(restore_bytes(&repo, &r2).await.unwrap(), contents[1]);

    let report = repair(&repo, RepairOptions::default()).await.unwrap();
    assert_eq!(
        report.heads_rebuilt,
        vec![("vm".to_string(), Some("vm@3".to_string()))]
    );
    let repo = reopen(&store, &repo).await;
    assert!(verify(repo.clone()).await.unwrap().is_clean());
    let (_, head) = resolved(&repo, "vm").await;
    assert_eq!(head.seq, 3);
}

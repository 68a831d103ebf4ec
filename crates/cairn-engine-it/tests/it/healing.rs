//! Damage heals instead of spreading, and damaged metadata never blocks work on the rest:
//! quarantine of damaged blob copies, `restore --allow-damage`, scoped and sampled verify,
//! and `repair` (heads, records, index, blobs from a source).

use cairn_format::keys;
use std::sync::Arc;

use crate::common::*;
use cairn_engine::gc::{gc, GcMode, GcOptions};
use cairn_engine::live::live_versions;
use cairn_engine::progress::WorkProgress;
use cairn_engine::repair::{repair, RepairOptions};
use cairn_engine::resolve::{history, history_checked, resolve, VersionSpec};
use cairn_engine::restore::{restore, RestoreOptions, RestoreTarget};
use cairn_engine::source::open_path;
use cairn_engine::verify::{verify, verify_with, PackSubset, VerifyOptions};
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::Repo;
use cairn_store::{MemoryStore, ObjectStore};

async fn new_repo() -> (Arc<MemoryStore>, Arc<Repo>) {
    let store = Arc::new(MemoryStore::new());
    let repo = Arc::new(
        Repo::init(store.clone(), config(16384, 1 << 20))
            .await
            .unwrap(),
    );
    (store, repo)
}

/// Reopens the repository as a new process would (and closes the old one, which writes
/// its quarantine markers).
async fn reopen(store: &Arc<MemoryStore>, old: &Arc<Repo>) -> Arc<Repo> {
    old.close().await.unwrap();
    Arc::new(Repo::open(store.clone()).await.unwrap())
}

async fn version(repo: &Repo, spec: &str) -> (Id, VersionRecord) {
    resolve(repo, &VersionSpec::parse(spec).unwrap())
        .await
        .unwrap()
}

/// Flips a byte inside the stored bytes of `chunk`.
fn flip_in_blob(store: &MemoryStore, repo: &Repo, chunk: &Id) {
    let loc = repo.locate(chunk).unwrap();
    store.corrupt_object(&keys::pack(&loc.pack), loc.entry.offset as usize + 50);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_chunk_heals_when_its_content_is_committed_again() {
    let (store, repo) = new_repo().await;
    let data = noise(3 << 20, 7);
    commit_bytes(&repo, "vm", data.clone()).await;
    let victim = Id::of(&data[(1 << 20)..(1 << 20) + 16384]);
    flip_in_blob(&store, &repo, &victim);

    // Nobody has read the damage yet: committing the same disk dedups against the damaged
    // copy, so version 2 is damaged too (a commit does not re-read what it dedups).
    let repo = reopen(&store, &repo).await;
    let v2 = commit_bytes(&repo, "vm", data.clone()).await;
    assert_eq!(v2.record.stats.new_chunks, 0);

    // verify finds it, names both versions, and quarantines the copy.
    let repo = reopen(&store, &repo).await;
    let report = verify(repo.clone()).await.unwrap();
    let damaged: Vec<u64> = report.damaged_versions.iter().map(|d| d.seq).collect();
    assert_eq!(damaged, vec![1, 2]);
    assert_eq!(report.quarantined, 1);
    let markers = store.list("quarantine/").await.unwrap();
    assert_eq!(markers.len(), 1, "{markers:?}");
    assert!(markers[0].key.ends_with(&victim.to_hex()));

    // The next commit of the same disk stores exactly that chunk again...
    let repo = reopen(&store, &repo).await;
    let v3 = commit_bytes(&repo, "vm", data.clone()).await;
    assert_eq!(v3.record.stats.new_chunks, 1);
    assert_eq!(v3.record.stats.new_chunk_bytes, 16384);

    // ...which heals every version: verify is clean, all three restore bit-exact.
    let repo = reopen(&store, &repo).await;
    let report = verify(repo.clone()).await.unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
    for seq in 1..=3 {
        let (_, r) = version(&repo, &format!("vm@{seq}")).await;
        assert_eq!(restore_bytes(&repo, &r).await.unwrap(), data, "vm@{seq}");
    }

    // gc --repair drops the damaged copy (its pack is repacked or deleted) and its marker.
    let r = gc(
        &repo,
        &GcOptions {
            mode: GcMode::Repair,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(r.packs_repacked + r.packs_deleted >= 1, "{r:?}");
    let repo = reopen(&store, &repo).await;
    assert!(verify(repo.clone()).await.unwrap().is_clean());
    assert!(store.list("quarantine/").await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restore_that_meets_damage_quarantines_it_and_allow_damage_restores_the_rest() {
    let (store, repo) = new_repo().await;
    let data = noise(3 << 20, 8);
    commit_bytes(&repo, "vm", data.clone()).await;
    let at = (2 << 20) + 5 * 16384;
    let victim = Id::of(&data[at..at + 16384]);
    flip_in_blob(&store, &repo, &victim);
    let repo = reopen(&store, &repo).await;
    let (_, v1) = version(&repo, "vm@1").await;

    // A plain restore fails naming the blob, and quarantines the copy.
    let err = restore_bytes(&repo, &v1).await.unwrap_err();
    assert!(err.starts_with(&format!("blob {victim} in pack ")), "{err}");

    // --allow-damage: everything else is restored, the damaged chunk is zeros and listed.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.raw");
    let stats = restore(
        repo.clone(),
        &v1,
        RestoreTarget::Path(out.clone()),
        RestoreOptions {
            allow_damage: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!(stats.damaged.len(), 1, "{:?}", stats.damaged);
    assert_eq!(
        (stats.damaged[0].offset, stats.damaged[0].len),
        (at as u64, 16384)
    );
    assert!(
        stats.damaged[0].reason.contains(&victim.to_hex()),
        "{}",
        stats.damaged[0].reason
    );
    let mut expected = data.clone();
    expected[at..at + 16384].fill(0);
    assert_eq!(std::fs::read(&out).unwrap(), expected);

    // The quarantine reached the store when the repository was closed.
    let repo = reopen(&store, &repo).await;
    assert_eq!(store.list("quarantine/").await.unwrap().len(), 1);
    assert!(
        !repo.has_blob(&victim),
        "dedup no longer trusts the damaged copy"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn allow_damage_zero_fills_a_lost_manifest_leaf_and_a_missing_pack() {
    let (store, repo) = new_repo().await;
    let data = noise(4 << 20, 9);
    let c = commit_bytes(&repo, "vm", data.clone()).await;
    // Damage the leaf of segment 2: its whole MiB is lost.
    let leaves = cairn_engine::tree::leaf_map(&repo, &c.record)
        .await
        .unwrap();
    let leaf = leaves[&2];
    let loc = repo.locate(&leaf).unwrap();
    store.corrupt_object(&keys::pack(&loc.pack), loc.entry.offset as usize + 3);
    let repo = reopen(&store, &repo).await;
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.raw");
    let stats = restore(
        repo.clone(),
        &c.record,
        RestoreTarget::Path(out.clone()),
        RestoreOptions {
            allow_damage: true,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    let ranges: Vec<(u64, u64)> = stats.damaged.iter().map(|d| (d.offset, d.len)).collect();
    assert_eq!(ranges, vec![(2 << 20, 1 << 20)]);
    let mut expected = data.clone();
    expected[(2 << 20)..(3 << 20)].fill(0);
    assert_eq!(std::fs::read(&out).unwrap(), expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scoped_and_sampled_verify() {
    let (store, repo) = new_repo().await;
    let a = noise(2 << 20, 10);
    let b = noise(2 << 20, 11);
    commit_bytes(&repo, "a", a.clone()).await;
    commit_bytes(&repo, "b", b.clone()).await;
    flip_in_blob(&store, &repo, &Id::of(&b[..16384]));
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
    assert!(packed > 0 && packed <= report.bytes_read, "{steps:?}");
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
    let (v2, _) = version(&repo, "vm@2").await;
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
        let (_, r) = version(&repo, &format!("vm@{seq}")).await;
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
    let (_, r1) = version(&repo, "vm@1").await;
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
    let (_, r2) = version(&repo, "vm@2").await;
    assert_eq!(restore_bytes(&repo, &r2).await.unwrap(), contents[1]);

    let report = repair(&repo, RepairOptions::default()).await.unwrap();
    assert_eq!(
        report.heads_rebuilt,
        vec![("vm".to_string(), Some("vm@3".to_string()))]
    );
    let repo = reopen(&store, &repo).await;
    assert!(verify(repo.clone()).await.unwrap().is_clean());
    let (_, head) = version(&repo, "vm").await;
    assert_eq!(head.seq, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repair_rebuilds_a_damaged_index_file_from_the_packs() {
    let (store, repo) = new_repo().await;
    let data = noise(3 << 20, 60);
    let c = commit_bytes(&repo, "vm", data.clone()).await;
    let files = store.list(keys::INDEX).await.unwrap();
    assert_eq!(files.len(), 1);
    store.corrupt_object(&files[0].key, 30);
    let repo = reopen(&store, &repo).await;
    assert!(!verify(repo.clone()).await.unwrap().is_clean());
    // GC never acts on a partial view: it refuses, saying what to do.
    let err = gc(&repo, &GcOptions::default())
        .await
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        format!(
            "gc: index file {} is damaged (index file: checksum mismatch (corrupt)); gc acts \
             only on a \
             complete index: run `cairn repair`, which rebuilds it from the packs; nothing was \
             deleted",
            files[0].key
        )
    );

    let report = repair(&repo, RepairOptions::default()).await.unwrap();
    assert_eq!(report.index_files_set_aside.len(), 1);
    assert!(report.blobs_reindexed > 0);
    assert!(report.is_clean(), "{:?}", report.lost_versions);
    let repo = reopen(&store, &repo).await;
    assert!(verify(repo.clone()).await.unwrap().is_clean());
    assert_eq!(restore_bytes(&repo, &c.record).await.unwrap(), data);
    gc(
        &repo,
        &GcOptions {
            mode: GcMode::Repair,
            ..Default::default()
        },
    )
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repair_from_a_source_stores_lost_chunks_and_nodes_again() {
    let (store, repo) = new_repo().await;
    let dir = tempfile::tempdir().unwrap();
    let data = noise(3 << 20, 70);
    let path = write_file(dir.path(), "disk.raw", &data);
    let c = commit_path(&repo, "vm", &path).await;
    // Lose a whole data pack (packs are 1 MiB here) and damage a leaf.
    let chunk = Id::of(&data[..16384]);
    let lost_pack = repo.locate(&chunk).unwrap().pack;
    store.delete(&keys::pack(&lost_pack)).await.unwrap();
    let leaves = cairn_engine::tree::leaf_map(&repo, &c.record)
        .await
        .unwrap();
    let leaf = repo.locate(&leaves[&2]).unwrap();
    store.corrupt_object(&keys::pack(&leaf.pack), leaf.entry.offset as usize + 2);
    let repo = reopen(&store, &repo).await;
    assert!(!verify(repo.clone()).await.unwrap().is_clean());
    let repo = reopen(&store, &repo).await;

    let without = repair(&repo, RepairOptions::default()).await.unwrap();
    assert!(!without.is_clean());
    assert_eq!(without.lost_versions.len(), 1);

    let from_path = path.clone();
    let report = repair(
        &repo,
        RepairOptions {
            dry_run: false,
            from: Some(Box::new(move || open_path(&from_path))),
        },
    )
    .await
    .unwrap();
    assert!(report.blobs_restored > 0);
    assert!(report.is_clean(), "{:?}", report.lost_versions);
    let repo = reopen(&store, &repo).await;
    assert!(verify(repo.clone()).await.unwrap().is_clean());
    assert_eq!(restore_bytes(&repo, &c.record).await.unwrap(), data);
}

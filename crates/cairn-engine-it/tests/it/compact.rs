//! Index compaction on format 2 (issue 17): merged runs hold exactly the locations of their
//! inputs, every version restores bit-exact through them and dedup still finds every chunk,
//! a dry run changes nothing, and a compaction dying after any number of store writes loses
//! nothing. Plain and encrypted repositories alike.

use crate::common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use crate::common::{commit_bytes, noise, restore_bytes, PASSPHRASE};
use cairn_engine::gc::compact::{after_commit, compact, CompactOptions, CompactReport};
use cairn_engine::gc::GcOptions;
use cairn_engine::verify::verify;
use cairn_format::config::RepoConfig;
use cairn_format::crypto::MasterKey;
use cairn_format::index_run;
use cairn_format::version::VersionRecord;
use cairn_format::{keys, Id};
use cairn_repo::{GivenPassphrase, Repo, SessionKind};
use cairn_store::{FailingStore, LocalStore, ObjectStore};
use zeroize::Zeroizing;

fn config() -> RepoConfig {
    RepoConfig {
        repo_id: [5; 16],
        segment_size: 256 << 10,
        pack_target: 1 << 20,
        ..RepoConfig::default_v2()
    }
}

async fn init(store: Arc<dyn ObjectStore>, encrypted: bool) -> Arc<Repo> {
    common::init_format2(store, config(), encrypted).await
}

async fn open(store: Arc<dyn ObjectStore>) -> cairn_repo::RepoResult<Repo> {
    let pass = GivenPassphrase(Zeroizing::new(PASSPHRASE.to_vec()));
    Repo::open_cached(store, SessionKind::Commit, None, Some(&pass)).await
}

fn options(all: bool) -> CompactOptions {
    CompactOptions {
        all,
        max_tier: None,
        gc: GcOptions {
            poll: Duration::from_millis(10),
            ..Default::default()
        },
    }
}

/// Commits `n` versions of one image, each rewriting a different 256 KiB with fresh noise,
/// and a second image sharing half of the first: one index run per commit.
async fn history(repo: &Arc<Repo>, n: u64) -> Vec<(VersionRecord, Vec<u8>)> {
    let mut data = noise(2 << 20, 1);
    let mut out = Vec::new();
    for i in 0..n {
        let at = (i as usize % 8) * (256 << 10);
        data[at..at + (256 << 10)].copy_from_slice(&noise(256 << 10, 100 + i));
        let c = commit_bytes(repo, "vm", data.clone()).await;
        out.push((c.record, data.clone()));
    }
    let mut other = data[..1 << 20].to_vec();
    other.extend(noise(1 << 20, 7));
    let c = commit_bytes(repo, "other", other.clone()).await;
    out.push((c.record, other));
    out
}

/// Every (key, pack) location the index runs in the store hold, read from their bytes.
async fn locations(store: &dyn ObjectStore, key: Option<&MasterKey>) -> BTreeSet<(u64, Id)> {
    let mut out = BTreeSet::new();
    for meta in store.list(keys::INDEX_RUNS).await.unwrap() {
        let bytes = store.get(&meta.key).await.unwrap();
        let run = index_run::parse_run(&bytes, key).unwrap();
        let entries = run.all_entries(&bytes, key).unwrap();
        out.extend(entries.iter().map(|e| (e.key, run.packs[e.pack as usize])));
    }
    out
}

/// A local repository (format 2, `encrypted` or not) holding [`history`] of `n` commits.
async fn local_history(
    encrypted: bool,
    n: u64,
) -> (
    tempfile::TempDir,
    Arc<dyn ObjectStore>,
    Arc<Repo>,
    Vec<(VersionRecord, Vec<u8>)>,
) {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn ObjectStore> = Arc::new(LocalStore::create(dir.path()).unwrap());
    let repo = init(store.clone(), encrypted).await;
    let versions = history(&repo, n).await;
    (dir, store, repo, versions)
}

async fn run_count(store: &dyn ObjectStore) -> usize {
    store.list(keys::INDEX_RUNS).await.unwrap().len()
}

async fn merges_runs_and_loses_no_location(encrypted: bool) {
    let (dir, store, repo, versions) = local_history(encrypted, 11).await;
    assert_eq!(run_count(&*store).await, 12);
    let before = locations(&*store, repo.key()).await;

    // A dry run reports the merge and changes nothing.
    let files_before = cairn_testkit::repo_snapshot(dir.path());
    let dry = compact(
        &repo,
        &CompactOptions {
            gc: GcOptions {
                dry_run: true,
                ..options(false).gc
            },
            ..options(false)
        },
    )
    .await
    .unwrap();
    assert_eq!((dry.merges, dry.runs_merged, dry.runs_after), (1, 12, 1));
    assert!(cairn_testkit::repo_snapshot(dir.path()) == files_before);

    let r: CompactReport = compact(&repo, &options(false)).await.unwrap();
    assert_eq!(
        (r.runs_before, r.runs_after, r.merges, r.runs_merged),
        (12, 1, 1, 12)
    );
    assert_eq!(run_count(&*store).await, 1);
    assert!(
        store.list(keys::PLANS).await.unwrap().is_empty(),
        "plan removed"
    );
    // Exactly the same locations, each once, in a run of the current version.
    let after = locations(&*store, repo.key()).await;
    assert!(
        after == before,
        "the merged run holds its inputs' locations"
    );
    assert_eq!(r.entries_after, before.len() as u64);
    let run_key = &store.list(keys::INDEX_RUNS).await.unwrap()[0].key;
    let run = index_run::parse_run(&store.get(run_key).await.unwrap(), repo.key()).unwrap();
    assert_eq!(run.version(), index_run::VERSION);
    // Nothing more to merge.
    let again = compact(&repo, &options(false)).await.unwrap();
    assert_eq!((again.merges, again.runs_after), (0, 1));
    assert_eq!(compact(&repo, &options(true)).await.unwrap().merges, 0);
    repo.close().await.unwrap();

    // A new process finds everything through the merged run: every version restores
    // bit-exact, verify is clean, and the same data committed again stores no chunk.
    let fresh = Arc::new(open(store.clone()).await.unwrap());
    for (record, data) in &versions {
        assert!(restore_bytes(&fresh, record).await.unwrap() == *data);
    }
    let v = verify(fresh.clone()).await.unwrap();
    assert!(v.is_clean(), "{:?} {:?}", v.problems, v.damaged_versions);
    let (_, last) = versions.last().unwrap();
    let c = commit_bytes(&fresh, "again", last.clone()).await;
    assert_eq!(c.record.stats.new_chunks, 0, "dedup finds every chunk");
    fresh.close().await.unwrap();
}

#[tokio::test]
async fn compaction_merges_runs_and_loses_no_location() {
    merges_runs_and_loses_no_location(false).await;
}

#[tokio::test]
async fn compaction_of_an_encrypted_repository_merges_its_sealed_runs() {
    merges_runs_and_loses_no_location(true).await;
}

/// An export is not waited for: the runs it read at open may be deleted under it. A lookup
/// that needs one forgets it and misses (never a store error), and after the refresh an
/// export does on a miss, it finds everything through the merged run.
#[tokio::test]
async fn an_export_reading_across_a_compaction_refreshes_and_finds_everything() {
    let (_dir, store, repo, versions) = local_history(false, 9).await;
    let export = Repo::open_cached(store.clone(), SessionKind::Export, None, None)
        .await
        .unwrap();
    let r = compact(&repo, &options(false)).await.unwrap();
    assert_eq!(r.runs_after, 1);
    let (record, data) = versions.last().unwrap();
    let root = record.root.expect("a tree");
    let v2 = export.v2().expect("format 2");
    match v2.read_chunk(&root).await {
        Err(e) => assert!(
            matches!(e, cairn_repo::RepoError::BlobMissing { .. }),
            "a miss, not {e}"
        ),
        Ok(_) => panic!("the export's runs were all deleted; it cannot have found the root"),
    }
    export.refresh_index().await.unwrap();
    assert!(v2.read_chunk(&root).await.is_ok());
    let export = Arc::new(export);
    assert!(restore_bytes(&export, record).await.unwrap() == *data);
    export.close().await.unwrap();
    repo.close().await.unwrap();
}

/// After a commit, full tiers are merged only when nothing else is using the repository (no
/// commit waits for another process), and then every version still restores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_merges_a_full_tier_only_when_no_other_session_is_alive() {
    let (_dir, store, repo, versions) = local_history(false, 7).await;
    assert_eq!(run_count(&*store).await, 8, "7 + 1 commits, a full tier 0");

    // Another process (here: a second session) is alive: nothing is merged.
    let other = open(store.clone()).await.unwrap();
    assert!(after_commit(&repo).await.is_none());
    assert_eq!(run_count(&*store).await, 8);

    // Alone again: the tier is merged into one run, with the GC protocol's cleanup.
    other.close().await.unwrap();
    let r = after_commit(&repo).await.expect("merged");
    assert_eq!((r.runs_before, r.runs_after, r.merges), (8, 1, 1));
    assert_eq!(run_count(&*store).await, 1);
    assert!(store.list(keys::PLANS).await.unwrap().is_empty());
    assert!(
        store.read_ref(keys::GC_LOCK).await.unwrap().is_none(),
        "lock released"
    );
    // Nothing more to merge.
    assert!(after_commit(&repo).await.is_none());

    let repo = Arc::new(open(store.clone()).await.unwrap());
    for (record, data) in &versions {
        assert!(restore_bytes(&repo, record).await.unwrap() == *data);
    }
    assert!(verify(repo.clone()).await.unwrap().is_clean());
}

/// The sessions a dying compaction leaves behind would go stale after a while; fast-forward.
async fn expire_sessions(store: &dyn ObjectStore) {
    for key in store.list_refs("sessions/").await.unwrap() {
        if let Some(state) = store.read_ref(&key).await.unwrap() {
            let _ = store.cas_ref(&key, Some(&state.version), None).await;
        }
    }
    if let Some(state) = store.read_ref("gc/lock").await.unwrap() {
        let _ = store.cas_ref("gc/lock", Some(&state.version), None).await;
    }
}

#[tokio::test]
async fn compaction_dying_after_any_number_of_store_writes_loses_nothing() {
    let (_dir, store, repo, versions) = local_history(false, 9).await;
    let before = locations(&*store, None).await;
    repo.close().await.unwrap();
    let mut trials = 0;
    for allowed in 0.. {
        let failing: Arc<dyn ObjectStore> = Arc::new(FailingStore::new(store.clone(), allowed));
        let Ok(r) = open(failing).await else {
            continue; // could not even register a session
        };
        let outcome = compact(&Arc::new(r), &options(false)).await;
        trials += 1;
        expire_sessions(&*store).await;
        // Whatever happened, a new process finds every location and every version.
        assert!(
            locations(&*store, None).await == before,
            "compaction stopped after {allowed} writes"
        );
        let check = Arc::new(open(store.clone()).await.unwrap());
        for (record, data) in &versions {
            assert!(
                restore_bytes(&check, record).await.unwrap() == *data,
                "after {allowed} writes"
            );
        }
        let v = verify(check.clone()).await.unwrap();
        assert!(v.is_clean(), "after {allowed}: {:?}", v.problems);
        check.close().await.unwrap();
        if outcome.is_ok() {
            break;
        }
        assert!(allowed < 100, "compaction never completed");
    }
    assert!(trials >= 5, "only {trials} crash points exercised");
    // What a dead compaction left (its output next to some of its inputs: below a full tier,
    // so the tiered pass may leave them) is merged by --all into one run, losing nothing.
    assert!(run_count(&*store).await < 2 * 8, "tiers stay bounded");
    let r = Arc::new(open(store.clone()).await.unwrap());
    compact(&r, &options(true)).await.unwrap();
    r.close().await.unwrap();
    assert_eq!(run_count(&*store).await, 1);
    assert!(locations(&*store, None).await == before);
}

/// A damaged run is never merged (its damage would be hidden in the output): compaction stops
/// with one line naming it and what to run, and changes nothing.
#[tokio::test]
async fn a_damaged_run_stops_compaction_and_changes_nothing() {
    let (dir, store, repo, _) = local_history(false, 9).await;
    let victim = store.list(keys::INDEX_RUNS).await.unwrap()[3].key.clone();
    let path = dir.path().join(&victim);
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.len() - 60; // in the meta, which the footer's checksum covers
    bytes[at] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap();
    let before = cairn_testkit::repo_snapshot(dir.path());
    let e = compact(&repo, &options(false))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&victim) && e.contains("cairn repair") && e.contains("nothing was changed"),
        "{e}"
    );
    assert!(!e.contains('\n'), "one line: {e}");
    repo.close().await.unwrap();
    let after = cairn_testkit::repo_snapshot(dir.path());
    let data = |snap: &[(String, Vec<u8>)]| -> Vec<(String, Vec<u8>)> {
        snap.iter()
            .filter(|(k, _)| !k.starts_with("refs/"))
            .cloned()
            .collect()
    };
    assert!(data(&after) == data(&before), "no object changed");
}

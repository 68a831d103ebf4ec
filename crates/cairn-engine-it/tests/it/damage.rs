//! Damage and faults: corrupt or truncated packs, failing stores, concurrent committers.
//! The user must get a clear error, the repository must stay consistent, and no committed
//! version may be lost.

use std::sync::Arc;

use crate::common::*;
use cairn_engine::commit::{commit, CommitOptions};
use cairn_engine::resolve::{history, resolve, VersionSpec};
use cairn_engine::source::StreamSource;
use cairn_engine::verify::verify;
use cairn_repo::Repo;
use cairn_store::{MemoryStore, ObjectStore};

/// Three versions of one image: v2 and v3 share everything but one MiB with v1; v3 adds a
/// unique MiB. Returns the store, the repo and the contents.
async fn three_versions() -> (Arc<MemoryStore>, Arc<Repo>, Vec<Vec<u8>>) {
    let store = Arc::new(MemoryStore::new());
    let repo = Arc::new(
        Repo::init(store.clone(), config(16384, 1 << 20))
            .await
            .unwrap(),
    );
    let v1 = noise(4 << 20, 1);
    let mut v2 = v1.clone();
    v2[(1 << 20)..(2 << 20)].copy_from_slice(&noise(1 << 20, 2));
    let mut v3 = v2.clone();
    v3[(3 << 20)..(4 << 20)].copy_from_slice(&noise(1 << 20, 3));
    let mut contents = Vec::new();
    for v in [v1, v2, v3] {
        commit_bytes(&repo, "vm", v.clone()).await;
        contents.push(v);
    }
    (store, repo, contents)
}

/// Reopens the repository as a new process would.
async fn reopen(store: &Arc<MemoryStore>) -> Arc<Repo> {
    Arc::new(Repo::open(store.clone()).await.unwrap())
}

async fn version(repo: &Repo, spec: &str) -> cairn_format::version::VersionRecord {
    resolve(repo, &VersionSpec::parse(spec).unwrap())
        .await
        .unwrap()
        .1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_failing_mid_commit_publishes_nothing_and_loses_nothing() {
    let inner = Arc::new(MemoryStore::new());
    let repo = Arc::new(
        Repo::init(inner.clone(), config(16384, 1 << 20))
            .await
            .unwrap(),
    );
    let v1 = noise(6 << 20, 9);
    let first = commit_bytes(&repo, "vm", v1.clone()).await;
    let v2 = noise(6 << 20, 10);
    // Allow every number of writes a commit might get through before the store "fills up",
    // until it has enough to finish; then that commit must be complete.
    let mut allowed = 0;
    loop {
        let failing = Arc::new(FailingStore::new(inner.clone(), allowed));
        let Ok(repo_f) = Repo::open(failing).await else {
            allowed += 1; // the store failed while the session was being registered
            continue;
        };
        let repo_f = Arc::new(repo_f);
        let src = StreamSource::new("test", std::io::Cursor::new(v2.clone()));
        let r = commit(repo_f, "vm", Box::new(src), CommitOptions::default()).await;
        let repo = reopen(&inner).await;
        let log = history(&repo, "vm").await.unwrap();
        let report = verify(repo.clone()).await.unwrap();
        assert!(
            report.is_clean(),
            "allowed {allowed}: {:?}",
            report.problems
        );
        match r {
            Err(e) => {
                assert!(
                    e.to_string().contains("injected failure"),
                    "allowed {allowed}: {e}"
                );
                assert_eq!(log.len(), 1, "allowed {allowed}: nothing was published");
                assert_eq!(log[0].0, first.id);
                assert_eq!(restore_bytes(&repo, &log[0].1).await.unwrap(), v1);
            }
            Ok(second) => {
                assert!(allowed >= 3, "a commit needs packs, index, version and ref");
                assert_eq!(log.len(), 2);
                assert_eq!(second.record.seq, 2);
                assert_eq!(restore_bytes(&repo, &second.record).await.unwrap(), v2);
                assert_eq!(restore_bytes(&repo, &log[1].1).await.unwrap(), v1);
                break;
            }
        }
        allowed += 1;
        assert!(allowed < 100, "commit never succeeded");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_commits_to_one_image_all_land() {
    let store: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new());
    Repo::init(store.clone(), config(16384, 1 << 20))
        .await
        .unwrap();
    let mut tasks = Vec::new();
    for i in 0..6u64 {
        // Each task opens its own Repo, as separate processes would.
        let store = store.clone();
        tasks.push(tokio::spawn(async move {
            let repo = Arc::new(Repo::open(store).await.unwrap());
            let data = noise(2 << 20, 100 + i);
            let c = commit_bytes(&repo, "shared", data.clone()).await;
            (c.id, data)
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.unwrap());
    }
    let repo = Arc::new(Repo::open(store).await.unwrap());
    let log = history(&repo, "shared").await.unwrap();
    let seqs: Vec<u64> = log.iter().map(|(_, r)| r.seq).collect();
    assert_eq!(
        seqs,
        vec![6, 5, 4, 3, 2, 1],
        "a linear history with no lost commit"
    );
    for (id, data) in results {
        let (_, record) = log
            .iter()
            .find(|(v, _)| *v == id)
            .expect("every commit is in the history");
        assert_eq!(restore_bytes(&repo, record).await.unwrap(), data);
    }
    assert!(verify(repo).await.unwrap().is_clean());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repository_that_refuses_writes_can_still_be_read() {
    let (store, _repo, contents) = three_versions().await;
    let read_only: Arc<dyn ObjectStore> = Arc::new(FailingStore::new(store.clone(), 0));
    // Readers work without a session ...
    let reader = Arc::new(
        Repo::open_as(read_only.clone(), cairn_repo::SessionKind::Restore)
            .await
            .unwrap(),
    );
    let v = version(&reader, "vm@2").await;
    assert_eq!(restore_bytes(&reader, &v).await.unwrap(), contents[1]);
    assert!(verify(reader.clone()).await.unwrap().is_clean());
    // ... writers need one: their safety against a concurrent GC depends on it.
    let err = Repo::open_as(read_only, cairn_repo::SessionKind::Commit)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("injected failure"), "{err}");
}

/// A repository in memory with one version of 3 MiB, 1 MiB packs.
async fn one_version_in_memory() -> Arc<MemoryStore> {
    let inner = Arc::new(MemoryStore::new());
    let repo = Arc::new(
        Repo::init(inner.clone(), config(16384, 1 << 20))
            .await
            .unwrap(),
    );
    commit_bytes(&repo, "vm", noise(3 << 20, 1)).await;
    inner
}

/// The pack keys in `store`, sorted.
async fn pack_keys(store: &MemoryStore) -> Vec<String> {
    let mut keys: Vec<String> = store
        .list("packs/")
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.key)
        .collect();
    keys.sort();
    keys
}

/// Commits 8 MiB of new data through `failing`, which must fail it; returns the repository
/// handle the commit used (its unindexed packs not yet discarded).
async fn commit_that_fails(failing: Arc<FailingStore>, options: CommitOptions) -> Arc<Repo> {
    let repo = Arc::new(Repo::open(failing).await.unwrap());
    let src = StreamSource::new("test", std::io::Cursor::new(noise(8 << 20, 2)));
    let err = commit(repo.clone(), "vm", Box::new(src), options)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("injected failure"), "{err}");
    repo
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_can_take_back_its_packs() {
    // The store fails mid-commit (a full bucket); once it accepts deletes again, the packs the
    // commit stored but never indexed are deleted, and the repository is what it was.
    let inner = one_version_in_memory().await;
    let before = pack_keys(&inner).await;
    for allowed in [2, 4, 7] {
        let failing = Arc::new(FailingStore::new(inner.clone(), allowed));
        let repo_f = commit_that_fails(failing.clone(), CommitOptions::default()).await;
        assert!(
            pack_keys(&inner).await.len() > before.len(),
            "allowed {allowed}: some packs landed"
        );
        failing.allow(usize::MAX);
        assert!(repo_f.discard_unindexed_packs().await > 0);
        assert_eq!(pack_keys(&inner).await, before, "allowed {allowed}");
        repo_f.close().await.unwrap();
    }
    let report = verify(reopen(&inner).await).await.unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_pack_of_a_failed_commit_lands_after_it_returns() {
    // A pack PUT fails while others are in flight, and those land late even if their caller
    // gives up (a server finishing a request whose body it had received; seen with MinIO on
    // a full disk). The failed commit waits for them, so that every pack it stored is
    // discarded: none appears after it returned.
    let inner = one_version_in_memory().await;
    let before = pack_keys(&inner).await;
    let delay = std::time::Duration::from_millis(300);
    for allowed in [2, 3, 5] {
        let failing = Arc::new(FailingStore::new(inner.clone(), allowed).with_landing_delay(delay));
        let options = CommitOptions {
            uploads: Some(4),
            ..CommitOptions::default()
        };
        let repo_f = commit_that_fails(failing.clone(), options).await;
        failing.allow(usize::MAX);
        repo_f.discard_unindexed_packs().await;
        // Anything still landing would land within the delay.
        tokio::time::sleep(delay * 2).await;
        assert_eq!(
            pack_keys(&inner).await,
            before,
            "allowed {allowed}: a pack of the failed commit landed after it returned"
        );
        repo_f.close().await.unwrap();
    }
    let report = verify(reopen(&inner).await).await.unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
}

//! Fast deletion while commits run: what it frees must be what it should. Three committers
//! cycle through variants of their images while a pruner keeps the last two versions of each
//! and runs fast deletion after every prune; afterwards the exact pass (`gc --repair`) must
//! find at most 1% of the repository left to reclaim. Before, a commit that saw a GC plan
//! refused every copy of each blob the plan named dead — including copies in packs the GC
//! kept — and stored the blob again: duplicates that only the exact pass removed (7–8% of the
//! repository in `scripts/stress_gc.py`'s leak check).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use crate::common::*;
use cairn_engine::gc::{gc, GcMode, GcOptions};
use cairn_engine::retention::{prune, KeepPolicy};
use cairn_engine::verify::verify;
use cairn_repo::Repo;
use cairn_repo::SessionKind;
use cairn_store::{LocalStore, ObjectStore};

const IMAGE: usize = 12 << 20;
const ROUNDS: u64 = 18;
/// The pruner must run at least this often while commits run; committers go on past
/// [`ROUNDS`] until it has (a slow GC, or a fast exact-dedup commit, must not make the
/// overlap a matter of timing), up to [`MAX_ROUNDS`].
const MIN_PRUNES: u64 = 3;
const MAX_ROUNDS: u64 = 200;

async fn open(store: &Arc<dyn ObjectStore>, kind: SessionKind) -> Arc<Repo> {
    Arc::new(Repo::open_as(store.clone(), kind).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fast_deletion_during_commits_leaves_at_most_one_percent_for_repair() {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn ObjectStore> = Arc::new(LocalStore::create(dir.path()).unwrap());
    let mut cfg = config(16384, 1 << 20);
    cfg.pack_target = 4 << 20;
    Repo::init(store.clone(), cfg)
        .await
        .unwrap()
        .close()
        .await
        .unwrap();

    let done = Arc::new(AtomicBool::new(false));
    let prunes = Arc::new(AtomicU64::new(0));
    let mut committers = Vec::new();
    for w in 0..3u64 {
        let (store, prunes) = (store.clone(), prunes.clone());
        committers.push(tokio::spawn(async move {
            // Three variants of one image committed in turn, as a fleet cycling through a few
            // golden images does: every version's data recurs, so commits keep reusing blobs
            // of versions the pruner has just deleted.
            let mut variants = vec![noise(IMAGE, 10_000_000 + w)];
            for v in 1..3u64 {
                let mut next = variants[v as usize - 1].clone();
                for k in 0..3u64 {
                    let at = (((v * 5 + k * 3 + w) % 11) as usize) << 20;
                    next[at..at + (512 << 10)]
                        .copy_from_slice(&noise(512 << 10, w * 100_000 + v * 10 + k));
                }
                variants.push(next);
            }
            let mut round = 0;
            while round < MAX_ROUNDS
                && (round < ROUNDS || prunes.load(Ordering::SeqCst) < MIN_PRUNES)
            {
                let repo = open(&store, SessionKind::Commit).await;
                commit_bytes(
                    &repo,
                    &format!("vm{w}"),
                    variants[round as usize % 3].clone(),
                )
                .await;
                repo.close().await.unwrap();
                round += 1;
            }
        }));
    }
    let pruner = {
        let (store, done, prunes) = (store.clone(), done.clone(), prunes.clone());
        tokio::spawn(async move {
            let policy = KeepPolicy {
                last: 2,
                ..Default::default()
            };
            let mut rounds = 0;
            while !done.load(Ordering::SeqCst) {
                let repo = open(&store, SessionKind::Edit).await;
                for image in repo.images().await.unwrap() {
                    prune(&repo, &image, &policy, false).await.unwrap();
                }
                gc(&repo, &GcOptions::default()).await.unwrap();
                repo.close().await.unwrap();
                rounds += 1;
                prunes.store(rounds, Ordering::SeqCst);
            }
            rounds
        })
    };
    for c in committers {
        c.await.unwrap();
    }
    done.store(true, Ordering::SeqCst);
    let rounds = pruner.await.unwrap();
    assert!(
        rounds >= MIN_PRUNES,
        "the pruner ran while commits ran ({rounds} rounds)"
    );

    // One last prune and fast deletion with nothing running, then the exact pass.
    let repo = open(&store, SessionKind::Edit).await;
    let policy = KeepPolicy {
        last: 2,
        ..Default::default()
    };
    for image in repo.images().await.unwrap() {
        prune(&repo, &image, &policy, false).await.unwrap();
    }
    gc(&repo, &GcOptions::default()).await.unwrap();
    repo.close().await.unwrap();
    let repo = open(&store, SessionKind::Gc).await;
    let exact = gc(
        &repo,
        &GcOptions {
            mode: GcMode::Repair,
            ..Default::default()
        },
    )
    .await
    .unwrap();
    repo.close().await.unwrap();
    let left = exact.reclaimed() as f64 / exact.before_bytes as f64;
    println!(
        "after {rounds} prune rounds: repair reclaimed {} of {} bytes ({:.3}%)",
        exact.reclaimed(),
        exact.before_bytes,
        left * 100.0
    );
    assert!(
        left <= 0.01,
        "fast deletion left {:.2}% for gc --repair: {exact:?}",
        left * 100.0
    );
    let repo = open(&store, SessionKind::Verify).await;
    assert!(verify(repo.clone()).await.unwrap().is_clean());
    for w in 0..3 {
        assert_eq!(
            cairn_engine::resolve::history(&repo, &format!("vm{w}"))
                .await
                .unwrap()
                .len(),
            2
        );
    }
}

//! Garbage collection: space comes back, live data never goes, concurrent commits are safe,
//! and a GC that dies at any point leaves a consistent repository.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use cairn_engine::gc::{gc, GcMode, GcOptions};
use cairn_engine::progress::WorkProgress;
use cairn_engine::resolve::{history, resolve, VersionSpec};
use cairn_engine::verify::verify;
use cairn_format::config::RepoConfig;
use cairn_format::version::VersionRecord;
use cairn_repo::Repo;
use cairn_store::{MemoryStore, ObjectStore};

fn opts(mode: GcMode) -> GcOptions {
    GcOptions {
        mode,
        poll: Duration::from_millis(10),
        ..Default::default()
    }
}

/// The repositories these tests collect: 4 KiB chunks in groups, 1 MiB leaves and packs.
fn gc_config() -> RepoConfig {
    config(4096, 1 << 20)
}

/// Runs a scenario with fast deletion and with the exact pass.
macro_rules! both_modes {
    ($name:ident) => {
        mod $name {
            use super::*;
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn fast() {
                super::$name(GcMode::Fast).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn repair() {
                super::$name(GcMode::Repair).await
            }
        }
    };
}

async fn stored_bytes(store: &dyn ObjectStore) -> u64 {
    store
        .list("")
        .await
        .unwrap()
        .iter()
        .filter(|m| {
            ["packs/", "index/", "index-runs/"]
                .iter()
                .any(|p| m.key.starts_with(p))
        })
        .map(|m| m.size)
        .sum()
}

async fn expire_sessions(store: &dyn ObjectStore) {
    for key in store.list_refs("sessions/").await.unwrap() {
        if let Some(state) = store.read_ref(&key).await.unwrap() {
            let _ = store.cas_ref(&key, Some(&state.version), None).await;
        }
    }
}

async fn version(repo: &Repo, spec: &str) -> VersionRecord {
    resolve(repo, &VersionSpec::parse(spec).unwrap())
        .await
        .unwrap()
        .1
}

/// Five versions of one image, each rewriting a different quarter with fresh noise.
async fn series(store: Arc<MemoryStore>) -> (Arc<Repo>, Vec<Vec<u8>>) {
    let repo = Arc::new(Repo::init(store, gc_config()).await.unwrap());
    let mut data = noise(8 << 20, 1);
    let mut contents = Vec::new();
    for i in 0..5u64 {
        let q = (i as usize % 4) * (2 << 20);
        data[q..q + (2 << 20)].copy_from_slice(&noise(2 << 20, 10 + i));
        commit_bytes(&repo, "vm", data.clone()).await;
        contents.push(data.clone());
    }
    (repo, contents)
}

both_modes!(gc_after_deleting_all_but_the_newest_matches_a_fresh_repository);
async fn gc_after_deleting_all_but_the_newest_matches_a_fresh_repository(mode: GcMode) {
    let store = Arc::new(MemoryStore::new());
    let (repo, contents) = series(store.clone()).await;
    for seq in 1..=4 {
        let (id, _) = resolve(&repo, &VersionSpec::parse(&format!("vm@{seq}")).unwrap())
            .await
            .unwrap();
        repo.mark_deleted(&id).await.unwrap();
    }
    let before = stored_bytes(store.as_ref()).await;
    let progress = Arc::new(WorkProgress::default());
    let options = GcOptions {
        progress: Some(progress.clone()),
        ..opts(mode)
    };
    let report = gc(&repo, &options).await.unwrap();
    let after = stored_bytes(store.as_ref()).await;
    assert_eq!(report.before_bytes, before);
    // Progress went through the steps of this mode, each counted to its total; the bytes
    // repacked are the report's.
    let steps: Vec<(&str, u64, u64)> = progress
        .steps()
        .iter()
        .map(|r| (r.step.name, r.done, r.total))
        .collect();
    // Fast deletion reads the live version's summary and no tree; the exact pass walks the
    // live tree.
    let mut want = match mode {
        GcMode::Fast => vec![("loading live summaries", 1, 1)],
        GcMode::Repair => vec![("marking live versions", 1, 1)],
    };
    if mode == GcMode::Fast {
        assert_eq!(report.metadata_read_bytes, 0, "{report:?}");
        assert!(report.summary_bytes > 0, "{report:?}");
    }
    let repacked = report.repacked_bytes;
    want.extend([
        ("repacking", repacked, repacked),
        ("waiting for older sessions", 0, 0),
        ("deleting", 0, 0),
    ]);
    assert_eq!(steps, want, "{report:?}");
    assert_eq!(report.after_bytes, after);
    assert!(
        report.dead_blobs > 0 && report.packs_deleted + report.packs_repacked > 0,
        "{report:?}"
    );

    // A fresh repository holding only the newest version.
    let fresh_store = Arc::new(MemoryStore::new());
    let fresh = Arc::new(Repo::init(fresh_store.clone(), gc_config()).await.unwrap());
    commit_bytes(&fresh, "vm", contents[4].clone()).await;
    let fresh_bytes = stored_bytes(fresh_store.as_ref()).await;
    let ratio = after as f64 / fresh_bytes as f64;
    assert!(
        (0.98..=1.02).contains(&ratio),
        "after gc {after} vs fresh {fresh_bytes} ({ratio:.3})"
    );

    let repo = Arc::new(Repo::open(store.clone()).await.unwrap());
    assert!(verify(repo.clone()).await.unwrap().is_clean());
    let newest = version(&repo, "vm").await;
    assert_eq!(restore_bytes(&repo, &newest).await.unwrap(), contents[4]);
    // A second GC finds nothing more to do.
    let again = gc(&repo, &opts(mode)).await.unwrap();
    assert_eq!(again.dead_blobs, 0);
    assert_eq!(again.reclaimed(), 0, "{again:?}");
}

both_modes!(gc_keeps_everything_live_versions_use);
async fn gc_keeps_everything_live_versions_use(mode: GcMode) {
    let store = Arc::new(MemoryStore::new());
    let (repo, contents) = series(store.clone()).await;
    // Delete the middle versions only.
    for seq in [2, 3] {
        let (id, _) = resolve(&repo, &VersionSpec::parse(&format!("vm@{seq}")).unwrap())
            .await
            .unwrap();
        repo.mark_deleted(&id).await.unwrap();
    }
    gc(&repo, &opts(mode)).await.unwrap();
    let repo = Arc::new(Repo::open(store.clone()).await.unwrap());
    assert!(verify(repo.clone()).await.unwrap().is_clean());
    let log = history(&repo, "vm").await.unwrap();
    let seqs: Vec<u64> = log.iter().map(|(_, r)| r.seq).collect();
    assert_eq!(seqs, vec![5, 4, 1]);
    for (_, r) in &log {
        assert_eq!(
            restore_bytes(&repo, r).await.unwrap(),
            contents[r.seq as usize - 1]
        );
    }
}

both_modes!(a_commit_running_during_gc_that_reuses_dead_data_is_rescued);
async fn a_commit_running_during_gc_that_reuses_dead_data_is_rescued(mode: GcMode) {
    let store = Arc::new(MemoryStore::new());
    let repo = Arc::new(Repo::init(store.clone(), gc_config()).await.unwrap());
    let old = noise(4 << 20, 77);
    let first = commit_bytes(&repo, "vm", old.clone()).await;
    commit_bytes(&repo, "vm", noise(4 << 20, 78)).await;
    repo.mark_deleted(&first.id).await.unwrap();
    repo.close().await.unwrap();

    // A committer opens the repository (its session predates the GC's plan) ...
    let committer = Arc::new(Repo::open(store.clone()).await.unwrap());
    // ... the GC marks (the old data is dead), publishes its plan and waits for that session.
    let gc_repo = Arc::new(Repo::open(store.clone()).await.unwrap());
    let gc_task = tokio::spawn(async move { gc(&gc_repo, &opts(mode)).await });
    while store.list("gc/plans/").await.unwrap().is_empty() {
        assert!(!gc_task.is_finished(), "gc finished without waiting");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // The committer commits the old content again: it deduplicates against the dead blobs.
    let again = commit_bytes(&committer, "vm", old.clone()).await;
    assert_eq!(again.record.stats.new_chunks, 0, "reused the dead blobs");
    committer.close().await.unwrap();
    let report = gc_task.await.unwrap().unwrap();
    assert!(report.rescued_blobs > 0, "{report:?}");

    let repo = Arc::new(Repo::open(store.clone()).await.unwrap());
    let v = verify(repo.clone()).await.unwrap();
    assert!(v.is_clean(), "{:?} {:?}", v.problems, v.damaged_versions);
    assert_eq!(restore_bytes(&repo, &again.record).await.unwrap(), old);
}

both_modes!(a_session_that_starts_after_the_plan_does_not_reuse_doomed_blobs);
async fn a_session_that_starts_after_the_plan_does_not_reuse_doomed_blobs(mode: GcMode) {
    let store = Arc::new(MemoryStore::new());
    let repo = Arc::new(Repo::init(store.clone(), gc_config()).await.unwrap());
    let old = noise(2 << 20, 5);
    let first = commit_bytes(&repo, "vm", old.clone()).await;
    commit_bytes(&repo, "vm", noise(2 << 20, 6)).await;
    repo.mark_deleted(&first.id).await.unwrap();
    repo.close().await.unwrap();
    // Keep an old session alive so the GC stays parked after publishing its plan.
    let blocker = Arc::new(Repo::open(store.clone()).await.unwrap());
    let gc_repo = Arc::new(Repo::open(store.clone()).await.unwrap());
    let gc_task = tokio::spawn(async move { gc(&gc_repo, &opts(mode)).await });
    while store.list("gc/plans/").await.unwrap().is_empty() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let late = Arc::new(Repo::open(store.clone()).await.unwrap());
    let c = commit_bytes(&late, "vm", old.clone()).await;
    assert!(
        c.record.stats.new_chunks > 0,
        "a late session stores its own copies"
    );
    late.close().await.unwrap();
    blocker.close().await.unwrap();
    gc_task.await.unwrap().unwrap();
    let repo = Arc::new(Repo::open(store.clone()).await.unwrap());
    let v = verify(repo.clone()).await.unwrap();
    assert!(v.is_clean(), "{:?} {:?}", v.problems, v.damaged_versions);
    assert_eq!(restore_bytes(&repo, &c.record).await.unwrap(), old);
}

/// After a GC that stopped after `allowed` store operations, once its session went stale (the
/// "killed" GC's would after a while; fast-forwarded here): a new process finds the repository
/// verified clean and each of `versions` (seq, bytes) restores bit-exact.
async fn reopened_intact<'a>(
    store: &Arc<MemoryStore>,
    allowed: impl std::fmt::Display,
    versions: impl IntoIterator<Item = (u64, &'a Vec<u8>)>,
) {
    expire_sessions(store.as_ref()).await;
    let check = Arc::new(Repo::open(store.clone()).await.unwrap());
    let report = verify(check.clone()).await.unwrap();
    assert!(
        report.is_clean(),
        "gc stopped after {allowed} writes: {:?} {:?}",
        report.problems,
        report.damaged_versions
    );
    for (seq, want) in versions {
        let v = version(&check, &format!("vm@{seq}")).await;
        assert!(
            restore_bytes(&check, &v).await.unwrap() == *want,
            "vm@{seq} after {allowed}"
        );
    }
    check.close().await.unwrap();
}

both_modes!(gc_dying_after_any_number_of_store_operations_loses_nothing);
async fn gc_dying_after_any_number_of_store_operations_loses_nothing(mode: GcMode) {
    let store = Arc::new(MemoryStore::new());
    let (repo, contents) = series(store.clone()).await;
    repo.close().await.unwrap();
    let mut trials = 0;
    let mut alive: Vec<u64> = vec![1, 2, 3, 4, 5];
    // Two rounds of deletions, each followed by GCs that die after 0, 1, 2, ... store
    // operations until one completes.
    for round in [vec![1u64, 3], vec![2, 4]] {
        let r = Arc::new(Repo::open(store.clone()).await.unwrap());
        for seq in &round {
            let (id, _) = resolve(&r, &VersionSpec::parse(&format!("vm@{seq}")).unwrap())
                .await
                .unwrap();
            r.mark_deleted(&id).await.unwrap();
        }
        r.close().await.unwrap();
        alive.retain(|s| !round.contains(s));
        for allowed in 0.. {
            let failing: Arc<dyn ObjectStore> = Arc::new(FailingStore::new(store.clone(), allowed));
            let Ok(r) = Repo::open(failing).await else {
                continue; // could not even register a session
            };
            let r = Arc::new(r);
            let outcome = gc(&r, &opts(mode)).await;
            drop(r);
            trials += 1;
            let kept = alive.iter().map(|&seq| (seq, &contents[seq as usize - 1]));
            reopened_intact(&store, allowed, kept).await;
            if outcome.is_ok() {
                break;
            }
            assert!(allowed < 500, "gc never completed");
        }
    }
    assert!(trials >= 20, "only {trials} crash points exercised");
    // A final, undisturbed GC completes the work of the interrupted ones.
    let r = Arc::new(Repo::open(store.clone()).await.unwrap());
    gc(&r, &opts(mode)).await.unwrap();
    assert!(verify(r.clone()).await.unwrap().is_clean());
    let v = version(&r, "vm@5").await;
    assert_eq!(restore_bytes(&r, &v).await.unwrap(), contents[4]);
}

/// A clone shares its source's tree and summary; deleting the source frees nothing it uses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_cloned_image_keeps_what_the_clone_uses() {
    let store = Arc::new(MemoryStore::new());
    let (repo, contents) = series(store.clone()).await;
    cairn_engine::clone::clone_version(&repo, &VersionSpec::parse("vm@3").unwrap(), "copy", None)
        .await
        .unwrap();
    cairn_engine::remove::remove_image(&repo, "vm")
        .await
        .unwrap();
    let report = gc(&repo, &opts(GcMode::Fast)).await.unwrap();
    assert_eq!(report.freed_versions, 5);
    assert!(report.dead_blobs > 0, "{report:?}");
    let repo = Arc::new(Repo::open(store.clone()).await.unwrap());
    assert!(verify(repo.clone()).await.unwrap().is_clean());
    let copy = version(&repo, "copy").await;
    assert_eq!(restore_bytes(&repo, &copy).await.unwrap(), contents[2]);
}

/// With near-perfect summaries, fast deletion of a rolling window leaves nothing for the exact
/// pass: every blob it keeps is live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_deletion_with_precise_summaries_leaves_nothing_for_repair() {
    let store = Arc::new(MemoryStore::new());
    let mut cfg = gc_config();
    cfg.summary_bits = 64;
    let repo = Arc::new(Repo::init(store.clone(), cfg).await.unwrap());
    let chunks = 1024usize;
    let mut data = noise(chunks * 16384, 3);
    let mut seed = 100;
    let mut fast_opts = opts(GcMode::Fast);
    fast_opts.repack_threshold = 1.0;
    let mut exact = opts(GcMode::Repair);
    exact.dry_run = true;
    for step in 0..8 {
        commit_bytes(&repo, "vm", data.clone()).await;
        for k in 0..50 {
            let c = (k * 37 + step * 11) % chunks;
            seed += 1;
            data[c * 16384..(c + 1) * 16384].copy_from_slice(&noise(16384, seed));
        }
        if step >= 3 {
            let h = history(&repo, "vm").await.unwrap();
            let (oldest, _) = h.last().unwrap();
            repo.mark_deleted(oldest).await.unwrap();
            let fast = gc(&repo, &fast_opts).await.unwrap();
            let leak = gc(&repo, &exact).await.unwrap();
            assert_eq!(
                leak.dead_blobs, 0,
                "step {step}: fast {fast:?}\nexact {leak:?}"
            );
        }
    }
}

/// `gc --repack-small` killed after any number of store operations loses nothing: every
/// version restores bit-exact and the repository verifies after each death; once one
/// completes (and the exact pass has removed what the killed ones wrote), the small packs of
/// six small commits are merged and another run finds nothing to merge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merging_small_packs_dying_after_any_number_of_store_operations_loses_nothing() {
    let store = Arc::new(MemoryStore::new());
    let repo = Arc::new(Repo::init(store.clone(), gc_config()).await.unwrap());
    let mut data = noise(1 << 20, 70);
    let mut contents = vec![data.clone()];
    commit_bytes(&repo, "vm", data.clone()).await;
    // Each commit: 32 new blocks (128 KiB), a data pack and a node pack below 256 KiB.
    for i in 0..6u64 {
        for j in 0..32u64 {
            let at = ((i * 29 + j * 7) % 256) as usize * 4096;
            data[at..at + 4096].copy_from_slice(&noise(4096, 7000 + i * 32 + j));
        }
        commit_bytes(&repo, "vm", data.clone()).await;
        contents.push(data.clone());
    }
    repo.close().await.unwrap();
    let packs = || async {
        let listed = store.list("packs/").await.unwrap();
        listed.iter().filter(|m| m.size < 256 << 10).count()
    };
    let small_before = packs().await;
    assert!(small_before >= 12, "{small_before}");
    let merge = GcOptions {
        repack_small: true,
        ..opts(GcMode::Fast)
    };
    for allowed in 0.. {
        let failing: Arc<dyn ObjectStore> = Arc::new(FailingStore::new(store.clone(), allowed));
        let Ok(r) = Repo::open(failing).await else {
            continue;
        };
        let r = Arc::new(r);
        let outcome = gc(&r, &merge).await;
        drop(r);
        let all = contents.iter().enumerate().map(|(i, c)| (i as u64 + 1, c));
        reopened_intact(&store, allowed, all).await;
        if outcome.is_ok() {
            break;
        }
        assert!(allowed < 500, "gc never completed");
    }
    // The exact pass removes what the killed GCs left (packs they wrote and never named,
    // copies both a killed GC and the one after it made); then little that is small is left.
    let r = Arc::new(Repo::open(store.clone()).await.unwrap());
    gc(&r, &opts(GcMode::Repair)).await.unwrap();
    r.close().await.unwrap();
    let r = Arc::new(Repo::open(store.clone()).await.unwrap());
    let again = gc(&r, &merge).await.unwrap();
    assert_eq!(again.small_packs, 0, "{again:?}");
    assert!(verify(r.clone()).await.unwrap().is_clean());
    let small_after = packs().await;
    assert!(
        small_after * 2 < small_before,
        "{small_before} small packs before, {small_after} after"
    );
}

/// Two commits that ran at once each stored the data neither had published yet (here: two
/// processes' sessions, each opened before the other committed, commit images sharing 6 MiB).
/// The everyday GC — nothing was deleted — finds the groups stored twice and keeps one copy,
/// so the repository ends within 5% of the same two commits run one after the other. Both
/// versions restore bit-exact, the exact pass finds nothing more to free, and a second GC
/// finds nothing to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_gc_drops_the_copies_commits_running_at_once_stored_twice() {
    let shared = noise(6 << 20, 40);
    let image = |seed| {
        let mut data = shared.clone();
        data.extend(noise(1 << 20, seed));
        data
    };
    let (a, b) = (image(41), image(42));

    let one_by_one = Arc::new(MemoryStore::new());
    let repo = Arc::new(Repo::init(one_by_one.clone(), gc_config()).await.unwrap());
    commit_bytes(&repo, "a", a.clone()).await;
    commit_bytes(&repo, "b", b.clone()).await;
    repo.close().await.unwrap();
    let sequential = stored_bytes(one_by_one.as_ref()).await;

    let store = Arc::new(MemoryStore::new());
    Repo::init(store.clone(), gc_config())
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    // Both sessions load the index before either publishes: neither sees the other's groups.
    let first = Arc::new(Repo::open(store.clone()).await.unwrap());
    let second = Arc::new(Repo::open(store.clone()).await.unwrap());
    let ca = commit_bytes(&first, "a", a.clone()).await;
    let cb = commit_bytes(&second, "b", b.clone()).await;
    assert_eq!(
        cb.record.stats.new_chunks, ca.record.stats.new_chunks,
        "the second commit stored the shared data again"
    );
    first.close().await.unwrap();
    second.close().await.unwrap();
    let at_once = stored_bytes(store.as_ref()).await;
    assert!(
        at_once as f64 > 1.5 * sequential as f64,
        "{at_once} against {sequential}"
    );

    let repo = Arc::new(Repo::open(store.clone()).await.unwrap());
    let report = gc(&repo, &opts(GcMode::Fast)).await.unwrap();
    assert_eq!(report.freed_versions, 0, "{report:?}");
    // 6 MiB shared in groups of 64 KiB: 96 groups stored twice, and the 6 leaves naming them.
    assert_eq!(report.duplicate_blobs, 96 + 6, "{report:?}");
    let after = stored_bytes(store.as_ref()).await;
    assert!(
        after as f64 <= 1.05 * sequential as f64,
        "after gc {after}, one by one {sequential}: {report:?}"
    );
    repo.close().await.unwrap();
    let repo = Arc::new(Repo::open(store.clone()).await.unwrap());
    let v = verify(repo.clone()).await.unwrap();
    assert!(v.is_clean(), "{:?} {:?}", v.problems, v.damaged_versions);
    assert_eq!(
        restore_bytes(&repo, &version(&repo, "a@1").await)
            .await
            .unwrap(),
        a
    );
    assert_eq!(
        restore_bytes(&repo, &version(&repo, "b@1").await)
            .await
            .unwrap(),
        b
    );

    let again = gc(&repo, &opts(GcMode::Fast)).await.unwrap();
    assert_eq!(again.reclaimed(), 0, "{again:?}");
    let mut exact = opts(GcMode::Repair);
    exact.dry_run = true;
    let leak = gc(&repo, &exact).await.unwrap();
    assert_eq!(leak.dead_blobs, 0, "{leak:?}");
    assert_eq!(leak.after_bytes, leak.before_bytes, "{leak:?}");
}

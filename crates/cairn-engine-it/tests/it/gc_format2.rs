//! GC on format 2, where the unit of storage is a group of 4 KiB chunks: a group some of
//! whose slots no live version uses is rewritten without them (same id, the slots still
//! listed), reads stay bit-exact, later commits never dedup against a dropped slot, and a
//! commit that reused such a slot while the GC ran gets the whole group rescued. Plain and
//! encrypted repositories alike (`gc.rs` runs the general GC scenarios on format 2 too).

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use crate::common::{commit_bytes, noise, restore_bytes, PASSPHRASE};
use cairn_engine::gc::{gc, GcMode, GcOptions, GcReport};
use cairn_engine::verify::verify;
use cairn_format::config::RepoConfig;
use cairn_format::version::VersionRecord;
use cairn_repo::{GivenPassphrase, Repo, SessionKind};
use cairn_store::{MemoryStore, ObjectStore};
use zeroize::Zeroizing;

fn config() -> RepoConfig {
    RepoConfig {
        repo_id: [7; 16],
        segment_size: 256 << 10,
        pack_target: 1 << 20,
        ..RepoConfig::default_v2()
    }
}

pub(crate) fn opts() -> GcOptions {
    GcOptions {
        mode: GcMode::Fast,
        poll: Duration::from_millis(10),
        ..Default::default()
    }
}

pub(crate) async fn init(store: Arc<MemoryStore>, encrypted: bool) -> Arc<Repo> {
    common::init_format2(store, config(), encrypted).await
}

pub(crate) async fn open(store: &Arc<MemoryStore>) -> Arc<Repo> {
    let pass = GivenPassphrase(Zeroizing::new(PASSPHRASE.to_vec()));
    let repo = Repo::open_cached(store.clone(), SessionKind::Commit, None, Some(&pass))
        .await
        .unwrap();
    Arc::new(repo)
}

/// Slots whose bytes some group no longer stores, over every pack the index names.
async fn dropped_slots(repo: &Repo) -> usize {
    let (view, _) = repo.v2_view().await.unwrap();
    let mut dropped = 0;
    for pack in view.packs().await.unwrap() {
        let trailer = view.trailer(&pack).await.unwrap();
        for g in &trailer.groups {
            dropped += g.desc.chunks.iter().filter(|c| !c.stored).count();
        }
    }
    dropped
}

async fn stored_bytes(store: &dyn ObjectStore) -> u64 {
    let listed = store.list("").await.unwrap();
    let data = listed
        .iter()
        .filter(|m| m.key.starts_with("packs/") || m.key.starts_with("index-runs/"));
    data.map(|m| m.size).sum()
}

/// `a` is 2 MiB of noise (32 groups of 16 chunks); `b` is `a` with every other 4 KiB block
/// of its first MiB new, so `b` uses half the slots of `a`'s first 16 groups.
fn pair() -> (Vec<u8>, Vec<u8>) {
    let a = noise(2 << 20, 1);
    let mut b = a.clone();
    for block in (0..256).step_by(2) {
        let at = block * 4096;
        b[at..at + 4096].copy_from_slice(&noise(4096, 1000 + block as u64));
    }
    (a, b)
}

/// Runs the exact pass (`gc --repair`).
pub(crate) async fn repair(repo: &Arc<Repo>) -> GcReport {
    let options = GcOptions {
        mode: GcMode::Repair,
        ..opts()
    };
    gc(repo, &options).await.unwrap()
}

pub(crate) async fn check(repo: &Arc<Repo>, record: &VersionRecord, want: &[u8]) {
    assert!(restore_bytes(repo, record).await.unwrap() == want);
}

pub(crate) async fn assert_clean(repo: &Arc<Repo>) {
    let v = verify(repo.clone()).await.unwrap();
    assert!(v.is_clean(), "{:?} {:?}", v.problems, v.damaged_versions);
}

async fn groups_with_dead_slots_are_rewritten_without_them(encrypted: bool) {
    let store = Arc::new(MemoryStore::new());
    let repo = init(store.clone(), encrypted).await;
    let (a, b) = pair();
    let first = commit_bytes(&repo, "vm", a.clone()).await;
    let second = commit_bytes(&repo, "vm", b.clone()).await;
    assert_eq!(second.record.stats.new_chunks, 128);
    repo.mark_deleted(&first.id).await.unwrap();
    let before = stored_bytes(store.as_ref()).await;
    let report: GcReport = gc(&repo, &opts()).await.unwrap();
    assert_eq!(report.before_bytes, before);
    assert_eq!(report.after_bytes, stored_bytes(store.as_ref()).await);
    assert_eq!(report.freed_versions, 1);
    // Each step's time is reported once, in the order the steps ran; they add up to no
    // more than the whole GC.
    let steps: Vec<&str> = report.phases.iter().map(|(name, _)| *name).collect();
    let at = |step: &str| steps.iter().position(|s| *s == step);
    assert_eq!(steps.first(), Some(&"lock"), "{steps:?}");
    assert_eq!(steps.last(), Some(&"unlock"), "{steps:?}");
    let order = [
        "live summaries",
        "trailers",
        "repack",
        "index run",
        "plan and wait",
        "sweep",
    ];
    let found: Vec<Option<usize>> = order.iter().map(|s| at(s)).collect();
    assert!(
        found.iter().all(Option::is_some) && found.windows(2).all(|w| w[0] < w[1]),
        "{steps:?}"
    );
    let mut unique = steps.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), steps.len(), "{steps:?}");
    let total: f64 = report.phases.iter().map(|(_, s)| s).sum();
    assert!(
        total <= report.duration_s,
        "{total} > {}",
        report.duration_s
    );

    let repo = open(&store).await;
    // The 16 half-dead groups were rewritten with their 8 live slots each; the 16 groups
    // `b` uses whole were copied or kept as they are.
    assert_eq!(dropped_slots(&repo).await, 16 * 8, "{report:?}");
    assert_clean(&repo).await;
    check(&repo, &second.record, &b).await;

    // What is left is what a repository holding only `b` stores (the dropped slots' ids
    // and lengths stay listed: 37 bytes each).
    let fresh_store = Arc::new(MemoryStore::new());
    let fresh = init(fresh_store.clone(), encrypted).await;
    commit_bytes(&fresh, "vm", b.clone()).await;
    let (after, fresh) = (
        report.after_bytes as f64,
        stored_bytes(fresh_store.as_ref()).await as f64,
    );
    assert!(
        (0.98..=1.02).contains(&(after / fresh)),
        "after gc {after} vs fresh {fresh}: {report:?}"
    );

    // A second GC has nothing to do; `a` committed again stores exactly the dropped chunks
    // (never deduplicated against a slot that is gone) and restores bit-exact.
    let again = gc(&repo, &opts()).await.unwrap();
    assert_eq!(again.reclaimed(), 0, "{again:?}");
    let third = commit_bytes(&repo, "vm", a.clone()).await;
    assert_eq!(third.record.stats.new_chunks, 128);
    check(&repo, &third.record, &a).await;
    check(&repo, &second.record, &b).await;
    assert_clean(&repo).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_with_dead_slots_are_rewritten_without_them_plain() {
    groups_with_dead_slots_are_rewritten_without_them(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn groups_with_dead_slots_are_rewritten_without_them_encrypted() {
    groups_with_dead_slots_are_rewritten_without_them(true).await
}

/// `a` then `b` committed and `a` deleted; a GC that has published its plan and waits for
/// `committer`, a session opened before it.
struct DuringGc {
    store: Arc<MemoryStore>,
    committer: Arc<Repo>,
    gc_task: tokio::task::JoinHandle<Result<GcReport, cairn_engine::EngineError>>,
    a: Vec<u8>,
    b: Vec<u8>,
    second: cairn_engine::commit::CommitResult,
}

/// `a` then `b` committed as `vm`, `a` deleted (not collected), the repository closed.
struct ADeleted {
    store: Arc<MemoryStore>,
    a: Vec<u8>,
    b: Vec<u8>,
    first: cairn_engine::commit::CommitResult,
    second: cairn_engine::commit::CommitResult,
}

async fn a_deleted(encrypted: bool) -> ADeleted {
    let store = Arc::new(MemoryStore::new());
    let repo = init(store.clone(), encrypted).await;
    let (a, b) = pair();
    let first = commit_bytes(&repo, "vm", a.clone()).await;
    let second = commit_bytes(&repo, "vm", b.clone()).await;
    repo.mark_deleted(&first.id).await.unwrap();
    repo.close().await.unwrap();
    ADeleted {
        store,
        a,
        b,
        first,
        second,
    }
}

async fn gc_waiting_for_a_commit(encrypted: bool) -> DuringGc {
    let ADeleted {
        store,
        a,
        b,
        second,
        ..
    } = a_deleted(encrypted).await;

    let committer = open(&store).await;
    let gc_repo = open(&store).await;
    let gc_task = tokio::spawn(async move { gc(&gc_repo, &opts()).await });
    while store.list("gc/plans/").await.unwrap().is_empty() {
        assert!(!gc_task.is_finished(), "gc finished without waiting");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    DuringGc {
        store,
        committer,
        gc_task,
        a,
        b,
        second,
    }
}

/// A commit whose session predates the plan reuses slots the GC drops: after the wait the
/// GC finds them and copies the groups into rescue packs (whole here: the commit uses every
/// slot); readers take the copy that stores the slots they want.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_reusing_slots_a_gc_drops_gets_the_whole_group_rescued() {
    let DuringGc {
        store,
        committer,
        gc_task,
        a,
        b,
        second,
    } = gc_waiting_for_a_commit(true).await;
    // `a` again, deduplicated against every slot of `a`'s groups — half of which the GC
    // has already rewritten away in its new packs.
    let again = commit_bytes(&committer, "other", a.clone()).await;
    assert_eq!(again.record.stats.new_chunks, 0);
    committer.close().await.unwrap();
    let report = gc_task.await.unwrap().unwrap();
    // The 16 half-dead groups, and `a`'s own manifest nodes, which the new version reuses
    // whole: the 4 leaves of the first MiB and the root (its other leaves are `b`'s too).
    assert_eq!(report.rescued_blobs, 16 + 5, "{report:?}");

    let repo = open(&store).await;
    assert_clean(&repo).await;
    check(&repo, &again.record, &a).await;
    check(&repo, &second.record, &b).await;
    // Fast deletion has nothing more to do (nothing was deleted since); the exact pass
    // keeps one copy of each group: the rescued whole ones (both versions use them), and
    // drops the trimmed copies.
    let fast = gc(&repo, &opts()).await.unwrap();
    assert_eq!((fast.reclaimed(), fast.freed_versions), (0, 0), "{fast:?}");
    assert_eq!(dropped_slots(&repo).await, 16 * 8);
    repair(&repo).await;
    let repo = open(&store).await;
    assert_eq!(dropped_slots(&repo).await, 0);
    assert_clean(&repo).await;
    check(&repo, &again.record, &a).await;
    check(&repo, &second.record, &b).await;
}

/// A commit whose session a GC judged dead (no heartbeat within `stale_after`) and so did not
/// wait for: the GC rewrote `a`'s first 16 groups without the slots only `a` used, which the
/// commit — its trailers read before the GC — dedups against. The stale-GC guard finds the
/// 16 groups (by the keys of the new version's reference summary) no longer storing them and
/// the 5 manifest nodes only `a` had (4 leaves and the root) gone, and nothing is published.
async fn a_commit_a_gc_did_not_wait_for_publishes_nothing(encrypted: bool) {
    let ADeleted {
        store,
        a,
        b,
        first,
        second,
    } = a_deleted(encrypted).await;

    let committer = open(&store).await;
    check(&committer, &first.record, &a).await; // its trailers are in the committer's cache
    let gc_repo = open(&store).await;
    let hasty = GcOptions {
        stale_after: Duration::ZERO,
        ..opts()
    };
    let report = gc(&gc_repo, &hasty).await.unwrap();
    assert_eq!(report.freed_versions, 1, "{report:?}");
    gc_repo.close().await.unwrap();

    let src = cairn_engine::source::StreamSource::new("test", std::io::Cursor::new(a.clone()));
    let options = cairn_engine::commit::CommitOptions::default();
    let err = cairn_engine::commit::commit(committer.clone(), "other", Box::new(src), options)
        .await
        .unwrap_err();
    assert!(
        matches!(err, cairn_engine::EngineError::RacedGc { missing: 21 }),
        "{err}"
    );
    assert!(committer.head("other").await.unwrap().is_none());
    committer.close().await.unwrap();

    let repo = open(&store).await;
    assert_clean(&repo).await;
    check(&repo, &second.record, &b).await;
    // Run again, the commit stores what the GC dropped and reuses the rest.
    let again = commit_bytes(&repo, "other", a.clone()).await;
    check(&repo, &again.record, &a).await;
    assert_clean(&repo).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_a_gc_did_not_wait_for_publishes_nothing_plain() {
    a_commit_a_gc_did_not_wait_for_publishes_nothing(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_a_gc_did_not_wait_for_publishes_nothing_encrypted() {
    a_commit_a_gc_did_not_wait_for_publishes_nothing(true).await;
}

/// A rescue copies a group with the slots the live versions or the newcomers use, not whole:
/// here the commit during the wait reuses one dropped slot of one of `a`'s groups, and the
/// rescued copy stores that slot and the 8 `b` uses, the other 7 dropped (before 2026-11-27
/// they stayed until `gc --repair`, which fast deletion no longer finds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescued_group_keeps_only_the_slots_in_use() {
    let DuringGc {
        store,
        committer,
        gc_task,
        a,
        b,
        second,
    } = gc_waiting_for_a_commit(false).await;
    // `b` with its first block as in `a`: slot 0 of `a`'s first group, which the GC drops.
    let mut c = b.clone();
    c[..4096].copy_from_slice(&a[..4096]);
    let again = commit_bytes(&committer, "other", c.clone()).await;
    assert_eq!(again.record.stats.new_chunks, 0);
    committer.close().await.unwrap();
    let report = gc_task.await.unwrap().unwrap();
    assert_eq!(report.rescued_blobs, 1, "{report:?}");

    let repo = open(&store).await;
    // 16 trimmed groups drop 8 slots each; the rescued copy of the first drops 7.
    assert_eq!(dropped_slots(&repo).await, 16 * 8 + 7);
    assert_clean(&repo).await;
    check(&repo, &again.record, &c).await;
    check(&repo, &second.record, &b).await;
}

/// Fast deletion trusts the live versions' reference summaries; one that is damaged (or
/// missing) is rebuilt from its tree, and the GC then frees exactly what it frees with the
/// summary intact. An encrypted repository's summaries are sealed.
async fn a_damaged_summary_is_rebuilt_from_the_tree(encrypted: bool) {
    let store = Arc::new(MemoryStore::new());
    let repo = init(store.clone(), encrypted).await;
    let (a, b) = pair();
    let first = commit_bytes(&repo, "vm", a.clone()).await;
    let second = commit_bytes(&repo, "vm", b.clone()).await;
    repo.mark_deleted(&first.id).await.unwrap();
    let key = cairn_format::keys::summary(&second.record.root.unwrap());
    let stored = store.get(&key).await.unwrap();
    let magic_visible = stored.windows(8).any(|w| w == b"CRNSUM2\0");
    assert_eq!(magic_visible, !encrypted, "sealed only when encrypted");
    let mut bad = stored.to_vec();
    let at = bad.len() / 2;
    bad[at] ^= 0x40;
    store.delete(&key).await.unwrap();
    store.put_if_absent(&key, bad.into()).await.unwrap();
    repo.close().await.unwrap();

    let repo = open(&store).await;
    let report = gc(&repo, &opts()).await.unwrap();
    assert!(
        report.metadata_read_bytes > 0,
        "the tree was walked: {report:?}"
    );
    assert_eq!(dropped_slots(&repo).await, 16 * 8, "{report:?}");
    let rebuilt = repo.load_group_summary(&second.record.root.unwrap()).await;
    assert!(matches!(rebuilt, Ok(Some(_))), "{rebuilt:?}");
    // The summary of the deleted version's tree went with it.
    let first_key = cairn_format::keys::summary(&first.record.root.unwrap());
    assert!(store.head(&first_key).await.unwrap().is_none());
    let repo = open(&store).await;
    assert_clean(&repo).await;
    check(&repo, &second.record, &b).await;
}

/// A summary GC rebuilds is the one the commit wrote: counted, with each leaf occurrence's
/// references — here a tree whose segments 0, 3 and 6 share a leaf — so the next commit
/// derives its own from it without reading the leaves it reuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuilt_summary_is_counted_like_the_commits() {
    let store = Arc::new(MemoryStore::new());
    let repo = init(store.clone(), false).await;
    let seg = 256usize << 10;
    let (a, mut b) = pair();
    b.extend_from_slice(&noise(6 * seg, 3));
    for s in [3, 6] {
        b.copy_within(..seg, s * seg);
    }
    let first = commit_bytes(&repo, "vm", a).await;
    let second = commit_bytes(&repo, "vm", b.clone()).await;
    let root = second.record.root.unwrap();
    let (written, _) = repo.load_group_summary(&root).await.unwrap().unwrap();
    assert!(written.is_counted() && !written.repeats().unwrap().is_empty());
    repo.mark_deleted(&first.id).await.unwrap();
    let key = cairn_format::keys::summary(&root);
    store.delete(&key).await.unwrap();
    repo.close().await.unwrap();

    let repo = open(&store).await;
    gc(&repo, &opts()).await.unwrap();
    let (rebuilt, _) = repo.load_group_summary(&root).await.unwrap().unwrap();
    assert_eq!(rebuilt, written);
    check(&repo, &second.record, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_summary_is_rebuilt_from_the_tree_plain() {
    a_damaged_summary_is_rebuilt_from_the_tree(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_summary_is_rebuilt_from_the_tree_encrypted() {
    a_damaged_summary_is_rebuilt_from_the_tree(true).await
}

/// Every pack the index runs name.
async fn named_packs(repo: &Repo) -> usize {
    let (view, _) = repo.v2_view().await.unwrap();
    view.packs().await.unwrap().len()
}

/// Fast deletion reads only the packs of what died (issue 17): six versions each with their
/// own 512 KiB of a 4 MiB image; deleting one reads the trailers of its data and node packs,
/// not the other versions'. What is left restores bit-exact and verifies, the index runs
/// name exactly the packs that exist, and the exact pass finds nothing more to delete.
async fn fast_deletion_reads_only_the_packs_of_what_died(encrypted: bool) {
    let store = Arc::new(MemoryStore::new());
    let repo = init(store.clone(), encrypted).await;
    let base = noise(4 << 20, 3);
    let mut versions = Vec::new();
    for k in 0..6u64 {
        let mut image = base.clone();
        image[1 << 20..(1 << 20) + (512 << 10)].copy_from_slice(&noise(512 << 10, 50 + k));
        let c = commit_bytes(&repo, "vm", image.clone()).await;
        versions.push((c, image));
    }
    let packs_before = named_packs(&repo).await;
    repo.mark_deleted(&versions[2].0.id).await.unwrap();
    let report = gc(&repo, &opts()).await.unwrap();
    assert_eq!(report.freed_versions, 1);
    assert!(
        report.packs_deleted + report.packs_repacked >= 1,
        "{report:?}"
    );
    assert!(
        report.trailers_read > 0 && report.trailers_read * 3 <= packs_before as u64,
        "{} of {packs_before} trailers read: {report:?}",
        report.trailers_read
    );
    assert!(report.index_read_bytes > 0, "{report:?}");

    let repo = open(&store).await;
    for (k, (c, image)) in versions.iter().enumerate() {
        if k != 2 {
            check(&repo, &c.record, image).await;
        }
    }
    assert_clean(&repo).await;
    // The runs name every pack that exists and no other.
    let (view, _) = repo.v2_view().await.unwrap();
    let mut named = view.packs().await.unwrap();
    let mut listed: Vec<_> = repo.pack_sizes().await.unwrap().into_keys().collect();
    named.sort();
    listed.sort();
    assert_eq!(named, listed);
    // Nothing died that fast deletion left behind.
    let exact = repair(&repo).await;
    assert_eq!(
        (
            exact.packs_deleted,
            exact.packs_repacked,
            exact.orphan_packs_deleted
        ),
        (0, 0, 0),
        "{exact:?}"
    );
    // The version's data committed again is stored again (no entry of a deleted group
    // was left for it to dedup against), and restores bit-exact.
    let again = commit_bytes(&repo, "vm", versions[2].1.clone()).await;
    assert_eq!(
        again.record.stats.new_chunks, 128,
        "{:?}",
        again.record.stats
    );
    check(&repo, &again.record, &versions[2].1).await;
    assert_clean(&repo).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_deletion_reads_only_the_packs_of_what_died_plain() {
    fast_deletion_reads_only_the_packs_of_what_died(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_deletion_reads_only_the_packs_of_what_died_encrypted() {
    fast_deletion_reads_only_the_packs_of_what_died(true).await
}

/// `repack_small` merges the small packs of many small commits into full ones: every version
/// restores bit-exact, the repository verifies, commits after it read few trailers again, and
/// a second run finds nothing small enough to merge (no churn). Without the option GC leaves
/// them.
async fn small_packs_are_merged_into_full_ones(encrypted: bool) {
    let store = Arc::new(MemoryStore::new());
    let repo = init(store.clone(), encrypted).await;
    let mut data = noise(2 << 20, 40);
    let mut versions = vec![(commit_bytes(&repo, "vm", data.clone()).await, data.clone())];
    for i in 0..48u64 {
        for j in 0..4u64 {
            let at = ((i * 37 + j * 131) % 512) as usize * 4096;
            data[at..at + 4096].copy_from_slice(&noise(4096, 5000 + i * 4 + j));
        }
        versions.push((commit_bytes(&repo, "vm", data.clone()).await, data.clone()));
    }
    // What a commit of four changed blocks reads, as a new process.
    let trailers_read = |data: Vec<u8>| {
        let store = store.clone();
        async move {
            let repo = open(&store).await;
            let v = commit_bytes(&repo, "vm", data.clone()).await;
            let read = repo.v2().unwrap().fetches().trailers;
            repo.close().await.unwrap(); // its session ended: no GC waits for it
            (v, data, read)
        }
    };
    let change = |data: &mut Vec<u8>, seed: u64| {
        for j in 0..4u64 {
            let at = ((seed * 53 + j * 97) % 512) as usize * 4096;
            data[at..at + 4096].copy_from_slice(&noise(4096, 9000 + seed * 4 + j));
        }
    };
    change(&mut data, 1);
    let (v, d, scattered) = trailers_read(data.clone()).await;
    versions.push((v, d));
    let before = named_packs(&repo).await;
    assert!(before > 96, "two small packs a commit: {before}");
    let plain = gc(&repo, &opts()).await.unwrap();
    assert_eq!(
        (plain.small_packs, plain.packs_repacked),
        (0, 0),
        "{plain:?}"
    );
    assert_eq!(named_packs(&repo).await, before);

    let merge = GcOptions {
        repack_small: true,
        ..opts()
    };
    let report = gc(&repo, &merge).await.unwrap();
    assert!(report.small_packs >= 96, "{report:?}");
    assert_eq!(
        report.packs_repacked, report.small_packs,
        "all of it is live"
    );
    assert_eq!(report.packs_deleted, 0);
    let after = named_packs(&repo).await;
    assert_eq!(
        after as u64,
        before as u64 - report.small_packs + report.packs_written,
        "{report:?}"
    );
    assert!(report.packs_written <= 3, "{report:?}");
    repo.close().await.unwrap(); // the next process sees it
    let repo = open(&store).await;
    for (v, want) in &versions {
        check(&repo, &v.record, want).await;
    }
    assert_clean(&repo).await;

    // A commit after it reads the trailers of a few packs, not of one per earlier commit.
    change(&mut data, 2);
    let (next, _, merged) = trailers_read(data.clone()).await;
    repo.close().await.unwrap();
    let repo = open(&store).await;
    check(&repo, &next.record, &data).await;
    assert!(
        merged * 4 < scattered,
        "{scattered} trailers before, {merged} after"
    );

    let again = gc(&repo, &merge).await.unwrap();
    assert_eq!(
        (again.small_packs, again.packs_repacked),
        (0, 0),
        "{again:?}"
    );
    let exact = repair(&repo).await;
    assert_eq!(
        (exact.packs_deleted, exact.orphan_packs_deleted),
        (0, 0),
        "{exact:?}"
    );
    assert_clean(&open(&store).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_packs_are_merged_into_full_ones_plain() {
    small_packs_are_merged_into_full_ones(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_packs_are_merged_into_full_ones_encrypted() {
    small_packs_are_merged_into_full_ones(true).await
}

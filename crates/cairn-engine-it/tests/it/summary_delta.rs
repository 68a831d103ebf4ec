//! Reference summaries stored as deltas (`cairn_format::group_summary`, "delta"): a commit
//! that changes little writes a small summary, every summary resolves through its chain to
//! exactly what its tree uses, GC keeps the summaries a live chain is resolved through even
//! when their own versions are gone (and deletes them once no chain needs them), and a damaged
//! chain is healed by rebuilding from the trees, losing nothing.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::common::{commit_bytes, flip_middle_byte, noise, summary_and_use};
use crate::gc_format2::{assert_clean, check, init, open, opts};
use cairn_engine::commit::CommitResult;
use cairn_engine::gc::gc;
use cairn_format::keys;
use cairn_format::Id;
use cairn_repo::Repo;
use cairn_store::{MemoryStore, ObjectStore};

/// Version `k`: 16 MiB of noise with its own 4 KiB at block `k * 37`.
fn version(k: u64) -> Vec<u8> {
    let mut image = noise(16 << 20, 7);
    let at = (k as usize * 37 % 4096) * 4096;
    image[at..at + 4096].copy_from_slice(&noise(4096, 1000 + k));
    image
}

async fn stored_summary(store: &MemoryStore, root: &Id) -> bytes::Bytes {
    store.get(&keys::summary(root)).await.unwrap()
}

async fn summary_roots(repo: &Repo) -> BTreeSet<Id> {
    let roots = repo.summary_roots().await.unwrap();
    roots.into_iter().map(|(id, _)| id).collect()
}

/// Every version's summary resolves to what its tree uses, and its data restores.
async fn all_exact(repo: &Arc<Repo>, versions: &[(CommitResult, Vec<u8>)]) {
    for (c, data) in versions {
        let (summary, used, _) = summary_and_use(repo, &c.record).await;
        assert!(summary.is_counted());
        assert_eq!(
            summary.groups().collect::<Vec<_>>(),
            used.groups().collect::<Vec<_>>()
        );
        assert_eq!(summary.repeats(), used.repeats());
        check(repo, &c.record, data).await;
    }
}

/// The repository opened again after a GC (a handle's index view is of before it).
async fn reopen(repo: Arc<Repo>, store: &Arc<MemoryStore>) -> Arc<Repo> {
    repo.close().await.unwrap();
    open(store).await
}

async fn commit_versions(repo: &Arc<Repo>, n: u64) -> Vec<(CommitResult, Vec<u8>)> {
    let mut out = Vec::new();
    for k in 0..n {
        out.push((commit_bytes(repo, "vm", version(k)).await, version(k)));
    }
    out
}

#[tokio::test]
async fn commits_store_small_deltas_that_resolve_exactly() {
    let store = Arc::new(MemoryStore::new());
    let repo = init(store.clone(), false).await;
    let versions = commit_versions(&repo, 10).await;
    let full = stored_summary(&store, &versions[0].0.record.root.unwrap()).await;
    assert!(full.starts_with(b"CRNSUM2\0"));
    for (c, _) in &versions[1..] {
        let raw = stored_summary(&store, &c.record.root.unwrap()).await;
        assert!(
            raw.starts_with(b"CRNSUMD\0"),
            "version {} is whole",
            c.record.seq
        );
        // One changed 4 KiB block: a few changed keys and a chain of at most 4 roots.
        assert!(
            raw.len() < 512 && raw.len() * 4 < full.len(),
            "{} of {}",
            raw.len(),
            full.len()
        );
    }
    all_exact(&repo, &versions).await;

    // Encrypted, the deltas are sealed and resolve the same.
    let store = Arc::new(MemoryStore::new());
    let repo = init(store.clone(), true).await;
    let versions = commit_versions(&repo, 4).await;
    let raw = stored_summary(&store, &versions[3].0.record.root.unwrap()).await;
    assert!(!raw.windows(8).any(|w| w == b"CRNSUMD\0"), "sealed");
    all_exact(&repo, &versions).await;
}

#[tokio::test]
async fn gc_keeps_the_bases_live_chains_need_and_frees_them_after() {
    let store = Arc::new(MemoryStore::new());
    let repo = init(store.clone(), false).await;
    let mut versions = commit_versions(&repo, 8).await;
    // Version 8 (position 7) is resolved through positions 0, 4 and 6: versions 1, 5, 7.
    let last = versions[7].0.record.root.unwrap();
    let chain = repo.summary_chain(&last).await.unwrap();
    let expected: Vec<Id> = [0, 4, 6]
        .iter()
        .map(|i| versions[*i].0.record.root.unwrap())
        .collect();
    assert_eq!(chain, expected);

    for (c, _) in &versions[..7] {
        repo.mark_deleted(&c.id).await.unwrap();
    }
    gc(&repo, &opts()).await.unwrap();
    let repo = reopen(repo, &store).await;
    let mut kept: BTreeSet<Id> = chain.iter().copied().collect();
    kept.insert(last);
    assert_eq!(
        summary_roots(&repo).await,
        kept,
        "the chain of version 8 is kept"
    );
    all_exact(&repo, &versions[7..]).await;

    // Once version 8 is deleted too, only version 9's summary and its chain remain.
    versions.push((commit_bytes(&repo, "vm", version(8)).await, version(8)));
    repo.mark_deleted(&versions[7].0.id).await.unwrap();
    gc(&repo, &opts()).await.unwrap();
    let repo = reopen(repo, &store).await;
    let nine = versions[8].0.record.root.unwrap();
    let mut kept: BTreeSet<Id> = repo
        .summary_chain(&nine)
        .await
        .unwrap()
        .into_iter()
        .collect();
    kept.insert(nine);
    assert_eq!(summary_roots(&repo).await, kept);
    all_exact(&repo, &versions[8..]).await;
    assert_clean(&repo).await;

    // The exact pass judges the bases the same way.
    crate::gc_format2::repair(&repo).await;
    let repo = reopen(repo, &store).await;
    assert_eq!(summary_roots(&repo).await, kept);
    all_exact(&repo, &versions[8..]).await;
}

#[tokio::test]
async fn a_damaged_chain_is_rebuilt_from_the_trees_and_nothing_is_lost() {
    let store = Arc::new(MemoryStore::new());
    let repo = init(store.clone(), false).await;
    let versions = commit_versions(&repo, 6).await;
    // The full summary every other one is resolved through.
    let first = versions[0].0.record.root.unwrap();
    flip_middle_byte(&store, &keys::summary(&first), 0x40).await;
    let err = repo
        .load_group_summary(&versions[3].0.record.root.unwrap())
        .await
        .unwrap_err();
    assert!(err.is_damage(), "{err}");

    // A deletion makes GC read the live summaries: each broken one is rebuilt whole.
    repo.mark_deleted(&versions[4].0.id).await.unwrap();
    let report = gc(&repo, &opts()).await.unwrap();
    assert!(
        report.metadata_read_bytes > 0,
        "trees were walked: {report:?}"
    );
    let repo = reopen(repo, &store).await;
    let live: Vec<_> = versions
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 4)
        .map(|(_, v)| v.clone())
        .collect();
    all_exact(&repo, &live).await;
    assert_clean(&repo).await;

    // A commit after the damage takes a healed summary as its base.
    let next = commit_bytes(&repo, "vm", version(6)).await;
    all_exact(&repo, &[(next, version(6))]).await;
}

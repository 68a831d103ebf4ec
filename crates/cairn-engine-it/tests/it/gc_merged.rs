//! Merged reference summaries (`gc/merged/`, one per image): fast deletion reads one per image
//! plus the summaries of trees deleted or committed since the last GC, and what the merges
//! say is live is exactly the union of the live trees' own summaries. A damaged merge, or one
//! counting a tree whose summary changed since, is built again; nothing live is lost.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::common::{commit_bytes, flip_middle_byte, noise};
use crate::gc_format2::{assert_clean, check, init, open, opts, repair};
use cairn_engine::commit::CommitResult as Committed;
use cairn_engine::gc::gc;
use cairn_format::group_summary::GroupSummary;
use cairn_format::Id;
use cairn_repo::Repo;
use cairn_store::{MemoryStore, ObjectStore};

/// Version `k` of image `seed`: 1 MiB of noise with its own 64 KiB at block `k`.
fn version(seed: u64, k: u64) -> Vec<u8> {
    let mut image = noise(1 << 20, seed);
    let at = (k as usize % 16) * (64 << 10);
    image[at..at + (64 << 10)].copy_from_slice(&noise(64 << 10, seed * 100 + k));
    image
}

async fn merge_keys(store: &MemoryStore) -> Vec<String> {
    let listed = store.list(cairn_format::keys::MERGED_SUMMARIES).await;
    listed.unwrap().into_iter().map(|m| m.key).collect()
}

/// The union the stored merges give, and the union of the live trees' own summaries.
async fn unions(repo: &Repo, live: &[&Committed]) -> (GroupSummary, GroupSummary) {
    let mut merged = GroupSummary::default();
    for (key, m, _) in repo.merged_summaries().await.unwrap() {
        m.unwrap_or_else(|e| panic!("{key}: {e}"))
            .union_into(&mut merged);
    }
    let mut own = GroupSummary::default();
    let roots: BTreeSet<Id> = live.iter().filter_map(|c| c.record.root).collect();
    for root in roots {
        let (s, _) = repo.load_group_summary(&root).await.unwrap().unwrap();
        own.merge(&s);
    }
    (merged, own)
}

async fn one_summary_per_image(encrypted: bool) {
    let store = Arc::new(MemoryStore::new());
    let repo = init(store.clone(), encrypted).await;
    let mut a = Vec::new();
    let mut b = Vec::new();
    for k in 0..4 {
        a.push((commit_bytes(&repo, "a", version(1, k)).await, version(1, k)));
        b.push((commit_bytes(&repo, "b", version(2, k)).await, version(2, k)));
    }

    // The first GC has no merge: it reads the 7 live trees' summaries and writes two.
    repo.mark_deleted(&a[0].0.id).await.unwrap();
    let first = gc(&repo, &opts()).await.unwrap();
    assert_eq!(first.summaries_read, 7, "{first:?}");
    assert_eq!(merge_keys(&store).await.len(), 2);
    if encrypted {
        let raw = store.get(&merge_keys(&store).await[0]).await.unwrap();
        assert!(!raw.windows(8).any(|w| w == b"CRNMSUM\0"), "sealed");
    }

    // Two commits and a deletion later: 2 merges, the deleted tree and the 2 new ones.
    for k in 4..6 {
        a.push((commit_bytes(&repo, "a", version(1, k)).await, version(1, k)));
    }
    repo.mark_deleted(&a[1].0.id).await.unwrap();
    let second = gc(&repo, &opts()).await.unwrap();
    assert_eq!(second.summaries_read, 2 + 1 + 2, "{second:?}");
    assert!(
        second.packs_deleted + second.packs_repacked > 0,
        "{second:?}"
    );
    assert_eq!(merge_keys(&store).await.len(), 2);
    let live: Vec<&Committed> = a[2..].iter().chain(&b).map(|(c, _)| c).collect();
    let (merged, own) = unions(&repo, &live).await;
    assert_eq!(merged, own, "the merges count exactly the live trees");

    repo.close().await.unwrap();
    let repo = open(&store).await;
    for (c, image) in a[2..].iter().chain(&b) {
        check(&repo, &c.record, image).await;
    }
    assert_clean(&repo).await;

    // An image with no live version left loses its merge.
    for (c, _) in &b {
        repo.mark_deleted(&c.id).await.unwrap();
    }
    let third = gc(&repo, &opts()).await.unwrap();
    assert_eq!(third.summaries_read, 2, "{third:?}");
    assert_eq!(merge_keys(&store).await.len(), 1);

    // A damaged merge is built again from the live trees' summaries.
    let key = merge_keys(&store).await.remove(0);
    flip_middle_byte(&store, &key, 0x08).await;
    repo.mark_deleted(&a[2].0.id).await.unwrap();
    let fourth = gc(&repo, &opts()).await.unwrap();
    assert_eq!(fourth.summaries_read, 1 + 3, "{fourth:?}");
    let keys = merge_keys(&store).await;
    assert!(keys.len() == 1 && keys[0] != key, "{keys:?}");
    let live: Vec<&Committed> = a[3..].iter().map(|(c, _)| c).collect();
    let (merged, own) = unions(&repo, &live).await;
    assert_eq!(merged, own);
    repo.close().await.unwrap();
    let repo = open(&store).await;
    for (c, image) in &a[3..] {
        check(&repo, &c.record, image).await;
    }
    assert_clean(&repo).await;

    // The exact pass finds nothing dead that fast deletion left, and deletes the merges.
    // (It may still repack or delete a pack: bounded dedup sometimes stores a block again
    // that only a grandparent held — which hooks a segment picks depends on the chunk ids,
    // keyed per repository when sealed, so about 1 sealed run in 40 — and the exact pass
    // keeps one copy of each, deleting a pack that holds only such duplicates. They were
    // never dead, and were there before any GC: no blob it counts is dead, and every live
    // version still restores.)
    let exact = repair(&repo).await;
    assert_eq!(exact.dead_blobs, 0, "{exact:?}");
    assert!(merge_keys(&store).await.is_empty());
    if exact.packs_deleted + exact.packs_repacked > 0 {
        repo.close().await.unwrap();
        let repo = open(&store).await;
        for (c, image) in &a[3..] {
            check(&repo, &c.record, image).await;
        }
        assert_clean(&repo).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_deletion_reads_one_merged_summary_per_image_plain() {
    one_summary_per_image(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fast_deletion_reads_one_merged_summary_per_image_encrypted() {
    one_summary_per_image(true).await
}

/// A tree's summary replaced after a merge counted it — here by a superset that also lists
/// the live tree's new groups — is not subtracted from the merge (that would take the live
/// tree's slots with it): the merge is built again, and the live version restores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tree_whose_summary_changed_is_not_subtracted() {
    let store = Arc::new(MemoryStore::new());
    let repo = init(store.clone(), false).await;
    let old = commit_bytes(&repo, "vm", noise(1 << 20, 9)).await;
    let gone_image = version(3, 0);
    let gone = commit_bytes(&repo, "vm", gone_image).await;
    let kept_image = version(3, 7);
    let kept = commit_bytes(&repo, "vm", kept_image.clone()).await;
    repo.mark_deleted(&old.id).await.unwrap();
    gc(&repo, &opts()).await.unwrap();
    assert_eq!(merge_keys(&store).await.len(), 1);

    let (gone_root, kept_root) = (gone.record.root.unwrap(), kept.record.root.unwrap());
    let (mut superset, _) = repo.load_group_summary(&gone_root).await.unwrap().unwrap();
    let (kept_summary, _) = repo.load_group_summary(&kept_root).await.unwrap().unwrap();
    superset.merge(&kept_summary);
    repo.delete_summary(&gone_root).await.unwrap();
    repo.put_group_summary(&gone_root, &superset, None)
        .await
        .unwrap();

    repo.mark_deleted(&gone.id).await.unwrap();
    let report = gc(&repo, &opts()).await.unwrap();
    assert_eq!(report.freed_versions, 1, "{report:?}");
    repo.close().await.unwrap();
    let repo = open(&store).await;
    check(&repo, &kept.record, &kept_image).await;
    assert_clean(&repo).await;
    // The merge (1), the changed summary (1), and the live tree's to build it again (1).
    assert_eq!(report.summaries_read, 1 + 1 + 1, "{report:?}");
    let (merged, own) = unions(&repo, &[&kept]).await;
    assert_eq!(merged, own);
}

/// A damaged merge built again with the same trees has the same content id (in a plain
/// repository): it is written over the damaged one, not lost with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_merge_built_again_under_its_own_key_is_kept() {
    let store = Arc::new(MemoryStore::new());
    let repo = init(store.clone(), false).await;
    let mut a = Vec::new();
    for k in 0..4 {
        a.push(commit_bytes(&repo, "a", version(4, k)).await);
    }
    commit_bytes(&repo, "b", version(5, 0)).await;
    repo.mark_deleted(&a[0].id).await.unwrap();
    gc(&repo, &opts()).await.unwrap();
    let merges = repo.merged_summaries().await.unwrap();
    let (b_key, _, _) = merges
        .iter()
        .find(|(_, m, _)| m.as_ref().unwrap().image == "b")
        .unwrap();
    let good = flip_middle_byte(&store, b_key, 0x04).await;

    // b's merge is built again from its one tree: the same bytes under the same key.
    repo.mark_deleted(&a[1].id).await.unwrap();
    let rebuilt = gc(&repo, &opts()).await.unwrap();
    assert_eq!(rebuilt.summaries_read, 2 + 1 + 1, "{rebuilt:?}");
    assert_eq!(store.get(b_key).await.unwrap(), good);
    // The next GC reads both merges as they are: a's, b's, and the tree deleted since.
    repo.mark_deleted(&a[2].id).await.unwrap();
    let next = gc(&repo, &opts()).await.unwrap();
    assert_eq!(next.summaries_read, 2 + 1, "{next:?}");
}

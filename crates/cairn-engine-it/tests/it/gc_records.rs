//! GC's version record bundle (`gc/records/`): a GC reads the bundle the last one wrote and
//! only the records committed since from their own keys; a GC with nothing new writes
//! nothing; a damaged bundle is ignored (every record read again) and replaced — under its own
//! key when the records are the same; the exact
//! pass reads every record but leaves a bundle. Plain and sealed repositories alike.

use std::sync::Arc;

use crate::common::{commit_bytes, flip_middle_byte, noise};
use crate::gc_format2::{assert_clean, check, init, open, opts, repair};
use cairn_engine::gc::gc;
use cairn_store::{MemoryStore, ObjectStore};

async fn bundle_keys(store: &MemoryStore) -> Vec<String> {
    let listed = store.list(cairn_format::keys::RECORD_BUNDLES).await;
    listed.unwrap().into_iter().map(|m| m.key).collect()
}

/// Version `k`: 512 KiB of noise with its own 64 KiB at block `k`.
fn version(k: u64) -> Vec<u8> {
    let mut image = noise(512 << 10, 5);
    let at = (k as usize % 8) * (64 << 10);
    image[at..at + (64 << 10)].copy_from_slice(&noise(64 << 10, 500 + k));
    image
}

async fn records_between_gcs(encrypted: bool) {
    let store = Arc::new(MemoryStore::new());
    let repo = init(store.clone(), encrypted).await;
    let mut v = Vec::new();
    for k in 0..6 {
        v.push(commit_bytes(&repo, "vm", version(k)).await);
    }

    // No bundle yet: the first GC reads the 6 records (its second walk none) and writes one.
    repo.mark_deleted(&v[0].id).await.unwrap();
    let first = gc(&repo, &opts()).await.unwrap();
    assert_eq!(
        (first.records_read, first.record_bundle_bytes),
        (6, 0),
        "{first:?}"
    );
    let keys = bundle_keys(&store).await;
    assert_eq!(keys.len(), 1);
    if encrypted {
        // The records in it are stored as under versions/: sealed.
        let raw = store.get(&keys[0]).await.unwrap();
        let plain_image = b"vm";
        let sealed = store
            .get(&cairn_format::keys::version(&v[1].id))
            .await
            .unwrap();
        assert!(raw.windows(sealed.len()).any(|w| w == &sealed[..]));
        assert!(!sealed.windows(2).any(|w| w == plain_image));
    }

    // Two commits later, a GC reads those two only.
    for k in 6..8 {
        v.push(commit_bytes(&repo, "vm", version(k)).await);
    }
    repo.mark_deleted(&v[1].id).await.unwrap();
    let second = gc(&repo, &opts()).await.unwrap();
    assert_eq!(second.records_read, 2, "{second:?}");
    assert!(second.record_bundle_bytes > 0, "{second:?}");
    let after_second = bundle_keys(&store).await;
    assert!(
        after_second.len() == 1 && after_second != keys,
        "{after_second:?}"
    );

    // Nothing new: nothing read, the bundle stays as it is.
    let idle = gc(&repo, &opts()).await.unwrap();
    assert_eq!(idle.records_read, 0, "{idle:?}");
    // It stopped after reading what is live: no summary, trailer or index run was touched.
    let steps: Vec<&str> = idle.phases.iter().map(|(name, _)| *name).collect();
    assert!(steps.contains(&"history") && steps.contains(&"record bundle"));
    assert!(!steps.contains(&"live summaries") && !steps.contains(&"index run"));
    assert_eq!(bundle_keys(&store).await, after_second);

    // A damaged bundle is ignored: every record is read from its own key, and it is replaced.
    let key = &after_second[0];
    let good = flip_middle_byte(&store, key, 0x20).await;
    repo.mark_deleted(&v[2].id).await.unwrap();
    let third = gc(&repo, &opts()).await.unwrap();
    assert_eq!(
        (third.records_read, third.freed_versions),
        (8, 1),
        "{third:?}"
    );
    // (The same records: the same content id, and now the good bytes under it again.)
    let replaced = bundle_keys(&store).await;
    assert_eq!(replaced, after_second);
    assert_eq!(store.get(key).await.unwrap(), good);

    repo.close().await.unwrap();
    let repo = open(&store).await;
    for (k, c) in v.iter().enumerate().skip(3) {
        check(&repo, &c.record, &version(k as u64)).await;
    }
    assert_clean(&repo).await;

    // The exact pass reads every record from its own key, finds nothing dead, and leaves a
    // bundle for the next fast deletion.
    let exact = repair(&repo).await;
    assert_eq!(exact.records_read, 8, "{exact:?}");
    assert_eq!(exact.dead_blobs, 0, "{exact:?}");
    assert_eq!(bundle_keys(&store).await, replaced);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_reads_only_the_records_committed_since_the_last_gc_plain() {
    records_between_gcs(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_reads_only_the_records_committed_since_the_last_gc_encrypted() {
    records_between_gcs(true).await
}

/// A GC killed between writing a bundle and deleting the one it replaced leaves two: the
/// next GC reads both (here: neither holds every record, together they do) and keeps one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_bundles_left_by_a_killed_gc_become_one() {
    use cairn_format::record_bundle::RecordBundle;
    let store = Arc::new(MemoryStore::new());
    let repo = init(store.clone(), false).await;
    let mut v = Vec::new();
    for k in 0..4 {
        v.push(commit_bytes(&repo, "vm", version(k)).await);
    }
    let (mut old, mut new) = (RecordBundle::default(), RecordBundle::default());
    for (i, c) in v.iter().enumerate() {
        let key = cairn_format::keys::version(&c.id);
        let stored = store.get(&key).await.unwrap().to_vec();
        if i < 3 {
            old.insert(stored.clone());
        }
        if i > 0 {
            new.insert(stored);
        }
    }
    repo.put_record_bundle(&old).await.unwrap();
    repo.put_record_bundle(&new).await.unwrap();
    assert_eq!(bundle_keys(&store).await.len(), 2);

    repo.mark_deleted(&v[0].id).await.unwrap();
    let report = gc(&repo, &opts()).await.unwrap();
    assert_eq!(report.records_read, 0, "{report:?}");
    let keys = bundle_keys(&store).await;
    assert_eq!(keys.len(), 1, "{keys:?}");
    let (_, kept, _) = repo.record_bundles().await.unwrap().remove(0);
    assert_eq!(kept.unwrap().records.len(), 4);
}

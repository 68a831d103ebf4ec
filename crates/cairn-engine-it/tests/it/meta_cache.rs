//! The metadata cache: a repository reopened with it downloads no index file and no manifest
//! node it has seen before, ignores damaged cached copies, and still learns what is new (and
//! forgets what is gone) from the store's listing.

use cairn_format::keys;
use std::sync::Arc;

use crate::common::*;
use cairn_engine::commit::CommitResult;
use cairn_format::pack::BlobKind;
use cairn_format::Id;
use cairn_repo::{ContentCache, Repo};
use cairn_store::{CountingStore, MemoryStore, ObjectStore};

const CHUNK: u32 = 16 << 10;
const SEGMENT: u32 = 256 << 10;

fn index_reads(keys: &[String]) -> usize {
    keys.iter().filter(|k| k.starts_with(keys::INDEX)).count()
}

fn pack_reads(keys: &[String]) -> usize {
    keys.iter().filter(|k| k.starts_with("packs/")).count()
}

async fn open(store: &Arc<dyn ObjectStore>, cache: &Arc<ContentCache>) -> Arc<Repo> {
    Arc::new(
        Repo::open_cached(
            store.clone(),
            cairn_repo::SessionKind::Read,
            Some(cache.clone()),
            None,
        )
        .await
        .unwrap(),
    )
}

/// A repository in `store` holding one commit of `image` as "vm", and an empty cache.
async fn setup(
    store: &Arc<dyn ObjectStore>,
    image: &[u8],
) -> (tempfile::TempDir, Arc<ContentCache>, CommitResult) {
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = Arc::new(ContentCache::open(cache_dir.path(), 1 << 30).unwrap());
    let repo = Arc::new(
        Repo::init(store.clone(), config(CHUNK, SEGMENT))
            .await
            .unwrap(),
    );
    let v1 = commit_bytes(&repo, "vm", image.to_vec()).await;
    repo.close().await.unwrap();
    (cache_dir, cache, v1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reopening_downloads_only_what_is_new() {
    let log = Arc::new(CountingStore::new(Arc::new(MemoryStore::new())));
    let store: Arc<dyn ObjectStore> = log.clone();
    let image = noise(3 << 20, 1);
    let (_cache_dir, cache, v1) = setup(&store, &image).await;

    // First open: every index file comes from the store; restoring reads nodes and chunks.
    log.take_keys_read();
    let first = open(&store, &cache).await;
    let opened = log.take_keys_read();
    assert!(index_reads(&opened) > 0);
    assert_eq!(restore_bytes(&first, &v1.record).await.unwrap(), image);
    let cold_pack_reads = pack_reads(&log.take_keys_read());
    first.close().await.unwrap();

    // Second open: no index file is downloaded, and no manifest node: a restore reads only
    // chunk ranges.
    let second = open(&store, &cache).await;
    assert_eq!(index_reads(&log.take_keys_read()), 0);
    let nodes: Vec<Id> = second
        .index()
        .by_pack()
        .values()
        .flatten()
        .filter(|e| e.kind == BlobKind::Node)
        .map(|e| e.id)
        .collect();
    assert!(nodes.len() > 10);
    second.read_blobs(&nodes).await.unwrap();
    assert_eq!(pack_reads(&log.take_keys_read()), 0);
    assert_eq!(restore_bytes(&second, &v1.record).await.unwrap(), image);
    let warm_pack_reads = pack_reads(&log.take_keys_read());
    assert!(
        warm_pack_reads < cold_pack_reads,
        "warm {warm_pack_reads} cold {cold_pack_reads}"
    );

    // A new commit (by a process without the cache) adds one index file: the next open
    // downloads exactly that one.
    let writer = Arc::new(Repo::open(store.clone()).await.unwrap());
    let mut changed = image.clone();
    changed[5000..9000].copy_from_slice(&noise(4000, 2));
    let v2 = commit_bytes(&writer, "vm", changed.clone()).await;
    writer.close().await.unwrap();
    log.take_keys_read();
    let third = open(&store, &cache).await;
    assert_eq!(index_reads(&log.take_keys_read()), 1);
    assert_eq!(restore_bytes(&third, &v2.record).await.unwrap(), changed);
    assert_eq!(restore_bytes(&third, &v1.record).await.unwrap(), image);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn neighbouring_blobs_share_a_read() {
    // A 12 MiB image has 48 leaves, written next to each other: reading them all takes one
    // ranged read per pack that holds them, not one per leaf.
    let log = Arc::new(CountingStore::new(Arc::new(MemoryStore::new())));
    let store: Arc<dyn ObjectStore> = log.clone();
    let repo = Arc::new(
        Repo::init(store.clone(), config(CHUNK, SEGMENT))
            .await
            .unwrap(),
    );
    commit_bytes(&repo, "vm", noise(12 << 20, 5)).await;
    let by_pack = repo.index().by_pack();
    let mut leaves = Vec::new();
    let mut packs_with_nodes = 0;
    for entries in by_pack.values() {
        let nodes: Vec<Id> = entries
            .iter()
            .filter(|e| e.kind == BlobKind::Node)
            .map(|e| e.id)
            .collect();
        packs_with_nodes += usize::from(!nodes.is_empty());
        leaves.extend(nodes);
    }
    assert!(leaves.len() >= 48);
    log.take_keys_read();
    let raws = repo.read_blobs(&leaves).await.unwrap();
    for (id, raw) in leaves.iter().zip(&raws) {
        assert_eq!(repo.read_blob(id).await.unwrap(), *raw);
    }
    let keys = log.take_keys_read();
    let batched = keys.len() - leaves.len();
    assert_eq!(batched, packs_with_nodes, "{keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_cached_copies_are_fetched_again() {
    let store: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new());
    let image = noise(2 << 20, 3);
    let (cache_dir, cache, v1) = setup(&store, &image).await;
    let warm = open(&store, &cache).await;
    assert_eq!(restore_bytes(&warm, &v1.record).await.unwrap(), image);
    warm.close().await.unwrap();

    // Flip one byte in every cached file.
    let mut damaged = 0;
    for sub in std::fs::read_dir(cache_dir.path()).unwrap() {
        let sub = sub.unwrap().path();
        if sub.ends_with("tmp") {
            continue;
        }
        for f in std::fs::read_dir(&sub).unwrap() {
            let path = f.unwrap().path();
            let mut bytes = std::fs::read(&path).unwrap();
            bytes[0] ^= 0xff;
            std::fs::write(&path, bytes).unwrap();
            damaged += 1;
        }
    }
    assert!(damaged > 1, "cache holds index files and nodes");
    let again = open(&store, &cache).await;
    assert!(again.index_errors().is_empty());
    assert_eq!(restore_bytes(&again, &v1.record).await.unwrap(), image);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_listing_decides_what_exists() {
    // An index file deleted from the store (as GC does after replacing it) is not resurrected
    // from the cache: its packs' blobs are no longer indexed.
    let store: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new());
    let (_cache_dir, cache, _) = setup(&store, &noise(1 << 20, 4)).await;
    let warm = open(&store, &cache).await;
    let blobs = warm.index().len();
    assert!(blobs > 0);
    warm.close().await.unwrap();
    for meta in store.list(keys::INDEX).await.unwrap() {
        store.delete(&meta.key).await.unwrap();
    }
    let cold = open(&store, &cache).await;
    assert_eq!(cold.index().len(), 0);
}

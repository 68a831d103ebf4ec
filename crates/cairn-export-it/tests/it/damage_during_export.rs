//! An export of a format 2 version whose group is damaged: the client gets an I/O error for
//! the group's blocks only, the copy is quarantined, and once a commit stored those blocks
//! again (in other groups) an export of the old version reads them from there, bit-exact.

use std::sync::Arc;

use cairn_export::{Base, ContentCache, ExportStats, VersionExport};
use cairn_format::config::RepoConfig;
use cairn_format::{keys, Id};
use cairn_nbd::Export;
use cairn_repo::Repo;
use cairn_store::{MemoryStore, ObjectStore};
use cairn_testkit::noise;

async fn commit_bytes(repo: &Arc<Repo>, data: Vec<u8>) -> cairn_engine::commit::CommitResult {
    cairn_testkit::engine::commit_bytes(repo, "vm", data).await
}

async fn open(store: &Arc<MemoryStore>) -> Arc<Repo> {
    Arc::new(
        Repo::open_as(store.clone(), cairn_repo::SessionKind::Export)
            .await
            .unwrap(),
    )
}

/// An export of `version` with a fresh host-wide cache.
async fn export(
    repo: &Arc<Repo>,
    version: &cairn_engine::commit::CommitResult,
) -> (VersionExport, tempfile::TempDir) {
    let cache_dir = tempfile::tempdir().unwrap();
    let stats = Arc::new(ExportStats::default());
    let base = Base::open(
        repo.clone(),
        Arc::new(ContentCache::open(cache_dir.path(), 1 << 30).unwrap()),
        stats.clone(),
        version.id,
        version.record.clone(),
        0,
    )
    .await
    .unwrap();
    (VersionExport::new(base, stats), cache_dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_group_fails_only_its_blocks_and_heals_through_other_copies() {
    let store = Arc::new(MemoryStore::new());
    let config = RepoConfig {
        pack_target: 1 << 20,
        ..RepoConfig::default_v2()
    };
    let repo = Arc::new(Repo::init(store.clone(), config).await.unwrap());
    let data = noise(3 << 20, 5);
    let v1 = commit_bytes(&repo, data.clone()).await;
    // Damage the second group of segment 1 (blocks 272..288).
    let at = (1 << 20) + 16 * 4096;
    let (trailer, slot) = repo
        .v2()
        .unwrap()
        .locate_chunk(&Id::of(&data[at..at + 4096]))
        .await
        .unwrap();
    let offset = trailer.groups[slot.group as usize].offset as usize;
    store.corrupt_object(&keys::pack(&trailer.pack), offset + 40);
    repo.close().await.unwrap();

    // The export serves everything else; the group's blocks are an I/O error, and the copy
    // is quarantined for every later process.
    let r = open(&store).await;
    let (e, _cache) = export(&r, &v1).await;
    assert!(e.read(0, 1 << 20).await.unwrap()[..] == data[..1 << 20]);
    assert!(e.read(at as u64, 4096).await.is_err());
    assert!(e.read((2 << 20) as u64, 4096).await.unwrap()[..] == data[2 << 20..(2 << 20) + 4096]);
    r.close().await.unwrap();
    assert_eq!(store.list("quarantine/").await.unwrap().len(), 1);

    // A commit of the disk with block 256 changed stores the group's 16 blocks again, in
    // other groups (the changed block comes first in the segment).
    let r = open(&store).await;
    let mut data3 = data.clone();
    data3[1 << 20..(1 << 20) + 4096].fill(9);
    let v3 = commit_bytes(&r, data3).await;
    assert_eq!(v3.record.stats.new_chunks, 17);
    r.close().await.unwrap();

    // An export of the old version now reads those blocks from their new copies.
    let r = open(&store).await;
    let (e, _cache) = export(&r, &v1).await;
    let got = e.read(1 << 20, 1 << 20).await.unwrap();
    assert!(
        got[..] == data[1 << 20..2 << 20],
        "healed through other copies"
    );
}

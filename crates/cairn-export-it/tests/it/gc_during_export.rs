//! An export does not hold GC back, and keeps serving its version after GC repacked it.

use std::sync::Arc;
use std::time::Duration;

use cairn_engine::gc::{gc, GcMode, GcOptions};
use cairn_export::{Base, ContentCache, ExportStats, VersionExport};
use cairn_format::config::RepoConfig;
use cairn_nbd::Export;
use cairn_repo::Repo;
use cairn_store::MemoryStore;
use cairn_testkit::noise;

async fn commit_bytes(repo: &Arc<Repo>, data: Vec<u8>) -> cairn_engine::commit::CommitResult {
    cairn_testkit::engine::commit_bytes(repo, "vm", data).await
}

/// The GC rewrites v1's groups without their dead slots in new packs; the export's
/// index runs name the old packs until it re-reads them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_rewrites_groups_under_a_running_export() {
    gc_under_a_running_export(RepoConfig::default_v2()).await
}

async fn gc_under_a_running_export(config: RepoConfig) {
    let store = Arc::new(MemoryStore::new());
    let config = RepoConfig {
        pack_target: 1 << 20,
        ..config
    };
    let repo = Arc::new(Repo::init(store.clone(), config).await.unwrap());
    // v1, then v2 rewriting every other 16 KiB: every pack of v1 becomes half dead.
    let v1 = noise(4 << 20, 1);
    let first = commit_bytes(&repo, v1.clone()).await;
    let mut v2 = v1.clone();
    for (i, c) in v2.chunks_mut(16384).enumerate() {
        if i % 2 == 0 {
            c.copy_from_slice(&noise(16384, 100 + i as u64));
        }
    }
    let second = commit_bytes(&repo, v2.clone()).await;
    repo.close().await.unwrap();

    // The export opens (its session predates the GC) and serves v2.
    let export_repo = Arc::new(
        Repo::open_as(store.clone(), cairn_repo::SessionKind::Export)
            .await
            .unwrap(),
    );
    let cache_dir = tempfile::tempdir().unwrap();
    let stats = Arc::new(ExportStats::default());
    let base = Base::open(
        export_repo.clone(),
        Arc::new(ContentCache::open(cache_dir.path(), 1 << 30).unwrap()),
        stats.clone(),
        second.id,
        second.record.clone(),
        0,
    )
    .await
    .unwrap();
    let export = VersionExport::new(base, stats.clone());
    assert_eq!(&export.read(0, 1 << 20).await.unwrap()[..], &v2[..1 << 20]);

    // Delete v1 and collect: GC must not wait for the export, and it repacks v2's blobs.
    let gc_repo = Arc::new(
        Repo::open_as(store.clone(), cairn_repo::SessionKind::Gc)
            .await
            .unwrap(),
    );
    gc_repo.mark_deleted(&first.id).await.unwrap();
    let report = gc(
        &gc_repo,
        &GcOptions {
            mode: GcMode::Fast,
            wait_limit: Duration::from_secs(5),
            poll: Duration::from_millis(10),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(report.packs_repacked > 0, "{report:?}");

    // The rest of v2 is read from the repository (not the cache): the old packs are gone, the
    // export re-reads the index and finds the repacked copies.
    let size = v2.len() as u64;
    let mut at = 1 << 20;
    while at < size {
        let len = (1 << 20).min(size - at) as u32;
        let got = export.read(at, len).await.unwrap();
        assert!(
            got[..] == v2[at as usize..at as usize + len as usize],
            "at {at}"
        );
        at += len as u64;
    }
    assert_eq!(
        stats
            .fetch_errors
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

//! The lazy version export keeps the NBD `Export` contract (`cairn_nbd::contract::check`),
//! read-only and with a writable overlay, over a version with data, zeros and a partial last
//! block (leaves of runs of compressed groups).

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cairn_engine::commit::{commit, CommitOptions};
use cairn_engine::source::StreamSource;
use cairn_export::{Base, ContentCache, ExportStats, VersionExport};
use cairn_format::config::RepoConfig;
use cairn_overlay::Overlay;
use cairn_repo::Repo;
use cairn_store::MemoryStore;
use cairn_testkit::noise;

/// 3 MiB + 1000 bytes: noise, a MiB of zeros, noise.
fn image() -> Vec<u8> {
    let mut v = noise((3 << 20) + 1000, 5);
    v[1 << 20..2 << 20].fill(0);
    v
}

/// A repository holding `image()` as vm@1, in a tree of `fanout` children a node.
async fn repo_with_image(fanout: u16) -> (Arc<Repo>, cairn_engine::commit::CommitResult) {
    let config = RepoConfig {
        fanout,
        ..RepoConfig::default_v2()
    };
    let repo = Arc::new(
        Repo::init(Arc::new(MemoryStore::new()), config)
            .await
            .unwrap(),
    );
    let src = StreamSource::new("test", std::io::Cursor::new(image()));
    let version = commit(repo.clone(), "vm", Box::new(src), CommitOptions::default())
        .await
        .unwrap();
    (repo, version)
}

async fn export(writable: bool, dir: &std::path::Path) -> Arc<VersionExport> {
    export_with(writable, 256, dir).await
}

async fn export_with(writable: bool, fanout: u16, dir: &std::path::Path) -> Arc<VersionExport> {
    let (repo, version) = repo_with_image(fanout).await;
    let stats = Arc::new(ExportStats::default());
    let cache = Arc::new(ContentCache::open(&dir.join("cache"), 1 << 30).unwrap());
    let base = Base::open(repo, cache, stats.clone(), version.id, version.record, 8)
        .await
        .unwrap();
    let overlay = writable.then(|| {
        Arc::new(
            Overlay::open(
                &dir.join("overlay"),
                base.size(),
                65536,
                &version.id.to_hex(),
            )
            .unwrap(),
        )
    });
    Arc::new(VersionExport::with_overlay(base, overlay, stats))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_version_export_keeps_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    cairn_nbd::contract::check(export(false, dir.path()).await, image()).await;
}

/// A tree of height 2 (fanout 2 over four segments, one of them zeros): the interior nodes
/// under the root are read when a segment under them is first touched, not at the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_of_a_deep_tree_reads_its_interior_nodes_on_demand() {
    {
        let dir = tempfile::tempdir().unwrap();
        let (repo, version) = repo_with_image(2).await;
        assert_eq!(version.record.height, 2);
        let root = version.record.root.unwrap();
        let root_bytes = repo.read_blob(&root).await.unwrap().len() as u64;
        let stats = Arc::new(ExportStats::default());
        let cache = Arc::new(ContentCache::open(&dir.path().join("cache"), 1 << 30).unwrap());
        let base = Base::open(repo, cache, stats.clone(), version.id, version.record, 8)
            .await
            .unwrap();
        let fetched = || stats.metadata_bytes_fetched.load(Ordering::Relaxed);
        assert_eq!(fetched(), root_bytes, "the start reads the root only");
        let export = Arc::new(VersionExport::with_overlay(base, None, stats.clone()));
        cairn_nbd::contract::check(export, image()).await;
        assert!(fetched() > root_bytes);
    }
    let dir = tempfile::tempdir().unwrap();
    cairn_nbd::contract::check(export_with(true, 2, dir.path()).await, image()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writable_version_export_keeps_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    cairn_nbd::contract::check(export(true, dir.path()).await, image()).await;
}

/// Format 2: a read decodes each group it touches once and counts its plain bytes as
/// fetched; a second export on the same host cache (another VM started from the same image)
/// fetches nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_fetches_each_group_once_and_shares_the_host_cache() {
    let dir = tempfile::tempdir().unwrap();
    let (repo, version) = repo_with_image(256).await;
    let cache = Arc::new(ContentCache::open(&dir.path().join("cache"), 1 << 30).unwrap());
    let open = |stats: Arc<ExportStats>| {
        Base::open(
            repo.clone(),
            cache.clone(),
            stats,
            version.id,
            version.record.clone(),
            0,
        )
    };
    let img = image();
    let stats = Arc::new(ExportStats::default());
    let base = Arc::new(open(stats.clone()).await.unwrap());
    // The first 4 KiB, then the whole first MiB in 4 KiB reads (a guest's pattern).
    let mut buf = vec![0u8; 4096];
    for off in (0..1 << 20).step_by(4096) {
        base.read(off, &mut buf).await.unwrap();
        assert!(buf[..] == img[off as usize..off as usize + 4096]);
    }
    let get = |s: &ExportStats, f: fn(&ExportStats) -> &std::sync::atomic::AtomicU64| {
        f(s).load(std::sync::atomic::Ordering::Relaxed)
    };
    // 1 MiB of noise in 64 KiB groups: 16 groups, each fetched once, 256 chunks.
    assert_eq!(get(&stats, |s| &s.bytes_fetched), 1 << 20);
    assert_eq!(get(&stats, |s| &s.chunks_fetched), 256);
    assert_eq!(get(&stats, |s| &s.fetch_errors), 0);

    let again = Arc::new(ExportStats::default());
    let second = Arc::new(open(again.clone()).await.unwrap());
    let mut all = vec![0u8; 1 << 20];
    second.read(0, &mut all).await.unwrap();
    assert!(all[..] == img[..1 << 20]);
    assert_eq!(get(&again, |s| &s.bytes_fetched), 0);
    assert_eq!(get(&again, |s| &s.cache_hits), 256);
}

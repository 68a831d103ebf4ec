//! The lazy version export keeps the NBD `Export` contract (`cairn_nbd::contract::check`),
//! read-only and with a writable overlay, over a version with data, zeros and a partial last
//! block.

use std::sync::Arc;

use cairn_engine::commit::{commit, CommitOptions};
use cairn_engine::source::StreamSource;
use cairn_export::{Base, ContentCache, ExportStats, VersionExport};
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

async fn export(writable: bool, dir: &std::path::Path) -> Arc<VersionExport> {
    let repo = Arc::new(
        Repo::init(Arc::new(MemoryStore::new()), Default::default())
            .await
            .unwrap(),
    );
    let src = StreamSource::new("test", std::io::Cursor::new(image()));
    let version = commit(repo.clone(), "vm", Box::new(src), CommitOptions::default())
        .await
        .unwrap();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writable_version_export_keeps_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    cairn_nbd::contract::check(export(true, dir.path()).await, image()).await;
}

//! `copy`: versions between repositories of other formats and keys — format 1 plain → format 2
//! encrypted → format 1 — bit-exact, with history, times, messages and tags; only changed
//! segments read; a second run copies nothing.

use std::path::Path;
use std::sync::Arc;

use crate::common::{commit_bytes, config, noise, restore_bytes};
use cairn_engine::copy::copy;
use cairn_engine::resolve::{history, VersionSpec};
use cairn_format::config::RepoConfig;
use cairn_format::crypto::KdfParams;
use cairn_repo::Repo;
use cairn_store::LocalStore;
use cairn_testkit::repo_snapshot;
use zeroize::Zeroizing;

const SEG: usize = 256 << 10;

async fn init(dir: &Path, config: RepoConfig) -> Arc<Repo> {
    let store = Arc::new(LocalStore::create(dir).unwrap());
    Arc::new(Repo::init(store, config).await.unwrap())
}

async fn init_encrypted(dir: &Path) -> Arc<Repo> {
    let store = Arc::new(LocalStore::create(dir).unwrap());
    let kdf = KdfParams {
        memory_kib: 1024,
        passes: 1,
        lanes: 1,
    };
    let config = RepoConfig {
        segment_size: SEG as u32,
        pack_target: 1 << 20,
        ..RepoConfig::default_v2()
    };
    let pass = Zeroizing::new(b"copy test".to_vec());
    Arc::new(
        Repo::init_encrypted(store, config, pass, kdf)
            .await
            .unwrap(),
    )
}

/// Source and copy agree: same count, order, times, messages, sizes and bytes.
async fn same_history(a: &Arc<Repo>, b: &Arc<Repo>, image: &str) {
    let ha = history(a, image).await.unwrap();
    let hb = history(b, image).await.unwrap();
    assert_eq!(ha.len(), hb.len(), "{image}: versions");
    for ((_, ra), (_, rb)) in ha.iter().zip(&hb) {
        assert_eq!(
            (ra.seq, ra.time_ns, &ra.message, ra.logical_size),
            (rb.seq, rb.time_ns, &rb.message, rb.logical_size)
        );
        assert_eq!(
            restore_bytes(a, ra).await.unwrap(),
            restore_bytes(b, rb).await.unwrap(),
            "{image}@{} differs after the copy",
            ra.seq
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_copy_across_formats_and_keys_bit_exact_and_a_second_run_copies_nothing() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let src = init(dirs[0].path(), config(16 << 10, SEG as u32)).await;

    // vm: 8 segments of data; then one byte range changed in segment 3; then grown by 2
    // segments (a new size: read whole). db: 4 segments, a hole in the middle.
    let mut vm = noise(8 * SEG, 1);
    let vm1 = commit_bytes(&src, "vm", vm.clone()).await;
    vm[3 * SEG + 100..3 * SEG + 200].copy_from_slice(&noise(100, 2));
    let vm2 = commit_bytes(&src, "vm", vm.clone()).await;
    vm.extend(noise(2 * SEG, 3));
    commit_bytes(&src, "vm", vm.clone()).await;
    let mut db = noise(4 * SEG, 4);
    db[SEG..2 * SEG].fill(0);
    commit_bytes(&src, "db", db.clone()).await;
    src.create_tag("vm", "golden", &vm2.id).await.unwrap();
    src.create_tag("vm", "first", &vm1.id).await.unwrap();

    // Format 1 plain → format 2 encrypted, everything.
    let enc = init_encrypted(dirs[1].path()).await;
    let report = copy(src.clone(), enc.clone(), &[], None).await.unwrap();
    assert_eq!(report.copied.len(), 4);
    assert_eq!(report.present, 0);
    assert_eq!(report.tags_created, 2);
    // Read: vm@1 whole (8), vm@2 one segment, vm@3 whole (10: its size changed), db's three
    // data segments (the hole has no leaf).
    assert_eq!(report.read_bytes, (8 + 1 + 10 + 3) * SEG as u64);
    same_history(&src, &enc, "vm").await;
    same_history(&src, &enc, "db").await;
    let golden = enc.tag("vm", "golden").await.unwrap().unwrap();
    assert_eq!(enc.load_version(&golden).await.unwrap().seq, 2);

    // A second run copies nothing and changes nothing.
    enc.close().await.unwrap();
    let before = repo_snapshot(dirs[1].path());
    let enc = {
        let store = Arc::new(LocalStore::open(dirs[1].path()).unwrap());
        let pass = cairn_repo::GivenPassphrase(Zeroizing::new(b"copy test".to_vec()));
        Arc::new(
            Repo::open_cached(store, cairn_repo::SessionKind::Commit, None, Some(&pass))
                .await
                .unwrap(),
        )
    };
    let again = copy(src.clone(), enc.clone(), &[], None).await.unwrap();
    assert!(again.copied.is_empty(), "{again:?}");
    assert_eq!(
        (again.present, again.tags_created, again.read_bytes),
        (4, 0, 0)
    );
    assert!(
        before == repo_snapshot(dirs[1].path()),
        "a second copy changed the destination"
    );

    // Format 2 encrypted → format 1 plain, one version by tag: only it, and the tag that
    // names it; its base in the destination is nothing, so it is read whole.
    let back = init(dirs[2].path(), config(16 << 10, SEG as u32)).await;
    let spec = VersionSpec::parse("vm@golden").unwrap();
    let one = copy(enc.clone(), back.clone(), &[spec], None)
        .await
        .unwrap();
    assert_eq!(one.copied.len(), 1);
    assert_eq!(one.copied[0].seq, 1);
    assert_eq!(
        one.tags_created, 1,
        "golden, not first (its target was not copied)"
    );
    let (_, record) = history(&back, "vm").await.unwrap().remove(0);
    let mut expect = noise(8 * SEG, 1);
    expect[3 * SEG + 100..3 * SEG + 200].copy_from_slice(&noise(100, 2));
    assert_eq!(restore_bytes(&back, &record).await.unwrap(), expect);
    assert!(back.tag("vm", "first").await.unwrap().is_none());
}

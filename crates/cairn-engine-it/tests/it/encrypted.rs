//! An encrypted format 2 repository end to end through the engine: bit-exact round trips,
//! nothing of the plain data in any stored file, keyed ids that no other repository shares,
//! a wrong or missing passphrase refused by name, and a flipped byte in any kind of sealed
//! object found by verify and named with the version it affects.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::common::{commit_bytes, noise, restore_bytes};
use cairn_engine::verify::verify;
use cairn_format::config::{Compression, RepoConfig};
use cairn_format::crypto::KdfParams;
use cairn_format::Id;
use cairn_repo::{GivenPassphrase, Repo, RepoError, SessionKind};
use cairn_store::LocalStore;
use cairn_testkit::files_under as files;
use zeroize::Zeroizing;

/// Fast key derivation for tests (the CLI uses `KdfParams::DEFAULT`).
const TEST_KDF: KdfParams = KdfParams {
    memory_kib: 1024,
    passes: 1,
    lanes: 1,
};

/// A marker that must appear in the stored bytes of a plain repository (no compression) and
/// never in an encrypted one's.
const MARKER: &[u8] = b"<<cairn plaintext marker: if you can read this, it leaked>>";

fn config() -> RepoConfig {
    RepoConfig {
        segment_size: 256 << 10,
        pack_target: 1 << 20,
        compression: Compression::None,
        ..RepoConfig::default_v2()
    }
}

fn pass(p: &str) -> GivenPassphrase {
    GivenPassphrase(Zeroizing::new(p.as_bytes().to_vec()))
}

async fn encrypted(dir: &Path, passphrase: &str) -> Arc<Repo> {
    let store = Arc::new(LocalStore::create(dir).unwrap());
    Arc::new(
        Repo::init_encrypted(store, config(), pass(passphrase).0, TEST_KDF)
            .await
            .unwrap(),
    )
}

async fn open(dir: &Path, passphrase: Option<&str>) -> Result<Arc<Repo>, RepoError> {
    let store = Arc::new(LocalStore::open(dir).unwrap());
    let p = passphrase.map(pass);
    Repo::open_cached(
        store,
        SessionKind::Read,
        None,
        p.as_ref().map(|p| p as &dyn cairn_repo::Passphrase),
    )
    .await
    .map(Arc::new)
}

/// Data with the marker in every 4 KiB block's middle, random blocks and zeros.
fn image() -> Vec<u8> {
    let mut img = Vec::new();
    for i in 0..128u32 {
        let mut block = noise(4096, u64::from(i));
        block[1000..1000 + MARKER.len()].copy_from_slice(MARKER);
        img.extend(block);
    }
    img.extend(vec![0u8; 64 << 10]);
    img.extend(noise(300 << 10, 99));
    img
}

/// Every chunk, group and node id a format 2 repository stores (from its pack trailers).
async fn stored_ids(repo: &Repo) -> HashSet<Id> {
    let reader = repo.v2().unwrap();
    let mut ids = HashSet::new();
    for pack in reader.packs().await.unwrap() {
        let trailer = reader.trailer(&pack).await.unwrap();
        for (i, g) in trailer.groups.iter().enumerate() {
            ids.insert(trailer.group_id(i as u32).unwrap());
            ids.extend(g.desc.chunks.iter().map(|c| c.id));
        }
    }
    ids
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

fn flip(path: &Path, at: usize) {
    cairn_testkit::flip_file_byte(path, at, 0x20);
}

#[tokio::test]
async fn encrypted_repositories_round_trip_leak_nothing_and_share_no_id() {
    let tmp = tempfile::tempdir().unwrap();
    let (a_dir, b_dir, p_dir) = (
        tmp.path().join("a"),
        tmp.path().join("b"),
        tmp.path().join("p"),
    );
    let a = encrypted(&a_dir, "same passphrase").await;
    let b = encrypted(&b_dir, "same passphrase").await;
    let p = Arc::new(
        Repo::init(Arc::new(LocalStore::create(&p_dir).unwrap()), config())
            .await
            .unwrap(),
    );
    let img = image();
    let first = commit_bytes(&a, "vm", img.clone()).await;
    commit_bytes(&b, "vm", img.clone()).await;
    commit_bytes(&p, "vm", img.clone()).await;
    assert_eq!(restore_bytes(&a, &first.record).await.unwrap(), img);
    // 128 marked blocks + 75 noise blocks; the zeros are holes.
    assert_eq!(first.record.stats.new_chunks, 128 + 75);

    // Dedup works inside the repository: the same image again stores no chunk.
    let again = commit_bytes(&a, "vm", img.clone()).await;
    assert_eq!(again.record.stats.new_chunks, 0);
    assert_eq!(again.record.root, first.record.root);

    // Keyed ids: the two encrypted repositories (same data, same passphrase) and the plain
    // one share no chunk, group or node id.
    let (ia, ib, ip) = (
        stored_ids(&a).await,
        stored_ids(&b).await,
        stored_ids(&p).await,
    );
    assert!(ia.len() > 203, "{}", ia.len());
    assert!(ia.is_disjoint(&ib));
    assert!(ia.is_disjoint(&ip));
    assert!(ib.is_disjoint(&ip));

    // The plain repository shows the marker (the check can fail); no encrypted file does.
    let leaks = |dir: &Path| {
        files(dir)
            .into_iter()
            .any(|f| contains(&std::fs::read(f).unwrap(), MARKER))
    };
    assert!(
        leaks(&p_dir),
        "the uncompressed plain repository holds the marker"
    );
    assert!(!leaks(&a_dir), "an encrypted repository leaked plain data");
    assert!(verify(a.clone()).await.unwrap().is_clean());

    // Opening: the right passphrase, a wrong one, none.
    drop((a, b));
    let again = open(&a_dir, Some("same passphrase")).await.unwrap();
    assert_eq!(restore_bytes(&again, &first.record).await.unwrap(), img);
    let e = open(&a_dir, Some("wrong")).await.unwrap_err();
    assert!(
        matches!(e, RepoError::WrongPassphrase { slots: 1, .. }),
        "{e}"
    );
    assert!(e.to_string().starts_with("wrong passphrase"), "{e}");
    let e = open(&a_dir, None).await.unwrap_err();
    assert!(matches!(e, RepoError::Locked { .. }), "{e}");
}

#[tokio::test]
async fn a_flipped_byte_in_any_sealed_object_is_found_and_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("r");
    let repo = encrypted(&dir, "pw").await;
    commit_bytes(&repo, "vm", image()).await;
    commit_bytes(&repo, "other", noise(200 << 10, 5)).await;
    drop(repo);
    let kinds = |prefix: &str| -> Vec<PathBuf> { files(&dir.join(prefix)) };
    let version_of_vm = {
        let r = open(&dir, Some("pw")).await.unwrap();
        let head = r.head("vm").await.unwrap().unwrap();
        cairn_format::keys::version(&head.version)
    };
    // (object, byte to flip, what verify must say)
    let data_pack = {
        let r = open(&dir, Some("pw")).await.unwrap();
        let reader = r.v2().unwrap();
        let mut biggest = None;
        for pack in reader.packs().await.unwrap() {
            let t = reader.trailer(&pack).await.unwrap();
            let bytes: u64 = t
                .groups
                .iter()
                .map(|g| g.range().end - g.range().start)
                .sum();
            if biggest.as_ref().is_none_or(|(b, _, _)| bytes > *b) {
                biggest = Some((bytes, pack, t.groups[0].range().start + 10));
            }
        }
        let (_, pack, at) = biggest.unwrap();
        (dir.join(cairn_format::keys::pack(&pack)), at as usize)
    };
    // (object, byte to flip, the version verify must name, if one in particular)
    let pack_len = std::fs::metadata(&data_pack.0).unwrap().len() as usize;
    let mut cases = vec![
        (data_pack.0.clone(), data_pack.1, Some("vm@1")),
        (data_pack.0.clone(), pack_len - 40, Some("vm@1")),
        (dir.join(&version_of_vm), 40, Some(version_of_vm.as_str())),
    ];
    cases.extend(kinds("index-runs").into_iter().map(|f| (f, 30, None)));
    for (path, at, expect) in cases {
        flip(&path, at);
        let r = open(&dir, Some("pw")).await.unwrap();
        let report = verify(r).await.unwrap();
        let what = path.strip_prefix(&dir).unwrap().display().to_string();
        assert!(!report.is_clean(), "{what}: verify found nothing");
        if what.starts_with("index-runs") {
            // A damaged section costs speed, not data: every version still restores, and
            // the problem names the run.
            assert!(
                report.damaged_versions.is_empty()
                    && report.problems.iter().any(|p| p.contains(&what)),
                "{what}: {:?}",
                report.problems
            );
            flip(&path, at);
            continue;
        }
        let named: Vec<String> = report
            .damaged_versions
            .iter()
            .map(|v| format!("{}@{}", v.image, v.seq))
            .chain(report.damaged_metadata.iter().map(|d| d.key.clone()))
            .collect();
        assert!(
            !named.is_empty(),
            "{what}: no version named: {:?}",
            report.problems
        );
        if let Some(expect) = expect {
            assert!(
                named.iter().any(|n| n == expect),
                "{what}: {named:?} {:?}",
                report.problems
            );
        }
        flip(&path, at);
        let r = open(&dir, Some("pw")).await.unwrap();
        assert!(verify(r).await.unwrap().is_clean(), "{what}: flipped back");
    }

    // A damaged key slot (the only one): the repository does not open, and says why.
    let slot = kinds("keys").pop().unwrap();
    flip(&slot, 50);
    let e = open(&dir, Some("pw")).await.unwrap_err();
    assert!(
        e.is_damage() && e.to_string().contains("every key slot is damaged"),
        "{e}"
    );
    flip(&slot, 50);
    assert!(open(&dir, Some("pw")).await.is_ok());
}

/// A config replaced by a plain one (a downgrade) next to key slots: a writer refuses before
/// writing anything; the repository's files stay as they were.
#[tokio::test]
async fn a_plain_config_next_to_key_slots_is_refused_by_writers() {
    let dir = tempfile::tempdir().unwrap();
    let repo = encrypted(dir.path(), "pw").await;
    commit_bytes(&repo, "vm", image()).await;
    // Closed, not dropped: a dropped session is removed in the background, which would race
    // with the snapshots below.
    repo.close().await.unwrap();
    let plain = config();
    std::fs::write(dir.path().join("config"), plain.encode()).unwrap();
    let snapshot = || cairn_testkit::repo_snapshot(dir.path());
    let before = snapshot();
    let store = Arc::new(LocalStore::open(dir.path()).unwrap());
    let e = Repo::open_cached(store, SessionKind::Commit, None, None)
        .await
        .unwrap_err();
    assert!(matches!(e, RepoError::Downgraded { .. }), "{e}");
    assert!(e.is_damage());
    assert!(
        e.to_string().contains("refusing to write plain data"),
        "{e}"
    );
    let after = snapshot();
    assert_eq!(before, after, "the refused writer changed the repository");
}

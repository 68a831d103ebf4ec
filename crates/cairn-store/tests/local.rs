//! Behaviour specific to the local-directory backend: on-disk layout, crash leftovers,
//! and ref locking across independent stores, threads and processes.

use std::path::Path;
use std::process::{Command, Stdio};

use bytes::Bytes;
use cairn_store::{CasOutcome, LocalStore, ObjectStore, PutOutcome, StoreError};

const CHILD_ENV: &str = "CAIRN_STORE_TEST_CAS_ROOT";
const INCREMENTS: u64 = 25;

/// Increment the counter ref `counter` `n` times with read-modify-write + CAS.
async fn increment(store: &LocalStore, n: u64) {
    for _ in 0..n {
        loop {
            let state = store.read_ref("counter").await.unwrap().unwrap();
            let value: u64 = std::str::from_utf8(&state.data).unwrap().parse().unwrap();
            let next = Bytes::from((value + 1).to_string());
            match store
                .cas_ref("counter", Some(&state.version), Some(next))
                .await
            {
                Ok(CasOutcome::Swapped { .. }) => break,
                Ok(CasOutcome::Conflict { .. }) => continue,
                Err(e) => panic!("cas_ref: {e}"),
            }
        }
    }
}

fn increment_blocking(root: &Path, n: u64) {
    let store = LocalStore::open(root).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(increment(&store, n));
}

async fn counter(store: &LocalStore) -> String {
    let state = store.read_ref("counter").await.unwrap().unwrap();
    String::from_utf8(state.data.to_vec()).unwrap()
}

#[test]
fn open_of_missing_directory_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-repo");
    let err = LocalStore::open(&missing).unwrap_err();
    assert!(matches!(err, StoreError::Io { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains(&missing.display().to_string()), "{msg}");
    assert!(!missing.exists(), "open must not create the directory");

    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let msg = LocalStore::open(&file).unwrap_err().to_string();
    assert!(msg.contains(&file.display().to_string()), "{msg}");
}

#[tokio::test]
async fn layout_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("deep/repo");
    let store = LocalStore::create(&root).unwrap();
    assert_eq!(store.root(), root);
    assert_eq!(store.describe(), root.display().to_string());

    store
        .put_if_absent("packs/ab/abcd.pack", Bytes::from_static(b"pack"))
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(root.join("packs/ab/abcd.pack")).unwrap(),
        b"pack"
    );

    let swapped = store
        .cas_ref("heads/web01", None, Some(Bytes::from_static(b"v1")))
        .await
        .unwrap();
    assert!(matches!(swapped, CasOutcome::Swapped { version: Some(_) }));
    assert_eq!(std::fs::read(root.join("refs/heads/web01")).unwrap(), b"v1");
    assert!(root.join("refs/.lock").is_file());

    // Refs are not objects, and the lock file is not a ref.
    let objects: Vec<String> = store
        .list("")
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.key)
        .collect();
    assert_eq!(objects, ["packs/ab/abcd.pack"]);
    assert_eq!(store.list_refs("").await.unwrap(), ["heads/web01"]);

    // Reopening sees the same state, and equal content means equal version.
    let reopened = LocalStore::open(&root).unwrap();
    let a = store.read_ref("heads/web01").await.unwrap().unwrap();
    let b = reopened.read_ref("heads/web01").await.unwrap().unwrap();
    assert_eq!(a, b);
}

/// A new store (in the returned directory) holding one object, `packs/ab/one`.
async fn store_with_one_pack() -> (tempfile::TempDir, LocalStore) {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create(dir.path()).unwrap();
    store
        .put_if_absent("packs/ab/one", Bytes::from_static(b"1"))
        .await
        .unwrap();
    (dir, store)
}

#[tokio::test]
async fn leftover_temp_files_are_ignored() {
    let (_dir, store) = store_with_one_pack().await;
    let root = store.root().to_path_buf();
    store
        .cas_ref("heads/a", None, Some(Bytes::from_static(b"a")))
        .await
        .unwrap();

    // What a crash between "create temp" and "link"/"rename" leaves behind.
    std::fs::write(root.join("packs/ab/.tmp-0123456789abcdef"), b"torn wri").unwrap();
    std::fs::write(root.join(".tmp-fedcba9876543210"), b"").unwrap();
    std::fs::write(root.join("refs/heads/.tmp-0000000000000000"), b"half").unwrap();

    let keys: Vec<String> = store
        .list("")
        .await
        .unwrap()
        .into_iter()
        .map(|m| m.key)
        .collect();
    assert_eq!(keys, ["packs/ab/one"]);
    assert_eq!(store.list("packs/ab/").await.unwrap().len(), 1);
    assert_eq!(store.list("packs/ab/.").await.unwrap(), []);
    assert_eq!(store.list_refs("heads/").await.unwrap(), ["heads/a"]);

    let outcome = store
        .put_if_absent("packs/ab/two", Bytes::from_static(b"2"))
        .await
        .unwrap();
    assert_eq!(outcome, PutOutcome::Created);
    assert_eq!(&store.get("packs/ab/two").await.unwrap()[..], b"2");
    let version = store.read_ref("heads/a").await.unwrap().unwrap().version;
    let swapped = store
        .cas_ref("heads/a", Some(&version), Some(Bytes::from_static(b"b")))
        .await
        .unwrap();
    assert!(matches!(swapped, CasOutcome::Swapped { .. }));

    // Temp names are not valid keys, so nobody can ask for one.
    let err = store
        .get("packs/ab/.tmp-0123456789abcdef")
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::InvalidKey { .. }), "{err:?}");
}

#[tokio::test]
async fn a_key_cannot_be_both_file_and_directory() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create(dir.path()).unwrap();
    store
        .put_if_absent("a/b", Bytes::from_static(b"x"))
        .await
        .unwrap();
    assert!(matches!(
        store.get("a").await,
        Err(StoreError::NotFound { .. })
    ));
    assert_eq!(store.head("a").await.unwrap(), None);
    store.delete("a").await.unwrap();
    let err = store.put_if_absent("a", Bytes::new()).await.unwrap_err();
    assert!(
        err.to_string()
            .contains(&dir.path().join("a").display().to_string()),
        "{err}"
    );
    assert!(matches!(
        store.get("a/b/c").await,
        Err(StoreError::NotFound { .. })
    ));
    assert_eq!(&store.get("a/b").await.unwrap()[..], b"x");
}

/// Independent stores on one root, each swapping from its own thread and runtime: the
/// `flock` on separate open file descriptions must serialise them.
#[tokio::test]
async fn cas_is_exclusive_across_independent_stores() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create(dir.path()).unwrap();
    store
        .cas_ref("counter", None, Some(Bytes::from_static(b"0")))
        .await
        .unwrap();
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let root = dir.path().to_path_buf();
            std::thread::spawn(move || increment_blocking(&root, INCREMENTS))
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(counter(&store).await, (4 * INCREMENTS).to_string());
}

/// Helper run in child processes by `cas_is_exclusive_across_processes`; a no-op otherwise.
#[test]
fn cas_child_worker() {
    if let Some(root) = std::env::var_os(CHILD_ENV) {
        increment_blocking(Path::new(&root), INCREMENTS);
    }
}

#[tokio::test]
async fn cas_is_exclusive_across_processes() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create(dir.path()).unwrap();
    store
        .cas_ref("counter", None, Some(Bytes::from_static(b"0")))
        .await
        .unwrap();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = (0..3)
        .map(|_| {
            Command::new(&exe)
                .args(["--exact", "cas_child_worker", "--test-threads=1", "--quiet"])
                .env(CHILD_ENV, dir.path())
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    increment(&store, INCREMENTS).await;
    for mut child in children {
        assert!(child.wait().unwrap().success(), "child process failed");
    }
    assert_eq!(counter(&store).await, (4 * INCREMENTS).to_string());
}

/// The sweep for stale temporaries trusts a listing's read of a directory that began after
/// its cutoff (that read saw every temporary old enough to remove), and reads the others.
#[tokio::test]
async fn the_temporary_sweep_reuses_what_a_listing_read() {
    let (_dir, store) = store_with_one_pack().await;
    let root = store.root().to_path_buf();
    let hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    let old_temporary = |key: &str| {
        let path = root.join(key);
        std::fs::write(&path, b"torn").unwrap();
        let file = std::fs::File::options().write(true).open(&path).unwrap();
        file.set_modified(hour_ago).unwrap();
        path
    };
    old_temporary("packs/ab/.tmp-0000000000000001");
    old_temporary("packs/.tmp-0000000000000002");
    let cutoff = std::time::SystemTime::now() - std::time::Duration::from_secs(60);
    // The listing reads packs/ and packs/ab/.
    assert_eq!(store.list("packs/").await.unwrap().len(), 1);
    // No writer can add a temporary last written before the cutoff once the listing ran: this
    // one's time is set back by hand, so the sweep, trusting the listing, does not see it.
    let unseen = old_temporary("packs/ab/.tmp-0000000000000003");
    // The top directory was not listed: it is read, and its temporary found.
    old_temporary(".tmp-0000000000000004");
    assert_eq!(
        store.remove_stale_temporaries(cutoff).await.unwrap(),
        (3, 12)
    );
    assert!(unseen.exists());
    // A cutoff after the listing began: every directory is read again.
    let now = std::time::SystemTime::now();
    assert_eq!(store.remove_stale_temporaries(now).await.unwrap(), (1, 4));
    assert!(!unseen.exists());
    assert_eq!(store.list("packs/").await.unwrap().len(), 1);
}

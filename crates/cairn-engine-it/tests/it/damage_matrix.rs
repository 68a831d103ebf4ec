//! The damage matrix (issue 53): every kind of object a repository holds × {flip a byte,
//! truncate, delete, swap for another of its kind} × {plain, encrypted}. After each, the
//! repository is used as an operator would, and four things must hold:
//!
//! 1. No wrong bytes: every version restores bit-exact or fails with an error.
//! 2. Damage is named: if a version does not restore, `verify` is not clean.
//! 3. Nothing live is deleted: `gc` and `gc --repair` (each may refuse) leave every version
//!    that restored before restoring bit-exact after.
//! 4. Healing: committing the image's newest data again yields a version that restores
//!    bit-exact, and `repair` loses nothing that restored, and is clean only if every
//!    version restores.
//!
//! A repository whose config or key slot is unreadable cannot be opened: every command fails
//! with one error, which satisfies 1 and is checked as such.

use std::sync::Arc;

use cairn_engine::gc::{gc, GcMode, GcOptions};
use cairn_engine::repair::{repair, RepairOptions};
use cairn_engine::verify::verify;
use cairn_format::config::RepoConfig;
use cairn_format::keys;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::{GivenPassphrase, Repo, SessionKind};
use cairn_store::{MemoryStore, ObjectMeta, ObjectStore};

use crate::common::*;

fn config() -> RepoConfig {
    RepoConfig {
        repo_id: [54; 16],
        segment_size: 1 << 20,
        pack_target: 1 << 20,
        ..RepoConfig::default_v2()
    }
}

/// A repository to damage: image `vm` (four versions, a few blocks changing each time) and
/// image `other` (one version of unrelated data, committed last). `before_other` lists the
/// objects that existed before `other` was committed: the damage targets `vm`'s.
struct Fixture {
    store: Arc<MemoryStore>,
    versions: Vec<(Id, VersionRecord, Vec<u8>)>,
    before_other: Vec<ObjectMeta>,
    newest_vm: Vec<u8>,
}

async fn fixture(encrypted: bool) -> Fixture {
    let store = Arc::new(MemoryStore::new());
    let repo = init_format2(store.clone(), config(), encrypted).await;
    let mut versions = changing_versions(&repo, "vm", 54, 4).await;
    let data = versions.last().expect("four versions").2.clone();
    let before_other = store.list("").await.unwrap();
    let other = noise(1 << 20, 55);
    let c = commit_bytes(&repo, "other", other.clone()).await;
    versions.push((c.id, c.record, other));
    repo.close().await.unwrap();
    Fixture {
        store,
        versions,
        before_other,
        newest_vm: data,
    }
}

async fn open(store: &Arc<MemoryStore>) -> Result<Arc<Repo>, String> {
    let pass = GivenPassphrase(zeroize::Zeroizing::new(PASSPHRASE.to_vec()));
    Repo::open_cached(store.clone(), SessionKind::Commit, None, Some(&pass))
        .await
        .map(Arc::new)
        .map_err(|e| e.to_string())
}

/// The versions that restore, checking that none restores wrong bytes. A version is named
/// by its record as the repository holds it: one whose record is unreadable is not a version
/// any more (its data may go with the next GC).
async fn restorable(repo: &Arc<Repo>, f: &Fixture, what: &str) -> Vec<Id> {
    let mut ok = Vec::new();
    for (id, record, data) in &f.versions {
        let Ok(stored) = repo.load_version(id).await else {
            continue;
        };
        assert_eq!(stored, *record, "{what}: a record reads back changed");
        if let Ok(got) = restore_bytes(repo, record).await {
            assert!(
                got == *data,
                "{what}: {}@{} restored WRONG BYTES with success",
                record.image,
                record.seq
            );
            ok.push(*id);
        }
    }
    ok
}

/// One commit of `data` as image `vm`.
async fn commit_once(
    repo: &Arc<Repo>,
    data: &[u8],
) -> Result<cairn_engine::commit::CommitResult, cairn_engine::EngineError> {
    let src = cairn_engine::source::StreamSource::new("test", std::io::Cursor::new(data.to_vec()));
    cairn_engine::commit::commit(
        repo.clone(),
        "vm",
        Box::new(src),
        cairn_engine::commit::CommitOptions::default(),
    )
    .await
}

/// How an object is damaged.
#[derive(Debug, Clone, Copy)]
enum Op {
    /// Flip a byte at this offset (negative: from the end).
    Flip(i64),
    Truncate,
    Delete,
    /// Replace with the bytes of another object of the same kind.
    Swap,
}

fn apply(store: &MemoryStore, target: &ObjectMeta, other: Option<&ObjectMeta>, op: Op) {
    let size = target.size as i64;
    match op {
        Op::Flip(at) => {
            let at = if at < 0 { size + at } else { at };
            store.corrupt_object(&target.key, at.clamp(0, size - 1) as usize);
        }
        Op::Truncate => store.truncate_object(&target.key, target.size as usize / 2),
        Op::Delete => futures_lite_block(store.delete(&target.key)),
        Op::Swap => {
            let other = other.expect("swap needs a second object");
            let bytes = futures_lite_block(store.get(&other.key));
            futures_lite_block(store.delete(&target.key));
            futures_lite_block(store.put_if_absent(&target.key, bytes));
        }
    }
}

/// Runs a store call to completion (MemoryStore answers at once).
fn futures_lite_block<T, E: std::fmt::Debug>(
    f: impl std::future::Future<Output = Result<T, E>>,
) -> T {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f)).unwrap()
}

/// Objects of `prefix` that existed before `other`, smallest first.
fn of_kind(f: &Fixture, prefix: &str) -> Vec<ObjectMeta> {
    let mut v: Vec<ObjectMeta> = f
        .before_other
        .iter()
        .filter(|m| m.key.starts_with(prefix))
        .cloned()
        .collect();
    v.sort_by_key(|m| m.size);
    v
}

/// The cells: (name, object kind prefix, which of that kind (smallest = 0, largest = -1),
/// operation).
fn cells(encrypted: bool) -> Vec<(&'static str, &'static str, i64, Op)> {
    let mut v = vec![
        ("data pack: a group", keys::PACKS, -1, Op::Flip(5000)),
        ("data pack: header", keys::PACKS, -1, Op::Flip(2)),
        ("data pack: trailer", keys::PACKS, -1, Op::Flip(-100)),
        ("data pack: footer", keys::PACKS, -1, Op::Flip(-10)),
        ("data pack: truncated", keys::PACKS, -1, Op::Truncate),
        ("data pack: deleted", keys::PACKS, -1, Op::Delete),
        ("data pack: swapped", keys::PACKS, -1, Op::Swap),
        // Past the first group's frame (33 bytes after the 20-byte header, 65 sealed).
        ("node pack: a node", keys::PACKS, 0, Op::Flip(100)),
        ("data pack: a group frame", keys::PACKS, -1, Op::Flip(24)),
        ("node pack: deleted", keys::PACKS, 0, Op::Delete),
        ("index run: a section", keys::INDEX_RUNS, -1, Op::Flip(20)),
        ("index run: top level", keys::INDEX_RUNS, -1, Op::Flip(-60)),
        ("index run: truncated", keys::INDEX_RUNS, -1, Op::Truncate),
        ("index run: deleted", keys::INDEX_RUNS, -1, Op::Delete),
        ("index run: swapped", keys::INDEX_RUNS, -1, Op::Swap),
        ("version record: flipped", keys::VERSIONS, 1, Op::Flip(20)),
        ("version record: truncated", keys::VERSIONS, 1, Op::Truncate),
        ("version record: deleted", keys::VERSIONS, 1, Op::Delete),
        ("version record: swapped", keys::VERSIONS, 1, Op::Swap),
        ("summary: flipped", keys::SUMMARIES, -1, Op::Flip(20)),
        ("summary: deleted", keys::SUMMARIES, -1, Op::Delete),
        ("config: flipped", keys::CONFIG, 0, Op::Flip(20)),
        ("config: deleted", keys::CONFIG, 0, Op::Delete),
    ];
    if encrypted {
        v.push(("key slot: flipped", keys::KEY_SLOTS, 0, Op::Flip(40)));
        v.push(("key slot: deleted", keys::KEY_SLOTS, 0, Op::Delete));
    }
    v
}

/// Ref damage: the head of `vm` flipped, deleted, or swapped for `other`'s.
#[derive(Debug, Clone, Copy)]
enum RefOp {
    Flip,
    Delete,
    Swap,
}

async fn damage_head(store: &MemoryStore, op: RefOp) {
    let key = keys::head("vm");
    let state = store.read_ref(&key).await.unwrap().unwrap();
    match op {
        RefOp::Flip => store.corrupt_ref(&key, state.data.len() / 2),
        RefOp::Delete => {
            store
                .cas_ref(&key, Some(&state.version), None)
                .await
                .unwrap();
        }
        RefOp::Swap => {
            let other = store.read_ref(&keys::head("other")).await.unwrap().unwrap();
            store
                .cas_ref(&key, Some(&state.version), Some(other.data))
                .await
                .unwrap();
        }
    }
}

/// Uses the damaged repository as an operator would and checks the four rules.
async fn check_cell(f: &Fixture, what: &str) {
    eprintln!("cell: {what}");
    let repo = match open(&f.store).await {
        Ok(repo) => repo,
        // Config or key slot: nothing opens, nothing returns bytes.
        Err(e) => {
            assert!(!e.is_empty(), "{what}: an open fails with a message");
            return;
        }
    };
    let before = restorable(&repo, f, what).await;
    let report = verify(repo.clone()).await.unwrap();
    if before.len() < f.versions.len() {
        assert!(
            !report.is_clean(),
            "{what}: {} of {} versions fail to restore, yet verify is clean",
            f.versions.len() - before.len(),
            f.versions.len()
        );
    }
    repo.close().await.unwrap();

    for mode in [GcMode::Fast, GcMode::Repair] {
        let repo = open(&f.store).await.unwrap();
        let _ = gc(
            &repo,
            &GcOptions {
                mode,
                ..Default::default()
            },
        )
        .await; // may refuse: then it deleted nothing
        repo.close().await.unwrap();
        let repo = open(&f.store).await.unwrap();
        let after = restorable(&repo, f, what).await;
        for id in &before {
            let (_, r, _) = f.versions.iter().find(|(v, _, _)| v == id).unwrap();
            if !after.contains(id) {
                let err = restore_bytes(&repo, r).await.err();
                panic!(
                    "{what}: gc ({mode:?}) lost {}@{}, which restored before it: {err:?}",
                    r.image, r.seq
                );
            }
        }
        repo.close().await.unwrap();
    }

    // Committing the newest data again heals: the new version restores. A commit may
    // refuse instead, naming damage it cannot build on (a head that cannot be read); then
    // `repair` comes first, and the commit after it must work.
    let repo = open(&f.store).await.unwrap();
    let first = commit_once(&repo, &f.newest_vm).await;
    repo.close().await.unwrap();
    let repo = open(&f.store).await.unwrap();
    let r = repair(&repo, RepairOptions::default()).await.unwrap();
    repo.close().await.unwrap();
    let again = match first {
        Ok(again) => again,
        Err(e) => {
            assert!(
                e.is_damage(),
                "{what}: a commit failed, and not on damage: {e}"
            );
            let repo = open(&f.store).await.unwrap();
            let again = commit_once(&repo, &f.newest_vm)
                .await
                .unwrap_or_else(|e| panic!("{what}: a commit after repair fails: {e}"));
            repo.close().await.unwrap();
            again
        }
    };
    let repo = open(&f.store).await.unwrap();
    let got = restore_bytes(&repo, &again.record).await;
    assert!(
        got.as_ref() == Ok(&f.newest_vm),
        "{what}: a new commit of the same data does not restore: {:?}",
        got.err()
    );
    repo.close().await.unwrap();
    let repo = open(&f.store).await.unwrap();
    let after = restorable(&repo, f, what).await;
    for id in &before {
        assert!(
            after.contains(id),
            "{what}: repair lost a version that restored"
        );
    }
    // Every version that does not restore is named: lost data, or a record set aside.
    for (id, record, _) in &f.versions {
        if after.contains(id) {
            continue;
        }
        let named = r.lost_versions.iter().any(|l| l.id == *id)
            || r.records_set_aside
                .iter()
                .any(|line| line.contains(&keys::version(id)));
        assert!(
            named,
            "{what}: {}@{} does not restore and repair does not name it: {r:?}",
            record.image, record.seq
        );
    }
    repo.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_damage_is_named_contained_and_healed() {
    for encrypted in [false, true] {
        for (name, prefix, which, op) in cells(encrypted) {
            let what = format!("{name} (encrypted {encrypted})");
            let f = fixture(encrypted).await;
            let kind = of_kind(&f, prefix);
            assert!(!kind.is_empty(), "{what}: no object of kind {prefix}");
            let at = if which < 0 {
                kind.len() - 1
            } else {
                (which as usize).min(kind.len() - 1)
            };
            let other = kind.iter().find(|m| m.key != kind[at].key);
            apply(&f.store, &kind[at], other, op);
            check_cell(&f, &what).await;
        }
        for op in [RefOp::Flip, RefOp::Delete, RefOp::Swap] {
            let what = format!("head ref: {op:?} (encrypted {encrypted})");
            let f = fixture(encrypted).await;
            damage_head(&f.store, op).await;
            check_cell(&f, &what).await;
        }
    }
}

//! Shared helpers for the engine's integration tests.
#![allow(dead_code)]

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cairn_engine::commit::{commit, CommitOptions, CommitResult};
use cairn_engine::restore::{restore, RestoreOptions, RestoreTarget};
use cairn_engine::source::open_path;
use cairn_format::config::RepoConfig;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::tree_walk::{walk_tree, NodeAt, TreeVisitor};
use cairn_repo::{Repo, RepoError};
#[allow(unused_imports)] // not every test file needs them
pub use cairn_store::FailingStore;
#[allow(unused_imports)]
pub use cairn_testkit::engine::commit_bytes;
#[allow(unused_imports)]
pub use cairn_testkit::noise;

/// The passphrase of the encrypted repositories [`init_format2`] makes.
pub const PASSPHRASE: &[u8] = b"correct horse battery staple";

/// A new repository with `config` (format 2), encrypted under [`PASSPHRASE`] with a cheap KDF
/// when `encrypted`.
pub async fn init_format2(
    store: Arc<dyn cairn_store::ObjectStore>,
    config: RepoConfig,
    encrypted: bool,
) -> Arc<Repo> {
    let repo = match encrypted {
        false => Repo::init(store, config).await,
        true => {
            let kdf = cairn_format::crypto::KdfParams {
                memory_kib: 1024,
                passes: 1,
                lanes: 1,
            };
            let pass = zeroize::Zeroizing::new(PASSPHRASE.to_vec());
            Repo::init_encrypted(store, config, pass, kdf).await
        }
    };
    Arc::new(repo.unwrap())
}

/// A format 2 repository's config with `chunk`-byte chunks in `segment`-byte leaves and
/// small (1 MiB) packs, so a test's few MiB span several packs.
pub fn config(chunk: u32, segment: u32) -> RepoConfig {
    RepoConfig {
        repo_id: [1; 16],
        chunk_size: chunk,
        segment_size: segment,
        pack_target: 1 << 20,
        ..RepoConfig::default_v2()
    }
}

/// Flips bits `mask` of the middle byte of object `key` in place (a store's bit rot);
/// returns the good bytes.
pub async fn flip_middle_byte(
    store: &cairn_store::MemoryStore,
    key: &str,
    mask: u8,
) -> bytes::Bytes {
    use cairn_store::ObjectStore;
    let good = store.get(key).await.unwrap();
    let mut bad = good.to_vec();
    let at = bad.len() / 2;
    bad[at] ^= mask;
    store.delete(key).await.unwrap();
    store.put_if_absent(key, bad.into()).await.unwrap();
    good
}

pub fn write_file(dir: &Path, name: &str, data: &[u8]) -> PathBuf {
    let p = dir.join(name);
    File::create(&p).unwrap().write_all(data).unwrap();
    p
}

pub async fn commit_path(repo: &Arc<Repo>, image: &str, path: &Path) -> CommitResult {
    commit(
        repo.clone(),
        image,
        open_path(path).unwrap(),
        CommitOptions::default(),
    )
    .await
    .unwrap()
}

/// Restores to a temporary file and returns its bytes.
pub async fn restore_bytes(repo: &Arc<Repo>, record: &VersionRecord) -> Result<Vec<u8>, String> {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out.raw");
    restore(
        repo.clone(),
        record,
        RestoreTarget::Path(out.clone()),
        RestoreOptions::default(),
    )
    .await
    .map_err(|e| e.to_string())?;
    Ok(std::fs::read(out).unwrap())
}

/// The node ids of a version's tree, in walk order; leaves are listed, not read (a leaf of
/// group runs is the caller's to decode).
pub struct TreeBlobs {
    pub nodes: Vec<Id>,
}

impl TreeVisitor<RepoError> for TreeBlobs {
    fn enter(&mut self, at: &NodeAt) -> bool {
        self.nodes.push(at.id);
        at.level > 0
    }
}

/// Every node of `record`'s tree, read through the repository's tree walker.
pub async fn tree_blobs(repo: &Repo, record: &VersionRecord) -> TreeBlobs {
    let mut blobs = TreeBlobs { nodes: Vec::new() };
    if let Some(root) = record.root {
        let mut reader = repo;
        walk_tree(&mut reader, root, record.height, record.fanout, &mut blobs)
            .await
            .unwrap();
    }
    blobs
}

/// Reopens a repository [`init_format2`] made (plain or encrypted) as a new process would:
/// the old handle is closed first (which writes its quarantine markers).
pub async fn reopen_format2(
    store: Arc<dyn cairn_store::ObjectStore>,
    old: &Arc<Repo>,
) -> Arc<Repo> {
    old.close().await.unwrap();
    let pass = cairn_repo::GivenPassphrase(zeroize::Zeroizing::new(PASSPHRASE.to_vec()));
    Arc::new(
        Repo::open_cached(store, cairn_repo::SessionKind::Commit, None, Some(&pass))
            .await
            .unwrap(),
    )
}

/// Commits `n` versions of `image`: 3 MiB of noise (`seed`), eight 4 KiB blocks changed
/// before each commit. Returns each version's id, record and bytes, oldest first.
pub async fn changing_versions(
    repo: &Arc<Repo>,
    image: &str,
    seed: u64,
    n: u64,
) -> Vec<(Id, VersionRecord, Vec<u8>)> {
    let mut data = noise(3 << 20, seed);
    let mut out = Vec::new();
    for v in 0..n {
        for k in 0..8 {
            let at = ((v * 8 + k) * 97 % 700) as usize * 4096;
            data[at..at + 4096].copy_from_slice(&noise(4096, seed * 1000 + v * 8 + k));
        }
        let c = commit_bytes(repo, image, data.clone()).await;
        out.push((c.id, c.record, data.clone()));
    }
    out
}

/// What `record`'s leaves use, read from the tree: (groups' slots with a reference per leaf
/// occurrence per run, leaf ids).
pub async fn used_by_tree(
    repo: &Arc<Repo>,
    record: &cairn_format::version::VersionRecord,
) -> (
    cairn_format::group_summary::GroupSummary,
    Vec<cairn_format::Id>,
) {
    let leaves = cairn_engine::tree::leaf_map(repo, record).await.unwrap();
    let mut used = cairn_format::group_summary::SummaryBuilder::counted();
    for leaf in leaves.values() {
        let raw = repo.read_blob(leaf).await.unwrap();
        for (group, first, count) in cairn_format::leaf_v2::RunLeaf::decode(&raw)
            .unwrap()
            .group_runs()
        {
            used.add_run(&group, first, count);
        }
    }
    (used.finish().unwrap(), leaves.into_values().collect())
}

/// `record`'s reference summary, and what its tree uses (`used_by_tree`).
pub async fn summary_and_use(
    repo: &Arc<Repo>,
    record: &cairn_format::version::VersionRecord,
) -> (
    cairn_format::group_summary::GroupSummary,
    cairn_format::group_summary::GroupSummary,
    Vec<cairn_format::Id>,
) {
    let root = record.root.unwrap();
    let (summary, _) = repo.load_group_summary(&root).await.unwrap().unwrap();
    let (used, leaves) = used_by_tree(repo, record).await;
    (summary, used, leaves)
}

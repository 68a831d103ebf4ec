//! Shared helpers for the engine's integration tests.
#![allow(dead_code)]

use std::fs::File;
use std::io::Write;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use cairn_engine::commit::{commit, CommitOptions, CommitResult};
use cairn_engine::restore::{restore, RestoreOptions, RestoreTarget};
use cairn_engine::source::{open_path, StreamSource};
use cairn_format::config::{Chunker, Compression, RepoConfig};
use cairn_format::version::VersionRecord;
use cairn_repo::Repo;
use cairn_store::{
    CasOutcome, ObjectMeta, ObjectStore, PutOutcome, RefState, RefVersion, StoreError, StoreResult,
};

pub fn config(chunk: u32, segment: u32) -> RepoConfig {
    RepoConfig {
        repo_id: [1; 16],
        chunker: Chunker::Fixed,
        chunk_size: chunk,
        segment_size: segment,
        fanout: 256,
        compression: Compression::Zstd { level: 3 },
        pack_target: 1 << 20,
        created_ns: 0,
        summary_bits: 24,
    }
}

/// Deterministic pseudo-random bytes.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
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

pub async fn commit_bytes(repo: &Arc<Repo>, image: &str, data: Vec<u8>) -> CommitResult {
    let src = StreamSource::new("test", std::io::Cursor::new(data));
    commit(repo.clone(), image, Box::new(src), CommitOptions::default())
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

/// A store that fails every write after `allowed` successful object writes: a disk that
/// fills up or a server that dies mid-commit.
#[derive(Debug)]
pub struct FailingStore {
    pub inner: Arc<dyn ObjectStore>,
    pub allowed: AtomicUsize,
}

impl FailingStore {
    pub fn new(inner: Arc<dyn ObjectStore>, allowed: usize) -> Self {
        FailingStore {
            inner,
            allowed: AtomicUsize::new(allowed),
        }
    }
    fn spend(&self, key: &str) -> StoreResult<()> {
        let ok = self
            .allowed
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if ok {
            Ok(())
        } else {
            Err(StoreError::Unavailable {
                location: format!("test store ({key})"),
                reason: "injected failure: no space left".into(),
            })
        }
    }
}

#[async_trait]
impl ObjectStore for FailingStore {
    fn describe(&self) -> String {
        self.inner.describe()
    }
    async fn put_if_absent(&self, key: &str, data: Bytes) -> StoreResult<PutOutcome> {
        self.spend(key)?;
        self.inner.put_if_absent(key, data).await
    }
    async fn get(&self, key: &str) -> StoreResult<Bytes> {
        self.inner.get(key).await
    }
    async fn get_range(&self, key: &str, range: Range<u64>) -> StoreResult<Bytes> {
        self.inner.get_range(key, range).await
    }
    async fn head(&self, key: &str) -> StoreResult<Option<u64>> {
        self.inner.head(key).await
    }
    async fn list(&self, prefix: &str) -> StoreResult<Vec<ObjectMeta>> {
        self.inner.list(prefix).await
    }
    async fn delete(&self, key: &str) -> StoreResult<()> {
        self.spend(key)?;
        self.inner.delete(key).await
    }
    async fn read_ref(&self, key: &str) -> StoreResult<Option<RefState>> {
        self.inner.read_ref(key).await
    }
    async fn list_refs(&self, prefix: &str) -> StoreResult<Vec<String>> {
        self.inner.list_refs(prefix).await
    }
    async fn cas_ref(
        &self,
        key: &str,
        expected: Option<&RefVersion>,
        new: Option<Bytes>,
    ) -> StoreResult<CasOutcome> {
        self.spend(key)?;
        self.inner.cas_ref(key, expected, new).await
    }
}

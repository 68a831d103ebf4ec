//! A wrapper that counts what passes through another store: read requests, bytes read and
//! bytes written. For measuring metadata reads in tests and benchmarks (e.g. that a diff of
//! two versions reads only the manifest nodes on the paths to the changed leaves).

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::Bytes;

use crate::{
    CasOutcome, ObjectMeta, ObjectStore, PutOutcome, RefState, RefVersion, StagedFile, StoreHints,
    StoreResult,
};

/// An [`ObjectStore`] that delegates everything to `inner` and counts:
/// - [`reads`](Self::reads): `get` and `get_range` requests (failed ones included);
/// - [`bytes_read`](Self::bytes_read): bytes those requests returned;
/// - [`bytes_written`](Self::bytes_written): payloads of `put_if_absent` calls that created
///   an object;
/// - [`take_keys_read`](Self::take_keys_read): the keys those read requests named, in order.
///
/// Refs, listings and `head` are passed through uncounted.
#[derive(Debug)]
pub struct CountingStore {
    inner: Arc<dyn ObjectStore>,
    reads: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    keys_read: Mutex<Vec<String>>,
}

impl CountingStore {
    pub fn new(inner: Arc<dyn ObjectStore>) -> Self {
        CountingStore {
            inner,
            reads: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            bytes_written: AtomicU64::new(0),
            keys_read: Mutex::new(Vec::new()),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }

    /// Bytes returned by `get` and `get_range` since creation or the last [`reset`](Self::reset).
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read.load(Ordering::Relaxed)
    }

    /// `get` and `get_range` requests since creation or the last reset.
    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// Bytes of objects created by `put_if_absent` since creation or the last reset.
    pub fn bytes_written(&self) -> u64 {
        self.bytes_written.load(Ordering::Relaxed)
    }

    /// The keys of `get` and `get_range` requests since creation or the last reset or take,
    /// in order; the log starts empty again.
    pub fn take_keys_read(&self) -> Vec<String> {
        std::mem::take(&mut *self.keys_read.lock().expect("key log lock"))
    }

    /// Sets every counter back to zero and empties the key log.
    pub fn reset(&self) {
        self.reads.store(0, Ordering::Relaxed);
        self.bytes_read.store(0, Ordering::Relaxed);
        self.bytes_written.store(0, Ordering::Relaxed);
        self.take_keys_read();
    }

    fn count_read(&self, key: &str, result: &StoreResult<Bytes>) {
        self.keys_read
            .lock()
            .expect("key log lock")
            .push(key.to_string());
        self.reads.fetch_add(1, Ordering::Relaxed);
        if let Ok(data) = result {
            self.bytes_read
                .fetch_add(data.len() as u64, Ordering::Relaxed);
        }
    }
}

#[async_trait]
impl ObjectStore for CountingStore {
    fn hints(&self) -> StoreHints {
        self.inner.hints()
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    async fn put_if_absent(&self, key: &str, data: Bytes) -> StoreResult<PutOutcome> {
        let len = data.len() as u64;
        let outcome = self.inner.put_if_absent(key, data).await?;
        if outcome == PutOutcome::Created {
            self.bytes_written.fetch_add(len, Ordering::Relaxed);
        }
        Ok(outcome)
    }

    async fn stage(&self, prefix: &str) -> StoreResult<Option<StagedFile>> {
        self.inner.stage(prefix).await
    }

    async fn publish_staged(&self, key: &str, staged: &mut StagedFile) -> StoreResult<PutOutcome> {
        let len = staged.len()?;
        let outcome = self.inner.publish_staged(key, staged).await?;
        if outcome == PutOutcome::Created {
            self.bytes_written.fetch_add(len, Ordering::Relaxed);
        }
        Ok(outcome)
    }

    async fn get(&self, key: &str) -> StoreResult<Bytes> {
        let result = self.inner.get(key).await;
        self.count_read(key, &result);
        result
    }

    async fn get_range(&self, key: &str, range: Range<u64>) -> StoreResult<Bytes> {
        let result = self.inner.get_range(key, range).await;
        self.count_read(key, &result);
        result
    }

    async fn head(&self, key: &str) -> StoreResult<Option<u64>> {
        self.inner.head(key).await
    }

    async fn list(&self, prefix: &str) -> StoreResult<Vec<ObjectMeta>> {
        self.inner.list(prefix).await
    }

    async fn list_keys(&self, prefix: &str) -> StoreResult<Vec<String>> {
        self.inner.list_keys(prefix).await
    }

    async fn delete(&self, key: &str) -> StoreResult<()> {
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
        self.inner.cas_ref(key, expected, new).await
    }

    async fn forget_deleted_refs(&self, prefix: &str) -> StoreResult<usize> {
        self.inner.forget_deleted_refs(prefix).await
    }

    async fn remove_stale_temporaries(
        &self,
        before: std::time::SystemTime,
    ) -> StoreResult<(u64, u64)> {
        self.inner.remove_stale_temporaries(before).await
    }

    async fn replenish_reserve(&self) -> StoreResult<bool> {
        self.inner.replenish_reserve().await
    }
    async fn check_reachable(&self) -> StoreResult<()> {
        self.inner.check_reachable().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryStore;

    #[tokio::test]
    async fn counts_reads_and_created_writes() {
        let store = CountingStore::new(Arc::new(MemoryStore::new()));
        let put = |k: &'static str, v: &'static [u8]| store.put_if_absent(k, Bytes::from_static(v));
        assert_eq!(put("a", b"hello").await.unwrap(), PutOutcome::Created);
        assert_eq!(put("a", b"other").await.unwrap(), PutOutcome::AlreadyExists);
        assert_eq!(put("b", b"xy").await.unwrap(), PutOutcome::Created);
        assert_eq!(store.bytes_written(), 7, "only created objects count");
        assert_eq!((store.reads(), store.bytes_read()), (0, 0));

        assert_eq!(&store.get("a").await.unwrap()[..], b"hello");
        assert_eq!(&store.get_range("a", 1..3).await.unwrap()[..], b"el");
        assert!(store.get("missing").await.is_err());
        assert!(store.get_range("b", 0..9).await.is_err());
        assert_eq!(store.head("a").await.unwrap(), Some(5));
        assert_eq!(store.list("").await.unwrap().len(), 2);
        assert_eq!(store.reads(), 4, "failed reads are requests too");
        assert_eq!(store.bytes_read(), 7);

        store.reset();
        assert_eq!(
            (store.reads(), store.bytes_read(), store.bytes_written()),
            (0, 0, 0)
        );
        store.get("b").await.unwrap();
        assert_eq!((store.reads(), store.bytes_read()), (1, 2));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn passes_the_conformance_suite() {
        let store = CountingStore::new(Arc::new(MemoryStore::new()));
        crate::conformance::run_all(&store).await;
        assert!(store.reads() > 0 && store.bytes_written() > 0);
    }
}

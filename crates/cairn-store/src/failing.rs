//! A wrapper that lets a number of writes through and then fails every write: a disk that
//! fills up or a server that dies mid-commit, for fault-injection tests. Optionally the writes
//! it lets through land late, even when their caller has given up: a server that finishes a
//! request whose body it had received; and an object can vanish after a number of reads, as
//! if another process (a GC) deleted it between two reads of one caller.

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use bytes::Bytes;

use crate::{
    CasOutcome, ObjectMeta, ObjectStore, PutOutcome, RefState, RefVersion, StagedFile, StoreError,
    StoreHints, StoreResult,
};

/// An [`ObjectStore`] that delegates to `inner` but fails every write (`put_if_absent`,
/// `delete`, `cas_ref`) once `allowed` writes have succeeded, with
/// [`StoreError::Unavailable`]. Reads pass, except of an object made to vanish
/// ([`vanish_after`](Self::vanish_after)). [`allow`](Self::allow) sets the budget again (the
/// disk was freed, the server came back).
#[derive(Debug)]
pub struct FailingStore {
    inner: Arc<dyn ObjectStore>,
    allowed: AtomicUsize,
    landing_delay: Option<Duration>,
    vanishing: Mutex<Option<Vanishing>>,
}

/// An object that reads find `reads_left` more times, then not at all.
#[derive(Debug)]
struct Vanishing {
    key: String,
    reads_left: usize,
    reads: usize,
}

impl FailingStore {
    pub fn new(inner: Arc<dyn ObjectStore>, allowed: usize) -> Self {
        FailingStore {
            inner,
            allowed: AtomicUsize::new(allowed),
            landing_delay: None,
            vanishing: Mutex::new(None),
        }
    }

    /// `get` and `get_range` of `key` find it `reads` times more, then answer
    /// [`StoreError::NotFound`] (the object stays in the inner store).
    pub fn vanish_after(&self, key: &str, reads: usize) {
        *self.vanishing.lock().expect("not poisoned") = Some(Vanishing {
            key: key.to_owned(),
            reads_left: reads,
            reads: 0,
        });
    }

    /// Reads asked of the vanishing object so far, found or not.
    pub fn vanishing_reads(&self) -> usize {
        self.vanishing
            .lock()
            .expect("not poisoned")
            .as_ref()
            .map_or(0, |v| v.reads)
    }

    /// Whether a read of `key` finds nothing because the object vanished.
    fn vanished(&self, key: &str) -> bool {
        let mut guard = self.vanishing.lock().expect("not poisoned");
        let Some(v) = guard.as_mut().filter(|v| v.key == key) else {
            return false;
        };
        v.reads += 1;
        match v.reads_left.checked_sub(1) {
            Some(left) => {
                v.reads_left = left;
                false
            }
            None => true,
        }
    }

    /// Each `put_if_absent` let through lands `delay` later, in a task of its own: it lands
    /// even if the caller drops the call meanwhile, as a server finishes a request whose body
    /// it had received after the client gave up.
    pub fn with_landing_delay(mut self, delay: Duration) -> Self {
        self.landing_delay = Some(delay);
        self
    }

    /// Lets `n` more writes through from now on.
    pub fn allow(&self, n: usize) {
        self.allowed.store(n, Ordering::SeqCst);
    }

    /// Writes still allowed.
    pub fn allowed(&self) -> usize {
        self.allowed.load(Ordering::SeqCst)
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
    fn hints(&self) -> StoreHints {
        self.inner.hints()
    }
    async fn put_if_absent(&self, key: &str, data: Bytes) -> StoreResult<PutOutcome> {
        self.spend(key)?;
        let Some(delay) = self.landing_delay else {
            return self.inner.put_if_absent(key, data).await;
        };
        let (inner, key) = (self.inner.clone(), key.to_owned());
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            inner.put_if_absent(&key, data).await
        })
        .await
        .map_err(|e| StoreError::Unavailable {
            location: "test store".into(),
            reason: format!("landing task: {e}"),
        })?
    }
    async fn stage(&self, prefix: &str) -> StoreResult<Option<StagedFile>> {
        self.inner.stage(prefix).await
    }
    async fn publish_staged(&self, key: &str, staged: &mut StagedFile) -> StoreResult<PutOutcome> {
        if self.landing_delay.is_none() {
            self.spend(key)?;
            return self.inner.publish_staged(key, staged).await;
        }
        // Landing late needs the bytes in a task of its own: copied, as a server holds a body.
        let outcome = self
            .put_if_absent(key, Bytes::from(staged.read_all()?))
            .await?;
        if outcome == PutOutcome::Created {
            staged.set_published();
        }
        Ok(outcome)
    }
    async fn get(&self, key: &str) -> StoreResult<Bytes> {
        if self.vanished(key) {
            return Err(StoreError::not_found(key));
        }
        self.inner.get(key).await
    }
    async fn get_range(&self, key: &str, range: Range<u64>) -> StoreResult<Bytes> {
        if self.vanished(key) {
            return Err(StoreError::not_found(key));
        }
        self.inner.get_range(key, range).await
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
    async fn forget_deleted_refs(&self, prefix: &str) -> StoreResult<usize> {
        self.inner.forget_deleted_refs(prefix).await
    }
    async fn remove_stale_temporaries(&self, before: SystemTime) -> StoreResult<(u64, u64)> {
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
    async fn fails_writes_past_the_budget_and_never_reads() {
        let store = FailingStore::new(Arc::new(MemoryStore::new()), 1);
        store
            .put_if_absent("a", Bytes::from_static(b"1"))
            .await
            .unwrap();
        let err = store
            .put_if_absent("b", Bytes::from_static(b"2"))
            .await
            .unwrap_err();
        assert!(matches!(err, StoreError::Unavailable { .. }), "{err}");
        assert!(store.head("b").await.unwrap().is_none(), "nothing written");
        assert_eq!(store.get("a").await.unwrap(), Bytes::from_static(b"1"));
        store.allow(1);
        store
            .put_if_absent("b", Bytes::from_static(b"2"))
            .await
            .unwrap();
        assert_eq!(store.allowed(), 0);
    }

    #[tokio::test]
    async fn a_vanishing_object_is_found_as_many_times_as_told_then_not() {
        let store = FailingStore::new(Arc::new(MemoryStore::new()), 2);
        for key in ["a", "b"] {
            store
                .put_if_absent(key, Bytes::from_static(b"12"))
                .await
                .unwrap();
        }
        store.vanish_after("a", 1);
        assert_eq!(store.get("a").await.unwrap(), Bytes::from_static(b"12"));
        let err = store.get_range("a", 0..1).await.unwrap_err();
        assert!(matches!(err, StoreError::NotFound { .. }), "{err}");
        assert!(store.get("a").await.is_err());
        assert_eq!(store.get("b").await.unwrap(), Bytes::from_static(b"12"));
        assert_eq!(store.vanishing_reads(), 3);
    }
}

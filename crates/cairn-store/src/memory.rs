//! An in-memory store for tests of the layers above, with fault injection.

use std::collections::BTreeMap;
use std::fmt;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use async_trait::async_trait;
use bytes::Bytes;

use crate::key::{validate_object_key, validate_prefix, validate_ref_key};
use crate::{
    CasOutcome, ObjectMeta, ObjectStore, PutOutcome, RefState, RefVersion, StoreError, StoreResult,
};

/// An [`ObjectStore`] held in memory, with the same semantics as the durable backends.
///
/// Ref versions come from a counter, so every write gets a fresh version even when the
/// content repeats; callers must not assume versions are content hashes.
#[derive(Default)]
pub struct MemoryStore {
    objects: Mutex<BTreeMap<String, Bytes>>,
    refs: Mutex<BTreeMap<String, RefState>>,
    next_version: AtomicU64,
}

/// A poisoned lock only means another test thread panicked; the maps are still consistent
/// because every critical section is a single map operation.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Flip the lowest bit of byte `offset` of an object, to test that upper layers detect
    /// corruption. Panics if the object does not exist or is too short: this is a test
    /// helper and a wrong call is a bug in the test.
    pub fn corrupt_object(&self, key: &str, offset: usize) {
        let mut objects = lock(&self.objects);
        let data = objects
            .get_mut(key)
            .unwrap_or_else(|| panic!("corrupt_object: no object {key:?}"));
        assert!(
            offset < data.len(),
            "corrupt_object: offset {offset} is past the end of {key:?} ({} bytes)",
            data.len()
        );
        let mut bytes = data.to_vec();
        bytes[offset] ^= 1;
        *data = Bytes::from(bytes);
    }

    /// Cut an object down to its first `len` bytes, to simulate a torn write. Panics if the
    /// object does not exist or is shorter than `len`.
    pub fn truncate_object(&self, key: &str, len: usize) {
        let mut objects = lock(&self.objects);
        let data = objects
            .get_mut(key)
            .unwrap_or_else(|| panic!("truncate_object: no object {key:?}"));
        assert!(
            len <= data.len(),
            "truncate_object: {key:?} has only {} bytes, cannot truncate to {len}",
            data.len()
        );
        data.truncate(len);
    }

    /// Flip the lowest bit of byte `offset` of a ref's value (bit rot in a head or tag).
    /// Panics if the ref does not exist or is too short.
    pub fn corrupt_ref(&self, key: &str, offset: usize) {
        let mut refs = lock(&self.refs);
        let state = refs
            .get_mut(key)
            .unwrap_or_else(|| panic!("corrupt_ref: no ref {key:?}"));
        assert!(
            offset < state.data.len(),
            "corrupt_ref: offset past the end"
        );
        let mut bytes = state.data.to_vec();
        bytes[offset] ^= 1;
        state.data = Bytes::from(bytes);
    }

    fn fresh_version(&self) -> RefVersion {
        RefVersion(format!(
            "m{}",
            self.next_version.fetch_add(1, Ordering::Relaxed)
        ))
    }
}

impl fmt::Debug for MemoryStore {
    // Not derived: dumping every object's bytes would drown any assertion message.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MemoryStore")
            .field("objects", &lock(&self.objects).len())
            .field("refs", &lock(&self.refs).len())
            .finish()
    }
}

#[async_trait]
impl ObjectStore for MemoryStore {
    fn describe(&self) -> String {
        format!("memory:{:p}", self)
    }

    async fn put_if_absent(&self, key: &str, data: Bytes) -> StoreResult<PutOutcome> {
        validate_object_key(key)?;
        let mut objects = lock(&self.objects);
        if objects.contains_key(key) {
            return Ok(PutOutcome::AlreadyExists);
        }
        objects.insert(key.to_owned(), data);
        Ok(PutOutcome::Created)
    }

    async fn get(&self, key: &str) -> StoreResult<Bytes> {
        validate_object_key(key)?;
        lock(&self.objects)
            .get(key)
            .cloned()
            .ok_or_else(|| StoreError::not_found(key))
    }

    async fn get_range(&self, key: &str, range: Range<u64>) -> StoreResult<Bytes> {
        let data = self.get(key).await?;
        let size = data.len() as u64;
        if range.start > range.end || range.end > size {
            return Err(StoreError::RangeOutOfBounds {
                key: key.to_owned(),
                start: range.start,
                end: range.end,
                size,
            });
        }
        // Both bounds are <= data.len(), so they fit in usize.
        Ok(data.slice(range.start as usize..range.end as usize))
    }

    async fn head(&self, key: &str) -> StoreResult<Option<u64>> {
        validate_object_key(key)?;
        Ok(lock(&self.objects).get(key).map(|d| d.len() as u64))
    }

    async fn list(&self, prefix: &str) -> StoreResult<Vec<ObjectMeta>> {
        validate_prefix(prefix)?;
        Ok(lock(&self.objects)
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| ObjectMeta {
                key: k.clone(),
                size: v.len() as u64,
            })
            .collect())
    }

    async fn delete(&self, key: &str) -> StoreResult<()> {
        validate_object_key(key)?;
        lock(&self.objects).remove(key);
        Ok(())
    }

    async fn read_ref(&self, key: &str) -> StoreResult<Option<RefState>> {
        validate_ref_key(key)?;
        Ok(lock(&self.refs).get(key).cloned())
    }

    async fn list_refs(&self, prefix: &str) -> StoreResult<Vec<String>> {
        validate_prefix(prefix)?;
        Ok(lock(&self.refs)
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .map(|(k, _)| k.clone())
            .collect())
    }

    async fn cas_ref(
        &self,
        key: &str,
        expected: Option<&RefVersion>,
        new: Option<Bytes>,
    ) -> StoreResult<CasOutcome> {
        validate_ref_key(key)?;
        let mut refs = lock(&self.refs);
        let current = refs.get(key);
        if current.map(|s| &s.version) != expected {
            return Ok(CasOutcome::Conflict {
                current: current.cloned(),
            });
        }
        let Some(data) = new else {
            refs.remove(key);
            return Ok(CasOutcome::Swapped { version: None });
        };
        let version = self.fresh_version();
        refs.insert(
            key.to_owned(),
            RefState {
                data,
                version: version.clone(),
            },
        );
        Ok(CasOutcome::Swapped {
            version: Some(version),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn fault_injection_changes_what_get_returns() {
        let store = MemoryStore::new();
        store
            .put_if_absent("k", Bytes::from_static(b"\x00abc"))
            .await
            .unwrap();
        store.corrupt_object("k", 0);
        assert_eq!(&store.get("k").await.unwrap()[..], b"\x01abc");
        store.truncate_object("k", 2);
        assert_eq!(&store.get("k").await.unwrap()[..], b"\x01a");
        assert_eq!(store.head("k").await.unwrap(), Some(2));
    }

    #[test]
    #[should_panic(expected = "no object")]
    fn corrupting_a_missing_object_panics() {
        MemoryStore::new().corrupt_object("missing", 0);
    }

    #[test]
    fn debug_does_not_dump_contents() {
        let s = format!("{:?}", MemoryStore::new());
        assert_eq!(s, "MemoryStore { objects: 0, refs: 0 }");
    }
}

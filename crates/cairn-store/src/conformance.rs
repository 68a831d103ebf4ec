//! The behavioural contract of [`ObjectStore`], as executable checks.
//!
//! Every backend (memory, local directory, later S3) runs [`run_all`] in its tests, so the
//! layers above can rely on the trait documentation rather than on one backend's quirks.
//! It is compiled in normal builds so other crates' tests can run it against their wrappers.
//!
//! All keys live under a fresh random prefix (`conformance-<hex>/`), so the suite can run
//! against a shared bucket, and every check removes what it created.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use bytes::Bytes;
use rand::RngCore;

use crate::{CasOutcome, ObjectMeta, ObjectStore, PutOutcome, RefVersion, StoreError, StoreResult};

mod concurrency;
mod objects;
mod refs;

use self::concurrency::{check_concurrent_cas, check_concurrent_put};
use self::objects::{
    check_delete, check_get_range, check_head, check_invalid_keys, check_list, check_put_get,
    check_staged,
};
use self::refs::check_refs;

/// Number of concurrent workers in the concurrency checks.
const WORKERS: usize = 8;
/// Increments per worker in the compare-and-swap check.
const INCREMENTS: usize = 25;

/// Run every check against `store`, panicking with a message naming the store and the
/// failed expectation on the first failure.
pub async fn run_all(store: &dyn ObjectStore) {
    let ctx = Ctx {
        store,
        prefix: format!("conformance-{}/", hex::encode(rand::random::<[u8; 8]>())),
    };
    assert!(!store.describe().is_empty(), "describe() is empty");
    check_put_get(&ctx).await;
    check_staged(&ctx).await;
    check_get_range(&ctx).await;
    check_head(&ctx).await;
    check_list(&ctx).await;
    check_delete(&ctx).await;
    check_invalid_keys(&ctx).await;
    check_refs(&ctx).await;
    check_concurrent_cas(&ctx).await;
    check_concurrent_put(&ctx).await;
    let left = ctx.ok(store.list(&ctx.prefix).await, "final list");
    assert!(
        left.is_empty(),
        "{}: objects left behind: {left:?}",
        ctx.name()
    );
    let left = ctx.ok(store.list_refs(&ctx.prefix).await, "final list_refs");
    assert!(
        left.is_empty(),
        "{}: refs left behind: {left:?}",
        ctx.name()
    );
}

struct Ctx<'a> {
    store: &'a dyn ObjectStore,
    prefix: String,
}

impl Ctx<'_> {
    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    fn name(&self) -> String {
        format!("conformance of {}", self.store.describe())
    }

    fn ok<T>(&self, result: StoreResult<T>, what: &str) -> T {
        result.unwrap_or_else(|e| panic!("{}: {what} failed: {e}", self.name()))
    }

    async fn put(&self, key: &str, data: impl Into<Bytes>) -> PutOutcome {
        let result = self.store.put_if_absent(key, data.into()).await;
        self.ok(result, &format!("put_if_absent({key})"))
    }

    async fn get(&self, key: &str) -> Bytes {
        self.ok(self.store.get(key).await, &format!("get({key})"))
    }

    async fn delete(&self, key: &str) {
        self.ok(self.store.delete(key).await, &format!("delete({key})"));
    }

    async fn list(&self, prefix: &str) -> Vec<ObjectMeta> {
        let found = self.ok(self.store.list(prefix).await, &format!("list({prefix})"));
        let sorted = found.windows(2).all(|w| w[0].key < w[1].key);
        assert!(
            sorted,
            "{}: list({prefix}) not sorted: {found:?}",
            self.name()
        );
        let keys = self.ok(
            self.store.list_keys(prefix).await,
            &format!("list_keys({prefix})"),
        );
        let listed: Vec<&str> = found.iter().map(|m| m.key.as_str()).collect();
        assert_eq!(
            keys,
            listed,
            "{}: list_keys({prefix}) differs from list",
            self.name()
        );
        found
    }

    async fn cas(&self, key: &str, expected: Option<&RefVersion>, new: Option<&str>) -> CasOutcome {
        let new = new.map(|s| Bytes::copy_from_slice(s.as_bytes()));
        let result = self.store.cas_ref(key, expected, new).await;
        self.ok(result, &format!("cas_ref({key})"))
    }

    /// A cas that must swap; returns the new version.
    async fn swap(
        &self,
        key: &str,
        expected: Option<&RefVersion>,
        new: Option<&str>,
    ) -> Option<RefVersion> {
        match self.cas(key, expected, new).await {
            CasOutcome::Swapped { version } => version,
            other => panic!("{}: cas_ref({key}) should swap, got {other:?}", self.name()),
        }
    }
}

fn random_bytes(len: usize) -> Bytes {
    let mut data = vec![0u8; len];
    rand::thread_rng().fill_bytes(&mut data);
    Bytes::from(data)
}

type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Drive `futures` concurrently to completion. The store is borrowed (not `'static`), so the
/// workers cannot be spawned as tasks; they interleave at every await instead, and backends
/// that do real work off-thread (like the local store) overlap for real.
async fn join_all<'a, T: Send>(futures: Vec<BoxFuture<'a, T>>) -> Vec<T> {
    let mut pending: Vec<Option<BoxFuture<'a, T>>> = futures.into_iter().map(Some).collect();
    let mut results: Vec<Option<T>> = pending.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut busy = false;
        for (slot, result) in pending.iter_mut().zip(results.iter_mut()) {
            if let Some(fut) = slot {
                match fut.as_mut().poll(cx) {
                    Poll::Ready(value) => {
                        *result = Some(value);
                        *slot = None;
                    }
                    Poll::Pending => busy = true,
                }
            }
        }
        if busy {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
    .await;
    results.into_iter().flatten().collect()
}

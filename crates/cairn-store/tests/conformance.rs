//! Every backend in this crate must pass the shared conformance suite.

use cairn_store::{conformance, LocalStore, MemoryStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_store_conforms() {
    conformance::run_all(&MemoryStore::new()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn local_store_conforms() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::create(dir.path().join("repo")).unwrap();
    conformance::run_all(&store).await;
}

#[tokio::test]
async fn local_store_conforms_on_a_current_thread_runtime() {
    let dir = tempfile::tempdir().unwrap();
    conformance::run_all(&LocalStore::create(dir.path()).unwrap()).await;
}

/// The suite's future must be `Send` so callers can spawn it on a multi-threaded runtime.
#[test]
fn run_all_future_is_send() {
    fn assert_send<T: Send>(_: &T) {}
    let store = MemoryStore::new();
    let fut = conformance::run_all(&store);
    assert_send(&fut);
}

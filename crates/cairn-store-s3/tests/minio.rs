//! The store conformance suite against a real S3-compatible server.
//!
//! Needs `CAIRN_TEST_S3_URL` (`s3://BUCKET/PREFIX?endpoint=...&path_style=true`) and the
//! `AWS_*` credentials; `scripts/minio.sh run cargo test -p cairn-store-s3 --test minio`
//! provides both. Without them the tests print a skip line and pass, unless
//! `CAIRN_REQUIRE_S3=1`, when they fail.

use bytes::Bytes;
use cairn_store::{CasOutcome, ObjectStore, StoreError};
use cairn_store_s3::S3Store;

fn store() -> Option<S3Store> {
    let Some(url) = std::env::var("CAIRN_TEST_S3_URL")
        .ok()
        .filter(|u| !u.is_empty())
    else {
        if std::env::var("CAIRN_REQUIRE_S3").as_deref() == Ok("1") {
            panic!(
                "CAIRN_REQUIRE_S3=1 but CAIRN_TEST_S3_URL is unset: run under \
                 scripts/minio.sh run ..."
            );
        }
        eprintln!("skipped: CAIRN_TEST_S3_URL is unset (scripts/minio.sh run ... sets it)");
        return None;
    };
    Some(S3Store::open(&url).unwrap_or_else(|e| panic!("opening {url}: {e}")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conformance() {
    let Some(store) = store() else { return };
    cairn_store::conformance::run_all(&store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn tombstones_of_never_reused_keys_can_be_removed() {
    let Some(store) = store() else { return };
    let prefix = format!("sess-{}/", rand_hex());
    let mut versions = Vec::new();
    for n in 0..3 {
        let key = format!("{prefix}{n}");
        match store
            .cas_ref(&key, None, Some(Bytes::from("live")))
            .await
            .unwrap()
        {
            CasOutcome::Swapped { version: Some(v) } => versions.push((key, v)),
            other => panic!("{other:?}"),
        }
    }
    for (key, v) in &versions[..2] {
        let r = store.cas_ref(key, Some(v), None).await.unwrap();
        assert_eq!(r, CasOutcome::Swapped { version: None });
    }
    assert_eq!(store.forget_deleted_refs(&prefix).await.unwrap(), 2);
    assert_eq!(store.forget_deleted_refs(&prefix).await.unwrap(), 0);
    let live = format!("{prefix}2");
    assert_eq!(store.list_refs(&prefix).await.unwrap(), vec![live.clone()]);
    assert_eq!(
        &store.read_ref(&live).await.unwrap().unwrap().data[..],
        b"live"
    );
    // A removed tombstone's key can be created again from scratch.
    let again = store
        .cas_ref(&versions[0].0, None, Some(Bytes::from("x")))
        .await
        .unwrap();
    assert!(matches!(again, CasOutcome::Swapped { version: Some(_) }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ref_tombstones_are_invisible_and_reusable() {
    let Some(store) = store() else { return };
    let key = format!("tomb-{}/head", rand_hex());
    let v1 = match store
        .cas_ref(&key, None, Some(Bytes::from("a")))
        .await
        .unwrap()
    {
        CasOutcome::Swapped { version: Some(v) } => v,
        other => panic!("{other:?}"),
    };
    let deleted = store.cas_ref(&key, Some(&v1), None).await.unwrap();
    assert_eq!(deleted, CasOutcome::Swapped { version: None });
    assert_eq!(store.read_ref(&key).await.unwrap(), None);
    assert!(store.list_refs(&key).await.unwrap().is_empty());
    // Deleting an absent ref with expected = None swaps (as on the local store).
    let again = store.cas_ref(&key, None, None).await.unwrap();
    assert_eq!(again, CasOutcome::Swapped { version: None });
    // Re-creating over the tombstone works, once.
    let v2 = match store
        .cas_ref(&key, None, Some(Bytes::from("b")))
        .await
        .unwrap()
    {
        CasOutcome::Swapped { version: Some(v) } => v,
        other => panic!("{other:?}"),
    };
    match store
        .cas_ref(&key, None, Some(Bytes::from("c")))
        .await
        .unwrap()
    {
        CasOutcome::Conflict { current: Some(s) } => assert_eq!(s.version, v2),
        other => panic!("{other:?}"),
    }
    assert_eq!(
        store.list_refs(&key).await.unwrap(),
        std::slice::from_ref(&key)
    );
    // Empty values would read as deleted: refused.
    let err = store
        .cas_ref(&key, Some(&v2), Some(Bytes::new()))
        .await
        .unwrap_err();
    assert!(matches!(err, StoreError::Remote { .. }), "{err}");
    store.cas_ref(&key, Some(&v2), None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn errors_name_the_key_and_hide_the_secret() {
    let Some(store) = store() else { return };
    let secret = std::env::var("AWS_SECRET_ACCESS_KEY").unwrap_or_default();
    assert!(!format!("{store:?} {}", store.describe()).contains(&secret));
    // A bucket that does not exist: every request fails; the message is one line.
    let url = std::env::var("CAIRN_TEST_S3_URL").unwrap();
    let (_, rest) = url.split_once("://").unwrap();
    let (bucket, _) = rest.split_once('/').unwrap();
    let bad = S3Store::open(&url.replacen(bucket, "no-such-bucket-cairn", 1)).unwrap();
    let err = bad.get("some/key").await.unwrap_err();
    let msg = err.to_string();
    assert!(!msg.contains('\n'), "{msg}");
    assert!(msg.contains("some/key"), "{msg}");
    assert!(secret.is_empty() || !msg.contains(&secret), "{msg}");
    let err = bad
        .put_if_absent("x", Bytes::from("y"))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        !err.contains('\n') && (secret.is_empty() || !err.contains(&secret)),
        "{err}"
    );
}

fn rand_hex() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("{nanos:x}")
}

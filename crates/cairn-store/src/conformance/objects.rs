//! Checks of immutable objects: put, get, ranges, head, list, delete, key validation.

use super::*;

pub(super) async fn check_put_get(ctx: &Ctx<'_>) {
    let cases = [
        ("empty", Bytes::new()),
        ("one", Bytes::from_static(&[0x42])),
        ("big", random_bytes(5 << 20)),
    ];
    for (name, data) in cases {
        let key = ctx.key(&format!("put/{name}"));
        assert_eq!(
            ctx.put(&key, data.clone()).await,
            PutOutcome::Created,
            "{}: first put of {key}",
            ctx.name()
        );
        assert!(
            ctx.get(&key).await == data,
            "{}: get({key}) differs from what was put",
            ctx.name()
        );
        let other = [&data[..], b"different"].concat();
        assert_eq!(
            ctx.put(&key, other).await,
            PutOutcome::AlreadyExists,
            "{}: second put of {key}",
            ctx.name()
        );
        assert!(
            ctx.get(&key).await == data,
            "{}: second put changed {key}",
            ctx.name()
        );
        ctx.delete(&key).await;
    }
}

pub(super) async fn check_get_range(ctx: &Ctx<'_>) {
    let key = ctx.key("range/obj");
    let data = random_bytes(100_000);
    let size = data.len() as u64;
    ctx.put(&key, data.clone()).await;
    for range in [
        0..0,
        0..size,
        size..size,
        size - 1..size,
        0..1,
        10..20,
        4096..70_000,
    ] {
        let got = ctx.ok(
            ctx.store.get_range(&key, range.clone()).await,
            &format!("get_range({key}, {range:?})"),
        );
        let want = &data[range.start as usize..range.end as usize];
        assert!(
            got == want,
            "{}: get_range({key}, {range:?}) returned wrong bytes",
            ctx.name()
        );
    }
    for range in [
        0..size + 1,
        size..size + 1,
        size + 1..size + 1,
        50..size * 2,
    ] {
        match ctx.store.get_range(&key, range.clone()).await {
            Err(StoreError::RangeOutOfBounds {
                key: k,
                start,
                end,
                size: s,
            }) if k == key && start == range.start && end == range.end && s == size => {}
            other => panic!(
                "{}: get_range({key}, {range:?}) should be RangeOutOfBounds, got {other:?}",
                ctx.name()
            ),
        }
    }
    let (start, end) = (20, 10);
    let reversed = ctx.store.get_range(&key, start..end).await;
    assert!(
        reversed.is_err(),
        "{}: reversed range {start}..{end} accepted",
        ctx.name()
    );
    let missing = ctx.key("range/missing");
    match ctx.store.get(&missing).await {
        Err(StoreError::NotFound { key: k }) if k == missing => {}
        other => panic!(
            "{}: get of missing key should be NotFound, got {other:?}",
            ctx.name()
        ),
    }
    match ctx.store.get_range(&missing, 0..0).await {
        Err(StoreError::NotFound { key: k }) if k == missing => {}
        other => panic!(
            "{}: get_range of missing key should be NotFound, got {other:?}",
            ctx.name()
        ),
    }
    ctx.delete(&key).await;
}

pub(super) async fn check_head(ctx: &Ctx<'_>) {
    let (key, empty, missing) = (
        ctx.key("head/obj"),
        ctx.key("head/empty"),
        ctx.key("head/missing"),
    );
    ctx.put(&key, &b"abc"[..]).await;
    ctx.put(&empty, Bytes::new()).await;
    for (k, want) in [(&key, Some(3)), (&empty, Some(0)), (&missing, None)] {
        let got = ctx.ok(ctx.store.head(k).await, &format!("head({k})"));
        assert_eq!(got, want, "{}: head({k})", ctx.name());
    }
    ctx.delete(&key).await;
    ctx.delete(&empty).await;
}

pub(super) async fn check_list(ctx: &Ctx<'_>) {
    let names = [
        "list/a",
        "list/b/c",
        "list/b/d",
        "list/ba",
        "list-other/x",
        "listx",
    ];
    for (i, name) in names.iter().enumerate() {
        ctx.put(&ctx.key(name), vec![7u8; i + 1]).await;
    }
    let ref_key = ctx.key("list/ref");
    ctx.swap(&ref_key, None, Some("not an object")).await;
    let expect = |prefix: &str, want: &[(&str, u64)]| {
        let want: Vec<ObjectMeta> = want
            .iter()
            .map(|(k, size)| ObjectMeta {
                key: ctx.key(k),
                size: *size,
            })
            .collect();
        (ctx.key(prefix), want)
    };
    let cases = [
        expect(
            "list/",
            &[
                ("list/a", 1),
                ("list/b/c", 2),
                ("list/b/d", 3),
                ("list/ba", 4),
            ],
        ),
        expect(
            "list/b",
            &[("list/b/c", 2), ("list/b/d", 3), ("list/ba", 4)],
        ),
        expect("list/b/", &[("list/b/c", 2), ("list/b/d", 3)]),
        expect("list/b/c", &[("list/b/c", 2)]),
        expect("list/nope/", &[]),
        expect(
            "list",
            &[
                ("list-other/x", 5),
                ("list/a", 1),
                ("list/b/c", 2),
                ("list/b/d", 3),
                ("list/ba", 4),
                ("listx", 6),
            ],
        ),
        expect(
            "",
            &[
                ("list-other/x", 5),
                ("list/a", 1),
                ("list/b/c", 2),
                ("list/b/d", 3),
                ("list/ba", 4),
                ("listx", 6),
            ],
        ),
    ];
    for (prefix, want) in cases {
        assert_eq!(
            ctx.list(&prefix).await,
            want,
            "{}: list({prefix})",
            ctx.name()
        );
    }
    ctx.delete(&ctx.key("list/b/c")).await;
    let after = ctx.list(&ctx.key("list/b/")).await;
    let want = vec![ObjectMeta {
        key: ctx.key("list/b/d"),
        size: 3,
    }];
    assert_eq!(after, want, "{}: list after delete", ctx.name());
    for name in names {
        ctx.delete(&ctx.key(name)).await;
    }
    let version = ctx
        .ok(ctx.store.read_ref(&ref_key).await, "read_ref")
        .map(|s| s.version);
    ctx.swap(&ref_key, version.as_ref(), None).await;
}

pub(super) async fn check_delete(ctx: &Ctx<'_>) {
    let key = ctx.key("delete/obj");
    ctx.put(&key, &b"x"[..]).await;
    ctx.delete(&key).await;
    ctx.delete(&key).await;
    ctx.delete(&ctx.key("delete/never-existed")).await;
    assert_eq!(
        ctx.ok(ctx.store.head(&key).await, "head"),
        None,
        "{}: head after delete",
        ctx.name()
    );
    let got = ctx.store.get(&key).await;
    assert!(
        matches!(got, Err(StoreError::NotFound { .. })),
        "{}: get after delete: {got:?}",
        ctx.name()
    );
    assert_eq!(
        ctx.put(&key, &b"y"[..]).await,
        PutOutcome::Created,
        "{}: put after delete",
        ctx.name()
    );
    assert!(
        ctx.get(&key).await == b"y"[..],
        "{}: content after re-put",
        ctx.name()
    );
    ctx.delete(&key).await;
}

fn assert_invalid<T: std::fmt::Debug>(ctx: &Ctx<'_>, op: &str, key: &str, result: StoreResult<T>) {
    match result {
        Err(StoreError::InvalidKey { key: k, .. }) if k == key => {}
        other => panic!(
            "{}: {op}({key:?}) should be InvalidKey, got {other:?}",
            ctx.name()
        ),
    }
}

pub(super) async fn check_invalid_keys(ctx: &Ctx<'_>) {
    let store = ctx.store;
    for key in [
        "", "/a", "a/", "a//b", "a/../b", "a/./b", "..", "a\nb", "a b",
    ] {
        assert_invalid(
            ctx,
            "put_if_absent",
            key,
            store.put_if_absent(key, Bytes::new()).await,
        );
        assert_invalid(ctx, "get", key, store.get(key).await);
        assert_invalid(ctx, "get_range", key, store.get_range(key, 0..0).await);
        assert_invalid(ctx, "head", key, store.head(key).await);
        assert_invalid(ctx, "delete", key, store.delete(key).await);
        assert_invalid(ctx, "read_ref", key, store.read_ref(key).await);
        assert_invalid(
            ctx,
            "cas_ref",
            key,
            store.cas_ref(key, None, Some(Bytes::new())).await,
        );
    }
    let key = "refs/x";
    assert_invalid(
        ctx,
        "put_if_absent",
        key,
        store.put_if_absent(key, Bytes::new()).await,
    );
    assert_invalid(ctx, "get", key, store.get(key).await);
    assert_invalid(ctx, "head", key, store.head(key).await);
    assert_invalid(ctx, "delete", key, store.delete(key).await);
    for prefix in ["../", "a/../", "/x", "a b"] {
        assert_invalid(ctx, "list", prefix, store.list(prefix).await);
        assert_invalid(ctx, "list_refs", prefix, store.list_refs(prefix).await);
    }
}

/// A store that stages (the local one) publishes a staged file's bytes exactly, never over
/// an existing object, and leaves no temporary behind; one that does not says `None`.
pub(super) async fn check_staged(ctx: &Ctx<'_>) {
    use std::io::Write;
    let prefix = ctx.key("staged/");
    let Some(mut staged) = ctx.ok(ctx.store.stage(&prefix).await, "stage") else {
        return;
    };
    let data = random_bytes(3 << 20);
    let (head, tail) = data.split_at(1000);
    staged.write_all(head).unwrap();
    staged.write_all(tail).unwrap();
    let key = ctx.key("staged/ab/obj");
    let outcome = ctx.ok(ctx.store.publish_staged(&key, &mut staged).await, "publish");
    assert_eq!(
        outcome,
        PutOutcome::Created,
        "{}: publish {key}",
        ctx.name()
    );
    drop(staged);
    assert!(
        ctx.get(&key).await == data,
        "{}: a published staged file differs from what was written",
        ctx.name()
    );
    // A second staged file for the same key is refused and left for its owner.
    let mut other = ctx.ok(ctx.store.stage(&prefix).await, "stage").unwrap();
    other.write_all(b"different").unwrap();
    let outcome = ctx.ok(ctx.store.publish_staged(&key, &mut other).await, "publish");
    assert_eq!(
        outcome,
        PutOutcome::AlreadyExists,
        "{}: republish",
        ctx.name()
    );
    other.write_at(0, b"D").unwrap();
    drop(other);
    assert!(
        ctx.get(&key).await == data,
        "{}: republish changed it",
        ctx.name()
    );
    let listed: Vec<String> = ctx
        .ok(ctx.store.list(&prefix).await, "list")
        .into_iter()
        .map(|m| m.key)
        .collect();
    assert_eq!(listed, vec![key.clone()], "{}: staged listing", ctx.name());
    ctx.delete(&key).await;
}

//! Checks of ref compare-and-swap semantics.

use super::*;

pub(super) async fn check_refs(ctx: &Ctx<'_>) {
    let (head, other, sibling) = (
        ctx.key("refs-check/head"),
        ctx.key("refs-check/other"),
        ctx.key("refs-check2/x"),
    );
    let read = |key: String| async move {
        ctx.ok(ctx.store.read_ref(&key).await, &format!("read_ref({key})"))
    };
    assert_eq!(
        read(head.clone()).await,
        None,
        "{}: read_ref of missing ref",
        ctx.name()
    );

    let v1 = ctx
        .swap(&head, None, Some("v1"))
        .await
        .unwrap_or_else(|| panic!("{}: create returned no version", ctx.name()));
    let state = read(head.clone())
        .await
        .unwrap_or_else(|| panic!("{}: ref missing after create", ctx.name()));
    assert_eq!(
        (&state.data[..], &state.version),
        (&b"v1"[..], &v1),
        "{}: read after create",
        ctx.name()
    );
    match ctx.cas(&head, None, Some("v1b")).await {
        CasOutcome::Conflict { current: Some(cur) } if cur == state => {}
        other => panic!(
            "{}: create over existing ref should conflict with v1, got {other:?}",
            ctx.name()
        ),
    }

    let v2 = ctx
        .swap(&head, Some(&v1), Some("v2"))
        .await
        .unwrap_or_else(|| panic!("{}: swap returned no version", ctx.name()));
    let state = read(head.clone()).await;
    assert_eq!(
        state.as_ref().map(|s| (&s.data[..], &s.version)),
        Some((&b"v2"[..], &v2)),
        "{}: read after swap",
        ctx.name()
    );
    match ctx.cas(&head, Some(&v1), Some("v3")).await {
        CasOutcome::Conflict { current: Some(cur) }
            if cur.data == b"v2"[..] && cur.version == v2 => {}
        other => panic!(
            "{}: stale swap should conflict with v2, got {other:?}",
            ctx.name()
        ),
    }

    ctx.swap(&other, None, Some("o")).await;
    ctx.swap(&sibling, None, Some("s")).await;
    let list = |prefix: String| async move {
        ctx.ok(
            ctx.store.list_refs(&prefix).await,
            &format!("list_refs({prefix})"),
        )
    };
    assert_eq!(
        list(ctx.key("refs-check/")).await,
        [head.clone(), other.clone()],
        "{}: list_refs",
        ctx.name()
    );
    assert_eq!(
        list(ctx.key("refs-check")).await,
        [head.clone(), other.clone(), sibling.clone()],
        "{}: list_refs",
        ctx.name()
    );
    assert_eq!(
        list(ctx.key("refs-check/o")).await,
        std::slice::from_ref(&other),
        "{}: list_refs",
        ctx.name()
    );

    match ctx.cas(&head, Some(&v1), None).await {
        CasOutcome::Conflict { current: Some(cur) } if cur.version == v2 => {}
        other => panic!(
            "{}: stale delete should conflict, got {other:?}",
            ctx.name()
        ),
    }
    assert_eq!(
        ctx.swap(&head, Some(&v2), None).await,
        None,
        "{}: delete returns no version",
        ctx.name()
    );
    assert_eq!(
        read(head.clone()).await,
        None,
        "{}: read_ref after delete",
        ctx.name()
    );
    match ctx.cas(&head, Some(&v2), None).await {
        CasOutcome::Conflict { current: None } => {}
        other => panic!(
            "{}: delete of deleted ref should conflict with None, got {other:?}",
            ctx.name()
        ),
    }
    assert_eq!(
        list(ctx.key("refs-check/")).await,
        std::slice::from_ref(&other),
        "{}: list_refs after delete",
        ctx.name()
    );

    for key in [other, sibling] {
        let version = read(key.clone()).await.map(|s| s.version);
        ctx.swap(&key, version.as_ref(), None).await;
    }
}

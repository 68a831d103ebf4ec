//! Checks that concurrent writers never lose updates or mix contents.

use super::*;

pub(super) async fn check_concurrent_cas(ctx: &Ctx<'_>) {
    let key = ctx.key("cas/counter");
    ctx.swap(&key, None, Some("0")).await;
    let worker = |_: usize| -> BoxFuture<'_, ()> {
        let key = key.clone();
        Box::pin(async move {
            for _ in 0..INCREMENTS {
                for attempt in 0.. {
                    assert!(attempt < 100_000, "{}: cas_ref never succeeds", ctx.name());
                    let state = ctx.ok(ctx.store.read_ref(&key).await, "read_ref(counter)");
                    let state =
                        state.unwrap_or_else(|| panic!("{}: counter ref vanished", ctx.name()));
                    let n: u64 = std::str::from_utf8(&state.data)
                        .ok()
                        .and_then(|s| s.parse().ok())
                        .unwrap_or_else(|| {
                            panic!("{}: counter holds garbage {:?}", ctx.name(), state.data)
                        });
                    // Let the other workers read the same state, so swaps really collide.
                    tokio::task::yield_now().await;
                    let next = (n + 1).to_string();
                    if let CasOutcome::Swapped { .. } =
                        ctx.cas(&key, Some(&state.version), Some(&next)).await
                    {
                        break;
                    }
                }
            }
        })
    };
    join_all((0..WORKERS).map(worker).collect()).await;
    let state = ctx.ok(ctx.store.read_ref(&key).await, "read_ref(counter)");
    let state = state.unwrap_or_else(|| panic!("{}: counter ref vanished", ctx.name()));
    let want = (WORKERS * INCREMENTS).to_string();
    assert_eq!(
        &state.data[..],
        want.as_bytes(),
        "{}: lost updates in concurrent cas_ref",
        ctx.name()
    );
    ctx.swap(&key, Some(&state.version), None).await;
}

pub(super) async fn check_concurrent_put(ctx: &Ctx<'_>) {
    let key = ctx.key("race/obj");
    let payload = |i: usize| Bytes::from(vec![i as u8; 256 * 1024]);
    let racer = |i: usize| -> BoxFuture<'_, PutOutcome> {
        let key = key.clone();
        Box::pin(async move { ctx.put(&key, payload(i)).await })
    };
    let outcomes = join_all((0..WORKERS).map(racer).collect()).await;
    let created: Vec<usize> = (0..WORKERS)
        .filter(|&i| outcomes[i] == PutOutcome::Created)
        .collect();
    assert_eq!(
        created.len(),
        1,
        "{}: racing puts: {outcomes:?}",
        ctx.name()
    );
    assert!(
        ctx.get(&key).await == payload(created[0]),
        "{}: racing puts mixed content",
        ctx.name()
    );
    ctx.delete(&key).await;
}

//! cairn-repo's own tests of the protocols it owns, over the in-memory store and two
//! repository handles standing for two processes: the GC lock, heads and tags by
//! compare-and-swap, deletion markers, session kinds and liveness.

use std::sync::Arc;
use std::time::Duration;

use cairn_format::config::RepoConfig;
use cairn_format::Id;
use cairn_repo::session::{liveness, now_ns, Liveness};
use cairn_repo::{GcLockAttempt, Repo, RepoError, SessionKind};
use cairn_store::MemoryStore;

const STALE: Duration = Duration::from_secs(600);

/// A repository and two handles on it with sessions of their own.
async fn two_processes() -> (Repo, Repo) {
    let store = Arc::new(MemoryStore::new());
    Repo::init(store.clone(), RepoConfig::default())
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    let a = Repo::open_as(store.clone(), SessionKind::Gc).await.unwrap();
    let b = Repo::open_as(store, SessionKind::Gc).await.unwrap();
    (a, b)
}

#[tokio::test]
async fn one_gc_holds_the_lock_and_a_dead_holder_loses_it() {
    let (a, b) = two_processes().await;
    let GcLockAttempt::Taken(lock) = a.take_gc_lock(STALE).await.unwrap() else {
        panic!("the first GC must get the lock");
    };
    match b.take_gc_lock(STALE).await.unwrap() {
        GcLockAttempt::HeldBy(who) => assert!(who.starts_with("gc (pid "), "{who}"),
        other => panic!("a second GC got {other:?}"),
    }
    a.release_gc_lock(lock).await;
    let GcLockAttempt::Taken(lock) = b.take_gc_lock(STALE).await.unwrap() else {
        panic!("a released lock must be free");
    };
    // Judged with stale_after = 0, every heartbeat is too old: the holder is dead and the
    // lock is taken over.
    let GcLockAttempt::Taken(taken_over) = a.take_gc_lock(Duration::ZERO).await.unwrap() else {
        panic!("the lock of a dead GC must be taken over");
    };
    a.release_gc_lock(taken_over).await;
    b.release_gc_lock(lock).await; // no longer its own: must not free a's lock (already free)
    let GcLockAttempt::Taken(lock) = b.take_gc_lock(STALE).await.unwrap() else {
        panic!("the lock must be free after both releases");
    };
    b.release_gc_lock(lock).await;
}

#[tokio::test]
async fn heads_move_only_from_the_state_the_writer_saw() {
    let (a, b) = two_processes().await;
    let (v1, v2) = (Id::of(b"v1"), Id::of(b"v2"));
    assert!(a.swap_head("vm", None, &v1).await.unwrap());
    assert!(
        !b.swap_head("vm", None, &v2).await.unwrap(),
        "a head that exists is not created again"
    );
    let seen = b.head("vm").await.unwrap().unwrap();
    assert_eq!(seen.version, v1);
    assert!(b.swap_head("vm", Some(&seen), &v2).await.unwrap());
    assert!(
        !a.swap_head("vm", Some(&seen), &v1).await.unwrap(),
        "a stale token must lose"
    );
    assert_eq!(a.head("vm").await.unwrap().unwrap().version, v2);
    assert_eq!(a.images().await.unwrap(), ["vm"]);
    assert!(a.head("other").await.unwrap().is_none());
}

#[tokio::test]
async fn tags_never_move_silently() {
    let (a, b) = two_processes().await;
    let (v1, v2) = (Id::of(b"v1"), Id::of(b"v2"));
    a.create_tag("vm", "golden", &v1).await.unwrap();
    let again = b.create_tag("vm", "golden", &v2).await.unwrap_err();
    assert_eq!(
        again.to_string(),
        "tag \"golden\" of image \"vm\" already exists (delete it first)"
    );
    assert!(matches!(again, RepoError::Exists(_)), "{again:?}");
    assert_eq!(b.tag("vm", "golden").await.unwrap(), Some(v1));
    a.create_tag("vm", "beta", &v2).await.unwrap();
    assert_eq!(
        b.tags("vm").await.unwrap(),
        [("beta".to_string(), v2), ("golden".to_string(), v1)]
    );
    b.delete_tag("vm", "golden").await.unwrap();
    assert_eq!(a.tag("vm", "golden").await.unwrap(), None);
    let missing = a.delete_tag("vm", "golden").await.unwrap_err();
    assert!(matches!(missing, RepoError::NotFound(_)), "{missing:?}");
    assert_eq!(missing.to_string(), "image \"vm\" has no tag \"golden\"");
    assert!(matches!(
        a.create_tag("vm", "12", &v1).await,
        Err(RepoError::BadInput(_))
    ));
}

#[tokio::test]
async fn deletion_markers_are_seen_by_every_process() {
    let (a, b) = two_processes().await;
    let (v1, v2) = (Id::of(b"v1"), Id::of(b"v2"));
    a.mark_deleted(&v1).await.unwrap();
    a.mark_deleted(&v1).await.unwrap(); // idempotent
    let deleted = b.deleted_versions().await.unwrap();
    assert!(deleted.contains(&v1) && !deleted.contains(&v2));
    assert_eq!(deleted.len(), 1);
}

#[test]
fn session_kinds_round_trip_and_gc_waits_for_all_but_exports() {
    for kind in SessionKind::ALL {
        assert_eq!(SessionKind::parse(kind.name()), Some(kind));
        assert_eq!(
            SessionKind::gc_waits_for(kind.name()),
            kind != SessionKind::Export,
            "{kind}"
        );
    }
    // A kind written by a newer cairn is waited for: not knowing it must never make GC
    // delete under it.
    assert_eq!(SessionKind::parse("compact"), None);
    assert!(SessionKind::gc_waits_for("compact"));
    let readers: Vec<_> = SessionKind::ALL
        .into_iter()
        .filter(|k| k.only_reads())
        .collect();
    assert_eq!(
        readers,
        [
            SessionKind::Read,
            SessionKind::Restore,
            SessionKind::Verify,
            SessionKind::Export
        ]
    );
}

#[tokio::test]
async fn a_session_is_dead_without_heartbeats_or_once_its_process_exits() {
    let (a, _b) = two_processes().await;
    let me = a.session_key().unwrap();
    let sessions = a.sessions().await.unwrap();
    let (_, mine) = sessions.iter().find(|(k, _)| *k == me).unwrap();
    let mine = mine.clone().unwrap();
    assert_eq!(mine.pid, std::process::id());
    assert_eq!(mine.kind, "gc");
    let now = now_ns();
    assert_eq!(liveness(&mine, now, STALE), Liveness::Alive);
    let later = mine.heartbeat_ns + STALE.as_nanos() as i64 + 1_000_000_000;
    assert!(
        matches!(liveness(&mine, later, STALE), Liveness::Dead(ref why) if why.starts_with("no heartbeat for ")),
        "{:?}",
        liveness(&mine, later, STALE)
    );

    // The same host and namespace, a process that has exited: dead at once, whatever the
    // heartbeat says.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    let mut gone = mine.clone();
    gone.pid = pid;
    assert_eq!(
        liveness(&gone, now, STALE),
        Liveness::Dead(format!("process {pid} has exited"))
    );
}

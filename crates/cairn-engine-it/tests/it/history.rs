//! Version history: clone (O(1)), tags, removing versions and images, retention and prune.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use crate::common::*;
use cairn_engine::clone::clone_version;
use cairn_engine::remove::{remove_image, remove_versions};
use cairn_engine::resolve::{history, origin, resolve, VersionSpec};
use cairn_engine::retention::{
    days_from_civil, plan_retention, plan_retention_named, prune, KeepPolicy, RetentionDecision,
};
use cairn_engine::EngineError;
use cairn_format::refs;
use cairn_format::version::{CommitStats, VersionRecord};
use cairn_format::Id;
use cairn_repo::Repo;
use cairn_store::{CountingStore, MemoryStore, ObjectStore};

const MIB: u64 = 1 << 20;

async fn memory_repo() -> Arc<Repo> {
    Arc::new(
        Repo::init(Arc::new(MemoryStore::new()), config(16 << 10, 1 << 20))
            .await
            .unwrap(),
    )
}

fn spec(s: &str) -> VersionSpec {
    VersionSpec::parse(s).unwrap()
}

async fn resolve_err(repo: &Repo, s: &str) -> String {
    resolve(repo, &spec(s)).await.unwrap_err().to_string()
}

async fn seqs(repo: &Repo, image: &str) -> Vec<u64> {
    history(repo, image)
        .await
        .unwrap()
        .iter()
        .map(|(_, r)| r.seq)
        .collect()
}

/// Sum of the sizes of every object in the store.
async fn stored_total(store: &dyn ObjectStore) -> u64 {
    store.list("").await.unwrap().iter().map(|m| m.size).sum()
}

/// Three versions of "vm" with different content; returns the contents, oldest first.
async fn three_versions(repo: &Arc<Repo>) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    for seed in 1..=3u64 {
        let data = noise(300_000, seed);
        commit_bytes(repo, "vm", data.clone()).await;
        out.push(data);
    }
    out
}

// ---- clone ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clone_writes_one_small_record_whatever_the_image_size() {
    let counting = Arc::new(CountingStore::new(Arc::new(MemoryStore::new())));
    let repo = Arc::new(
        Repo::init(counting.clone(), config(16 << 10, 1 << 20))
            .await
            .unwrap(),
    );
    // A 2 GiB sparse image with 8 MiB of data spread over 512 segments: a height-2 tree.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("big.raw");
    let f = File::create(&path).unwrap();
    f.set_len(2 << 30).unwrap();
    for i in 0..512u64 {
        f.write_all_at(&noise(16 << 10, i), i * 4 * MIB + 8192)
            .unwrap();
    }
    drop(f);
    let source = commit_path(&repo, "base", &path).await;
    assert!(source.record.height >= 2);
    assert!(source.record.stats.stored_bytes > 8 * MIB);

    counting.reset();
    let before = stored_total(counting.inner().as_ref()).await;
    let (id, clone) = clone_version(&repo, &spec("base@1"), "web01/disk0", None)
        .await
        .unwrap();
    let written = counting.bytes_written();
    let grown = stored_total(counting.inner().as_ref()).await - before;
    assert!(written < 4096, "clone wrote {written} bytes");
    assert_eq!(grown, written, "only the version record is new");
    assert_eq!(written, clone.encode().len() as u64);

    // The record: seq 1, the source as parent, the same tree, figures copied.
    let src = &source.record;
    assert_eq!(clone.image, "web01/disk0");
    assert_eq!(clone.seq, 1);
    assert_eq!(clone.parent, Some(source.id));
    assert_eq!(
        (
            clone.root,
            clone.height,
            clone.segment_size,
            clone.fanout,
            clone.logical_size
        ),
        (
            src.root,
            src.height,
            src.segment_size,
            src.fanout,
            src.logical_size
        )
    );
    assert_eq!(
        clone.stats,
        CommitStats {
            data_bytes: src.stats.data_bytes,
            chunks: src.stats.chunks,
            new_chunks: 0,
            new_chunk_bytes: 0,
            stored_bytes: clone.encode().len() as u64 + refs::encode(&Id::ZERO).len() as u64,
        }
    );
    assert_eq!(clone.message, "clone of base@1");
    assert_eq!(repo.load_version(&id).await.unwrap(), clone);
    assert_eq!(repo.head("web01/disk0").await.unwrap().unwrap().version, id);

    // Its history is its own; its origin is the source.
    let h = history(&repo, "web01/disk0").await.unwrap();
    assert_eq!(h, vec![(id, clone.clone())]);
    let (oid, orec) = origin(&repo, "web01/disk0").await.unwrap().unwrap();
    assert_eq!((oid, orec.image.as_str(), orec.seq), (source.id, "base", 1));
    assert!(origin(&repo, "base").await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clone_restores_like_its_source_and_evolves_on_its_own() {
    let repo = memory_repo().await;
    let contents = three_versions(&repo).await;
    let (_, clone) = clone_version(&repo, &spec("vm@2"), "web", Some("from two".into()))
        .await
        .unwrap();
    assert_eq!(clone.message, "from two");
    assert_eq!(restore_bytes(&repo, &clone).await.unwrap(), contents[1]);

    let next = commit_bytes(&repo, "web", noise(300_000, 9)).await;
    assert_eq!(
        (next.record.seq, next.record.parent),
        (2, resolve(&repo, &spec("web@1")).await.ok().map(|v| v.0))
    );
    assert_eq!(seqs(&repo, "web").await, vec![2, 1]);
    assert_eq!(seqs(&repo, "vm").await, vec![3, 2, 1]);
    let (oid, _) = origin(&repo, "web").await.unwrap().unwrap();
    assert_eq!(oid, resolve(&repo, &spec("vm@2")).await.unwrap().0);

    // The clone outlives its source image.
    remove_image(&repo, "vm").await.unwrap();
    assert_eq!(restore_bytes(&repo, &clone).await.unwrap(), contents[1]);
    let (_, orec) = origin(&repo, "web").await.unwrap().unwrap();
    assert_eq!((orec.image.as_str(), orec.seq), ("vm", 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clone_refuses_existing_and_bad_names() {
    let repo = memory_repo().await;
    three_versions(&repo).await;
    commit_bytes(&repo, "other", noise(1000, 5)).await;
    let err = clone_version(&repo, &spec("vm"), "other", None)
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "image \"other\" already exists");
    let err = clone_version(&repo, &spec("vm"), "vm", None)
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), "image \"vm\" already exists");
    let err = clone_version(&repo, &spec("vm"), "../x", None)
        .await
        .unwrap_err();
    assert!(err.to_string().starts_with("invalid image name"), "{err}");
    let err = clone_version(&repo, &spec("vm@9"), "new", None)
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "vm@9: image \"vm\" has no version 9 (its newest is vm@3)"
    );
    assert_eq!(repo.images().await.unwrap(), vec!["other", "vm"]);
}

// ---- tags ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tags_name_versions_and_never_move() {
    let repo = memory_repo().await;
    let contents = three_versions(&repo).await;
    let (id1, _) = resolve(&repo, &spec("vm@1")).await.unwrap();
    let (id3, _) = resolve(&repo, &spec("vm@3")).await.unwrap();
    repo.create_tag("vm", "v1", &id1).await.unwrap();
    repo.create_tag("vm", "latest-ok", &id3).await.unwrap();

    let (id, rec) = resolve(&repo, &spec("vm@v1")).await.unwrap();
    assert_eq!((id, rec.seq), (id1, 1));
    assert_eq!(restore_bytes(&repo, &rec).await.unwrap(), contents[0]);
    assert_eq!(
        repo.tags("vm").await.unwrap(),
        vec![("latest-ok".to_string(), id3), ("v1".to_string(), id1)]
    );

    let err = repo.create_tag("vm", "v1", &id3).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "tag \"v1\" of image \"vm\" already exists (delete it first)"
    );
    assert_eq!(repo.tag("vm", "v1").await.unwrap(), Some(id1), "unchanged");
    assert!(
        repo.create_tag("vm", "42", &id3).await.is_err(),
        "digits are seqs"
    );

    repo.delete_tag("vm", "v1").await.unwrap();
    assert_eq!(repo.tag("vm", "v1").await.unwrap(), None);
    assert_eq!(
        resolve_err(&repo, "vm@v1").await,
        "vm@v1: no tag \"v1\"; a reference is a version number, a tag, or a hex prefix of a version id"
    );
    let err = repo.delete_tag("vm", "v1").await.unwrap_err();
    assert_eq!(err.to_string(), "image \"vm\" has no tag \"v1\"");
    // The version itself is untouched.
    assert_eq!(resolve(&repo, &spec("vm@1")).await.unwrap().0, id1);
}

/// A version record of "vm" for an all-zero, empty image: enough to test naming and retention.
fn empty_record(seq: u64, parent: Option<Id>, time_ns: i64) -> VersionRecord {
    VersionRecord {
        image: "vm".into(),
        seq,
        parent,
        time_ns,
        logical_size: 0,
        root: None,
        height: 1,
        segment_size: 1 << 20,
        fanout: 256,
        stats: CommitStats::default(),
        message: String::new(),
    }
}

/// A hand-made version of "vm" whose id starts with `digits` decimal digits: `time_ns` is
/// counted up from 0 until the hash fits, so the search is the same on every run.
fn version_with_digit_id(seq: u64, parent: Option<Id>, digits: usize) -> (Id, VersionRecord) {
    (0..1_000_000i64)
        .map(|time_ns| empty_record(seq, parent, time_ns))
        .map(|record| (Id::of(&record.encode()), record))
        .find(|(id, _)| id.to_hex()[..digits].bytes().all(|b| b.is_ascii_digit()))
        .expect("one in ~110 ids starts with 10 digits")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_prefix_of_only_digits_names_its_version() {
    let repo = memory_repo().await;
    let (id1, v1) = version_with_digit_id(1, None, 0);
    assert_eq!(repo.put_version(&v1).await.unwrap().0, id1);
    assert!(repo.swap_head("vm", None, &id1).await.unwrap());
    let (id2, v2) = version_with_digit_id(2, Some(id1), 10);
    assert_eq!(repo.put_version(&v2).await.unwrap().0, id2);
    let head = repo.head("vm").await.unwrap();
    assert!(repo.swap_head("vm", head.as_ref(), &id2).await.unwrap());

    // What `log` prints (12 hex digits) and shorter copies of it down to 8 digits.
    let hex = id2.to_hex();
    for len in [12, 10, 8] {
        let (id, record) = resolve(&repo, &spec(&format!("vm@{}", &hex[..len])))
            .await
            .unwrap();
        assert_eq!((id, record.seq), (id2, 2), "prefix of {len}");
    }
    // A sequence number still means the sequence number.
    assert_eq!(resolve(&repo, &spec("vm@2")).await.unwrap().0, id2);
    assert_eq!(resolve(&repo, &spec("vm@1")).await.unwrap().0, id1);
    // Fewer than 8 digits are only ever sequence numbers.
    let seven = &hex[..7];
    assert_eq!(
        resolve_err(&repo, &format!("vm@{seven}")).await,
        format!(
            "vm@{seven}: image \"vm\" has no version {} (its newest is vm@2)",
            seven.parse::<u64>().unwrap()
        )
    );
    // Eight or more digits that are neither a sequence number nor an id prefix.
    let other = if hex.starts_with('9') {
        "88888888"
    } else {
        "99999999"
    };
    assert!(!id1.to_hex().starts_with(other));
    assert_eq!(
        resolve_err(&repo, &format!("vm@{other}")).await,
        format!(
            "vm@{other}: image \"vm\" has no version {other} and no version of it has an id starting with {other}"
        )
    );
}

// ---- rm ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_middle_version_keeps_the_others() {
    let repo = memory_repo().await;
    let contents = three_versions(&repo).await;
    let (id2, _) = resolve(&repo, &spec("vm@2")).await.unwrap();

    let removed = remove_versions(&repo, &[spec("vm@2")]).await.unwrap();
    assert_eq!(removed.len(), 1);
    assert_eq!((removed[0].0, removed[0].1.seq), (id2, 2));

    assert_eq!(seqs(&repo, "vm").await, vec![3, 1]);
    for (n, data) in [(1, &contents[0]), (3, &contents[2])] {
        let (_, r) = resolve(&repo, &spec(&format!("vm@{n}"))).await.unwrap();
        assert_eq!(&restore_bytes(&repo, &r).await.unwrap(), data, "vm@{n}");
    }
    assert_eq!(
        resolve_err(&repo, "vm@2").await,
        format!("vm@2: version vm@2 ({}) was deleted", id2.short())
    );
    assert_eq!(resolve(&repo, &spec("vm")).await.unwrap().1.seq, 3);
    assert!(repo.deleted_versions().await.unwrap().contains(&id2));

    // Removing it again: it no longer resolves.
    assert!(remove_versions(&repo, &[spec("vm@2")]).await.is_err());

    // New commits still continue the numbering.
    let next = commit_bytes(&repo, "vm", noise(1000, 7)).await;
    assert_eq!(next.record.seq, 4);
    assert_eq!(seqs(&repo, "vm").await, vec![4, 3, 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_the_newest_version_falls_back_to_the_previous() {
    let repo = memory_repo().await;
    let contents = three_versions(&repo).await;
    remove_versions(&repo, &[spec("vm@3")]).await.unwrap();
    let (_, r) = resolve(&repo, &spec("vm")).await.unwrap();
    assert_eq!(r.seq, 2);
    assert_eq!(restore_bytes(&repo, &r).await.unwrap(), contents[1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rm_checks_everything_before_changing_anything() {
    let repo = memory_repo().await;
    three_versions(&repo).await;
    let (id1, _) = resolve(&repo, &spec("vm@1")).await.unwrap();
    let (id2, _) = resolve(&repo, &spec("vm@2")).await.unwrap();
    repo.create_tag("vm", "v2.0", &id2).await.unwrap();

    let err = remove_versions(&repo, &[spec("vm@1"), spec("vm@9")])
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "vm@9: image \"vm\" has no version 9 (its newest is vm@3)"
    );
    let err = remove_versions(&repo, &[spec("vm@1"), spec("vm@2")])
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "vm@2 is tagged as v2.0; delete the tag first (`cairn tag --delete vm v2.0`)"
    );
    let err = remove_versions(&repo, &[spec("vm@v2.0")])
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "vm@2 is tagged as v2.0; delete the tag first (`cairn tag --delete vm v2.0`)"
    );
    assert!(repo.deleted_versions().await.unwrap().is_empty());
    assert_eq!(seqs(&repo, "vm").await, vec![3, 2, 1]);

    // Once the tag is gone the version can go; duplicates count once.
    repo.delete_tag("vm", "v2.0").await.unwrap();
    let hex = id1.to_hex();
    let removed = remove_versions(
        &repo,
        &[
            spec("vm@2"),
            spec(&format!("vm@{}", &hex[..10])),
            spec("vm@1"),
        ],
    )
    .await
    .unwrap();
    assert_eq!(
        removed.iter().map(|(_, r)| r.seq).collect::<Vec<_>>(),
        vec![2, 1]
    );
    assert_eq!(seqs(&repo, "vm").await, vec![3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_an_image_drops_its_head_and_is_refused_while_tagged() {
    let repo = memory_repo().await;
    three_versions(&repo).await;
    commit_bytes(&repo, "keep", noise(1000, 4)).await;
    let (id1, _) = resolve(&repo, &spec("vm@1")).await.unwrap();
    repo.create_tag("vm", "v1", &id1).await.unwrap();

    // A tag protects its version from the whole image's removal too: nothing changes.
    let err = remove_image(&repo, "vm").await.unwrap_err();
    assert!(matches!(err, EngineError::Tagged { .. }), "{err:?}");
    assert_eq!(
        err.to_string(),
        "vm@1 is tagged as v1; delete the tag first (`cairn tag --delete vm v1`)"
    );
    assert_eq!(seqs(&repo, "vm").await, vec![3, 2, 1]);
    assert!(repo.deleted_versions().await.unwrap().is_empty());

    repo.delete_tag("vm", "v1").await.unwrap();
    let gone = remove_image(&repo, "vm").await.unwrap();
    assert_eq!(gone.image, "vm");
    assert_eq!(
        gone.versions.iter().map(|(_, r)| r.seq).collect::<Vec<_>>(),
        vec![3, 2, 1]
    );
    assert_eq!(repo.images().await.unwrap(), vec!["keep"]);
    assert!(repo.tags("vm").await.unwrap().is_empty());
    assert_eq!(
        resolve_err(&repo, "vm").await,
        "image \"vm\" does not exist"
    );
    assert_eq!(
        remove_image(&repo, "vm").await.unwrap_err().to_string(),
        "image \"vm\" does not exist"
    );
    // The name can be used again, from scratch.
    let fresh = commit_bytes(&repo, "vm", noise(1000, 8)).await;
    assert_eq!((fresh.record.seq, fresh.record.parent), (1, None));
}

// ---- retention ----

fn at(y: i64, m: u32, d: u32, h: i64) -> i64 {
    (days_from_civil(y, m, d) * 86_400 + h * 3600) * 1_000_000_000
}

/// Hand-made versions of "vm", newest first, seq counting up from the oldest.
fn versions(times: &[i64]) -> Vec<(Id, VersionRecord)> {
    let n = times.len() as u64;
    times
        .iter()
        .enumerate()
        .map(|(i, &time_ns)| {
            let seq = n - i as u64;
            (Id::of(&seq.to_le_bytes()), empty_record(seq, None, time_ns))
        })
        .collect()
}

/// (seq, reasons) of the kept versions, newest first.
fn kept(decisions: &[RetentionDecision]) -> Vec<(u64, Vec<&str>)> {
    decisions
        .iter()
        .filter(|d| d.keep)
        .map(|d| (d.seq, d.reasons.iter().map(String::as_str).collect()))
        .collect()
}

fn sample() -> Vec<(Id, VersionRecord)> {
    versions(&[
        at(2026, 11, 21, 18), // 9: a Saturday, ISO week 47
        at(2026, 11, 21, 9),  // 8
        at(2026, 11, 20, 23), // 7
        at(2026, 11, 19, 12), // 6
        at(2026, 11, 16, 8),  // 5: Monday of week 47
        at(2026, 11, 15, 8),  // 4: Sunday of week 46
        at(2026, 10, 31, 10), // 3
        at(2026, 9, 1, 10),   // 2
        at(2025, 12, 31, 10), // 1: ISO week 2026-W01
    ])
}

#[test]
fn retention_combines_rules_and_lists_every_reason() {
    let v = sample();
    let policy = KeepPolicy {
        last: 1,
        hourly: 2,
        daily: 3,
        weekly: 2,
        monthly: 3,
    };
    let tagged: HashSet<Id> = [v[8].0].into();
    let d = plan_retention(&v, &policy, &tagged);
    assert_eq!(d.len(), 9);
    assert_eq!(
        d.iter().map(|d| d.seq).collect::<Vec<_>>(),
        (1..=9).rev().collect::<Vec<_>>()
    );
    assert_eq!(
        kept(&d),
        vec![
            (
                9,
                vec![
                    "last 1",
                    "hourly 2026-11-21 18",
                    "daily 2026-11-21",
                    "weekly 2026-W47",
                    "monthly 2026-11"
                ]
            ),
            (8, vec!["hourly 2026-11-21 09"]),
            (7, vec!["daily 2026-11-20"]),
            (6, vec!["daily 2026-11-19"]),
            (4, vec!["weekly 2026-W46"]),
            (3, vec!["monthly 2026-10"]),
            (2, vec!["monthly 2026-09"]),
            (1, vec!["tagged"]),
        ]
    );
    let removed: Vec<_> = d.iter().filter(|d| !d.keep).collect();
    assert_eq!(removed.len(), 1);
    assert_eq!((removed[0].seq, removed[0].reasons.len()), (5, 0));

    // With tag names, the reason names the tag.
    let names: HashMap<Id, Vec<String>> = [(v[8].0, vec!["v1.0".to_string()])].into();
    let d = plan_retention_named(&v, &policy, &names);
    assert_eq!(d[8].reasons, vec!["tagged v1.0"]);
}

#[test]
fn retention_rules_one_at_a_time() {
    let v = sample();
    let none = HashSet::new();
    let seqs_kept = |policy: KeepPolicy| -> Vec<u64> {
        plan_retention(&v, &policy, &none)
            .iter()
            .filter(|d| d.keep)
            .map(|d| d.seq)
            .collect()
    };
    assert_eq!(
        seqs_kept(KeepPolicy {
            last: 3,
            ..Default::default()
        }),
        vec![9, 8, 7]
    );
    assert_eq!(
        seqs_kept(KeepPolicy {
            last: 100,
            ..Default::default()
        }),
        (1..=9).rev().collect::<Vec<_>>()
    );
    assert_eq!(
        seqs_kept(KeepPolicy {
            daily: 1,
            ..Default::default()
        }),
        vec![9]
    );
    assert_eq!(
        seqs_kept(KeepPolicy {
            daily: 100,
            ..Default::default()
        }),
        vec![9, 7, 6, 5, 4, 3, 2, 1]
    );
    assert_eq!(
        seqs_kept(KeepPolicy {
            hourly: 100,
            ..Default::default()
        }),
        (1..=9).rev().collect::<Vec<_>>()
    );
    // Weekly buckets across the year boundary: 2025-12-31 belongs to 2026-W01.
    let d = plan_retention(
        &v,
        &KeepPolicy {
            weekly: 10,
            ..Default::default()
        },
        &none,
    );
    assert_eq!(
        kept(&d),
        vec![
            (9, vec!["weekly 2026-W47"]),
            (4, vec!["weekly 2026-W46"]),
            (3, vec!["weekly 2026-W44"]),
            (2, vec!["weekly 2026-W36"]),
            (1, vec!["weekly 2026-W01"]),
        ]
    );
    assert_eq!(
        seqs_kept(KeepPolicy {
            monthly: 10,
            ..Default::default()
        }),
        vec![9, 3, 2, 1]
    );
    // Nothing but tags survives an empty policy (the CLI refuses it).
    assert!(seqs_kept(KeepPolicy::default()).is_empty());
    assert!(KeepPolicy::default().is_empty());
    assert!(plan_retention(
        &[],
        &KeepPolicy {
            last: 1,
            ..Default::default()
        },
        &none
    )
    .is_empty());
}

#[test]
fn weeks_at_the_turn_of_2020() {
    let v = versions(&[
        at(2021, 1, 4, 0),   // 3: 2021-W01
        at(2021, 1, 3, 23),  // 2: 2020-W53
        at(2020, 12, 31, 0), // 1: 2020-W53 as well
    ]);
    let d = plan_retention(
        &v,
        &KeepPolicy {
            weekly: 5,
            ..Default::default()
        },
        &HashSet::new(),
    );
    assert_eq!(
        kept(&d),
        vec![(3, vec!["weekly 2021-W01"]), (2, vec!["weekly 2020-W53"])]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_keep_last_marks_the_rest_deleted() {
    let repo = memory_repo().await;
    let mut contents = three_versions(&repo).await;
    let data = noise(300_000, 4);
    commit_bytes(&repo, "vm", data.clone()).await;
    contents.push(data);
    let (id2, _) = resolve(&repo, &spec("vm@2")).await.unwrap();
    repo.create_tag("vm", "golden", &id2).await.unwrap();
    let policy = KeepPolicy {
        last: 1,
        ..Default::default()
    };

    let dry = prune(&repo, "vm", &policy, true).await.unwrap();
    let summary = |d: &[RetentionDecision]| {
        d.iter()
            .map(|d| (d.seq, d.keep, d.reasons.join(",")))
            .collect::<Vec<_>>()
    };
    let expected = vec![
        (4, true, "last 1".to_string()),
        (3, false, String::new()),
        (2, true, "tagged golden".to_string()),
        (1, false, String::new()),
    ];
    assert_eq!(summary(&dry), expected);
    assert!(repo.deleted_versions().await.unwrap().is_empty(), "dry run");
    assert_eq!(seqs(&repo, "vm").await, vec![4, 3, 2, 1]);

    let done = prune(&repo, "vm", &policy, false).await.unwrap();
    assert_eq!(summary(&done), expected);
    assert_eq!(seqs(&repo, "vm").await, vec![4, 2]);
    assert_eq!(repo.deleted_versions().await.unwrap().len(), 2);
    for (n, data) in [(4, &contents[3]), (2, &contents[1])] {
        let (_, r) = resolve(&repo, &spec(&format!("vm@{n}"))).await.unwrap();
        assert_eq!(&restore_bytes(&repo, &r).await.unwrap(), data);
    }

    // Pruning again changes nothing; an empty policy is refused.
    let again = prune(&repo, "vm", &policy, false).await.unwrap();
    assert!(again.iter().all(|d| d.keep));
    assert!(prune(&repo, "vm", &KeepPolicy::default(), false)
        .await
        .is_err());
    assert!(prune(&repo, "nope", &policy, false).await.is_err());
}

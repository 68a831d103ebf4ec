//! How a commit is planned (`commit_plan::plan_commit`): a qcow2 overlay made by qemu-img on a
//! committed file commits incrementally when its backing layer is known (by records or an
//! explicit parent) and in full otherwise; a dirty bitmap commits on the image's newest
//! version; a premise that cannot hold is refused with a clear error.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use crate::common::*;
use cairn_engine::commit::incremental::commit_changes;
use cairn_engine::commit::plan::{plan_commit, CommitPlan, CommitSource, KnownVersions, NoRecords};
use cairn_engine::source::{open_image, ReadPolicy, SourceFormat, StreamSource};
use cairn_engine::EngineError;
use cairn_format::Id;
use cairn_image::DiskImage;
use cairn_repo::Repo;
use cairn_store::MemoryStore;

fn qemu(tool: &str, args: &[&str]) {
    let out = Command::new(tool).args(args).output().expect(tool);
    assert!(
        out.status.success(),
        "{tool} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn open(path: &Path) -> Arc<dyn DiskImage> {
    open_image(path, SourceFormat::Auto, ReadPolicy::default()).unwrap()
}

/// Records saying `path` holds `id`.
struct Known(PathBuf, Id);

impl KnownVersions for Known {
    fn lookup(&self, path: &Path) -> Option<Id> {
        (path == self.0).then_some(self.1)
    }
}

fn bad_input(r: Result<CommitPlan, EngineError>) -> String {
    match r {
        Err(EngineError::BadInput(msg)) => msg,
        Err(e) => panic!("expected bad input, got {e}"),
        Ok(_) => panic!("expected bad input, got a plan"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlay_on_a_known_version_commits_only_its_clusters() {
    let dir = tempfile::tempdir().unwrap();
    let repo = Arc::new(
        Repo::init(Arc::new(MemoryStore::new()), config(16 << 10, 1 << 20))
            .await
            .unwrap(),
    );
    let base_data = noise(4 << 20, 1);
    let base = write_file(dir.path(), "base.raw", &base_data);
    let parent = commit_path(&repo, "vm", &base).await;
    let top = dir.path().join("top.qcow2");
    let (b, t) = (base.to_str().unwrap(), top.to_str().unwrap());
    qemu(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", "-F", "raw", "-b", b, t],
    );
    qemu("qemu-io", &["-f", "qcow2", "-c", "write -P 0x11 1M 64k", t]);
    let mut want = base_data.clone();
    want[1 << 20..(1 << 20) + (64 << 10)].fill(0x11);

    // Unknown backing layer: in full.
    let plan = plan_commit(
        &repo,
        "vm",
        CommitSource::Local(open(&top)),
        None,
        &NoRecords,
    );
    assert!(matches!(plan.await.unwrap(), CommitPlan::Full(_)));

    // Known by the records: only the overlay's cluster, on top of vm@1.
    let known = Known(base.clone(), parent.id);
    let plan = plan_commit(&repo, "vm", CommitSource::Local(open(&top)), None, &known)
        .await
        .unwrap();
    let CommitPlan::Incremental {
        image,
        parent: p,
        changed,
        because,
    } = plan
    else {
        panic!("expected an incremental plan");
    };
    assert_eq!(p.0, parent.id);
    assert_eq!(changed.data, vec![(1 << 20, (1 << 20) + (64 << 10))]);
    assert!(changed.zeros.is_empty());
    assert_eq!(because, format!("{} holds vm@1", base.display()));
    let (result, stats) = commit_changes(
        repo.clone(),
        "vm",
        *p,
        image,
        &changed,
        "",
        Default::default(),
    )
    .await
    .unwrap();
    assert_eq!(stats.changed_bytes, 64 << 10);
    assert_eq!(restore_bytes(&repo, &result.record).await.unwrap(), want);

    // An explicit parent is the overlay's direct backing file.
    let plan = plan_commit(
        &repo,
        "vm",
        CommitSource::Local(open(&top)),
        Some((parent.id, parent.record.clone())),
        &NoRecords,
    );
    match plan.await.unwrap() {
        CommitPlan::Incremental { because, .. } => {
            assert_eq!(because, format!("overlay {t} on vm@1 (--parent)"))
        }
        CommitPlan::Full(_) => panic!("expected an incremental plan"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn premises_that_cannot_hold_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let repo = Arc::new(
        Repo::init(Arc::new(MemoryStore::new()), config(16 << 10, 1 << 20))
            .await
            .unwrap(),
    );
    let small = write_file(dir.path(), "small.raw", &noise(1 << 20, 2));
    let parent = commit_path(&repo, "vm", &small).await;
    let parent = Some((parent.id, parent.record));

    // A flat image has no backing layer to be the parent.
    let plan = plan_commit(
        &repo,
        "vm",
        CommitSource::Local(open(&small)),
        parent.clone(),
        &NoRecords,
    );
    assert!(bad_input(plan.await).contains("--parent needs a qcow2 overlay"));

    // An overlay whose backing file is not the parent's size cannot hold it.
    let other = write_file(dir.path(), "other.raw", &noise(2 << 20, 3));
    let top = dir.path().join("top.qcow2");
    let (o, t) = (other.to_str().unwrap(), top.to_str().unwrap());
    qemu(
        "qemu-img",
        &["create", "-q", "-f", "qcow2", "-F", "raw", "-b", o, t],
    );
    let plan = plan_commit(
        &repo,
        "vm",
        CommitSource::Local(open(&top)),
        parent.clone(),
        &NoRecords,
    );
    let msg = bad_input(plan.await);
    assert!(
        msg.contains("the backing chain does not hold that version"),
        "{msg}"
    );
    assert!(msg.contains("2097152 bytes but vm@1 has 1048576"), "{msg}");

    // A stream has no parent.
    let stream = CommitSource::Stream(Box::new(StreamSource::new("s", std::io::empty())));
    let plan = plan_commit(&repo, "vm", stream, parent.clone(), &NoRecords);
    assert!(bad_input(plan.await).contains("not a stream"));

    // A dirty bitmap needs a parent: the image's newest version, if it has one.
    let nbd = |dirty| CommitSource::Nbd {
        image: open(&small),
        dirty,
    };
    let dirty = Some(("b0".to_string(), vec![(0, 4096)]));
    match plan_commit(&repo, "vm", nbd(dirty.clone()), None, &NoRecords)
        .await
        .unwrap()
    {
        CommitPlan::Incremental {
            because, changed, ..
        } => {
            assert_eq!(because, "dirty bitmap b0 since vm@1");
            assert_eq!(changed.data, vec![(0, 4096)]);
        }
        CommitPlan::Full(_) => panic!("expected an incremental plan"),
    }
    let plan = plan_commit(&repo, "new", nbd(dirty), None, &NoRecords);
    assert!(bad_input(plan.await).contains("--dirty-bitmap commits on top of a parent version"));
    let plan = plan_commit(&repo, "vm", nbd(None), parent, &NoRecords);
    assert!(bad_input(plan.await).contains("needs --dirty-bitmap"));
}

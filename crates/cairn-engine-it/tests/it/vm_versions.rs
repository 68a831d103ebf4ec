//! VM versions (`cairn_engine::vm`): published on top of the VM's head, listed newest first,
//! sealed in an encrypted repository; a disk version a live VM version binds cannot be removed
//! or pruned alone; removing a VM version removes the disk versions only it binds (not tagged
//! ones); disk versions an interrupted backup left are found and discarded.

use std::sync::Arc;

use crate::common::{commit_bytes, noise, restore_bytes};
use crate::gc_format2::{init, open};
use cairn_engine::resolve::{history, VersionSpec};
use cairn_engine::retention::{prune, KeepPolicy};
use cairn_engine::vm::{
    bound_versions, discard_disks, latest_vm, prune_vm, publish_vm, remove_vm_versions, resolve_vm,
    unbound_disk_versions, vm_history, NewVmVersion, VmSpec, DISK_MESSAGE_PREFIX,
};
use cairn_engine::EngineError;
use cairn_format::vm::{ConfigKind, Freeze, VmDisk};
use cairn_repo::Repo;
use cairn_store::MemoryStore;

/// Commits `data` as a disk of VM `web` the way a backup does (its message marks it).
async fn disk(repo: &Arc<Repo>, name: &str, seed: u64) -> VmDisk {
    let image = format!("web/{name}");
    let c = commit_bytes(repo, &image, noise(1 << 20, seed)).await;
    VmDisk {
        name: name.into(),
        version: c.id,
        seq: c.record.seq,
        node: format!("node-{name}"),
        checkpoint: format!("cairn-cp-{seed}"),
    }
}

fn new_version(disks: Vec<VmDisk>, message: &str) -> NewVmVersion {
    NewVmVersion {
        vm: "web".into(),
        time_ns: 1,
        config_kind: ConfigKind::QemuArgs,
        config: "qemu-system-x86_64".into(),
        disks,
        memory: None,
        freeze: Freeze::Frozen,
        freeze_ns: 3_000_000,
        message: message.into(),
    }
}

async fn vm_round_trip(encrypted: bool) {
    let store = Arc::new(MemoryStore::new());
    init(store.clone(), encrypted).await;
    let repo = open(&store).await;
    let d1 = vec![disk(&repo, "disk0", 1).await, disk(&repo, "data", 2).await];
    let (id1, v1) = publish_vm(&repo, new_version(d1.clone(), "one"))
        .await
        .unwrap();
    assert_eq!((v1.seq, v1.parent), (1, None));
    let d2 = vec![disk(&repo, "disk0", 3).await, disk(&repo, "data", 4).await];
    let (id2, v2) = publish_vm(&repo, new_version(d2.clone(), "two"))
        .await
        .unwrap();
    assert_eq!((v2.seq, v2.parent), (2, Some(id1)));

    let repo = open(&store).await;
    let log = vm_history(&repo, "web").await.unwrap();
    assert_eq!(
        log.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        [id2, id1]
    );
    assert_eq!(log[0].1.disks, d2);
    let spec = VmSpec::parse("web@1").unwrap();
    assert_eq!(resolve_vm(&repo, &spec).await.unwrap().0, id1);
    assert!(VmSpec::parse("web@.x").is_err() && VmSpec::parse("web@0").is_err());
    assert!(matches!(
        resolve_vm(&repo, &VmSpec::parse("web@9").unwrap()).await,
        Err(EngineError::NotFound(_))
    ));
    assert_eq!(repo.vms().await.unwrap(), ["web"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn vm_versions_publish_and_list_plain() {
    vm_round_trip(false).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn vm_versions_publish_and_list_encrypted() {
    vm_round_trip(true).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_bound_disk_version_goes_only_with_its_vm_version() {
    let store = Arc::new(MemoryStore::new());
    init(store.clone(), false).await;
    let repo = open(&store).await;
    let d1 = vec![disk(&repo, "disk0", 1).await];
    publish_vm(&repo, new_version(d1.clone(), "one"))
        .await
        .unwrap();
    let d2 = vec![disk(&repo, "disk0", 2).await];
    publish_vm(&repo, new_version(d2.clone(), "two"))
        .await
        .unwrap();
    // A third VM version binds disk0@2 again (nothing changed on that disk).
    publish_vm(&repo, new_version(d2.clone(), "three"))
        .await
        .unwrap();

    let rm =
        cairn_engine::remove::remove_versions(&repo, &[VersionSpec::parse("web/disk0@1").unwrap()])
            .await;
    assert!(
        matches!(rm, Err(EngineError::BoundToVm { ref vm_version, .. }) if vm_version == "web@1"),
        "{rm:?}"
    );
    let policy = KeepPolicy {
        last: 1,
        ..Default::default()
    };
    let kept = prune(&repo, "web/disk0", &policy, false).await.unwrap();
    assert!(kept.iter().all(|d| d.keep), "{kept:?}");
    assert!(
        kept[1]
            .reasons
            .contains(&"disk of VM version web@1".to_string()),
        "{kept:?}"
    );

    // web@3 goes, but disk0@2 stays: web@2 still binds it.
    let gone = remove_vm_versions(&repo, &[VmSpec::parse("web@3").unwrap()])
        .await
        .unwrap();
    assert!(gone[0].disks.is_empty());
    assert_eq!(latest_vm(&repo, "web").await.unwrap().unwrap().1.seq, 2);
    // A tagged disk version stays as an image version when its VM version goes.
    repo.create_tag("web/disk0", "keep", &d1[0].version)
        .await
        .unwrap();
    let gone = remove_vm_versions(&repo, &[VmSpec::parse("web@1").unwrap()])
        .await
        .unwrap();
    assert!(gone[0].disks.is_empty());
    let gone = remove_vm_versions(&repo, &[VmSpec::parse("web@2").unwrap()])
        .await
        .unwrap();
    assert_eq!(gone[0].disks.len(), 1);
    assert_eq!(gone[0].disks[0].0, d2[0].version);
    let left: Vec<u64> = history(&repo, "web/disk0")
        .await
        .unwrap()
        .iter()
        .map(|(_, r)| r.seq)
        .collect();
    assert_eq!(left, [1]);
    assert!(bound_versions(&repo, &[]).await.unwrap().is_empty());
    assert!(vm_history(&repo, "web").await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn disk_versions_of_an_interrupted_backup_are_found_and_discarded() {
    let store = Arc::new(MemoryStore::new());
    init(store.clone(), false).await;
    let repo = open(&store).await;
    let d1 = vec![disk(&repo, "disk0", 1).await];
    let (_, v1) = publish_vm(&repo, new_version(d1, "one")).await.unwrap();
    // A backup committed disk0 again and died before its VM version; the operator also
    // committed by hand (not ours to discard).
    let by_backup = by_backup(&repo, "web/disk0", 5).await;
    commit_bytes(&repo, "web/disk0", noise(1 << 20, 6)).await;
    let left = unbound_disk_versions(&repo, "web", Some(&v1), &["disk0".to_string()])
        .await
        .unwrap();
    assert_eq!(
        left.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        [by_backup.id]
    );
    discard_disks(&repo, &left).await.unwrap();
    assert_eq!(history(&repo, "web/disk0").await.unwrap().len(), 2);
    assert!(
        unbound_disk_versions(&repo, "web", Some(&v1), &["disk0".to_string()])
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn vm_retention_removes_whole_vm_versions() {
    let store = Arc::new(MemoryStore::new());
    init(store.clone(), false).await;
    let repo = open(&store).await;
    for seed in 1..=3 {
        let d = vec![disk(&repo, "disk0", seed).await];
        publish_vm(&repo, new_version(d, "v")).await.unwrap();
    }
    let policy = KeepPolicy {
        last: 1,
        ..Default::default()
    };
    // A tag names web@1 and keeps it.
    let (first, _) = resolve_vm(&repo, &VmSpec::numbered("web", 1))
        .await
        .unwrap();
    repo.create_vm_tag("web", "gold", &first).await.unwrap();
    assert_eq!(
        resolve_vm(&repo, &VmSpec::parse("web@gold").unwrap())
            .await
            .unwrap()
            .0,
        first
    );
    let refused = remove_vm_versions(&repo, &[VmSpec::parse("web@gold").unwrap()]).await;
    assert!(
        matches!(refused, Err(EngineError::VmTagged { .. })),
        "{refused:?}"
    );
    let dry = prune_vm(&repo, "web", &policy, true).await.unwrap();
    assert_eq!(dry.iter().filter(|(d, _)| d.keep).count(), 2);
    repo.delete_vm_tag("web", "gold").await.unwrap();
    let dry = prune_vm(&repo, "web", &policy, true).await.unwrap();
    assert_eq!(dry.iter().filter(|(d, _)| d.keep).count(), 1);
    assert_eq!(vm_history(&repo, "web").await.unwrap().len(), 3);
    prune_vm(&repo, "web", &policy, false).await.unwrap();
    let left = vm_history(&repo, "web").await.unwrap();
    assert_eq!(left.iter().map(|(_, v)| v.seq).collect::<Vec<_>>(), [3]);
    let disks: Vec<u64> = history(&repo, "web/disk0")
        .await
        .unwrap()
        .iter()
        .map(|(_, r)| r.seq)
        .collect();
    assert_eq!(disks, [3]);
    assert!(prune_vm(&repo, "web", &KeepPolicy::default(), false)
        .await
        .is_err());
}

/// Commits `data` as image `image` the way a VM backup does (its message marks it).
async fn by_backup(repo: &Arc<Repo>, image: &str, seed: u64) -> cairn_engine::commit::CommitResult {
    let src =
        cairn_engine::source::StreamSource::new("t", std::io::Cursor::new(noise(1 << 20, seed)));
    let options = cairn_engine::commit::CommitOptions {
        message: format!("{DISK_MESSAGE_PREFIX}web at {seed}"),
        ..Default::default()
    };
    cairn_engine::commit::commit(repo.clone(), image, Box::new(src), options)
        .await
        .unwrap()
}

/// The memory state (image `web/.memory`) is bound like a disk: kept by `rm`/`prune` of
/// images, removed with its VM version, and discarded when a killed backup left it unbound.
#[tokio::test(flavor = "multi_thread")]
async fn a_memory_state_is_bound_like_a_disk() {
    let store = Arc::new(MemoryStore::new());
    init(store.clone(), false).await;
    let repo = open(&store).await;
    let memory = by_backup(&repo, "web/.memory", 7).await;
    let mut new = new_version(vec![disk(&repo, "disk0", 1).await], "with memory");
    new.memory = Some(memory.id);
    let (_, v1) = publish_vm(&repo, new).await.unwrap();
    assert_eq!(v1.bound().last(), Some(&(".memory", memory.id)));
    assert_eq!(
        bound_versions(&repo, &[]).await.unwrap().get(&memory.id),
        Some(&"web@1".to_string())
    );
    // A later backup saved memory again and was killed before its VM version.
    let left = by_backup(&repo, "web/.memory", 8).await;
    let names = ["disk0".to_string(), ".memory".to_string()];
    let found = unbound_disk_versions(&repo, "web", Some(&v1), &names)
        .await
        .unwrap();
    assert_eq!(
        found.iter().map(|(id, _)| *id).collect::<Vec<_>>(),
        [left.id]
    );
    discard_disks(&repo, &found).await.unwrap();
    // Removing the VM version takes its memory state along.
    let removed = remove_vm_versions(&repo, &[VmSpec::parse("web@1").unwrap()])
        .await
        .unwrap();
    assert!(removed[0].disks.iter().any(|(id, _)| *id == memory.id));
    assert!(history(&repo, "web/.memory").await.unwrap().is_empty());
}

/// A damaged VM record: verify names it; removing versions of another image goes on, and of
/// the VM's own images is refused (which of them it binds is unknown). A bound disk version
/// deleted behind its VM version's back is a problem verify names.
#[tokio::test(flavor = "multi_thread")]
async fn damaged_vm_metadata_is_named_and_holds_back_only_its_images() {
    let store = Arc::new(MemoryStore::new());
    init(store.clone(), false).await;
    let repo = open(&store).await;
    let d1 = vec![disk(&repo, "disk0", 1).await];
    let (id1, _) = publish_vm(&repo, new_version(d1.clone(), "one"))
        .await
        .unwrap();
    commit_bytes(&repo, "web/disk0", noise(1 << 20, 2)).await;
    commit_bytes(&repo, "other", noise(1 << 20, 3)).await;
    commit_bytes(&repo, "other", noise(1 << 20, 4)).await;
    let report = cairn_engine::verify::verify(repo.clone()).await.unwrap();
    assert!(report.is_clean(), "{:?}", report.problems);
    assert_eq!(report.vm_versions_checked, 1);

    let key = cairn_format::keys::vm_version(&id1);
    let good = crate::common::flip_middle_byte(&store, &key, 0x10).await;
    let repo = open(&store).await;
    let report = cairn_engine::verify::verify(repo.clone()).await.unwrap();
    assert!(
        report.damaged_metadata.iter().any(|d| d.key == key),
        "{:?}",
        report.damaged_metadata
    );
    cairn_engine::remove::remove_versions(&repo, &[VersionSpec::parse("other@1").unwrap()])
        .await
        .unwrap();
    let policy = KeepPolicy {
        last: 1,
        ..Default::default()
    };
    let rm =
        cairn_engine::remove::remove_versions(&repo, &[VersionSpec::parse("web/disk0@2").unwrap()])
            .await;
    assert!(
        matches!(&rm, Err(e) if e.to_string().contains("cannot all be read")),
        "{rm:?}"
    );
    assert!(prune(&repo, "web/disk0", &policy, false).await.is_err());
    assert_eq!(history(&repo, "web/disk0").await.unwrap().len(), 2);

    // Mended: a bound disk version deleted behind the VM's back is named.
    {
        use cairn_store::ObjectStore;
        store.delete(&key).await.unwrap();
        store.put_if_absent(&key, good).await.unwrap();
    }
    let repo = open(&store).await;
    repo.mark_deleted(&d1[0].version).await.unwrap();
    let report = cairn_engine::verify::verify(repo.clone()).await.unwrap();
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.contains("web@1 binds web/disk0") && p.contains("deleted")),
        "{:?}",
        report.problems
    );
}

/// `copy` takes VM versions along with their disks: each is published in the destination
/// naming the destination's copies (disks and memory state), in order, and a second copy
/// finds them there. A copy of only some of a VM's images copies no VM version and says why.
#[tokio::test(flavor = "multi_thread")]
async fn copy_takes_vm_versions_along_with_their_disks() {
    let store = Arc::new(MemoryStore::new());
    init(store.clone(), false).await;
    let repo = open(&store).await;
    let d1 = vec![
        disk(&repo, "disk0", 11).await,
        disk(&repo, "data", 12).await,
    ];
    publish_vm(&repo, new_version(d1, "one")).await.unwrap();
    let memory = commit_bytes(&repo, "web/.memory", noise(1 << 20, 13)).await;
    let d2 = vec![
        disk(&repo, "disk0", 14).await,
        disk(&repo, "data", 15).await,
    ];
    let mut two = new_version(d2, "two");
    two.memory = Some(memory.id);
    publish_vm(&repo, two).await.unwrap();

    let dest_store = Arc::new(MemoryStore::new());
    init(dest_store.clone(), false).await;
    let dest = open(&dest_store).await;
    let report = cairn_engine::copy::copy(repo.clone(), dest.clone(), &[], None)
        .await
        .unwrap();
    let copied: Vec<(String, u64, u64)> = vec![("web".into(), 1, 1), ("web".into(), 2, 2)];
    assert_eq!(report.vms.copied, copied);
    assert!(report.vms.incomplete.is_empty(), "{:?}", report.vms);

    let dest = open(&dest_store).await;
    let (source_log, dest_log) = (
        vm_history(&repo, "web").await.unwrap(),
        vm_history(&dest, "web").await.unwrap(),
    );
    for ((_, s), (_, d)) in source_log.iter().zip(&dest_log) {
        assert_eq!(
            (s.seq, &s.message, s.time_ns),
            (d.seq, &d.message, d.time_ns)
        );
        assert_eq!(
            (&s.config, s.freeze, s.freeze_ns),
            (&d.config, d.freeze, d.freeze_ns)
        );
        for ((name, from), (dname, to)) in s.bound().into_iter().zip(d.bound()) {
            assert_eq!(name, dname);
            let image = format!("web/{name}");
            let from = repo.load_version(&from).await.unwrap();
            let to = dest.load_version(&to).await.unwrap();
            assert_eq!(to.image, image, "bound to the destination's own version");
            assert_eq!(
                restore_bytes(&dest, &to).await.unwrap(),
                restore_bytes(&repo, &from).await.unwrap(),
                "{image}"
            );
        }
    }
    assert!(dest_log[0].1.memory.is_some());

    let again = cairn_engine::copy::copy(repo.clone(), dest.clone(), &[], None)
        .await
        .unwrap();
    assert!(again.vms.copied.is_empty(), "{:?}", again.vms);
    assert_eq!(again.vms.present, 2);

    // Only one disk's image: no VM version, and the report says which image lacks a copy.
    let partial_store = Arc::new(MemoryStore::new());
    init(partial_store.clone(), false).await;
    let partial = open(&partial_store).await;
    let only = [VersionSpec::parse("web/disk0").unwrap()];
    let report = cairn_engine::copy::copy(repo.clone(), partial.clone(), &only, None)
        .await
        .unwrap();
    assert!(report.vms.copied.is_empty());
    assert_eq!(report.vms.incomplete.len(), 1, "{:?}", report.vms);
    let (vm, seq, why) = &report.vms.incomplete[0];
    assert_eq!((vm.as_str(), *seq), ("web", 1));
    assert!(why.contains("web/data@1 has no copy"), "{why}");
    assert!(partial.vms().await.unwrap().is_empty());
}

/// A VM head lost, or damaged, loses no VM version: the records no head reaches still bind
/// their disks (`rm` and `prune` keep them), `verify` names them, and `repair` points the
/// head at the newest. A backup's record that lost the race for a sound head binds nothing;
/// once the head is lost it cannot be told from a published one, and is kept too (it names
/// a complete VM version: its disks were published before it).
#[tokio::test(flavor = "multi_thread")]
async fn a_lost_or_damaged_vm_head_loses_no_vm_version() {
    use cairn_engine::repair::{repair, RepairOptions};
    use cairn_store::ObjectStore;
    let store = Arc::new(MemoryStore::new());
    init(store.clone(), false).await;
    let repo = open(&store).await;
    let (id1, _) = publish_vm(
        &repo,
        new_version(vec![disk(&repo, "disk0", 21).await], "one"),
    )
    .await
    .unwrap();
    let d2 = vec![disk(&repo, "disk0", 22).await];
    let (id2, _) = publish_vm(&repo, new_version(d2.clone(), "two"))
        .await
        .unwrap();
    // A record whose head swap never happened (a killed backup): unpublished, binds nothing.
    let d3 = vec![disk(&repo, "disk0", 23).await];
    let mut unpublished = resolve_vm(&repo, &VmSpec::parse("web").unwrap())
        .await
        .unwrap()
        .1;
    (unpublished.seq, unpublished.parent, unpublished.disks) = (3, Some(id2), d3.clone());
    let (id3, _) = repo.put_vm_version(&unpublished).await.unwrap();
    let strays = cairn_engine::vm::strays::vm_strays(&repo).await.unwrap();
    assert!(strays.strays.is_empty(), "{strays:?}");
    assert!(!bound_versions(&repo, &["web/disk0"])
        .await
        .unwrap()
        .contains_key(&d3[0].version));

    let head_key = cairn_format::keys::vm_head("web");
    for damage in [None, Some(&b"not a head"[..])] {
        let now = store.read_ref(&head_key).await.unwrap().map(|s| s.version);
        store
            .cas_ref(
                &head_key,
                now.as_ref(),
                damage.map(bytes::Bytes::from_static),
            )
            .await
            .unwrap();
        let repo = open(&store).await;
        // Lost: the strays bind their disks; damaged: nothing of the VM's is removed at all.
        match (damage, bound_versions(&repo, &["web/disk0"]).await) {
            (None, Ok(bound)) => assert!(
                bound
                    .get(&d2[0].version)
                    .is_some_and(|by| by.contains("web@2")),
                "{bound:?}"
            ),
            (Some(_), Err(e)) => assert!(e.to_string().contains("cannot all be read"), "{e}"),
            (_, other) => panic!("{other:?}"),
        }
        let rm = cairn_engine::remove::remove_versions(
            &repo,
            &[VersionSpec::parse("web/disk0@2").unwrap()],
        )
        .await;
        assert!(rm.is_err(), "a bound disk version was removed: {rm:?}");
        let report = cairn_engine::verify::verify(repo.clone()).await.unwrap();
        assert!(
            report
                .problems
                .iter()
                .any(|p| p.contains("web@2") && p.contains("reached by no VM head")),
            "{:?}",
            report.problems
        );
        let fixed = repair(&repo, RepairOptions::default()).await.unwrap();
        assert_eq!(
            fixed.vm_heads_rebuilt,
            [("web".to_string(), "web@3".to_string())]
        );
        let repo = open(&store).await;
        let log: Vec<_> = vm_history(&repo, "web")
            .await
            .unwrap()
            .into_iter()
            .map(|(id, _)| id)
            .collect();
        assert_eq!(log, [id3, id2, id1]);
        assert!(cairn_engine::vm::strays::vm_strays(&repo)
            .await
            .unwrap()
            .strays
            .is_empty());
    }
    assert_eq!(
        cairn_format::refs::decode(&store.read_ref(&head_key).await.unwrap().unwrap().data)
            .unwrap(),
        id3
    );
}

//! A lost or moved metadata object costs a report, never a version (issue 53): GC deletes
//! only what it proves dead against what live versions use, never on the evidence of an
//! index run or a ref that is gone. Each test runs on a plain and an encrypted repository.
//!
//! - Index runs deleted: `verify` names the packs no run names and the versions that fail,
//!   `gc` (fast and exact) deletes no pack and indexes them again, `repair` rebuilds the runs.
//! - A head ref deleted, moved back, or pointed at another image's version: `verify` names
//!   the versions no ref reaches, `gc --repair` deletes none of them nor their data, `repair`
//!   points the head at the newest.
//! - A commit killed between its record and its ref still leaves a record GC deletes.

use std::sync::Arc;

use cairn_engine::gc::{gc, GcMode, GcOptions, GcReport};
use cairn_engine::repair::{repair, RepairOptions};
use cairn_engine::resolve::history;
use cairn_engine::verify::verify;
use cairn_format::config::RepoConfig;
use cairn_format::keys;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::Repo;
use cairn_store::{MemoryStore, ObjectStore};

use crate::common::*;

fn config() -> RepoConfig {
    RepoConfig {
        repo_id: [53; 16],
        segment_size: 1 << 20,
        pack_target: 1 << 20,
        ..RepoConfig::default_v2()
    }
}

/// Four versions of one 3 MiB image, each changing a few blocks: (store, repo, contents by
/// version, records by version).
async fn four_versions(
    encrypted: bool,
) -> (
    Arc<MemoryStore>,
    Arc<Repo>,
    Vec<Vec<u8>>,
    Vec<(Id, VersionRecord)>,
) {
    let store = Arc::new(MemoryStore::new());
    let repo = init_format2(store.clone(), config(), encrypted).await;
    let (mut contents, mut records) = (Vec::new(), Vec::new());
    for (id, record, data) in changing_versions(&repo, "vm", 53, 4).await {
        contents.push(data);
        records.push((id, record));
    }
    (store, repo, contents, records)
}

async fn all_restore(repo: &Arc<Repo>, contents: &[Vec<u8>], records: &[(Id, VersionRecord)]) {
    for ((_, record), data) in records.iter().zip(contents) {
        let got = restore_bytes(repo, record).await;
        assert!(
            got.as_ref() == Ok(data),
            "@{} does not restore intact",
            record.seq
        );
    }
}

fn options(mode: GcMode) -> GcOptions {
    GcOptions {
        mode,
        ..Default::default()
    }
}

async fn keys_under(store: &MemoryStore, prefix: &str) -> Vec<String> {
    store.list_keys(prefix).await.unwrap()
}

async fn delete_all(store: &MemoryStore, prefix: &str) -> usize {
    let keys = keys_under(store, prefix).await;
    for k in &keys {
        store.delete(k).await.unwrap();
    }
    keys.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_index_runs_cost_no_pack_and_gc_indexes_them_again() {
    for encrypted in [false, true] {
        for mode in [GcMode::Fast, GcMode::Repair] {
            let (store, repo, contents, records) = four_versions(encrypted).await;
            let packs = keys_under(&store, keys::PACKS).await;
            assert!(delete_all(&store, keys::INDEX_RUNS).await > 0);
            let repo = reopen_format2(store.clone(), &repo).await;

            let report = verify(repo.clone()).await.unwrap();
            assert_eq!(report.damaged_versions.len(), 4, "{report:?}");
            assert_eq!(report.unindexed_packs.len(), packs.len(), "{report:?}");

            if mode == GcMode::Repair {
                // The exact pass walks every live tree: with its nodes unindexed it stops,
                // deletes nothing and says what heals it.
                let err = gc(&repo, &options(mode)).await.unwrap_err().to_string();
                assert!(err.contains("nothing was deleted"), "{err}");
                assert!(err.contains("run `cairn repair` first"), "{err}");
                assert_eq!(keys_under(&store, keys::PACKS).await, packs);
                continue;
            }
            let r: GcReport = gc(&repo, &options(mode)).await.unwrap();
            assert_eq!(r.orphan_packs_deleted, 0, "{encrypted} {mode:?}: {r:?}");
            assert_eq!(r.packs_deleted, 0, "{encrypted} {mode:?}: {r:?}");
            assert!(r.orphan_packs_reindexed > 0, "{r:?}");
            let repo = reopen_format2(store.clone(), &repo).await;
            let report = verify(repo.clone()).await.unwrap();
            assert!(report.is_clean(), "{encrypted} {mode:?}: {report:?}");
            assert!(report.unindexed_packs.is_empty(), "{report:?}");
            all_restore(&repo, &contents, &records).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repair_rebuilds_lost_index_runs_from_the_pack_trailers() {
    for encrypted in [false, true] {
        let (store, repo, contents, records) = four_versions(encrypted).await;
        delete_all(&store, keys::INDEX_RUNS).await;
        let repo = reopen_format2(store.clone(), &repo).await;
        let report = repair(&repo, RepairOptions::default()).await.unwrap();
        assert!(report.packs_reindexed > 0, "{report:?}");
        assert!(report.is_clean(), "{report:?}");
        let repo = reopen_format2(store.clone(), &repo).await;
        assert!(verify(repo.clone()).await.unwrap().is_clean());
        all_restore(&repo, &contents, &records).await;
        // Nothing is left for GC to find dead.
        let r = gc(&repo, &options(GcMode::Repair)).await.unwrap();
        assert_eq!((r.packs_deleted, r.orphan_packs_deleted), (0, 0), "{r:?}");
        all_restore(&repo, &contents, &records).await;
    }
}

/// How a head ref goes wrong.
#[derive(Debug, Clone, Copy)]
enum HeadDamage {
    Deleted,
    MovedBack,
    OtherImage,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_or_moved_head_loses_no_version_and_repair_points_it_back() {
    for encrypted in [false, true] {
        for damage in [
            HeadDamage::Deleted,
            HeadDamage::MovedBack,
            HeadDamage::OtherImage,
        ] {
            let what = format!("{damage:?}, encrypted {encrypted}");
            let (store, repo, contents, records) = four_versions(encrypted).await;
            let other = commit_bytes(&repo, "other", noise(1 << 20, 7)).await;
            match damage {
                HeadDamage::Deleted => {
                    let key = keys::head("vm");
                    let state = store.read_ref(&key).await.unwrap().unwrap();
                    store
                        .cas_ref(&key, Some(&state.version), None)
                        .await
                        .unwrap();
                }
                HeadDamage::MovedBack => {
                    assert!(repo.overwrite_head("vm", &records[1].0).await.unwrap());
                }
                HeadDamage::OtherImage => {
                    assert!(repo.overwrite_head("vm", &other.id).await.unwrap());
                }
            }
            let repo = reopen_format2(store.clone(), &repo).await;
            let report = verify(repo.clone()).await.unwrap();
            assert!(!report.is_clean(), "{what}: {report:?}");
            assert!(
                report.problems.iter().any(|p| p.contains("no ref reaches")),
                "{what}: {:?}",
                report.problems
            );

            // Neither GC deletes a record or the data of the versions no ref reaches.
            let versions_before = keys_under(&store, keys::VERSIONS).await;
            for mode in [GcMode::Fast, GcMode::Repair] {
                let r = gc(&repo, &options(mode)).await.unwrap();
                assert_eq!(r.orphan_records_removed, 0, "{what} {mode:?}: {r:?}");
            }
            assert_eq!(keys_under(&store, keys::VERSIONS).await, versions_before);
            let repo = reopen_format2(store.clone(), &repo).await;
            all_restore(&repo, &contents, &records).await;

            let r = repair(&repo, RepairOptions::default()).await.unwrap();
            assert_eq!(
                r.heads_rebuilt,
                vec![("vm".to_string(), Some("vm@4".to_string()))],
                "{what}"
            );
            let repo = reopen_format2(store.clone(), &repo).await;
            let report = verify(repo.clone()).await.unwrap();
            assert!(report.is_clean(), "{what}: {report:?}");
            let seqs: Vec<u64> = history(&repo, "vm")
                .await
                .unwrap()
                .iter()
                .map(|(_, r)| r.seq)
                .collect();
            assert_eq!(seqs, [4, 3, 2, 1], "{what}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gc_still_deletes_the_record_of_a_commit_killed_before_its_ref() {
    for encrypted in [false, true] {
        let (store, repo, _, records) = four_versions(encrypted).await;
        // The record a commit building on the head writes before it swaps the ref, from a
        // process that is gone (older than every live session).
        let (head_id, head) = records.last().unwrap().clone();
        let unpublished = VersionRecord {
            seq: head.seq + 1,
            parent: Some(head_id),
            time_ns: head.time_ns - 3_600_000_000_000,
            message: "killed".into(),
            ..head.clone()
        };
        let (id, _) = repo.put_version(&unpublished).await.unwrap();
        let repo = reopen_format2(store.clone(), &repo).await;
        let report = verify(repo.clone()).await.unwrap();
        assert!(report.is_clean(), "{report:?}");
        let r = gc(&repo, &options(GcMode::Repair)).await.unwrap();
        assert_eq!(r.orphan_records_removed, 1, "{r:?}");
        assert!(!keys_under(&store, keys::VERSIONS)
            .await
            .contains(&keys::version(&id)));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_newest_version_is_an_error_never_an_older_one() {
    use cairn_engine::resolve::{resolve, VersionSpec};
    for encrypted in [false, true] {
        for missing in [false, true] {
            let (store, repo, _, records) = four_versions(encrypted).await;
            let key = keys::version(&records[3].0);
            match missing {
                true => store.delete(&key).await.unwrap(),
                false => {
                    flip_middle_byte(&store, &key, 0x10).await;
                }
            }
            let repo = reopen_format2(store.clone(), &repo).await;
            let err = resolve(&repo, &VersionSpec::parse("vm").unwrap())
                .await
                .unwrap_err();
            assert!(err.is_damage(), "{err}");
            assert!(
                err.to_string()
                    .contains("the newest version of vm is unreadable"),
                "{err}"
            );
            // A version named explicitly still resolves.
            let (id, _) = resolve(&repo, &VersionSpec::parse("vm@3").unwrap())
                .await
                .unwrap();
            assert_eq!(id, records[2].0);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damaged_gc_bookkeeping_is_reported_and_set_aside_never_blocking() {
    use cairn_format::marker::GcPlan;
    for encrypted in [false, true] {
        let (store, repo, contents, records) = four_versions(encrypted).await;
        // A plan whose bytes do not match its name, one that does not decode, and a lock
        // that names no session.
        let plan = GcPlan {
            created_ns: 1,
            dead_blobs: vec![records[0].0],
            superseded_index: vec![],
        }
        .encode();
        let bad_name = keys::plan(&Id::of(b"another plan"));
        store.put_if_absent(&bad_name, plan.into()).await.unwrap();
        let garbage = b"garbage".to_vec();
        let bad_bytes = keys::plan(&Id::of(&garbage));
        store
            .put_if_absent(&bad_bytes, garbage.into())
            .await
            .unwrap();
        store
            .cas_ref(keys::GC_LOCK, None, Some(b"garbage".to_vec().into()))
            .await
            .unwrap();

        // Every command opens the repository; verify names all three.
        let repo = reopen_format2(store.clone(), &repo).await;
        let report = verify(repo.clone()).await.unwrap();
        let named = |what: &str| report.problems.iter().any(|p| p.contains(what));
        assert!(
            named(&bad_name) && named(&bad_bytes),
            "{:?}",
            report.problems
        );
        assert!(named("the gc lock cannot be read"), "{:?}", report.problems);
        // A commit still publishes, GC takes the lock over and sets the plans aside.
        commit_bytes(&repo, "other", noise(1 << 20, 9)).await;
        gc(&repo, &options(GcMode::Fast)).await.unwrap();
        assert!(keys_under(&store, keys::PLANS).await.is_empty());
        let aside = keys_under(&store, "damaged/").await;
        assert!(
            aside.contains(&format!("damaged/{bad_name}"))
                && aside.contains(&format!("damaged/{bad_bytes}")),
            "{aside:?}"
        );
        let repo = reopen_format2(store.clone(), &repo).await;
        assert!(verify(repo.clone()).await.unwrap().is_clean());
        all_restore(&repo, &contents, &records).await;
    }
}

/// How a pack is damaged.
#[derive(Debug, Clone, Copy)]
enum PackDamage {
    Missing,
    Truncated,
    Trailer,
    Header,
    NodeGroup,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn damage_found_by_verify_never_spreads_to_a_new_commit_of_the_same_data() {
    use cairn_engine::resolve::{resolve, VersionSpec};
    for encrypted in [false, true] {
        for damage in [
            PackDamage::Missing,
            PackDamage::Truncated,
            PackDamage::Trailer,
            PackDamage::Header,
            PackDamage::NodeGroup,
        ] {
            let what = format!("{damage:?}, encrypted {encrypted}");
            let (store, repo, contents, _) = four_versions(encrypted).await;
            let mut packs = store.list(keys::PACKS).await.unwrap();
            packs.sort_by_key(|m| m.size);
            // The first commit's data (the largest pack), or a pack of manifest nodes (the
            // smallest).
            let target = match damage {
                PackDamage::NodeGroup => packs.first().unwrap().clone(),
                _ => packs.last().unwrap().clone(),
            };
            match damage {
                PackDamage::Missing => store.delete(&target.key).await.unwrap(),
                PackDamage::Truncated => {
                    store.truncate_object(&target.key, target.size as usize / 2)
                }
                PackDamage::Trailer => {
                    store.corrupt_object(&target.key, target.size as usize - 100)
                }
                PackDamage::Header => store.corrupt_object(&target.key, 2),
                // Past the first group's frame (33 bytes after the header, 65 sealed).
                PackDamage::NodeGroup => store.corrupt_object(&target.key, 100),
            }
            let repo = reopen_format2(store.clone(), &repo).await;
            let report = verify(repo.clone()).await.unwrap();
            assert!(!report.damaged_versions.is_empty(), "{what}: {report:?}");
            // verify's advice: committing the content again heals.
            let repo = reopen_format2(store.clone(), &repo).await;
            let again = commit_bytes(&repo, "vm", contents[3].clone()).await;
            let got = restore_bytes(&repo, &again.record).await;
            assert!(got.as_ref() == Ok(&contents[3]), "{what}: {:?}", got.err());
            let (id, _) = resolve(&repo, &VersionSpec::parse("vm").unwrap())
                .await
                .unwrap();
            assert_eq!(id, again.id);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn repair_reads_before_it_judges_damage_nobody_found_and_markers_that_lie() {
    for encrypted in [false, true] {
        // Damage no verify or restore has met: repair finds it and says what is lost.
        let (store, repo, _, records) = four_versions(encrypted).await;
        let mut packs = store.list(keys::PACKS).await.unwrap();
        packs.sort_by_key(|m| m.size);
        let data_pack = packs.last().unwrap().clone();
        store.corrupt_object(&data_pack.key, 5000);
        let repo = reopen_format2(store.clone(), &repo).await;
        let r = repair(&repo, RepairOptions::default()).await.unwrap();
        assert!(!r.is_clean(), "encrypted {encrypted}: {r:?}");
        assert!(r.packs_checked > 0);
        assert!(
            r.lost_versions.iter().any(|v| v.id == records[0].0),
            "{r:?}"
        );

        // A marker that names an intact copy (garbage in it, or put there by hand): read,
        // found intact, lifted; nothing is called lost.
        let (store, repo, contents, records) = four_versions(encrypted).await;
        let mut packs = store.list(keys::PACKS).await.unwrap();
        packs.sort_by_key(|m| m.size);
        let pack: Id = packs
            .last()
            .unwrap()
            .key
            .rsplit('/')
            .next()
            .unwrap()
            .parse()
            .unwrap();
        let trailer = repo.v2().unwrap().trailer(&pack).await.unwrap();
        let marker = keys::quarantine(&pack, &trailer.group_id(0).unwrap());
        store
            .put_if_absent(&marker, b"garbage".to_vec().into())
            .await
            .unwrap();
        let repo = reopen_format2(store.clone(), &repo).await;
        let r = repair(&repo, RepairOptions::default()).await.unwrap();
        assert!(r.is_clean(), "encrypted {encrypted}: {r:?}");
        assert!(
            store.list_keys(&marker).await.unwrap().is_empty(),
            "the marker is lifted"
        );
        let repo = reopen_format2(store.clone(), &repo).await;
        assert!(verify(repo.clone()).await.unwrap().is_clean());
        all_restore(&repo, &contents, &records).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_goes_on_past_a_damaged_version_and_names_it() {
    use cairn_engine::copy::copy;
    for encrypted in [false, true] {
        let (store, repo, contents, records) = four_versions(encrypted).await;
        let before: Vec<String> = keys_under(&store, keys::PACKS).await;
        commit_bytes(&repo, "other", noise(2 << 20, 77)).await;
        let mut new: Vec<_> = store
            .list(keys::PACKS)
            .await
            .unwrap()
            .into_iter()
            .filter(|m| !before.contains(&m.key))
            .collect();
        new.sort_by_key(|m| m.size);
        store.corrupt_object(&new.last().unwrap().key, 5000);
        let source = reopen_format2(store.clone(), &repo).await;
        let dest_store = Arc::new(MemoryStore::new());
        let dest = init_format2(dest_store.clone(), config(), encrypted).await;
        let report = copy(source, dest.clone(), &[], None).await.unwrap();
        assert_eq!(report.copied.len(), 4, "{report:?}");
        assert_eq!(report.damaged.len(), 1, "{report:?}");
        assert_eq!(
            (report.damaged[0].0.as_str(), report.damaged[0].1),
            ("other", 1)
        );
        for (c, data) in report.copied.iter().zip(&contents) {
            let record = dest.load_version(&c.id).await.unwrap();
            assert_eq!(restore_bytes(&dest, &record).await.unwrap(), *data);
        }
        assert_eq!(records.len(), 4);
    }
}

/// Where a pack's table of contents is damaged (finding 5: it used to lose the whole pack).
#[derive(Debug, Clone, Copy)]
enum TocDamage {
    /// A byte of the trailer flipped.
    Trailer,
    /// A byte of the footer flipped.
    Footer,
    /// The footer and the end of the trailer cut off.
    Tail,
    /// A byte of the first group's frame flipped (the trailer intact).
    Frame,
    /// A byte of the trailer of a pack of manifest nodes flipped.
    NodeTrailer,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_trailer_or_footer_loses_no_group_and_repair_stores_them_again() {
    for encrypted in [false, true] {
        for damage in [
            TocDamage::Trailer,
            TocDamage::Footer,
            TocDamage::Tail,
            TocDamage::Frame,
            TocDamage::NodeTrailer,
        ] {
            let what = format!("{damage:?}, encrypted {encrypted}");
            let (store, repo, contents, records) = four_versions(encrypted).await;
            let mut packs = store.list(keys::PACKS).await.unwrap();
            packs.sort_by_key(|m| m.size);
            // The first commit's data (every version uses some of it), or the smallest pack:
            // manifest nodes.
            let target = match damage {
                TocDamage::NodeTrailer => packs.first().unwrap().clone(),
                _ => packs.last().unwrap().clone(),
            };
            let size = target.size as usize;
            match damage {
                TocDamage::Trailer => store.corrupt_object(&target.key, size - 100),
                TocDamage::Footer => store.corrupt_object(&target.key, size - 10),
                TocDamage::Tail => store.truncate_object(&target.key, size - 60),
                TocDamage::Frame => store.corrupt_object(&target.key, 24),
                TocDamage::NodeTrailer => store.corrupt_object(&target.key, size - 60),
            }
            let pack: Id = target.key.rsplit('/').next().unwrap().parse().unwrap();
            let repo = reopen_format2(store.clone(), &repo).await;
            let report = verify(repo.clone()).await.unwrap();
            assert!(!report.is_clean(), "{what}: {report:?}");
            assert_eq!(report.rescuable_packs, [pack], "{what}: {report:?}");
            match damage {
                TocDamage::Frame => assert!(report.damaged_versions.is_empty(), "{what}"),
                _ => assert!(!report.damaged_versions.is_empty(), "{what}"),
            }

            let repo = reopen_format2(store.clone(), &repo).await;
            let r = repair(&repo, RepairOptions::default()).await.unwrap();
            assert_eq!(r.packs_rescued, 1, "{what}: {r:?}");
            assert!(r.groups_rescued > 1, "{what}: {r:?}");
            assert!(r.is_clean(), "{what}: nothing is lost: {r:?}");
            assert_eq!(
                keys_under(&store, &keys::set_aside_object(&target.key)).await,
                [keys::set_aside_object(&target.key)],
                "{what}: the damaged pack is kept aside"
            );

            let repo = reopen_format2(store.clone(), &repo).await;
            all_restore(&repo, &contents, &records).await;
            let report = verify(repo.clone()).await.unwrap();
            assert!(report.is_clean(), "{what}: {report:?}");
            gc(&repo, &options(GcMode::Repair)).await.unwrap();
            let repo = reopen_format2(store.clone(), &repo).await;
            all_restore(&repo, &contents, &records).await;
            let report = verify(repo.clone()).await.unwrap();
            assert!(report.is_clean(), "{what}: after gc: {report:?}");
            assert!(report.packs_with_quarantined == 0, "{what}: {report:?}");
        }
    }
}

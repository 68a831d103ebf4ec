//! Reading format v2 objects through cairn-repo's `V2Reader`, over a directory store: packs of
//! chunk groups and index runs written with cairn-format's writers, read back in pieces
//! (ranged reads of trailers, sections and groups), bit-exact, with one fetch per group
//! however many readers ask, and with every kind of damage refused by name.

use std::sync::Arc;

use cairn_format::config::{Compression, RepoConfig};
use cairn_format::crypto::MasterKey;
use cairn_format::group::{group_id, GroupBuilder, GroupDesc};
use cairn_format::index_run;
use cairn_format::leaf_v2::{RunExtent, RunLeaf};
use cairn_format::pack::BlobKind;
use cairn_format::pack_v2::{self, PackWriter};
use cairn_format::{keys, Id};
use cairn_repo::v2::{CacheLimits, GroupPacker, PackBytes, V2Reader};
use cairn_repo::{Repo, RepoError};
use cairn_store::{LocalStore, ObjectStore};
use rand::{Rng, SeedableRng};

mod common;
use common::*;

#[tokio::test]
async fn groups_and_chunks_read_back_bit_exact_plain_and_sealed() {
    for key in [None, Some(MasterKey::generate())] {
        let f = fixture().await;
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (p1, b1, w1) = pack(&mut rng, 6, key.as_ref());
        let (p2, b2, w2) = pack(&mut rng, 3, key.as_ref());
        let mut locs = locations(p1, &w1, key.as_ref());
        locs.extend(locations(p2, &w2, key.as_ref()));
        let run = f.publish(&[(p1, b1), (p2, b2)], &locs, key.as_ref()).await;
        let r = f.reader(key.clone());
        r.add_run(&run).await.unwrap();

        for g in w1.iter().chain(&w2) {
            let whole = r.read_group_run(&g.id, 0, 16).await.unwrap();
            assert_eq!(whole, g.chunks.concat());
            let part = r.read_group_run(&g.id, 3, 5).await.unwrap();
            assert_eq!(part, g.chunks[3..8].concat());
            for (slot, c) in g.chunks.iter().enumerate() {
                let id = key.as_ref().map_or_else(|| Id::of(c), |k| k.id_of(c));
                assert_eq!(&r.read_chunk(&id).await.unwrap()[..], &c[..], "slot {slot}");
            }
        }
        let fetched = r.fetches();
        assert_eq!(fetched.groups, 9, "each group is fetched once: {fetched:?}");
        assert_eq!(
            fetched.trailers, 2,
            "each trailer is read once: {fetched:?}"
        );

        let absent = Id::of(b"never stored");
        assert!(matches!(
            r.read_group_run(&absent, 0, 1).await,
            Err(RepoError::BlobMissing { id }) if id == absent
        ));
        let err = r.read_group_run(&w1[0].id, 10, 7).await.unwrap_err();
        assert!(
            err.to_string().contains("slots 10..17 of a group of 16"),
            "{err}"
        );
    }
}

#[tokio::test]
async fn concurrent_readers_of_one_group_wait_for_one_fetch() {
    let f = fixture().await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(8);
    let (p, b, w) = pack(&mut rng, 2, None);
    let run = f.publish(&[(p, b)], &locations(p, &w, None), None).await;
    let r = Arc::new(f.reader(None));
    r.add_run(&run).await.unwrap();
    let mut tasks = tokio::task::JoinSet::new();
    for slot in 0..16u16 {
        let (r, id) = (r.clone(), w[0].id);
        tasks.spawn(async move { (slot, r.read_group_run(&id, slot, 1).await.unwrap()) });
    }
    while let Some(done) = tasks.join_next().await {
        let (slot, bytes) = done.unwrap();
        assert_eq!(bytes, w[0].chunks[slot as usize]);
    }
    assert_eq!(r.fetches().groups, 1);
    assert_eq!(r.fetches().trailers, 1);
}

#[tokio::test]
async fn a_trailer_longer_than_the_first_read_is_fetched_whole() {
    // 9000 chunks of 16 bytes: a trailer of 333 KB, more than the 256 KiB tail read first.
    let f = fixture().await;
    let mut w = PackWriter::new(None);
    let mut all = Vec::new();
    let mut groups = Vec::new();
    for g in 0..9u32 {
        let mut b = GroupBuilder::new(GROUP);
        let mut chunks = Vec::new();
        for i in 0..1000u32 {
            let c = [g.to_le_bytes(), i.to_le_bytes(), [7; 4], [9; 4]].concat();
            b.push(Id::of(&c), &c);
            chunks.push(c);
        }
        let group = b.finish(Compression::Zstd { level: 3 }, None);
        groups.push((group_id(&group.desc.chunks, None), chunks));
        w.push(BlobKind::Data, group);
    }
    let (p, bytes, _) = w.finish();
    for (gid, chunks) in &groups {
        all.push((*gid, p));
        all.extend(chunks.iter().map(|c| (Id::of(c), p)));
    }
    let run = f.publish(&[(p, bytes)], &all, None).await;
    let r = f.reader(None);
    r.add_run(&run).await.unwrap();
    let (gid, chunks) = &groups[8];
    assert_eq!(
        r.read_group_run(gid, 998, 2).await.unwrap(),
        chunks[998..].concat()
    );
    let trailer = r.trailer(&p).await.unwrap();
    assert_eq!(trailer.groups.len(), 9);
}

#[tokio::test]
async fn an_index_entry_is_only_a_candidate_the_trailer_decides() {
    // A newer run that names the wrong pack for every id (as an 8-byte key collision would)
    // is outvoted by the trailer: the older run's pack is found, and an id that no trailer
    // lists is missing, not read from the wrong place.
    let f = fixture().await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(9);
    let (p1, b1, w1) = pack(&mut rng, 2, None);
    let (p2, b2, w2) = pack(&mut rng, 2, None);
    let right = f
        .publish(&[(p1, b1)], &locations(p1, &w1, None), None)
        .await;
    let mut wrong: Vec<(Id, Id)> = locations(p1, &w1, None)
        .into_iter()
        .map(|(id, _)| (id, p2))
        .collect();
    wrong.push((Id::of(b"claimed"), p2));
    let wrong = f.publish(&[(p2, b2)], &wrong, None).await;
    let r = f.reader(None);
    r.add_run(&right).await.unwrap();
    r.add_run(&wrong).await.unwrap();
    assert_eq!(
        r.read_group_run(&w1[1].id, 0, 16).await.unwrap(),
        w1[1].chunks.concat()
    );
    let claimed = Id::of(b"claimed");
    assert!(matches!(
        r.read_chunk(&claimed).await,
        Err(RepoError::BlobMissing { id }) if id == claimed
    ));
    // p2's own groups are not in any run: not found, though their pack was read.
    assert!(matches!(
        r.read_group_run(&w2[0].id, 0, 1).await,
        Err(RepoError::BlobMissing { .. })
    ));
}

#[tokio::test]
async fn damage_is_refused_naming_the_object() {
    let key = MasterKey::generate();
    let f = fixture().await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(10);
    let (p, b, w) = pack(&mut rng, 3, Some(&key));
    let groups = pack_v2::parse_pack(&b, Some(&key)).unwrap();
    let pack_len = b.len() as u64;
    let run = f
        .publish(&[(p, b)], &locations(p, &w, Some(&key)), Some(&key))
        .await;
    let pack_key = keys::pack(&p);

    // A plain reader of a sealed repository, and a reader with another key.
    let plain = f.reader(None);
    let err = plain.add_run(&run).await.unwrap_err();
    assert!(err.is_damage(), "{err}");
    let other = f.reader(Some(MasterKey::generate()));
    let err = other.add_run(&run).await.unwrap_err();
    assert!(err.to_string().contains("authentication failed"), "{err}");

    // A flipped byte inside group 1: its tag fails; groups 0 and 2 still read.
    let at = groups[1].range().start + 100;
    flip(&f.object(&pack_key), at);
    let r = f.reader(Some(key.clone()));
    r.add_run(&run).await.unwrap();
    let err = r.read_group_run(&w[1].id, 0, 1).await.unwrap_err();
    assert!(err.is_damage());
    let msg = err.to_string();
    assert!(
        msg.contains(&pack_key) && msg.contains("group 1") && msg.contains("authentication"),
        "{msg}"
    );
    assert_eq!(
        r.read_group_run(&w[2].id, 0, 16).await.unwrap(),
        w[2].chunks.concat()
    );
    flip(&f.object(&pack_key), at);

    // A flipped byte in the trailer: its checksum fails.
    flip(&f.object(&pack_key), pack_len - 60);
    let r = f.reader(Some(key.clone()));
    r.add_run(&run).await.unwrap();
    let err = r.read_group_run(&w[0].id, 0, 1).await.unwrap_err();
    assert!(err.is_damage());
    assert!(
        err.to_string().contains(&pack_key) && err.to_string().contains("checksum"),
        "{err}"
    );
    flip(&f.object(&pack_key), pack_len - 60);

    // A truncated pack: the footer is gone.
    let bytes = std::fs::read(f.object(&pack_key)).unwrap();
    std::fs::write(f.object(&pack_key), &bytes[..bytes.len() - 10]).unwrap();
    let r = f.reader(Some(key.clone()));
    r.add_run(&run).await.unwrap();
    let err = r.read_group_run(&w[0].id, 0, 1).await.unwrap_err();
    assert!(
        err.is_damage() && err.to_string().contains(&pack_key),
        "{err}"
    );
    std::fs::write(f.object(&pack_key), &bytes).unwrap();

    // A flipped byte in a run section: its checksum fails at lookup, which then takes every
    // pack of the run as a candidate (the trailer decides): the read still works, and the
    // run's check names the damage.
    let run_key = keys::index_run(&run);
    flip(&f.object(&run_key), 20);
    let r = f.reader(Some(key.clone()));
    r.add_run(&run).await.unwrap();
    let read = r.read_group_run(&w[0].id, 0, 1).await.unwrap();
    assert_eq!(&read[..], &w[0].chunks[0][..]);
    let line = r.check_run(&run).await.unwrap().expect("reported");
    assert!(
        line.contains(&run_key) && line.contains("section"),
        "{line}"
    );
}

#[tokio::test]
async fn a_group_gc_rewrote_keeps_its_id_and_refuses_dropped_slots() {
    let f = fixture().await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let (_, b, w) = pack(&mut rng, 1, None);
    let old = pack_v2::parse_pack(&b, None).unwrap().remove(0);
    let plain = w[0].chunks.concat();
    let rewritten = GroupBuilder::repack(&old.desc, &plain, |slot| slot % 4 != 1)
        .finish(Compression::Zstd { level: 3 }, None);
    let desc: &GroupDesc = &rewritten.desc;
    assert_eq!(group_id(&desc.chunks, None), w[0].id);
    let mut pw = PackWriter::new(None);
    pw.push(BlobKind::Data, rewritten);
    let (p, bytes, _) = pw.finish();
    let kept: Vec<(Id, Id)> = std::iter::once((w[0].id, p))
        .chain(
            w[0].chunks
                .iter()
                .enumerate()
                .filter(|(s, _)| s % 4 != 1)
                .map(|(_, c)| (Id::of(c), p)),
        )
        .collect();
    let run = f.publish(&[(p, bytes)], &kept, None).await;
    let r = f.reader(None);
    r.add_run(&run).await.unwrap();
    assert_eq!(
        r.read_group_run(&w[0].id, 2, 3).await.unwrap(),
        w[0].chunks[2..5].concat()
    );
    let err = r.read_group_run(&w[0].id, 0, 2).await.unwrap_err();
    assert!(
        err.to_string().contains("slot 1 is no longer stored"),
        "{err}"
    );
    assert!(matches!(
        r.read_chunk(&Id::of(&w[0].chunks[5])).await,
        Err(RepoError::BlobMissing { .. })
    ));
}

#[tokio::test]
async fn the_group_cache_stays_within_its_bound() {
    // 12 groups of 64 KiB through a 256 KiB cache, twice: the second pass must fetch again
    // (what stays cached is bounded), and every read is still bit-exact.
    let f = fixture().await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(12);
    let (p, b, w) = pack(&mut rng, 12, None);
    let run = f.publish(&[(p, b)], &locations(p, &w, None), None).await;
    let r = f.repo.v2_reader(
        None,
        CacheLimits {
            group_bytes: 256 << 10,
            ..CacheLimits::default()
        },
    );
    r.add_run(&run).await.unwrap();
    for _ in 0..2 {
        for g in &w {
            assert_eq!(
                r.read_group_run(&g.id, 0, 16).await.unwrap(),
                g.chunks.concat()
            );
        }
    }
    let fetched = r.fetches().groups;
    assert!(
        fetched > 12,
        "a 256 KiB cache cannot hold 768 KiB: {fetched} fetches"
    );
}

/// A reader of `runs` holding at most `filter_bytes` of their filters.
async fn budgeted(f: &Fixture, runs: &[Id], filter_bytes: u64) -> V2Reader {
    let limits = CacheLimits {
        filter_bytes,
        ..CacheLimits::default()
    };
    let r = f.repo.v2_reader(None, limits);
    r.add_runs(runs).await.unwrap();
    r
}

#[tokio::test]
async fn runs_whose_filters_exceed_the_budget_are_asked_through_their_fence_keys() {
    // Three runs of different sizes: with room for none of their filters, for the smaller
    // ones only, and for all, every chunk is found where it is and an absent id is not.
    let f = fixture().await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(21);
    let mut runs = Vec::new();
    let mut all = Vec::new();
    for groups in [2, 4, 24] {
        let (p, b, w) = pack(&mut rng, groups, None);
        runs.push(f.publish(&[(p, b)], &locations(p, &w, None), None).await);
        all.extend(w);
    }
    let full = budgeted(&f, &runs, u64::MAX).await;
    let (held, unfiltered) = full.filter_memory();
    assert_eq!(unfiltered, 0);
    // Room for all but the largest filter: only the largest run loses its filter.
    let no_largest = budgeted(&f, &runs, held - 1).await;
    let (kept, dropped) = no_largest.filter_memory();
    assert_eq!(dropped, 1);
    assert!(kept < held && kept > 0, "{kept} of {held}");
    let none = budgeted(&f, &runs, 0).await;
    assert_eq!(none.filter_memory(), (0, 3));
    // The smallest run superseded (a compaction, a GC): the largest's filter fits now and
    // is read again; without room, nothing is read.
    let refilled = budgeted(&f, &runs, held - 1).await;
    refilled.retain_runs(&runs[1..]);
    assert_eq!(refilled.refill_filters().await.unwrap(), 1);
    assert_eq!(refilled.filter_memory().1, 0);
    assert_eq!(none.refill_filters().await.unwrap(), 0);
    for r in [&full, &no_largest, &none] {
        // (Some chunks repeat across groups: any group holding the same bytes will do.)
        for g in &all {
            for c in &g.chunks {
                let p = r.find_chunk(&Id::of(c)).await.unwrap().expect("found");
                let at = all.iter().find(|w| w.id == p.group).expect("a known group");
                assert!(at.chunks[usize::from(p.slot)] == *c);
            }
        }
        assert_eq!(r.find_chunk(&Id::of(b"absent")).await.unwrap(), None);
    }
    // Absent ids, on fresh readers: without filters every run is asked through a section
    // (read once, then cached); with them, only the rare false positive reads one.
    let (full, none) = (
        budgeted(&f, &runs, u64::MAX).await,
        budgeted(&f, &runs, 0).await,
    );
    for i in 0u64..100 {
        let id = Id::of(&i.to_le_bytes());
        assert_eq!(full.find_chunk(&id).await.unwrap(), None);
        assert_eq!(none.find_chunk(&id).await.unwrap(), None);
    }
    let (with, without) = (full.fetches().sections, none.fetches().sections);
    assert!(without >= 3, "every run asked: {without}");
    assert!(
        with < without,
        "{with} section reads with filters, {without} without"
    );
}

/// A 4 MiB image: random regions, zeros, a region repeated, a compressible region.
fn image(rng: &mut rand::rngs::StdRng) -> Vec<u8> {
    let mut img = vec![0u8; 4 << 20];
    rng.fill(&mut img[..1 << 20]);
    for (i, b) in img[(3 << 19)..(2 << 20)].chunks_mut(CHUNK).enumerate() {
        b.fill(0x5a); // compressible, and each block its own
        b[..8].copy_from_slice(&(i as u64).to_le_bytes());
    }
    let copy = img[(64 << 10)..(320 << 10)].to_vec();
    img[(3 << 20)..(3 << 20) + copy.len()].copy_from_slice(&copy); // a repeat
    rng.fill(&mut img[(7 << 19)..(7 << 19) + 8192]);
    img
}

#[tokio::test]
async fn chunks_packed_into_groups_read_back_through_their_leaf() {
    // Packs built in memory, and in files the store publishes as they are (the first few
    // packs: the packer falls back to memory once the stager has no more files).
    let keys = [None, Some(MasterKey::generate())];
    for (key, staged) in keys
        .iter()
        .flat_map(|k| [(k.clone(), false), (k.clone(), true)])
    {
        let f = fixture().await;
        let mut rng = rand::rngs::StdRng::seed_from_u64(13);
        let img = image(&mut rng);
        let id_of = |d: &[u8]| key.as_ref().map_or_else(|| Id::of(d), |k| k.id_of(d));
        let mut packer = GroupPacker::new(
            key.clone(),
            Compression::Zstd { level: 3 },
            GROUP,
            256 << 10,
        );
        if staged {
            let mut files = Vec::new();
            for _ in 0..3 {
                files.push(
                    f.repo
                        .stage_pack()
                        .await
                        .unwrap()
                        .expect("a local store stages"),
                );
            }
            packer = packer.staged(Box::new(move || Ok(files.pop())));
        }
        let mut finished = Vec::new();
        let mut blocks = Vec::new(); // per 4 KiB block: None (zeros) or its ticket
        for block in img.chunks(CHUNK) {
            if block.iter().all(|b| *b == 0) {
                blocks.push(None);
                continue;
            }
            let (ticket, full) = packer.push(id_of(block), block).unwrap();
            finished.extend(full);
            blocks.push(Some(ticket));
        }
        finished.extend(packer.close_group().unwrap());
        let mut leaf = RunLeaf::default();
        for b in &blocks {
            leaf.push(match b {
                None => RunExtent::Zero { len: CHUNK as u32 },
                Some(t) => {
                    let p = packer.placement(*t).expect("placed once its group closed");
                    RunExtent::Run {
                        group: p.group,
                        first: p.slot,
                        count: 1,
                        len: CHUNK as u32,
                    }
                }
            });
        }
        let leaf_bytes = leaf.encode();
        let leaf_id = id_of(&leaf_bytes);
        finished.extend(packer.push_node(leaf_id, &leaf_bytes).unwrap());
        finished.extend(packer.finish().unwrap());
        let staged_packs = finished
            .iter()
            .filter(|p| matches!(p.bytes, PackBytes::Staged(_)))
            .count();
        assert_eq!(staged_packs, if staged { 3 } else { 0 });
        assert!(finished.len() > 3, "some packs were built in memory");

        let mut locations = Vec::new();
        for p in finished {
            let (pack, _) = f.repo.put_pack(&p.id, p.bytes).await.unwrap();
            locations.extend(p.ids.iter().map(|id| (*id, pack)));
        }
        let packs: std::collections::HashSet<Id> = locations.iter().map(|l| l.1).collect();
        assert!(packs.len() >= 3, "256 KiB packs: {} packs", packs.len());
        let (run, written) = f
            .repo
            .put_index_run(&locations, key.as_ref())
            .await
            .unwrap();
        assert!(written > 0);
        assert_eq!(
            f.repo.discard_unindexed_packs().await,
            0,
            "every pack is indexed"
        );

        // The repeat is stored once: 256 + 128 + 2 unique blocks of data, in groups of 16.
        let unique: std::collections::HashSet<&[u8]> = img
            .chunks(CHUNK)
            .filter(|b| b.iter().any(|x| *x != 0))
            .collect();
        let runs = leaf
            .extents()
            .iter()
            .filter(|e| matches!(e, RunExtent::Run { .. }));
        assert_eq!(unique.len(), 256 + 128 + 2);
        assert!(
            runs.count() <= unique.len().div_ceil(16) + 8,
            "merged runs: {:?}",
            leaf.extents().len()
        );

        let r = f.reader(key.clone());
        r.add_run(&run).await.unwrap();
        let read_leaf = RunLeaf::decode(&r.read_chunk(&leaf_id).await.unwrap()).unwrap();
        assert_eq!(read_leaf, leaf);
        let mut out = Vec::with_capacity(img.len());
        for e in read_leaf.extents() {
            match *e {
                RunExtent::Zero { len } => out.resize(out.len() + len as usize, 0),
                RunExtent::Run {
                    group,
                    first,
                    count,
                    ..
                } => out.extend_from_slice(&r.read_group_run(&group, first, count).await.unwrap()),
            }
        }
        assert!(out == img, "the image reads back bit-exact");
        let groups = unique.len().div_ceil(16) as u64;
        assert!(
            r.fetches().groups <= groups + 1,
            "each group fetched once: {:?} for {groups} groups",
            r.fetches()
        );
    }
}

#[tokio::test]
async fn a_pack_stored_but_never_indexed_is_discarded() {
    let f = fixture().await;
    let mut packer = GroupPacker::new(None, Compression::Zstd { level: 3 }, GROUP, 1 << 20);
    packer.push(Id::of(b"lonely"), b"lonely").unwrap();
    let p = packer.finish().unwrap().unwrap();
    let (pack, _) = f.repo.put_pack(&p.id, p.bytes).await.unwrap();
    assert!(f.store.head(&keys::pack(&pack)).await.unwrap().is_some());
    assert_eq!(f.repo.discard_unindexed_packs().await, 1);
    assert!(f.store.head(&keys::pack(&pack)).await.unwrap().is_none());
}

#[tokio::test]
async fn a_staged_pack_whose_key_is_taken_is_resalted_and_stored_apart() {
    let f = fixture().await;
    let mut packer = GroupPacker::new(None, Compression::Zstd { level: 3 }, GROUP, 1 << 20);
    packer.push(Id::of(b"twice"), b"twice").unwrap();
    let p = packer.finish().unwrap().unwrap();
    let PackBytes::Memory(bytes) = p.bytes else {
        panic!("an unstaged packer builds in memory")
    };
    let (first, _) = f.repo.put_pack(&p.id, bytes.clone()).await.unwrap();
    assert_eq!(first, p.id);
    // The same bytes again, staged: the key is taken, so the pack gets a new salt and id.
    let mut staged = f.repo.stage_pack().await.unwrap().unwrap();
    std::io::Write::write_all(&mut staged, &bytes).unwrap();
    let (second, n) = f
        .repo
        .put_pack(&p.id, PackBytes::Staged(staged))
        .await
        .unwrap();
    assert_ne!(second, first);
    assert_eq!(n, bytes.len() as u64);
    let stored = f.store.get(&keys::pack(&second)).await.unwrap();
    assert_eq!(
        Id::of(&stored),
        second,
        "the id is the hash of the stored pack"
    );
    assert_eq!(stored[..12], bytes[..12]);
    assert_eq!(stored[16..], bytes[16..], "only the salt differs");
    assert_eq!(f.store.get(&keys::pack(&first)).await.unwrap(), bytes);
    // No staged file is left behind.
    assert_no_staged_file(&f.root.join("packs"));
}

/// No `.tmp-` file (a staged object's temporary name) is left in `dir`.
fn assert_no_staged_file(dir: &std::path::Path) {
    let left: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n.to_string_lossy().starts_with(".tmp-"))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// A repository on a counting store holding one pack of random groups and a run naming it.
struct OnePack {
    dir: tempfile::TempDir,
    store: Arc<cairn_store::CountingStore>,
    repo: Repo,
    pack: Id,
    /// The pack's groups as parsed back (their byte ranges).
    groups: Vec<pack_v2::PackGroup>,
    written: Vec<Written>,
    run_id: Id,
}

/// [`OnePack`] of `groups` groups from the random seed `seed` (the store's counts start
/// after it is written).
async fn one_pack(seed: u64, groups: usize) -> OnePack {
    let dir = tempfile::tempdir().unwrap();
    let local: Arc<dyn ObjectStore> = Arc::new(LocalStore::create(dir.path()).unwrap());
    let store = Arc::new(cairn_store::CountingStore::new(local.clone()));
    let repo = Repo::init(store.clone(), RepoConfig::default())
        .await
        .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (p, b, w) = pack(&mut rng, groups, None);
    let parsed = pack_v2::parse_pack(&b, None).unwrap();
    local
        .put_if_absent(&keys::pack(&p), b.into())
        .await
        .unwrap();
    let run = index_run::write_run(&locations(p, &w, None), None);
    let run_id = Id::of(&run);
    local
        .put_if_absent(&keys::index_run(&run_id), run.into())
        .await
        .unwrap();
    OnePack {
        dir,
        store,
        repo,
        pack: p,
        groups: parsed,
        written: w,
        run_id,
    }
}

#[tokio::test]
async fn a_leafs_nearby_groups_come_in_one_read_and_damage_names_its_group() {
    let OnePack {
        dir,
        store,
        repo,
        pack: p,
        groups,
        written: w,
        run_id,
    } = one_pack(11, 6).await;
    let pack_key = keys::pack(&p);

    let r = repo.v2_reader(None, CacheLimits::default());
    r.add_run(&run_id).await.unwrap();
    // Groups 1, 2, 3, 1 again and 5, located (trailer and sections read) before counting.
    let wanted = [1, 2, 3, 1, 5];
    let mut located = Vec::new();
    for g in wanted {
        located.push(r.locate_group(&w[g].id).await.unwrap());
    }
    store.reset();
    let opened = r.open_groups(&located).await.unwrap();
    // One read for the neighbours 1..=3 and for 5, one group (at most 64 KiB, and the frames
    // of 4 and 5) away: group 4 is read through and dropped; group 1 asked twice is fetched
    // once.
    assert!(groups[5].range().start - groups[3].range().end <= (64 << 10) + 2 * 33);
    assert_eq!(store.reads(), 1);
    assert_eq!(
        store.bytes_read(),
        groups[5].range().end - groups[1].range().start
    );
    assert_eq!(r.fetches().groups, 4);
    for (at, g) in wanted.iter().enumerate() {
        assert_eq!(
            located[at].slots(&opened[at], 0, 16).unwrap(),
            w[*g].chunks.concat()
        );
    }
    // Asked again: all from the cache.
    store.reset();
    r.open_groups(&located).await.unwrap();
    assert_eq!(store.reads(), 0);
    // Groups further apart than 64 KiB come in reads of their own (0 and 5: four groups of
    // random, incompressible chunks between them).
    let r2 = repo.v2_reader(None, CacheLimits::default());
    r2.add_run(&run_id).await.unwrap();
    let far = [
        r2.locate_group(&w[0].id).await.unwrap(),
        r2.locate_group(&w[5].id).await.unwrap(),
    ];
    assert!(groups[5].range().start - groups[0].range().end > 64 << 10);
    store.reset();
    r2.open_groups(&far).await.unwrap();
    assert_eq!(store.reads(), 2);
    assert_eq!(
        store.bytes_read(),
        groups[0].range().end - groups[0].range().start + groups[5].range().end
            - groups[5].range().start
    );

    // A flipped byte in group 2 fails the span by naming group 2 (a fresh reader: no cache).
    let path = dir.path().join(&pack_key);
    flip(&path, groups[2].range().start + 50);
    let r = repo.v2_reader(None, CacheLimits::default());
    r.add_run(&run_id).await.unwrap();
    let mut located = Vec::new();
    for g in [1, 2, 3] {
        located.push(r.locate_group(&w[g].id).await.unwrap());
    }
    let err = r.open_groups(&located).await.unwrap_err();
    assert!(err.is_damage(), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(&pack_key) && msg.contains("group 2 (at byte"),
        "{msg}"
    );
    // The damage stays in group 2: group 3 still reads.
    assert_eq!(
        r.read_group_run(&w[3].id, 0, 16).await.unwrap(),
        w[3].chunks.concat()
    );
}

#[tokio::test]
async fn a_large_runs_filter_is_read_once_the_run_is_asked_often() {
    // A run of 60,000 entries more than its pack's: its filter (~120 KB) lies before the 64 KiB
    // the run's first read takes, so it is read only at the run's 64th lookup. Every lookup
    // before and after finds what the pack stores and nothing else.
    let f = fixture().await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(31);
    let (p, b, w) = pack(&mut rng, 4, None);
    let mut locs = locations(p, &w, None);
    locs.extend((0..60_000u32).map(|i| (Id::of(&i.to_le_bytes()), p)));
    let run = f.publish(&[(p, b)], &locs, None).await;
    let r = f.reader(None);
    r.add_run(&run).await.unwrap();
    assert_eq!(r.filter_memory(), (0, 1), "no filter read at open");
    // A refill (what `Repo::refresh_index` does) leaves it for the asks too.
    assert_eq!(r.refill_filters().await.unwrap(), 0);
    let chunks: Vec<&Vec<u8>> = w.iter().flat_map(|g| &g.chunks).collect();
    let asks = cairn_repo::v2::FILTER_AFTER_ASKS as usize;
    async fn check(r: &V2Reader, w: &[Written], c: &[u8]) {
        let p = r.find_chunk(&Id::of(c)).await.unwrap().expect("found");
        let g = w
            .iter()
            .find(|g| g.id == p.group)
            .expect("a group of the pack");
        assert!(g.chunks[usize::from(p.slot)] == c);
    }
    for i in 0..asks - 1 {
        check(&r, &w, chunks[i % chunks.len()]).await;
    }
    assert_eq!(r.filter_memory(), (0, 1), "{} asks: still unread", asks - 1);
    assert_eq!(r.find_chunk(&Id::of(b"absent")).await.unwrap(), None);
    let (held, unfiltered) = r.filter_memory();
    assert!(held > 64 << 10, "the filter is held now: {held} bytes");
    assert_eq!(unfiltered, 0);
    for c in &chunks {
        check(&r, &w, c).await;
    }
    assert_eq!(r.find_chunk(&Id::of(b"absent")).await.unwrap(), None);

    // Without room in the budget, the 64th ask reads nothing: fence keys, as before.
    let lean = budgeted(&f, &[run], 1 << 10).await;
    for i in 0..2 * asks {
        let c = chunks[i % chunks.len()];
        assert!(lean.find_chunk(&Id::of(c)).await.unwrap().is_some());
    }
    assert_eq!(lean.filter_memory(), (0, 1));

    // A damaged filter is left out when its turn comes: the run stays asked through its fence
    // keys, every answer still right.
    let path = f.object(&keys::index_run(&run));
    let stored = std::fs::read(&path).unwrap();
    let at = index_run::parse_run(&stored, None)
        .unwrap()
        .meta
        .filter_at
        .expect("a version 3 run's filter is a piece")
        .range;
    flip(&path, (at.start + at.end) / 2);
    let r = f.reader(None);
    r.add_run(&run).await.unwrap();
    for i in 0..2 * asks {
        check(&r, &w, chunks[i % chunks.len()]).await;
    }
    assert_eq!(r.filter_memory(), (0, 1));
    assert_eq!(r.find_chunk(&Id::of(b"absent")).await.unwrap(), None);
}

/// On a directory store a run of entries gathered pack by pack is written into a staged file
/// and published as it is: the stored object is byte for byte the run written in memory,
/// under the hash of its bytes, the reader finds its entries, a second publication of the
/// same run writes nothing, and no staged file is left.
#[tokio::test]
async fn a_commits_run_is_staged_and_published_as_written_in_memory() {
    let f = fixture().await;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (pack_id, bytes, written) = pack(&mut rng, 3, None);
    f.put(&keys::pack(&pack_id), bytes).await;
    let entries = || {
        let mut e = index_run::RunEntries::default();
        e.add_pack(pack_id, written.iter().map(|w| &w.id));
        e
    };
    let in_memory = entries().write(None);
    let (id, n) = f.repo.put_run_entries(entries(), None).await.unwrap();
    assert_eq!(id, Id::of(&in_memory));
    assert_eq!(n, in_memory.len() as u64);
    assert_eq!(f.store.get(&keys::index_run(&id)).await.unwrap(), in_memory);
    let reader = f.reader(None);
    reader.add_run(&id).await.unwrap();
    for w in &written {
        assert_eq!(reader.locate_group(&w.id).await.unwrap().id(), w.id);
    }
    assert_eq!(
        f.repo.put_run_entries(entries(), None).await.unwrap(),
        (id, 0)
    );
    assert_no_staged_file(&f.root.join("index-runs"));
}

/// A node (or chunk) in a pack whose trailer the caller holds is read from there: no index
/// section and no trailer read, only its group. A damaged copy there is quarantined and the
/// node looked up as usual (here it has no other copy: the error says so).
#[tokio::test]
async fn a_node_in_a_held_trailer_is_read_without_the_index_and_damage_there_is_quarantined() {
    let f = one_pack(12, 3).await;
    let (repo, p, w, run_id) = (&f.repo, f.pack, &f.written, f.run_id);
    let id = Id::of(&w[1].chunks[2]);
    let held = repo
        .v2_reader(None, CacheLimits::default())
        .trailer(&p)
        .await
        .unwrap();

    let r = repo.v2_reader(None, CacheLimits::default());
    r.add_run(&run_id).await.unwrap();
    f.store.reset();
    let (bytes, from) = r.read_node_once_near(&id, [&held]).await.unwrap();
    assert_eq!(bytes, w[1].chunks[2]);
    assert!(Arc::ptr_eq(&from, &held));
    assert_eq!(f.store.reads(), 1, "the group only");
    assert_eq!((r.fetches().sections, r.fetches().trailers), (0, 0));
    // Not held: looked up through the index, and the trailer it was found in returned.
    let (bytes, from) = r.read_node_once_near(&id, []).await.unwrap();
    assert_eq!((bytes, from.pack), (w[1].chunks[2].clone().into(), p));

    flip(
        &f.dir.path().join(keys::pack(&p)),
        f.groups[1].range().start + 50,
    );
    let r = repo.v2_reader(None, CacheLimits::default());
    r.add_run(&run_id).await.unwrap();
    let err = r.read_node_once_near(&id, [&held]).await.unwrap_err();
    assert!(err.is_damage(), "{err}");
    // Its only copy is quarantined: nothing locates it any more.
    let copy = r.locate_group(&w[1].id).await;
    assert!(
        matches!(copy, Err(RepoError::Quarantined { .. })),
        "{copy:?}"
    );
}

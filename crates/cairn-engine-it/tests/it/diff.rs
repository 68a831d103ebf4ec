//! `diff`: which ranges differ between two versions, at chunk granularity, and at a cost
//! proportional to the change.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::Arc;

use crate::common::*;
use cairn_engine::diff::{diff, ChangedRange, DiffReport};
use cairn_format::config::RepoConfig;
use cairn_format::version::VersionRecord;
use cairn_repo::Repo;
use cairn_store::{CountingStore, MemoryStore, ObjectStore};

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

async fn repo_with(config: RepoConfig) -> Arc<Repo> {
    Arc::new(
        Repo::init(Arc::new(MemoryStore::new()), config)
            .await
            .unwrap(),
    )
}

fn ranges(r: &DiffReport) -> Vec<(u64, u64)> {
    r.ranges.iter().map(|c| (c.offset, c.len)).collect()
}

/// Checks the report's internal consistency: sorted, merged, summed.
fn check_shape(r: &DiffReport) {
    for w in r.ranges.windows(2) {
        assert!(
            w[0].end() < w[1].offset,
            "sorted and merged: {:?}",
            r.ranges
        );
    }
    assert!(r.ranges.iter().all(|c| c.len > 0));
    assert_eq!(r.changed_bytes, r.ranges.iter().map(|c| c.len).sum::<u64>());
}

/// diff(a, b) and diff(b, a) agree, with added and removed swapped.
async fn diff_both_ways(repo: &Arc<Repo>, a: &VersionRecord, b: &VersionRecord) -> DiffReport {
    let ab = diff(repo, a, b).await.unwrap();
    let ba = diff(repo, b, a).await.unwrap();
    check_shape(&ab);
    assert_eq!(ab.ranges, ba.ranges);
    assert_eq!(
        (ab.chunks_added, ab.chunks_removed),
        (ba.chunks_removed, ba.chunks_added)
    );
    assert_eq!(ab.nodes_read, ba.nodes_read);
    assert_eq!((ab.size_a, ab.size_b), (ba.size_b, ba.size_a));
    ab
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identical_versions_read_nothing() {
    let repo = repo_with(config(4096, 65536)).await;
    let data = noise(3 * MIB as usize + 17, 1);
    let a = commit_bytes(&repo, "vm", data.clone()).await;
    let b = commit_bytes(&repo, "vm", data).await;
    assert_ne!(a.id, b.id, "two versions");
    assert_eq!(a.record.root, b.record.root);
    let r = diff(&repo, &a.record, &b.record).await.unwrap();
    let size = 3 * MIB + 17;
    assert_eq!(
        r,
        DiffReport {
            size_a: size,
            size_b: size,
            ..DiffReport::default()
        },
        "equal roots: nothing changed, no node read"
    );

    // Two all-zero images of different sizes: no data, no change, no read.
    let z1 = commit_bytes(&repo, "zeros", vec![0; 100_000]).await;
    let z2 = commit_bytes(&repo, "zeros", vec![0; 20_000_000]).await;
    assert_ne!(z1.record.height, z2.record.height);
    let r = diff(&repo, &z1.record, &z2.record).await.unwrap();
    assert_eq!(
        r,
        DiffReport {
            size_a: 100_000,
            size_b: 20_000_000,
            ..DiffReport::default()
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_flipped_byte_is_one_chunk() {
    let repo = repo_with(config(4096, 65536)).await;
    let data = noise(3 * MIB as usize + 123, 2);
    let a = commit_bytes(&repo, "vm", data.clone()).await;
    let mut changed = data;
    let at = 1_234_567usize;
    changed[at] ^= 0x40;
    let b = commit_bytes(&repo, "vm", changed).await;
    let r = diff_both_ways(&repo, &a.record, &b.record).await;
    let chunk_start = at as u64 / 4096 * 4096;
    assert_eq!(ranges(&r), vec![(chunk_start, 4096)]);
    assert_eq!(r.changed_bytes, 4096);
    assert_eq!((r.chunks_added, r.chunks_removed), (1, 1));
    // Height 1: both roots and the two leaves of the changed segment.
    assert_eq!(a.record.height, 1);
    assert_eq!(r.nodes_read, 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zeroed_region() {
    let repo = repo_with(config(4096, 65536)).await;
    let data = noise(2 * MIB as usize, 3);
    let a = commit_bytes(&repo, "vm", data.clone()).await;
    let mut zeroed = data;
    zeroed[200_000..700_000].fill(0);
    let b = commit_bytes(&repo, "vm", zeroed).await;
    let r = diff_both_ways(&repo, &a.record, &b.record).await;
    // Chunks partly zeroed changed too; both ends of the region are mid-chunk.
    let (start, end) = (200_000 / 4096 * 4096, 700_000u64.div_ceil(4096) * 4096);
    assert_eq!(ranges(&r), vec![(start, end - start)]);
    assert_eq!(r.chunks_removed, (end - start) / 4096);
    assert_eq!(r.chunks_added, 2, "the two partly zeroed chunks");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn growing_and_shrinking_across_tree_heights() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with(config(4096, 65536)).await;
    // A: 10 MiB + 1000 bytes of data; height 1 (161 segments of 64 KiB).
    let small = noise(10 * MIB as usize + 1000, 4);
    let a = commit_bytes(&repo, "vm", small.clone()).await;
    // B: A, zeros, 1 MiB of data at 40 MiB, zeros up to 60 MiB; height 2.
    let mut grown = small.clone();
    grown.resize(60 * MIB as usize, 0);
    grown[(40 * MIB) as usize..(41 * MIB) as usize].copy_from_slice(&noise(MIB as usize, 5));
    let b = commit_bytes(&repo, "vm", grown).await;
    // C: a 5 GiB sparse file holding A and 64 KiB at 4.5 GiB; height 3.
    let path = dir.path().join("c.raw");
    let f = File::create(&path).unwrap();
    f.set_len(5 * GIB).unwrap();
    f.write_all_at(&small, 0).unwrap();
    f.write_all_at(&noise(64 * KIB as usize, 6), 4 * GIB + GIB / 2)
        .unwrap();
    f.sync_all().unwrap();
    let c = commit_path(&repo, "vm", &path).await;
    assert_eq!(
        (a.record.height, b.record.height, c.record.height),
        (1, 2, 3)
    );

    // The last, partial chunk of A became a full chunk (its data followed by zeros): changed
    // at chunk granularity. The zeros beyond A's end are not changes; B's data is.
    let tail = 10 * MIB;
    let ab = diff_both_ways(&repo, &a.record, &b.record).await;
    assert_eq!(ranges(&ab), vec![(tail, 4096), (40 * MIB, MIB)]);
    // The size change is part of the report.
    assert_eq!((ab.size_a, ab.size_b), (10 * MIB + 1000, 60 * MIB));
    assert_eq!((ab.chunks_added, ab.chunks_removed), (1 + 256, 1));
    let shrink = diff(&repo, &b.record, &a.record).await.unwrap();
    assert_eq!((shrink.chunks_added, shrink.chunks_removed), (1, 257));

    let ac = diff_both_ways(&repo, &a.record, &c.record).await;
    assert_eq!(
        ranges(&ac),
        vec![(tail, 4096), (4 * GIB + GIB / 2, 64 * KIB)]
    );
    assert_eq!((ac.chunks_added, ac.chunks_removed), (1 + 16, 1));

    let bc = diff_both_ways(&repo, &b.record, &c.record).await;
    assert_eq!(
        ranges(&bc),
        vec![(40 * MIB, MIB), (4 * GIB + GIB / 2, 64 * KIB)]
    );
    assert_eq!((bc.chunks_added, bc.chunks_removed), (16, 256));
    // The walk reads only what differs: C's root, the lifted paths, and the changed leaves
    // (far fewer than the 177 leaves plus interiors of the three trees).
    assert!(bc.nodes_read < 40, "read {} nodes", bc.nodes_read);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn different_geometry_is_refused() {
    let repo = repo_with(config(4096, 65536)).await;
    let a = commit_bytes(&repo, "vm", noise(100_000, 7)).await;
    let mut other = a.record.clone();
    other.segment_size = 1 << 20;
    let err = diff(&repo, &a.record, &other).await.unwrap_err();
    assert!(err.to_string().contains("different geometry"), "{err}");
}

/// How one image is represented at 4 KiB fixed chunking: per block, zeros or the hash of the
/// block's bytes (the last block may be short).
fn blocks(data: &[u8]) -> Vec<Option<(blake3::Hash, usize)>> {
    data.chunks(4096)
        .map(|b| (!b.iter().all(|&x| x == 0)).then(|| (blake3::hash(b), b.len())))
        .collect()
}

/// The diff expected from first principles: a block is changed if its representation
/// differs; its range ends where the longer chunk of the two ends.
fn expected_diff(a: &[u8], b: &[u8]) -> (Vec<ChangedRange>, u64, u64) {
    let (ba, bb) = (blocks(a), blocks(b));
    let mut out: Vec<ChangedRange> = Vec::new();
    let (mut added, mut removed) = (0, 0);
    for k in 0..ba.len().max(bb.len()) {
        let x = ba.get(k).copied().flatten();
        let y = bb.get(k).copied().flatten();
        if x == y {
            continue;
        }
        removed += x.is_some() as u64;
        added += y.is_some() as u64;
        let len = x.map_or(0, |v| v.1).max(y.map_or(0, |v| v.1)) as u64;
        let offset = k as u64 * 4096;
        match out.last_mut() {
            Some(last) if last.end() == offset => last.len += len,
            _ => out.push(ChangedRange { offset, len }),
        }
    }
    (out, added, removed)
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next() % n
        }
    }
}

/// Random images and edits (rewrites, zeroed ranges, grows, shrinks) on a fanout-3 tree, so
/// that heights differ often, checked against a first-principles oracle.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_edits_match_the_oracle() {
    let mut cfg = config(4096, 65536);
    cfg.fanout = 3;
    let repo = repo_with(cfg).await;
    let mut rng = Rng(0x5eed_1234_abcd_0001);
    let max = 1_700_000u64;
    let mut heights = std::collections::BTreeSet::new();
    for case in 0..40u64 {
        let size = if case % 7 == 0 { 0 } else { rng.below(max) } as usize;
        let mut a = noise(size, case + 100);
        for _ in 0..rng.below(4) {
            let s = rng.below(size as u64) as usize;
            let e = (s + rng.below(300_000) as usize).min(size);
            a[s..e].fill(0);
        }
        let mut b = a.clone();
        for op in 0..rng.below(5) {
            let len = b.len() as u64;
            match rng.below(4) {
                0 => {
                    let s = rng.below(len) as usize;
                    let e = (s + 1 + rng.below(200_000) as usize).min(b.len());
                    let fresh = noise(e - s, case * 10 + op + 1000);
                    b[s..e].copy_from_slice(&fresh);
                }
                1 => {
                    let s = rng.below(len) as usize;
                    let e = (s + rng.below(200_000) as usize).min(b.len());
                    b[s..e].fill(0);
                }
                2 => b.truncate(rng.below(len + 1) as usize),
                _ => {
                    let extra = rng.below(max.saturating_sub(len) + 1) as usize;
                    if rng.below(2) == 0 {
                        b.resize(b.len() + extra, 0);
                    } else {
                        b.extend(noise(extra, case * 10 + op + 2000));
                    }
                }
            }
        }
        let image = format!("img{case}");
        let va = commit_bytes(&repo, &image, a.clone()).await;
        let vb = commit_bytes(&repo, &image, b.clone()).await;
        heights.insert((va.record.height, vb.record.height));
        let r = diff_both_ways(&repo, &va.record, &vb.record).await;
        let (want, added, removed) = expected_diff(&a, &b);
        assert_eq!(
            (&r.ranges, r.chunks_added, r.chunks_removed),
            (&want, added, removed),
            "case {case}: sizes {} → {}",
            a.len(),
            b.len()
        );
        if va.record.root == vb.record.root && va.record.height == vb.record.height {
            assert_eq!(r.nodes_read, 0);
        }
    }
    assert!(
        heights.iter().any(|(x, y)| x != y),
        "some cases pair trees of different heights: {heights:?}"
    );
}

/// With content-defined chunks, extents no longer line up between versions; the diff stays
/// conservative: every byte that differs lies in a changed range, and an edit stays local.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_defined_chunks_are_covered() {
    let mut cfg = config(4096, 65536);
    cfg.chunker = cairn_format::config::Chunker::FastCdc;
    let repo = repo_with(cfg).await;
    let a = noise(2 * MIB as usize, 11);
    let mut b = a.clone();
    // 777 bytes inserted and 777 removed 10 KB later: a shift that chunk boundaries resync
    // after (so extents stop lining up there); and a rewrite elsewhere.
    b.splice(300_000..300_000, noise(777, 12));
    b.drain(310_000..310_777);
    b[1_500_000..1_500_100].fill(7);
    let va = commit_bytes(&repo, "vm", a.clone()).await;
    let vb = commit_bytes(&repo, "vm", b.clone()).await;
    let r = diff_both_ways(&repo, &va.record, &vb.record).await;
    let covered = |pos: u64| r.ranges.iter().any(|c| c.offset <= pos && pos < c.end());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        if x != y {
            assert!(
                covered(i as u64),
                "byte {i} differs but is not in {:?}",
                r.ranges
            );
        }
    }
    // Each edit disturbs a few chunks around it, not the rest of the image.
    assert!(r.changed_bytes < 65536 + 4 * 16384, "{:?}", r.ranges);
    assert!(!covered(0) && !covered(1_000_000) && !covered(2 * MIB - 1));
}

/// The headline property: in a 2 GiB image holding 64 MiB of data, a 1 MiB change costs a
/// handful of manifest nodes, not a walk of the manifest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_change_in_a_big_image_reads_only_its_paths() {
    let dir = tempfile::tempdir().unwrap();
    let inner: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new());
    let repo = Arc::new(
        Repo::init(inner.clone(), config(16384, 1 << 20))
            .await
            .unwrap(),
    );
    let size = 2 * GIB;
    let path = dir.path().join("big.raw");
    let f = File::create(&path).unwrap();
    f.set_len(size).unwrap();
    // 128 pieces of 512 KiB, one every 16 MiB: 64 MiB of data.
    for i in 0..128u64 {
        f.write_all_at(&noise(512 * KIB as usize, i), i * 16 * MIB)
            .unwrap();
    }
    f.sync_all().unwrap();
    let a = commit_path(&repo, "big", &path).await;
    assert_eq!(a.record.stats.data_bytes, 64 * MIB);
    // Rewrite 1 MiB that straddles a segment boundary, half over data, half over a hole.
    let at = 37 * 16 * MIB + 256 * KIB;
    f.write_all_at(&noise(MIB as usize, 999), at).unwrap();
    f.sync_all().unwrap();
    let b = commit_path(&repo, "big", &path).await;
    assert_eq!(b.record.height, 2);

    let counting = Arc::new(CountingStore::new(inner));
    let repo = Arc::new(Repo::open(counting.clone()).await.unwrap());
    counting.reset();
    let r = diff(&repo, &a.record, &b.record).await.unwrap();
    let (bytes, reads) = (counting.bytes_read(), counting.reads());
    check_shape(&r);
    assert_eq!(ranges(&r), vec![(at, MIB)], "exactly the rewritten MiB");
    assert_eq!((r.chunks_added, r.chunks_removed), (64, 16));
    // Two roots, the two level-1 nodes above segments 592-593, and three leaves (segment 593
    // was a hole in A).
    assert_eq!(r.nodes_read, 7);
    // Each node is found through an index run section and its pack's trailer, then read as
    // one group: a few ranged reads per node, never a walk.
    assert!(
        reads <= 4 * r.nodes_read,
        "{reads} reads for {} nodes",
        r.nodes_read
    );
    assert!(bytes < MIB, "diff read {bytes} bytes of metadata");

    // For scale: what walking both manifests in full reads (a new process: nothing cached).
    let repo = Arc::new(Repo::open(counting.clone()).await.unwrap());
    counting.reset();
    let mut leaves = 0;
    for v in [&a.record, &b.record] {
        for leaf in cairn_engine::tree::leaf_map(&repo, v)
            .await
            .unwrap()
            .values()
        {
            repo.read_blob(leaf).await.unwrap();
            leaves += 1;
        }
    }
    eprintln!(
        "diff of 2 GiB versions differing in 1 MiB: {} nodes, {reads} reads, {bytes} bytes of \
         metadata; a full walk of both manifests: {} leaves, {} reads, {} bytes",
        r.nodes_read,
        leaves,
        counting.reads(),
        counting.bytes_read()
    );
    // A node is read with the rest of its group (up to 64 KiB), so in bytes the diff's seven
    // nodes cost about what this small manifest's full walk does; in reads, far less.
    assert!(counting.reads() > 5 * reads, "{} reads", counting.reads());
}

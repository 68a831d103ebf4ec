//! Format 2 end to end through the engine: commit (4 KiB dedup in compressed groups, an index
//! run per commit), restore, bit-exact, and verify finding damage, on a real local
//! repository.

use std::sync::Arc;

use crate::common::{commit_bytes, noise, restore_bytes, summary_and_use, used_by_tree};
use cairn_engine::commit::patch::{commit_patch, PatchOptions, PatchSource};
use cairn_engine::commit::CommitResult;
use cairn_engine::restore::{restore, RestoreOptions, RestoreTarget};
use cairn_engine::verify::{verify, verify_with, VerifyOptions, VerifyReport};
use cairn_format::config::RepoConfig;
use cairn_format::group_summary::GroupSummary;
use cairn_format::leaf_v2::RunLeaf;
use cairn_repo::Repo;
use cairn_store::{FailingStore, LocalStore};

async fn v2_repo(dir: &std::path::Path) -> Arc<Repo> {
    let store = Arc::new(LocalStore::create(dir).unwrap());
    let config = RepoConfig {
        repo_id: [2; 16],
        segment_size: 256 << 10,
        pack_target: 1 << 20,
        ..RepoConfig::default_v2()
    };
    Arc::new(Repo::init(store, config).await.unwrap())
}

/// Compressible but varied 4 KiB blocks (text-like), so groups compress.
fn text_blocks(n: usize, seed: u64) -> Vec<u8> {
    let words = ["cairn ", "group ", "chunk ", "disk ", "image ", "version "];
    let mut out = Vec::with_capacity(n * 4096);
    let mut x = seed | 1;
    while out.len() < n * 4096 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        out.extend_from_slice(words[(x % 6) as usize].as_bytes());
        out.extend_from_slice(&(x % 1000).to_string().into_bytes());
    }
    out.truncate(n * 4096);
    out
}

/// An image with every kind of content: incompressible and compressible data, zero runs, a
/// block repeated many times, a partial last segment.
fn image() -> Vec<u8> {
    let mut img = noise(1 << 20, 1);
    img.extend(text_blocks(256, 2));
    img.extend(vec![0u8; 300 << 10]);
    let block = noise(4096, 3);
    for _ in 0..40 {
        img.extend_from_slice(&block);
    }
    img.extend(noise(5000, 4)); // ends inside a chunk
    img
}

#[tokio::test]
async fn commit_and_restore_are_bit_exact_and_dedup_per_4k_block() {
    let dir = tempfile::tempdir().unwrap();
    let repo = v2_repo(dir.path()).await;
    let img = image();
    let first = commit_bytes(&repo, "vm", img.clone()).await;
    assert!(restore_bytes(&repo, &first.record).await.unwrap() == img);
    let s = first.record.stats;
    // 256 noise + 256 text + 40 copies of one block + the 5000-byte tail (2 chunks).
    assert_eq!(s.chunks, 256 + 256 + 40 + 2);
    assert_eq!(s.new_chunks, 256 + 256 + 1 + 2);
    // The text (1 MiB) compresses in groups to well under half; the noise does not compress.
    assert!(
        s.stored_bytes < (1 << 20) + (512 << 10),
        "stored {}",
        s.stored_bytes
    );

    // The same image again stores no chunk, only what a version needs of its own.
    let again = commit_bytes(&repo, "vm", img.clone()).await;
    assert_eq!(again.record.stats.new_chunks, 0);
    assert_eq!(again.record.root, first.record.root, "same tree, same root");

    // The data moved by one 4 KiB block (what a file copied inside a guest looks like) is
    // found again: only the inserted block is new.
    let mut moved = noise(4096, 99);
    moved.extend_from_slice(&img);
    moved.truncate(img.len());
    let third = commit_bytes(&repo, "vm", moved.clone()).await;
    assert_eq!(
        third.record.stats.new_chunks,
        1 + 1,
        "the new block and a new tail"
    );
    assert!(restore_bytes(&repo, &third.record).await.unwrap() == moved);

    // A process that opens the repository afresh finds everything through the index runs.
    let reopened = Arc::new(
        Repo::open(Arc::new(LocalStore::open(dir.path()).unwrap()))
            .await
            .unwrap(),
    );
    assert!(restore_bytes(&reopened, &first.record).await.unwrap() == img);
    let fourth = commit_bytes(&reopened, "other", moved.clone()).await;
    assert_eq!(fourth.record.stats.new_chunks, 0);
}

#[tokio::test]
async fn a_version_restores_to_qcow2() {
    let dir = tempfile::tempdir().unwrap();
    let repo = v2_repo(dir.path()).await;
    let img = image();
    let v = commit_bytes(&repo, "vm", img.clone()).await;
    let out = dir.path().join("out.qcow2");
    let stats = restore(
        repo.clone(),
        &v.record,
        RestoreTarget::Qcow2(out.clone()),
        RestoreOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(stats.data_bytes, img.len() as u64 - (300 << 10));
    assert!(stats.reads > 0 && stats.fetched_bytes > 0);
    let raw = dir.path().join("back.raw");
    let st = std::process::Command::new("qemu-img")
        .args(["convert", "-O", "raw"])
        .arg(&out)
        .arg(&raw)
        .status()
        .expect("qemu-img");
    assert!(st.success());
    // qcow2 sizes are whole 512-byte sectors: the rest of the last one reads as zeros.
    let back = std::fs::read(&raw).unwrap();
    assert_eq!(back.len() as u64, (img.len() as u64).div_ceil(512) * 512);
    assert!(back[..img.len()] == img[..] && back[img.len()..].iter().all(|&b| b == 0));
}

#[tokio::test]
async fn damage_in_a_group_fails_the_restore_naming_the_pack() {
    let dir = tempfile::tempdir().unwrap();
    let repo = v2_repo(dir.path()).await;
    let img = noise(512 << 10, 7);
    let v = commit_bytes(&repo, "vm", img).await;
    // Flip a byte in the middle of the data pack (the larger of the two).
    let mut packs: Vec<_> = walkdir(dir.path().join("packs"));
    packs.sort_by_key(|p| std::fs::metadata(p).unwrap().len());
    let data_pack = packs.last().unwrap();
    let mut bytes = std::fs::read(data_pack).unwrap();
    bytes[100] ^= 1;
    std::fs::write(data_pack, bytes).unwrap();
    let fresh = Arc::new(
        Repo::open(Arc::new(LocalStore::open(dir.path()).unwrap()))
            .await
            .unwrap(),
    );
    let e = restore_bytes(&fresh, &v.record).await.unwrap_err();
    let name = data_pack.file_name().unwrap().to_str().unwrap();
    assert!(e.contains(name) && e.contains("group 0"), "{e}");
}

fn walkdir(dir: std::path::PathBuf) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walkdir(p));
        } else {
            out.push(p);
        }
    }
    out
}

/// Files under `dir` that are not in `before`.
fn new_files(dir: std::path::PathBuf, before: &[std::path::PathBuf]) -> Vec<std::path::PathBuf> {
    let mut out: Vec<_> = walkdir(dir)
        .into_iter()
        .filter(|p| !before.contains(p))
        .collect();
    out.sort_by_key(|p| std::fs::metadata(p).unwrap().len());
    out
}

/// Two images of 512 KiB noise each, committed one after the other, with the packs (smallest
/// first) and the index run the first commit wrote.
struct TwoImages {
    a: CommitResult,
    b: CommitResult,
    a_packs: Vec<std::path::PathBuf>,
    a_run: std::path::PathBuf,
}

async fn two_images(dir: &std::path::Path) -> TwoImages {
    let repo = v2_repo(dir).await;
    let a = commit_bytes(&repo, "a", noise(512 << 10, 7)).await;
    let a_packs = new_files(dir.join("packs"), &[]);
    let mut a_run = new_files(dir.join("index-runs"), &[]);
    assert_eq!(
        (a_packs.len(), a_run.len()),
        (2, 1),
        "a data pack, a node pack, a run"
    );
    let b = commit_bytes(&repo, "b", noise(512 << 10, 8)).await;
    TwoImages {
        a,
        b,
        a_packs,
        a_run: a_run.pop().unwrap(),
    }
}

async fn reopen(dir: &std::path::Path) -> Arc<Repo> {
    Arc::new(
        Repo::open(Arc::new(LocalStore::open(dir).unwrap()))
            .await
            .unwrap(),
    )
}

fn damaged(report: &VerifyReport) -> Vec<(String, u64)> {
    report
        .damaged_versions
        .iter()
        .map(|d| (d.image.clone(), d.seq))
        .collect()
}

fn file_name(p: &std::path::Path) -> &str {
    p.file_name().unwrap().to_str().unwrap()
}

#[tokio::test]
async fn verify_reads_every_group_and_finds_a_clean_repository_clean() {
    let dir = tempfile::tempdir().unwrap();
    let t = two_images(dir.path()).await;
    let report = verify(reopen(dir.path()).await).await.unwrap();
    assert!(report.is_clean(), "{report:?}");
    assert_eq!(report.packs_checked, 4);
    assert_eq!(report.versions_checked, 2);
    // Each image: 128 chunks of 4 KiB, two leaves (256 KiB segments) and a root.
    assert_eq!(report.blobs_checked, 2 * (128 + 3));
    let packs: u64 = walkdir(dir.path().join("packs"))
        .iter()
        .map(|p| std::fs::metadata(p).unwrap().len())
        .sum();
    assert_eq!(report.read_bytes, packs);
    assert!(t.a.record.root != t.b.record.root);
}

#[tokio::test]
async fn verify_names_a_damaged_group_and_only_the_versions_using_it() {
    let dir = tempfile::tempdir().unwrap();
    let t = two_images(dir.path()).await;
    let data_pack = t.a_packs.last().unwrap();
    let mut bytes = std::fs::read(data_pack).unwrap();
    bytes[100] ^= 1;
    std::fs::write(data_pack, bytes).unwrap();

    let repo = reopen(dir.path()).await;
    let report = verify(repo.clone()).await.unwrap();
    assert_eq!(damaged(&report), vec![("a".to_string(), 1)], "{report:?}");
    let name = file_name(data_pack);
    assert!(
        report.damaged_versions[0].reason.contains(name)
            && report.damaged_versions[0].reason.contains("group 0"),
        "{report:?}"
    );
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.contains(name) && p.contains("does not match its id")),
        "{report:?}"
    );

    // Scoped to the undamaged version, the damaged pack is not in scope at all.
    let scoped = verify_with(
        repo,
        &VerifyOptions {
            versions: vec![(t.b.id, t.b.record.clone())],
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert!(scoped.is_clean(), "{scoped:?}");
    assert_eq!(scoped.packs_in_scope, 2);
}

#[tokio::test]
async fn a_damaged_index_run_is_reported_and_the_repository_still_opens() {
    // A byte flipped in a section (found by a lookup) and in the footer (found at open).
    for at_end in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let t = two_images(dir.path()).await;
        let mut bytes = std::fs::read(&t.a_run).unwrap();
        let at = if at_end {
            bytes.len() - 1
        } else {
            bytes.len() / 2
        };
        bytes[at] ^= 1;
        std::fs::write(&t.a_run, bytes).unwrap();

        let repo = reopen(dir.path()).await;
        // The other image is untouched: it restores bit-exact.
        assert!(restore_bytes(&repo, &t.b.record).await.unwrap() == noise(512 << 10, 8));
        // A damaged section costs speed, not data (every pack of the run is a candidate); a
        // run that cannot be opened at all hides what only it locates.
        assert_eq!(
            restore_bytes(&repo, &t.a.record).await.is_ok(),
            !at_end,
            "at_end {at_end}"
        );
        let report = verify(repo).await.unwrap();
        let run = file_name(&t.a_run);
        assert!(
            report.problems.iter().any(|p| p.contains(run)),
            "{report:?}"
        );
        let want = if at_end {
            vec![("a".to_string(), 1)]
        } else {
            vec![]
        };
        assert_eq!(damaged(&report), want, "{report:?}");
    }
}

#[tokio::test]
async fn a_missing_pack_is_named_and_damages_the_versions_using_it() {
    let dir = tempfile::tempdir().unwrap();
    let t = two_images(dir.path()).await;
    let data_pack = t.a_packs.last().unwrap();
    std::fs::remove_file(data_pack).unwrap();
    let report = verify(reopen(dir.path()).await).await.unwrap();
    let name = file_name(data_pack);
    assert!(
        report
            .problems
            .iter()
            .any(|p| p.contains(name) && p.contains("missing")),
        "{report:?}"
    );
    assert_eq!(damaged(&report), vec![("a".to_string(), 1)], "{report:?}");
    assert!(
        report.damaged_versions[0].reason.contains(name),
        "{report:?}"
    );
}

/// Changed 4 KiB blocks held in memory.
struct Blocks(std::collections::BTreeMap<u64, Vec<u8>>);

impl Blocks {
    /// Sets block `index` of `image` (clipped to its end) and records it.
    fn set(&mut self, image: &mut [u8], index: u64, data: Vec<u8>) {
        let start = index as usize * 4096;
        let end = (start + 4096).min(image.len());
        image[start..end].copy_from_slice(&data[..end - start]);
        self.0.insert(index, data[..end - start].to_vec());
    }
}

impl PatchSource for Blocks {
    fn block_size(&self) -> u32 {
        4096
    }
    fn changed_blocks(&self) -> Vec<u64> {
        self.0.keys().copied().collect()
    }
    fn read_block(&self, index: u64) -> std::io::Result<Vec<u8>> {
        Ok(self.0[&index].clone())
    }
}

async fn patch(repo: &Arc<Repo>, base: &CommitResult, size: u64, p: &Blocks) -> CommitResult {
    commit_patch(
        repo.clone(),
        "vm",
        Some((base.id, base.record.clone())),
        size,
        p,
        PatchOptions::default(),
    )
    .await
    .unwrap()
}

/// A patch (an export's COMMIT, an incremental commit) on format 2 stores only the changed
/// blocks and gives exactly the tree a full commit of the same bytes gives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_patch_stores_only_its_blocks_and_equals_a_full_commit() {
    let dir = tempfile::tempdir().unwrap();
    let repo = v2_repo(dir.path()).await;
    // 256 KiB segments: noise in segments 0–3, zeros in 4–7, a 1000-byte noise tail.
    let size = (2u64 << 20) + 1000;
    let mut image = vec![0u8; size as usize];
    image[..1 << 20].copy_from_slice(&noise(1 << 20, 1));
    let tail = image.len() - 1000;
    image[tail..].copy_from_slice(&noise(1000, 2));
    let base = commit_bytes(&repo, "vm", image.clone()).await;

    let mut p = Blocks(Default::default());
    p.set(&mut image, 5, vec![0; 4096]); // a hole over data
    for b in 64..128 {
        p.set(&mut image, b, vec![0; 4096]); // segment 1 all zeros now
    }
    p.set(&mut image, 300, noise(4096, 3)); // data in the zero region (segment 4)
    p.set(&mut image, 130, noise(4096, 1)[..].to_vec()); // block 0's bytes again: found
    let new = patch(&repo, &base, size, &p).await;
    assert!(restore_bytes(&repo, &new.record).await.unwrap() == image);
    assert_eq!(new.record.stats.new_chunks, 1, "{:?}", new.record.stats);
    // Segments 0 and 2 changed one block each: their other 63 chunks are found in the
    // base's leaf of the same segment (block 130's bytes, block 0's, through the index).
    assert_eq!(new.dedup.parent, 126);
    assert_eq!(new.record.parent, Some(base.id));
    let leaves = cairn_engine::tree::leaf_map(&repo, &new.record)
        .await
        .unwrap();
    assert_eq!(leaves.keys().copied().collect::<Vec<_>>(), [0, 2, 3, 4, 8]);
    let full = commit_bytes(&repo, "full", image.clone()).await;
    assert_eq!(full.record.stats.new_chunks, 0);
    assert_eq!(full.record.root, new.record.root, "same bytes, same tree");
    assert_eq!(full.record.stats.chunks, new.record.stats.chunks);
    assert_eq!(full.record.stats.data_bytes, new.record.stats.data_bytes);

    // Growth: the partial last segment gets longer, a block far out is data.
    let grown = (5u64 << 20) + 777;
    let mut bigger = image.clone();
    bigger.resize(grown as usize, 0);
    let mut g = Blocks(Default::default());
    g.set(&mut bigger, (grown - 1) / 4096, noise(4096, 4));
    g.set(&mut bigger, 1000, noise(4096, 5));
    let v3 = patch(&repo, &new, grown, &g).await;
    assert_eq!(v3.record.logical_size, grown);
    assert!(restore_bytes(&repo, &v3.record).await.unwrap() == bigger);
    let full = commit_bytes(&repo, "full2", bigger).await;
    assert_eq!(full.record.root, v3.record.root);
    assert_eq!(full.record.stats.chunks, v3.record.stats.chunks);
    assert!(verify(reopen(dir.path()).await).await.unwrap().is_clean());
}

/// `summary` is exactly what the tree uses: its slots with their references (counted), and
/// its nodes (`leaves` and `interior` more).
fn assert_exact(
    summary: &GroupSummary,
    used: &GroupSummary,
    leaves: &[cairn_format::Id],
    interior: usize,
) {
    assert!(summary.is_counted(), "{summary:?}");
    assert!(summary.groups().eq(used.groups()));
    assert_eq!(summary.repeats(), used.repeats());
    assert!(leaves.iter().all(|n| summary.has_node(n)));
    let distinct: std::collections::HashSet<_> = leaves.iter().collect();
    assert_eq!(
        summary.nodes().len(),
        distinct.len() + interior,
        "the new tree's nodes only"
    );
}

/// The reference summary a commit writes lists exactly the slots its tree uses, with their
/// references, and every node; a patch's too, though its untouched leaves are not read: the
/// base's counted summary, minus the leaves it replaced, plus the ones it built.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reference_summaries_list_what_the_tree_uses() {
    let dir = tempfile::tempdir().unwrap();
    let repo = v2_repo(dir.path()).await;
    let size = 4u64 << 20;
    let mut image = noise(size as usize, 7);
    image[1 << 20..(1 << 20) + (64 << 10)].fill(0); // 1,008 slots used
    let base = commit_bytes(&repo, "vm", image.clone()).await;
    let root = base.record.root.unwrap();
    let (summary, _) = repo.load_group_summary(&root).await.unwrap().unwrap();
    let (used, leaves) = used_by_tree(&repo, &base.record).await;
    // 16 leaves and the root (height 1 at fanout 256).
    assert!(summary.has_node(&root));

    assert_exact(&summary, &used, &leaves, 1);

    // A patch of 3 blocks in one segment: the 3 base slots they overwrote are gone from the
    // table (the segment's new leaf still uses its other 61); then a patch of 20 more.
    let mut p = Blocks(Default::default());
    for b in [1, 2, 40] {
        p.set(&mut image, b, noise(4096, 100 + b));
    }
    let v2 = patch(&repo, &base, size, &p).await;
    let (s2, used2, leaves2) = summary_and_use(&repo, &v2.record).await;
    assert_eq!(
        s2.slot_count(),
        summary.slot_count(),
        "3 slots replaced by 3 new ones"
    );
    assert_exact(&s2, &used2, &leaves2, 1);
    let mut q = Blocks(Default::default());
    for b in 0..20 {
        q.set(&mut image, b, noise(4096, 200 + b));
    }
    let v3 = patch(&repo, &v2, size, &q).await;
    let (s3, used3, leaves3) = summary_and_use(&repo, &v3.record).await;
    assert_exact(&s3, &used3, &leaves3, 1);
    assert!(restore_bytes(&repo, &v3.record).await.unwrap() == image);
}

/// A leaf may occur in a tree more than once (segments with the same bytes), and the
/// summary counts each occurrence: a commit that drops one of two occurrences keeps the
/// leaf's slots, one that adds an occurrence of a reused leaf counts it, and the summary is
/// exact after each — without reading the leaves the commit kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counted_summaries_follow_leaves_that_occur_twice() {
    let dir = tempfile::tempdir().unwrap();
    let repo = v2_repo(dir.path()).await;
    let seg = 256usize << 10;
    let mut image = noise(8 * seg, 31);
    let a = noise(seg, 32);
    image[..seg].copy_from_slice(&a);
    image[seg..2 * seg].copy_from_slice(&a);
    let v1 = commit_bytes(&repo, "vm", image.clone()).await;
    let (s1, used1, leaves1) = summary_and_use(&repo, &v1.record).await;
    assert_eq!(leaves1[0], leaves1[1], "segments 0 and 1 share a leaf");
    assert_eq!(
        used1.repeats().unwrap().len(),
        64,
        "each slot of the shared leaf"
    );
    assert_exact(&s1, &used1, &leaves1, 1);

    // Segment 1 changes: one occurrence of the shared leaf is dropped, its slots stay.
    image[seg + 4096..seg + 8192].copy_from_slice(&noise(4096, 33));
    let v2 = commit_bytes(&repo, "vm", image.clone()).await;
    assert_eq!(v2.reused_segments, 7);
    let (s2, used2, leaves2) = summary_and_use(&repo, &v2.record).await;
    assert_exact(&s2, &used2, &leaves2, 1);

    // Segments 2 and 3 take segment 0's bytes: the shared leaf, reused unread, occurs three
    // times (once more than in the parent).
    image.copy_within(..seg, 2 * seg);
    image.copy_within(..seg, 3 * seg);
    let v3 = commit_bytes(&repo, "vm", image.clone()).await;
    let (s3, used3, leaves3) = summary_and_use(&repo, &v3.record).await;
    assert_eq!(leaves3[2], leaves3[0]);
    assert_exact(&s3, &used3, &leaves3, 1);
    assert!(restore_bytes(&repo, &v3.record).await.unwrap() == image);
}

#[tokio::test]
async fn a_recommit_reuses_the_parents_unchanged_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let repo = v2_repo(dir.path()).await;
    let img = image();
    let a = commit_bytes(&repo, "vm", img.clone()).await;
    assert_eq!(a.reused_segments, 0, "no parent");
    let leaves = cairn_engine::tree::leaf_map(&repo, &a.record)
        .await
        .unwrap()
        .len() as u64;
    assert!(leaves >= 5, "{leaves}");

    // The same bytes: every leaf reused, the same tree, nothing stored, the same counts.
    let b = commit_bytes(&repo, "vm", img.clone()).await;
    assert_eq!(b.reused_segments, leaves);
    assert_eq!(b.record.root, a.record.root);
    assert_eq!(b.record.stats.new_chunks, 0);
    assert_eq!(b.record.stats.chunks, a.record.stats.chunks);
    assert_eq!(b.record.stats.data_bytes, a.record.stats.data_bytes);

    // One block changed: that segment alone takes the ordinary path.
    let mut changed = img.clone();
    changed[300_000..304_096].copy_from_slice(&noise(4096, 77));
    let c = commit_bytes(&repo, "vm", changed.clone()).await;
    assert_eq!(c.reused_segments, leaves - 1);
    assert_eq!(
        c.record.stats.new_chunks, 2,
        "the block straddles two 4 KiB chunks"
    );
    // The changed segment's other 62 chunks are found in the parent's leaf of that segment,
    // without an index lookup.
    assert_eq!(c.dedup.parent, 62);
    assert!(restore_bytes(&repo, &c.record).await.unwrap() == changed);
    assert!(restore_bytes(&repo, &b.record).await.unwrap() == img);

    // Another image has no parent: nothing reused, yet the same leaves by content.
    let d = commit_bytes(&repo, "other", img.clone()).await;
    assert_eq!(d.reused_segments, 0);
    assert_eq!(d.record.root, a.record.root);

    // Every leaf written carries its segment's digest.
    let reader = repo.v2().unwrap();
    for leaf in cairn_engine::tree::leaf_map(&repo, &c.record)
        .await
        .unwrap()
        .values()
    {
        let raw = reader.read_chunk(leaf).await.unwrap();
        assert!(RunLeaf::decode(&raw).unwrap().digest().is_some());
    }
}

/// A re-commit learns its parent's segment digests from the level-1 nodes, which carry
/// them: the unchanged leaves are reused unread (before, every leaf was read, each from the
/// pack of the commit that last changed it), the tree's reference summary covers them through
/// the parent's, and `verify` checks what the nodes carry against the leaves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recommit_reuses_unchanged_leaves_unread() {
    let dir = tempfile::tempdir().unwrap();
    let repo = v2_repo(dir.path()).await;
    let seg = 256usize << 10;
    let mut image = noise(16 * seg, 11);
    let mut head = commit_bytes(&repo, "vm", image.clone()).await;
    // Segments 0..8 changed one per commit: each leaf now sits in its own commit's pack.
    for s in 0..8 {
        image[s * seg + 8192..s * seg + 12288].copy_from_slice(&noise(4096, 50 + s as u64));
        head = commit_bytes(&repo, "vm", image.clone()).await;
    }
    let reader = repo.v2().unwrap();
    let leaves = cairn_engine::tree::leaf_refs(&repo, &head.record)
        .await
        .unwrap();
    assert_eq!(leaves.len(), 16);
    let mut old_packs = std::collections::HashSet::new();
    for (&s, leaf) in &leaves {
        let raw = reader.read_chunk(&leaf.id).await.unwrap();
        let digest = RunLeaf::decode(&raw).unwrap().leaf_digest();
        assert!(digest.is_some());
        assert_eq!(
            leaf.digest, digest,
            "the level-1 node carries leaf {s}'s digest"
        );
        if s < 7 {
            old_packs.insert(reader.locate_chunk(&leaf.id).await.unwrap().0.pack);
        }
    }
    assert_eq!(old_packs.len(), 7);

    // Change segment 15 and commit through a store that counts what is read.
    image[15 * seg..15 * seg + 4096].copy_from_slice(&noise(4096, 99));
    let counting = Arc::new(cairn_store::CountingStore::new(Arc::new(
        LocalStore::open(dir.path()).unwrap(),
    )));
    let repo2 = Arc::new(Repo::open(counting.clone()).await.unwrap());
    counting.reset();
    let c = commit_bytes(&repo2, "vm", image.clone()).await;
    assert_eq!(c.reused_segments, 15);
    let read: Vec<String> = counting.take_keys_read();
    for pack in &old_packs {
        assert!(
            !read.iter().any(|k| k.contains(&pack.to_string())),
            "pack {pack} of an unchanged leaf was read: {read:?}"
        );
    }
    assert_eq!(c.record.stats.chunks, head.record.stats.chunks);
    assert_eq!(c.record.stats.data_bytes, head.record.stats.data_bytes);
    assert!(restore_bytes(&repo2, &c.record).await.unwrap() == image);

    // The summary is exact (the overwritten slot is gone) though the unchanged leaves were
    // not read: the parent's counted summary, minus the changed leaf, plus its new one.
    let (summary, used, tree_leaves) = summary_and_use(&repo2, &c.record).await;
    assert_exact(&summary, &used, &tree_leaves, 1);
    let report = verify(repo2.clone()).await.unwrap();
    assert!(report.is_clean(), "{report:?}");
}

/// A session that opens while a GC plan is pending does not find what the plan hides (a GC
/// that does not wait for it rescues dead data only after its own wait). A re-commit then
/// reuses no parent leaf it cannot locate: it stores them again rather than failing, or
/// referring to a leaf its index does not hold (found by the GC stress run: "blob … is not
/// in any index").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recommit_under_a_pending_plan_reuses_only_leaves_it_can_locate() {
    let dir = tempfile::tempdir().unwrap();
    let repo = v2_repo(dir.path()).await;
    let seg = 256usize << 10;
    let mut image = noise(8 * seg, 21);
    commit_bytes(&repo, "vm", image.clone()).await;
    let first_runs = repo.index_run_ids(&Default::default()).await.unwrap();
    image[..4096].copy_from_slice(&noise(4096, 22));
    let b = commit_bytes(&repo, "vm", image.clone()).await;
    // A pending plan hides the first commit's run, which locates most of b's leaves.
    let plan = repo
        .publish_gc_plan(&cairn_format::marker::GcPlan {
            created_ns: cairn_repo::session::now_ns(),
            dead_blobs: Vec::new(),
            superseded_index: first_runs,
        })
        .await
        .unwrap();
    image[3 * seg..3 * seg + 4096].copy_from_slice(&noise(4096, 23));
    let under_plan = reopen(dir.path()).await;
    assert!(under_plan.saw_any_plan());
    let c = commit_bytes(&under_plan, "vm", image.clone()).await;
    assert!(
        c.reused_segments < 7,
        "leaves the session cannot locate are not reused ({} were)",
        c.reused_segments
    );
    under_plan.withdraw_gc_plan(&plan).await;
    let repo = reopen(dir.path()).await;
    assert!(restore_bytes(&repo, &c.record).await.unwrap() == image);
    assert!(restore_bytes(&repo, &b.record).await.is_ok());
    assert!(verify(repo).await.unwrap().is_clean());
}

/// A re-commit checks the parent's summary at its start and reads it again at its end rather
/// than holding it through the pipeline. If it is gone by then (a GC deleted the version, the
/// object was damaged), the commit reads the leaves it reused instead and still writes an
/// exact, counted summary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_summary_gone_by_the_end_of_a_commit_is_replaced_by_the_reused_leaves() {
    let dir = tempfile::tempdir().unwrap();
    let repo = v2_repo(dir.path()).await;
    let seg = 256usize << 10;
    let mut image = noise(8 * seg, 51);
    let v1 = commit_bytes(&repo, "vm", image.clone()).await;
    let summary_key = cairn_format::keys::summary(&v1.record.root.unwrap());

    let store = Arc::new(FailingStore::new(
        Arc::new(LocalStore::open(dir.path()).unwrap()),
        usize::MAX,
    ));
    store.vanish_after(&summary_key, 1);
    let vanishing = Arc::new(Repo::open(store.clone()).await.unwrap());
    image[2 * seg..2 * seg + 4096].copy_from_slice(&noise(4096, 52));
    let v2 = commit_bytes(&vanishing, "vm", image.clone()).await;
    assert_eq!(
        v2.reused_segments, 7,
        "leaves reused unread, on the first read"
    );
    assert_eq!(
        store.vanishing_reads(),
        2,
        "read at the start, and again (not found) at the end"
    );

    let repo = Arc::new(
        Repo::open(Arc::new(LocalStore::open(dir.path()).unwrap()))
            .await
            .unwrap(),
    );
    let (summary, used, leaves) = summary_and_use(&repo, &v2.record).await;
    assert_exact(&summary, &used, &leaves, 1);
    assert!(restore_bytes(&repo, &v2.record).await.unwrap() == image);
    assert!(verify(repo).await.unwrap().is_clean());
}

/// A base whose summary carries no counts (written before counts existed, or rebuilt by GC):
/// the commit over it reads the leaves it reuses and writes an exact, counted summary, which
/// the next commit derives from.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_over_an_uncounted_summary_reads_its_reused_leaves_once() {
    let dir = tempfile::tempdir().unwrap();
    let repo = v2_repo(dir.path()).await;
    let seg = 256usize << 10;
    let mut image = noise(8 * seg, 41);
    let v1 = commit_bytes(&repo, "vm", image.clone()).await;
    let root = v1.record.root.unwrap();
    let (mut uncounted, _) = repo.load_group_summary(&root).await.unwrap().unwrap();
    uncounted.forget_counts();
    repo.delete_summary(&root).await.unwrap();
    repo.put_group_summary(&root, &uncounted, None)
        .await
        .unwrap();
    let (back, _) = repo.load_group_summary(&root).await.unwrap().unwrap();
    assert!(!back.is_counted());

    for (round, s) in [(1u64, 3usize), (2, 5)] {
        image[s * seg..s * seg + 4096].copy_from_slice(&noise(4096, 40 + round));
        let v = commit_bytes(&repo, "vm", image.clone()).await;
        assert_eq!(v.reused_segments, 7);
        let (summary, used, leaves) = summary_and_use(&repo, &v.record).await;
        assert_exact(&summary, &used, &leaves, 1);
    }
}

//! COMMIT of a patch (base version + changed blocks): content, cost, summary, history,
//! failure and concurrency.

use cairn_format::keys;
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use cairn_engine::commit::patch::{commit_patch, PatchOptions, PatchSource};
use cairn_engine::commit::CommitResult;
use cairn_engine::diff::{diff, ChangedRange};
use cairn_engine::gc::{gc, GcMode, GcOptions};
use cairn_engine::resolve::{history, origin, VersionSpec};
use cairn_engine::tree::leaf_map;
use cairn_format::config::Chunker;
use cairn_format::version::VersionRecord;
use cairn_repo::Repo;
use cairn_store::{CountingStore, MemoryStore, ObjectStore};

const CHUNK: u32 = 16 << 10;
const SEGMENT: u32 = 1 << 20;

/// Changed blocks held in memory; `fail` makes reading that block fail.
struct MemPatch {
    block_size: u32,
    blocks: BTreeMap<u64, Vec<u8>>,
    fail: Option<u64>,
}

impl MemPatch {
    fn new(block_size: u32) -> Self {
        MemPatch {
            block_size,
            blocks: BTreeMap::new(),
            fail: None,
        }
    }

    /// Sets block `index` (clipped to `size`) and applies it to `image`.
    fn set(&mut self, image: &mut [u8], index: u64, data: Vec<u8>) {
        let start = (index * self.block_size as u64) as usize;
        let end = (start + self.block_size as usize).min(image.len());
        let data = data[..end - start].to_vec();
        image[start..end].copy_from_slice(&data);
        self.blocks.insert(index, data);
    }
}

impl PatchSource for MemPatch {
    fn block_size(&self) -> u32 {
        self.block_size
    }
    fn changed_blocks(&self) -> Vec<u64> {
        self.blocks.keys().copied().collect()
    }
    fn read_block(&self, index: u64) -> io::Result<Vec<u8>> {
        if self.fail == Some(index) {
            return Err(io::Error::other("overlay file vanished"));
        }
        Ok(self.blocks[&index].clone())
    }
}

async fn new_repo(store: Arc<dyn ObjectStore>, chunker: Chunker) -> Arc<Repo> {
    let mut cfg = config(CHUNK, SEGMENT);
    cfg.chunker = chunker;
    Arc::new(Repo::init(store, cfg).await.unwrap())
}

async fn listing(store: &dyn ObjectStore) -> BTreeSet<(String, u64)> {
    store
        .list("")
        .await
        .unwrap()
        .into_iter()
        .map(|m| (m.key, m.size))
        .collect()
}

async fn patch(
    repo: &Arc<Repo>,
    image: &str,
    base: Option<&CommitResult>,
    size: u64,
    p: &MemPatch,
) -> CommitResult {
    commit_patch(
        repo.clone(),
        image,
        base.map(|b| (b.id, b.record.clone())),
        size,
        p,
        PatchOptions {
            message: "patch".into(),
            ..PatchOptions::default()
        },
    )
    .await
    .unwrap()
}

/// GC's fast deletion relies on this: the summary lists exactly the group slots the tree
/// uses, with their references, and names every node of the tree.
async fn assert_summary_complete(repo: &Arc<Repo>, record: &VersionRecord) {
    let (summary, used, _) = summary_and_use(repo, record).await;
    assert!(summary.groups().eq(used.groups()));
    assert_eq!(summary.repeats(), used.repeats());
    assert!(summary.slot_count() > 0);
    let TreeBlobs { nodes } = tree_blobs(repo, record).await;
    for n in &nodes {
        assert!(summary.has_node(n), "node {n} missing from the summary");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_patch_reads_and_writes_only_the_change() {
    let log = Arc::new(CountingStore::new(Arc::new(MemoryStore::new())));
    let store: Arc<dyn ObjectStore> = log.clone();
    let repo = new_repo(store.clone(), Chunker::Fixed).await;
    let size = (20u64 << 20) + 5000; // the last block is partial
    let mut image = noise(size as usize, 1);
    let base = commit_bytes(&repo, "vm", image.clone()).await;

    let mut p = MemPatch::new(CHUNK);
    let last = (size - 1) / CHUNK as u64;
    for (n, b) in [3u64, 700, last].into_iter().enumerate() {
        p.set(&mut image, b, noise(CHUNK as usize, 100 + n as u64));
    }
    let before = listing(store.as_ref()).await;
    log.take_keys_read();
    log.reset();
    let new = patch(&repo, "vm", Some(&base), size, &p).await;
    let reads = log.take_keys_read();
    let read_bytes = log.bytes_read();
    let after = listing(store.as_ref()).await;

    // Content, parent, stats.
    assert_eq!(restore_bytes(&repo, &new.record).await.unwrap(), image);
    assert_eq!(new.record.parent, Some(base.id));
    assert_eq!(new.record.seq, 2);
    let st = new.record.stats;
    assert_eq!(st.new_chunks, 3);
    assert_eq!(st.new_chunk_bytes, 2 * CHUNK as u64 + 5000);
    assert_eq!(st.chunks, base.record.stats.chunks);
    assert_eq!(st.data_bytes, size);

    // Reads stay within the touched segments: each is rebuilt from its base groups (a group
    // is recompressed whole), so at most those 3 of the 21 MiB-segments' data is read, plus
    // metadata.
    assert!(read_bytes < 4 << 20, "{read_bytes} bytes read: {reads:?}");

    // Written: the new data and nodes in packs, one index run, the summary and the version
    // record.
    let written: Vec<_> = after.difference(&before).cloned().collect();
    let kinds: BTreeSet<&str> = written
        .iter()
        .map(|(k, _)| k.split('/').next().unwrap())
        .collect();
    assert_eq!(
        kinds,
        BTreeSet::from(["index-runs", "packs", "summaries", "versions"]),
        "{written:?}"
    );
    let runs = written.iter().filter(|(k, _)| k.starts_with("index-runs/"));
    assert_eq!(runs.count(), 1, "{written:?}");
    let bytes: u64 = written.iter().map(|(_, n)| n).sum();
    eprintln!(
        "3-block patch of a 20 MiB image: {} objects, {bytes} bytes written (stored_bytes {}, \
         incl. the ref): {written:?}",
        written.len(),
        st.stored_bytes
    );
    assert!(st.stored_bytes >= bytes && st.stored_bytes < bytes + 200);

    // Diff reports exactly the changed blocks.
    let report = diff(&repo, &base.record, &new.record).await.unwrap();
    let want: Vec<ChangedRange> = [3u64, 700, last]
        .iter()
        .map(|&b| ChangedRange {
            offset: b * CHUNK as u64,
            len: (size - b * CHUNK as u64).min(CHUNK as u64),
        })
        .collect();
    assert_eq!(report.ranges, want);

    // The same bytes committed in full give the very same tree.
    let full = commit_bytes(&repo, "vm-full", image).await;
    assert_eq!(full.record.root, new.record.root);
    assert_summary_complete(&repo, &new.record).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zeros_holes_sparse_regions_and_growth() {
    let store: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new());
    let repo = new_repo(store, Chunker::Fixed).await;
    // 4 MiB + 1000: data in segments 0, 1 and 4 (partial), zeros in 2 and 3.
    let size = (4u64 << 20) + 1000;
    let mut image = vec![0u8; size as usize];
    image[..2 << 20].copy_from_slice(&noise(2 << 20, 2));
    let tail = image.len() - 1000;
    image[tail..].copy_from_slice(&noise(1000, 3));
    let base = commit_bytes(&repo, "vm", image.clone()).await;
    let per_seg = (SEGMENT / CHUNK) as u64;

    let mut p = MemPatch::new(CHUNK);
    p.set(&mut image, 5, vec![0; CHUNK as usize]); // a hole over data
    for b in per_seg..2 * per_seg {
        p.set(&mut image, b, vec![0; CHUNK as usize]); // a whole segment of zeros
    }
    p.set(&mut image, 3 * per_seg + 7, noise(CHUNK as usize, 4)); // data in a sparse region
    let new = patch(&repo, "vm", Some(&base), size, &p).await;
    assert_eq!(restore_bytes(&repo, &new.record).await.unwrap(), image);
    let leaves = leaf_map(&repo, &new.record).await.unwrap();
    assert_eq!(leaves.keys().copied().collect::<Vec<_>>(), [0, 3, 4]);
    assert_eq!(new.record.stats.new_chunks, 1);
    assert_eq!(
        new.record.stats.chunks,
        base.record.stats.chunks - per_seg - 1 + 1
    );
    assert_eq!(
        new.record.stats.data_bytes,
        base.record.stats.data_bytes - (per_seg + 1) * CHUNK as u64 + CHUNK as u64
    );
    let full = commit_bytes(&repo, "full1", image.clone()).await;
    assert_eq!(full.record.root, new.record.root);
    assert_eq!(full.record.stats.chunks, new.record.stats.chunks);
    assert_summary_complete(&repo, &new.record).await;

    // Growth: the partial last segment and chunk get longer, new segments are zeros except
    // a patched block; the tree may get a level higher.
    let grown = (300u64 << 20) + 777;
    let mut bigger = image.clone();
    bigger.resize(grown as usize, 0);
    let mut g = MemPatch::new(CHUNK);
    g.set(
        &mut bigger,
        (299u64 << 20) / CHUNK as u64,
        noise(CHUNK as usize, 5),
    );
    g.set(
        &mut bigger,
        (grown - 1) / CHUNK as u64,
        noise(CHUNK as usize, 6),
    );
    let v3 = patch(&repo, "vm", Some(&new), grown, &g).await;
    assert_eq!(v3.record.height, 2);
    assert_eq!(v3.record.logical_size, grown);
    assert_eq!(restore_bytes(&repo, &v3.record).await.unwrap(), bigger);
    let full = commit_bytes(&repo, "full2", bigger).await;
    assert_eq!(full.record.root, v3.record.root);
    assert_eq!(full.record.stats.chunks, v3.record.stats.chunks);
    assert_eq!(full.record.stats.data_bytes, v3.record.stats.data_bytes);
    assert_summary_complete(&repo, &v3.record).await;

    // Shrinking is refused.
    let err = commit_patch(
        repo.clone(),
        "vm",
        Some((v3.id, v3.record.clone())),
        grown - 1,
        &MemPatch::new(CHUNK),
        PatchOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("shrinking"), "{err}");

    // No base: zeros plus the blocks; blocks smaller than a chunk (materialized path).
    let mut fresh = vec![0u8; 3 << 20];
    let mut q = MemPatch::new(4096);
    q.set(&mut fresh, 1, noise(4096, 7));
    q.set(&mut fresh, 300, noise(4096, 8));
    q.set(&mut fresh, 301, vec![0; 4096]);
    let v = patch(&repo, "fresh", None, 3 << 20, &q).await;
    assert_eq!((v.record.seq, v.record.parent), (1, None));
    assert_eq!(restore_bytes(&repo, &v.record).await.unwrap(), fresh);
    let full = commit_bytes(&repo, "full3", fresh).await;
    assert_eq!(full.record.root, v.record.root);
    assert_eq!(v.record.stats.chunks, 2);
    assert_summary_complete(&repo, &v.record).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fastcdc_patch_restores_bit_exact() {
    let store: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new());
    let repo = new_repo(store, Chunker::FastCdc).await;
    let size = (6u64 << 20) + 12345;
    let mut image = noise(size as usize, 9);
    let base = commit_bytes(&repo, "vm", image.clone()).await;
    let mut p = MemPatch::new(CHUNK);
    for (n, b) in [0u64, 64, 65, 200, (size - 1) / CHUNK as u64]
        .into_iter()
        .enumerate()
    {
        p.set(&mut image, b, noise(CHUNK as usize, 20 + n as u64));
    }
    let new = patch(&repo, "vm", Some(&base), size, &p).await;
    assert_eq!(restore_bytes(&repo, &new.record).await.unwrap(), image);
    let full = commit_bytes(&repo, "full", image).await;
    assert_eq!(full.record.root, new.record.root);
    assert_eq!(full.record.stats.chunks, new.record.stats.chunks);
    assert_summary_complete(&repo, &new.record).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn patch_into_a_new_image_starts_at_the_base() {
    let store: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new());
    let repo = new_repo(store, Chunker::Fixed).await;
    let mut image = noise(3 << 20, 10);
    let golden = commit_bytes(&repo, "golden", image.clone()).await;
    let mut p = MemPatch::new(CHUNK);
    p.set(&mut image, 70, noise(CHUNK as usize, 11));
    let new = patch(&repo, "vm2", Some(&golden), 3 << 20, &p).await;
    assert_eq!(new.record.parent, Some(golden.id));
    assert_eq!((new.record.seq, new.record.image.as_str()), (1, "vm2"));
    let h = history(&repo, "vm2").await.unwrap();
    assert_eq!(h.iter().map(|(id, _)| *id).collect::<Vec<_>>(), [new.id]);
    assert_eq!(
        origin(&repo, "vm2").await.unwrap().map(|(id, _)| id),
        Some(golden.id)
    );
    assert_eq!(restore_bytes(&repo, &new.record).await.unwrap(), image);
    // The golden image is untouched.
    assert_eq!(
        repo.head("golden").await.unwrap().unwrap().version,
        golden.id
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn summary_is_complete_when_rebuilt_and_gc_keeps_the_patched_version() {
    let store: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new());
    let repo = new_repo(store.clone(), Chunker::Fixed).await;
    let mut image = noise(5 << 20, 12);
    let base = commit_bytes(&repo, "vm", image.clone()).await;
    // Without the base's summary, the new one is rebuilt from the leaves.
    let root = base.record.root.unwrap();
    store.delete(&keys::summary(&root)).await.unwrap();
    let mut p = MemPatch::new(CHUNK);
    p.set(&mut image, 100, noise(CHUNK as usize, 13));
    let v2 = patch(&repo, "vm", Some(&base), 5 << 20, &p).await;
    assert_summary_complete(&repo, &v2.record).await;
    // With it (OR-ed into the base's).
    let mut p = MemPatch::new(CHUNK);
    p.set(&mut image, 200, noise(CHUNK as usize, 14));
    let v3 = patch(&repo, "vm", Some(&v2), 5 << 20, &p).await;
    assert_summary_complete(&repo, &v3.record).await;
    let (s3, _, _) = summary_and_use(&repo, &v3.record).await;
    assert_eq!(s3.nodes().len(), 6); // 5 leaves + the root

    // Deleting the older versions and collecting keeps everything the patch reuses.
    cairn_engine::remove::remove_versions(
        &repo,
        &[
            VersionSpec::parse("vm@1").unwrap(),
            VersionSpec::parse("vm@2").unwrap(),
        ],
    )
    .await
    .unwrap();
    let opts = GcOptions {
        mode: GcMode::Fast,
        poll: Duration::from_millis(10),
        ..Default::default()
    };
    let report = gc(&repo, &opts).await.unwrap();
    assert!(report.dead_blobs > 0, "{report:?}");
    let repo = Arc::new(Repo::open(store.clone()).await.unwrap());
    assert_eq!(restore_bytes(&repo, &v3.record).await.unwrap(), image);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_block_read_publishes_nothing() {
    let store: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new());
    let repo = new_repo(store.clone(), Chunker::Fixed).await;
    let mut image = noise(4 << 20, 15);
    let base = commit_bytes(&repo, "vm", image.clone()).await;
    let mut p = MemPatch::new(CHUNK);
    for b in [1u64, 90, 200] {
        p.set(&mut image, b, noise(CHUNK as usize, b));
    }
    p.fail = Some(90);
    let versions = store.list("versions/").await.unwrap().len();
    let indexes = store.list(keys::INDEX_RUNS).await.unwrap().len();
    let err = commit_patch(
        repo.clone(),
        "vm",
        Some((base.id, base.record.clone())),
        4 << 20,
        &p,
        PatchOptions::default(),
    )
    .await
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("changed block 90") && msg.contains("overlay file vanished"),
        "{msg}"
    );
    assert_eq!(repo.head("vm").await.unwrap().unwrap().version, base.id);
    assert_eq!(store.list("versions/").await.unwrap().len(), versions);
    assert_eq!(store.list(keys::INDEX_RUNS).await.unwrap().len(), indexes);
    // A block of the wrong length is refused too.
    p.fail = None;
    p.blocks.insert(90, vec![1; 10]);
    let err = commit_patch(
        repo.clone(),
        "vm",
        Some((base.id, base.record.clone())),
        4 << 20,
        &p,
        PatchOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("10 bytes read"), "{err}");
    assert_eq!(repo.head("vm").await.unwrap().unwrap().version, base.id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_landing_meanwhile_becomes_the_parent() {
    let store: Arc<dyn ObjectStore> = Arc::new(MemoryStore::new());
    let repo = new_repo(store, Chunker::Fixed).await;
    let mut image = noise(4 << 20, 16);
    let base = commit_bytes(&repo, "vm", image.clone()).await;
    // Another writer commits after the export opened on `base`.
    let other = commit_bytes(&repo, "vm", noise(4 << 20, 17)).await;
    let mut p = MemPatch::new(CHUNK);
    p.set(&mut image, 33, noise(CHUNK as usize, 18));
    let new = patch(&repo, "vm", Some(&base), 4 << 20, &p).await;
    assert_eq!((new.record.parent, new.record.seq), (Some(other.id), 3));
    assert_eq!(restore_bytes(&repo, &new.record).await.unwrap(), image);

    // Truly concurrent: a commit and a patch race for the head; both land, linearly.
    let mut p = MemPatch::new(CHUNK);
    p.set(&mut image, 34, noise(CHUNK as usize, 19));
    let (a, b) = tokio::join!(
        commit_bytes(&repo, "vm", noise(4 << 20, 20)),
        patch(&repo, "vm", Some(&new), 4 << 20, &p)
    );
    let h = history(&repo, "vm").await.unwrap();
    assert_eq!(h.len(), 5);
    let seqs: BTreeSet<u64> = [a.record.seq, b.record.seq].into();
    assert_eq!(seqs, BTreeSet::from([4, 5]));
    assert_eq!(restore_bytes(&repo, &b.record).await.unwrap(), image);
}

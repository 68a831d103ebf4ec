//! Incremental commits from a layered disk image: only the layers above the parent's are
//! read, the result restores bit-exact, and a bad premise (size) is refused.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::common::*;
use cairn_engine::commit::incremental::{commit_changes, layer_changes};
use cairn_engine::commit::DedupMode;
use cairn_format::config::Chunker;
use cairn_image::{Allocation, DiskImage, ImageResult, Layer, MapRun};
use cairn_repo::Repo;
use cairn_store::MemoryStore;

/// A two-layer image in memory: `top` defines the listed ranges (data or zeros), the rest
/// comes from `base`. Counts the bytes read.
struct Layered {
    base: Vec<u8>,
    size: u64,
    top: Vec<(u64, Vec<u8>, Allocation)>,
    read: AtomicU64,
}

impl Layered {
    fn contents(&self) -> Vec<u8> {
        let mut out = self.base.clone();
        out.resize(self.size as usize, 0);
        for (off, data, _) in &self.top {
            out[*off as usize..*off as usize + data.len()].copy_from_slice(data);
        }
        out
    }
}

impl DiskImage for Layered {
    fn describe(&self) -> String {
        "layered".into()
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn map(&self) -> ImageResult<Vec<MapRun>> {
        let mut runs = Vec::new();
        let mut pos = 0;
        let mut top = self.top.clone();
        top.sort_by_key(|t| t.0);
        for (off, data, alloc) in top {
            if off > pos {
                runs.push(MapRun {
                    start: pos,
                    len: off - pos,
                    alloc: Allocation::Data,
                    depth: 1,
                });
            }
            runs.push(MapRun {
                start: off,
                len: data.len() as u64,
                alloc,
                depth: 0,
            });
            pos = off + data.len() as u64;
        }
        if pos < self.size {
            runs.push(MapRun {
                start: pos,
                len: self.size - pos,
                alloc: Allocation::Data,
                depth: 1,
            });
        }
        Ok(runs)
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ImageResult<()> {
        let all = self.contents();
        buf.copy_from_slice(&all[offset as usize..offset as usize + buf.len()]);
        self.read.fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(())
    }
    fn layers(&self) -> Vec<Layer> {
        vec![]
    }
}

async fn repo(chunker: Chunker) -> Arc<Repo> {
    let mut cfg = config(16 << 10, 1 << 20);
    cfg.chunker = chunker;
    Arc::new(Repo::init(Arc::new(MemoryStore::new()), cfg).await.unwrap())
}

async fn overlay_round_trip(chunker: Chunker) {
    let repo = repo(chunker).await;
    let base = noise(6 << 20, 1);
    let parent = commit_bytes(&repo, "vm", base.clone()).await;
    let img = Arc::new(Layered {
        base,
        size: 7 << 20, // grown by 1 MiB
        top: vec![
            (100_000, noise(5000, 2), Allocation::Data),
            (3 << 20, vec![0u8; 200_000], Allocation::Zero),
            ((6 << 20) + 4096, noise(70_000, 3), Allocation::Data),
        ],
        read: AtomicU64::new(0),
    });
    let changed = layer_changes(img.as_ref(), 1).unwrap();
    assert_eq!((changed.data.len(), changed.zeros.len()), (2, 1));
    let (result, stats) = commit_changes(
        repo.clone(),
        "vm",
        (parent.id, parent.record.clone()),
        img.clone(),
        &changed,
        "overlay",
        DedupMode::Exact,
    )
    .await
    .unwrap();
    assert_eq!(stats.changed_bytes, 5000 + 200_000 + 70_000);
    let read = img.read.load(Ordering::Relaxed);
    assert_eq!(read, stats.read_bytes);
    // Data ranges rounded out to blocks, plus the partial blocks at the zero range's ends;
    // the zero range's inside is never read.
    assert!(
        read <= 5000 + 70_000 + 6 * 65536,
        "read {read} bytes for {} changed",
        stats.changed_bytes
    );
    assert_eq!(result.record.seq, 2);
    assert_eq!(result.record.logical_size, 7 << 20);
    assert_eq!(
        restore_bytes(&repo, &result.record).await.unwrap(),
        img.contents()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlay_commit_reads_only_the_overlay_fixed() {
    overlay_round_trip(Chunker::Fixed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overlay_commit_reads_only_the_overlay_fastcdc() {
    overlay_round_trip(Chunker::FastCdc).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_smaller_than_its_parent_is_refused() {
    let repo = repo(Chunker::Fixed).await;
    let parent = commit_bytes(&repo, "vm", noise(2 << 20, 1)).await;
    let img = Arc::new(Layered {
        base: noise(1 << 20, 1),
        size: 1 << 20,
        top: vec![],
        read: AtomicU64::new(0),
    });
    let err = commit_changes(
        repo.clone(),
        "vm",
        (parent.id, parent.record.clone()),
        img,
        &Default::default(),
        "",
        DedupMode::default(),
    )
    .await
    .err()
    .unwrap();
    assert_eq!(
        err.to_string(),
        "layered has 1048576 bytes but its parent vm@1 has 2097152: an incremental commit \
         cannot shrink an image"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zeros_over_zeros_are_no_change() {
    // The parent has data in its first MiB only; the overlay zeroes 3 MiB from offset 512 KiB
    // (as `qemu-img convert -B` does for every zero area): only the first segment changes.
    let repo = repo(Chunker::Fixed).await;
    let mut base = noise(1 << 20, 5);
    base.resize(4 << 20, 0);
    let parent = commit_bytes(&repo, "vm", base.clone()).await;
    let img = Arc::new(Layered {
        base,
        size: 4 << 20,
        top: vec![(512 << 10, vec![0u8; 3 << 20], Allocation::Zero)],
        read: AtomicU64::new(0),
    });
    let changes = layer_changes(img.as_ref(), 1).unwrap();
    let (result, stats) = commit_changes(
        repo.clone(),
        "vm",
        (parent.id, parent.record.clone()),
        img.clone(),
        &changes,
        "",
        DedupMode::Bounded,
    )
    .await
    .unwrap();
    assert_eq!(stats.changed_bytes, 512 << 10);
    assert_eq!(stats.read_bytes, 0);
    assert_eq!(
        restore_bytes(&repo, &result.record).await.unwrap(),
        img.contents()
    );
}

#[test]
fn layer_changes_ignores_unallocated_and_deeper_runs() {
    let img = Layered {
        base: vec![],
        size: 100,
        top: vec![
            (10, vec![1; 10], Allocation::Data),
            (20, vec![0; 5], Allocation::Zero),
        ],
        read: AtomicU64::new(0),
    };
    let changes = layer_changes(&img, 1).unwrap();
    assert_eq!(changes.data, vec![(10, 20)]);
    assert_eq!(changes.zeros, vec![(20, 25)]);
    assert_eq!(layer_changes(&img, 0).unwrap(), Default::default());
}

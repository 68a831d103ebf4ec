//! Bit-exact round trips through commit and restore, including the edge cases.

use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::Arc;
use std::time::Instant;

use crate::common::*;
use cairn_engine::resolve::{history, resolve, VersionSpec};
use cairn_engine::restore::{restore, RestoreOptions, RestoreTarget};
use cairn_engine::source::Source;
use cairn_format::config::Chunker;
use cairn_repo::Repo;
use cairn_store::{LocalStore, MemoryStore};

async fn memory_repo(chunk: u32, segment: u32) -> Arc<Repo> {
    Arc::new(
        Repo::init(Arc::new(MemoryStore::new()), config(chunk, segment))
            .await
            .unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_case_sizes_round_trip() {
    let repo = memory_repo(4096, 65536).await;
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", vec![]),
        ("one-byte", vec![42]),
        ("unaligned", noise(65536 * 3 + 4097, 1)),
        ("all-zero", vec![0; 300_000]),
        ("zeros-and-data", {
            let mut v = vec![0u8; 500_000];
            v[131_072..140_000].copy_from_slice(&noise(8928, 2));
            v
        }),
    ];
    for (name, data) in cases {
        let c = commit_bytes(&repo, name, data.clone()).await;
        assert_eq!(c.record.logical_size, data.len() as u64, "{name}");
        assert_eq!(
            restore_bytes(&repo, &c.record).await.unwrap(),
            data,
            "{name}"
        );
    }
    let all_zero = resolve(&repo, &VersionSpec::parse("all-zero").unwrap())
        .await
        .unwrap()
        .1;
    assert!(
        all_zero.root.is_none(),
        "an all-zero image has no manifest nodes"
    );
    assert_eq!(all_zero.stats.data_bytes, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fastcdc_round_trip_and_dedup_of_shifted_data() {
    let mut cfg = config(8192, 1 << 20);
    cfg.chunker = Chunker::FastCdc;
    let repo = Arc::new(Repo::init(Arc::new(MemoryStore::new()), cfg).await.unwrap());
    let base = noise(3 << 20, 3);
    let a = commit_bytes(&repo, "cdc", base.clone()).await;
    assert_eq!(restore_bytes(&repo, &a.record).await.unwrap(), base);
    // Insert 100 bytes near the start of segment 1: only that segment's chunks change.
    let mut shifted = base.clone();
    shifted.splice((1 << 20) + 5000..(1 << 20) + 5000, noise(100, 4));
    shifted.truncate(base.len());
    let b = commit_bytes(&repo, "cdc", shifted.clone()).await;
    assert_eq!(restore_bytes(&repo, &b.record).await.unwrap(), shifted);
    assert!(
        b.record.stats.new_chunk_bytes < (1 << 20),
        "new {} bytes: CDC should resynchronise within the segment",
        b.record.stats.new_chunk_bytes
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn recommit_of_unchanged_image_stores_almost_nothing() {
    let repo = memory_repo(16384, 1 << 20).await;
    let data = noise(8 << 20, 5);
    let first = commit_bytes(&repo, "vm", data.clone()).await;
    assert!(
        first.record.stats.stored_bytes > 8 << 20,
        "noise does not compress"
    );
    let again = commit_bytes(&repo, "vm", data.clone()).await;
    assert_eq!(again.record.seq, 2);
    assert_eq!(again.record.parent, Some(first.id));
    assert_eq!(
        again.record.root, first.record.root,
        "same content, same manifest root"
    );
    assert_eq!(again.record.stats.new_chunks, 0);
    assert!(
        again.record.stats.stored_bytes < (8 << 20) / 1000,
        "stored {} bytes for an unchanged image",
        again.record.stats.stored_bytes
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_change_rewrites_one_leaf_and_the_path_to_the_root() {
    let repo = memory_repo(4096, 65536).await;
    let mut data = noise(64 << 20, 6); // 1024 segments → tree height 2
    let first = commit_bytes(&repo, "vm", data.clone()).await;
    assert_eq!(first.record.height, 2);
    data[40 << 20] ^= 0xff;
    let second = commit_bytes(&repo, "vm", data.clone()).await;
    // One new chunk, one new leaf, one level-1 node, one root.
    assert_eq!(second.record.stats.new_chunks, 1);
    let old_nodes: std::collections::HashSet<_> = tree_blobs(&repo, &first.record)
        .await
        .nodes
        .into_iter()
        .collect();
    let new_nodes = tree_blobs(&repo, &second.record).await.nodes;
    assert_eq!(
        new_nodes.iter().filter(|n| !old_nodes.contains(n)).count(),
        3
    );
    assert_eq!(restore_bytes(&repo, &second.record).await.unwrap(), data);
    assert_eq!(
        restore_bytes(&repo, &first.record).await.unwrap()[40 << 20],
        data[40 << 20] ^ 0xff
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn huge_sparse_file_costs_only_its_data() {
    let dir = tempfile::tempdir().unwrap();
    let repo = Arc::new(
        Repo::init(
            Arc::new(LocalStore::create(dir.path().join("repo")).unwrap()),
            config(16384, 1 << 20),
        )
        .await
        .unwrap(),
    );
    let path = dir.path().join("sparse.raw");
    let f = File::create(&path).unwrap();
    f.set_len(100 << 30).unwrap(); // 100 GiB
    let mut expected = Vec::new();
    for (i, off) in [0u64, 7 << 30, 50 << 30, (100 << 30) - 3 * 4096]
        .iter()
        .enumerate()
    {
        let d = noise(3 * 4096 - i, i as u64 + 10);
        f.write_all_at(&d, *off).unwrap();
        expected.push((*off, d));
    }
    f.sync_all().unwrap();
    let started = Instant::now();
    let c = commit_path(&repo, "big", &path).await;
    let took = started.elapsed();
    assert_eq!(c.record.logical_size, 100 << 30);
    assert!(c.record.stats.data_bytes < 100_000);
    assert!(
        c.record.stats.stored_bytes < 500_000,
        "stored {}",
        c.record.stats.stored_bytes
    );
    // Work is proportional to data: far below what reading 100 GiB would take. (Not a timing
    // assertion on speed, a sanity bound that fails only if holes were read.)
    assert!(
        took.as_secs() < 60,
        "commit of a sparse 100 GiB file took {took:?}"
    );

    let out = dir.path().join("restored.raw");
    restore(
        repo.clone(),
        &c.record,
        RestoreTarget::Path(out.clone()),
        RestoreOptions::default(),
    )
    .await
    .unwrap();
    let meta = std::fs::metadata(&out).unwrap();
    assert_eq!(meta.len(), 100 << 30);
    assert!(
        meta.blocks() * 512 < 1 << 20,
        "restored file is sparse ({} blocks)",
        meta.blocks()
    );
    let r = File::open(&out).unwrap();
    for (off, d) in expected {
        let mut buf = vec![0; d.len()];
        r.read_exact_at(&mut buf, off).unwrap();
        assert_eq!(buf, d);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn file_and_stream_sources_give_the_same_version_content() {
    let dir = tempfile::tempdir().unwrap();
    let repo = memory_repo(16384, 1 << 20).await;
    let mut data = noise(5 << 20, 7);
    data[(2 << 20)..(3 << 20)].fill(0);
    let path = write_file(dir.path(), "img.raw", &data);
    let a = commit_path(&repo, "file", &path).await;
    let b = commit_bytes(&repo, "stream", data.clone()).await;
    assert_eq!(a.record.root, b.record.root);
    assert_eq!(
        b.record.stats.new_chunks, 0,
        "everything deduplicated across images"
    );
    let log = history(&repo, "file").await.unwrap();
    assert_eq!(log.len(), 1);
}

/// A source that reports a size other than the one it was read at (a file resized during
/// the commit).
struct ResizedSource(cairn_engine::source::StreamSource<std::io::Cursor<Vec<u8>>>);

impl Source for ResizedSource {
    fn describe(&self) -> String {
        "disk.raw".into()
    }
    fn size_hint(&self) -> Option<u64> {
        self.0.size_hint()
    }
    fn data_hint(&self) -> Option<u64> {
        self.0.data_hint()
    }
    fn next_segment(
        &mut self,
        segment_size: u32,
        buf: Vec<u8>,
    ) -> cairn_engine::EngineResult<Option<cairn_engine::source::Segment>> {
        self.0.next_segment(segment_size, buf)
    }
    fn final_size(&self) -> u64 {
        self.0.final_size()
    }
    fn size_now(&self) -> Option<u64> {
        Some(self.0.final_size() + 4096)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_changes_size_while_read_publishes_nothing() {
    let repo = memory_repo(4096, 65536).await;
    let data = noise(300_000, 9);
    let src = ResizedSource(cairn_engine::source::StreamSource::new(
        "disk.raw",
        std::io::Cursor::new(data),
    ));
    let err = cairn_engine::commit::commit(
        repo.clone(),
        "vm",
        Box::new(src),
        cairn_engine::commit::CommitOptions::default(),
    )
    .await
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "disk.raw changed size while it was read (300000 -> 304096 bytes); nothing was \
         published: commit a stopped VM's disk, or a snapshot of it"
    );
    assert!(repo.images().await.unwrap().is_empty(), "nothing published");
}

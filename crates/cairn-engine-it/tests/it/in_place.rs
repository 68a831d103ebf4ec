//! In-place restore: an existing file becomes a version with only what differs written —
//! by the two trees' diff when the file is known to hold a version, by comparing it
//! otherwise — and what must not be written is refused before any byte is.

use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::sync::Arc;

use crate::common::*;
use cairn_engine::restore::in_place::{
    restore_in_place, InPlaceMethod, InPlaceOptions, InPlaceStats, InPlaceTarget,
};
use cairn_format::version::VersionRecord;
use cairn_repo::Repo;
use cairn_store::MemoryStore;

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const SIZE: usize = 8 * MIB;

/// Version A: data in segments 0, 1, 2, 4 and 6 (of 8), zeros elsewhere.
fn version_a() -> Vec<u8> {
    let mut a = vec![0u8; SIZE];
    for seg in [0, 1, 2, 4, 6] {
        a[seg * MIB..(seg + 1) * MIB].copy_from_slice(&noise(MIB, seg as u64 + 1));
    }
    a
}

/// Version B: A with twenty 4 KiB blocks of segment 1 rewritten, 256 KiB of segment 2
/// zeroed, and segment 5 (zeros in A) filled.
fn version_b(a: &[u8]) -> Vec<u8> {
    let mut b = a.to_vec();
    for i in 0..20 {
        let at = MIB + i * 48 * KIB;
        b[at..at + 4 * KIB].copy_from_slice(&noise(4 * KIB, 100 + i as u64));
    }
    b[2 * MIB..2 * MIB + 256 * KIB].fill(0);
    b[5 * MIB..6 * MIB].copy_from_slice(&noise(MIB, 55));
    b
}

async fn in_place(
    repo: &Arc<Repo>,
    version: &VersionRecord,
    path: &Path,
    holds: Option<&VersionRecord>,
    resize: bool,
) -> Result<InPlaceStats, String> {
    let target =
        InPlaceTarget::open(path, version, resize, holds.is_some()).map_err(|e| e.to_string())?;
    let options = InPlaceOptions {
        holds: holds.cloned(),
        ..Default::default()
    };
    restore_in_place(repo.clone(), version, target, options)
        .await
        .map_err(|e| e.to_string())
}

fn allocated(path: &Path) -> u64 {
    std::fs::metadata(path).unwrap().blocks() * 512
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_place_writes_only_what_differs_by_diff_and_by_compare() {
    for encrypted in [false, true] {
        let repo = init_format2(
            Arc::new(MemoryStore::new()),
            config(4096, MIB as u32),
            encrypted,
        )
        .await;
        let a = version_a();
        let b = version_b(&a);
        let va = commit_bytes(&repo, "disk", a.clone()).await.record;
        let vb = commit_bytes(&repo, "disk", b.clone()).await.record;
        let dir = tempfile::tempdir().unwrap();
        let path = write_file(dir.path(), "disk.raw", &a);
        let inode = std::fs::metadata(&path).unwrap().ino();

        // Known to hold A: the diff names the ranges; the file is not read.
        let s = in_place(&repo, &vb, &path, Some(&va), false).await.unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b, "encrypted: {encrypted}");
        assert_eq!(s.method, InPlaceMethod::Diff);
        assert_eq!(s.target_read_bytes, 0);
        // 20 blocks and one segment of data, 256 KiB of zeros: exactly, at 4 KiB chunks.
        assert_eq!(s.written_bytes, (20 * 4 * KIB + MIB) as u64);
        assert_eq!(s.zeroed_bytes, (256 * KIB) as u64);
        assert_eq!(
            std::fs::metadata(&path).unwrap().ino(),
            inode,
            "written in place"
        );

        // Unknown content: three blocks damaged in data, one segment V holds as zeros
        // filled. Compared segment by segment: only those are written.
        let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        for at in [100 * KIB, 4 * MIB + 8 * KIB, 6 * MIB + 1020 * KIB] {
            f.write_all_at(&noise(4 * KIB, at as u64), at as u64)
                .unwrap();
        }
        f.write_all_at(&noise(MIB, 7), 7 * MIB as u64).unwrap();
        f.sync_all().unwrap();
        let before = allocated(&path);
        let s = in_place(&repo, &vb, &path, None, false).await.unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b);
        assert_eq!(s.method, InPlaceMethod::Compare);
        assert_eq!(s.target_read_bytes, SIZE as u64);
        assert_eq!(s.written_bytes, (3 * 4 * KIB) as u64);
        assert_eq!(s.zeroed_bytes, MIB as u64);
        assert_eq!(s.segments_unchanged, 4, "segments 1, 2, 3 and 5 match");
        // Chunk by chunk: the groups of the three blocks, not their three whole segments.
        assert!(s.fetched_bytes < MIB as u64, "fetched {}", s.fetched_bytes);
        assert!(
            allocated(&path) + MIB as u64 <= before,
            "the zeroed segment is a hole again ({before} -> {} bytes allocated)",
            allocated(&path)
        );

        // Already the version: nothing is written.
        let s = in_place(&repo, &vb, &path, None, false).await.unwrap();
        assert_eq!((s.written_bytes, s.zeroed_bytes), (0, 0));
        assert_eq!(s.segments_unchanged, 8);
        assert_eq!(s.fetched_bytes, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_place_refuses_what_it_must_not_write_and_resizes_when_asked() {
    let repo = init_format2(
        Arc::new(MemoryStore::new()),
        config(4096, MIB as u32),
        false,
    )
    .await;
    let a = version_a();
    let va = commit_bytes(&repo, "disk", a.clone()).await.record;
    let dir = tempfile::tempdir().unwrap();

    let missing = dir.path().join("missing.raw");
    let e = in_place(&repo, &va, &missing, None, false)
        .await
        .unwrap_err();
    assert!(e.contains("it does not exist"), "{e}");

    // Another size: refused, the file untouched; resized when asked.
    let short = write_file(dir.path(), "short.raw", &a[..3 * MIB]);
    let e = in_place(&repo, &va, &short, None, false).await.unwrap_err();
    assert!(
        e.ends_with(&format!(
            "it has {} bytes and disk@1 has {SIZE}; pass --resize to make it that size",
            3 * MIB
        )),
        "{e}"
    );
    assert_eq!(std::fs::read(&short).unwrap(), &a[..3 * MIB]);
    let s = in_place(&repo, &va, &short, None, true).await.unwrap();
    assert_eq!(s.resized_from, Some(3 * MIB as u64));
    assert_eq!(std::fs::read(&short).unwrap(), a);
    let long = write_file(dir.path(), "long.raw", &[&a[..], &noise(MIB, 9)].concat());
    in_place(&repo, &va, &long, None, true).await.unwrap();
    assert_eq!(std::fs::read(&long).unwrap(), a);

    // A qcow2 file's bytes are not the guest's disk.
    let mut qcow2 = a.clone();
    qcow2[..4].copy_from_slice(b"QFI\xfb");
    let q = write_file(dir.path(), "disk.qcow2", &qcow2);
    let e = in_place(&repo, &va, &q, None, false).await.unwrap_err();
    assert!(e.contains("it is a qcow2 image"), "{e}");

    // A file another process locks (as QEMU locks a running VM's disk).
    let locked = write_file(dir.path(), "locked.raw", &a);
    let holder = std::fs::OpenOptions::new()
        .write(true)
        .open(&locked)
        .unwrap();
    assert!(cairn_engine::file_lock::lock_whole_file(&holder).unwrap());
    let e = in_place(&repo, &va, &locked, None, false)
        .await
        .unwrap_err();
    assert!(e.contains("it is in use"), "{e}");
    drop(holder);

    // A directory.
    let e = in_place(&repo, &va, dir.path(), None, false)
        .await
        .unwrap_err();
    assert!(e.contains("not a regular file or block device"), "{e}");
}

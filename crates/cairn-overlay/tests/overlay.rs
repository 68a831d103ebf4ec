mod common;

use std::sync::Arc;

use cairn_overlay::{Overlay, OverlayError};
use common::{pattern, read, write, BS};

const SIZE: u64 = 10 * BS as u64 + 1000; // 11 blocks, the last one 1000 bytes

fn open(dir: &std::path::Path) -> Overlay {
    Overlay::open(dir, SIZE, BS, "base-v1").unwrap()
}

#[test]
fn round_trip_with_short_last_block() {
    let d = tempfile::tempdir().unwrap();
    let o = open(d.path());
    assert_eq!(o.block_count(), 11);
    assert_eq!(o.block_len(10), 1000);
    assert_eq!(o.block_len(9), BS as u64);
    assert!(!o.holds(3));
    write(&o, 3, 1);
    write(&o, 10, 1);
    assert!(o.holds(3) && o.holds(10) && !o.holds(4));
    assert_eq!(read(&o, 3).unwrap(), pattern(3, 1, BS as usize));
    assert_eq!(read(&o, 10).unwrap(), pattern(10, 1, 1000));
    // partial reads inside a block
    let mut buf = vec![0u8; 100];
    o.read_block(10, 900, &mut buf).unwrap();
    assert_eq!(buf, pattern(10, 1, 1000)[900..]);
    // errors
    assert!(matches!(
        o.read_block(10, 901, &mut buf),
        Err(OverlayError::ReadOutsideBlock { .. })
    ));
    assert!(matches!(
        o.read_block(4, 0, &mut buf),
        Err(OverlayError::NotHeld { block: 4 })
    ));
    assert!(matches!(
        o.write_block(10, &[1u8; 4096]),
        Err(OverlayError::BadLength { expected: 1000, .. })
    ));
    assert!(matches!(
        o.write_block(11, &[1u8; 4096]),
        Err(OverlayError::BlockOutOfRange {
            block: 11,
            blocks: 11
        })
    ));
    assert!(!o.holds(11));
    // overwrite
    write(&o, 3, 2);
    assert_eq!(read(&o, 3).unwrap(), pattern(3, 2, BS as usize));
    assert_eq!(o.held_blocks(), vec![3, 10]);
    let s = o.stats();
    assert_eq!(
        (s.blocks_held, s.held_bytes, s.layers),
        (2, BS as u64 + 1000, 1)
    );
}

#[test]
fn zero_blocks_are_held_zeros() {
    let d = tempfile::tempdir().unwrap();
    let o = open(d.path());
    write(&o, 1, 1);
    write(&o, 2, 1);
    o.zero_blocks(2, 9).unwrap();
    assert_eq!(o.held_blocks(), (1..11).collect::<Vec<_>>());
    assert_eq!(read(&o, 2).unwrap(), vec![0; BS as usize]);
    assert_eq!(read(&o, 10).unwrap(), vec![0; 1000]);
    assert_eq!(read(&o, 1).unwrap(), pattern(1, 1, BS as usize));
    assert!(o.zero_blocks(5, 7).is_err());
    o.zero_blocks(0, 0).unwrap();
    // an all-zero write is a hole too
    o.write_block(1, &[0u8; BS as usize]).unwrap();
    assert_eq!(read(&o, 1).unwrap(), vec![0; BS as usize]);
    o.flush().unwrap();
    drop(o);
    let o = open(d.path());
    assert_eq!(o.held_blocks(), (1..11).collect::<Vec<_>>());
    assert_eq!(read(&o, 2).unwrap(), vec![0; BS as usize]);
}

#[test]
fn zero_blocks_over_lower_layer_shadows_it() {
    let d = tempfile::tempdir().unwrap();
    let o = open(d.path());
    write(&o, 4, 1);
    o.snapshot("s").unwrap();
    o.zero_blocks(4, 1).unwrap();
    assert_eq!(read(&o, 4).unwrap(), vec![0; BS as usize]);
    assert_eq!(o.holding_layer(4), Some(1));
}

#[test]
fn reopen_after_flush_and_without_flush() {
    let d = tempfile::tempdir().unwrap();
    let o = open(d.path());
    for b in [0, 5, 10] {
        write(&o, b, 7);
    }
    o.flush().unwrap();
    write(&o, 6, 7); // never flushed
    drop(o); // no flush on drop: a crash as far as the overlay is concerned
    let o = open(d.path());
    assert_eq!(o.held_blocks(), vec![0, 5, 10]);
    for b in [0, 5, 10] {
        assert_eq!(read(&o, b).unwrap(), pattern(b, 7, o.block_len(b) as usize));
    }
    assert_eq!(o.base(), "base-v1");
}

#[test]
fn reopen_with_other_parameters_is_refused() {
    let d = tempfile::tempdir().unwrap();
    drop(open(d.path()));
    let e = Overlay::open(d.path(), SIZE + 1, BS, "base-v1")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("size") && e.contains(&SIZE.to_string()) && e.contains(&(SIZE + 1).to_string()),
        "{e}"
    );
    let e = Overlay::open(d.path(), SIZE, 8192, "base-v1")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("block size") && e.contains("4096") && e.contains("8192"),
        "{e}"
    );
    let e = Overlay::open(d.path(), SIZE, BS, "base-v2")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("base") && e.contains("base-v1") && e.contains("base-v2"),
        "{e}"
    );
    assert!(matches!(
        Overlay::open(d.path(), SIZE, 3000, "base-v1"),
        Err(OverlayError::InvalidBlockSize(3000))
    ));
    assert!(matches!(
        Overlay::open(d.path(), SIZE, 8 << 20, "base-v1"),
        Err(OverlayError::InvalidBlockSize(_))
    ));
    open(d.path());
}

#[test]
fn second_open_is_locked() {
    let d = tempfile::tempdir().unwrap();
    let o = open(d.path());
    assert!(matches!(
        Overlay::open(d.path(), SIZE, BS, "base-v1"),
        Err(OverlayError::Locked { .. })
    ));
    drop(o);
    open(d.path());
}

/// A child process spawned by another thread holds a copy of every descriptor between its
/// `fork` and its `exec`, including a just-dropped overlay's locked file: reopening must wait
/// that moment out rather than report the overlay as open elsewhere.
#[test]
fn reopening_while_other_threads_spawn_processes() {
    let d = tempfile::tempdir().unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let spawner = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                std::process::Command::new("true").status().unwrap();
            }
        })
    };
    for _ in 0..300 {
        drop(open(d.path()));
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    spawner.join().unwrap();
}

#[test]
fn snapshot_write_rollback() {
    let d = tempfile::tempdir().unwrap();
    let o = open(d.path());
    write(&o, 1, 1);
    write(&o, 2, 1);
    o.snapshot("a").unwrap();
    assert!(matches!(
        o.snapshot("a"),
        Err(OverlayError::SnapshotExists(_))
    ));
    assert!(o.snapshot("").is_err());
    write(&o, 2, 2);
    write(&o, 3, 2);
    o.snapshot("b").unwrap();
    write(&o, 4, 3);
    o.zero_blocks(1, 1).unwrap();
    assert_eq!(o.snapshots(), vec!["a", "b"]);
    assert_eq!(o.stats().layers, 3);

    o.rollback("b").unwrap();
    assert_eq!(o.held_blocks(), vec![1, 2, 3]);
    assert_eq!(read(&o, 1).unwrap(), pattern(1, 1, BS as usize));
    assert_eq!(read(&o, 2).unwrap(), pattern(2, 2, BS as usize));

    // Rolling back to a keeps b: a branch one can return to.
    o.rollback("a").unwrap();
    assert_eq!(o.snapshots(), vec!["a", "b"]);
    let tree = o.snapshot_tree();
    assert_eq!(tree[1].parent.as_deref(), Some("a"));
    assert!(tree[0].current_path && !tree[1].current_path);
    assert_eq!(o.held_blocks(), vec![1, 2]);
    assert_eq!(read(&o, 2).unwrap(), pattern(2, 1, BS as usize));
    write(&o, 7, 7);
    o.rollback("b").unwrap();
    assert_eq!(o.held_blocks(), vec![1, 2, 3]);
    assert_eq!(read(&o, 2).unwrap(), pattern(2, 2, BS as usize));
    o.rollback("a").unwrap();
    assert!(matches!(
        o.rollback("zz"),
        Err(OverlayError::NoSuchSnapshot(_))
    ));

    // rollback is durable without an explicit flush, and the snapshots survive reopen
    write(&o, 5, 9);
    drop(o);
    let o = open(d.path());
    assert_eq!(o.snapshots(), vec!["a", "b"]);
    assert_eq!(o.held_blocks(), vec![1, 2]);
    // rollback discards even flushed writes
    write(&o, 6, 9);
    o.flush().unwrap();
    o.rollback("a").unwrap();
    assert_eq!(o.held_blocks(), vec![1, 2]);
    drop(o); // waits for the dropped layers' files to go
             // only the files of live layers remain
    let mut names: Vec<String> = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names.len(), 3 * 2 + 2, "{names:?}"); // 3 layers + meta.json + lock
}

#[test]
fn chain_of_100_snapshots_reads_through_merged_table() {
    let d = tempfile::tempdir().unwrap();
    let size = 200 * BS as u64;
    let o = Overlay::open(d.path(), size, BS, "b").unwrap();
    // Layer i writes block i (and rewrites block 0), then is frozen as snapshot i.
    for i in 0..100u64 {
        write(&o, i, i);
        write(&o, 0, 1000 + i);
        o.snapshot(&format!("s{i}")).unwrap();
    }
    assert_eq!(o.stats().layers, 101);
    let check = |o: &Overlay| {
        // The merged table names the holding layer directly: no layer scan on reads.
        assert_eq!(o.holding_layer(0), Some(99));
        for i in 1..100u64 {
            assert_eq!(o.holding_layer(i), Some(i as usize), "block {i}");
            assert_eq!(read(o, i).unwrap(), pattern(i, i, BS as usize));
        }
        assert_eq!(read(o, 0).unwrap(), pattern(0, 1099, BS as usize));
        assert_eq!(o.holding_layer(150), None);
    };
    check(&o);
    drop(o);
    let o = Overlay::open(d.path(), size, BS, "b").unwrap();
    check(&o);
    o.rollback("s50").unwrap();
    assert_eq!(o.holding_layer(0), Some(50));
    assert_eq!(o.holding_layer(60), None);
    assert_eq!(read(&o, 0).unwrap(), pattern(0, 1050, BS as usize));
    // Every later snapshot stays, on a branch one can return to.
    assert_eq!(o.snapshots().len(), 100);
    o.rollback("s80").unwrap();
    assert_eq!(read(&o, 0).unwrap(), pattern(0, 1080, BS as usize));
    assert_eq!(o.holding_layer(70), Some(70));
    assert_eq!(o.holding_layer(90), None);
}

/// Copy-on-demand: a block read from deep enough below is copied into the current layer,
/// once; shallower reads are not.
#[test]
fn copy_on_read_pulls_deep_blocks_up() {
    let d = tempfile::tempdir().unwrap();
    let size = 16 * BS as u64;
    let o = Overlay::open(d.path(), size, BS, "b").unwrap();
    for i in 0..6u64 {
        write(&o, i, 10 + i);
        o.snapshot(&format!("s{i}")).unwrap();
    }
    // The current layer is slot 6; block i is held i layers deeper than s5's block 5.
    o.set_copy_on_read(4);
    assert_eq!(read(&o, 5).unwrap(), pattern(5, 15, BS as usize));
    assert_eq!(read(&o, 3).unwrap(), pattern(3, 13, BS as usize));
    assert_eq!(
        o.stats().copied_on_read,
        0,
        "depth 1 and 3: not deep enough"
    );
    assert_eq!(read(&o, 1).unwrap(), pattern(1, 11, BS as usize));
    assert_eq!(o.stats().copied_on_read, 1);
    assert_eq!(o.holding_layer(1), Some(6));
    assert_eq!(read(&o, 1).unwrap(), pattern(1, 11, BS as usize));
    assert_eq!(o.stats().copied_on_read, 1, "copied once");
    // A copy is like a write: rolled back with the current layer, durable on flush.
    o.rollback("s5").unwrap();
    assert_eq!(o.holding_layer(1), Some(1));
    assert_eq!(read(&o, 0).unwrap(), pattern(0, 10, BS as usize));
    o.flush().unwrap();
    drop(o);
    let o = Overlay::open(d.path(), size, BS, "b").unwrap();
    assert_eq!(o.holding_layer(0), Some(6));
    assert_eq!(read(&o, 0).unwrap(), pattern(0, 10, BS as usize));
}

/// iROW's virtual deletion: a snapshot layers still read through is only marked; what every
/// layer above it holds is punched out at once; it goes when nothing reads through it.
#[test]
fn deleted_snapshots_are_reclaimed_and_merged() {
    let d = tempfile::tempdir().unwrap();
    let size = 64 * BS as u64;
    let o = Overlay::open(d.path(), size, BS, "b").unwrap();
    for b in 0..32 {
        write(&o, b, 1);
    }
    o.snapshot("base").unwrap();
    for b in 0..16 {
        write(&o, b, 2);
    }
    o.snapshot("left").unwrap();
    o.rollback("base").unwrap();
    for b in 8..24 {
        write(&o, b, 3);
    }
    o.snapshot("right").unwrap();
    let view = |o: &Overlay| (0..40).map(|b| read(o, b)).collect::<Vec<_>>();
    let before = view(&o);
    let allocated = o.stats().data_bytes_allocated;

    // Two snapshots sit on base: it stays, marked, and loses blocks 8..16 (both hold them).
    o.delete_snapshot("base").unwrap();
    assert_eq!(view(&o), before);
    o.settle(); // blocks are punched out in the background
    assert_eq!(o.snapshots(), vec!["left", "right"]);
    assert!(o.snapshot_tree().iter().all(|s| s.parent.is_none()));
    assert_eq!(o.stats().layers, 4, "base kept as a deleted layer");
    assert_eq!(
        o.stats().data_bytes_allocated,
        allocated - 8 * BS as u64,
        "blocks both branches hide are punched out"
    );
    o.rollback("left").unwrap();
    assert_eq!(read(&o, 20).unwrap(), pattern(20, 1, BS as usize));
    assert_eq!(read(&o, 3).unwrap(), pattern(3, 2, BS as usize));

    // Deleting one branch leaves base one layer on it (left): the two merge.
    o.rollback("right").unwrap();
    o.delete_snapshot("left").unwrap();
    assert_eq!(view(&o), before);
    assert_eq!(o.snapshots(), vec!["right"]);
    assert_eq!(o.stats().layers, 2, "base merged with right");
    drop(o);
    let o = Overlay::open(d.path(), size, BS, "b").unwrap();
    assert_eq!(view(&o), before);
    assert_eq!(o.snapshots(), vec!["right"]);
    let names = std::fs::read_dir(d.path()).unwrap().count();
    assert_eq!(names, 2 * 2 + 2, "no files of gone layers");
}

#[test]
fn delete_snapshot_keeps_contents() {
    let d = tempfile::tempdir().unwrap();
    let o = open(d.path());
    write(&o, 0, 1);
    write(&o, 1, 1);
    o.zero_blocks(7, 1).unwrap();
    o.snapshot("a").unwrap();
    write(&o, 1, 2);
    write(&o, 2, 2);
    o.snapshot("b").unwrap();
    o.snapshot("c").unwrap(); // empty layer above b
    write(&o, 3, 4); // unflushed write in the top
    let snapshot = |o: &Overlay| (0..11).map(|b| read(o, b)).collect::<Vec<_>>();
    let before = snapshot(&o);

    // Copy case: a's blocks 0 and 7 move up into b (which holds 1, 2).
    o.delete_snapshot("a").unwrap();
    assert_eq!(snapshot(&o), before);
    assert_eq!(o.snapshots(), vec!["b", "c"]);
    // Adopt case: c is empty, so b's layer takes c's place.
    o.delete_snapshot("b").unwrap();
    assert_eq!(snapshot(&o), before);
    assert_eq!(o.snapshots(), vec!["c"]);
    // Copy into the writable top (which has its own write to block 3).
    o.delete_snapshot("c").unwrap();
    assert_eq!(snapshot(&o), before);
    assert!(o.snapshots().is_empty());
    assert_eq!(o.stats().layers, 1);
    assert!(matches!(
        o.delete_snapshot("c"),
        Err(OverlayError::NoSuchSnapshot(_))
    ));
    drop(o); // delete flushed everything
    let o = open(d.path());
    assert_eq!(snapshot(&o), before);
}

#[test]
fn delete_snapshot_adopts_into_empty_top() {
    let d = tempfile::tempdir().unwrap();
    let o = open(d.path());
    write(&o, 0, 1);
    o.snapshot("a").unwrap();
    o.delete_snapshot("a").unwrap();
    assert_eq!(o.stats().layers, 1);
    write(&o, 1, 1); // the adopted layer is writable
    o.flush().unwrap();
    drop(o);
    let o = open(d.path());
    assert_eq!(o.held_blocks(), vec![0, 1]);
    assert_eq!(read(&o, 0).unwrap(), pattern(0, 1, BS as usize));
}

#[test]
fn reset_empties() {
    let d = tempfile::tempdir().unwrap();
    let o = open(d.path());
    write(&o, 0, 1);
    o.snapshot("a").unwrap();
    write(&o, 1, 1);
    o.reset("base-v2").unwrap();
    assert!(o.held_blocks().is_empty());
    assert!(o.snapshots().is_empty());
    assert_eq!(o.base(), "base-v2");
    assert_eq!(
        o.stats(),
        cairn_overlay::OverlayStats {
            layers: 1,
            ..Default::default()
        }
    );
    drop(o);
    assert!(Overlay::open(d.path(), SIZE, BS, "base-v1").is_err());
    let o = Overlay::open(d.path(), SIZE, BS, "base-v2").unwrap();
    assert!(o.held_blocks().is_empty());
}

#[test]
fn zero_size_image() {
    let d = tempfile::tempdir().unwrap();
    let o = Overlay::open(d.path(), 0, BS, "b").unwrap();
    assert_eq!(o.block_count(), 0);
    assert!(o.held_blocks().is_empty());
    o.snapshot("s").unwrap();
    o.flush().unwrap();
    assert_eq!(o.stats().held_bytes, 0);
}

#[test]
fn concurrent_writers_readers_and_snapshots() {
    let d = tempfile::tempdir().unwrap();
    let o = Arc::new(Overlay::open(d.path(), 256 * BS as u64, BS, "b").unwrap());
    let mut threads = Vec::new();
    for t in 0..4u64 {
        let o = o.clone();
        threads.push(std::thread::spawn(move || {
            for round in 0..3u64 {
                for b in (t..256).step_by(4) {
                    write(&o, b, round);
                    assert_eq!(read(&o, b).unwrap(), pattern(b, round, BS as usize));
                }
            }
        }));
    }
    let snapper = {
        let o = o.clone();
        std::thread::spawn(move || {
            for i in 0..20 {
                o.snapshot(&format!("s{i}")).unwrap();
                if i % 3 == 2 {
                    o.delete_snapshot(&format!("s{}", i - 1)).unwrap();
                }
                o.flush().unwrap();
            }
        })
    };
    for t in threads {
        t.join().unwrap();
    }
    snapper.join().unwrap();
    for b in 0..256 {
        assert_eq!(
            read(&o, b).unwrap(),
            pattern(b, 2, BS as usize),
            "block {b}"
        );
    }
    o.flush().unwrap();
    drop(o);
    let o = Overlay::open(d.path(), 256 * BS as u64, BS, "b").unwrap();
    for b in 0..256 {
        assert_eq!(
            read(&o, b).unwrap(),
            pattern(b, 2, BS as usize),
            "block {b}"
        );
    }
}

#[test]
fn data_files_are_sparse() {
    let d = tempfile::tempdir().unwrap();
    let size = 1024 * BS as u64;
    let o = Overlay::open(d.path(), size, BS, "b").unwrap();
    write(&o, 1000, 1);
    o.flush().unwrap();
    let s = o.stats();
    assert_eq!(s.blocks_held, 1);
    // one block written near the end of a 4 MiB image: far less than the image allocated
    assert!(s.data_bytes_allocated < 512 * 1024, "{s:?}");
}

#[test]
fn inspect_reads_an_overlay_without_opening_it() {
    let d = tempfile::tempdir().unwrap();
    let o = open(d.path());
    write(&o, 1, 1);
    write(&o, 10, 1);
    o.snapshot("s1").unwrap();
    write(&o, 1, 2);
    write(&o, 4, 2);
    o.flush().unwrap();
    // Works while the overlay is open (no lock taken) and after.
    for _ in 0..2 {
        let i = Overlay::inspect(d.path()).unwrap();
        assert_eq!(i.base, "base-v1");
        assert_eq!((i.size, i.block_size), (SIZE, BS));
        assert_eq!(i.snapshots, vec!["s1".to_string()]);
        assert_eq!((i.blocks_held, i.held_bytes), (3, 2 * BS as u64 + 1000));
        assert_eq!(i.layers, 2);
    }
    drop(o);
    let e = tempfile::tempdir().unwrap();
    assert!(matches!(
        Overlay::inspect(e.path()),
        Err(OverlayError::NotAnOverlay { .. })
    ));
}

#[test]
fn an_empty_overlay_is_rebased_and_a_used_one_is_not() {
    let d = tempfile::tempdir().unwrap();
    drop(open(d.path()));
    let (o, old) = Overlay::open_rebasing_empty(d.path(), SIZE, BS, "base-v2").unwrap();
    assert_eq!(old.as_deref(), Some("base-v1"));
    assert_eq!(o.base(), "base-v2");
    write(&o, 2, 1);
    o.flush().unwrap();
    drop(o);
    // Same base: nothing to do.
    let (o, old) = Overlay::open_rebasing_empty(d.path(), SIZE, BS, "base-v2").unwrap();
    assert_eq!(old, None);
    drop(o);
    // Writes depend on their base: refused, and nothing changed.
    let err = Overlay::open_rebasing_empty(d.path(), SIZE, BS, "base-v3").unwrap_err();
    assert!(
        matches!(err, OverlayError::Mismatch { field: "base", .. }),
        "{err}"
    );
    assert_eq!(Overlay::inspect(d.path()).unwrap().base, "base-v2");
    // So do snapshots, even empty ones.
    let f = tempfile::tempdir().unwrap();
    let o = open(f.path());
    o.snapshot("empty").unwrap();
    drop(o);
    assert!(Overlay::open_rebasing_empty(f.path(), SIZE, BS, "base-v2").is_err());
    // Size and block size still have to match.
    let g = tempfile::tempdir().unwrap();
    drop(open(g.path()));
    assert!(matches!(
        Overlay::open_rebasing_empty(g.path(), SIZE + 1, BS, "base-v2"),
        Err(OverlayError::Mismatch { field: "size", .. })
    ));
}

#[test]
fn discard_deletes_an_overlay_nobody_holds() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("ov");
    let o = open(&dir);
    write(&o, 1, 1);
    o.snapshot("s").unwrap();
    o.flush().unwrap();
    assert!(matches!(
        Overlay::discard(&dir),
        Err(OverlayError::Locked { .. })
    ));
    drop(o);
    // A file that is not the overlay's is not deleted: nothing is.
    std::fs::write(dir.join("notes.txt"), b"mine").unwrap();
    let err = Overlay::discard(&dir).unwrap_err();
    assert!(err.to_string().contains("notes.txt"), "{err}");
    assert!(dir.join("meta.json").exists());
    std::fs::remove_file(dir.join("notes.txt")).unwrap();
    Overlay::discard(&dir).unwrap();
    assert!(!dir.exists());
    assert!(matches!(
        Overlay::discard(&dir),
        Err(OverlayError::NotAnOverlay { .. })
    ));
}

#[test]
fn an_overlay_is_private_and_one_other_users_can_write_is_refused() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("ov");
    let ov = Overlay::open(&dir, 1 << 20, 4096, "base").unwrap();
    write(&ov, 0, 7);
    ov.flush().unwrap();
    drop(ov);
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(&dir), 0o700);
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        assert_eq!(mode(&e.path()), 0o600, "{}", e.path().display());
    }

    // A directory others may write into could hold their bytes: refused, with why.
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
    let err = Overlay::open(&dir, 1 << 20, 4096, "base").unwrap_err();
    assert!(matches!(err, OverlayError::Untrusted { .. }), "{err}");
    assert!(err.to_string().contains("writable by other users"), "{err}");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();

    // One another user owns (only root can make one here).
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } == 0 {
        std::os::unix::fs::chown(&dir, Some(64055), None).unwrap();
        assert_eq!(std::fs::metadata(&dir).unwrap().uid(), 64055);
        let err = Overlay::open(&dir, 1 << 20, 4096, "base").unwrap_err();
        assert!(err.to_string().contains("owned by uid 64055"), "{err}");
    }
}

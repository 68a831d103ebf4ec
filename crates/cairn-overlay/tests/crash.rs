//! Crash safety: corrupted / truncated / missing metadata, leftovers of interrupted
//! operations, and a real `kill -9` of a writing process.

mod common;

use std::fs;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cairn_overlay::{Overlay, OverlayError};
use common::{pattern, read, write, BS};

const SIZE: u64 = 16 * BS as u64;

fn open(dir: &Path) -> Result<Overlay, OverlayError> {
    Overlay::open(dir, SIZE, BS, "b")
}

/// An overlay with a snapshot "a" (layer 0: blocks 0, 1) and a flushed top (layer 1: block 2).
fn setup(dir: &Path) {
    let o = open(dir).unwrap();
    write(&o, 0, 1);
    write(&o, 1, 1);
    o.snapshot("a").unwrap();
    write(&o, 2, 1);
    o.flush().unwrap();
}

fn expect_corrupt(dir: &Path, file: &str) {
    match open(dir) {
        Err(e @ OverlayError::Corrupt { .. }) => {
            let msg = e.to_string();
            assert!(msg.contains(file), "{msg} should name {file}");
        }
        Err(e) => panic!("expected a corruption error naming {file}, got {e}"),
        Ok(_) => panic!("opened an overlay with a broken {file}"),
    }
}

fn flip_byte(path: &Path, at: usize) {
    cairn_testkit::flip_file_byte(path, at, 0x40);
}

fn truncate_by(path: &Path, n: u64) {
    let f = fs::OpenOptions::new().write(true).open(path).unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len.saturating_sub(n)).unwrap();
}

#[test]
fn corrupt_metadata_is_refused_naming_the_file() {
    type Damage = fn(&Path);
    let cases: &[(&str, Damage)] = &[
        ("meta.json", |p| truncate_by(p, 10)),
        ("meta.json", |p| truncate_by(p, 1000)),
        ("meta.json", |p| flip_byte(p, 80)),
        ("meta.json", |p| fs::write(p, b"").unwrap()),
        ("layer-1.bitmap", |p| truncate_by(p, 1)),
        ("layer-1.bitmap", |p| truncate_by(p, 1000)),
        ("layer-1.bitmap", |p| flip_byte(p, 41)),
        ("layer-1.bitmap", |p| fs::remove_file(p).unwrap()),
        ("layer-0.bitmap", |p| flip_byte(p, 20)),
        ("layer-0.data", |p| fs::remove_file(p).unwrap()),
    ];
    for (file, damage) in cases {
        let d = tempfile::tempdir().unwrap();
        setup(d.path());
        damage(&d.path().join(file));
        expect_corrupt(d.path(), file);
    }
}

#[test]
fn bitmap_of_another_layer_is_refused() {
    let d = tempfile::tempdir().unwrap();
    setup(d.path());
    fs::copy(
        d.path().join("layer-0.bitmap"),
        d.path().join("layer-1.bitmap"),
    )
    .unwrap();
    expect_corrupt(d.path(), "layer-1.bitmap");
}

#[test]
fn leftovers_of_interrupted_operations_are_ignored_and_removed() {
    let d = tempfile::tempdir().unwrap();
    setup(d.path());
    // What a crash in the middle of a snapshot / an atomic replacement leaves behind.
    fs::write(d.path().join("layer-7.data"), b"junk").unwrap();
    fs::write(d.path().join("layer-7.bitmap"), b"junk").unwrap();
    fs::write(d.path().join("meta.json.tmp"), b"{half").unwrap();
    fs::write(d.path().join("layer-1.bitmap.tmp"), b"half").unwrap();
    let o = open(d.path()).unwrap();
    assert_eq!(o.held_blocks(), vec![0, 1, 2]);
    for f in [
        "layer-7.data",
        "layer-7.bitmap",
        "meta.json.tmp",
        "layer-1.bitmap.tmp",
    ] {
        assert!(!d.path().join(f).exists(), "{f} not removed");
    }
    // and the id space moves on safely
    o.snapshot("b").unwrap();
    write(&o, 3, 1);
    o.flush().unwrap();
    drop(o);
    assert_eq!(open(d.path()).unwrap().held_blocks(), vec![0, 1, 2, 3]);
}

#[test]
fn crash_during_first_creation_starts_fresh() {
    let d = tempfile::tempdir().unwrap();
    fs::write(d.path().join("layer-0.data"), b"").unwrap();
    fs::write(d.path().join("layer-0.bitmap"), b"half-written").unwrap();
    fs::write(d.path().join("meta.json.tmp"), b"{half").unwrap();
    fs::write(d.path().join("unrelated.tmp"), b"not ours").unwrap();
    let o = open(d.path()).unwrap();
    assert!(o.held_blocks().is_empty());
    assert!(!d.path().join("meta.json.tmp").exists());
    assert!(d.path().join("unrelated.tmp").exists());
}

#[test]
fn lost_manifest_is_refused_not_silently_recreated() {
    let d = tempfile::tempdir().unwrap();
    setup(d.path());
    fs::remove_file(d.path().join("meta.json")).unwrap();
    expect_corrupt(d.path(), "meta.json");
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

fn contents(o: &Overlay) -> Vec<Option<Vec<u8>>> {
    (0..o.block_count()).map(|b| read(o, b)).collect()
}

/// The intermediate state of delete_snapshot's copy path (upper layer already merged, old
/// manifest still in place) must read exactly like the state before the delete, snapshots
/// included.
#[test]
fn crash_inside_delete_snapshot_reads_like_before() {
    let root = tempfile::tempdir().unwrap();
    let live = root.path().join("live");
    let o = open(&live).unwrap();
    write(&o, 0, 1);
    write(&o, 1, 1);
    o.snapshot("a").unwrap(); // layer 0
    write(&o, 1, 2);
    write(&o, 2, 2);
    o.snapshot("b").unwrap(); // layer 1
    write(&o, 3, 3); // layer 2 (top)
    o.flush().unwrap();
    let before = contents(&o);
    drop(o);
    let old = root.path().join("old");
    copy_dir(&live, &old);

    let o = open(&live).unwrap();
    o.delete_snapshot("a").unwrap();
    drop(o);

    // old manifest + old layer 0 + merged layer 1
    let mid = root.path().join("mid");
    copy_dir(&old, &mid);
    for f in ["layer-1.data", "layer-1.bitmap"] {
        fs::copy(live.join(f), mid.join(f)).unwrap();
    }
    let o = open(&mid).unwrap();
    assert_eq!(contents(&o), before);
    assert_eq!(o.snapshots(), vec!["a", "b"]);
    o.rollback("b").unwrap();
    assert_eq!(o.held_blocks(), vec![0, 1, 2]);
    assert_eq!(read(&o, 1).unwrap(), pattern(1, 2, BS as usize));
    o.rollback("a").unwrap();
    assert_eq!(o.held_blocks(), vec![0, 1]);
    assert_eq!(read(&o, 1).unwrap(), pattern(1, 1, BS as usize));
}

/// A deletion interrupted right after its commit point (the manifest marks the snapshot
/// deleted; nothing reclaimed or merged yet) is finished by the next open.
#[test]
fn interrupted_deletion_is_finished_at_open() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("o");
    let o = open(&dir).unwrap();
    write(&o, 0, 1);
    write(&o, 1, 1);
    o.snapshot("a").unwrap(); // layer 0
    write(&o, 1, 2); // layer 1, current
    o.flush().unwrap();
    let before = contents(&o);
    drop(o);
    // Mark "a" deleted in the manifest, with a checksum that matches.
    let meta = fs::read_to_string(dir.join("meta.json")).unwrap();
    let body_at = meta.find("\"body\":").unwrap() + "\"body\":".len();
    let body = meta[body_at..meta.trim_end().len() - 1].replace(
        "\"snapshot\":\"a\",\"deleted\":false",
        "\"snapshot\":null,\"deleted\":true",
    );
    assert!(body.contains("\"deleted\":true"), "{body}");
    let sum = blake3::hash(body.as_bytes()).to_hex();
    fs::write(
        dir.join("meta.json"),
        format!("{{\"blake3\":\"{sum}\",\"body\":{body}}}\n"),
    )
    .unwrap();

    let o = open(&dir).unwrap();
    assert_eq!(contents(&o), before);
    assert!(o.snapshots().is_empty());
    assert_eq!(o.stats().layers, 1, "merged into one layer");
    write(&o, 2, 3); // and that layer is writable
    o.flush().unwrap();
    drop(o);
    let o = open(&dir).unwrap();
    assert_eq!(o.held_blocks(), vec![0, 1, 2]);
    assert_eq!(read(&o, 1).unwrap(), pattern(1, 2, BS as usize));
    let files = fs::read_dir(&dir).unwrap().count();
    assert_eq!(files, 2 + 2, "one layer's files, meta.json and lock");
}

// ---- kill -9 ----

const KILL_SIZE: u64 = 4096 * BS as u64;
const ENV_DIR: &str = "CAIRN_OVERLAY_KILL9_DIR";
const ENV_MODE: &str = "CAIRN_OVERLAY_KILL9_MODE";

fn progress_path(dir: &Path) -> std::path::PathBuf {
    dir.with_extension("progress")
}

/// Child side: only does something when spawned by `kill_9_*` with the env vars set.
#[test]
fn kill9_child() {
    let Ok(dir) = std::env::var(ENV_DIR) else {
        return;
    };
    let dir = Path::new(&dir);
    let mode = std::env::var(ENV_MODE).unwrap();
    let o = Overlay::open(dir, KILL_SIZE, BS, "b").unwrap();
    let mut progress = fs::File::create(progress_path(dir)).unwrap();
    let nblocks = o.block_count();
    match mode.as_str() {
        // Write every block once; flush every 8 blocks and record how many are flushed;
        // snapshot every 64 blocks, delete every other snapshot.
        "stress" => {
            for b in 0..nblocks {
                write(&o, b, 1);
                if b % 8 == 7 {
                    o.flush().unwrap();
                    writeln!(progress, "{}", b + 1).unwrap();
                }
                if b % 64 == 63 {
                    o.snapshot(&format!("s{b}")).unwrap();
                    if b % 128 == 127 {
                        o.delete_snapshot(&format!("s{}", b - 64)).unwrap();
                    }
                }
            }
        }
        // Write and flush 256 blocks, then overwrite the others forever without flushing.
        "unflushed" => {
            for b in 0..256 {
                write(&o, b, 1);
            }
            o.flush().unwrap();
            writeln!(progress, "256").unwrap();
            let mut seed = 2;
            loop {
                for b in 256..nblocks {
                    write(&o, b, seed);
                }
                seed += 1;
            }
        }
        other => panic!("unknown mode {other}"),
    }
    writeln!(progress, "done").unwrap();
    loop {
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// Spawns the child, waits until it has recorded at least `min_progress` flushed blocks,
/// waits `delay`, kills it with SIGKILL and returns the last recorded progress.
fn run_and_kill(dir: &Path, mode: &str, min_progress: u64, delay: Duration) -> u64 {
    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args(["--exact", "kill9_child", "--nocapture", "--test-threads=1"])
        .env(ENV_DIR, dir)
        .env(ENV_MODE, mode)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let last = || -> Option<String> {
        let s = fs::read_to_string(progress_path(dir)).ok()?;
        s.lines().last().map(str::to_string)
    };
    let parse = |l: Option<String>| match l.as_deref() {
        Some("done") => u64::MAX,
        Some(n) => n.parse().unwrap_or(0),
        None => 0,
    };
    let start = Instant::now();
    while parse(last()) < min_progress {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("child exited early: {status}");
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "child made no progress"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(delay);
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    // The progress file may end in a torn line; take the last complete number.
    let s = fs::read_to_string(progress_path(dir)).unwrap();
    s.lines()
        .filter_map(|l| {
            if l == "done" {
                Some(4096)
            } else {
                l.parse().ok()
            }
        })
        .max()
        .unwrap_or(0)
}

#[test]
fn kill_9_while_writing_and_flushing() {
    let root = tempfile::tempdir().unwrap();
    let runs = [(8, 0u64), (130, 3), (300, 20), (520, 7), (700, 1)];
    for (i, (min_progress, delay_ms)) in runs.into_iter().enumerate() {
        let dir = root.path().join(format!("o{i}"));
        let flushed = run_and_kill(
            &dir,
            "stress",
            min_progress,
            Duration::from_millis(delay_ms),
        );
        let o = Overlay::open(&dir, KILL_SIZE, BS, "b").unwrap();
        let held = o.held_blocks();
        // Flushes happen in block order, so what survived is a prefix covering at least
        // every block whose flush was recorded, each with exactly the written data.
        let n = held.len() as u64;
        eprintln!(
            "run {i}: killed after {delay_ms} ms: {flushed} flushed blocks recorded, {n} held"
        );
        assert!(
            n >= flushed,
            "run {i}: {n} blocks held, {flushed} were flushed"
        );
        assert_eq!(held, (0..n).collect::<Vec<_>>(), "run {i}: not a prefix");
        for b in held {
            assert_eq!(
                read(&o, b).unwrap(),
                pattern(b, 1, BS as usize),
                "run {i}: block {b}"
            );
        }
        // snapshots taken before the kill are intact: rolling back to the oldest one gives
        // exactly the blocks written before it
        if let Some(first) = o.snapshots().first().cloned() {
            let upto: u64 = first[1..].parse::<u64>().unwrap() + 1;
            o.rollback(&first).unwrap();
            assert_eq!(o.held_blocks(), (0..upto).collect::<Vec<_>>(), "run {i}");
        }
        // and the overlay is usable afterwards
        write(&o, 4095, 9);
        o.flush().unwrap();
    }
}

#[test]
fn kill_9_during_unflushed_writes() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("o");
    run_and_kill(&dir, "unflushed", 256, Duration::from_millis(300));
    let o = Overlay::open(&dir, KILL_SIZE, BS, "b").unwrap();
    assert_eq!(o.held_blocks(), (0..256).collect::<Vec<_>>());
    for b in 0..256 {
        assert_eq!(
            read(&o, b).unwrap(),
            pattern(b, 1, BS as usize),
            "block {b}"
        );
    }
}

//! Safe in an operator's hands: restores never clobber, names that cannot be stored are
//! refused before any write, killed processes do not hold up GC, SIGINT/SIGTERM end work
//! cleanly, and nothing is left behind.

use crate::common::{cairn, noise, stderr_line};

use std::io::Write;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn init(dir: &Path) -> PathBuf {
    let repo = dir.join("repo");
    let out = cairn(&repo, &["init", "--reserve", "0"]);
    assert!(out.status.success(), "{out:?}");
    repo
}

fn commit_file(repo: &Path, image: &str, path: &Path) {
    let out = cairn(repo, &["-q", "commit", image, path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
}

/// Every file under `dir` whose name starts with `prefix`.
fn files_named(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if e.file_name().to_string_lossy().starts_with(prefix) {
                out.push(p);
            }
        }
    }
    out
}

fn sessions(repo: &Path) -> Vec<PathBuf> {
    files_named(&repo.join("refs/sessions"), "")
}

#[test]
fn restore_never_clobbers() {
    let dir = tempfile::tempdir().unwrap();
    let repo = init(dir.path());
    let data = noise(1 << 20, 1);
    let src = dir.path().join("disk.raw");
    std::fs::write(&src, &data).unwrap();
    commit_file(&repo, "vm", &src);

    // An existing file: refused without --force, unchanged.
    let existing = dir.path().join("existing.raw");
    std::fs::write(&existing, b"precious").unwrap();
    let out = cairn(&repo, &["restore", "vm", existing.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr_line(&out),
        format!(
            "cairn: error: will not restore to {}: it exists; pass --force to replace it (the \
             new image is written aside and renamed over it only when complete)",
            existing.display()
        )
    );
    assert_eq!(std::fs::read(&existing).unwrap(), b"precious");
    // With --force it is replaced, bit-exact.
    let out = cairn(
        &repo,
        &["-q", "restore", "vm", existing.to_str().unwrap(), "--force"],
    );
    assert!(out.status.success(), "{out:?}");
    assert_eq!(std::fs::read(&existing).unwrap(), data);

    // A file another process holds a lock on (QEMU locks a running VM's images): refused
    // even with --force.
    let locked = dir.path().join("locked.raw");
    std::fs::write(&locked, b"in use").unwrap();
    let holder = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&locked)
        .unwrap();
    // SAFETY: a zeroed flock (plain integers) is a valid value.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = libc::F_RDLCK as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = 100;
    lock.l_len = 1;
    // SAFETY: `holder` owns a valid descriptor during the call; `lock` outlives it.
    let rc = unsafe { libc::fcntl(holder.as_raw_fd(), libc::F_OFD_SETLK, &lock) };
    assert_eq!(rc, 0);
    let out = cairn(
        &repo,
        &["restore", "vm", locked.to_str().unwrap(), "--force"],
    );
    assert_eq!(out.status.code(), Some(1));
    let line = stderr_line(&out);
    assert!(line.contains("it is in use:"), "{line}");
    assert_eq!(std::fs::read(&locked).unwrap(), b"in use");
    // Committing it works but warns: a running guest may write while it is read.
    let out = cairn(&repo, &["-q", "commit", "busy", locked.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(
        stderr_line(&out),
        format!(
            "warning: {} is in use: another process holds a lock on it (QEMU locks the images \
             of a running VM). A running guest may write while cairn reads, so the version may \
             not be one point in time: stop the VM, or back it up with `cairn vm backup` (one \
             point in time while it runs)",
            locked.display()
        )
    );
    drop(holder);
    let out = cairn(&repo, &["-q", "commit", "busy", locked.to_str().unwrap()]);
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "",
        "no lock, no warning"
    );

    // A FIFO, a directory, a character device: refused, and left as they were.
    let fifo = dir.path().join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: `c` is a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    for (target, what) in [
        (fifo.clone(), "it is a FIFO"),
        (dir.path().to_path_buf(), "it is a directory"),
        (PathBuf::from("/dev/null"), "it is a character device"),
    ] {
        let out = cairn(
            &repo,
            &["restore", "vm", target.to_str().unwrap(), "--force"],
        );
        assert_eq!(out.status.code(), Some(1), "{target:?}");
        assert_eq!(
            stderr_line(&out),
            format!(
                "cairn: error: will not restore to {}: {what}; restore writes files and block \
                 devices (`-` writes to standard output)",
                target.display()
            )
        );
    }
    assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
    assert!(std::fs::metadata("/dev/null")
        .unwrap()
        .file_type()
        .is_char_device());
    // No partial file was left anywhere.
    assert!(files_named(dir.path(), ".existing.raw.cairn-partial").is_empty());
}

#[test]
fn a_name_that_cannot_be_stored_is_refused_before_any_write() {
    let dir = tempfile::tempdir().unwrap();
    let repo = init(dir.path());
    let src = dir.path().join("disk.raw");
    std::fs::write(&src, noise(1 << 20, 2)).unwrap();
    let name = "+".repeat(200);
    let out = cairn(&repo, &["commit", &name, src.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    let line = stderr_line(&out);
    assert!(
        line.contains("600 bytes once encoded for storage, at most 255"),
        "{line}"
    );
    assert!(line.len() < 250, "the name is shortened: {line}");
    for sub in ["packs", "index", "versions", "summaries"] {
        assert!(
            files_named(&repo.join(sub), "").is_empty(),
            "{sub} is empty"
        );
    }
}

/// A `cairn commit vm -` fed through a pipe that the test controls: it stays mid-commit
/// until the pipe is closed.
struct SlowCommit {
    child: Child,
}

impl SlowCommit {
    fn start(repo: &Path, image: &str) -> SlowCommit {
        let mut child = Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("--repo")
            .arg(repo)
            .args(["-q", "commit", image, "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Enough data for a few packs (1 MiB of noise per segment), then keep it waiting.
        let stdin = child.stdin.as_mut().unwrap();
        stdin.write_all(&noise(24 << 20, 3)).unwrap();
        stdin.flush().unwrap();
        SlowCommit { child }
    }

    /// Waits until the commit has registered its session.
    fn wait_for_session(&self, repo: &Path, before: usize) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while sessions(repo).len() <= before {
            assert!(Instant::now() < deadline, "the commit never registered");
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn gc_json(repo: &Path, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["--json", "gc"];
    all.extend_from_slice(args);
    let out = cairn(repo, &all);
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn a_killed_commit_or_gc_does_not_hold_up_the_next_gc() {
    let dir = tempfile::tempdir().unwrap();
    let repo = init(dir.path());
    let src = dir.path().join("disk.raw");
    for seed in 0..2 {
        std::fs::write(&src, noise(4 << 20, 10 + seed)).unwrap();
        commit_file(&repo, "vm", &src);
    }
    // Something for GC to do, so that it has to wait for older sessions.
    assert!(cairn(&repo, &["rm", "--no-gc", "vm@1"]).status.success());

    let mut commit = SlowCommit::start(&repo, "other");
    commit.wait_for_session(&repo, 0);
    commit.child.kill().unwrap(); // SIGKILL: no cleanup at all
    commit.child.wait().unwrap();
    assert_eq!(
        sessions(&repo).len(),
        1,
        "the dead commit's session is left"
    );
    // A GC right after does not wait for the dead process (10 minutes before); the wait
    // limit makes a wait fail instead of hang.
    let report = gc_json(&repo, &["--wait-limit", "30"]);
    assert_eq!(report["freed_versions"], 1);
    assert!(sessions(&repo).is_empty(), "the dead session was removed");

    // A GC killed while it waits for a live session leaves its lock; a GC started once that
    // session is gone takes the dead GC's lock over at once.
    assert!(cairn(&repo, &["rm", "--no-gc", "vm@2"]).status.success());
    let mut live = SlowCommit::start(&repo, "other");
    live.wait_for_session(&repo, 0);
    let mut waiting_gc = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--repo")
        .arg(&repo)
        .args(["gc"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !repo.join("refs/gc/lock").exists() {
        assert!(Instant::now() < deadline, "gc never took its lock");
        std::thread::sleep(Duration::from_millis(20));
    }
    waiting_gc.kill().unwrap();
    waiting_gc.wait().unwrap();
    live.child.kill().unwrap();
    live.child.wait().unwrap();
    assert!(
        repo.join("refs/gc/lock").exists(),
        "the killed gc's lock is left"
    );
    let report = gc_json(&repo, &["--wait-limit", "30"]);
    assert_eq!(report["freed_versions"], 1);
    assert!(!repo.join("refs/gc/lock").exists());

    // What the killed commits left (their packs and temporary files) is gone, and a repair
    // pass finds nothing more to reclaim. (Temporary files count as stale once they are
    // older than every live session by the clock-skew margin of one second.)
    std::thread::sleep(Duration::from_millis(1100));
    let report = gc_json(&repo, &["--repair"]);
    assert_eq!(report["reclaimed_bytes"], 0, "{report}");
    assert!(files_named(&repo, ".tmp-").is_empty());
    let out = cairn(&repo, &["verify"]);
    assert!(out.status.success(), "{out:?}");
}

#[test]
fn sigint_and_sigterm_end_a_commit_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let repo = init(dir.path());
    for (signal, code, name) in [
        (libc::SIGINT, 130, "SIGINT"),
        (libc::SIGTERM, 143, "SIGTERM"),
    ] {
        let commit = SlowCommit::start(&repo, "vm");
        commit.wait_for_session(&repo, 0);
        // Let it store a pack or two.
        let deadline = Instant::now() + Duration::from_secs(60);
        while files_named(&repo.join("packs"), "").is_empty() {
            assert!(Instant::now() < deadline, "no pack was stored");
            std::thread::sleep(Duration::from_millis(20));
        }
        // Hold stdin open until the process has exited (wait_with_output would close it,
        // and an EOF could let the commit finish before it handles the signal).
        let mut child = commit.child;
        let stdin = child.stdin.take();
        // SAFETY: kill with a valid pid and signal number.
        assert_eq!(unsafe { libc::kill(child.id() as i32, signal) }, 0);
        let out = child.wait_with_output().unwrap();
        drop(stdin);
        assert_eq!(out.status.code(), Some(code), "{out:?}");
        assert_eq!(
            stderr_line(&out),
            format!("cairn: interrupted by {name}; stopped cleanly, nothing half-done was kept")
        );
        assert!(sessions(&repo).is_empty(), "the session was closed");
        assert!(
            files_named(&repo.join("packs"), "").is_empty(),
            "the unpublished packs were deleted"
        );
        assert!(files_named(&repo, ".tmp-").is_empty());
        assert!(files_named(&repo.join("versions"), "").is_empty());
    }
    let out = cairn(&repo, &["images"]);
    assert!(out.status.success());
    assert!(out.stdout.is_empty(), "nothing was published");
}

/// Every file and directory under `dir` (not following links), with its permission bits.
fn modes_under(dir: &Path) -> Vec<(PathBuf, u32)> {
    use std::os::unix::fs::PermissionsExt;
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let m = std::fs::symlink_metadata(e.path()).unwrap();
            out.push((e.path(), m.permissions().mode() & 0o7777));
            if m.is_dir() {
                stack.push(e.path());
            }
        }
    }
    out
}

#[test]
fn a_repository_and_what_it_restores_are_private_by_default_whatever_the_umask() {
    use std::os::unix::fs::PermissionsExt;
    // SAFETY: umask only swaps the process's file-creation mask; the children the test runs
    // inherit it (what an operator with `umask 000` would run).
    let old = unsafe { libc::umask(0) };
    let dir = tempfile::tempdir().unwrap();
    let repo = init(dir.path());
    let src = dir.path().join("disk.raw");
    std::fs::write(&src, noise(1 << 20, 5)).unwrap();
    commit_file(&repo, "vm", &src);
    let out_path = dir.path().join("out.raw");
    let out = cairn(&repo, &["-q", "restore", "vm", out_path.to_str().unwrap()]);
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    assert!(out.status.success(), "{out:?}");
    let root = std::fs::metadata(&repo).unwrap().permissions().mode() & 0o7777;
    assert_eq!(root, 0o700);
    let everything = modes_under(&repo);
    assert!(everything.len() > 5, "{everything:?}");
    for (path, mode) in everything {
        let private = if path.is_dir() { 0o700 } else { 0o600 };
        assert_eq!(mode, private, "{} is {mode:o}", path.display());
    }
    let restored = std::fs::metadata(&out_path).unwrap().permissions().mode() & 0o7777;
    assert_eq!(restored, 0o600);

    // A root its owner opened to the group gives the group read access to what comes next,
    // never write access.
    std::fs::set_permissions(&repo, std::fs::Permissions::from_mode(0o750)).unwrap();
    std::fs::write(&src, noise(1 << 20, 55)).unwrap();
    commit_file(&repo, "other", &src);
    let packs: Vec<(PathBuf, u32)> = modes_under(&repo.join("packs"));
    assert!(packs.iter().any(|(_, m)| *m == 0o640), "{packs:?}");
    assert!(packs.iter().all(|(_, m)| m & 0o022 == 0), "{packs:?}");
}

#[test]
fn restore_force_keeps_the_targets_owner_mode_and_attributes() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let dir = tempfile::tempdir().unwrap();
    let repo = init(dir.path());
    let data = noise(1 << 20, 6);
    let src = dir.path().join("disk.raw");
    std::fs::write(&src, &data).unwrap();
    commit_file(&repo, "vm", &src);

    // libvirt's disk: another owner, 0640, a label.
    let target = dir.path().join("vm.raw");
    std::fs::write(&target, b"old disk").unwrap();
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o640)).unwrap();
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let owner = if root {
        64055
    } else {
        std::fs::metadata(&target).unwrap().uid()
    };
    std::os::unix::fs::chown(&target, Some(owner), Some(owner)).ok();
    let labelled = xattr::set(&target, "user.cairn-test", b"label").is_ok();
    let out = cairn(
        &repo,
        &["-q", "restore", "vm", target.to_str().unwrap(), "--force"],
    );
    assert!(out.status.success(), "{out:?}");
    assert_eq!(std::fs::read(&target).unwrap(), data);
    let m = std::fs::metadata(&target).unwrap();
    assert_eq!((m.uid(), m.mode() & 0o7777), (owner, 0o640));
    if labelled {
        assert_eq!(
            xattr::get(&target, "user.cairn-test").unwrap().as_deref(),
            Some(&b"label"[..])
        );
    }
}

/// The provenance records of `state` (CAIRN_STATE_DIR): path → (mtime_ns, size).
fn provenance_records(state: &Path) -> Vec<(String, i64, u64)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(state).into_iter().flatten().flatten() {
        if e.path().extension().is_none_or(|x| x != "json") {
            continue; // the in-place markers' directory
        }
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(e.path()).unwrap()).unwrap();
        for (path, r) in v.as_object().unwrap() {
            out.push((
                path.clone(),
                r["identity"]["mtime_ns"].as_i64().unwrap(),
                r["identity"]["size"].as_u64().unwrap(),
            ));
        }
    }
    out
}

/// A process that writes to a restored file as soon as it appears must never have its write
/// recorded as the version's (the record would let a later qcow2-overlay commit store bytes
/// the disk does not hold).
#[test]
fn a_write_racing_a_restore_is_never_recorded_as_the_version() {
    use std::os::unix::fs::{FileExt, MetadataExt};
    let dir = tempfile::tempdir().unwrap();
    let repo = init(dir.path());
    let src = dir.path().join("disk.raw");
    std::fs::write(&src, noise(1 << 20, 9)).unwrap();
    commit_file(&repo, "vm", &src);
    let state = dir.path().join("state");
    let out = dir.path().join("out.raw");
    let restore = || {
        let st = crate::common::cairn_with(
            &repo,
            &[("CAIRN_STATE_DIR", state.to_str().unwrap())],
            &["-q", "restore", "vm", out.to_str().unwrap(), "--force"],
        );
        assert!(st.status.success(), "{st:?}");
    };
    // Unraced, the restore is recorded.
    restore();
    let canonical = std::fs::canonicalize(&out).unwrap();
    let mine = |records: Vec<(String, i64, u64)>| {
        records
            .into_iter()
            .find(|(p, _, _)| Path::new(p) == canonical)
    };
    assert!(
        mine(provenance_records(&state)).is_some(),
        "an unraced restore is recorded"
    );
    let mut raced = 0;
    for _ in 0..15 {
        std::fs::remove_dir_all(&state).ok();
        let _ = std::fs::remove_file(&out);
        let path = out.clone();
        let writer = std::thread::spawn(move || {
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                if let Ok(f) = std::fs::OpenOptions::new().write(true).open(&path) {
                    f.write_all_at(&[0xee; 4096], 0).unwrap();
                    return true;
                }
                std::hint::spin_loop();
            }
            false
        });
        restore();
        if !writer.join().unwrap() {
            continue;
        }
        raced += 1;
        let now = std::fs::metadata(&out).unwrap();
        if let Some((_, mtime, size)) = mine(provenance_records(&state)) {
            let current = now.mtime() * 1_000_000_000 + now.mtime_nsec();
            assert!(
                (mtime, size) != (current, now.size()),
                "the racing write was recorded as the version"
            );
        }
    }
    assert!(raced > 0, "the writer never raced a restore");
}

/// `restore --in-place`: by diff where cairn knows what the file holds, by compare where it
/// does not; the file stays the same file (inode, mode); a run that fails half-way leaves a
/// marker, so the file is refused as a commit source until the same command finishes it.
#[test]
fn in_place_restore_writes_the_file_where_it_is_and_a_cut_short_one_is_finished_by_a_rerun() {
    use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
    let dir = tempfile::tempdir().unwrap();
    let repo = init(dir.path());
    let state = dir.path().join("state");
    let env = [("CAIRN_STATE_DIR", state.to_str().unwrap())];
    let run = |args: &[&str]| crate::common::cairn_with(&repo, &env, args);
    let json = |args: &[&str]| {
        let out = run(args);
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let a = noise(4 << 20, 21);
    let mut b = a.clone();
    for i in 0..8 {
        let at = i * 300 * 1024;
        b[at..at + 4096].copy_from_slice(&noise(4096, 30 + i as u64));
    }
    let src = dir.path().join("src.raw");
    std::fs::write(&src, &a).unwrap();
    commit_file(&repo, "vm", &src);
    std::fs::write(&src, &b).unwrap();
    commit_file(&repo, "vm", &src);
    let ids: Vec<String> = json(&["--json", "log", "vm"])
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["id"].as_str().unwrap().to_string())
        .collect();

    let out = dir.path().join("vm.raw");
    let target = out.to_str().unwrap();
    assert!(run(&["-q", "restore", "vm@2", target]).status.success());
    let inode = std::fs::metadata(&out).unwrap().ino();

    // cairn restored vm@2 there: the trees say what differs, the file is not read.
    let r = json(&["--json", "restore", "vm@1", target, "--in-place"]);
    assert_eq!(r["method"], "diff", "{r}");
    assert!(
        ids.contains(&r["held"].as_str().unwrap().to_string()),
        "{r}"
    );
    assert_eq!(r["target_read_bytes"], 0);
    assert_eq!(r["written_bytes"], 8 * 4096);
    assert_eq!(std::fs::read(&out).unwrap(), a);
    assert_eq!(std::fs::metadata(&out).unwrap().ino(), inode);

    // Changed by someone else since (a chmod, a write): compared, whatever the records said.
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o640)).unwrap();
    let f = std::fs::OpenOptions::new().write(true).open(&out).unwrap();
    f.write_all_at(&[0x55; 4096], 1 << 20).unwrap();
    drop(f);
    let r = json(&["--json", "restore", "vm@2", target, "--in-place"]);
    assert_eq!(r["method"], "compare", "{r}");
    assert_eq!(
        r["written_bytes"],
        9 * 4096,
        "eight blocks of vm@2 and the one overwritten"
    );
    assert_eq!(std::fs::read(&out).unwrap(), b);
    let m = std::fs::metadata(&out).unwrap();
    assert_eq!((m.ino(), m.mode() & 0o7777), (inode, 0o640));

    // A run that fails half-way (the packs are gone) leaves the marker.
    let packs = repo.join("packs");
    let aside = dir.path().join("packs-aside");
    std::fs::rename(&packs, &aside).unwrap();
    std::fs::create_dir(&packs).unwrap();
    let failed = run(&["restore", "vm@1", target, "--in-place"]);
    assert!(!failed.status.success(), "{failed:?}");
    std::fs::remove_dir(&packs).unwrap();
    std::fs::rename(&aside, &packs).unwrap();
    let refused = run(&["commit", "vm", target]);
    assert!(!refused.status.success());
    let line = stderr_line(&refused);
    assert!(
        line.contains("an in-place restore of vm@1 into it was interrupted")
            && line.contains(&format!(
                "run `cairn restore vm@1 {} --in-place` again",
                std::fs::canonicalize(&out).unwrap().display()
            )),
        "{line}"
    );
    // The rerun compares (the file may be torn) and finishes; the marker goes.
    let r = json(&["--json", "restore", "vm@1", target, "--in-place"]);
    assert_eq!(
        (&r["method"], &r["finished_interrupted"]),
        (&"compare".into(), &true.into()),
        "{r}"
    );
    assert_eq!(std::fs::read(&out).unwrap(), a);
    assert!(run(&["-q", "commit", "vm", target]).status.success());
}

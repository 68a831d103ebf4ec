//! Versions as files: `cairn mount` (a real FUSE mount, read by real readers and a loop
//! device) and `cairn ls|cat IMAGE@V:/path` (real ext4 file systems made by mkfs.ext4, bare
//! and inside a GPT made by sgdisk). Needs root, /dev/fuse and loop devices, as CI has.

use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::export::tool;
use crate::common::{cairn, noise};

const MIB: usize = 1 << 20;

fn ok(repo: &Path, args: &[&str]) -> Value {
    let out = cairn(repo, args);
    assert!(out.status.success(), "{args:?}: {out:?}");
    serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
}

fn is_mounted(path: &Path) -> bool {
    let table = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    let path = path.to_str().unwrap();
    table.lines().any(|l| l.split(' ').nth(4) == Some(path))
}

/// A running `cairn --json mount`.
struct Mount {
    child: Child,
    stdout: BufReader<ChildStdout>,
    stderr: Option<std::thread::JoinHandle<String>>,
    path: PathBuf,
}

impl Mount {
    fn start(repo: &Path, path: &Path, cache: &Path) -> Mount {
        let mut child = Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("--repo")
            .arg(repo)
            .args(["--json", "mount"])
            .arg(path)
            .arg("--cache-dir")
            .arg(cache)
            .env_remove("CAIRN_LOG")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut err = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert!(
            !line.is_empty(),
            "mount did not start ({:?}): {}",
            child.wait(),
            stderr.join().unwrap()
        );
        let ready: Value = serde_json::from_str(&line).unwrap();
        let path = PathBuf::from(ready["mounted"].as_str().unwrap());
        assert!(
            is_mounted(&path),
            "{} is not in the mount table",
            path.display()
        );
        Mount {
            child,
            stdout,
            stderr: Some(stderr),
            path,
        }
    }

    fn signal(&self, sig: &str) {
        let st = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(st.success());
    }

    /// Waits for the process to exit: its status, its last JSON line and its stderr.
    fn wait(&mut self) -> (std::process::ExitStatus, Value, String) {
        let status = self.child.wait().unwrap();
        let mut rest = String::new();
        self.stdout.read_to_string(&mut rest).unwrap();
        let last = rest
            .lines()
            .last()
            .map(|l| serde_json::from_str(l).unwrap())
            .unwrap_or(Value::Null);
        let err = self.stderr.take().unwrap().join().unwrap();
        (status, last, err)
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        if is_mounted(&self.path) {
            let _ = Command::new("umount").arg("-l").arg(&self.path).status();
        }
    }
}

fn names(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

/// Waits up to 5 s for `cond` (a listing is trusted for a second).
fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < Duration::from_secs(5), "{what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn every_version_reads_through_the_mount_as_its_restore_with_two_readers_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    assert!(cairn(&repo, &["init", "--reserve", "0"]).status.success());
    // Two versions that share most data, the second longer, plus a second image.
    let mut a = noise(6 * MIB, 1);
    a[2 * MIB..3 * MIB].fill(0);
    let mut b = a.clone();
    b[MIB..MIB + 4096].copy_from_slice(&noise(4096, 2));
    b.extend_from_slice(&noise(MIB + 512, 3));
    let c = noise(3 * MIB, 4);
    for (name, data) in [("a.raw", &a), ("b.raw", &b), ("c.raw", &c)] {
        std::fs::write(dir.path().join(name), data).unwrap();
    }
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    ok(&repo, &["--json", "commit", "web01/disk0", &p("a.raw")]);
    ok(&repo, &["--json", "commit", "web01/disk0", &p("b.raw")]);
    ok(&repo, &["--json", "commit", "db", &p("c.raw")]);
    ok(&repo, &["tag", "web01/disk0@1", "golden"]);

    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mut m = Mount::start(&repo, &mnt, &dir.path().join("cache"));
    assert_eq!(names(&mnt), ["db", "web01"]);
    assert_eq!(names(&mnt.join("web01")), ["disk0"]);
    let disk = mnt.join("web01/disk0");
    assert_eq!(
        names(&disk),
        ["@1.raw", "@2.raw", "@golden.raw", "latest.raw"]
    );
    assert_eq!(names(&mnt.join("db")), ["@1.raw", "latest.raw"]);
    assert_eq!(
        std::fs::metadata(disk.join("@2.raw")).unwrap().len(),
        b.len() as u64
    );

    // Each file is byte for byte what `cairn restore` writes.
    for (name, spec, want) in [
        ("@1.raw", "web01/disk0@1", &a),
        ("@2.raw", "web01/disk0@2", &b),
        ("@golden.raw", "web01/disk0@golden", &a),
        ("latest.raw", "web01/disk0", &b),
    ] {
        let restored = dir.path().join(format!("restored-{name}"));
        ok(&repo, &["restore", spec, restored.to_str().unwrap()]);
        let got = std::fs::read(disk.join(name)).unwrap();
        assert!(got == *want, "{name} differs from the committed image");
        assert!(
            got == std::fs::read(&restored).unwrap(),
            "{name} differs from its restore"
        );
    }
    assert!(std::fs::read(mnt.join("db/latest.raw")).unwrap() == c);

    // Two readers at once, in 64 KiB reads at scattered offsets, each its own version.
    let readers: Vec<_> = [("@1.raw", a.clone()), ("@2.raw", b.clone())]
        .into_iter()
        .map(|(name, want)| {
            let f = File::open(disk.join(name)).unwrap();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 65536];
                for i in 0..200u64 {
                    let off = (i * 7919 * 4096) % (want.len() as u64 - 65536);
                    f.read_exact_at(&mut buf, off).unwrap();
                    assert!(
                        buf[..] == want[off as usize..off as usize + 65536],
                        "at {off}"
                    );
                }
            })
        })
        .collect();
    for r in readers {
        r.join().unwrap();
    }

    // Read-only: writing is refused by the file system.
    let w = std::fs::OpenOptions::new()
        .write(true)
        .open(disk.join("@1.raw"))
        .unwrap_err();
    assert_eq!(w.raw_os_error(), Some(libc::EROFS), "{w}");

    // A commit made while mounted shows up; `latest.raw` follows it.
    let mut d = b.clone();
    d[..4096].copy_from_slice(&noise(4096, 5));
    std::fs::write(dir.path().join("d.raw"), &d).unwrap();
    ok(&repo, &["--json", "commit", "web01/disk0", &p("d.raw")]);
    eventually("@3.raw did not appear", || {
        names(&disk).contains(&"@3.raw".to_string())
    });
    eventually("latest.raw is not @3", || {
        let mut head = vec![0u8; 4096];
        File::open(disk.join("latest.raw"))
            .unwrap()
            .read_exact_at(&mut head, 0)
            .is_ok()
            && head == d[..4096]
    });

    // SIGTERM unmounts and says what was read.
    m.signal("TERM");
    let (status, last, err) = m.wait();
    assert!(status.success(), "{status}: {err}");
    assert_eq!(last["stopped_by"], "SIGTERM", "{last}");
    assert_eq!(last["unmounted"], mnt.to_str().unwrap());
    assert!(last["fetched_bytes"].as_u64().unwrap() > 0, "{last}");
    assert!(!is_mounted(&mnt));
    assert!(names(&mnt).is_empty());
}

#[test]
fn a_bad_mount_point_is_refused_in_one_line_and_a_busy_mount_waits_for_its_files() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    assert!(cairn(&repo, &["init", "--reserve", "0"]).status.success());
    let img = dir.path().join("a.raw");
    std::fs::write(&img, noise(MIB, 1)).unwrap();
    ok(&repo, &["--json", "commit", "vm", img.to_str().unwrap()]);
    let refused = |path: &Path, says: &str| {
        let out = cairn(&repo, &["mount", path.to_str().unwrap()]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{err}");
        assert_eq!(
            err.trim(),
            format!("cairn: error: mount point {}: {says}", path.display())
        );
    };
    refused(
        &dir.path().join("missing"),
        "does not exist (create the directory first)",
    );
    refused(&img, "is not a directory");
    refused(dir.path(), "is not empty: a mount would hide its files");

    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mut m = Mount::start(&repo, &mnt, &dir.path().join("cache"));
    refused(
        &mnt,
        "is already a mount point: unmount it first or choose another directory",
    );

    // A file open keeps the mount; closing it and stopping again unmounts.
    let held = File::open(mnt.join("vm/@1.raw")).unwrap();
    m.signal("TERM");
    std::thread::sleep(Duration::from_millis(500));
    assert!(m.child.try_wait().unwrap().is_none(), "exited while busy");
    assert!(is_mounted(&mnt));
    let mut buf = vec![0u8; 4096];
    held.read_exact_at(&mut buf, 8192).unwrap();
    assert!(buf[..] == noise(MIB, 1)[8192..12288]);
    drop(held);
    m.signal("INT");
    let (status, last, err) = m.wait();
    assert!(status.success(), "{status}: {err}");
    assert!(err.contains("is busy (1 files open"), "{err}");
    assert_eq!(last["stopped_by"], "SIGINT", "{last}");
    assert!(!is_mounted(&mnt));
}

/// A 24 MiB ext4 file system made by mkfs.ext4 from `root`.
fn ext4_image(path: &Path, root: &Path) {
    let st = tool("mkfs.ext4", "e2fsprogs")
        .args(["-q", "-F", "-b", "4096", "-L", "guest", "-d"])
        .arg(root)
        .arg(path)
        .arg("24M")
        .status()
        .unwrap();
    assert!(st.success());
}

/// A guest tree: a config file, a 700 KiB file of noise, a symlink, a nested directory.
fn guest_tree(root: &Path) -> Vec<u8> {
    let big = noise(700 * 1024 + 123, 9);
    std::fs::create_dir_all(root.join("etc")).unwrap();
    std::fs::create_dir_all(root.join("var/lib/app")).unwrap();
    std::fs::write(root.join("etc/hostname"), b"web01\n").unwrap();
    std::fs::write(root.join("var/lib/app/data.bin"), &big).unwrap();
    std::os::unix::fs::symlink("../var/lib/app/data.bin", root.join("etc/data")).unwrap();
    big
}

fn stdout_of(repo: &Path, args: &[&str]) -> Vec<u8> {
    let out = cairn(repo, args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

#[test]
fn ls_and_cat_read_files_inside_a_bare_and_a_partitioned_guest_and_a_loop_mount_agrees() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    assert!(cairn(&repo, &["init", "--reserve", "0"]).status.success());
    let root = dir.path().join("root");
    let big = guest_tree(&root);
    let fs = dir.path().join("fs.img");
    ext4_image(&fs, &root);
    // The same file system inside a GPT disk, as partition 2 (partition 1 is empty space).
    let disk = dir.path().join("disk.img");
    let fs_bytes = std::fs::read(&fs).unwrap();
    let mut d = vec![0u8; 32 * MIB];
    d[4 * MIB..4 * MIB + fs_bytes.len()].copy_from_slice(&fs_bytes);
    std::fs::write(&disk, &d).unwrap();
    let st = tool("sgdisk", "gdisk")
        .args([
            "-o",
            "-n",
            "1:2048:4095",
            "-t",
            "1:ef02",
            "-n",
            "2:8192:+24M",
            "-t",
            "2:8300",
        ])
        .arg(&disk)
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    ok(&repo, &["--json", "commit", "bare", fs.to_str().unwrap()]);
    ok(&repo, &["--json", "commit", "gpt", disk.to_str().unwrap()]);

    for image in ["bare", "gpt@1"] {
        let at = |p: &str| format!("{image}:{p}");
        assert_eq!(stdout_of(&repo, &["cat", &at("/etc/hostname")]), b"web01\n");
        assert!(stdout_of(&repo, &["cat", &at("/var/lib/app/data.bin")]) == big);
        assert!(
            stdout_of(&repo, &["cat", &at("/etc/data")]) == big,
            "symlink followed"
        );
        let ls: Value =
            serde_json::from_slice(&stdout_of(&repo, &["--json", "ls", &at("/etc")])).unwrap();
        let entries: Vec<(&str, &str)> = ls
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["name"].as_str().unwrap(), e["type"].as_str().unwrap()))
            .collect();
        assert_eq!(entries, [("data", "symlink"), ("hostname", "file")]);
        assert_eq!(ls[0]["target"], "../var/lib/app/data.bin");
        assert_eq!(ls[1]["size"], 6);
        let text = String::from_utf8(stdout_of(&repo, &["ls", &at("/var/lib/app")])).unwrap();
        assert!(text.starts_with("-rw-r--r-- "), "{text}");
        assert!(
            text.contains(&format!(" {} ", big.len())) && text.trim_end().ends_with(" data.bin"),
            "{text}"
        );
    }
    // Errors: one line each, with the kind's exit code.
    let fails = |args: &[&str], code: i32, says: &str| {
        let out = cairn(&repo, args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert_eq!(err.trim(), format!("cairn: error: {says}"), "{args:?}");
    };
    fails(
        &["cat", "bare:/nope"],
        1,
        "bare@1: /nope: no such file or directory in the guest",
    );
    fails(&["cat", "bare:/etc"], 1, "bare@1: /etc: is a directory");
    fails(
        &["cat", "bare:etc"],
        2,
        "\"bare:etc\": expected IMAGE[@V]:/path (a path in the guest, starting with /)",
    );
    fails(
        &["ls", "gpt:/", "--partition", "1"],
        1,
        "gpt@1: partition 1 (unknown) is not ext2/3/4: cairn reads ext2/3/4; for another file \
         system use `cairn mount` and a read-only loop mount",
    );
    fails(
        &["ls", "gpt:/", "--partition", "3"],
        1,
        "gpt@1: no partition 3 (found: partition 1 (unknown), partition 2 (ext2/3/4))",
    );

    // The same file through `cairn mount` and a read-only loop device on partition 2 (by
    // offset: in a container no udev makes /dev/loopNpM of `losetup -P`).
    let mnt = dir.path().join("mnt");
    let guest = dir.path().join("guest");
    std::fs::create_dir(&mnt).unwrap();
    std::fs::create_dir(&guest).unwrap();
    let mut m = Mount::start(&repo, &mnt, &dir.path().join("cache"));
    let out = tool("losetup", "util-linux")
        .args([
            "-r",
            "--show",
            "-f",
            "-o",
            &(4 * MIB).to_string(),
            "--sizelimit",
        ])
        .arg((24 * MIB).to_string())
        .arg(mnt.join("gpt/@1.raw"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    let loop_dev = String::from_utf8(out.stdout).unwrap().trim().to_string();
    let part = loop_dev.clone();
    let mounted = Command::new("mount")
        .args(["-o", "ro,noload", &part])
        .arg(&guest)
        .status()
        .unwrap();
    let read = mounted
        .success()
        .then(|| std::fs::read(guest.join("var/lib/app/data.bin")));
    let _ = Command::new("umount").arg(&guest).status();
    let _ = Command::new("losetup").args(["-d", &loop_dev]).status();
    assert!(mounted.success(), "mount {part} failed");
    assert!(
        read.unwrap().unwrap() == big,
        "the loop-mounted file differs"
    );
    let file = mnt.join("gpt/@1.raw");
    eventually("the loop device still holds the file", || {
        loop_released(&file)
    });
    m.signal("TERM");
    let (status, _, err) = m.wait();
    assert!(status.success(), "{status}: {err}");
}

/// Whether no loop device is backed by `file` any more.
fn loop_released(file: &Path) -> bool {
    let out = Command::new("losetup")
        .arg("-j")
        .arg(file)
        .output()
        .unwrap();
    out.status.success() && out.stdout.is_empty()
}

/// Runs `cmd`; it must succeed.
fn run(cmd: &mut Command) {
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{cmd:?}: {out:?}");
}

#[test]
fn xfs_and_ntfs_guests_read_back_through_the_mount_and_read_only_mounts_of_their_files() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let repo = d.join("repo");
    assert!(cairn(&repo, &["init", "--reserve", "0"]).status.success());
    let big = noise(900 * 1024 + 77, 11);

    // xfs (300 MiB, its smallest), filled through a loop mount of its own.
    let xfs = d.join("xfs.raw");
    std::fs::File::create(&xfs)
        .unwrap()
        .set_len(300 * MIB as u64)
        .unwrap();
    run(tool("mkfs.xfs", "xfsprogs").args(["-q", "-f"]).arg(&xfs));
    let fill = d.join("fill");
    std::fs::create_dir(&fill).unwrap();
    run(Command::new("mount")
        .args(["-o", "loop"])
        .arg(&xfs)
        .arg(&fill));
    std::fs::create_dir(fill.join("srv")).unwrap();
    let wrote = std::fs::write(fill.join("srv/data.bin"), &big);
    run(Command::new("umount").arg(&fill));
    wrote.unwrap();
    // NTFS (16 MiB) made by mkntfs, the file copied in by ntfscp (no mount needed).
    let ntfs = d.join("ntfs.raw");
    std::fs::File::create(&ntfs)
        .unwrap()
        .set_len(16 * MIB as u64)
        .unwrap();
    run(tool("mkntfs", "ntfs-3g")
        .args(["-q", "-F", "-Q", "-L", "guest"])
        .arg(&ntfs));
    let src = d.join("data.bin");
    std::fs::write(&src, &big).unwrap();
    run(tool("ntfscp", "ntfs-3g")
        .arg(&ntfs)
        .arg(&src)
        .arg("data.bin"));
    for (image, file) in [("xfs", &xfs), ("ntfs", &ntfs)] {
        ok(&repo, &["commit", image, file.to_str().unwrap()]);
    }

    // Through `cairn mount`: xfs on a read-only loop device, NTFS by ntfs-3g read-only.
    let mnt = d.join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mut m = Mount::start(&repo, &mnt, &d.join("cache"));
    let guest = d.join("guest");
    std::fs::create_dir(&guest).unwrap();
    let mounted = Command::new("mount")
        .args(["-o", "ro,loop,norecovery"])
        .arg(mnt.join("xfs/@1.raw"))
        .arg(&guest)
        .status()
        .unwrap();
    let read = mounted
        .success()
        .then(|| std::fs::read(guest.join("srv/data.bin")));
    let _ = Command::new("umount").arg(&guest).status();
    assert!(mounted.success(), "mount of xfs/@1.raw failed");
    assert!(
        read.unwrap().unwrap() == big,
        "the file read from xfs differs"
    );

    let mounted = tool("ntfs-3g", "ntfs-3g")
        .args(["-o", "ro"])
        .arg(mnt.join("ntfs/@1.raw"))
        .arg(&guest)
        .status()
        .unwrap();
    let read = mounted
        .success()
        .then(|| std::fs::read(guest.join("data.bin")));
    let _ = Command::new("umount").arg(&guest).status();
    assert!(mounted.success(), "ntfs-3g of ntfs/@1.raw failed");
    assert!(
        read.unwrap().unwrap() == big,
        "the file read from NTFS differs"
    );

    // Once the loop device and ntfs-3g let go of the files, SIGTERM unmounts.
    let xfs_file = mnt.join("xfs/@1.raw");
    eventually("the loop device lets go of xfs/@1.raw", || {
        loop_released(&xfs_file)
    });
    eventually("ntfs-3g exits", || {
        let out = Command::new("pgrep")
            .args(["-x", "ntfs-3g"])
            .output()
            .unwrap();
        out.stdout.is_empty()
    });
    m.signal("TERM");
    let (status, _, err) = m.wait();
    assert!(status.success(), "{status}: {err}");
    assert!(!is_mounted(&mnt));
}

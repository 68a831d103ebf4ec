//! `cairn export`: a version served over NBD to real clients (qemu-img, nbdcopy, nbdinfo),
//! the shared chunk cache, and failure when the repository goes away.

mod common;
use common::cairn;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

fn tool(name: &str, package: &str) -> Command {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {name}"))
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    assert!(
        found,
        "{name} is missing: install the Debian package {package}"
    );
    Command::new(name)
}

/// An image: 3 MiB of noise, 2 MiB of zeros, then `tail` bytes of noise seeded by `seed`
/// (QEMU sees NBD disks in whole 512-byte sectors, so keep `tail` a multiple of 512).
fn image(dir: &Path, name: &str, seed: u64, tail: usize) -> PathBuf {
    let mut data = Vec::new();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut noise = |n: usize, s: u64, out: &mut Vec<u8>| {
        x ^= s;
        for _ in 0..n / 8 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            out.extend_from_slice(&x.to_le_bytes());
        }
    };
    noise(3 << 20, 1, &mut data);
    data.extend(std::iter::repeat_n(0u8, 2 << 20));
    noise(tail, seed, &mut data);
    let path = dir.join(name);
    std::fs::write(&path, &data).unwrap();
    path
}

struct Served {
    child: Child,
    socket: PathBuf,
    stats: PathBuf,
    /// The first object the export printed with `--json` once it served.
    ready: Value,
    /// The rest of its standard output (kept open so that it can go on printing).
    _stdout: BufReader<ChildStdout>,
    /// Collects its standard error until it exits.
    stderr: Option<std::thread::JoinHandle<String>>,
}

impl Served {
    /// Runs `cairn --json export ARGS… --socket DIR/TAG.sock` (run directory DIR/run, cache
    /// DIR/cache, counters in DIR/TAG.json; no `--socket` when ARGS has `--listen`) and waits
    /// until it prints that it serves (its `--json` line; by then every socket is bound).
    fn spawn(repo: &Path, dir: &Path, tag: &str, args: &[&str]) -> Served {
        Self::spawn_env(repo, dir, tag, args, &[])
    }

    fn spawn_env(
        repo: &Path,
        dir: &Path,
        tag: &str,
        args: &[&str],
        env: &[(&str, &std::ffi::OsStr)],
    ) -> Served {
        let socket = dir.join(format!("{tag}.sock"));
        let stats = dir.join(format!("{tag}.json"));
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_cairn"));
        cmd.arg("--repo")
            .arg(repo)
            .args(["--json", "export"])
            .args(args);
        if !args.contains(&"--listen") {
            cmd.arg("--socket").arg(&socket);
        }
        cmd.arg("--cache-dir")
            .arg(dir.join("cache"))
            .arg("--stats-file")
            .arg(&stats)
            .env("CAIRN_RUN_DIR", dir.join("run"))
            .env_remove("CAIRN_LOG")
            .env_remove("NOTIFY_SOCKET")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let mut child = cmd.spawn().unwrap();
        let mut err = child.stderr.take().unwrap();
        let stderr = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = err.read_to_string(&mut s);
            s
        });
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        if line.is_empty() {
            let status = child.wait().unwrap();
            panic!(
                "export did not start ({status}): {}",
                stderr.join().unwrap()
            );
        }
        let ready: Value = serde_json::from_str(&line).unwrap();
        Served {
            child,
            socket,
            stats,
            ready,
            _stdout: out,
            stderr: Some(stderr),
        }
    }

    /// A read-only export of `spec` named `disk`.
    fn start(repo: &Path, spec: &str, dir: &Path, tag: &str) -> Served {
        Self::spawn(repo, dir, tag, &[spec, "--name", "disk"])
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///disk?socket={}", self.socket.display())
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The export's counters (written every second and at exit).
    fn stats(&mut self) -> Value {
        std::thread::sleep(Duration::from_millis(1200));
        serde_json::from_slice(&std::fs::read(&self.stats).unwrap()).unwrap()
    }

    /// Sends `signal` (TERM, INT, KILL) and returns the exit status and what it printed on
    /// standard error.
    fn signal(&mut self, signal: &str) -> (std::process::ExitStatus, String) {
        let st = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status()
            .unwrap();
        assert!(st.success());
        self.wait()
    }

    /// Waits for the export to exit; its exit status and standard error.
    fn wait(&mut self) -> (std::process::ExitStatus, String) {
        let status = self.child.wait().unwrap();
        let err = self
            .stderr
            .take()
            .map(|h| h.join().unwrap())
            .unwrap_or_default();
        (status, err)
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Asserts two files are equal, naming the first difference (never printing the contents).
fn same_file(got: &Path, want: &Path, what: &str) {
    let (g, w) = (std::fs::read(got).unwrap(), std::fs::read(want).unwrap());
    let first = g.iter().zip(&w).position(|(a, b)| a != b);
    assert!(
        g == w,
        "{what}: {} bytes vs {} expected, first difference at {first:?}",
        g.len(),
        w.len()
    );
}

fn setup() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    assert!(cairn(&repo, &["-q", "init"]).status.success());
    let a = image(dir.path(), "a.raw", 7, (1 << 20) + 12288);
    let b = image(dir.path(), "b.raw", 8, 1 << 20);
    for (img, path) in [("vm", &a), ("other", &b)] {
        let out = cairn(&repo, &["-q", "commit", img, path.to_str().unwrap()]);
        assert!(out.status.success(), "{out:?}");
    }
    (dir, repo, a, b)
}

#[test]
fn real_clients_read_a_version_bit_exact_and_skip_its_holes() {
    let (dir, repo, a, _) = setup();
    let mut served = Served::start(&repo, "vm@1", dir.path(), "a");

    let out = dir.path().join("convert.raw");
    let st = tool("qemu-img", "qemu-utils")
        .args(["convert", "-f", "raw", "-O", "raw", &served.uri()])
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success());
    same_file(&out, &a, "qemu-img convert");

    let copy = dir.path().join("copy.raw");
    let st = tool("nbdcopy", "libnbd-bin")
        .arg(served.uri())
        .arg(&copy)
        .status()
        .unwrap();
    assert!(st.success());
    same_file(&copy, &a, "nbdcopy");

    // The map shows the zero run as a hole, exactly where it is.
    let map = tool("nbdinfo", "libnbd-bin")
        .args(["--map", &served.uri()])
        .output()
        .unwrap();
    let map = String::from_utf8(map.stdout).unwrap();
    let rows: Vec<Vec<&str>> = map
        .lines()
        .map(|l| l.split_whitespace().collect())
        .collect();
    assert_eq!(rows.len(), 3, "{map}");
    assert_eq!(rows[0][..3], ["0", "3145728", "0"], "{map}");
    assert_eq!(rows[1][..3], ["3145728", "2097152", "3"], "{map}");
    assert_eq!(rows[2][..3], ["5242880", "1060864", "0"], "{map}");

    // The data was fetched once (the second client read from the cache), zeros never.
    let s = served.stats();
    let data_bytes = 3 * 1048576 + 1048576 + 12288;
    assert_eq!(s["bytes_fetched"].as_u64().unwrap(), data_bytes, "{s}");
    assert!(s["cache_hits"].as_u64().unwrap() > 0, "{s}");
    assert_eq!(s["fetch_errors"], 0);

    // Writes to a read-only export are refused.
    let w = tool("qemu-io", "qemu-utils")
        .args(["-f", "raw", "-c", "write -P 0xab 0 4096", &served.uri()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&w.stdout).to_string() + &String::from_utf8_lossy(&w.stderr);
    assert!(!text.contains("wrote 4096"), "{text}");
}

#[test]
fn a_second_export_fetches_only_what_the_cache_lacks() {
    let (dir, repo, _, b) = setup();
    {
        let served = Served::start(&repo, "vm", dir.path(), "a");
        let st = tool("qemu-img", "qemu-utils")
            .args(["convert", "-f", "raw", "-O", "raw", &served.uri()])
            .arg(dir.path().join("a-out.raw"))
            .status()
            .unwrap();
        assert!(st.success());
    }
    // Another image sharing its first 3 MiB: only its own last MiB comes from the repository.
    let mut served = Served::start(&repo, "other", dir.path(), "b");
    let out = dir.path().join("b-out.raw");
    let st = tool("qemu-img", "qemu-utils")
        .args(["convert", "-f", "raw", "-O", "raw", &served.uri()])
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success());
    same_file(&out, &b, "second export");
    let s = served.stats();
    assert_eq!(s["bytes_fetched"].as_u64().unwrap(), 1 << 20, "{s}");
    assert_eq!(s["cache_hits"].as_u64().unwrap(), 3 * 64, "{s}");
}

#[test]
fn reads_fail_with_an_error_when_the_repository_is_gone() {
    let (dir, repo, _, _) = setup();
    let served = Served::start(&repo, "vm", dir.path(), "a");
    std::fs::rename(repo.join("packs"), dir.path().join("packs-away")).unwrap();
    let out = tool("qemu-io", "qemu-utils")
        .args(["-r", "-f", "raw", "-c", "read -P 0 0 65536", &served.uri()])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("Input/output error"), "{text}");
    // Zeros need no repository.
    let out = tool("qemu-io", "qemu-utils")
        .args([
            "-r",
            "-f",
            "raw",
            "-c",
            "read -P 0 3145728 65536",
            &served.uri(),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.contains("read 65536/65536 bytes"), "{text}");
}

/// A writable export of `spec` named `disk`, its overlay in DIR/overlay.
fn start_writable(repo: &Path, spec: &str, dir: &Path, tag: &str) -> Served {
    let overlay = dir.join("overlay");
    Served::spawn(
        repo,
        dir,
        tag,
        &[
            spec,
            "--name",
            "disk",
            "--writable",
            "--overlay",
            overlay.to_str().unwrap(),
        ],
    )
}

/// `cairn` with the test's run directory, so that it finds the export's control socket.
fn cairn_ctl(repo: &Path, dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--repo")
        .arg(repo)
        .args(args)
        .env("CAIRN_RUN_DIR", dir.join("run"))
        .output()
        .unwrap()
}

fn qemu_io(uri: &str, cmds: &[&str]) -> String {
    let mut c = tool("qemu-io", "qemu-utils");
    c.args(["-f", "raw"]);
    for cmd in cmds {
        c.args(["-c", cmd]);
    }
    let out = c.arg(uri).output().unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && !text.contains("failed") && !text.contains("error"),
        "{cmds:?}: {text}"
    );
    text
}

#[test]
fn writes_go_to_the_overlay_and_commit_back_as_a_new_version() {
    let (dir, repo, a, _) = setup();
    let served = start_writable(&repo, "vm", dir.path(), "w");
    let uri = served.uri();
    // A partial-block write across two blocks, a full block, zeros over data, and data in the
    // zero run.
    qemu_io(
        &uri,
        &[
            "write -P 0xab 10000 30000",
            "write -P 0xcd 65536 16384",
            "write -z 131072 16384",
            "write -P 0xef 4194304 8192",
            "flush",
        ],
    );
    let mut want = std::fs::read(&a).unwrap();
    want[10000..40000].fill(0xab);
    want[65536..81920].fill(0xcd);
    want[131072..147456].fill(0);
    want[4194304..4202496].fill(0xef);
    qemu_io(
        &uri,
        &["read -P 0xab 10000 30000", "read -P 0xef 4194304 8192"],
    );
    let copy = dir.path().join("live.raw");
    let st = tool("nbdcopy", "libnbd-bin")
        .arg(&uri)
        .arg(&copy)
        .status()
        .unwrap();
    assert!(st.success());
    same_file_bytes(&copy, &want, "export with overlay");

    let status = cairn_ctl(&repo, dir.path(), &["--json", "status", "disk"]);
    let status: Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["overlay"]["blocks_held"], 6, "{status}"); // 2 + 1 + 1 + 1 + 1 blocks of 16 KiB

    // COMMIT: a new version of vm holding exactly what the export showed.
    let out = cairn_ctl(
        &repo,
        dir.path(),
        &[
            "--json",
            "commit",
            "vm",
            "--from-export",
            "disk",
            "-m",
            "from qemu",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["image"].as_str(), v["seq"].as_u64()),
        (Some("vm"), Some(2)),
        "{v}"
    );
    assert_eq!(v["new_chunks"], 5, "{v}"); // the zeroed block is a hole
    let restored = dir.path().join("v2.raw");
    assert!(cairn(
        &repo,
        &[
            "-q",
            "restore",
            "vm@2",
            restored.to_str().unwrap(),
            "--force"
        ]
    )
    .status
    .success());
    same_file_bytes(&restored, &want, "committed version");

    // The export goes on with the new version and an empty overlay.
    let status: Value =
        serde_json::from_slice(&cairn_ctl(&repo, dir.path(), &["--json", "status", "disk"]).stdout)
            .unwrap();
    assert_eq!(
        (
            status["seq"].as_u64(),
            status["overlay"]["blocks_held"].as_u64()
        ),
        (Some(2), Some(0)),
        "{status}"
    );
    qemu_io(&uri, &["read -P 0xcd 65536 16384"]);

    // Writes committed into a new image start its history at the export's version.
    qemu_io(&uri, &["write -P 0x11 0 4096", "flush"]);
    let out = cairn_ctl(
        &repo,
        dir.path(),
        &["-q", "commit", "branch", "--from-export", "disk"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let log = String::from_utf8(cairn(&repo, &["log", "branch"]).stdout).unwrap();
    assert!(log.starts_with("branch@1 "), "{log}");
    assert!(log.contains("\ncloned from vm@2 ("), "{log}");
}

/// Asserts a file equals `want` (never printing the contents).
fn same_file_bytes(got: &Path, want: &[u8], what: &str) {
    let g = std::fs::read(got).unwrap();
    let first = g.iter().zip(want).position(|(a, b)| a != b);
    assert!(
        g == want,
        "{what}: {} bytes vs {} expected, first difference at {first:?}",
        g.len(),
        want.len()
    );
}

#[test]
fn overlay_snapshots_roll_back_and_flushed_writes_survive_kill_9() {
    let (dir, repo, _, _) = setup();
    let mut served = start_writable(&repo, "vm", dir.path(), "w");
    let uri = served.uri();
    qemu_io(&uri, &["write -P 0x11 0 16384", "flush"]);
    let ok = |args: &[&str]| {
        let out = cairn_ctl(&repo, dir.path(), args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    ok(&["overlay", "snapshot", "disk", "s1"]);
    qemu_io(
        &uri,
        &[
            "write -P 0x22 0 16384",
            "write -P 0x33 16384 16384",
            "flush",
        ],
    );
    assert_eq!(ok(&["overlay", "list", "disk"]), "disk: snapshots s1\n");
    ok(&["overlay", "rollback", "disk", "s1"]);
    qemu_io(&uri, &["read -P 0x11 0 16384"]);
    ok(&["overlay", "snapshot", "disk", "s2"]);
    qemu_io(&uri, &["write -P 0x44 32768 16384", "flush"]);
    ok(&["overlay", "delete", "disk", "s1"]);
    qemu_io(&uri, &["read -P 0x11 0 16384", "read -P 0x44 32768 16384"]);

    // kill -9, then a new export on the same version reopens the overlay with its writes.
    served.child.kill().unwrap();
    served.child.wait().unwrap();
    let served = start_writable(&repo, "vm", dir.path(), "w2");
    qemu_io(
        &served.uri(),
        &["read -P 0x11 0 16384", "read -P 0x44 32768 16384"],
    );
    let status: Value =
        serde_json::from_slice(&cairn_ctl(&repo, dir.path(), &["--json", "status", "disk"]).stdout)
            .unwrap();
    assert_eq!(
        status["overlay"]["snapshots"],
        serde_json::json!(["s2"]),
        "{status}"
    );
}

#[test]
fn one_process_serves_several_exports_sharing_one_cache() {
    let (dir, repo, a, b) = setup();
    let served = Served::spawn(&repo, dir.path(), "multi", &["vm@1=first", "other=second"]);
    let socket = served.socket.clone();
    let list = tool("nbdinfo", "libnbd-bin")
        .args([
            "--list",
            "--json",
            &format!("nbd+unix:///?socket={}", socket.display()),
        ])
        .output()
        .unwrap();
    let list: Value = serde_json::from_slice(&list.stdout).unwrap();
    let mut names: Vec<&str> = list["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["export-name"].as_str().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["first", "second"], "{list}");
    for (name, want) in [("first", &a), ("second", &b)] {
        let out = dir.path().join(format!("{name}.raw"));
        let st = tool("qemu-img", "qemu-utils")
            .args(["convert", "-f", "raw", "-O", "raw"])
            .arg(format!("nbd+unix:///{name}?socket={}", socket.display()))
            .arg(&out)
            .status()
            .unwrap();
        assert!(st.success());
        same_file(&out, want, name);
    }
    let status = cairn_ctl(&repo, dir.path(), &["--json", "status", "second"]);
    let status: Value = serde_json::from_slice(&status.stdout).unwrap();
    // The second image shares its first 3 MiB with the first: served from the cache.
    assert_eq!(status["stats"]["bytes_fetched"], 1 << 20, "{status}");
    drop(served);
}

/// `nbdinfo [ cairn export … ]` starts the export itself (socket activation) and talks to it.
#[test]
fn a_client_can_start_the_export_itself() {
    let (dir, repo, a, _) = setup();
    let out = tool("nbdinfo", "libnbd-bin")
        .args(["--size", "--", "["])
        .arg(env!("CARGO_BIN_EXE_cairn"))
        .arg("--repo")
        .arg(&repo)
        .args(["-q", "export", "vm", "--cache-dir"])
        .arg(dir.path().join("cache"))
        .arg("]")
        .env("CAIRN_RUN_DIR", dir.path().join("run"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let size = std::fs::metadata(&a).unwrap().len();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        size.to_string()
    );
}

// ------------------------------------------------------------------ lifecycle

/// `cairn ARGS…` with the test's run directory and overlay root (DIR/state), no repository
/// unless ARGS names one.
fn cairn_in(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(args)
        .env("CAIRN_RUN_DIR", dir.join("run"))
        .env("XDG_STATE_HOME", dir.join("state"))
        .env_remove("CAIRN_LOG")
        .env_remove("CAIRN_REPO")
        .output()
        .unwrap()
}

fn stdout(out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// The last line a process printed on standard error.
fn last_line(stderr: &str) -> &str {
    stderr.lines().last().unwrap_or_default()
}

/// The 12-digit short id of a version.
fn short_id(repo: &Path, spec: &str) -> String {
    let out = cairn(repo, &["--json", "show", spec]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["id"].as_str().unwrap()[..12].to_string()
}

fn full_id(repo: &Path, spec: &str) -> String {
    let out = cairn(repo, &["--json", "show", spec]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["id"].as_str().unwrap().to_string()
}

#[test]
fn export_json_announces_each_export_with_its_uri_once_it_serves() {
    let (dir, repo, a, _) = setup();
    let served = Served::start(&repo, "vm@1", dir.path(), "a");
    let socket = served.socket.display().to_string();
    assert_eq!(
        served.ready,
        serde_json::json!({
            "name": "disk",
            "uri": format!("nbd+unix:///disk?socket={socket}"),
            "version": "vm@1",
            "id": full_id(&repo, "vm@1"),
            "pid": served.pid(),
            "socket": socket,
            "listen": null,
            "writable": false,
            "tls": false,
            "overlay": null,
        })
    );
    // The URI works as printed.
    let out = dir.path().join("out.raw");
    let st = tool("qemu-img", "qemu-utils")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(served.ready["uri"].as_str().unwrap())
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success());
    same_file(&out, &a, "the announced URI");

    // On TCP, port 0 is announced as the port it got.
    let tcp = Served::spawn(
        &repo,
        dir.path(),
        "t",
        &["vm@1", "--name", "tcp", "--listen", "127.0.0.1:0"],
    );
    let uri = tcp.ready["uri"].as_str().unwrap();
    let listen = tcp.ready["listen"].as_str().unwrap();
    assert!(
        listen.starts_with("127.0.0.1:") && !listen.ends_with(":0"),
        "{listen}"
    );
    assert_eq!(uri, format!("nbd://{listen}/tcp"));
    let size = tool("nbdinfo", "libnbd-bin")
        .args(["--size", uri])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&size.stdout).trim(),
        std::fs::metadata(&a).unwrap().len().to_string()
    );
}

#[test]
fn a_second_export_cannot_take_a_busy_socket_or_name() {
    let (dir, repo, a, _) = setup();
    let served = Served::start(&repo, "vm@1", dir.path(), "a");
    let pid = served.pid();
    let run = dir.path().join("run");
    let try_export = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("--repo")
            .arg(&repo)
            .arg("export")
            .args(args)
            .arg("--cache-dir")
            .arg(dir.path().join("cache"))
            .env("CAIRN_RUN_DIR", &run)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        common::stderr_line(&out)
    };
    let socket = served.socket.display().to_string();
    assert_eq!(
        try_export(&["vm@1", "--name", "other", "--socket", &socket]),
        format!(
            "cairn: error: socket {socket} is in use by export \"disk\" (pid {pid}); \
             stop it with `cairn exports stop disk` or choose another --socket"
        )
    );
    let elsewhere = dir.path().join("b.sock");
    assert_eq!(
        try_export(&[
            "vm@1",
            "--name",
            "disk",
            "--socket",
            elsewhere.to_str().unwrap()
        ]),
        format!(
            "cairn: error: export name \"disk\" is in use by pid {pid} ({}); \
             stop it with `cairn exports stop disk` or choose another --name",
            run.join("disk.ctl").display()
        )
    );
    assert!(!elsewhere.exists());

    // A socket some other program serves is not taken either.
    let foreign = dir.path().join("foreign.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&foreign).unwrap();
    assert_eq!(
        try_export(&[
            "vm@1",
            "--name",
            "third",
            "--socket",
            foreign.to_str().unwrap()
        ]),
        format!(
            "cairn: error: socket {} is in use by pid {}; choose another --socket",
            foreign.display(),
            std::process::id()
        )
    );

    // The first export still serves, and its control socket is still its own.
    let out = dir.path().join("out.raw");
    let st = tool("qemu-img", "qemu-utils")
        .args(["convert", "-f", "raw", "-O", "raw", &served.uri()])
        .arg(&out)
        .status()
        .unwrap();
    assert!(st.success());
    same_file(&out, &a, "first export");
    let status: Value =
        serde_json::from_slice(&cairn_ctl(&repo, dir.path(), &["--json", "status", "disk"]).stdout)
            .unwrap();
    assert_eq!(status["pid"], pid, "{status}");
}

/// A file of `len` bytes with a pattern no version has.
fn pattern(dir: &Path, len: u64) -> PathBuf {
    let path = dir.join("pattern.raw");
    let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8 ^ 0x5a).collect();
    std::fs::write(&path, data).unwrap();
    path
}

#[test]
fn sigterm_stops_an_export_cleanly_and_keeps_unflushed_writes() {
    let (dir, repo, a, _) = setup();
    let mut served = start_writable(&repo, "vm", dir.path(), "w");
    let run = dir.path().join("run");
    assert!(run.join("disk.json").exists());
    // nbdcopy writes without a flush (no --flush).
    let want = pattern(dir.path(), std::fs::metadata(&a).unwrap().len());
    let st = tool("nbdcopy", "libnbd-bin")
        .arg(&want)
        .arg(served.uri())
        .status()
        .unwrap();
    assert!(st.success());
    let (status, err) = served.signal("TERM");
    assert_eq!(status.code(), Some(0), "{err}");
    assert_eq!(
        last_line(&err),
        "cairn: export disk stopped (SIGTERM); overlay flushed"
    );
    for gone in [
        served.socket.clone(),
        run.join("disk.ctl"),
        run.join("disk.json"),
    ] {
        assert!(!gone.exists(), "{} left behind", gone.display());
    }
    // Every write is there after a restart.
    let mut again = start_writable(&repo, "vm", dir.path(), "w2");
    let copy = dir.path().join("copy.raw");
    let st = tool("nbdcopy", "libnbd-bin")
        .arg(again.uri())
        .arg(&copy)
        .status()
        .unwrap();
    assert!(st.success());
    same_file(&copy, &want, "writes after SIGTERM and restart");
    // SIGINT (^C) too; a read-only export has no overlay to flush.
    let (status, err) = again.signal("INT");
    assert_eq!(status.code(), Some(0), "{err}");
    assert_eq!(
        last_line(&err),
        "cairn: export disk stopped (SIGINT); overlay flushed"
    );
    let mut ro = Served::start(&repo, "vm@1", dir.path(), "r");
    let (status, err) = ro.signal("INT");
    assert_eq!(status.code(), Some(0), "{err}");
    assert_eq!(last_line(&err), "cairn: export disk stopped (SIGINT)");
}

#[test]
fn exports_lists_running_exports_and_stops_one() {
    let (dir, repo, _, _) = setup();
    let d = dir.path();
    let repo_s = repo.to_str().unwrap();
    assert_eq!(stdout(&cairn_in(d, &["exports"])), "no running exports\n");

    let mut w = start_writable(&repo, "vm", d, "w");
    let mut r = Served::spawn(&repo, d, "r", &["other", "--name", "ro"]);
    qemu_io(&w.uri(), &["write -P 0x11 0 20000", "flush"]);
    let (vm1, other1) = (short_id(&repo, "vm@1"), short_id(&repo, "other@1"));
    let overlay = d.join("overlay");
    let text = stdout(&cairn_in(d, &["exports"]));
    assert_eq!(
        text,
        format!(
            "disk  vm@1 ({vm1}), pid {}, nbd+unix:///disk?socket={}, overlay {} (32.0 KiB held)\n\
             ro  other@1 ({other1}), pid {}, nbd+unix:///ro?socket={}, read-only\n",
            w.pid(),
            w.socket.display(),
            overlay.display(),
            r.pid(),
            r.socket.display(),
        )
    );
    let json: Value = serde_json::from_str(&stdout(&cairn_in(d, &["--json", "exports"]))).unwrap();
    let list = json.as_array().unwrap();
    assert_eq!(list.len(), 2, "{json}");
    assert_eq!(list[0]["name"], "disk");
    assert_eq!(list[0]["version"], "vm@1");
    assert_eq!(list[0]["pid"], w.pid());
    assert_eq!(list[0]["socket"], w.socket.display().to_string());
    assert_eq!(list[0]["writable"], true);
    assert_eq!(list[0]["overlay"]["dir"], overlay.display().to_string());
    assert_eq!(list[0]["overlay"]["bytes_held"], 32768);
    assert_eq!(list[1]["name"], "ro");
    assert_eq!(list[1]["overlay"], Value::Null);

    // An export killed with SIGKILL leaves its files behind: they are cleaned, not listed.
    r.child.kill().unwrap();
    r.child.wait().unwrap();
    assert!(d.join("run/ro.json").exists());
    let text = stdout(&cairn_in(d, &["exports"]));
    assert!(text.starts_with("disk  vm@1"), "{text}");
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(!d.join("run/ro.json").exists());
    assert!(!d.join("run/ro.ctl").exists());
    assert!(!r.socket.exists());

    // A restore onto what the running export serves from (its overlay, its socket) is
    // refused, even with --force, and changes nothing.
    let data = overlay.join("data");
    let inside = if data.exists() {
        data.clone()
    } else {
        overlay.join("new.raw")
    };
    let before = std::fs::read(&inside).ok();
    for target in [inside.clone(), w.socket.clone()] {
        let out = cairn_in(
            d,
            &[
                "--repo",
                repo_s,
                "restore",
                "vm",
                target.to_str().unwrap(),
                "--force",
            ],
        );
        assert_eq!(out.status.code(), Some(1));
        assert_eq!(
            common::stderr_line(&out),
            format!(
                "cairn: error: will not restore to {}: it belongs to the running export disk \
                 (pid {}); stop it first with `cairn exports stop disk`",
                target.display(),
                w.pid()
            )
        );
    }
    assert_eq!(std::fs::read(&inside).ok(), before);

    // Stop: the export flushes, cleans up and exits 0; then it is gone.
    let out = cairn_in(d, &["--repo", repo_s, "exports", "stop", "disk"]);
    assert_eq!(
        stdout(&out),
        format!("stopped export disk (pid {})\n", w.pid())
    );
    let (status, err) = w.wait();
    assert_eq!(status.code(), Some(0), "{err}");
    assert_eq!(
        last_line(&err),
        "cairn: export disk stopped (SIGTERM); overlay flushed"
    );
    assert_eq!(stdout(&cairn_in(d, &["exports"])), "no running exports\n");
    assert_eq!(stdout(&cairn_in(d, &["--json", "exports"])), "[]\n");
    let out = cairn_in(d, &["exports", "stop", "disk"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        common::stderr_line(&out),
        format!(
            "cairn: error: no running export named \"disk\" (run directory {})",
            d.join("run").display()
        )
    );
}

#[test]
fn an_export_restarts_after_a_commit_into_another_image() {
    let (dir, repo, a, _) = setup();
    let d = dir.path();
    let mut w = start_writable(&repo, "vm", d, "w");
    qemu_io(&w.uri(), &["write -P 0x22 0 16384", "flush"]);
    let out = cairn_ctl(
        &repo,
        d,
        &["-q", "commit", "branch", "--from-export", "disk"],
    );
    assert!(out.status.success(), "{out:?}");
    let (status, err) = w.signal("TERM");
    assert_eq!(status.code(), Some(0), "{err}");
    // The overlay holds nothing since the commit: the export starts again on vm (its newest
    // version, where the overlay no longer is).
    let w = start_writable(&repo, "vm", d, "w2");
    assert_eq!(w.ready["version"], "vm@1");
    let copy = d.join("copy.raw");
    let st = tool("nbdcopy", "libnbd-bin")
        .arg(w.uri())
        .arg(&copy)
        .status()
        .unwrap();
    assert!(st.success());
    same_file(&copy, &a, "vm@1 after the restart");
}

#[test]
fn an_overlay_on_another_base_says_what_to_do() {
    let (dir, repo, _, _) = setup();
    let d = dir.path();
    let overlay = d.join("overlay");
    let mut w = start_writable(&repo, "vm", d, "w");
    qemu_io(&w.uri(), &["write -P 0x22 0 16384", "flush"]);
    let out = cairn_ctl(
        &repo,
        d,
        &["-q", "commit", "branch", "--from-export", "disk"],
    );
    assert!(out.status.success(), "{out:?}");
    // Writes after the commit sit on branch@1.
    qemu_io(&w.uri(), &["write -P 0x33 16384 16384", "flush"]);
    w.signal("TERM");
    let out = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--repo")
        .arg(&repo)
        .args(["export", "vm", "--name", "disk", "--writable", "--overlay"])
        .arg(&overlay)
        .env("CAIRN_RUN_DIR", d.join("run"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let o = overlay.display();
    assert_eq!(
        common::stderr_line(&out),
        format!(
            "cairn: error: overlay {o} holds 16.0 KiB of writes made over branch@1 ({}), not \
             over vm@1 ({}): continue with `cairn export branch@1 --writable --name disk \
             --overlay {o}`, commit them while that runs with `cairn commit IMAGE --from-export \
             disk`, or discard them with `cairn overlay discard {o} --yes`",
            short_id(&repo, "branch@1"),
            short_id(&repo, "vm@1"),
        )
    );
    // The first way out works.
    let w = start_writable(&repo, "branch@1", d, "w3");
    qemu_io(
        &w.uri(),
        &["read -P 0x22 0 16384", "read -P 0x33 16384 16384"],
    );
    drop(w);
    // And so does the last.
    let out = cairn_in(
        d,
        &["overlay", "discard", overlay.to_str().unwrap(), "--yes"],
    );
    assert_eq!(
        stdout(&out),
        format!("discarded overlay {o} (16.0 KiB of writes)\n")
    );
    assert!(!overlay.exists());
    start_writable(&repo, "vm", d, "w4");
}

#[test]
fn overlays_are_listed_and_discarded_without_a_running_export() {
    let (dir, repo, _, _) = setup();
    let d = dir.path();
    let repo_s = repo.to_str().unwrap();
    let root = d.join("state/cairn/overlays");
    assert_eq!(
        stdout(&cairn_in(d, &["--repo", repo_s, "overlay", "list"])),
        format!("no overlays in {}\n", root.display())
    );
    let state = d.join("state");
    let mut w = Served::spawn_env(
        &repo,
        d,
        "w",
        &["vm", "--name", "web/disk", "--writable"],
        &[("XDG_STATE_HOME", state.as_os_str())],
    );
    let uri = format!("nbd+unix:///web/disk?socket={}", w.socket.display());
    qemu_io(&uri, &["write -P 0x11 0 16384", "flush"]);
    let ok = |args: &[&str]| stdout(&cairn_in(d, args));
    ok(&["overlay", "snapshot", "web/disk", "s1"]);
    qemu_io(&uri, &["write -P 0x12 65536 16384", "flush"]);
    // The existing form still lists a running export's snapshots.
    assert_eq!(
        ok(&["overlay", "list", "web/disk"]),
        "web/disk: snapshots s1\n"
    );
    let vm1 = short_id(&repo, "vm@1");
    let dirpath = root.join("web_disk");
    assert_eq!(
        ok(&["--repo", repo_s, "overlay", "list"]),
        format!(
            "web_disk  base vm@1 ({vm1}), 32.0 KiB held in 2 blocks, snapshots s1, in use by \
             export \"web/disk\" (pid {})\n",
            w.pid()
        )
    );
    // Held by a running export: refused, even with --yes.
    let out = cairn_in(d, &["overlay", "discard", "web/disk", "--yes"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        common::stderr_line(&out),
        format!(
            "cairn: error: overlay {} is in use by export \"web/disk\" (pid {}); stop it first \
             with `cairn exports stop web/disk`",
            dirpath.display(),
            w.pid()
        )
    );
    ok(&["exports", "stop", "web/disk"]);
    w.wait();
    let json: Value =
        serde_json::from_str(&ok(&["--json", "--repo", repo_s, "overlay", "list"])).unwrap();
    assert_eq!(
        json,
        serde_json::json!([{
            "name": "web_disk",
            "dir": dirpath.display().to_string(),
            "base": full_id(&repo, "vm@1"),
            "base_version": "vm@1",
            "bytes_held": 32768,
            "blocks_held": 2,
            "snapshots": ["s1"],
            "export": null,
        }])
    );
    assert_eq!(
        ok(&["overlay", "list"]),
        format!("web_disk  base {vm1}, 32.0 KiB held in 2 blocks, snapshots s1, not in use\n")
    );
    // Destructive: only with --yes.
    let out = cairn_in(d, &["overlay", "discard", "web/disk"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        common::stderr_line(&out),
        format!(
            "cairn: error: discarding overlay web_disk deletes {} and its 32.0 KiB of writes \
             that were never committed; run again with --yes to do it",
            dirpath.display()
        )
    );
    assert!(dirpath.join("meta.json").exists());
    assert_eq!(
        ok(&["overlay", "discard", "web/disk", "--yes"]),
        "discarded overlay web_disk (32.0 KiB of writes)\n"
    );
    assert!(!dirpath.exists());
    let out = cairn_in(d, &["overlay", "discard", "web/disk", "--yes"]);
    assert_eq!(
        common::stderr_line(&out),
        format!(
            "cairn: error: no overlay named web_disk in {}",
            root.display()
        )
    );
}

#[test]
fn the_run_directory_must_be_private() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let (dir, repo, _, _) = setup();
    let d = dir.path();
    let tmp = d.join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let uid = std::fs::metadata(&tmp).unwrap().uid();
    let run = tmp.join(format!("cairn-{uid}"));
    let export = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("--repo")
            .arg(&repo)
            .args(["export", "vm", "--cache-dir"])
            .arg(d.join("cache"))
            .args(extra)
            .env_remove("CAIRN_RUN_DIR")
            .env_remove("XDG_RUNTIME_DIR")
            .env("TMPDIR", &tmp)
            .output()
            .unwrap()
    };
    // Pre-created by someone else with a mode that lets others in: refused.
    std::fs::create_dir(&run).unwrap();
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = export(&[]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        common::stderr_line(&out),
        format!(
            "cairn: error: unsafe run directory {}: mode 0777 lets other users in; it must be \
             0700 and yours (uid {uid}): remove it or chmod 700 it",
            run.display()
        )
    );
    // An explicit --socket still needs the control socket's directory.
    let sock = d.join("x.sock");
    let out = export(&["--socket", sock.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!sock.exists());
    // A symbolic link (to a directory of ours) is refused too.
    std::fs::remove_dir(&run).unwrap();
    let elsewhere = d.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &run).unwrap();
    let out = export(&[]);
    assert_eq!(
        common::stderr_line(&out),
        format!(
            "cairn: error: unsafe run directory {}: it is a symbolic link; remove it",
            run.display()
        )
    );
    // Owned by another user (needs root to arrange).
    std::fs::remove_file(&run).unwrap();
    if uid == 0 {
        std::fs::create_dir(&run).unwrap();
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&run, Some(65534), Some(65534)).unwrap();
        let out = export(&[]);
        assert_eq!(
            common::stderr_line(&out),
            format!(
                "cairn: error: unsafe run directory {}: owned by uid 65534, not by you (uid \
                 0); remove it",
                run.display()
            )
        );
        std::fs::remove_dir(&run).unwrap();
    }
    // Missing: created 0700, and the socket goes there (never to a shared $TMPDIR/cairn).
    let mut child = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--repo")
        .arg(&repo)
        .args(["--json", "export", "vm", "--cache-dir"])
        .arg(d.join("cache"))
        .env_remove("CAIRN_RUN_DIR")
        .env_remove("XDG_RUNTIME_DIR")
        .env("TMPDIR", &tmp)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let ready: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(
        ready["socket"],
        run.join("vm.sock").display().to_string(),
        "{ready}"
    );
    let m = std::fs::metadata(&run).unwrap();
    assert_eq!(m.mode() & 0o777, 0o700);
    assert!(!tmp.join("cairn").exists());
}

#[test]
fn a_writable_export_on_a_public_address_needs_tls_or_insecure() {
    let (dir, repo, _, _) = setup();
    let d = dir.path();
    let out = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--repo")
        .arg(&repo)
        .args(["export", "vm", "--writable", "--overlay"])
        .arg(d.join("overlay"))
        .args(["--listen", "0.0.0.0:0"])
        .env("CAIRN_RUN_DIR", d.join("run"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        common::stderr_line(&out),
        "cairn: error: refusing a writable export on 0.0.0.0:0 without TLS: anyone who can \
         reach that address could read and overwrite the disk; serve TLS (--tls-dir DIR, or \
         --tls-cert FILE --tls-key FILE), listen on a loopback address, or pass --insecure"
    );
    let overlay = d.join("overlay");
    let o = overlay.to_str().unwrap();
    let mut insecure = Served::spawn(
        &repo,
        d,
        "i",
        &[
            "vm",
            "--writable",
            "--overlay",
            o,
            "--listen",
            "0.0.0.0:0",
            "--insecure",
        ],
    );
    assert_eq!(insecure.ready["writable"], true);
    insecure.signal("TERM");
    // Loopback needs neither.
    let lo = Served::spawn(
        &repo,
        d,
        "l",
        &[
            "vm",
            "--writable",
            "--overlay",
            o,
            "--listen",
            "127.0.0.1:0",
        ],
    );
    assert_eq!(lo.ready["writable"], true);
}

#[test]
fn readiness_and_stopping_are_notified_to_systemd() {
    let (dir, repo, _, _) = setup();
    let d = dir.path();
    let path = d.join("notify.sock");
    let notify = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
    // Only a safety net against a hang: the messages come at once.
    notify
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut served = Served::spawn_env(
        &repo,
        d,
        "n",
        &["vm@1", "--name", "disk"],
        &[("NOTIFY_SOCKET", path.as_os_str())],
    );
    let mut buf = [0u8; 4096];
    let n = notify.recv(&mut buf).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&buf[..n]),
        format!(
            "READY=1\nSTATUS=serving disk (vm@1) at nbd+unix:///disk?socket={}",
            served.socket.display()
        )
    );
    let (status, _) = served.signal("TERM");
    assert_eq!(status.code(), Some(0));
    let n = notify.recv(&mut buf).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&buf[..n]),
        "STOPPING=1\nSTATUS=stopping (SIGTERM)"
    );
}

// ------------------------------------------------------------------ TLS

/// A CA that signs certificates, as rcgen makes them.
struct Ca {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut p = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        p.distinguished_name
            .push(rcgen::DnType::CommonName, name.to_string());
        let key = rcgen::KeyPair::generate().unwrap();
        let pem = p.self_signed(&key).unwrap().pem();
        Ca {
            issuer: rcgen::Issuer::new(p, key),
            pem,
        }
    }

    /// (certificate PEM, key PEM) for `names`, for a server or a client.
    fn sign(&self, names: &[&str], client: bool) -> (String, String) {
        let mut p =
            rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        p.distinguished_name
            .push(rcgen::DnType::CommonName, names[0].to_string());
        p.key_usages = vec![
            rcgen::KeyUsagePurpose::DigitalSignature,
            rcgen::KeyUsagePurpose::KeyEncipherment,
        ];
        p.extended_key_usages = vec![if client {
            rcgen::ExtendedKeyUsagePurpose::ClientAuth
        } else {
            rcgen::ExtendedKeyUsagePurpose::ServerAuth
        }];
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = p.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// Credentials in QEMU's layout: `server` (requires client certificates: it has
/// ca-cert.pem), `client` (trusts the CA, has a client certificate), `ca-only` (trusts the
/// CA, no client certificate), `stranger` (trusts another CA and has its certificate); and
/// `cert.pem`/`key.pem` for --tls-cert/--tls-key.
struct Pki {
    server: PathBuf,
    client: PathBuf,
    ca_only: PathBuf,
    stranger: PathBuf,
    cert: PathBuf,
    key: PathBuf,
}

fn pki(dir: &Path) -> Pki {
    let ca = Ca::new("cairn test CA");
    let other = Ca::new("some other CA");
    let (cert, key) = ca.sign(&["localhost", "127.0.0.1"], false);
    let (ccert, ckey) = ca.sign(&["client"], true);
    let (ocert, okey) = other.sign(&["client"], true);
    let put = |sub: &str, files: &[(&str, &str)]| {
        let d = dir.join(sub);
        std::fs::create_dir_all(&d).unwrap();
        for (n, body) in files {
            std::fs::write(d.join(n), body).unwrap();
        }
        d
    };
    let server = put(
        "tls-server",
        &[
            ("server-cert.pem", &cert),
            ("server-key.pem", &key),
            ("ca-cert.pem", &ca.pem),
        ],
    );
    let client = put(
        "tls-client",
        &[
            ("ca-cert.pem", &ca.pem),
            ("client-cert.pem", &ccert),
            ("client-key.pem", &ckey),
        ],
    );
    let ca_only = put("tls-ca-only", &[("ca-cert.pem", &ca.pem)]);
    let stranger = put(
        "tls-stranger",
        &[
            ("ca-cert.pem", &other.pem),
            ("client-cert.pem", &ocert),
            ("client-key.pem", &okey),
        ],
    );
    Pki {
        cert: server.join("server-cert.pem"),
        key: server.join("server-key.pem"),
        server,
        client,
        ca_only,
        stranger,
    }
}

fn nbdinfo_size(uri: &str) -> std::process::Output {
    tool("nbdinfo", "libnbd-bin")
        .args(["--size", uri])
        .output()
        .unwrap()
}

/// `qemu-img convert` from an NBD export over TLS on 127.0.0.1:PORT, with the client
/// credentials in `creds`.
fn qemu_img_tls(port: &str, export: &str, creds: &Path, out: &Path) -> std::process::Output {
    tool("qemu-img", "qemu-utils")
        .arg("convert")
        .arg("--object")
        .arg(format!(
            "tls-creds-x509,id=tls0,dir={},endpoint=client",
            creds.display()
        ))
        .arg("--image-opts")
        .arg(format!(
            "driver=nbd,host=127.0.0.1,port={port},export={export},tls-creds=tls0"
        ))
        .args(["-O", "raw"])
        .arg(out)
        .output()
        .unwrap()
}

#[test]
fn tls_exports_serve_qemu_img_and_nbdcopy_bit_exact() {
    let (dir, repo, a, _) = setup();
    let d = dir.path();
    let p = pki(d);
    // On a Unix socket, credentials in QEMU's layout (client certificates required).
    let served = Served::spawn(
        &repo,
        d,
        "tls",
        &[
            "vm@1",
            "--name",
            "disk",
            "--tls-dir",
            p.server.to_str().unwrap(),
        ],
    );
    let uri = served.ready["uri"].as_str().unwrap().to_string();
    assert_eq!(
        uri,
        format!("nbds+unix:///disk?socket={}", served.socket.display())
    );
    assert_eq!(served.ready["tls"], true);
    let copy = d.join("copy.raw");
    let st = tool("nbdcopy", "libnbd-bin")
        .arg(format!("{uri}&tls-certificates={}", p.client.display()))
        .arg(&copy)
        .status()
        .unwrap();
    assert!(st.success());
    same_file(&copy, &a, "nbdcopy over TLS");

    // On TCP with --tls-cert/--tls-key (no client certificate asked), read by QEMU.
    let tcp = Served::spawn(
        &repo,
        d,
        "tcp",
        &[
            "vm@1",
            "--name",
            "tcp",
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            p.cert.to_str().unwrap(),
            "--tls-key",
            p.key.to_str().unwrap(),
        ],
    );
    let listen = tcp.ready["listen"].as_str().unwrap();
    assert_eq!(tcp.ready["uri"], format!("nbds://{listen}/tcp"));
    let port = listen.rsplit_once(':').unwrap().1;
    let out = d.join("qemu.raw");
    let r = qemu_img_tls(port, "tcp", &p.ca_only, &out);
    assert!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    same_file(&out, &a, "qemu-img over TLS");
}

#[test]
fn tls_refuses_plaintext_clients_and_untrusted_certificates() {
    let (dir, repo, _, _) = setup();
    let d = dir.path();
    let p = pki(d);
    let served = Served::spawn(
        &repo,
        d,
        "tls",
        &[
            "vm@1",
            "--name",
            "disk",
            "--tls-dir",
            p.server.to_str().unwrap(),
        ],
    );
    let sock = served.socket.display().to_string();
    let tls_uri = |creds: &Path| {
        format!(
            "nbds+unix:///disk?socket={sock}&tls-certificates={}",
            creds.display()
        )
    };
    let failure = |out: std::process::Output| {
        assert!(!out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    // A plaintext client is told TLS is required.
    let err = failure(nbdinfo_size(&format!("nbd+unix:///disk?socket={sock}")));
    assert!(err.contains("TLS"), "{err}");
    // A client that trusts another CA refuses the server; the server refuses a client
    // without a certificate of its CA.
    failure(nbdinfo_size(&tls_uri(&p.stranger)));
    failure(nbdinfo_size(&tls_uri(&p.ca_only)));
    // The right credentials get in.
    let ok = nbdinfo_size(&tls_uri(&p.client));
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );

    // QEMU trusting another CA does not read an export over TCP either.
    let tcp = Served::spawn(
        &repo,
        d,
        "tcp",
        &[
            "vm@1",
            "--name",
            "tcp",
            "--listen",
            "127.0.0.1:0",
            "--tls-cert",
            p.cert.to_str().unwrap(),
            "--tls-key",
            p.key.to_str().unwrap(),
        ],
    );
    let listen = tcp.ready["listen"].as_str().unwrap();
    let port = listen.rsplit_once(':').unwrap().1;
    let out = d.join("never.raw");
    let r = qemu_img_tls(port, "tcp", &p.stranger, &out);
    assert!(!r.status.success());
    // A plaintext QEMU is refused too.
    let r = tool("qemu-img", "qemu-utils")
        .args(["info", &format!("nbd://{listen}/tcp")])
        .output()
        .unwrap();
    assert!(!r.status.success());
    assert!(String::from_utf8_lossy(&r.stderr).contains("TLS"), "{r:?}");
}

#[test]
fn bad_tls_files_are_named_in_one_line() {
    let (dir, repo, _, _) = setup();
    let d = dir.path();
    let p = pki(d);
    let missing = d.join("missing.pem");
    let out = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--repo")
        .arg(&repo)
        .args(["export", "vm", "--tls-cert"])
        .arg(&p.cert)
        .arg("--tls-key")
        .arg(&missing)
        .env("CAIRN_RUN_DIR", d.join("run"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let line = common::stderr_line(&out);
    assert!(
        line.starts_with(&format!(
            "cairn: error: TLS private key {}: ",
            missing.display()
        )),
        "{line}"
    );
}

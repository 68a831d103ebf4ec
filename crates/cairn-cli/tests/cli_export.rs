//! `cairn export`: a version served over NBD to real clients (qemu-img, nbdcopy, nbdinfo),
//! the shared chunk cache, and failure when the repository goes away.

mod common;
use common::cairn;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
}

impl Served {
    fn start(repo: &Path, spec: &str, dir: &Path, tag: &str, cache: &Path) -> Served {
        let socket = dir.join(format!("{tag}.sock"));
        let stats = dir.join(format!("{tag}.json"));
        let child = Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("--repo")
            .arg(repo)
            .args(["-q", "export", spec, "--name", "disk", "--socket"])
            .arg(&socket)
            .arg("--cache-dir")
            .arg(cache)
            .arg("--stats-file")
            .arg(&stats)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let started = Instant::now();
        while !socket.exists() {
            assert!(
                started.elapsed() < Duration::from_secs(20),
                "export did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Served {
            child,
            socket,
            stats,
        }
    }

    fn uri(&self) -> String {
        format!("nbd+unix:///disk?socket={}", self.socket.display())
    }

    /// The export's counters (written every second and at exit).
    fn stats(&mut self) -> Value {
        std::thread::sleep(Duration::from_millis(1200));
        serde_json::from_slice(&std::fs::read(&self.stats).unwrap()).unwrap()
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
    let cache = dir.path().join("cache");
    let mut served = Served::start(&repo, "vm@1", dir.path(), "a", &cache);

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
    let cache = dir.path().join("cache");
    {
        let served = Served::start(&repo, "vm", dir.path(), "a", &cache);
        let st = tool("qemu-img", "qemu-utils")
            .args(["convert", "-f", "raw", "-O", "raw", &served.uri()])
            .arg(dir.path().join("a-out.raw"))
            .status()
            .unwrap();
        assert!(st.success());
    }
    // Another image sharing its first 3 MiB: only its own last MiB comes from the repository.
    let mut served = Served::start(&repo, "other", dir.path(), "b", &cache);
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
    let cache = dir.path().join("cache");
    let served = Served::start(&repo, "vm", dir.path(), "a", &cache);
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

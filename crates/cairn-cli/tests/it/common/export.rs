//! Helpers of the export tests: a served export, images, tools, TLS certificates.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use serde_json::Value;

use super::cairn;
pub use cairn_testkit::tls::Ca;

pub fn tool(name: &str, package: &str) -> Command {
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

/// `qemu-img convert` of the raw NBD export at `uri` into the file `out`; must succeed.
pub fn qemu_img_convert(uri: impl AsRef<std::ffi::OsStr>, out: &Path) {
    let st = tool("qemu-img", "qemu-utils")
        .args(["convert", "-f", "raw", "-O", "raw"])
        .arg(uri)
        .arg(out)
        .status()
        .unwrap();
    assert!(
        st.success(),
        "qemu-img convert into {}: {st}",
        out.display()
    );
}

/// `nbdcopy SRC DST` (either side an NBD URI or a file); must succeed.
pub fn nbdcopy(src: impl AsRef<std::ffi::OsStr>, dst: impl AsRef<std::ffi::OsStr>) {
    let (src, dst) = (src.as_ref(), dst.as_ref());
    let st = tool("nbdcopy", "libnbd-bin")
        .arg(src)
        .arg(dst)
        .status()
        .unwrap();
    assert!(st.success(), "nbdcopy {src:?} {dst:?}: {st}");
}

/// An image: 3 MiB of noise, 2 MiB of zeros, then `tail` bytes of noise seeded by `seed`
/// (QEMU sees NBD disks in whole 512-byte sectors, so keep `tail` a multiple of 512).
pub fn image(dir: &Path, name: &str, seed: u64, tail: usize) -> PathBuf {
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

pub struct Served {
    pub child: Child,
    pub socket: PathBuf,
    pub stats: PathBuf,
    /// The first object the export printed with `--json` once it served.
    pub ready: Value,
    /// The rest of its standard output (kept open so that it can go on printing).
    pub stdout: BufReader<ChildStdout>,
    /// Collects its standard error until it exits.
    pub stderr: Option<std::thread::JoinHandle<String>>,
}

impl Served {
    /// Runs `cairn --json export ARGS… --socket DIR/TAG.sock` (run directory DIR/run, cache
    /// DIR/cache, counters in DIR/TAG.json; no `--socket` when ARGS has `--listen`) and waits
    /// until it prints that it serves (its `--json` line; by then every socket is bound).
    pub fn spawn(repo: &Path, dir: &Path, tag: &str, args: &[&str]) -> Served {
        Self::spawn_env(repo, dir, tag, args, &[])
    }

    pub fn spawn_env(
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
            stdout: out,
            stderr: Some(stderr),
        }
    }

    /// A read-only export of `spec` named `disk`.
    pub fn start(repo: &Path, spec: &str, dir: &Path, tag: &str) -> Served {
        Self::spawn(repo, dir, tag, &[spec, "--name", "disk"])
    }

    pub fn uri(&self) -> String {
        format!("nbd+unix:///disk?socket={}", self.socket.display())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The export's counters (written every second and at exit).
    pub fn stats(&mut self) -> Value {
        std::thread::sleep(Duration::from_millis(1200));
        serde_json::from_slice(&std::fs::read(&self.stats).unwrap()).unwrap()
    }

    /// Sends `signal` (TERM, INT, KILL) and returns the exit status and what it printed on
    /// standard error.
    pub fn signal(&mut self, signal: &str) -> (std::process::ExitStatus, String) {
        let st = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status()
            .unwrap();
        assert!(st.success());
        self.wait()
    }

    /// Waits for the export to exit; its exit status and standard error.
    pub fn wait(&mut self) -> (std::process::ExitStatus, String) {
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
pub fn same_file(got: &Path, want: &Path, what: &str) {
    let (g, w) = (std::fs::read(got).unwrap(), std::fs::read(want).unwrap());
    let first = g.iter().zip(&w).position(|(a, b)| a != b);
    assert!(
        g == w,
        "{what}: {} bytes vs {} expected, first difference at {first:?}",
        g.len(),
        w.len()
    );
}

/// A repository with two images, `vm` (a.raw) and `other` (b.raw): (dir, repo, a, b).
pub fn setup() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
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

/// A writable export of `spec` named `disk`, its overlay in DIR/overlay.
pub fn start_writable(repo: &Path, spec: &str, dir: &Path, tag: &str) -> Served {
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
pub fn cairn_ctl(repo: &Path, dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--repo")
        .arg(repo)
        .args(args)
        .env("CAIRN_RUN_DIR", dir.join("run"))
        .output()
        .unwrap()
}

pub fn qemu_io(uri: &str, cmds: &[&str]) -> String {
    qemu_io_opened(uri, &[], cmds)
}

/// [`qemu_io`] opening the export read-only (`-r`), as a read-only export requires.
pub fn qemu_io_ro(uri: &str, cmds: &[&str]) -> String {
    qemu_io_opened(uri, &["-r"], cmds)
}

fn qemu_io_opened(uri: &str, open: &[&str], cmds: &[&str]) -> String {
    let mut c = tool("qemu-io", "qemu-utils");
    c.args(open).args(["-f", "raw"]);
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

/// Asserts a file equals `want` (never printing the contents).
pub fn same_file_bytes(got: &Path, want: &[u8], what: &str) {
    let g = std::fs::read(got).unwrap();
    let first = g.iter().zip(want).position(|(a, b)| a != b);
    assert!(
        g == want,
        "{what}: {} bytes vs {} expected, first difference at {first:?}",
        g.len(),
        want.len()
    );
}

// ------------------------------------------------------------------ lifecycle

/// `cairn ARGS…` with the test's run directory and overlay root (DIR/state), no repository
/// unless ARGS names one.
pub fn cairn_in(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(args)
        .env("CAIRN_RUN_DIR", dir.join("run"))
        .env("XDG_STATE_HOME", dir.join("state"))
        .env_remove("CAIRN_LOG")
        .env_remove("CAIRN_REPO")
        .output()
        .unwrap()
}

pub fn stdout(out: &std::process::Output) -> String {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

/// The last line a process printed on standard error.
pub fn last_line(stderr: &str) -> &str {
    stderr.lines().last().unwrap_or_default()
}

/// The 12-digit short id of a version.
pub fn short_id(repo: &Path, spec: &str) -> String {
    let out = cairn(repo, &["--json", "show", spec]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["id"].as_str().unwrap()[..12].to_string()
}

pub fn full_id(repo: &Path, spec: &str) -> String {
    let out = cairn(repo, &["--json", "show", spec]);
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v["id"].as_str().unwrap().to_string()
}

/// A file of `len` bytes with a pattern no version has.
pub fn pattern(dir: &Path, len: u64) -> PathBuf {
    let path = dir.join("pattern.raw");
    let data: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8 ^ 0x5a).collect();
    std::fs::write(&path, data).unwrap();
    path
}

// ------------------------------------------------------------------ TLS

/// Credentials in QEMU's layout: `server` (requires client certificates: it has
/// ca-cert.pem), `client` (trusts the CA, has a client certificate), `ca-only` (trusts the
/// CA, no client certificate), `stranger` (trusts another CA and has its certificate); and
/// `cert.pem`/`key.pem` for --tls-cert/--tls-key.
pub struct Pki {
    pub server: PathBuf,
    pub client: PathBuf,
    pub ca_only: PathBuf,
    pub stranger: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

pub fn pki(dir: &Path) -> Pki {
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

pub fn nbdinfo_size(uri: &str) -> std::process::Output {
    tool("nbdinfo", "libnbd-bin")
        .args(["--size", uri])
        .output()
        .unwrap()
}

/// `qemu-img convert` from an NBD export over TLS on 127.0.0.1:PORT, with the client
/// credentials in `creds`.
pub fn qemu_img_tls(port: &str, export: &str, creds: &Path, out: &Path) -> std::process::Output {
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

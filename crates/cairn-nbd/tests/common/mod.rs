//! Shared helpers for the integration tests: an in-process server on a Unix
//! socket, tool lookup, and test data.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};
use std::sync::Arc;

use cairn_nbd::{serve_unix_listener, Server};

/// A server running on its own tokio runtime, listening on a Unix socket in
/// a temporary directory. Dropping it stops the runtime.
pub struct TestServer {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    rt: Option<tokio::runtime::Runtime>,
}

impl TestServer {
    pub fn start(server: Server) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let socket = dir.path().join("nbd.sock");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let listener = {
            let _guard = rt.enter();
            tokio::net::UnixListener::bind(&socket).expect("bind unix socket")
        };
        rt.spawn(serve_unix_listener(Arc::new(server), listener));
        TestServer {
            dir,
            socket,
            rt: Some(rt),
        }
    }

    /// `nbd+unix:///NAME?socket=PATH`
    pub fn uri(&self, name: &str) -> String {
        format!("nbd+unix:///{name}?socket={}", self.socket.display())
    }

    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// Fail (not skip) when a client tool is missing, naming its package.
pub fn require_tool(tool: &str, package: &str) {
    match Command::new(tool).arg("--version").output() {
        Ok(_) => {}
        Err(e) => panic!(
            "required tool `{tool}` is not available ({e}); install the Debian package `{package}` \
             (sudo apt-get install -y {package})"
        ),
    }
}

/// Run a command, returning its output; panics if it cannot be spawned.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("failed to run {cmd:?}: {e}"));
    eprintln!(
        "$ {cmd:?}\n[status {}]\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Run a command and require success.
pub fn run_ok(cmd: &mut Command) -> Output {
    let out = run(cmd);
    assert!(out.status.success(), "command failed: {cmd:?}");
    out
}

/// Patterned, partly-zero test data: 4 KiB blocks in runs of 16, alternating
/// data and zero runs, with the data bytes varying per position.
pub fn patterned(size: usize) -> Vec<u8> {
    let mut v = vec![0u8; size];
    for (i, b) in v.iter_mut().enumerate() {
        let block = i / 4096;
        if (block / 16) % 2 == 0 {
            *b = ((i * 7 + i / 4096) % 251) as u8 + 1;
        }
    }
    v
}

/// What `nbdinfo --map` prints for [`patterned`] data of `size` bytes served with block
/// status: runs of 64 KiB, data first, alternating with holes that read as zeros.
pub fn patterned_map(size: usize) -> String {
    let mut expected = String::new();
    for run in 0..(size / 65536) {
        let (flags, desc) = if run % 2 == 0 {
            (0, "data")
        } else {
            (3, "hole,zero")
        };
        expected.push_str(&format!(
            "{:>10}  {:>10}  {:>3}  {}\n",
            run * 65536,
            65536,
            flags,
            desc
        ));
    }
    expected
}

/// Caps the address space of this test process at its size now plus `headroom` (plus a
/// malloc arena per core), so that an allocation of an attacker-chosen size fails instead of
/// being backed by lazily mapped pages: the fuzz tests' guard against hostile lengths.
pub fn limit_address_space(headroom: u64) {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let vm_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmSize in /proc/self/status");
    // Each test thread may get a malloc arena (64 MiB of address space): more room on a
    // machine with more cores, but always below the 4 GiB this limit exists to catch.
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get()) as u64;
    let limit = vm_kib * 1024 + (headroom + cores * (64 << 20)).min(7 << 29);
    let old = getrlimit(Resource::As);
    if old.current.is_some_and(|c| c <= limit) {
        return;
    }
    setrlimit(
        Resource::As,
        Rlimit {
            current: Some(limit),
            maximum: old.maximum,
        },
    )
    .expect("setrlimit(RLIMIT_AS)");
}

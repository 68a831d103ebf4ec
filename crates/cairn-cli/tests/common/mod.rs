//! Running the `cairn` binary from integration tests.
#![allow(dead_code)]

pub mod export;

use std::path::Path;
use std::process::{Command, Output};

/// Runs `cairn --repo REPO ARGS...` with logging at its default level.
pub fn cairn(repo: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--repo")
        .arg(repo)
        .args(args)
        .env_remove("CAIRN_LOG")
        .output()
        .expect("run cairn")
}

/// The single line a failing command printed on stderr (asserts there is exactly one).
pub fn stderr_line(out: &Output) -> String {
    let s = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(s.lines().count(), 1, "exactly one line on stderr: {s:?}");
    s.trim_end().to_string()
}

/// Deterministic pseudo-random bytes (xorshift64 from `seed`).
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

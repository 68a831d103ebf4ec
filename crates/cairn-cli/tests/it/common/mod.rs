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

/// `cairn --repo REPO ARGS` with `env` set, no passphrase inherited from the caller's
/// environment, and stdin not a terminal (so nothing prompts).
pub fn cairn_with(repo: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_cairn"));
    cmd.arg("--repo")
        .arg(repo)
        .args(args)
        .env_remove("CAIRN_LOG")
        .env_remove("CAIRN_PASSWORD")
        .env_remove("CAIRN_NEW_PASSWORD")
        .stdin(std::process::Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run cairn")
}

/// The single line a failing command printed on stderr (asserts there is exactly one).
pub fn stderr_line(out: &Output) -> String {
    let s = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(s.lines().count(), 1, "exactly one line on stderr: {s:?}");
    s.trim_end().to_string()
}

/// What "the command changed nothing" compares (sessions left out).
#[allow(unused_imports)] // not every test file needs it
pub use cairn_testkit::repo_snapshot as snapshot;

#[allow(unused_imports)] // not every test file needs it
pub use cairn_testkit::noise;

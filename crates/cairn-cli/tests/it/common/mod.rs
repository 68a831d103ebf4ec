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

/// A fresh repository (`init --reserve 0`) in a temporary directory, plain or encrypted (the
/// passphrase passed in the environment), and runners that assert success.
pub struct Scratch {
    pub dir: tempfile::TempDir,
    pub repo: std::path::PathBuf,
    env: Vec<(&'static str, &'static str)>,
}

impl Scratch {
    pub fn new(encrypted: bool) -> Scratch {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("repo");
        let env = if encrypted {
            vec![("CAIRN_PASSWORD", "correct horse")]
        } else {
            Vec::new()
        };
        let scratch = Scratch { dir, repo, env };
        let mut init = vec!["-q", "init", "--reserve", "0"];
        if encrypted {
            init.push("--encrypt");
        }
        scratch.run(&init);
        scratch
    }

    /// `cairn ARGS`, which must succeed; its standard output.
    pub fn run(&self, args: &[&str]) -> String {
        let out = cairn_with(&self.repo, &self.env, args);
        assert!(out.status.success(), "cairn {args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    }

    /// `cairn --json ARGS`, parsed.
    pub fn json(&self, args: &[&str]) -> serde_json::Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        serde_json::from_str(self.run(&all).trim()).unwrap()
    }
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

/// Every file under `dir`.
pub fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

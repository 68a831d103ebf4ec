//! A format-v1 repository made by the v1 release (2026-11-24) is checked in as a fixture
//! (`tests/fixtures/v1-repo/`), so that every later cairn — format v2 included — is tested to
//! read it: history, tags, a clone, a deleted version, and bit-exact restores of every version.
//!
//! The images are generated here (deterministic noise, zeros, text), so only the repository is
//! stored. `CAIRN_MAKE_V1_FIXTURE=1 cargo test -p cairn-cli --test cli_v1_fixture` (re)makes
//! the fixture with the cairn being tested; that is only right while cairn writes format v1.

mod common;
use common::{cairn, noise};

use std::path::{Path, PathBuf};

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/v1-repo")
}

/// The contents of vm@1, vm@2, vm@3 (deleted) in order: 96 KiB of noise, 64 KiB of zeros, a
/// 4 KiB text; then one changed 4 KiB block; then another.
fn images() -> Vec<Vec<u8>> {
    let mut v1 = noise(96 << 10, 1);
    v1.extend(vec![0u8; 64 << 10]);
    v1.extend(
        b"cairn v1 fixture\n"
            .repeat(4096 / 17 + 1)
            .into_iter()
            .take(4096),
    );
    let mut v2 = v1.clone();
    v2[16 << 10..20 << 10].copy_from_slice(&noise(4096, 2));
    let mut v3 = v2.clone();
    v3[48 << 10..52 << 10].copy_from_slice(&noise(4096, 3));
    vec![v1, v2, v3]
}

fn ok(repo: &Path, args: &[&str]) -> String {
    let out = cairn(repo, args);
    assert!(out.status.success(), "cairn {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

fn make_fixture(dir: &Path) {
    let repo = fixture_dir();
    let _ = std::fs::remove_dir_all(&repo);
    ok(&repo, &["-q", "init"]);
    for (i, data) in images().iter().enumerate() {
        let path = dir.join(format!("v{}.raw", i + 1));
        std::fs::write(&path, data).unwrap();
        let message = format!("version {}", i + 1);
        ok(
            &repo,
            &["-q", "commit", "vm", path.to_str().unwrap(), "-m", &message],
        );
    }
    ok(&repo, &["-q", "tag", "vm@1", "golden"]);
    ok(&repo, &["-q", "clone", "vm@2", "web"]);
    ok(&repo, &["-q", "rm", "--no-gc", "vm@3"]);
    // The space reserve is a local file of 32 MiB that holds no data; a repository without it
    // works (it is made again when space is freed).
    std::fs::remove_file(repo.join(".cairn-reserve")).unwrap();
}

#[test]
fn a_v1_repository_made_by_the_v1_release_reads_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    if std::env::var("CAIRN_MAKE_V1_FIXTURE").is_ok_and(|v| v == "1") {
        make_fixture(dir.path());
    }
    // Work on a copy: reading registers sessions, and nothing may change the fixture.
    let repo = dir.path().join("v1-repo");
    let st = std::process::Command::new("cp")
        .arg("-a")
        .arg(fixture_dir())
        .arg(&repo)
        .status()
        .unwrap();
    assert!(st.success());

    let verify = ok(&repo, &["verify"]);
    assert!(verify.ends_with("no problems found\n"), "{verify}");

    let log: serde_json::Value =
        serde_json::from_str(&ok(&repo, &["--json", "log", "vm"])).unwrap();
    let seqs: Vec<u64> = log
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, [2, 1], "vm@3 was deleted");
    assert_eq!(log[1]["tags"], serde_json::json!(["golden"]));
    assert_eq!(log[1]["message"], "version 1");
    assert!(ok(&repo, &["log", "web"]).contains("cloned from vm@2"));

    let images = images();
    for (spec, want) in [
        ("vm@1", &images[0]),
        ("vm@golden", &images[0]),
        ("vm@2", &images[1]),
        ("web", &images[1]),
    ] {
        let out = dir.path().join(format!("{spec}.raw"));
        ok(&repo, &["-q", "restore", spec, out.to_str().unwrap()]);
        assert!(std::fs::read(&out).unwrap() == *want, "{spec} differs");
    }
    let gone = cairn(&repo, &["restore", "vm@3", "-"]);
    assert!(!gone.status.success());

    // GC frees the deleted version's own block and the repository stays whole.
    ok(&repo, &["-q", "gc"]);
    let verify = ok(&repo, &["verify"]);
    assert!(verify.ends_with("no problems found\n"), "{verify}");
}

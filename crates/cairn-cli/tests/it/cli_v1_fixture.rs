//! A format-v1 repository made by the v1 release (2026-11-24) is checked in as a fixture
//! (`tests/fixtures/v1-repo/`), so that every later cairn — format v2 included — is tested to
//! read it: history, tags, a clone, a deleted version, and bit-exact restores of every version.
//!
//! The images are generated here (deterministic noise, zeros, text), so only the repository is
//! stored. `CAIRN_MAKE_V1_FIXTURE=1 cargo test -p cairn-cli --test cli_v1_fixture` (re)makes
//! the fixture with the cairn being tested; that is only right while cairn writes format v1.

use crate::common;
use crate::common::{cairn, noise};

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

/// A copy of the fixture under `dir` (reading registers sessions; the fixture never changes).
fn fixture_copy(dir: &Path) -> PathBuf {
    let repo = dir.join("v1-repo");
    let st = std::process::Command::new("cp")
        .arg("-a")
        .arg(fixture_dir())
        .arg(&repo)
        .status()
        .unwrap();
    assert!(st.success());
    repo
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
    let repo = fixture_copy(dir.path());

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

    // Format 1 is read-only: every command that writes refuses it with the way forward
    // (exit 1, code `unsupported`) and changes nothing.
    let src = dir.path().join("vm@1.raw");
    let src = src.to_str().unwrap();
    let before = tree_listing(&repo);
    for args in [
        vec!["commit", "vm", src],
        vec!["gc"],
        vec!["gc", "--repair"],
        vec!["rm", "vm@1"],
        vec!["prune", "vm", "--keep-last", "1"],
        vec!["tag", "vm@2", "new-tag"],
        vec!["clone", "vm@2", "other"],
        vec!["repair"],
        vec!["index", "compact"],
    ] {
        let out = cairn(&repo, &args);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {out:?}");
        let line = common::stderr_line(&out);
        assert!(
            line.contains("format 1 repository, which this cairn only reads")
                && line.contains("copy --from"),
            "{args:?}: {line}"
        );
        let mut json = vec!["--json"];
        json.extend(&args);
        let out = cairn(&repo, &json);
        let err: serde_json::Value =
            serde_json::from_str(String::from_utf8_lossy(&out.stderr).trim()).unwrap();
        assert_eq!(err["error"]["code"], "unsupported", "{args:?}");
    }
    assert_eq!(tree_listing(&repo), before);
    let verify = ok(&repo, &["verify"]);
    assert!(verify.ends_with("no problems found\n"), "{verify}");
}

/// Every object and ref of a repository (sessions aside), with its bytes' hash.
fn tree_listing(repo: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut stack = vec![repo.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            let rel = p.strip_prefix(repo).unwrap().to_string_lossy().into_owned();
            if rel.starts_with("refs/sessions") || rel.contains("ref.lock") {
                continue;
            }
            if p.is_dir() {
                stack.push(p);
            } else {
                let hash = blake3::hash(&std::fs::read(&p).unwrap())
                    .to_hex()
                    .to_string();
                out.push((rel, hash));
            }
        }
    }
    out.sort();
    out
}

/// The way from format 1 to format 2: `cairn copy` the fixture into a new encrypted format 2
/// repository — history, messages, tags and bytes kept; a second run copies nothing — and
/// back out of it into a plain one with the source's passphrase from $CAIRN_FROM_PASSWORD.
#[test]
fn cairn_copy_moves_the_v1_fixture_into_an_encrypted_format_2_repository() {
    let dir = tempfile::tempdir().unwrap();
    let v1 = fixture_copy(dir.path());
    let v1_s = v1.to_str().unwrap();
    let v2 = dir.path().join("v2-repo");
    let pw = [("CAIRN_PASSWORD", "new home")];
    let run = |repo: &Path, env: &[(&str, &str)], args: &[&str]| {
        let out = common::cairn_with(repo, env, args);
        assert!(out.status.success(), "cairn {args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    run(&v2, &pw, &["-q", "init", "--encrypt"]);

    let report: serde_json::Value =
        serde_json::from_str(&run(&v2, &pw, &["--json", "copy", "--from", v1_s])).unwrap();
    assert_eq!(report["copied"].as_array().unwrap().len(), 3, "{report}");
    assert_eq!(report["tags_created"], 1, "{report}");
    let log: serde_json::Value =
        serde_json::from_str(&run(&v2, &pw, &["--json", "log", "vm"])).unwrap();
    assert_eq!(log[0]["message"], "version 2");
    assert_eq!(log[1]["message"], "version 1");
    assert_eq!(log[1]["tags"], serde_json::json!(["golden"]));
    let images = images();
    for (spec, want) in [
        ("vm@golden", &images[0]),
        ("vm", &images[1]),
        ("web", &images[1]),
    ] {
        let out = dir.path().join(format!("{spec}.raw"));
        run(&v2, &pw, &["-q", "restore", spec, out.to_str().unwrap()]);
        assert!(std::fs::read(&out).unwrap() == *want, "{spec} differs");
    }
    let again = run(&v2, &pw, &["copy", "--from", v1_s]);
    assert!(
        again.contains("0 version(s) copied, 3 already there, 0 tag(s) created"),
        "{again}"
    );
    assert!(run(&v2, &pw, &["verify"]).ends_with("no problems found\n"));

    // Out of the encrypted repository: the source's passphrase is its own.
    let back = dir.path().join("back");
    run(&back, &[], &["-q", "init"]);
    let v2_s = v2.to_str().unwrap();
    let wrong = common::cairn_with(
        &back,
        &[("CAIRN_FROM_PASSWORD", "not it")],
        &["copy", "--from", v2_s, "vm@1"],
    );
    assert_eq!(wrong.status.code(), Some(5), "{wrong:?}");
    assert!(common::stderr_line(&wrong).contains("wrong passphrase"));
    let none = common::cairn_with(&back, &pw, &["copy", "--from", v2_s]);
    assert_eq!(none.status.code(), Some(5), "{none:?}");
    assert!(
        common::stderr_line(&none).contains("CAIRN_FROM_PASSWORD"),
        "{none:?}"
    );
    run(
        &back,
        &[("CAIRN_FROM_PASSWORD", "new home")],
        &["-q", "copy", "--from", v2_s, "vm@1"],
    );
    let out = dir.path().join("back.raw");
    run(&back, &[], &["-q", "restore", "vm", out.to_str().unwrap()]);
    assert!(std::fs::read(&out).unwrap() == images[0]);
    // A version copied without the one before it is numbered by the destination, and the
    // output says so.
    let alone = dir.path().join("alone");
    run(&alone, &[], &["-q", "init"]);
    let text = run(
        &alone,
        &[("CAIRN_FROM_PASSWORD", "new home")],
        &["copy", "--from", v2_s, "vm@2"],
    );
    assert!(text.starts_with("copied vm@2 to vm@1 "), "{text}");
    assert!(
        text.contains(
            "\n1 version(s) numbered differently here (the destination numbers each image's \
             versions in order; times, messages and tags are kept)\n"
        ),
        "{text}"
    );

    // Nothing is copied into a format 1 repository (itself included): it is read-only.
    let same = common::cairn_with(&v1, &[], &["copy", "--from", v1_s]);
    assert!(!same.status.success());
    assert!(common::stderr_line(&same).contains("which this cairn only reads"));
}

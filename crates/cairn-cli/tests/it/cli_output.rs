//! The output contract: a closed pipe ends no command badly, `--json` errors are one JSON
//! object with a stable code, exit statuses tell "no repository" and "damage" apart, and a
//! misspelt name gets a suggestion.

use std::path::Path;
use std::process::{Command, Output, Stdio};

use crate::common::{self, cairn, noise, stderr_line};
use serde_json::Value;

/// A repository with two versions of `web01/disk0` (4 MiB, one MiB changed).
fn repo_with_two_versions(dir: &Path) -> std::path::PathBuf {
    let repo = dir.join("r");
    assert!(cairn(&repo, &["init"]).status.success());
    let img = dir.join("img.raw");
    let mut data = noise(4 << 20, 7);
    std::fs::write(&img, &data).unwrap();
    let img_arg = img.to_str().unwrap();
    assert!(cairn(&repo, &["-q", "commit", "web01/disk0", img_arg])
        .status
        .success());
    data[1 << 20..2 << 20].copy_from_slice(&noise(1 << 20, 8));
    std::fs::write(&img, &data).unwrap();
    assert!(cairn(&repo, &["-q", "commit", "web01/disk0", img_arg])
        .status
        .success());
    repo
}

/// Runs cairn with its stdout a pipe whose reading end is already closed, so the first write
/// fails with EPIPE (deterministically: the reader is gone before cairn starts).
fn cairn_into_closed_pipe(repo: &Path, args: &[&str]) -> Output {
    let (reader, writer) = std::io::pipe().unwrap();
    drop(reader);
    Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--repo")
        .arg(repo)
        .args(args)
        .env_remove("CAIRN_LOG")
        .stdout(Stdio::from(writer))
        .stderr(Stdio::piped())
        .output()
        .expect("run cairn")
}

#[test]
fn a_closed_pipe_ends_no_command_badly() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with_two_versions(dir.path());
    let cases: &[&[&str]] = &[
        &["log", "web01/disk0"],
        &["--json", "log", "web01/disk0"],
        &["images"],
        &["--json", "images"],
        &["show", "web01/disk0@1"],
        &["stats"],
        &["verify"],
        &["diff", "web01/disk0@1", "web01/disk0@2"],
        &["tags", "web01/disk0"],
    ];
    for args in cases {
        let out = cairn_into_closed_pipe(&repo, args);
        assert_eq!(
            (
                out.status.code(),
                String::from_utf8_lossy(&out.stderr).as_ref()
            ),
            (Some(0), ""),
            "cairn {args:?} into a closed pipe"
        );
    }
    // A command that changes the repository finishes its work even if nobody reads.
    let out = cairn_into_closed_pipe(&repo, &["tag", "web01/disk0@1", "gold"]);
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let tags = cairn(&repo, &["tags", "web01/disk0"]);
    assert!(String::from_utf8_lossy(&tags.stdout).contains("gold"));
}

/// The one JSON error object a failed `--json` command printed, and its exit status.
fn json_error(out: &Output) -> (Value, Option<i32>) {
    assert!(out.stdout.is_empty(), "nothing on stdout: {out:?}");
    let line = stderr_line(out);
    let v: Value = serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"));
    (v["error"].clone(), out.status.code())
}

#[test]
fn json_errors_carry_a_stable_code_and_the_exit_status() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with_two_versions(dir.path());

    let (e, code) = json_error(&cairn(&repo, &["--json", "log", "web01/disk1"]));
    assert_eq!(code, Some(1));
    assert_eq!(e["code"], "not_found");
    assert_eq!(e["exit_code"], 1);
    assert_eq!(
        e["message"],
        "image \"web01/disk1\" does not exist; did you mean \"web01/disk0\"?"
    );

    let (e, code) = json_error(&cairn(&repo, &["--json", "show", "web01/disk0@9"]));
    assert_eq!((code, e["code"].as_str()), (Some(1), Some("not_found")));
    assert_eq!(
        e["message"],
        "web01/disk0@9: image \"web01/disk0\" has no version 9 (its newest is web01/disk0@2)"
    );

    let nowhere = dir.path().join("nowhere");
    let (e, code) = json_error(&cairn(&nowhere, &["--json", "images"]));
    assert_eq!((code, e["code"].as_str()), (Some(4), Some("no_repository")));

    // A usage error: clap's first line, as JSON, exit 2.
    let (e, code) = json_error(&cairn(&repo, &["--json", "log"]));
    assert_eq!((code, e["code"].as_str()), (Some(2), Some("usage")));
    assert!(e["message"].as_str().unwrap().contains("required"), "{e}");

    // Invalid input the engine or the repository finds is a usage error too.
    let (e, code) = json_error(&cairn(&repo, &["--json", "tag", "web01/disk0", "12"]));
    assert_eq!((code, e["code"].as_str()), (Some(2), Some("usage")), "{e}");
    let (e, code) = json_error(&cairn(&repo, &["--json", "show", "web01/disk0@"]));
    assert_eq!((code, e["code"].as_str()), (Some(2), Some("usage")), "{e}");
    // What exists already, and what a tag protects.
    let (e, code) = json_error(&cairn(
        &repo,
        &["--json", "clone", "web01/disk0@1", "web01/disk0"],
    ));
    assert_eq!((code, e["code"].as_str()), (Some(1), Some("exists")), "{e}");
    assert_eq!(e["message"], "image \"web01/disk0\" already exists");
    assert!(cairn(&repo, &["tag", "web01/disk0@1", "keep"])
        .status
        .success());
    let (e, code) = json_error(&cairn(&repo, &["--json", "rm", "web01/disk0@1"]));
    assert_eq!(
        (code, e["code"].as_str()),
        (Some(1), Some("refused")),
        "{e}"
    );

    // Without --json the same failure is one plain line, with the same exit status.
    let out = cairn(&nowhere, &["images"]);
    assert_eq!(out.status.code(), Some(4));
    assert!(stderr_line(&out).starts_with("cairn: error: no cairn repository at "));
}

#[test]
fn damage_found_by_a_failing_command_exits_3() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with_two_versions(dir.path());
    // Flip a byte in the middle of every pack: the restore meets damaged data.
    for entry in common::walk(&repo.join("packs")) {
        let mut raw = std::fs::read(&entry).unwrap();
        let mid = raw.len() / 2;
        raw[mid] ^= 0xff;
        std::fs::write(&entry, raw).unwrap();
    }
    let out_file = dir.path().join("out.raw");
    let out = cairn(
        &repo,
        &[
            "--json",
            "restore",
            "web01/disk0",
            out_file.to_str().unwrap(),
        ],
    );
    let (e, code) = json_error(&out);
    assert_eq!((code, e["code"].as_str()), (Some(3), Some("damage")), "{e}");
    assert!(!out_file.exists(), "no partial restore is left");
}

/// `log`, `show`, `images` and `commit` print one and the same version object.
#[test]
fn json_names_the_same_things_the_same_way() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with_two_versions(dir.path());
    assert!(cairn(&repo, &["tag", "web01/disk0@2", "gold"])
        .status
        .success());
    let json = |args: &[&str]| -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let out = cairn(&repo, &all);
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let log = json(&["log", "web01/disk0"]);
    let newest = &log[0];
    assert_eq!(
        (newest["seq"].as_u64(), &newest["tags"]),
        (Some(2), &serde_json::json!(["gold"]))
    );
    assert_eq!(
        &json(&["show", "web01/disk0"]),
        newest,
        "show = log's entry, tags included"
    );
    assert_eq!(&json(&["show", "web01/disk0@1"]), &log[1]);
    let images = json(&["images"]);
    assert_eq!(images[0]["image"], "web01/disk0");
    assert_eq!(images[0]["versions"], 2);
    assert_eq!(&images[0]["newest"], newest, "images' newest = log's entry");
    // Every version object has the same fields.
    let fields = |v: &Value| -> Vec<String> {
        let mut k: Vec<String> = v.as_object().unwrap().keys().cloned().collect();
        k.sort();
        k
    };
    assert_eq!(fields(&log[1]), fields(newest));
    for name in [
        "id",
        "image",
        "seq",
        "parent",
        "time",
        "time_ns",
        "logical_bytes",
        "stored_bytes",
        "tags",
    ] {
        assert!(
            newest.get(name).is_some(),
            "version objects carry {name:?}: {newest}"
        );
    }
}

/// `restore IMAGE -` writes the image to standard output; under `--json` its summary is the one
/// JSON line on standard error, so a script gets both.
#[test]
fn a_restore_to_standard_output_reports_on_standard_error() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with_two_versions(dir.path());
    let out = cairn(&repo, &["--json", "restore", "web01/disk0@1", "-"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(out.stdout, noise(4 << 20, 7), "the image, bit for bit");
    let stderr = String::from_utf8(out.stderr).unwrap();
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one line on stderr: {stderr}");
    let v: Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(v["image"], "web01/disk0");
    assert_eq!(v["seq"], 1);
    assert_eq!(v["output"], "-");
    assert_eq!(v["logical_bytes"], 4 << 20);
}

/// A commit's last line says how much of its data was found already stored, and how well the
/// new data compressed.
#[test]
fn a_commit_reports_dedup_and_compression() {
    let dir = tempfile::tempdir().unwrap();
    let repo = repo_with_two_versions(dir.path());
    let img = dir.path().join("img.raw");
    // 4 MiB of which 3 MiB are stored already (the image's second version), 1 MiB of new
    // numbered lines (compressible, and no two chunks alike).
    let mut data = std::fs::read(&img).unwrap();
    let text: String = (0..100_000).map(|i| format!("line {i:08}\n")).collect();
    data[..1 << 20].copy_from_slice(&text.as_bytes()[..1 << 20]);
    std::fs::write(&img, &data).unwrap();
    let out = cairn(&repo, &["commit", "web01/disk0", img.to_str().unwrap()]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = String::from_utf8(out.stdout).unwrap();
    assert!(line.contains("(75.0% deduplicated)"), "{line}");
    let ratio: f64 = line
        .split(" stored (")
        .nth(1)
        .and_then(|r| r.split('×').next())
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("no compression ratio in {line}"));
    assert!(ratio > 2.0, "text compresses: {line}");
    // Nothing new: everything deduplicated, nothing to compress.
    let out = cairn(&repo, &["commit", "copy", img.to_str().unwrap()]);
    let line = String::from_utf8(out.stdout).unwrap();
    assert!(line.contains("(100.0% deduplicated)"), "{line}");
    assert!(!line.contains("compressed"), "{line}");
}

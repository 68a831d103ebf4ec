//! `clone`, `tag`, `tags`, `rm`, `prune` and the history parts of `log`, through the binary.

use crate::common::cairn;

use std::path::{Path, PathBuf};

use serde_json::Value;

/// Runs a command that must succeed; returns its stdout.
fn ok(repo: &Path, args: &[&str]) -> String {
    let out = cairn(repo, args);
    assert!(
        out.status.success(),
        "cairn {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn json(repo: &Path, args: &[&str]) -> Value {
    let mut all = vec!["--json"];
    all.extend_from_slice(args);
    serde_json::from_str(&ok(repo, &all)).unwrap()
}

/// Runs a command that must fail with status 1 and one line on stderr; returns that line.
fn error_line(repo: &Path, args: &[&str]) -> String {
    error_line_status(repo, args, 1)
}

/// Runs a command that must fail with `status` and one line on stderr; returns that line.
fn error_line_status(repo: &Path, args: &[&str], status: i32) -> String {
    let out = cairn(repo, args);
    assert_eq!(out.status.code(), Some(status), "cairn {args:?}");
    let s = String::from_utf8_lossy(&out.stderr).to_string();
    assert_eq!(s.lines().count(), 1, "exactly one line on stderr: {s:?}");
    s.trim_end().to_string()
}

fn seqs(log: &Value) -> Vec<u64> {
    log.as_array()
        .unwrap()
        .iter()
        .map(|v| v["seq"].as_u64().unwrap())
        .collect()
}

/// A repository with versions 1..=n of "vm", each with different content.
fn setup(n: u8) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("r");
    ok(&repo, &["init"]);
    let img = dir.path().join("img.raw");
    for i in 1..=n {
        std::fs::write(&img, vec![i; 100_000]).unwrap();
        ok(
            &repo,
            &[
                "-q",
                "commit",
                "vm",
                img.to_str().unwrap(),
                "-m",
                &format!("v{i}"),
            ],
        );
    }
    (dir, repo)
}

fn id_of(repo: &Path, version: &str) -> String {
    json(repo, &["show", version])["id"]
        .as_str()
        .unwrap()
        .to_string()
}

#[test]
fn clone_text_json_and_errors() {
    let (_dir, repo) = setup(2);
    let src = id_of(&repo, "vm@1");

    let out = ok(&repo, &["clone", "vm@1", "web"]);
    let web = id_of(&repo, "web");
    assert_eq!(out, format!("cloned vm@1 to web@1 {}\n", &web[..12]));

    let v = json(&repo, &["clone", "vm", "db", "-m", "for the db"]);
    assert_eq!(v["image"], "db");
    assert_eq!(v["seq"], 1);
    assert_eq!(v["parent"], Value::String(id_of(&repo, "vm@2")));
    assert_eq!(v["message"], "for the db");
    assert_eq!(v["new_chunks"], 0);
    assert_eq!(v["root"], json(&repo, &["show", "vm@2"])["root"]);

    // The clone restores like its source.
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("web.raw");
    ok(
        &repo,
        &["restore", "web", out_path.to_str().unwrap(), "--force"],
    );
    assert_eq!(std::fs::read(&out_path).unwrap(), vec![1u8; 100_000]);

    // log shows where the clone came from.
    let log = ok(&repo, &["log", "web"]);
    assert!(
        log.ends_with(&format!("cloned from vm@1 ({})\n", &src[..12])),
        "{log}"
    );
    assert_eq!(seqs(&json(&repo, &["log", "web"])), vec![1]);
    assert!(!ok(&repo, &["log", "vm"]).contains("cloned from"));

    assert_eq!(
        error_line(&repo, &["clone", "vm", "web"]),
        "cairn: error: image \"web\" already exists"
    );
    assert_eq!(
        error_line(&repo, &["clone", "vm@5", "x"]),
        "cairn: error: vm@5: image \"vm\" has no version 5 (its newest is vm@2)"
    );
    assert_eq!(
        error_line_status(&repo, &["clone", "vm", "../x"], 2),
        "cairn: error: invalid image name: \"../x\": '.' and '..' are not allowed as path components"
    );
}

#[test]
fn tags_create_list_use_and_delete() {
    let (_dir, repo) = setup(3);
    let id2 = id_of(&repo, "vm@2");

    let out = ok(&repo, &["tag", "vm@2", "v1.0"]);
    assert_eq!(out, format!("tagged vm@2 {} as v1.0\n", &id2[..12]));
    let v = json(&repo, &["tag", "vm", "newest"]);
    assert_eq!(v["seq"], 3);
    assert_eq!(v["name"], "newest");

    let tags = json(&repo, &["tags", "vm"]);
    let got: Vec<(&str, &str, u64, &str)> = tags
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            let v = &t["version"];
            (
                t["name"].as_str().unwrap(),
                v["id"].as_str().unwrap(),
                v["seq"].as_u64().unwrap(),
                v["image"].as_str().unwrap(),
            )
        })
        .collect();
    let id3 = id_of(&repo, "vm@3");
    assert_eq!(
        got,
        [
            ("newest", id3.as_str(), 3, "vm"),
            ("v1.0", id2.as_str(), 2, "vm")
        ]
    );
    assert_eq!(
        tags[1]["version"]["message"],
        json(&repo, &["show", "vm@2"])["message"]
    );
    assert_eq!(id_of(&repo, "vm@v1.0"), id2);

    // log: tags next to their versions; JSON stays an array, newest first, with "tags".
    let log = json(&repo, &["log", "vm"]);
    assert_eq!(seqs(&log), vec![3, 2, 1]);
    assert_eq!(log[0]["tags"], serde_json::json!(["newest"]));
    assert_eq!(log[1]["tags"], serde_json::json!(["v1.0"]));
    assert_eq!(log[2]["tags"], serde_json::json!([]));
    let text = ok(&repo, &["log", "vm"]);
    let line2 = text.lines().find(|l| l.starts_with("vm@2 ")).unwrap();
    assert!(line2.ends_with("[v1.0] v2"), "{line2}");

    assert_eq!(
        error_line(&repo, &["tag", "vm@1", "v1.0"]),
        "cairn: error: tag \"v1.0\" of image \"vm\" already exists (delete it first)"
    );
    assert_eq!(
        error_line_status(&repo, &["tag", "vm@1", "123"], 2),
        "cairn: error: invalid tag name: \"123\": a tag of only digits would be read as a version number"
    );
    assert_eq!(
        error_line(&repo, &["tags", "nope"]),
        "cairn: error: image \"nope\" does not exist"
    );

    let v = json(&repo, &["tag", "--delete", "vm", "v1.0"]);
    assert_eq!(v["deleted"], true);
    assert_eq!(v["id"], Value::String(id2.clone()));
    assert_eq!(
        error_line(&repo, &["tag", "--delete", "vm", "v1.0"]),
        "cairn: error: image \"vm\" has no tag \"v1.0\""
    );
    assert_eq!(
        error_line(&repo, &["show", "vm@v1.0"]),
        "cairn: error: vm@v1.0: no tag \"v1.0\"; a reference is a version number, a tag, or a hex prefix of a version id"
    );
    assert_eq!(json(&repo, &["tags", "vm"]).as_array().unwrap().len(), 1);
}

#[test]
fn rm_versions_and_images() {
    let (_dir, repo) = setup(3);
    let id2 = id_of(&repo, "vm@2");
    ok(&repo, &["tag", "vm@1", "golden"]);

    assert_eq!(
        error_line(&repo, &["rm", "vm@1"]),
        "cairn: error: vm@1 is tagged as golden; delete the tag first (`cairn tag --delete vm \
         golden`)"
    );
    assert_eq!(
        error_line(&repo, &["rm", "vm@2", "vm@7"]),
        "cairn: error: vm@7: image \"vm\" has no version 7 (its newest is vm@3)"
    );
    assert_eq!(
        error_line(&repo, &["rm", "vm@2", "ghost"]),
        "cairn: error: image \"ghost\" does not exist"
    );
    assert_eq!(
        seqs(&json(&repo, &["log", "vm"])),
        vec![3, 2, 1],
        "nothing changed"
    );

    let v = json(&repo, &["rm", "vm@2"]);
    let removed = v["versions"].as_array().unwrap();
    assert_eq!(removed.len(), 1);
    assert_eq!(
        (removed[0]["seq"].as_u64(), removed[0]["id"].as_str()),
        (Some(2), Some(id2.as_str()))
    );
    assert_eq!(v["images"], serde_json::json!([]));
    assert_eq!(seqs(&json(&repo, &["log", "vm"])), vec![3, 1]);
    assert_eq!(
        error_line(&repo, &["show", "vm@2"]),
        format!(
            "cairn: error: vm@2: version vm@2 ({}) was deleted",
            &id2[..12]
        )
    );
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("one.raw");
    ok(
        &repo,
        &["restore", "vm@1", out_path.to_str().unwrap(), "--force"],
    );
    assert_eq!(std::fs::read(&out_path).unwrap(), vec![1u8; 100_000]);

    // Text output names what went and what space came back: nothing, as a clone uses it.
    ok(&repo, &["clone", "vm@3", "web"]);
    let id3 = id_of(&repo, "vm@3");
    let text = ok(&repo, &["rm", "vm@3"]);
    assert!(
        text.starts_with(&format!("removed vm@3 {}  ", &id3[..12])),
        "{text}"
    );
    assert!(
        text.contains("\nreclaimed 0 B (")
            && text.contains(": freed 1 deleted version, 0 dead blobs;"),
        "{text}"
    );

    // A whole image asks for --yes, and its tagged versions stay protected.
    let refused = cairn(&repo, &["--json", "rm", "web"]);
    assert_eq!(refused.status.code(), Some(1));
    let err: serde_json::Value = serde_json::from_slice(&refused.stderr).unwrap();
    assert_eq!(err["error"]["code"], "refused");
    assert_eq!(
        err["error"]["message"],
        "`cairn rm web` removes the whole image and its 1 version; run again with --yes to do \
         it, or name versions (web@N)"
    );
    let tagged = cairn(&repo, &["--json", "rm", "web", "vm", "--yes"]);
    let err: serde_json::Value = serde_json::from_slice(&tagged.stderr).unwrap();
    assert_eq!(err["error"]["code"], "refused", "{err}");
    assert_eq!(
        err["error"]["message"],
        "vm@1 is tagged as golden; delete the tag first (`cairn tag --delete vm golden`)"
    );
    assert_eq!(
        json(&repo, &["images"]).as_array().unwrap().len(),
        2,
        "nothing changed"
    );

    // Then the head goes, the clone stays.
    ok(&repo, &["tag", "--delete", "vm", "golden"]);
    let text = ok(&repo, &["rm", "vm", "--no-gc", "--yes"]);
    assert!(text.starts_with("removed image vm (1 version)\n"), "{text}");
    assert!(
        text.ends_with("run `cairn gc` to reclaim space\n"),
        "{text}"
    );
    let gc = json(&repo, &["gc"]);
    assert_eq!(gc["mode"], "fast");
    assert_eq!(gc["freed_versions"], 1);
    assert!(gc["dead_blobs"].as_u64().unwrap() > 0, "{gc}");
    assert!(gc["reclaimed_bytes"].as_u64().unwrap() > 0, "{gc}");
    assert_eq!(
        ok(&repo, &["gc"]),
        "nothing to free: no version was deleted since the last gc\n"
    );
    let images = json(&repo, &["images"]);
    assert_eq!(images.as_array().unwrap().len(), 1);
    assert_eq!(images[0]["image"], "web");
    assert_eq!(
        error_line(&repo, &["log", "vm"]),
        "cairn: error: image \"vm\" does not exist"
    );
    ok(
        &repo,
        &["restore", "web", out_path.to_str().unwrap(), "--force"],
    );
    assert_eq!(std::fs::read(&out_path).unwrap(), vec![3u8; 100_000]);

    let v = json(&repo, &["rm", "web", "--yes"]);
    assert_eq!(v["gc"]["freed_versions"], 1);
    assert!(v["gc"]["dead_blobs"].as_u64().unwrap() > 0, "{v}");
    assert_eq!(v["versions"], serde_json::json!([]));
    assert_eq!(v["images"][0]["image"], "web");
    assert_eq!(v["images"][0]["versions"][0]["seq"], 1);
    assert_eq!(json(&repo, &["images"]), serde_json::json!([]));
}

#[test]
fn prune_with_keep_last() {
    let (_dir, repo) = setup(4);
    ok(&repo, &["tag", "vm@2", "golden"]);
    ok(&repo, &["clone", "vm@1", "web"]);

    assert_eq!(
        error_line(&repo, &["prune", "vm"]),
        "cairn: error: refusing to remove every version: give at least one --keep-* option"
    );
    assert_eq!(
        error_line(&repo, &["prune", "nope", "--keep-last", "1"]),
        "cairn: error: image \"nope\" does not exist"
    );
    assert_eq!(
        cairn(&repo, &["prune", "--keep-last", "1"]).status.code(),
        Some(2)
    );

    let dry = json(&repo, &["prune", "vm", "--keep-last", "1", "--dry-run"]);
    assert_eq!(dry["gc"], Value::Null);
    let rows: Vec<(u64, bool, Value)> = dry["versions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            assert_eq!(r["image"], "vm");
            assert!(r["id"].as_str().unwrap().len() == 64 && r["time"].is_string());
            (
                r["seq"].as_u64().unwrap(),
                r["keep"].as_bool().unwrap(),
                r["reasons"].clone(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        vec![
            (4, true, serde_json::json!(["last 1"])),
            (3, false, serde_json::json!([])),
            (2, true, serde_json::json!(["tagged golden"])),
            (1, false, serde_json::json!([])),
        ]
    );
    assert_eq!(
        seqs(&json(&repo, &["log", "vm"])),
        vec![4, 3, 2, 1],
        "dry run"
    );
    let text = ok(&repo, &["prune", "vm", "--keep-last", "1", "-n"]);
    assert!(
        text.contains("dry run: would keep 2 versions, remove 2 versions; nothing was changed"),
        "{text}"
    );
    let line3 = text.lines().find(|l| l.contains("vm@3 ")).unwrap();
    assert!(line3.starts_with("remove "), "{line3}");

    let text = ok(&repo, &["prune", "--all", "--keep-last", "1"]);
    assert!(
        text.contains("kept 3 versions, removed 2 versions\nreclaimed ")
            && text.contains(": freed 2 deleted versions, "),
        "{text}"
    );
    assert_eq!(seqs(&json(&repo, &["log", "vm"])), vec![4, 2]);
    assert_eq!(seqs(&json(&repo, &["log", "web"])), vec![1]);
    // The clone of a pruned version still restores.
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("web.raw");
    ok(
        &repo,
        &["restore", "web", out_path.to_str().unwrap(), "--force"],
    );
    assert_eq!(std::fs::read(&out_path).unwrap(), vec![1u8; 100_000]);

    let again = json(&repo, &["prune", "--all", "--keep-daily", "1"]);
    assert!(again["versions"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["keep"] == true));
    assert_eq!(again["gc"], Value::Null, "nothing removed, no gc");
}

/// Issue 53, finding 10: a deletion whose GC did not run (another GC held the lock when two
/// prunes ran at once; here `rm --no-gc`) is freed by the next prune even when that prune
/// removes nothing, not left for `gc --repair`.
#[test]
fn prune_frees_what_an_earlier_deletion_left() {
    let (_dir, repo) = setup(3);
    ok(&repo, &["-q", "rm", "--no-gc", "vm@1"]);
    let p = json(&repo, &["prune", "vm", "--keep-last", "5"]);
    assert!(p["versions"]
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["keep"] == true));
    assert_eq!(p["gc"]["freed_versions"], 1, "{p}");
    // Nothing is pending now: the next prune that removes nothing runs no GC.
    let p = json(&repo, &["prune", "vm", "--keep-last", "5"]);
    assert_eq!(p["gc"], Value::Null, "{p}");
}

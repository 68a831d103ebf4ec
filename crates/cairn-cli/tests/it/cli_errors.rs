//! The CLI's error contract: one line on stderr naming what and where, a non-zero exit, and
//! nothing published.

use crate::common::{cairn, cairn_with, stderr_line};

#[test]
fn missing_repository() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("nope");
    let out = cairn(&repo, &["log", "vm"]);
    assert_eq!(out.status.code(), Some(4), "exit 4: no repository here");
    assert_eq!(
        stderr_line(&out),
        format!(
            "cairn: error: no cairn repository at {} (the directory does not exist; run `cairn init` first)",
            repo.display()
        )
    );
    assert!(!repo.exists(), "opening must never create a repository");

    std::fs::create_dir(&repo).unwrap();
    let out = cairn(&repo, &["images"]);
    assert_eq!(
        stderr_line(&out),
        format!(
            "cairn: error: no cairn repository at {} (run `cairn init` first)",
            repo.display()
        )
    );
}

#[test]
fn repository_with_a_newer_format_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("r");
    assert!(cairn(&repo, &["init"]).status.success());
    // Rewrite the config as format version 3 (this cairn reads 1 and 2), with a valid checksum.
    let cfg = repo.join("config");
    let mut raw = std::fs::read(&cfg).unwrap();
    raw[8..12].copy_from_slice(&3u32.to_le_bytes());
    let body = raw.len() - 32;
    let sum = blake3::hash(&raw[..body]);
    raw[body..].copy_from_slice(sum.as_bytes());
    std::fs::write(&cfg, raw).unwrap();
    let out = cairn(&repo, &["images"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr_line(&out),
        format!(
            "cairn: error: {}/config: config: format version 3 is newer than this cairn supports (2); upgrade cairn",
            repo.display()
        )
    );
}

#[test]
fn init_twice_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("r");
    assert!(cairn(&repo, &["init"]).status.success());
    let out = cairn(&repo, &["init"]);
    assert_eq!(
        stderr_line(&out),
        format!(
            "cairn: error: a repository already exists at {}",
            repo.display()
        )
    );
}

#[test]
fn bad_image_names_and_sources() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("r");
    assert!(cairn(&repo, &["init"]).status.success());
    let img = dir.path().join("img.raw");
    std::fs::write(&img, vec![1u8; 100_000]).unwrap();

    let out = cairn(&repo, &["commit", "../evil", img.to_str().unwrap()]);
    assert_eq!(
        stderr_line(&out),
        "cairn: error: invalid image name: \"../evil\": '.' and '..' are not allowed as path components"
    );
    let out = cairn(&repo, &["commit", "a\u{7}b", img.to_str().unwrap()]);
    assert_eq!(
        stderr_line(&out),
        "cairn: error: invalid image name: \"a\\u{7}b\": control characters are not allowed"
    );
    let missing = dir.path().join("missing.raw");
    let out = cairn(&repo, &["commit", "vm", missing.to_str().unwrap()]);
    assert_eq!(
        stderr_line(&out),
        format!(
            "cairn: error: cannot open source {}: No such file or directory (os error 2)",
            missing.display()
        )
    );
    let out = cairn(&repo, &["commit", "vm", dir.path().to_str().unwrap()]);
    assert_eq!(
        stderr_line(&out),
        format!(
            "cairn: error: cannot read source {}: is a directory",
            dir.path().display()
        )
    );
    // Nothing was published by the failed commits.
    let out = cairn(&repo, &["--json", "images"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "[]");
}

#[test]
fn unknown_versions() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("r");
    assert!(cairn(&repo, &["init"]).status.success());
    let img = dir.path().join("img.raw");
    std::fs::write(&img, vec![1u8; 100_000]).unwrap();
    assert!(cairn(&repo, &["commit", "vm", img.to_str().unwrap()])
        .status
        .success());
    let out = cairn(&repo, &["show", "vm@7"]);
    assert_eq!(
        stderr_line(&out),
        "cairn: error: vm@7: image \"vm\" has no version 7 (its newest is vm@1)"
    );
    let out = cairn(&repo, &["show", "other"]);
    assert_eq!(
        stderr_line(&out),
        "cairn: error: image \"other\" does not exist"
    );
    let out = cairn(&repo, &["show", "vm@zz"]);
    assert_eq!(
        stderr_line(&out),
        "cairn: error: vm@zz: no tag \"zz\"; a reference is a version number, a tag, or a hex prefix of a version id"
    );
    let out = cairn(&repo, &["--json", "show", "vm@1"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["seq"], 1);
    assert_eq!(v["logical_bytes"], 100_000);
}

#[test]
fn init_refuses_a_directory_that_holds_other_files() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("r");
    std::fs::create_dir(&repo).unwrap();
    std::fs::write(repo.join("notes.txt"), b"mine").unwrap();
    let out = cairn(&repo, &["init"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr_line(&out),
        format!(
            "cairn: error: {} is not empty (1 entry: notes.txt): `cairn init` needs a new or \
             empty directory",
            repo.display()
        )
    );
    let left: Vec<_> = std::fs::read_dir(&repo)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["notes.txt"], "nothing was created");
    // An empty directory is fine.
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert!(cairn(&empty, &["init"]).status.success());
}

#[test]
fn init_encrypt_without_a_passphrase_exits_5_and_creates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("r");
    let out = cairn_with(&repo, &[], &["--json", "init", "--encrypt"]);
    assert_eq!(out.status.code(), Some(5));
    let err: serde_json::Value = serde_json::from_slice(&out.stderr).unwrap();
    assert_eq!(err["error"]["code"], "password", "{err}");
    assert!(
        !repo.exists(),
        "nothing created before the passphrase is known"
    );
}

#[test]
fn an_empty_cairn_variable_counts_as_unset() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("r");
    assert!(cairn(&repo, &["init"]).status.success());
    let empty = [
        ("CAIRN_PASSWORD_FILE", ""),
        ("CAIRN_PASSWORD_COMMAND", ""),
        ("CAIRN_META_CACHE", ""),
    ];
    let out = cairn_with(&repo, &empty, &["images"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // An empty CAIRN_REPO is no repository, not the current directory.
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_cairn"));
    let out = cmd
        .args(["images"])
        .env("CAIRN_REPO", "")
        .current_dir(dir.path())
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(4),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

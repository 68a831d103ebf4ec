//! `cairn --repo s3://...` end to end: init, commit, restore, verify, rm, gc; an encrypted
//! format 2 repository with its key slots on the bucket, rm and gc on it; `cairn copy` through
//! the bucket.
//!
//! Needs `CAIRN_TEST_S3_URL` and the `AWS_*` credentials (see `scripts/minio.sh run`); prints
//! a skip line without them, unless `CAIRN_REQUIRE_S3=1`.

#[path = "it/common/mod.rs"]
mod common;

use common::cairn;

use std::path::Path;

fn s3_repo() -> Option<String> {
    let Some(url) = std::env::var("CAIRN_TEST_S3_URL")
        .ok()
        .filter(|u| !u.is_empty())
    else {
        if std::env::var("CAIRN_REQUIRE_S3").as_deref() == Ok("1") {
            panic!("CAIRN_REQUIRE_S3=1 but CAIRN_TEST_S3_URL is unset: run under scripts/minio.sh run ...");
        }
        eprintln!("skipped: CAIRN_TEST_S3_URL is unset (scripts/minio.sh run ... sets it)");
        return None;
    };
    // A fresh prefix per run, so runs never see each other's repositories.
    let (base, query) = url.split_once('?').unwrap_or((&url, ""));
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let base = base.trim_end_matches('/');
    Some(format!("{base}/cli-{nanos:x}?{query}"))
}

fn ok(repo: &str, args: &[&str]) -> String {
    let out = cairn(Path::new(repo), args);
    assert!(
        out.status.success(),
        "cairn {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// An image with data, holes and repeated content.
fn image(seed: u8, len: usize) -> Vec<u8> {
    let mut data = vec![0u8; len];
    let mut x = 0x9e37_79b9u32 ^ u32::from(seed);
    for (i, b) in data.iter_mut().enumerate() {
        if (i / 65_536) % 3 == 1 {
            continue; // zero run
        }
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        *b = (x % 7) as u8; // compressible
    }
    data
}

#[test]
fn init_commit_restore_gc_on_s3() {
    let Some(repo) = s3_repo() else { return };
    let secret = std::env::var("AWS_SECRET_ACCESS_KEY").unwrap_or_default();
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img.raw");
    let out = dir.path().join("out.raw");
    let out_s = out.to_str().unwrap();

    let text = ok(&repo, &["init"]);
    assert!(text.contains("s3://"), "{text}");
    assert!(secret.is_empty() || !text.contains(&secret), "{text}");

    let v1 = image(1, 3 << 20);
    std::fs::write(&img, &v1).unwrap();
    ok(
        &repo,
        &["-q", "commit", "vm", img.to_str().unwrap(), "-m", "one"],
    );
    let mut v2 = v1.clone();
    v2[100_000..200_000].copy_from_slice(&image(2, 100_000));
    std::fs::write(&img, &v2).unwrap();
    ok(
        &repo,
        &["-q", "commit", "vm", img.to_str().unwrap(), "-m", "two"],
    );

    ok(&repo, &["-q", "restore", "vm@1", out_s, "--force"]);
    assert!(std::fs::read(&out).unwrap() == v1, "vm@1 restored wrong");
    ok(&repo, &["-q", "restore", "vm", out_s, "--force"]);
    assert!(std::fs::read(&out).unwrap() == v2, "vm restored wrong");
    ok(&repo, &["-q", "verify"]);

    // Deleting a version and collecting garbage goes through ref deletion and object delete.
    ok(&repo, &["-q", "rm", "vm@1"]);
    ok(&repo, &["-q", "gc"]);
    ok(&repo, &["-q", "restore", "vm", out_s, "--force"]);
    assert!(
        std::fs::read(&out).unwrap() == v2,
        "vm restored wrong after gc"
    );
    let log = ok(&repo, &["log", "vm"]);
    assert!(log.contains("two") && !log.contains("one"), "{log}");

    // A second init on the same prefix must refuse, in one line.
    let out = cairn(Path::new(&repo), &["init"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(secret.is_empty() || !err.contains(&secret), "{err}");
}

/// An encrypted format 2 repository on the bucket: key slots and sealed objects go through
/// the S3 store like any other object; a wrong passphrase is refused with exit 5.
#[test]
fn an_encrypted_repository_on_s3_round_trips_and_refuses_a_wrong_passphrase() {
    let Some(repo) = s3_repo() else { return };
    let repo = Path::new(&repo);
    let pw = [("CAIRN_PASSWORD", "s3 passphrase")];
    let ok_with = |env: &[(&str, &str)], args: &[&str]| {
        let out = common::cairn_with(repo, env, args);
        assert!(out.status.success(), "cairn {args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let dir = tempfile::tempdir().unwrap();
    let img = dir.path().join("img.raw");
    let out = dir.path().join("out.raw");
    let (img_s, out_s) = (img.to_str().unwrap(), out.to_str().unwrap());

    let init = ok_with(&pw, &["--json", "init", "--encrypt"]);
    let init: serde_json::Value = serde_json::from_str(&init).unwrap();
    assert_eq!(init["encrypted"], true, "{init}");
    let v1 = image(3, 3 << 20);
    std::fs::write(&img, &v1).unwrap();
    ok_with(&pw, &["-q", "commit", "vm", img_s]);
    let mut v2 = v1.clone();
    v2[1 << 20..(1 << 20) + 50_000].copy_from_slice(&image(4, 50_000));
    std::fs::write(&img, &v2).unwrap();
    ok_with(&pw, &["-q", "commit", "vm", img_s]);

    ok_with(&pw, &["-q", "restore", "vm@1", out_s, "--force"]);
    assert!(std::fs::read(&out).unwrap() == v1, "vm@1 restored wrong");
    ok_with(&pw, &["-q", "restore", "vm", out_s, "--force"]);
    assert!(std::fs::read(&out).unwrap() == v2, "vm restored wrong");
    ok_with(&pw, &["-q", "verify"]);

    // A second slot, then the first passphrase changed: both slots live on the bucket.
    ok_with(
        &[
            ("CAIRN_PASSWORD", "s3 passphrase"),
            ("CAIRN_NEW_PASSWORD", "second"),
        ],
        &["-q", "key", "add"],
    );
    let slots = ok_with(&[("CAIRN_PASSWORD", "second")], &["--json", "key", "list"]);
    let slots: serde_json::Value = serde_json::from_str(&slots).unwrap();
    assert_eq!(slots.as_array().map(Vec::len), Some(2), "{slots}");

    let wrong = common::cairn_with(
        repo,
        &[("CAIRN_PASSWORD", "nope")],
        &["restore", "vm", out_s, "--force"],
    );
    assert_eq!(wrong.status.code(), Some(5), "{wrong:?}");
    assert!(
        common::stderr_line(&wrong).contains("wrong passphrase"),
        "{wrong:?}"
    );
    let none = common::cairn_with(repo, &[], &["log", "vm"]);
    assert_eq!(none.status.code(), Some(5), "{none:?}");

    // rm gives back what only vm@1 held (its 50,000 changed bytes' groups are rewritten
    // without them, through ranged reads and deletes on the bucket); vm stays bit-exact.
    let rm = ok_with(&pw, &["--json", "rm", "vm@1"]);
    let rm: serde_json::Value = serde_json::from_str(&rm).unwrap();
    assert!(rm["gc"]["reclaimed_bytes"].as_u64().unwrap() > 0, "{rm}");
    let gc = ok_with(&pw, &["--json", "gc", "--repair"]);
    let gc: serde_json::Value = serde_json::from_str(&gc).unwrap();
    assert_eq!(gc["reclaimed_bytes"], 0, "{gc}");
    ok_with(&pw, &["-q", "restore", "vm", out_s, "--force"]);
    assert!(
        std::fs::read(&out).unwrap() == v2,
        "vm restored wrong after gc"
    );
    ok_with(&pw, &["-q", "verify"]);
}

/// `cairn copy` local → S3 → a new encrypted local repository ends bit-exact, and a second
/// run copies nothing.
#[test]
fn copy_goes_local_to_s3_to_an_encrypted_local_repository() {
    let Some(bucket) = s3_repo() else { return };
    let dir = tempfile::tempdir().unwrap();
    let local = dir.path().join("local");
    let sealed = dir.path().join("sealed");
    let img = dir.path().join("img.raw");
    let run = |repo: &Path, env: &[(&str, &str)], args: &[&str]| {
        let out = common::cairn_with(repo, env, args);
        assert!(out.status.success(), "cairn {args:?}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let pw = [("CAIRN_PASSWORD", "sealed")];
    run(&local, &[], &["-q", "init"]);
    let mut data = image(5, 2 << 20);
    let mut versions = Vec::new();
    for round in 0..3u8 {
        data[(round as usize) << 19..((round as usize) << 19) + 4096].fill(round + 1);
        std::fs::write(&img, &data).unwrap();
        run(&local, &[], &["-q", "commit", "vm", img.to_str().unwrap()]);
        versions.push(data.clone());
    }
    run(&local, &[], &["-q", "tag", "vm@2", "golden"]);

    let s3 = Path::new(&bucket);
    run(s3, &[], &["-q", "init", "--format", "2"]);
    let (local_s, s3_s) = (local.to_str().unwrap(), bucket.as_str());
    let first = run(s3, &[], &["copy", "--from", local_s]);
    assert!(first.contains("3 version(s) copied"), "{first}");
    run(&sealed, &pw, &["-q", "init", "--encrypt"]);
    run(&sealed, &pw, &["-q", "copy", "--from", s3_s]);
    for (i, want) in versions.iter().enumerate() {
        let out = dir.path().join(format!("out{i}.raw"));
        let spec = format!("vm@{}", i + 1);
        run(
            &sealed,
            &pw,
            &["-q", "restore", &spec, out.to_str().unwrap()],
        );
        assert!(std::fs::read(&out).unwrap() == *want, "{spec} differs");
    }
    let tagged = run(&sealed, &pw, &["log", "vm"]);
    assert!(tagged.contains("golden"), "{tagged}");
    for (repo, from, env) in [(s3, local_s, &[][..]), (sealed.as_path(), s3_s, &pw[..])] {
        let again = run(repo, env, &["copy", "--from", from]);
        assert!(
            again.contains("0 version(s) copied, 3 already there"),
            "{again}"
        );
    }
}

/// A store that cannot be used says what to fix — the credentials, the bucket, the endpoint —
/// in one line, at once (not after minutes of retries).
#[test]
fn an_unusable_store_says_what_to_fix() {
    let Some(repo) = s3_repo() else { return };
    let run = |url: &str, secret: Option<&str>| {
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_cairn"));
        cmd.args(["--json", "--repo", url, "images"])
            .env_remove("CAIRN_LOG");
        if let Some(secret) = secret {
            cmd.env("AWS_SECRET_ACCESS_KEY", secret);
        }
        let out = cmd.output().unwrap();
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        let line = String::from_utf8_lossy(&out.stderr).trim().to_string();
        assert_eq!(line.lines().count(), 1, "one line: {line}");
        let v: serde_json::Value = serde_json::from_str(&line).unwrap();
        assert_eq!(v["error"]["code"], "store", "{v}");
        v["error"]["message"].as_str().unwrap().to_string()
    };
    let wrong_secret = "not-the-secret-0123456789";
    let message = run(&repo, Some(wrong_secret));
    assert!(
        message.contains("access denied: check AWS_ACCESS_KEY_ID"),
        "{message}"
    );
    assert!(
        !message.contains(wrong_secret),
        "the secret is never shown: {message}"
    );

    let (base, query) = repo.split_once('?').unwrap();
    let bucket = base.trim_start_matches("s3://").split('/').next().unwrap();
    let missing = repo.replacen(bucket, "cairn-no-such-bucket-4f2a", 1);
    let message = run(&missing, None);
    assert!(
        message.contains("bucket \"cairn-no-such-bucket-4f2a\" does not exist"),
        "{message}"
    );

    // Port 9 (discard) on loopback: nothing listens, the connection is refused.
    let endpoint = query
        .split('&')
        .find_map(|kv| kv.strip_prefix("endpoint="))
        .unwrap();
    let closed = repo.replace(endpoint, "http://127.0.0.1:9");
    let message = run(&closed, None);
    assert!(
        message.contains("the endpoint does not answer"),
        "{message}"
    );
}

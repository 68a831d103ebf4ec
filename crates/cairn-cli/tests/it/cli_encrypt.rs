//! `cairn init --encrypt` end to end through the binary: every passphrase source
//! (CAIRN_PASSWORD, --password-file, --password-command; never argv), a wrong or missing
//! passphrase refused with one line and exit 5 leaving the repository unchanged, key slots
//! added, listed, changed and removed (never the last), and an encrypted version served over
//! NBD bit-exact with the host cache private to its user.

use crate::common;
use crate::common::export::{qemu_img_convert, same_file, Served};
use crate::common::{noise, snapshot, stderr_line};

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Output;

fn run(repo: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    common::cairn_with(repo, env, args)
}

fn ok(repo: &Path, env: &[(&str, &str)], args: &[&str]) -> String {
    let out = run(repo, env, args);
    assert!(out.status.success(), "cairn {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// Fails with exit 5 and one line containing `text`.
fn refused(out: Output, text: &str) {
    assert_eq!(out.status.code(), Some(5), "{out:?}");
    let line = stderr_line(&out);
    assert!(line.contains(text), "{line}");
}

#[test]
fn passphrases_come_from_the_environment_a_file_or_a_command_and_wrong_ones_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let pw = [("CAIRN_PASSWORD", "correct horse")];
    let init = ok(
        &repo,
        &pw,
        &["--json", "init", "--encrypt", "--reserve", "0"],
    );
    let v: serde_json::Value = serde_json::from_str(init.trim()).unwrap();
    assert_eq!(
        (v["format"].as_u64(), v["encrypted"].as_bool()),
        (Some(2), Some(true))
    );
    // Format 1 is read-only: no new one, encrypted or not.
    let out = run(
        &dir.path().join("r1"),
        &pw,
        &["init", "--encrypt", "--format", "1"],
    );
    assert!(stderr_line(&out).contains("format 1 is read-only"));

    let mut data = noise(2 << 20, 3);
    data.extend(vec![0u8; 1 << 20]);
    data.extend(b"encrypted disk\n".repeat(70_000));
    let img = dir.path().join("disk.raw");
    std::fs::write(&img, &data).unwrap();
    ok(&repo, &pw, &["-q", "commit", "vm", img.to_str().unwrap()]);

    // Each source restores bit-exact: the environment, a file (first line), a command.
    let file = dir.path().join("pw.txt");
    std::fs::write(&file, "correct horse\nignored second line\n").unwrap();
    let script = "printf 'correct horse\\n'";
    type Env<'a> = &'a [(&'a str, &'a str)];
    let sources: [(Env, Vec<&str>); 3] = [
        (&pw, vec![]),
        (&[], vec!["--password-file", file.to_str().unwrap()]),
        (&[], vec!["--password-command", script]),
    ];
    for (i, (env, flags)) in sources.iter().enumerate() {
        let out = dir.path().join(format!("out{i}.raw"));
        let mut args = flags.clone();
        args.extend(["-q", "restore", "vm", out.to_str().unwrap()]);
        ok(&repo, env, &args);
        assert!(std::fs::read(&out).unwrap() == data, "source {i}");
    }
    assert!(ok(&repo, &pw, &["verify"]).contains("no problems found"));

    // Wrong, missing, failing: one line, exit 5, nothing changed (a commit refused too).
    let before = snapshot(&repo);
    let wrong = [("CAIRN_PASSWORD", "battery staple")];
    refused(
        run(&repo, &wrong, &["commit", "vm", img.to_str().unwrap()]),
        "wrong passphrase: none of the 1 key slot(s)",
    );
    refused(run(&repo, &[], &["log", "vm"]), "no passphrase given");
    refused(
        run(&repo, &[], &["--password-command", "exit 7", "log", "vm"]),
        "--password-command failed",
    );
    refused(
        run(
            &repo,
            &[],
            &["--password-file", "/nonexistent/pw", "log", "vm"],
        ),
        "cannot read the password file /nonexistent/pw",
    );
    assert!(
        snapshot(&repo) == before,
        "a refused command changed the repository"
    );

    // Nothing of the plain image is in any stored file.
    let marker = b"encrypted disk\nencrypted disk\n";
    for (path, bytes) in snapshot(&repo) {
        assert!(
            !bytes.windows(marker.len()).any(|w| w == marker),
            "{path} holds plain data"
        );
    }
}

#[test]
fn key_slots_are_added_listed_changed_and_the_last_is_never_removed() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let a = [("CAIRN_PASSWORD", "alpha")];
    ok(&repo, &a, &["-q", "init", "--encrypt", "--reserve", "0"]);
    let list = |env: &[(&str, &str)]| -> Vec<serde_json::Value> {
        serde_json::from_str(&ok(&repo, env, &["--json", "key", "list"])).unwrap()
    };
    let first = list(&a);
    assert_eq!(first.len(), 1);
    assert_eq!(first[0]["current"], true);
    assert_eq!(first[0]["memory_kib"], 65536);

    // Add "beta" (from the environment); both open the repository.
    ok(
        &repo,
        &[("CAIRN_PASSWORD", "alpha"), ("CAIRN_NEW_PASSWORD", "beta")],
        &["key", "add"],
    );
    let b = [("CAIRN_PASSWORD", "beta")];
    let two = list(&b);
    assert_eq!(two.len(), 2);
    assert_eq!(two.iter().filter(|s| s["current"] == true).count(), 1);
    assert!(list(&a).len() == 2);

    // Change beta's passphrase to gamma (from a file): beta stops working, alpha still works.
    let file = dir.path().join("new.txt");
    std::fs::write(&file, "gamma\n").unwrap();
    ok(
        &repo,
        &b,
        &[
            "key",
            "passwd",
            "--new-password-file",
            file.to_str().unwrap(),
        ],
    );
    refused(run(&repo, &b, &["key", "list"]), "wrong passphrase");
    let g = [("CAIRN_PASSWORD", "gamma")];
    assert_eq!(list(&g).len(), 2);

    // Remove alpha's slot (by prefix, opened with gamma), then the last one is refused.
    let alpha_id = first[0]["slot"].as_str().unwrap();
    ok(&repo, &g, &["key", "remove", &alpha_id[..10]]);
    refused(run(&repo, &a, &["key", "list"]), "wrong passphrase");
    let last = list(&g);
    assert_eq!(last.len(), 1);
    let out = run(
        &repo,
        &g,
        &["key", "remove", last[0]["slot"].as_str().unwrap()],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr_line(&out).contains("is the last one"), "{out:?}");
    assert_eq!(list(&g).len(), 1);

    // Key commands on a plain repository say why they do nothing.
    let plain = dir.path().join("plain");
    ok(
        &plain,
        &[],
        &["-q", "init", "--format", "2", "--reserve", "0"],
    );
    let out = run(&plain, &[], &["key", "list"]);
    assert!(stderr_line(&out).contains("is not encrypted"), "{out:?}");
}

#[test]
fn an_encrypted_version_is_served_bit_exact_and_its_cache_is_private() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let pw = [("CAIRN_PASSWORD", "served")];
    ok(&repo, &pw, &["-q", "init", "--encrypt", "--reserve", "0"]);
    let img = common::export::image(dir.path(), "a.raw", 7, (1 << 20) + 12288);
    ok(&repo, &pw, &["-q", "commit", "vm", img.to_str().unwrap()]);

    let pw_os = std::ffi::OsString::from("served");
    let mut served = Served::spawn_env(
        &repo,
        dir.path(),
        "enc",
        &["vm", "--name", "disk"],
        &[("CAIRN_PASSWORD", pw_os.as_os_str())],
    );
    let out = dir.path().join("served.raw");
    qemu_img_convert(served.uri(), &out);
    same_file(&out, &img, "an encrypted version served over NBD");
    let cache = dir.path().join("cache");
    let mode = std::fs::metadata(&cache).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "the host cache is private to its user");
    served.signal("TERM");
}

/// Whoever can write the bucket can swap an encrypted repository's config for a plain one
/// (and delete its key slots): a command that writes then refuses, rather than store
/// plaintext, while key slots remain or a passphrase is given.
#[test]
fn a_downgraded_repository_gets_no_plaintext() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let pw = [("CAIRN_PASSWORD", "correct horse")];
    ok(&repo, &pw, &["-q", "init", "--encrypt", "--reserve", "0"]);
    let img = dir.path().join("disk.raw");
    std::fs::write(&img, noise(1 << 20, 4)).unwrap();
    ok(&repo, &pw, &["-q", "commit", "vm", img.to_str().unwrap()]);

    // The attacker's plain config (another repository's), key slots still there.
    let plain = dir.path().join("plain");
    ok(&plain, &[], &["-q", "init", "--reserve", "0"]);
    std::fs::remove_file(repo.join("config")).unwrap();
    std::fs::copy(plain.join("config"), repo.join("config")).unwrap();
    let before = snapshot(&repo);
    let commit = |env: &[(&str, &str)]| run(&repo, env, &["commit", "vm", img.to_str().unwrap()]);
    // Refused as the repository opens for writing (damage: exit 3).
    for env in [&[][..], &pw[..]] {
        let out = commit(env);
        assert_eq!(out.status.code(), Some(3), "{out:?}");
        assert!(
            stderr_line(&out).contains("yet it holds key slots"),
            "{out:?}"
        );
    }
    // Key slots deleted too: a given passphrase still stops it.
    std::fs::remove_dir_all(repo.join("keys")).unwrap();
    refused(
        commit(&pw),
        "is not encrypted, yet a passphrase is given ($CAIRN_PASSWORD)",
    );
    let pwfile = dir.path().join("pw");
    std::fs::write(&pwfile, "correct horse\n").unwrap();
    refused(
        run(
            &repo,
            &[],
            &[
                "--password-file",
                pwfile.to_str().unwrap(),
                "commit",
                "vm",
                img.to_str().unwrap(),
            ],
        ),
        "a passphrase is given (--password-file)",
    );
    let mut now = snapshot(&repo);
    now.retain(|(k, _)| !k.contains("/keys/"));
    let mut was = before;
    was.retain(|(k, _)| !k.contains("/keys/"));
    assert_eq!(now, was, "nothing was written");
}

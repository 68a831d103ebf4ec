//! Shell completions and man pages are generated from the command definitions.

use std::process::Command;

fn cairn(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_cairn"))
        .args(args)
        .env_remove("CAIRN_REPO")
        .output()
        .expect("run cairn")
}

#[test]
fn completion_scripts_know_every_command() {
    for shell in ["bash", "zsh", "fish"] {
        let out = cairn(&["completions", shell]);
        assert!(out.status.success(), "{shell}: {out:?}");
        let script = String::from_utf8(out.stdout).unwrap();
        for command in [
            "commit",
            "restore",
            "export",
            "verify",
            "mount",
            "repair",
            "allow-damage",
        ] {
            assert!(
                script.contains(command),
                "{shell} completion lacks {command}"
            );
        }
    }
    // bash parses it (from a file: the script is longer than one argument may be).
    let out = cairn(&["completions", "bash"]);
    let dir = tempfile::tempdir().unwrap();
    let script = dir.path().join("cairn.bash");
    std::fs::write(&script, &out.stdout).unwrap();
    let check = Command::new("bash")
        .arg("-n")
        .arg(&script)
        .status()
        .unwrap();
    assert!(check.success(), "bash -n rejects the completion script");
}

#[test]
fn man_pages_for_cairn_and_each_command() {
    let dir = tempfile::tempdir().unwrap();
    let out = cairn(&["man", "--dir", dir.path().to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    for page in [
        "cairn.1",
        "cairn-commit.1",
        "cairn-restore.1",
        "cairn-overlay.1",
    ] {
        let text = std::fs::read_to_string(dir.path().join(page)).unwrap();
        let title = page.trim_end_matches(".1");
        assert!(text.starts_with(".ie"), "{page} is roff");
        assert!(
            text.contains(&format!(".TH {title} 1")),
            "{page}: {}",
            &text[..200]
        );
    }
    let commit = std::fs::read_to_string(dir.path().join("cairn-commit.1")).unwrap();
    assert!(
        commit.contains("dirty\\-bitmap"),
        "the page documents the flags"
    );
    // Without --dir, cairn(1) goes to stdout.
    let out = cairn(&["man"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains(".TH cairn 1"));
}

//! The life of an export: readiness on stdout and to systemd, one owner per socket and
//! name, a clean stop, `cairn exports`, overlays without a running export, a private run
//! directory, and no writable export on a public address without TLS.

use crate::common;
use crate::common::export::*;

use std::io::{BufRead, BufReader, Read};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

#[test]
fn export_json_announces_each_export_with_its_uri_once_it_serves() {
    let (dir, repo, a, _) = setup();
    let served = Served::start(&repo, "vm@1", dir.path(), "a");
    let socket = served.socket.display().to_string();
    assert_eq!(
        served.ready,
        serde_json::json!({
            "name": "disk",
            "uri": format!("nbd+unix:///disk?socket={socket}"),
            "version": "vm@1",
            "id": full_id(&repo, "vm@1"),
            "pid": served.pid(),
            "socket": socket,
            "listen": null,
            "writable": false,
            "tls": false,
            "overlay": null,
        })
    );
    // The URI works as printed.
    let out = dir.path().join("out.raw");
    qemu_img_convert(served.ready["uri"].as_str().unwrap(), &out);
    same_file(&out, &a, "the announced URI");

    // On TCP, port 0 is announced as the port it got.
    let tcp = Served::spawn(
        &repo,
        dir.path(),
        "t",
        &["vm@1", "--name", "tcp", "--listen", "127.0.0.1:0"],
    );
    let uri = tcp.ready["uri"].as_str().unwrap();
    let listen = tcp.ready["listen"].as_str().unwrap();
    assert!(
        listen.starts_with("127.0.0.1:") && !listen.ends_with(":0"),
        "{listen}"
    );
    assert_eq!(uri, format!("nbd://{listen}/tcp"));
    let size = tool("nbdinfo", "libnbd-bin")
        .args(["--size", uri])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&size.stdout).trim(),
        std::fs::metadata(&a).unwrap().len().to_string()
    );

    // Several exports in one process: exactly one line each, in the order given, and nothing
    // more on standard output until it exits (a script can read one line per export).
    let mut two = Served::spawn(&repo, dir.path(), "two", &["vm@1=a", "other=b"]);
    let two_socket = two.socket.display().to_string();
    let mut rest = String::new();
    two.stdout.read_line(&mut rest).unwrap();
    let second: Value = serde_json::from_str(&rest).unwrap();
    let announced: Vec<(&str, &str)> = [&two.ready, &second]
        .iter()
        .map(|v| (v["name"].as_str().unwrap(), v["uri"].as_str().unwrap()))
        .collect();
    assert_eq!(
        announced,
        [
            ("a", format!("nbd+unix:///a?socket={two_socket}").as_str()),
            ("b", format!("nbd+unix:///b?socket={two_socket}").as_str()),
        ]
    );
    assert_eq!(second["version"], "other@1");
    let (status, err) = two.signal("TERM");
    assert_eq!(status.code(), Some(0), "{err}");
    rest.clear();
    two.stdout.read_to_string(&mut rest).unwrap();
    assert_eq!(rest, "", "more on stdout after the announcements");
    assert!(
        !err.contains("serving"),
        "the text notes went out too: {err}"
    );
}

#[test]
fn a_second_export_cannot_take_a_busy_socket_or_name() {
    let (dir, repo, a, _) = setup();
    let served = Served::start(&repo, "vm@1", dir.path(), "a");
    let pid = served.pid();
    let run = dir.path().join("run");
    let try_export = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("--repo")
            .arg(&repo)
            .arg("export")
            .args(args)
            .arg("--cache-dir")
            .arg(dir.path().join("cache"))
            .env("CAIRN_RUN_DIR", &run)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        common::stderr_line(&out)
    };
    let socket = served.socket.display().to_string();
    assert_eq!(
        try_export(&["vm@1", "--name", "other", "--socket", &socket]),
        format!(
            "cairn: error: socket {socket} is in use by export \"disk\" (pid {pid}); \
             stop it with `cairn exports stop disk` or choose another --socket"
        )
    );
    let elsewhere = dir.path().join("b.sock");
    assert_eq!(
        try_export(&[
            "vm@1",
            "--name",
            "disk",
            "--socket",
            elsewhere.to_str().unwrap()
        ]),
        format!(
            "cairn: error: export name \"disk\" is in use by pid {pid} ({}); \
             stop it with `cairn exports stop disk` or choose another --name",
            run.join("disk.ctl").display()
        )
    );
    assert!(!elsewhere.exists());

    // A socket some other program serves is not taken either.
    let foreign = dir.path().join("foreign.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&foreign).unwrap();
    assert_eq!(
        try_export(&[
            "vm@1",
            "--name",
            "third",
            "--socket",
            foreign.to_str().unwrap()
        ]),
        format!(
            "cairn: error: socket {} is in use by pid {}; choose another --socket",
            foreign.display(),
            std::process::id()
        )
    );

    // The first export still serves, and its control socket is still its own.
    let out = dir.path().join("out.raw");
    qemu_img_convert(served.uri(), &out);
    same_file(&out, &a, "first export");
    let status: Value =
        serde_json::from_slice(&cairn_ctl(&repo, dir.path(), &["--json", "status", "disk"]).stdout)
            .unwrap();
    assert_eq!(status["pid"], pid, "{status}");
}

#[test]
fn sigterm_stops_an_export_cleanly_and_keeps_unflushed_writes() {
    let (dir, repo, a, _) = setup();
    let mut served = start_writable(&repo, "vm", dir.path(), "w");
    let run = dir.path().join("run");
    assert!(run.join("disk.json").exists());
    // nbdcopy writes without a flush (no --flush).
    let want = pattern(dir.path(), std::fs::metadata(&a).unwrap().len());
    nbdcopy(&want, served.uri());
    let (status, err) = served.signal("TERM");
    assert_eq!(status.code(), Some(0), "{err}");
    assert_eq!(
        last_line(&err),
        "cairn: export disk stopped (SIGTERM); overlay flushed"
    );
    for gone in [
        served.socket.clone(),
        run.join("disk.ctl"),
        run.join("disk.json"),
    ] {
        assert!(!gone.exists(), "{} left behind", gone.display());
    }
    // Every write is there after a restart.
    let mut again = start_writable(&repo, "vm", dir.path(), "w2");
    let copy = dir.path().join("copy.raw");
    nbdcopy(again.uri(), &copy);
    same_file(&copy, &want, "writes after SIGTERM and restart");
    // SIGINT (^C) too; a read-only export has no overlay to flush.
    let (status, err) = again.signal("INT");
    assert_eq!(status.code(), Some(0), "{err}");
    assert_eq!(
        last_line(&err),
        "cairn: export disk stopped (SIGINT); overlay flushed"
    );
    let mut ro = Served::start(&repo, "vm@1", dir.path(), "r");
    let (status, err) = ro.signal("INT");
    assert_eq!(status.code(), Some(0), "{err}");
    assert_eq!(last_line(&err), "cairn: export disk stopped (SIGINT)");
}

#[test]
fn exports_lists_running_exports_and_stops_one() {
    let (dir, repo, _, _) = setup();
    let d = dir.path();
    let repo_s = repo.to_str().unwrap();
    assert_eq!(stdout(&cairn_in(d, &["exports"])), "no running exports\n");

    let mut w = start_writable(&repo, "vm", d, "w");
    let mut r = Served::spawn(&repo, d, "r", &["other", "--name", "ro"]);
    qemu_io(&w.uri(), &["write -P 0x11 0 20000", "flush"]);
    let (vm1, other1) = (short_id(&repo, "vm@1"), short_id(&repo, "other@1"));
    let overlay = d.join("overlay");
    let text = stdout(&cairn_in(d, &["exports"]));
    assert_eq!(
        text,
        format!(
            "disk  vm@1 ({vm1}), pid {}, nbd+unix:///disk?socket={}, overlay {} (20.0 KiB held)\n\
             ro  other@1 ({other1}), pid {}, nbd+unix:///ro?socket={}, read-only\n",
            w.pid(),
            w.socket.display(),
            overlay.display(),
            r.pid(),
            r.socket.display(),
        )
    );
    let json: Value = serde_json::from_str(&stdout(&cairn_in(d, &["--json", "exports"]))).unwrap();
    let list = json.as_array().unwrap();
    assert_eq!(list.len(), 2, "{json}");
    assert_eq!(list[0]["name"], "disk");
    assert_eq!(list[0]["version"], "vm@1");
    assert_eq!(list[0]["pid"], w.pid());
    assert_eq!(list[0]["socket"], w.socket.display().to_string());
    assert_eq!(list[0]["writable"], true);
    assert_eq!(list[0]["overlay"]["dir"], overlay.display().to_string());
    assert_eq!(list[0]["overlay"]["held_bytes"], 20480);
    assert_eq!(list[1]["name"], "ro");
    assert_eq!(list[1]["overlay"], Value::Null);

    // An export killed with SIGKILL leaves its files behind: they are cleaned, not listed.
    r.child.kill().unwrap();
    r.child.wait().unwrap();
    assert!(d.join("run/ro.json").exists());
    let text = stdout(&cairn_in(d, &["exports"]));
    assert!(text.starts_with("disk  vm@1"), "{text}");
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(!d.join("run/ro.json").exists());
    assert!(!d.join("run/ro.ctl").exists());
    assert!(!r.socket.exists());

    // A restore onto what the running export serves from (its overlay, its socket) is
    // refused, even with --force, and changes nothing.
    let data = overlay.join("data");
    let inside = if data.exists() {
        data.clone()
    } else {
        overlay.join("new.raw")
    };
    let before = std::fs::read(&inside).ok();
    for target in [inside.clone(), w.socket.clone()] {
        let out = cairn_in(
            d,
            &[
                "--repo",
                repo_s,
                "restore",
                "vm",
                target.to_str().unwrap(),
                "--force",
            ],
        );
        assert_eq!(out.status.code(), Some(1));
        assert_eq!(
            common::stderr_line(&out),
            format!(
                "cairn: error: will not restore to {}: it belongs to the running export disk \
                 (pid {}); stop it first with `cairn exports stop disk`",
                target.display(),
                w.pid()
            )
        );
    }
    assert_eq!(std::fs::read(&inside).ok(), before);

    // Stop: the export flushes, cleans up and exits 0; then it is gone.
    let out = cairn_in(d, &["--repo", repo_s, "exports", "stop", "disk"]);
    assert_eq!(
        stdout(&out),
        format!("stopped export disk (pid {})\n", w.pid())
    );
    let (status, err) = w.wait();
    assert_eq!(status.code(), Some(0), "{err}");
    assert_eq!(
        last_line(&err),
        "cairn: export disk stopped (SIGTERM); overlay flushed"
    );
    assert_eq!(stdout(&cairn_in(d, &["exports"])), "no running exports\n");
    assert_eq!(stdout(&cairn_in(d, &["--json", "exports"])), "[]\n");
    let out = cairn_in(d, &["exports", "stop", "disk"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        common::stderr_line(&out),
        format!(
            "cairn: error: no running export named \"disk\" (run directory {})",
            d.join("run").display()
        )
    );
}

/// A writable export of vm whose first 16 KiB were written and committed into the image
/// `branch` (through the control socket).
fn written_and_committed_into_branch(repo: &Path, d: &Path) -> Served {
    let w = start_writable(repo, "vm", d, "w");
    qemu_io(&w.uri(), &["write -P 0x22 0 16384", "flush"]);
    let out = cairn_ctl(
        repo,
        d,
        &["-q", "commit", "branch", "--from-export", "disk"],
    );
    assert!(out.status.success(), "{out:?}");
    w
}

#[test]
fn an_export_restarts_after_a_commit_into_another_image() {
    let (dir, repo, a, _) = setup();
    let d = dir.path();
    let mut w = written_and_committed_into_branch(&repo, d);
    let (status, err) = w.signal("TERM");
    assert_eq!(status.code(), Some(0), "{err}");
    // The overlay holds nothing since the commit: the export starts again on vm (its newest
    // version, where the overlay no longer is).
    let w = start_writable(&repo, "vm", d, "w2");
    assert_eq!(w.ready["version"], "vm@1");
    let copy = d.join("copy.raw");
    nbdcopy(w.uri(), &copy);
    same_file(&copy, &a, "vm@1 after the restart");
}

#[test]
fn an_overlay_on_another_base_says_what_to_do() {
    let (dir, repo, _, _) = setup();
    let d = dir.path();
    let overlay = d.join("overlay");
    let mut w = written_and_committed_into_branch(&repo, d);
    // Writes after the commit sit on branch@1.
    qemu_io(&w.uri(), &["write -P 0x33 16384 16384", "flush"]);
    w.signal("TERM");
    let out = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--repo")
        .arg(&repo)
        .args(["export", "vm", "--name", "disk", "--writable", "--overlay"])
        .arg(&overlay)
        .env("CAIRN_RUN_DIR", d.join("run"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let o = overlay.display();
    assert_eq!(
        common::stderr_line(&out),
        format!(
            "cairn: error: overlay {o} holds 16.0 KiB of writes made over branch@1 ({}), not \
             over vm@1 ({}): continue with `cairn export branch@1 --writable --name disk \
             --overlay {o}`, commit them while that runs with `cairn commit IMAGE --from-export \
             disk`, or discard them with `cairn overlay discard {o} --yes`",
            short_id(&repo, "branch@1"),
            short_id(&repo, "vm@1"),
        )
    );
    // The first way out works.
    let w = start_writable(&repo, "branch@1", d, "w3");
    qemu_io(
        &w.uri(),
        &["read -P 0x22 0 16384", "read -P 0x33 16384 16384"],
    );
    drop(w);
    // And so does the last.
    let out = cairn_in(
        d,
        &["overlay", "discard", overlay.to_str().unwrap(), "--yes"],
    );
    assert_eq!(
        stdout(&out),
        format!("discarded overlay {o} (16.0 KiB of writes)\n")
    );
    assert!(!overlay.exists());
    start_writable(&repo, "vm", d, "w4");
}

#[test]
fn overlays_are_listed_and_discarded_without_a_running_export() {
    let (dir, repo, _, _) = setup();
    let d = dir.path();
    let repo_s = repo.to_str().unwrap();
    let root = d.join("state/cairn/overlays");
    assert_eq!(
        stdout(&cairn_in(d, &["--repo", repo_s, "overlay", "list"])),
        format!("no overlays in {}\n", root.display())
    );
    let state = d.join("state");
    let mut w = Served::spawn_env(
        &repo,
        d,
        "w",
        &["vm", "--name", "web/disk", "--writable"],
        &[("XDG_STATE_HOME", state.as_os_str())],
    );
    let uri = format!("nbd+unix:///web/disk?socket={}", w.socket.display());
    qemu_io(&uri, &["write -P 0x11 0 16384", "flush"]);
    let ok = |args: &[&str]| stdout(&cairn_in(d, args));
    ok(&["overlay", "snapshot", "web/disk", "s1"]);
    qemu_io(&uri, &["write -P 0x12 65536 16384", "flush"]);
    // The existing form still lists a running export's snapshots.
    assert_eq!(
        ok(&["overlay", "list", "web/disk"]),
        "web/disk: snapshots s1\n"
    );
    let vm1 = short_id(&repo, "vm@1");
    let dirpath = root.join("web%2Fdisk");
    assert_eq!(
        ok(&["--repo", repo_s, "overlay", "list"]),
        format!(
            "web/disk  base vm@1 ({vm1}), 32.0 KiB held in 8 blocks, snapshots s1, in use by \
             export \"web/disk\" (pid {})\n",
            w.pid()
        )
    );
    // Held by a running export: refused, even with --yes.
    let out = cairn_in(d, &["overlay", "discard", "web/disk", "--yes"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        common::stderr_line(&out),
        format!(
            "cairn: error: overlay {} is in use by export \"web/disk\" (pid {}); stop it first \
             with `cairn exports stop web/disk`",
            dirpath.display(),
            w.pid()
        )
    );
    ok(&["exports", "stop", "web/disk"]);
    w.wait();
    let json: Value =
        serde_json::from_str(&ok(&["--json", "--repo", repo_s, "overlay", "list"])).unwrap();
    assert_eq!(
        json,
        serde_json::json!([{
            "name": "web/disk",
            "dir": dirpath.display().to_string(),
            "base": full_id(&repo, "vm@1"),
            "base_version": "vm@1",
            "held_bytes": 32768,
            "blocks_held": 8,
            "snapshots": ["s1"],
            "export": null,
        }])
    );
    assert_eq!(
        ok(&["overlay", "list"]),
        format!("web/disk  base {vm1}, 32.0 KiB held in 8 blocks, snapshots s1, not in use\n")
    );
    // Destructive: only with --yes.
    let out = cairn_in(d, &["overlay", "discard", "web/disk"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        common::stderr_line(&out),
        format!(
            "cairn: error: discarding overlay web/disk deletes {} and its 32.0 KiB of writes \
             that were never committed; run again with --yes to do it",
            dirpath.display()
        )
    );
    assert!(dirpath.join("meta.json").exists());
    assert_eq!(
        ok(&["overlay", "discard", "web/disk", "--yes"]),
        "discarded overlay web/disk (32.0 KiB of writes)\n"
    );
    assert!(!dirpath.exists());
    let out = cairn_in(d, &["overlay", "discard", "web/disk", "--yes"]);
    assert_eq!(
        common::stderr_line(&out),
        format!(
            "cairn: error: no overlay named web/disk in {}",
            root.display()
        )
    );
}

#[test]
fn the_run_directory_must_be_private() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let (dir, repo, _, _) = setup();
    let d = dir.path();
    let tmp = d.join("tmp");
    std::fs::create_dir(&tmp).unwrap();
    let uid = std::fs::metadata(&tmp).unwrap().uid();
    let run = tmp.join(format!("cairn-{uid}"));
    let export = |extra: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_cairn"))
            .arg("--repo")
            .arg(&repo)
            .args(["export", "vm", "--cache-dir"])
            .arg(d.join("cache"))
            .args(extra)
            .env_remove("CAIRN_RUN_DIR")
            .env_remove("XDG_RUNTIME_DIR")
            .env("TMPDIR", &tmp)
            .output()
            .unwrap()
    };
    // Pre-created by someone else with a mode that lets others in: refused.
    std::fs::create_dir(&run).unwrap();
    std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = export(&[]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        common::stderr_line(&out),
        format!(
            "cairn: error: unsafe run directory {}: mode 0777 lets other users in; it must be \
             0700 and yours (uid {uid}): remove it or chmod 700 it",
            run.display()
        )
    );
    // An explicit --socket still needs the control socket's directory.
    let sock = d.join("x.sock");
    let out = export(&["--socket", sock.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(1));
    assert!(!sock.exists());
    // A symbolic link (to a directory of ours) is refused too.
    std::fs::remove_dir(&run).unwrap();
    let elsewhere = d.join("elsewhere");
    std::fs::create_dir(&elsewhere).unwrap();
    std::fs::set_permissions(&elsewhere, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::symlink(&elsewhere, &run).unwrap();
    let out = export(&[]);
    assert_eq!(
        common::stderr_line(&out),
        format!(
            "cairn: error: unsafe run directory {}: it is a symbolic link; remove it",
            run.display()
        )
    );
    // Owned by another user (needs root to arrange).
    std::fs::remove_file(&run).unwrap();
    if uid == 0 {
        std::fs::create_dir(&run).unwrap();
        std::fs::set_permissions(&run, std::fs::Permissions::from_mode(0o700)).unwrap();
        std::os::unix::fs::chown(&run, Some(65534), Some(65534)).unwrap();
        let out = export(&[]);
        assert_eq!(
            common::stderr_line(&out),
            format!(
                "cairn: error: unsafe run directory {}: owned by uid 65534, not by you (uid \
                 0); remove it",
                run.display()
            )
        );
        std::fs::remove_dir(&run).unwrap();
    }
    // Missing: created 0700, and the socket goes there (never to a shared $TMPDIR/cairn).
    let mut child = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--repo")
        .arg(&repo)
        .args(["--json", "export", "vm", "--cache-dir"])
        .arg(d.join("cache"))
        .env_remove("CAIRN_RUN_DIR")
        .env_remove("XDG_RUNTIME_DIR")
        .env("TMPDIR", &tmp)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let ready: Value = serde_json::from_str(&line).unwrap();
    assert_eq!(
        ready["socket"],
        run.join("vm.sock").display().to_string(),
        "{ready}"
    );
    let m = std::fs::metadata(&run).unwrap();
    assert_eq!(m.mode() & 0o777, 0o700);
    assert!(!tmp.join("cairn").exists());
}

#[test]
fn a_writable_export_on_a_public_address_needs_tls_or_insecure() {
    let (dir, repo, _, _) = setup();
    let d = dir.path();
    let out = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--repo")
        .arg(&repo)
        .args(["export", "vm", "--writable", "--overlay"])
        .arg(d.join("overlay"))
        .args(["--listen", "0.0.0.0:0"])
        .env("CAIRN_RUN_DIR", d.join("run"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        common::stderr_line(&out),
        "cairn: error: refusing a writable export on 0.0.0.0:0 without TLS client \
         certificates: anyone who can reach that address can connect and overwrite the disk; \
         serve on a Unix socket (--socket PATH, private to you), require client certificates \
         (--tls-dir DIR with ca-cert.pem, or --tls-cert FILE --tls-key FILE --tls-ca FILE), or \
         pass --insecure"
    );
    let overlay = d.join("overlay");
    let o = overlay.to_str().unwrap();
    let mut insecure = Served::spawn(
        &repo,
        d,
        "i",
        &[
            "vm",
            "--writable",
            "--overlay",
            o,
            "--listen",
            "0.0.0.0:0",
            "--insecure",
        ],
    );
    assert_eq!(insecure.ready["writable"], true);
    insecure.signal("TERM");
    // Loopback too: every local user could connect.
    let out = Command::new(env!("CARGO_BIN_EXE_cairn"))
        .arg("--repo")
        .arg(&repo)
        .args(["export", "vm", "--writable", "--overlay", o])
        .args(["--listen", "127.0.0.1:0"])
        .env("CAIRN_RUN_DIR", d.join("run"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        common::stderr_line(&out).contains("every local user can connect to a loopback address"),
        "{out:?}"
    );
}

#[test]
fn readiness_and_stopping_are_notified_to_systemd() {
    let (dir, repo, _, _) = setup();
    let d = dir.path();
    let path = d.join("notify.sock");
    let notify = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
    // Only a safety net against a hang: the messages come at once.
    notify
        .set_read_timeout(Some(Duration::from_secs(60)))
        .unwrap();
    let mut served = Served::spawn_env(
        &repo,
        d,
        "n",
        &["vm@1", "--name", "disk"],
        &[("NOTIFY_SOCKET", path.as_os_str())],
    );
    let mut buf = [0u8; 4096];
    let n = notify.recv(&mut buf).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&buf[..n]),
        format!(
            "READY=1\nSTATUS=serving disk (vm@1) at nbd+unix:///disk?socket={}",
            served.socket.display()
        )
    );
    let (status, _) = served.signal("TERM");
    assert_eq!(status.code(), Some(0));
    let n = notify.recv(&mut buf).unwrap();
    assert_eq!(
        String::from_utf8_lossy(&buf[..n]),
        "STOPPING=1\nSTATUS=stopping (SIGTERM)"
    );
}

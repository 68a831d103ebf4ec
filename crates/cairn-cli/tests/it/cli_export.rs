//! `cairn export`: a version served over NBD to real clients (qemu-img, nbdcopy, nbdinfo),
//! the shared chunk cache, writable overlays and COMMIT, and failure when the repository goes
//! away.

use crate::common::cairn;
use crate::common::export::*;

use serde_json::Value;

/// qemu-img and then nbdcopy read the whole export: both bit-exact to `want`.
fn clients_read(served: &Served, dir: &std::path::Path, want: &std::path::Path) {
    let out = dir.join("convert.raw");
    qemu_img_convert(served.uri(), &out);
    same_file(&out, want, "qemu-img convert");
    let copy = dir.join("copy.raw");
    nbdcopy(served.uri(), &copy);
    same_file(&copy, want, "nbdcopy");
}

/// `nbdinfo --map` of `uri`: its text and its rows split into fields.
fn map_rows(uri: &str) -> (String, Vec<Vec<String>>) {
    let map = tool("nbdinfo", "libnbd-bin")
        .args(["--map", uri])
        .output()
        .unwrap();
    let map = String::from_utf8(map.stdout).unwrap();
    let rows = map
        .lines()
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect();
    (map, rows)
}

#[test]
fn real_clients_read_a_version_bit_exact_and_skip_its_holes() {
    let (dir, repo, a, _) = setup();
    let mut served = Served::start(&repo, "vm@1", dir.path(), "a");
    clients_read(&served, dir.path(), &a);

    // The map shows the zero run as a hole, exactly where it is.
    let (map, rows) = map_rows(&served.uri());
    assert_eq!(rows.len(), 3, "{map}");
    assert_eq!(rows[0][..3], ["0", "3145728", "0"], "{map}");
    assert_eq!(rows[1][..3], ["3145728", "2097152", "3"], "{map}");
    assert_eq!(rows[2][..3], ["5242880", "1060864", "0"], "{map}");

    // The data was fetched once (the second client read from the cache), zeros never.
    let s = served.stats();
    let data_bytes = 3 * 1048576 + 1048576 + 12288;
    assert_eq!(s["fetched_bytes"].as_u64().unwrap(), data_bytes, "{s}");
    assert!(s["cache_hits"].as_u64().unwrap() > 0, "{s}");
    assert_eq!(s["fetch_errors"], 0);

    // Writes to a read-only export are refused.
    let w = tool("qemu-io", "qemu-utils")
        .args(["-f", "raw", "-c", "write -P 0xab 0 4096", &served.uri()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&w.stdout).to_string() + &String::from_utf8_lossy(&w.stderr);
    assert!(!text.contains("wrote 4096"), "{text}");
}

/// Format 2: the same clients, the same bytes and holes; each group fetched once (its plain
/// bytes counted), and a second export of an image sharing data fetches only its own groups.
#[test]
fn a_format_2_version_is_served_bit_exact_and_shares_the_cache() {
    let (dir, repo, a, b) = setup();
    let mut served = Served::start(&repo, "vm@1", dir.path(), "a");
    clients_read(&served, dir.path(), &a);
    let (map, rows) = map_rows(&served.uri());
    assert_eq!(rows.len(), 3, "{map}");
    assert_eq!(rows[1][..3], ["3145728", "2097152", "3"], "{map}");
    let s = served.stats();
    let data_bytes = 3 * 1048576 + 1048576 + 12288;
    assert_eq!(s["fetched_bytes"].as_u64().unwrap(), data_bytes, "{s}");
    assert_eq!(s["fetch_errors"], 0, "{s}");
    drop(served);

    let mut served = Served::start(&repo, "other", dir.path(), "b");
    let out = dir.path().join("b-out.raw");
    qemu_img_convert(served.uri(), &out);
    same_file(&out, &b, "second export");
    let s = served.stats();
    assert_eq!(s["fetched_bytes"].as_u64().unwrap(), 1 << 20, "{s}");
    assert_eq!(s["cache_hits"].as_u64().unwrap(), 3 * 256, "{s}");
}

#[test]
fn a_second_export_fetches_only_what_the_cache_lacks() {
    let (dir, repo, _, b) = setup();
    {
        // Stopped as an operator stops it: what it fetched is then in the cache (a kill -9
        // may lose the chunks its cache's thread had not written yet).
        let mut served = Served::start(&repo, "vm", dir.path(), "a");
        qemu_img_convert(served.uri(), &dir.path().join("a-out.raw"));
        let (status, err) = served.signal("TERM");
        assert!(status.success(), "{err}");
    }
    // Another image sharing its first 3 MiB: only its own last MiB comes from the repository.
    let mut served = Served::start(&repo, "other", dir.path(), "b");
    let out = dir.path().join("b-out.raw");
    qemu_img_convert(served.uri(), &out);
    same_file(&out, &b, "second export");
    let s = served.stats();
    assert_eq!(s["fetched_bytes"].as_u64().unwrap(), 1 << 20, "{s}");
    assert_eq!(s["cache_hits"].as_u64().unwrap(), 3 * 256, "{s}"); // 4 KiB chunks
}

/// Two exports on one host share its cache and fetch each group once between them: a fetch
/// in one process makes the other's read of the same group wait and then hit the cache.
#[test]
fn two_exports_reading_at_once_fetch_each_group_once_between_them() {
    let (dir, repo, a, _) = setup();
    let mut one = Served::start(&repo, "vm", dir.path(), "one");
    // Its own run directory (the export name is taken in the first's), the same cache.
    let run = dir.path().join("run-two");
    let env = [("CAIRN_RUN_DIR", run.as_os_str())];
    let mut two = Served::spawn_env(&repo, dir.path(), "two", &["vm", "--name", "disk"], &env);
    let readers: Vec<_> = [(one.uri(), "one-out.raw"), (two.uri(), "two-out.raw")]
        .into_iter()
        .map(|(uri, name)| {
            let out = dir.path().join(name);
            std::thread::spawn(move || {
                qemu_img_convert(uri, &out);
                out
            })
        })
        .collect();
    for r in readers {
        same_file(&r.join().unwrap(), &a, "export sharing the cache");
    }
    let (s1, s2) = (one.stats(), two.stats());
    let fetched = s1["fetched_bytes"].as_u64().unwrap() + s2["fetched_bytes"].as_u64().unwrap();
    let data_bytes = 3 * 1048576 + 1048576 + 12288;
    assert_eq!(fetched, data_bytes, "{s1}\n{s2}");
}

#[test]
fn reads_fail_with_an_error_when_the_repository_is_gone() {
    let (dir, repo, _, _) = setup();
    let served = Served::start(&repo, "vm", dir.path(), "a");
    std::fs::rename(repo.join("packs"), dir.path().join("packs-away")).unwrap();
    let out = tool("qemu-io", "qemu-utils")
        .args(["-r", "-f", "raw", "-c", "read -P 0 0 65536", &served.uri()])
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(text.contains("Input/output error"), "{text}");
    // Zeros need no repository.
    let out = tool("qemu-io", "qemu-utils")
        .args([
            "-r",
            "-f",
            "raw",
            "-c",
            "read -P 0 3145728 65536",
            &served.uri(),
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(text.contains("read 65536/65536 bytes"), "{text}");
}

/// The overlay's blocks are 4 KiB (the chunk size); COMMIT writes a patch on group runs.
#[test]
fn writes_go_to_the_overlay_and_commit_back_as_a_new_version() {
    writes_commit_back(18); // 8 + 4 + 4 + 2 blocks of 4 KiB
}

fn writes_commit_back(blocks_held: u64) {
    let (dir, repo, a, _) = setup();
    let served = start_writable(&repo, "vm", dir.path(), "w");
    let uri = served.uri();
    // A partial-block write across two blocks, a full block, zeros over data, and data in the
    // zero run.
    qemu_io(
        &uri,
        &[
            "write -P 0xab 10000 30000",
            "write -P 0xcd 65536 16384",
            "write -z 131072 16384",
            "write -P 0xef 4194304 8192",
            "flush",
        ],
    );
    let mut want = std::fs::read(&a).unwrap();
    want[10000..40000].fill(0xab);
    want[65536..81920].fill(0xcd);
    want[131072..147456].fill(0);
    want[4194304..4202496].fill(0xef);
    qemu_io(
        &uri,
        &["read -P 0xab 10000 30000", "read -P 0xef 4194304 8192"],
    );
    let copy = dir.path().join("live.raw");
    nbdcopy(&uri, &copy);
    same_file_bytes(&copy, &want, "export with overlay");

    let status = cairn_ctl(&repo, dir.path(), &["--json", "status", "disk"]);
    let status: Value = serde_json::from_slice(&status.stdout).unwrap();
    assert_eq!(status["overlay"]["blocks_held"], blocks_held, "{status}");

    // COMMIT: a new version of vm holding exactly what the export showed.
    let out = cairn_ctl(
        &repo,
        dir.path(),
        &[
            "--json",
            "commit",
            "vm",
            "--from-export",
            "disk",
            "-m",
            "from qemu",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["image"].as_str(), v["seq"].as_u64()),
        (Some("vm"), Some(2)),
        "{v}"
    );
    // The zeroed blocks are a hole; equal blocks are one chunk (in both formats: 5).
    assert_eq!(v["new_chunks"], 5, "{v}");
    let restored = dir.path().join("v2.raw");
    assert!(cairn(
        &repo,
        &[
            "-q",
            "restore",
            "vm@2",
            restored.to_str().unwrap(),
            "--force"
        ]
    )
    .status
    .success());
    same_file_bytes(&restored, &want, "committed version");

    // The export goes on with the new version and an empty overlay.
    let status: Value =
        serde_json::from_slice(&cairn_ctl(&repo, dir.path(), &["--json", "status", "disk"]).stdout)
            .unwrap();
    assert_eq!(
        (
            status["seq"].as_u64(),
            status["overlay"]["blocks_held"].as_u64()
        ),
        (Some(2), Some(0)),
        "{status}"
    );
    qemu_io(&uri, &["read -P 0xcd 65536 16384"]);

    // Writes committed into a new image start its history at the export's version.
    qemu_io(&uri, &["write -P 0x11 0 4096", "flush"]);
    let out = cairn_ctl(
        &repo,
        dir.path(),
        &["-q", "commit", "branch", "--from-export", "disk"],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let log = String::from_utf8(cairn(&repo, &["log", "branch"]).stdout).unwrap();
    assert!(log.starts_with("branch@1 "), "{log}");
    assert!(log.contains("\ncloned from vm@2 ("), "{log}");
}

#[test]
fn overlay_snapshots_roll_back_and_flushed_writes_survive_kill_9() {
    let (dir, repo, _, _) = setup();
    let mut served = start_writable(&repo, "vm", dir.path(), "w");
    let uri = served.uri();
    qemu_io(&uri, &["write -P 0x11 0 16384", "flush"]);
    let run = |args: &[&str]| {
        let out = cairn_ctl(&repo, dir.path(), args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        (
            String::from_utf8_lossy(&out.stdout).to_string(),
            String::from_utf8_lossy(&out.stderr).to_string(),
        )
    };
    let ok = |args: &[&str]| run(args).0;
    // Each action says what it did.
    assert_eq!(
        ok(&["overlay", "snapshot", "disk", "s1"]),
        "disk: took snapshot s1; snapshots s1\n"
    );
    qemu_io(
        &uri,
        &[
            "write -P 0x22 0 16384",
            "write -P 0x33 16384 16384",
            "flush",
        ],
    );
    assert_eq!(ok(&["overlay", "list", "disk"]), "disk: snapshots s1\n");
    let (out, err) = run(&["overlay", "rollback", "disk", "s1"]);
    assert_eq!(
        out,
        "disk: rolled back to snapshot s1: the writes since are gone; snapshots s1\n"
    );
    assert_eq!(err, "", "no client was connected");
    qemu_io(&uri, &["read -P 0x11 0 16384"]);

    // A rollback under a connected client warns: the guest does not know.
    let mut client = std::process::Command::new("qemu-io")
        .args(["-f", "raw", &uri])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("qemu-io");
    let clients = || {
        let status: Value = serde_json::from_slice(
            &cairn_ctl(&repo, dir.path(), &["--json", "status", "disk"]).stdout,
        )
        .unwrap();
        status["stats"]["clients"].as_u64().unwrap()
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while clients() == 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "qemu-io never attached"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // Refused while it is connected, in one line naming the export; --force rolls back and
    // warns: the guest does not know.
    let out = cairn_ctl(&repo, dir.path(), &["overlay", "rollback", "disk", "s1"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr),
        "cairn: error: disk: 1 NBD client is connected, and a running guest would not know its \
         disk was rolled back under it: shut the guest down first, or pass --force (then \
         restart it before it writes more)\n"
    );
    let (_, err) = run(&["overlay", "rollback", "disk", "s1", "--force"]);
    assert_eq!(
        err,
        "warning: disk has 1 NBD client connected: a running guest does not know its disk was \
         rolled back; restart it (or detach and attach the disk) before it writes more\n"
    );
    drop(client.stdin.take()); // qemu-io quits at the end of its input
    client.wait().unwrap();
    while clients() > 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "the client never left"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    ok(&["overlay", "snapshot", "disk", "s2"]);
    qemu_io(&uri, &["write -P 0x44 32768 16384", "flush"]);
    ok(&["overlay", "delete", "disk", "s1"]);
    qemu_io(&uri, &["read -P 0x11 0 16384", "read -P 0x44 32768 16384"]);

    // Snapshots form a tree: rolling back to s2 keeps s3 as a branch to return to.
    qemu_io(&uri, &["write -P 0x55 49152 4096", "flush"]);
    ok(&["overlay", "snapshot", "disk", "s3"]);
    assert_eq!(
        ok(&["overlay", "rollback", "disk", "s2"]),
        "disk: rolled back to snapshot s2: the writes since are gone; snapshots s2, s3 (on s2); \
         the disk is at s2 and later writes\n"
    );
    qemu_io(&uri, &["write -P 0x66 49152 4096", "flush"]);
    let list: Value = serde_json::from_str(&ok(&["--json", "overlay", "list", "disk"])).unwrap();
    assert_eq!(
        list["tree"],
        serde_json::json!([
            {"name": "s2", "parent": null, "current_path": true, "blocks": 4},
            {"name": "s3", "parent": "s2", "current_path": false, "blocks": 5},
        ]),
        "{list}"
    );
    ok(&["overlay", "rollback", "disk", "s3"]);
    qemu_io(
        &uri,
        &["read -P 0x55 49152 4096", "read -P 0x44 32768 16384"],
    );

    // kill -9, then a new export on the same version reopens the overlay with its writes.
    served.child.kill().unwrap();
    served.child.wait().unwrap();
    let served = start_writable(&repo, "vm", dir.path(), "w2");
    qemu_io(
        &served.uri(),
        &["read -P 0x11 0 16384", "read -P 0x44 32768 16384"],
    );
    let status: Value =
        serde_json::from_slice(&cairn_ctl(&repo, dir.path(), &["--json", "status", "disk"]).stdout)
            .unwrap();
    assert_eq!(
        status["overlay"]["snapshots"],
        serde_json::json!(["s2", "s3"]),
        "{status}"
    );
}

#[test]
fn copy_on_read_moves_deep_blocks_into_the_current_layer() {
    let (dir, repo, _, _) = setup();
    let overlay = dir.path().join("cod-overlay");
    let served = Served::spawn(
        &repo,
        dir.path(),
        "cod",
        &[
            "vm",
            "--name",
            "disk",
            "--writable",
            "--overlay",
            overlay.to_str().unwrap(),
            "--copy-on-read",
            "2",
        ],
    );
    let uri = served.uri();
    qemu_io(&uri, &["write -P 0x11 0 4096", "flush"]);
    for snap in ["s1", "s2"] {
        let out = cairn_ctl(
            &repo,
            dir.path(),
            &["-q", "overlay", "snapshot", "disk", snap],
        );
        assert!(out.status.success());
    }
    let copied = || {
        let status: Value = serde_json::from_slice(
            &cairn_ctl(&repo, dir.path(), &["--json", "status", "disk"]).stdout,
        )
        .unwrap();
        status["overlay"]["copied_on_read"].as_u64().unwrap()
    };
    assert_eq!(copied(), 0);
    // Held two snapshots down: copied up on the first read, not again.
    qemu_io(&uri, &["read -P 0x11 0 4096", "read -P 0x11 0 4096"]);
    assert_eq!(copied(), 1);
}

#[test]
fn one_process_serves_several_exports_sharing_one_cache() {
    let (dir, repo, a, b) = setup();
    let served = Served::spawn(&repo, dir.path(), "multi", &["vm@1=first", "other=second"]);
    let socket = served.socket.clone();
    let list = tool("nbdinfo", "libnbd-bin")
        .args([
            "--list",
            "--json",
            &format!("nbd+unix:///?socket={}", socket.display()),
        ])
        .output()
        .unwrap();
    let list: Value = serde_json::from_slice(&list.stdout).unwrap();
    let mut names: Vec<&str> = list["exports"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["export-name"].as_str().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["first", "second"], "{list}");
    for (name, want) in [("first", &a), ("second", &b)] {
        let out = dir.path().join(format!("{name}.raw"));
        qemu_img_convert(
            format!("nbd+unix:///{name}?socket={}", socket.display()),
            &out,
        );
        same_file(&out, want, name);
    }
    let status = cairn_ctl(&repo, dir.path(), &["--json", "status", "second"]);
    let status: Value = serde_json::from_slice(&status.stdout).unwrap();
    // The second image shares its first 3 MiB with the first: served from the cache.
    assert_eq!(status["stats"]["fetched_bytes"], 1 << 20, "{status}");
    drop(served);
}

/// `nbdinfo [ cairn export … ]` starts the export itself (socket activation) and talks to it.
#[test]
fn a_client_can_start_the_export_itself() {
    let (dir, repo, a, _) = setup();
    let out = tool("nbdinfo", "libnbd-bin")
        .args(["--size", "--", "["])
        .arg(env!("CARGO_BIN_EXE_cairn"))
        .arg("--repo")
        .arg(&repo)
        .args(["-q", "export", "vm", "--cache-dir"])
        .arg(dir.path().join("cache"))
        .arg("]")
        .env("CAIRN_RUN_DIR", dir.path().join("run"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let size = std::fs::metadata(&a).unwrap().len();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        size.to_string()
    );
}

/// A writable export of an older version: COMMIT into its image would make a newest version
/// without the changes since. Refused with what to do; --force rolls the image back on top
/// of its newest, so no version leaves the history; a new image takes a commit as it is.
#[test]
fn a_commit_from_an_export_of_an_older_version_is_refused_unless_forced() {
    let (dir, repo, a, b) = setup();
    // vm@2 holds b's bytes; the export serves vm@1.
    let out = cairn(&repo, &["-q", "commit", "vm", b.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    let served = start_writable(&repo, "vm@1", dir.path(), "w");
    qemu_io(&served.uri(), &["write -P 0x5a 0 4096", "flush"]);
    let mut want = std::fs::read(&a).unwrap();
    want[..4096].fill(0x5a);

    let commit = |image: &str, extra: &[&str]| {
        let mut args = vec!["--json", "commit", image, "--from-export", "disk"];
        args.extend(extra);
        cairn_ctl(&repo, dir.path(), &args)
    };
    let refused = commit("vm", &[]);
    assert_eq!(refused.status.code(), Some(1));
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        err.contains("the export serves vm@1, but the newest version of vm is @2")
            && err.contains("--force"),
        "{err}"
    );
    let log = |image: &str| -> Value {
        serde_json::from_slice(&cairn(&repo, &["--json", "log", image]).stdout).unwrap()
    };
    assert_eq!(
        log("vm").as_array().unwrap().len(),
        2,
        "nothing was published"
    );

    // Forced: vm@3 holds vm@1 plus the write, vm@2 stays in the history.
    let out = commit("vm", &["--force"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The export now serves vm@3; into a new image, its history starts there.
    qemu_io(&served.uri(), &["write -P 0x5a 0 4096", "flush"]);
    let out = commit("vm-branch", &[]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let history = log("vm");
    let seqs: Vec<u64> = history
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v["seq"].as_u64().unwrap())
        .collect();
    assert_eq!(seqs, [3, 2, 1]);
    assert!(
        history[0]["message"]
            .as_str()
            .unwrap()
            .contains("rolls back to vm@1 (the newest was @2)"),
        "{history}"
    );
    for image in ["vm", "vm-branch"] {
        let out_path = dir.path().join(format!("{image}.raw"));
        let out = cairn(&repo, &["-q", "restore", image, out_path.to_str().unwrap()]);
        assert!(out.status.success(), "{out:?}");
        same_file_bytes(&out_path, &want, image);
    }
}

//! `cairn init --format 2` end to end through the binary: commit in full and of a qcow2
//! overlay's changes, restore, verify, log, show, tag, clone, diff, repair, rm and gc.

use crate::common;
use crate::common::{cairn, noise, snapshot};

use std::path::Path;

/// The largest pack of local repository `repo`: its path and bytes.
fn largest_pack(repo: &Path) -> (String, Vec<u8>) {
    let packs = repo.join("packs");
    snapshot(repo)
        .into_iter()
        .filter(|(k, _)| k.starts_with(packs.to_str().unwrap()))
        .max_by_key(|(_, b)| b.len())
        .unwrap()
}

fn ok(repo: &Path, args: &[&str]) -> String {
    let out = cairn(repo, args);
    assert!(out.status.success(), "cairn {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn a_format_2_repository_commits_restores_diffs_and_collects() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    let init = ok(
        &repo,
        &["--json", "init", "--format", "2", "--reserve", "0"],
    );
    let v: serde_json::Value = serde_json::from_str(init.trim()).unwrap();
    assert_eq!(v["format"], 2);
    assert_eq!(v["chunk_size"], 4096);
    assert_eq!(v["group_size"], 65536);

    // A real qcow2 image made by qemu-img from raw data, and the raw data itself.
    let mut data = noise(3 << 20, 1);
    data.extend(vec![0u8; 1 << 20]);
    data.extend(b"format two\n".repeat(200_000));
    data.truncate(6 << 20);
    let raw = dir.path().join("disk.raw");
    std::fs::write(&raw, &data).unwrap();
    let qcow2 = dir.path().join("disk.qcow2");
    let st = std::process::Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "qcow2"])
        .arg(&raw)
        .arg(&qcow2)
        .status()
        .expect("qemu-img");
    assert!(st.success());

    let first = ok(&repo, &["--json", "commit", "vm", qcow2.to_str().unwrap()]);
    let first: serde_json::Value = serde_json::from_str(first.trim()).unwrap();
    assert_eq!(first["seq"], 1);
    let again = ok(&repo, &["--json", "commit", "vm", raw.to_str().unwrap()]);
    let again: serde_json::Value = serde_json::from_str(again.trim()).unwrap();
    assert_eq!(again["new_chunks"], 0, "{again}");
    ok(&repo, &["-q", "tag", "vm@1", "golden"]);
    ok(&repo, &["-q", "clone", "vm@golden", "web"]);
    let log = ok(&repo, &["log", "vm"]);
    assert_eq!(
        log.lines().filter(|l| l.contains("vm@")).count(),
        2,
        "{log}"
    );

    for spec in ["vm@1", "vm", "web"] {
        let out = dir.path().join(format!("{}.raw", spec.replace('@', "-")));
        ok(&repo, &["-q", "restore", spec, out.to_str().unwrap()]);
        assert!(
            std::fs::read(&out).unwrap() == data,
            "{spec} restores bit-exact"
        );
    }

    let report = ok(&repo, &["--json", "verify"]);
    let report: serde_json::Value = serde_json::from_str(report.trim()).unwrap();
    assert_eq!(report["clean"], true, "{report}");
    assert_eq!(report["versions_checked"], 3, "{report}");

    // The same bytes from qcow2 and raw: no difference; a repair of a clean repository
    // finds nothing lost and changes nothing.
    let diff = ok(&repo, &["--json", "diff", "vm@1", "vm@2"]);
    let diff: serde_json::Value = serde_json::from_str(diff.trim()).unwrap();
    assert_eq!(diff["changed_bytes"], 0, "{diff}");
    let before = snapshot(&repo);
    let repair = ok(&repo, &["--json", "repair"]);
    let repair: serde_json::Value = serde_json::from_str(repair.trim()).unwrap();
    assert_eq!(repair["blobs_lost"], 0, "{repair}");
    assert!(snapshot(&repo) == before, "a clean repair changes nothing");

    // A qcow2 overlay on the raw image, committed as its changed clusters on top of vm@1.
    let overlay = dir.path().join("overlay.qcow2");
    let st = std::process::Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-F", "raw", "-b"])
        .arg(&raw)
        .arg(&overlay)
        .status()
        .expect("qemu-img");
    assert!(st.success());
    let st = std::process::Command::new("qemu-io")
        .args(["-f", "qcow2", "-c", "write -P 0x5a 1048576 12288"])
        .stdout(std::process::Stdio::null())
        .arg(&overlay)
        .status()
        .expect("qemu-io");
    assert!(st.success());
    let v = ok(
        &repo,
        &[
            "--json",
            "commit",
            "patched",
            overlay.to_str().unwrap(),
            "--parent",
            "vm@1",
        ],
    );
    let v: serde_json::Value = serde_json::from_str(v.trim()).unwrap();
    assert_eq!(v["new_chunks"], 1, "{v}"); // three equal 4 KiB blocks
    let out = dir.path().join("patched.raw");
    ok(&repo, &["-q", "restore", "patched", out.to_str().unwrap()]);
    let mut want = data.clone();
    want[1 << 20..(1 << 20) + 12288].fill(0x5a);
    assert!(
        std::fs::read(&out).unwrap() == want,
        "patched restores bit-exact"
    );
    // An OUTPUT named .qcow2 is written as qcow2 without --format, and QEMU reads it back.
    let q = dir.path().join("patched.QCOW2");
    let v = ok(
        &repo,
        &["--json", "restore", "patched", q.to_str().unwrap()],
    );
    let v: serde_json::Value = serde_json::from_str(v.trim()).unwrap();
    assert_eq!(v["format"], "qcow2", "{v}");
    assert_eq!(&std::fs::read(&q).unwrap()[..4], b"QFI\xfb");
    let back = dir.path().join("patched-back.raw");
    let st = std::process::Command::new("qemu-img")
        .args(["convert", "-f", "qcow2", "-O", "raw"])
        .arg(&q)
        .arg(&back)
        .status()
        .expect("qemu-img");
    assert!(st.success());
    assert!(
        std::fs::read(&back).unwrap() == want,
        "qcow2 restores bit-exact"
    );
    // diff names exactly the three rewritten 4 KiB blocks.
    let diff = ok(&repo, &["--json", "diff", "vm@1", "patched"]);
    let diff: serde_json::Value = serde_json::from_str(diff.trim()).unwrap();
    assert_eq!(diff["changed_bytes"], 12288, "{diff}");
    assert_eq!(diff["ranges"][0]["offset"], 1 << 20, "{diff}");

    // rm marks the version deleted and gives back the space only it used: vm@2 shares
    // everything with vm@1; a version of new data gives back its packs.
    let out = ok(&repo, &["rm", "vm@2"]);
    assert!(out.contains("\nreclaimed "), "{out}");
    let scratch = dir.path().join("scratch.raw");
    std::fs::write(&scratch, noise(2 << 20, 99)).unwrap();
    ok(
        &repo,
        &["-q", "commit", "scratch", scratch.to_str().unwrap()],
    );
    let rm: serde_json::Value =
        serde_json::from_str(ok(&repo, &["--json", "rm", "scratch@1"]).trim()).unwrap();
    let reclaimed = rm["gc"]["reclaimed_bytes"].as_u64().unwrap();
    assert!(reclaimed >= 2 << 20, "{rm}");
    let gc: serde_json::Value = serde_json::from_str(ok(&repo, &["--json", "gc"]).trim()).unwrap();
    assert_eq!(gc["reclaimed_bytes"], 0, "{gc}");
    for spec in ["vm@1", "web"] {
        let out = dir.path().join("after-gc.raw");
        ok(
            &repo,
            &["-q", "restore", "--force", spec, out.to_str().unwrap()],
        );
        assert!(std::fs::read(&out).unwrap() == data, "{spec} after gc");
    }
    let log = ok(&repo, &["log", "vm"]);
    assert_eq!(
        log.lines().filter(|l| l.contains("vm@")).count(),
        1,
        "{log}"
    );

    // A flipped byte in the data pack: verify exits 3 and names the live versions using it.
    let (key, mut bytes) = largest_pack(&repo);
    bytes[100] ^= 1;
    std::fs::write(&key, bytes).unwrap();
    let out = cairn(&repo, &["--json", "verify"]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut damaged: Vec<String> = report["damaged_versions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| format!("{}@{}", d["image"].as_str().unwrap(), d["seq"]))
        .collect();
    damaged.sort();
    assert_eq!(damaged, ["patched@1", "vm@1", "web@1"], "{report}");
}

/// Issue 16's check: an ext4 image, a 32 MiB file copied inside it to a new place (the copy
/// lands 4 KiB off the original's 16 KiB phase, as in a real file system), both versions
/// committed: format 2 adds ≤ 2% of the file's size. A repository of 16 KiB chunks is
/// committed too, to show the copy really moved off its alignment (there it costs most of
/// the file).
#[test]
fn a_file_copied_inside_ext4_costs_format_2_almost_nothing() {
    use common::export::tool;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("file");
    std::fs::write(&file, noise(32 << 20, 7)).unwrap();
    let pad = dir.path().join("pad");
    std::fs::write(&pad, noise(4096, 8)).unwrap();
    let debugfs = |img: &Path, request: String| {
        let out = tool("debugfs", "e2fsprogs")
            .args(["-w", "-R", &request])
            .arg(img)
            .output()
            .unwrap();
        assert!(out.status.success(), "debugfs {request}: {out:?}");
    };
    let one = dir.path().join("one.raw");
    std::fs::File::create(&one)
        .unwrap()
        .set_len(128 << 20)
        .unwrap();
    let st = tool("mkfs.ext4", "e2fsprogs")
        .args(["-q", "-F", "-b", "4096"])
        .arg(&one)
        .status()
        .unwrap();
    assert!(st.success());
    debugfs(&one, format!("write {} /file", file.display()));
    let two = dir.path().join("two.raw");
    std::fs::copy(&one, &two).unwrap();
    debugfs(&two, format!("write {} /pad", pad.display()));
    debugfs(&two, format!("write {} /copy", file.display()));

    let added = |chunk: &str| {
        let repo = dir.path().join(format!("repo{chunk}"));
        ok(&repo, &["-q", "init", "--chunk-size", chunk]);
        ok(&repo, &["-q", "commit", "fs", one.to_str().unwrap()]);
        let out = ok(&repo, &["--json", "commit", "fs", two.to_str().unwrap()]);
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        v["new_chunk_bytes"].as_u64().unwrap()
    };
    let (f2, f1) = (added("4K"), added("16K"));
    let size = 32u64 << 20;
    assert!(
        f2 * 50 <= size,
        "format 2 added {f2} bytes for a copied file of {size}"
    );
    assert!(
        f1 * 2 >= size,
        "16 KiB chunks added only {f1} bytes: the copy did not move off the 16 KiB phase, so this \
         test shows nothing"
    );
}

/// `stats` on format 2 counts chunks and manifest nodes from the pack trailers.
#[test]
fn stats_counts_the_chunks_and_nodes_of_a_format_2_repository() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    ok(&repo, &["-q", "init", "--format", "2", "--reserve", "0"]);
    let image = dir.path().join("a.raw");
    std::fs::write(&image, noise(3_000_000, 5)).unwrap();
    ok(&repo, &["-q", "commit", "vm", image.to_str().unwrap()]);
    let s: serde_json::Value =
        serde_json::from_str(ok(&repo, &["--json", "stats"]).trim()).unwrap();
    // 733 chunks (the last one partial), 3 leaves (1 MiB segments) and a root.
    assert_eq!(s["blobs"], 733 + 4, "{s}");
    assert_eq!(s["tree_nodes"], 4, "{s}");
    assert!(s["tree_bytes"].as_u64().unwrap() > 0, "{s}");
}

#[test]
fn index_compact_merges_the_runs_of_many_commits_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    ok(&repo, &["-q", "init", "--reserve", "0"]);
    let mut data = noise(2 << 20, 3);
    let disk = dir.path().join("disk.raw");
    for i in 0..9u64 {
        let at = (i as usize % 8) * (256 << 10);
        data[at..at + 4096].copy_from_slice(&noise(4096, 10 + i));
        std::fs::write(&disk, &data).unwrap();
        let no_compact = ["-q", "commit", "--no-compact", "vm", disk.to_str().unwrap()];
        ok(&repo, &no_compact);
    }
    let runs = || std::fs::read_dir(repo.join("index-runs")).unwrap().count();
    assert_eq!(runs(), 9);

    let before = snapshot(&repo);
    let dry = ok(&repo, &["--json", "index", "compact", "--dry-run"]);
    let dry: serde_json::Value = serde_json::from_str(dry.trim()).unwrap();
    assert_eq!(
        (dry["merges"].as_u64(), dry["runs_after"].as_u64()),
        (Some(1), Some(1)),
        "{dry}"
    );
    assert!(snapshot(&repo) == before, "a dry run changes nothing");

    let line = ok(&repo, &["index", "compact"]);
    assert!(
        line.starts_with("merged 9 index runs into 1 (9 -> 1 runs, "),
        "{line}"
    );
    assert_eq!(runs(), 1);
    // One run left: nothing to merge, its size said as `cairn stats` says sizes.
    let run = std::fs::read_dir(repo.join("index-runs"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap();
    let kib = run.metadata().unwrap().len() as f64 / 1024.0;
    assert_eq!(
        ok(&repo, &["index", "compact", "--all"]).trim_end(),
        format!("nothing to merge: 1 index run ({kib:.1} KiB)")
    );
    ok(&repo, &["-q", "verify"]);
    let out = dir.path().join("out.raw");
    ok(&repo, &["-q", "restore", "vm", out.to_str().unwrap()]);
    assert!(std::fs::read(&out).unwrap() == data);
}

/// `CAIRN_DEDUP` sets the mode of a commit without `--dedup` (bounded when unset), a flag
/// overrides it, and a value that is not a mode is refused before anything runs.
#[test]
fn cairn_dedup_sets_the_default_mode() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    ok(&repo, &["-q", "init", "--reserve", "0"]);
    let first = noise(1 << 20, 21);
    let a = dir.path().join("a.raw");
    std::fs::write(&a, &first).unwrap();
    ok(&repo, &["-q", "commit", "a", a.to_str().unwrap()]);
    // A new image of new data but one block of `a`: the hooks (its smallest keys) are new
    // data, so only an index lookup of every chunk finds that block.
    let commit = |image: &str, seed: u64, dedup: Option<&str>, flag: &[&str]| {
        let mut data = noise(1 << 20, seed);
        data[100 * 4096..101 * 4096].copy_from_slice(&first[100 * 4096..101 * 4096]);
        let path = dir.path().join(format!("{image}.raw"));
        std::fs::write(&path, &data).unwrap();
        let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_cairn"));
        cmd.arg("--repo").arg(&repo).args(["--json", "commit"]);
        cmd.args(flag)
            .arg(image)
            .arg(&path)
            .env_remove("CAIRN_DEDUP");
        if let Some(mode) = dedup {
            cmd.env("CAIRN_DEDUP", mode);
        }
        cmd.output().unwrap()
    };
    let found = |out: std::process::Output| -> (u64, u64) {
        assert!(out.status.success(), "{out:?}");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        (
            v["new_chunks"].as_u64().unwrap(),
            v["index_chunks"].as_u64().unwrap(),
        )
    };
    assert_eq!(found(commit("unset", 22, None, &[])), (256, 0));
    assert_eq!(found(commit("exact", 23, Some("exact"), &[])), (255, 1));
    assert_eq!(found(commit("bounded", 24, Some("bounded"), &[])), (256, 0));
    let flag = commit("flag", 25, Some("exact"), &["--dedup", "bounded"]);
    assert_eq!(found(flag), (256, 0));
    let bad = commit("bad", 26, Some("sideways"), &[]);
    assert_eq!(bad.status.code(), Some(2), "{bad:?}");
    let e: serde_json::Value = serde_json::from_str(&common::stderr_line(&bad)).unwrap();
    assert_eq!(e["error"]["code"], "usage");
    assert_eq!(
        e["error"]["message"],
        "CAIRN_DEDUP=\"sideways\": expected exact or bounded"
    );
    // Nothing was committed by the refused command.
    assert!(!cairn(&repo, &["show", "bad"]).status.success());
}

#[test]
fn commit_dedup_modes_report_what_each_tier_found() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    ok(&repo, &["-q", "init", "--reserve", "0"]);
    // A golden image, and copies of it with its data moved by 5 blocks and one new block,
    // committed as images of their own: no parent, so only similar packs find the data.
    let golden = noise(4 << 20, 11);
    let g = dir.path().join("golden.raw");
    std::fs::write(&g, &golden).unwrap();
    ok(&repo, &["-q", "commit", "golden", g.to_str().unwrap()]);
    let copy = |seed| {
        let mut copy = vec![0u8; 5 * 4096];
        copy.extend_from_slice(&golden[..golden.len() - 6 * 4096]);
        copy.extend(noise(4096, seed));
        let path = dir.path().join(format!("copy-{seed}.raw"));
        std::fs::write(&path, &copy).unwrap();
        (copy, path)
    };
    let json = |args: &[&str]| -> serde_json::Value {
        serde_json::from_str(ok(&repo, args).trim()).unwrap()
    };
    let moved = (golden.len() / 4096 - 6) as u64;
    for (mode, seed) in [("bounded", 12), ("exact", 13)] {
        let (_, path) = copy(seed);
        let v = json(&[
            "--json",
            "commit",
            "--dedup",
            mode,
            mode,
            path.to_str().unwrap(),
        ]);
        assert_eq!(v["new_chunks"], 1, "{mode}: {v}");
        assert_eq!(v["similar_chunks"], moved, "{mode}: {v}");
        assert_eq!(v["parent_chunks"], 0, "{mode}: {v}");
        assert_eq!(v["index_chunks"], 0, "{mode}: {v}");
        assert!(v["hook_lookups"].as_u64().unwrap() >= 1, "{v}");
        assert!(v["fetched"]["trailers"].as_u64().unwrap() >= 1, "{v}");
    }
    // Without `--dedup` (the process default: `cairn_dedup_sets_the_default_mode`).
    let (data, path) = copy(14);
    let v = json(&["--json", "commit", "default", path.to_str().unwrap()]);
    assert_eq!(
        (v["new_chunks"].clone(), v["index_chunks"].clone()),
        (1.into(), 0.into())
    );
    let out = dir.path().join("out.raw");
    ok(&repo, &["-q", "restore", "default", out.to_str().unwrap()]);
    assert!(std::fs::read(&out).unwrap() == data);
    // With no memory for index filters every run is asked through its fence keys: the
    // same chunks are found in both modes, and what is committed restores and verifies.
    for (mode, seed) in [("bounded", 15), ("exact", 16)] {
        let (data, path) = copy(seed);
        let image = format!("lean-{mode}");
        let v = json(&[
            "--json",
            "--index-memory",
            "0",
            "commit",
            "--dedup",
            mode,
            &image,
            path.to_str().unwrap(),
        ]);
        assert_eq!(v["new_chunks"], 1, "{mode}: {v}");
        assert_eq!(v["fetched"]["index_filter_bytes"], 0, "{v}");
        assert!(
            v["fetched"]["index_runs_without_filter"].as_u64().unwrap() >= 1,
            "{v}"
        );
        let out = dir.path().join(format!("{image}.raw"));
        ok(
            &repo,
            &[
                "-q",
                "--index-memory",
                "0",
                "restore",
                &image,
                out.to_str().unwrap(),
            ],
        );
        assert!(std::fs::read(&out).unwrap() == data);
    }
    ok(&repo, &["-q", "--index-memory", "0", "verify"]);
    // A mode that does not exist is refused by name.
    let bad = cairn(
        &repo,
        &["commit", "--dedup", "fuzzy", "x", path.to_str().unwrap()],
    );
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("fuzzy"),
        "{bad:?}"
    );
}

/// Issue 53, finding 5: a pack whose trailer is damaged loses none of its groups. `verify`
/// exits 3 and lists the pack as rescuable; `repair` stores its groups again (exit 0: nothing
/// lost) and sets it aside; every version restores bit-exact and `verify` is clean, plain and
/// encrypted.
#[test]
fn a_damaged_pack_trailer_is_rescued_by_repair() {
    for encrypted in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let repo = dir.path().join("repo");
        let env: &[(&str, &str)] = if encrypted {
            &[("CAIRN_PASSWORD", "frames")]
        } else {
            &[]
        };
        let run = |args: &[&str]| common::cairn_with(&repo, env, args);
        let init: &[&str] = if encrypted {
            &["-q", "init", "--reserve", "0", "--encrypt"]
        } else {
            &["-q", "init", "--reserve", "0"]
        };
        assert!(run(init).status.success());
        let mut images = Vec::new();
        for v in 0..2u64 {
            let mut data = noise(4 << 20, 7);
            data[v as usize * 100_000..][..4096].fill(v as u8 + 1);
            let path = dir.path().join(format!("v{v}.raw"));
            std::fs::write(&path, &data).unwrap();
            assert!(run(&["-q", "commit", "vm", path.to_str().unwrap()])
                .status
                .success());
            images.push(data);
        }
        let (key, mut bytes) = largest_pack(&repo);
        let at = bytes.len() - 100; // in the trailer
        bytes[at] ^= 0x20;
        std::fs::write(&key, &bytes).unwrap();
        let pack_id = key.rsplit('/').next().unwrap().to_string();

        let out = run(&["--json", "verify"]);
        assert_eq!(out.status.code(), Some(3), "{out:?}");
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(
            report["rescuable_packs"],
            serde_json::json!([pack_id]),
            "{report}"
        );

        let out = run(&["--json", "repair"]);
        assert!(out.status.success(), "encrypted {encrypted}: {out:?}");
        let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(r["packs_rescued"], 1, "{r}");
        assert_eq!(r["blobs_lost"], 0, "{r}");
        let aside = repo.join("damaged").join(
            key.strip_prefix(repo.to_str().unwrap())
                .unwrap()
                .trim_start_matches('/'),
        );
        assert!(aside.exists(), "{aside:?}");
        assert!(!Path::new(&key).exists());

        for (v, data) in images.iter().enumerate() {
            let out = dir.path().join(format!("r{v}.raw"));
            let spec = format!("vm@{}", v + 1);
            assert!(run(&["-q", "restore", &spec, out.to_str().unwrap()])
                .status
                .success());
            assert!(std::fs::read(&out).unwrap() == *data, "{spec} bit-exact");
        }
        let out = run(&["verify"]);
        assert!(out.status.success(), "encrypted {encrypted}: {out:?}");
    }
}

/// Text-like data that zstd's higher levels compress better than level 3.
fn records(len: usize, seed: u64) -> Vec<u8> {
    let words = [
        "alpha", "beta", "gamma", "delta", "kernel", "module", "package", "value",
    ];
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(len + 64);
    while out.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let line = format!(
            "record {} {} {}={}\n",
            x % 100_000,
            words[(x >> 20) as usize % words.len()],
            words[(x >> 30) as usize % words.len()],
            (x >> 40) % 1000
        );
        out.extend_from_slice(line.as_bytes());
    }
    out.truncate(len);
    out
}

/// `gc --recompress LEVEL` compresses kept data again: fewer bytes, every version restores
/// bit-exact, verify finds nothing, and a second run finds nothing worth copying. Plain and
/// encrypted.
#[test]
fn gc_recompress_stores_less_and_changes_no_version() {
    for encrypted in [false, true] {
        let scratch = common::Scratch::new(encrypted);
        let dir = &scratch.dir;
        let run = |args: &[&str]| scratch.run(args);
        let mut images = Vec::new();
        for v in 0..2u64 {
            let mut data = records(6 << 20, 7 + v);
            data.extend(noise(1 << 20, v));
            let path = dir.path().join(format!("disk{v}.raw"));
            std::fs::write(&path, &data).unwrap();
            run(&["-q", "commit", "vm", path.to_str().unwrap()]);
            images.push(path);
        }
        let gc = |extra: &[&str]| -> serde_json::Value {
            let mut args = vec!["gc"];
            args.extend_from_slice(extra);
            scratch.json(&args)
        };
        let first = gc(&["--recompress", "19"]);
        assert_eq!(first["mode"], "repair", "{first}");
        assert!(first["packs_recompressed"].as_u64().unwrap() > 0, "{first}");
        let (before, after) = (
            first["before_bytes"].as_u64().unwrap(),
            first["after_bytes"].as_u64().unwrap(),
        );
        assert!(after < before * 99 / 100, "{first}");
        for (v, image) in images.iter().enumerate() {
            let out = dir.path().join("out.raw");
            let _ = std::fs::remove_file(&out);
            run(&[
                "-q",
                "restore",
                &format!("vm@{}", v + 1),
                out.to_str().unwrap(),
            ]);
            assert!(
                std::fs::read(&out).unwrap() == std::fs::read(image).unwrap(),
                "vm@{} differs after recompression",
                v + 1
            );
        }
        assert!(run(&["verify"]).contains("no problems found"));
        let second = gc(&["--recompress", "19"]);
        assert_eq!(second["packs_recompressed"], 0, "{second}");
        assert_eq!(second["after_bytes"], second["before_bytes"], "{second}");
        // A level outside zstd's is refused by the parser, in one line.
        let out = common::cairn(&scratch.repo, &["gc", "--recompress", "23"]);
        assert_eq!(out.status.code(), Some(2));
    }
}

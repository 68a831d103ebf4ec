//! Seeded restore (`--seed`) and qcow2 overlays on a local base (`--backing`): local bytes are
//! taken only where they are the version's, so the output is exact whatever the seed holds,
//! and only the rest is fetched or stored.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::common::{cairn, noise};

const KIB: usize = 1 << 10;
const MIB: usize = 1 << 20;
const CLUSTER: usize = 64 * KIB;

fn ok(repo: &Path, args: &[&str]) -> serde_json::Value {
    let out = cairn(repo, args);
    assert!(out.status.success(), "{args:?}: {out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// A: 6 MiB, data in its first 4 MiB. B: A with 24 scattered 4 KiB blocks rewritten, the
/// cluster at 2 MiB zeroed, and 512 KiB of data where A has zeros.
fn images() -> (Vec<u8>, Vec<u8>) {
    let mut a = vec![0u8; 6 * MIB];
    a[..4 * MIB].copy_from_slice(&noise(4 * MIB, 1));
    let mut b = a.clone();
    for i in 0..24 {
        let at = i * 160 * KIB + 8 * KIB;
        b[at..at + 4 * KIB].copy_from_slice(&noise(4 * KIB, 10 + i as u64));
    }
    b[2 * MIB..2 * MIB + CLUSTER].fill(0);
    b[5 * MIB..5 * MIB + 512 * KIB].copy_from_slice(&noise(512 * KIB, 3));
    (a, b)
}

/// A repository in `dir` with A and B committed as vm@1 and vm@2, and their files.
fn two_versions(dir: &Path) -> (PathBuf, Vec<u8>, Vec<u8>, PathBuf, PathBuf) {
    let repo = dir.join("repo");
    assert!(cairn(&repo, &["init", "--reserve", "0"]).status.success());
    let (a, b) = images();
    let (pa, pb) = (dir.join("a.raw"), dir.join("b.raw"));
    std::fs::write(&pa, &a).unwrap();
    std::fs::write(&pb, &b).unwrap();
    ok(&repo, &["--json", "commit", "vm", pa.to_str().unwrap()]);
    ok(&repo, &["--json", "commit", "vm", pb.to_str().unwrap()]);
    (repo, a, b, pa, pb)
}

/// Bytes of 4 KiB blocks of `want` holding data that `seed` holds at the same place.
fn same_data_blocks(want: &[u8], seed: &[u8]) -> u64 {
    want.chunks(4 * KIB)
        .zip(seed.chunks(4 * KIB))
        .filter(|(w, s)| w == s && w.iter().any(|&x| x != 0))
        .map(|(w, _)| w.len() as u64)
        .sum()
}

#[test]
fn a_seeded_restore_fetches_only_what_its_seeds_lack_and_is_exact_whatever_they_hold() {
    let dir = tempfile::tempdir().unwrap();
    let (repo, a, b, pa, _) = two_versions(dir.path());

    let out = dir.path().join("out.raw");
    let plain = ok(&repo, &["--json", "restore", "vm@2", out.to_str().unwrap()]);
    std::fs::remove_file(&out).unwrap();
    let seeded = ok(
        &repo,
        &[
            "--json",
            "restore",
            "vm@2",
            out.to_str().unwrap(),
            "--seed",
            pa.to_str().unwrap(),
        ],
    );
    assert_eq!(std::fs::read(&out).unwrap(), b);
    assert_eq!(seeded["seeded_bytes"], same_data_blocks(&b, &a), "{seeded}");
    let (fetched, all) = (
        seeded["fetched_bytes"].as_u64().unwrap(),
        plain["fetched_bytes"].as_u64().unwrap(),
    );
    assert!(fetched * 4 < all, "fetched {fetched} of {all}");

    // A seed that lies (B with a block flipped) and one that is missing: the output is B,
    // the missing seed a warning.
    let mut liar = b.clone();
    liar[100 * KIB] ^= 0xff;
    let pl = dir.path().join("liar.raw");
    std::fs::write(&pl, &liar).unwrap();
    std::fs::remove_file(&out).unwrap();
    let run = cairn(
        &repo,
        &[
            "--json",
            "restore",
            "vm@2",
            out.to_str().unwrap(),
            "--seed",
            "/nonexistent/seed.raw",
            "--seed",
            pl.to_str().unwrap(),
        ],
    );
    assert!(run.status.success(), "{run:?}");
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        err.contains("seed /nonexistent/seed.raw is left out"),
        "{err}"
    );
    assert_eq!(std::fs::read(&out).unwrap(), b);
    let r: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(r["seeded_bytes"], same_data_blocks(&b, &liar));
}

/// Bytes of non-zero 4 KiB blocks of `want` that `seed` holds at any 4 KiB-aligned offset.
fn blocks_found_anywhere(want: &[u8], seed: &[u8]) -> u64 {
    let held: std::collections::HashSet<&[u8]> = seed.chunks(4 * KIB).collect();
    want.chunks(4 * KIB)
        .filter(|w| w.iter().any(|&x| x != 0) && held.contains(w))
        .map(|w| w.len() as u64)
        .sum()
}

#[test]
fn a_seed_gives_the_data_it_holds_at_other_offsets_too() {
    let dir = tempfile::tempdir().unwrap();
    let (repo, a, _, pa, _) = two_versions(dir.path());
    // C: A's first and fourth MiB swapped, 256 KiB of A copied past A's data, 64 KiB copied to
    // an offset that is not a multiple of 4 KiB (not findable by blocks), and new data.
    let mut c = vec![0u8; 6 * MIB];
    c[..MIB].copy_from_slice(&a[3 * MIB..4 * MIB]);
    c[MIB..3 * MIB].copy_from_slice(&a[MIB..3 * MIB]);
    c[3 * MIB..4 * MIB].copy_from_slice(&a[..MIB]);
    c[4 * MIB + 4 * KIB..4 * MIB + 260 * KIB]
        .copy_from_slice(&a[2 * MIB + 12 * KIB..2 * MIB + 268 * KIB]);
    c[5 * MIB + 100..5 * MIB + 100 + 64 * KIB].copy_from_slice(&a[MIB..MIB + 64 * KIB]);
    c[5 * MIB + 128 * KIB..5 * MIB + 256 * KIB].copy_from_slice(&noise(128 * KIB, 4));
    let pc = dir.path().join("c.raw");
    std::fs::write(&pc, &c).unwrap();
    ok(&repo, &["--json", "commit", "moved", pc.to_str().unwrap()]);

    let out = dir.path().join("out.raw");
    let plain = ok(
        &repo,
        &["--json", "restore", "moved", out.to_str().unwrap()],
    );
    std::fs::remove_file(&out).unwrap();
    let seeded = ok(
        &repo,
        &[
            "--json",
            "restore",
            "moved",
            out.to_str().unwrap(),
            "--seed",
            pa.to_str().unwrap(),
        ],
    );
    assert_eq!(std::fs::read(&out).unwrap(), c);
    let found = blocks_found_anywhere(&c, &a);
    assert_eq!(found, (4 * MIB + 256 * KIB) as u64);
    assert_eq!(seeded["seeded_bytes"], found, "{seeded}");
    // Only the groups of the unaligned copy and the new data are fetched.
    let (fetched, all) = (
        seeded["fetched_bytes"].as_u64().unwrap(),
        plain["fetched_bytes"].as_u64().unwrap(),
    );
    assert!(fetched * 10 < all, "fetched {fetched} of {all}");
}

#[test]
fn a_restore_with_backing_is_a_qcow2_overlay_holding_only_the_clusters_that_differ() {
    let dir = tempfile::tempdir().unwrap();
    let (repo, a, b, pa, pb) = two_versions(dir.path());

    let out = dir.path().join("vm.qcow2");
    let r = ok(
        &repo,
        &[
            "--json",
            "restore",
            "vm@2",
            out.to_str().unwrap(),
            "--backing",
            pa.to_str().unwrap(),
        ],
    );
    assert_eq!(r["format"], "qcow2");
    let compare = Command::new("qemu-img")
        .args(["compare", "-q", "-f", "qcow2", "-F", "raw"])
        .arg(&out)
        .arg(&pb)
        .status()
        .expect("qemu-img");
    assert!(
        compare.success(),
        "qemu-img compare finds the overlay equal to B"
    );
    let info = Command::new("qemu-img")
        .args(["info", "--output=json"])
        .arg(&out)
        .output()
        .expect("qemu-img");
    let info: serde_json::Value = serde_json::from_slice(&info.stdout).unwrap();
    let absolute = std::fs::canonicalize(&pa).unwrap();
    assert_eq!(info["backing-filename"], absolute.to_str().unwrap());
    assert_eq!(info["backing-filename-format"], "raw");
    // Allocated: the clusters where B differs from A and holds data (the zeroed cluster has
    // the zero flag, no data).
    let differing_data = b
        .chunks(CLUSTER)
        .zip(a.chunks(CLUSTER))
        .filter(|(x, y)| x != y && x.iter().any(|&v| v != 0))
        .count();
    let check = Command::new("qemu-img")
        .args(["check", "--output=json"])
        .arg(&out)
        .output()
        .expect("qemu-img");
    let check: serde_json::Value = serde_json::from_slice(&check.stdout).unwrap();
    assert_eq!(check["allocated-clusters"], differing_data, "{check}");
    assert_eq!(check["corruptions"].as_u64().unwrap_or(0), 0, "{check}");
}

#[test]
fn a_seeded_export_serves_what_its_seed_holds_and_fetches_only_the_rest() {
    use crate::common::export::{nbdcopy, Served};
    let dir = tempfile::tempdir().unwrap();
    let (repo, a, b, pa, _) = two_versions(dir.path());
    let garbage = dir.path().join("garbage.raw");
    std::fs::write(&garbage, noise(a.len(), 99)).unwrap();
    let mut fetched = Vec::new();
    for (tag, seeds) in [
        ("plain", vec![]),
        ("seeded", vec![pa.clone()]),
        ("garbage", vec![garbage.clone()]),
        ("both", vec![garbage.clone(), pa.clone()]),
    ] {
        // No boot profile: the first run's reads would be fetched ahead by the next.
        let mut args = vec![
            "vm@2".to_string(),
            "--no-profile".into(),
            "--name".into(),
            "disk".into(),
        ];
        for s in &seeds {
            args.push("--seed".into());
            args.push(s.to_str().unwrap().into());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        // A cache of its own each time (a shared one would serve the second run).
        let run = dir.path().join(tag);
        std::fs::create_dir(&run).unwrap();
        let mut served = Served::spawn(&repo, &run, tag, &args);
        let out = run.join("out.raw");
        nbdcopy(served.uri(), &out);
        assert!(
            std::fs::read(&out).unwrap() == b,
            "{tag}: the export differs from vm@2"
        );
        let (status, err) = served.signal("TERM");
        assert!(status.success(), "{tag}: {err}");
        let stats: serde_json::Value =
            serde_json::from_slice(&std::fs::read(run.join(format!("{tag}.json"))).unwrap())
                .unwrap();
        // What the seed holds of vm@2 is served from it, exactly that (a run of an old
        // group is all the seed's or none of it), and a seed of other data serves nothing.
        let want_seeded = match tag {
            "seeded" | "both" => same_data_blocks(&b, &a),
            _ => 0,
        };
        assert_eq!(stats["seeded_bytes"], want_seeded, "{tag}: {stats}");
        fetched.push(stats["fetched_bytes"].as_u64().unwrap());
    }
    assert!(same_data_blocks(&b, &a) > 3 * MIB as u64);
    assert!(fetched[1] * 3 < fetched[0], "seeded fetched {fetched:?}");
    assert_eq!(fetched[2], fetched[0], "a useless seed changes nothing");
    assert_eq!(fetched[3], fetched[1], "seeds are tried in order");
}

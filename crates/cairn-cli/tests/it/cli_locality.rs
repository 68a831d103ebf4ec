//! Restore locality: `cairn stats IMAGE@V` counts the reads a restore of a version makes, and
//! `cairn relayout` (CloudVS's α) stores the most scattered segments again, side by side.

use crate::common::{self, cairn, noise};

use std::path::Path;

fn ok(repo: &Path, args: &[&str]) -> String {
    let out = cairn(repo, args);
    assert!(out.status.success(), "cairn {args:?}: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// Two versions of a disk of `mib` MiB: the first committed whole, the second with every
/// other pair of 64 KiB blocks rewritten (blocks 1, 2, 5, 6, …). Returns both images' bytes.
fn scattered_history(dir: &Path, mib: usize, run: &dyn Fn(&[&str]) -> String) -> Vec<Vec<u8>> {
    scattered_writes(dir, mib, 64 << 10, run)
}

/// [`scattered_history`] rewriting only the first `len` bytes of each of those blocks.
fn scattered_writes(
    dir: &Path,
    mib: usize,
    len: usize,
    run: &dyn Fn(&[&str]) -> String,
) -> Vec<Vec<u8>> {
    let mut data = noise(mib << 20, 7);
    let disk = dir.join("disk.raw");
    std::fs::write(&disk, &data).unwrap();
    run(&["-q", "commit", "vm", disk.to_str().unwrap()]);
    let first = data.clone();
    for block in (0..mib * 16).filter(|b| b % 4 == 1 || b % 4 == 2) {
        let at = block * (64 << 10);
        data[at..at + len].copy_from_slice(&noise(len, 100 + block as u64));
    }
    std::fs::write(&disk, &data).unwrap();
    run(&["-q", "commit", "vm", disk.to_str().unwrap()]);
    vec![first, data]
}

/// `stats IMAGE@V` says where a version's data lies: a version committed whole is read in
/// one request from one pack; the next, whose every other pair of 64 KiB blocks was
/// rewritten, takes a read per run of old blocks left between the new ones.
#[test]
fn stats_of_a_version_counts_the_reads_a_restore_makes() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    ok(&repo, &["-q", "init", "--reserve", "0"]);
    scattered_history(dir.path(), 2, &|args| ok(&repo, args));
    let stats = |spec: &str| -> serde_json::Value {
        serde_json::from_str(ok(&repo, &["--json", "stats", spec]).trim()).unwrap()
    };
    let (one, two) = (stats("vm@1"), stats("vm@2"));
    assert_eq!(
        (
            &one["data_bytes"],
            &one["groups"],
            &one["packs"],
            &one["reads"]
        ),
        (&(2u64 << 20).into(), &32.into(), &1.into(), &1.into()),
        "{one}"
    );
    // Old blocks 0 | 3,4 | 7,8 | … | 27,28 | 31: nine reads of the first pack; the 16 new
    // blocks lie side by side in the second.
    assert_eq!(
        (&two["groups"], &two["packs"], &two["reads"]),
        (&32.into(), &2.into(), &10.into()),
        "{two}"
    );
    assert!(
        two["reads_per_gib"].as_f64() > one["reads_per_gib"].as_f64(),
        "{two}"
    );
    let text = ok(&repo, &["stats", "vm@2"]);
    assert!(
        text.contains("restore reads   10 (5120.0 per GiB of data"),
        "{text}"
    );
}

/// `relayout --alpha A` re-stores the top A of the batches a restore reads together (4 MiB),
/// scattered ones only. vm@2 of an 8 MiB disk is two batches, each read in 18 requests or
/// more (17 runs of old blocks between the new ones, and the new blocks); α = 0.5 copies the
/// first batch's 64 groups into one layout pack, where a restore reads them in two requests
/// (64 groups and their frames pass the 4 MiB a read may span); α = 1 then copies only the
/// second, the first being side by side already. Every version restores bit-exact
/// throughout; `gc --repair` keeps the layout copies (four reads) and drops what no version
/// reads any more. Plain and encrypted.
#[test]
fn relayout_stores_scattered_data_again_and_gc_keeps_the_new_layout() {
    for encrypted in [false, true] {
        let scratch = common::Scratch::new(encrypted);
        let (dir, repo) = (&scratch.dir, &scratch.repo);
        let run = |args: &[&str]| scratch.run(args);
        let json = |args: &[&str]| scratch.json(args);
        let images = scattered_history(dir.path(), 8, &run);
        let reads = |spec: &str| json(&["stats", spec])["reads"].as_u64().unwrap();
        let restores_exactly = |when: &str| {
            for (v, data) in images.iter().enumerate() {
                let out = dir.path().join("out.raw");
                let _ = std::fs::remove_file(&out);
                let spec = format!("vm@{}", v + 1);
                run(&["-q", "restore", &spec, out.to_str().unwrap()]);
                assert!(std::fs::read(&out).unwrap() == *data, "{spec} {when}");
            }
        };
        let layout_markers = || std::fs::read_dir(repo.join("layout")).map_or(0, |d| d.count());
        let scattered = reads("vm@2");
        assert!(scattered >= 36, "{scattered} reads");

        let none = json(&["relayout", "vm@2", "--alpha", "0"]);
        let counts = |v: &serde_json::Value| {
            [
                "batches",
                "scattered_batches",
                "chosen_batches",
                "groups_copied",
            ]
            .map(|k| v[k].as_u64().unwrap())
        };
        assert_eq!(counts(&none), [2, 2, 0, 0], "{none}");
        let dry = json(&["relayout", "vm@2", "--alpha", "1", "--dry-run"]);
        assert_eq!(counts(&dry), [2, 2, 2, 128], "{dry}");
        // Every group of the version, as stored: noise, so a little more than its bytes.
        let to_copy = dry["bytes_copied"].as_u64().unwrap();
        assert!((8 << 20..(8 << 20) + 128 * 64).contains(&to_copy), "{dry}");
        assert_eq!(
            (reads("vm@2"), layout_markers()),
            (scattered, 0),
            "a dry run writes nothing"
        );

        let half = json(&["relayout", "vm@2", "--alpha", "0.5"]);
        assert_eq!(counts(&half), [2, 2, 1, 64], "{half}");
        assert_eq!(half["packs_written"], 1, "{half}");
        let after_half = half["after"]["reads"].as_u64().unwrap();
        assert!(after_half <= scattered / 2 + 2, "{half}");
        assert_eq!((reads("vm@2"), layout_markers()), (after_half, 1));
        restores_exactly("after relayout --alpha 0.5");

        let all = json(&["relayout", "vm@2", "--alpha", "1"]);
        assert_eq!(counts(&all), [2, 1, 1, 64], "{all}");
        assert_eq!(reads("vm@2"), 4);
        let again = json(&["relayout", "vm@2", "--alpha", "1"]);
        assert_eq!(
            counts(&again),
            [2, 0, 0, 0],
            "nothing is scattered: {again}"
        );
        restores_exactly("after relayout --alpha 1");

        let stored = |v: &serde_json::Value| v["stored_bytes"].as_u64().unwrap();
        let before_gc = json(&["stats"]);
        let gc = json(&["gc", "--repair"]);
        assert!(gc["packs_deleted"].as_u64().unwrap() >= 1, "{gc}");
        assert!(stored(&json(&["stats"])) < stored(&before_gc), "{gc}");
        assert_eq!(reads("vm@2"), 4, "GC kept the layout copies: {gc}");
        assert_eq!(layout_markers(), 2);
        restores_exactly("after gc --repair");
        run(&["-q", "verify"]);
    }
}

/// A proportion outside 0–1 is refused with one line, before anything is read.
#[test]
fn relayout_refuses_an_alpha_outside_0_to_1() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    ok(&repo, &["-q", "init", "--reserve", "0"]);
    scattered_history(dir.path(), 2, &|args| ok(&repo, args));
    let out = cairn(&repo, &["relayout", "vm@2", "--alpha", "1.5"]);
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    assert_eq!(
        common::stderr_line(&out),
        "cairn: error: --alpha 1.5 is not between 0 and 1 (the proportion of the version's data to re-store)"
    );
}

/// A GC that repacks a relayout's packs (here because `rm vm@1` leaves half of each old
/// group the relayout copied dead: vm@2 rewrote the first half of blocks 1, 2, 5, 6, …)
/// copies them in the order the relayout wrote them: with 1 MiB packs, vm@2's 8 MiB lie in
/// eight or more layout packs, and a batch of 4 MiB spans four of them; in any other order a
/// restore of each batch would read pieces of more packs. The repacked copies stay
/// preferred, and the version restores bit-exact.
#[test]
fn a_gc_that_repacks_a_relayouts_packs_keeps_their_order() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    ok(
        &repo,
        &["-q", "init", "--reserve", "0", "--pack-size", "1M"],
    );
    let images = scattered_writes(dir.path(), 8, 32 << 10, &|args| ok(&repo, args));
    let json = |args: &[&str]| -> serde_json::Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        serde_json::from_str(ok(&repo, &all).trim()).unwrap()
    };
    let reads = || json(&["stats", "vm@2"])["reads"].as_u64().unwrap();
    let relayout = json(&["relayout", "vm@2", "--alpha", "1"]);
    assert!(
        relayout["packs_written"].as_u64().unwrap() >= 8,
        "{relayout}"
    );
    let laid_out = reads();
    assert_eq!(laid_out, relayout["after"]["reads"].as_u64().unwrap());

    // `rm` runs fast deletion, which repacks; `gc --repair` then finds nothing to move.
    let rm = json(&["rm", "vm@1"]);
    assert!(
        rm["gc"]["packs_repacked"].as_u64().unwrap() >= relayout["packs_written"].as_u64().unwrap(),
        "the layout packs were repacked: {rm}"
    );
    assert!(
        reads() <= laid_out,
        "{} reads after the repack, {laid_out} before: {rm}",
        reads()
    );
    let out = dir.path().join("out.raw");
    ok(&repo, &["-q", "restore", "vm@2", out.to_str().unwrap()]);
    assert!(std::fs::read(&out).unwrap() == images[1], "vm@2 after gc");
    ok(&repo, &["-q", "verify"]);
}

/// A relayout that meets a damaged copy stops with one line naming it (exit 3, damage) and
/// stores nothing: no layout marker, no new pack, vm@1 (whose pack is whole) still restores,
/// and a second attempt says the same.
#[test]
fn a_relayout_that_meets_damage_names_it_and_stores_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("repo");
    ok(&repo, &["-q", "init", "--reserve", "0"]);
    let images = scattered_history(dir.path(), 2, &|args| ok(&repo, args));
    let packs = || -> Vec<std::path::PathBuf> {
        let mut all: Vec<_> = common::walk(&repo.join("packs"));
        all.sort();
        all
    };
    // vm@2's new blocks lie in the second commit's data pack, the smaller one (1 MiB of the
    // 2 MiB; node packs are a few KiB); flip a byte in its first group.
    let before = packs();
    let size = |p: &std::path::PathBuf| std::fs::metadata(p).unwrap().len();
    let newest = before
        .iter()
        .filter(|p| size(p) > 100 << 10)
        .min_by_key(|p| size(p))
        .unwrap()
        .clone();
    let mut bytes = std::fs::read(&newest).unwrap();
    bytes[1000] ^= 0x55;
    std::fs::write(&newest, &bytes).unwrap();

    for attempt in 0..2 {
        let out = cairn(&repo, &["relayout", "vm@2", "--alpha", "1"]);
        assert_eq!(out.status.code(), Some(3), "attempt {attempt}: {out:?}");
        let line = common::stderr_line(&out);
        let pack = newest.file_name().unwrap().to_str().unwrap();
        assert!(
            line.starts_with("cairn: error: ") && line.contains(pack),
            "attempt {attempt}: {line}"
        );
        assert!(!repo.join("layout").exists() || common::walk(&repo.join("layout")).is_empty());
        assert_eq!(packs(), before, "attempt {attempt}: no pack written");
    }
    let out = dir.path().join("one.raw");
    ok(&repo, &["-q", "restore", "vm@1", out.to_str().unwrap()]);
    assert!(std::fs::read(&out).unwrap() == images[0], "vm@1");
}

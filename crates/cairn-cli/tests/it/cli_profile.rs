//! Boot profiles: an export records its client's first reads as the image's stored profile
//! (or a file, `--record-profile`), and a later export of another version of the image fetches
//! them ahead of its client (or those of a file, `--profile`), so the client's reads find the
//! cache warm. A profile that does not fit is ignored. `cairn profile` manages stored ones.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::export::{qemu_io_ro as qemu_io, Served};
use crate::common::{cairn, cairn_with, noise, stderr_line};

const MIB: usize = 1 << 20;
const K64: u64 = 65536;

fn commit(repo: &Path, dir: &Path, image: &str, name: &str, data: &[u8]) {
    let path = dir.join(name);
    std::fs::write(&path, data).unwrap();
    let out = cairn(repo, &["--json", "commit", image, path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
}

/// A repository in `dir` with two 8 MiB versions of `vm` (one block apart) and one 4 MiB
/// version of `other`.
fn two_images(dir: &Path) -> std::path::PathBuf {
    let repo = dir.join("repo");
    assert!(cairn(&repo, &["init", "--reserve", "0"]).status.success());
    let a = noise(8 * MIB, 1);
    let mut b = a.clone();
    b[6 * MIB..6 * MIB + 4096].copy_from_slice(&noise(4096, 2));
    commit(&repo, dir, "vm", "a.raw", &a);
    commit(&repo, dir, "vm", "b.raw", &b);
    commit(&repo, dir, "other", "c.raw", &noise(4 * MIB, 3));
    repo
}

/// A run directory of its own (its own cache) for each export.
fn serve(repo: &Path, dir: &Path, tag: &str, args: &[&str]) -> Served {
    let run = dir.join(tag);
    std::fs::create_dir(&run).unwrap();
    let mut all = args.to_vec();
    all.extend(["--name", "disk"]);
    Served::spawn(repo, &run, tag, &all)
}

fn stats_of(dir: &Path, tag: &str) -> Value {
    serde_json::from_slice(&std::fs::read(dir.join(tag).join(format!("{tag}.json"))).unwrap())
        .unwrap()
}

#[test]
fn a_recorded_profile_is_fetched_ahead_by_the_next_export_and_a_misfit_is_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let repo = two_images(dir);

    // Record: three reads, the third adjacent to the second, then one read again.
    let profile = dir.join("vm.boot.json");
    let p = profile.to_str().unwrap();
    let mut rec = serve(&repo, dir, "rec", &["vm@1", "--record-profile", p]);
    let reads = ["read 5M 64k", "read 1M 64k", "read 1088k 64k", "read 5M 4k"];
    qemu_io(&rec.uri(), &reads);
    let (status, err) = rec.signal("TERM");
    assert!(status.success(), "{err}");
    let recorded: Value = serde_json::from_slice(&std::fs::read(&profile).unwrap()).unwrap();
    assert_eq!(recorded["cairn_boot_profile"], 1);
    assert_eq!(recorded["image"], "vm");
    assert_eq!(recorded["size"], 8 * MIB);
    assert_eq!(
        recorded["reads"],
        serde_json::json!([[5 * MIB, K64], [MIB, 2 * K64]])
    );
    // One think time per read; the first read has none before it.
    assert_eq!(recorded["think_us"].as_array().unwrap().len(), 2);
    assert_eq!(recorded["think_us"][0], 0);
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&profile).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);

    // Replay on the next version: the profile's bytes are fetched before any client read,
    // and the client's reads of them then all hit the cache.
    let mut play = serve(&repo, dir, "play", &["vm@2", "--profile", p]);
    let start = Instant::now();
    let ahead = loop {
        let s = play.stats();
        if s["prefetched_bytes"] == 3 * K64 || start.elapsed() > Duration::from_secs(20) {
            break s;
        }
    };
    assert_eq!(ahead["prefetched_bytes"], 3 * K64, "{ahead}");
    assert_eq!(ahead["reads"], 0);
    assert!(
        ahead["fetched_bytes"].as_u64().unwrap() >= 3 * K64,
        "{ahead}"
    );
    let misses = ahead["cache_misses"].as_u64().unwrap();
    qemu_io(&play.uri(), &["read 5M 64k", "read 1M 128k"]);
    let (status, err) = play.signal("TERM");
    assert!(status.success(), "{err}");
    let after = stats_of(dir, "play");
    assert_eq!(after["reads"], 2);
    assert_eq!(after["cache_misses"].as_u64().unwrap(), misses, "{after}");
    assert_eq!(after["fetched_bytes"], ahead["fetched_bytes"], "{after}");

    // Another image's export ignores it with one warning line; so does a damaged file.
    let mut other = serve(&repo, dir, "other", &["other", "--profile", p]);
    let (status, err) = other.signal("TERM");
    assert!(status.success(), "{err}");
    assert!(
        err.contains(&format!(
            "boot profile {p} is ignored: it was recorded for image \"vm\" (serving other@1"
        )),
        "{err}"
    );
    assert_eq!(stats_of(dir, "other")["prefetched_bytes"], 0);
    let damaged = dir.join("damaged.json");
    std::fs::write(&damaged, b"{\"cairn_boot_profile\": 1, \"image\": ").unwrap();
    let mut d = serve(
        &repo,
        dir,
        "damaged",
        &["vm@2", "--profile", damaged.to_str().unwrap()],
    );
    let (status, err) = d.signal("TERM");
    assert!(status.success(), "{err}");
    assert!(err.contains("is ignored: not a boot profile"), "{err}");
}

/// Waits until the export has fetched `bytes` ahead of its client, and returns its counters.
fn prefetched(served: &mut Served, bytes: u64) -> Value {
    let start = Instant::now();
    loop {
        let s = served.stats();
        if s["prefetched_bytes"] == bytes || start.elapsed() > Duration::from_secs(20) {
            return s;
        }
    }
}

fn stored_profile(repo: &Path, image: &str) -> Value {
    let out = cairn(repo, &["--json", "profile", "show", image]);
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn the_image_keeps_its_boot_profile_and_every_export_uses_it_without_flags() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let repo = two_images(dir);

    let none = cairn(&repo, &["profile", "show", "vm"]);
    assert_eq!(none.status.code(), Some(1));
    assert_eq!(stderr_line(&none), "cairn: error: vm has no boot profile");
    let listed = cairn(&repo, &["--json", "profile", "list"]);
    assert_eq!(String::from_utf8_lossy(&listed.stdout).trim(), "[]");

    // The first export of the image records its client's first reads into the repository.
    let mut first = serve(&repo, dir, "first", &["vm@1"]);
    qemu_io(
        &first.uri(),
        &["read 5M 64k", "read 1M 64k", "read 1088k 64k"],
    );
    let (status, err) = first.signal("TERM");
    assert!(status.success(), "{err}");
    let recorded = stored_profile(&repo, "vm");
    assert_eq!(recorded["image"], "vm");
    assert_eq!(recorded["size"], 8 * MIB);
    let reads = serde_json::json!([[5 * MIB, K64], [MIB, 2 * K64]]);
    assert_eq!(recorded["reads"], reads);
    let listed = cairn(&repo, &["--json", "profile", "list"]);
    let mut listed: Value = serde_json::from_slice(&listed.stdout).unwrap();
    // The guest's think time is what it is; that it is there is what counts.
    let think = listed[0]["think_seconds"].take();
    assert!(think.as_f64().is_some_and(|t| t >= 0.0), "{think}");
    assert_eq!(
        listed,
        serde_json::json!([{"image": "vm", "reads": 2, "bytes": 3 * K64, "size": 8 * MIB,
                            "think_seconds": null}])
    );

    // `cairn copy` takes the profile along with the image.
    let copy = dir.join("copy");
    assert!(cairn(&copy, &["init", "--reserve", "0"]).status.success());
    let out = cairn(
        &copy,
        &["--json", "copy", "--from", repo.to_str().unwrap(), "vm"],
    );
    assert!(out.status.success(), "{out:?}");
    let report: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["profiles_copied"], 1, "{report}");
    assert_eq!(stored_profile(&copy, "vm")["reads"], reads);

    // The next export of another version fetches them before any read, its client's reads
    // of them all hit the cache, and the stored profile stays as it was.
    let mut next = serve(&repo, dir, "next", &["vm@2"]);
    let ahead = prefetched(&mut next, 3 * K64);
    assert_eq!(ahead["prefetched_bytes"], 3 * K64, "{ahead}");
    assert_eq!(ahead["reads"], 0);
    let misses = ahead["cache_misses"].as_u64().unwrap();
    qemu_io(&next.uri(), &["read 5M 64k", "read 1M 128k"]);
    let hit = next.stats();
    assert_eq!(hit["cache_misses"].as_u64().unwrap(), misses, "{hit}");
    qemu_io(&next.uri(), &["read 7M 4k"]);
    let (status, err) = next.signal("TERM");
    assert!(status.success(), "{err}");
    assert!(stats_of(dir, "next")["cache_misses"].as_u64().unwrap() > misses);
    assert_eq!(stored_profile(&repo, "vm")["reads"], reads);

    // --no-profile fetches nothing ahead; --new-profile records anew.
    let mut off = serve(&repo, dir, "off", &["vm@2", "--no-profile"]);
    std::thread::sleep(Duration::from_millis(500));
    let (status, err) = off.signal("TERM");
    assert!(status.success(), "{err}");
    assert_eq!(stats_of(dir, "off")["prefetched_bytes"], 0);
    let mut anew = serve(&repo, dir, "anew", &["vm@2", "--new-profile"]);
    qemu_io(&anew.uri(), &["read 3M 4k"]);
    let (status, err) = anew.signal("TERM");
    assert!(status.success(), "{err}");
    assert_eq!(anew_reads(&repo), serde_json::json!([[3 * MIB, 4096]]));
    assert_eq!(stats_of(dir, "anew")["prefetched_bytes"], 0);

    // show --json gives a file that `profile set` stores again (for this image only), and rm
    // removes it.
    let saved = dir.join("saved.json");
    std::fs::write(
        &saved,
        cairn(&repo, &["--json", "profile", "show", "vm"]).stdout,
    )
    .unwrap();
    let s = saved.to_str().unwrap();
    let rm = cairn(&repo, &["profile", "rm", "vm"]);
    assert!(rm.status.success(), "{rm:?}");
    let again = cairn(&repo, &["profile", "rm", "vm"]);
    assert_eq!(again.status.code(), Some(1));
    assert_eq!(stderr_line(&again), "cairn: error: vm has no boot profile");
    let wrong = cairn(&repo, &["profile", "set", "other", s]);
    assert_eq!(
        stderr_line(&wrong),
        format!(
            "cairn: error: {s} does not fit other@1 (4194304 bytes): it was recorded for image \"vm\""
        )
    );
    let set = cairn(&repo, &["profile", "set", "vm", s]);
    assert!(set.status.success(), "{set:?}");
    assert_eq!(anew_reads(&repo), serde_json::json!([[3 * MIB, 4096]]));

    // A damaged stored profile is ignored with one warning and recorded anew.
    let stored = repo.join("refs/profiles/vm");
    let mut bytes = std::fs::read(&stored).unwrap();
    bytes[20] ^= 1;
    std::fs::write(&stored, &bytes).unwrap();
    let mut damaged = serve(&repo, dir, "damaged", &["vm@2"]);
    qemu_io(&damaged.uri(), &["read 2M 4k"]);
    let (status, err) = damaged.signal("TERM");
    assert!(status.success(), "{err}");
    assert!(
        err.contains("the stored boot profile of vm is ignored: refs/profiles/vm:"),
        "{err}"
    );
    assert_eq!(anew_reads(&repo), serde_json::json!([[2 * MIB, 4096]]));

    // Removing the image removes its profile; GC removes one whose image is gone.
    std::fs::copy(&stored, repo.join("refs/profiles/ghost")).unwrap();
    let rm = cairn(&repo, &["rm", "vm", "--yes", "--no-gc"]);
    assert!(rm.status.success(), "{rm:?}");
    let gc = cairn(&repo, &["--json", "gc"]);
    assert!(gc.status.success(), "{gc:?}");
    let gc: Value = serde_json::from_slice(&gc.stdout).unwrap();
    assert_eq!(gc["profiles_removed"], 1, "{gc}");
    let listed = cairn(&repo, &["--json", "profile", "list"]);
    assert_eq!(String::from_utf8_lossy(&listed.stdout).trim(), "[]");
}

fn anew_reads(repo: &Path) -> Value {
    stored_profile(repo, "vm")["reads"].clone()
}

#[test]
fn an_encrypted_repository_stores_its_boot_profiles_sealed() {
    let dir = tempfile::tempdir().unwrap();
    let dir = dir.path();
    let repo = dir.join("repo");
    let pw = [("CAIRN_PASSWORD", "correct horse")];
    let init = cairn_with(&repo, &pw, &["init", "--encrypt", "--reserve", "0"]);
    assert!(init.status.success(), "{init:?}");
    let data = dir.join("a.raw");
    std::fs::write(&data, noise(4 * MIB, 4)).unwrap();
    let c = cairn_with(&repo, &pw, &["commit", "vm", data.to_str().unwrap()]);
    assert!(c.status.success(), "{c:?}");
    let run = dir.join("rec");
    std::fs::create_dir(&run).unwrap();
    let env = [("CAIRN_PASSWORD", std::ffi::OsStr::new("correct horse"))];
    let mut rec = Served::spawn_env(&repo, &run, "rec", &["vm", "--name", "disk"], &env);
    qemu_io(&rec.uri(), &["read 1M 64k"]);
    let (status, err) = rec.signal("TERM");
    assert!(status.success(), "{err}");
    let stored = std::fs::read(repo.join("refs/profiles/vm")).unwrap();
    // After the envelope's header: a nonce, not the zstd frame a plain repository stores.
    assert_eq!(&stored[..8], b"CRNBPRF\0");
    assert_ne!(
        &stored[16..20],
        &[0x28, 0xb5, 0x2f, 0xfd],
        "stored in the clear"
    );
    let out = cairn_with(&repo, &pw, &["--json", "profile", "show", "vm"]);
    assert!(out.status.success(), "{out:?}");
    let shown: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(shown["reads"], serde_json::json!([[MIB, K64]]));
    let wrong = cairn_with(
        &repo,
        &[("CAIRN_PASSWORD", "nope")],
        &["profile", "show", "vm"],
    );
    assert!(!wrong.status.success());
}

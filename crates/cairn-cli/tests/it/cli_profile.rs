//! Boot profiles: an export records its client's first reads (`--record-profile`), and a later
//! export of another version of the image fetches them ahead of its client (`--profile`), so
//! the client's reads find the cache warm. A profile that does not fit is ignored.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::common::export::{qemu_io_ro as qemu_io, Served};
use crate::common::{cairn, noise};

const MIB: usize = 1 << 20;
const K64: u64 = 65536;

fn commit(repo: &Path, dir: &Path, image: &str, name: &str, data: &[u8]) {
    let path = dir.join(name);
    std::fs::write(&path, data).unwrap();
    let out = cairn(repo, &["--json", "commit", image, path.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
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
    let repo = dir.join("repo");
    assert!(cairn(&repo, &["init", "--reserve", "0"]).status.success());
    let a = noise(8 * MIB, 1);
    let mut b = a.clone();
    b[6 * MIB..6 * MIB + 4096].copy_from_slice(&noise(4096, 2));
    commit(&repo, dir, "vm", "a.raw", &a);
    commit(&repo, dir, "vm", "b.raw", &b);
    commit(&repo, dir, "other", "c.raw", &noise(4 * MIB, 3));

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

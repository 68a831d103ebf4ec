//! `cairn diff`: text, --stat and --json output on two small versions.

use crate::common::{cairn, noise};

use std::path::Path;
use std::process::Output;

use serde_json::{json, Value};

fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "cairn failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// Commits `data` as a new version of `vm` and returns its id.
fn commit(repo: &Path, dir: &Path, data: &[u8]) -> String {
    let img = dir.join("img.raw");
    std::fs::write(&img, data).unwrap();
    let out = ok(cairn(
        repo,
        &["--json", "commit", "vm", img.to_str().unwrap()],
    ));
    let v: Value = serde_json::from_str(&out).unwrap();
    v["id"].as_str().unwrap().to_string()
}

#[test]
fn diff_of_two_versions() {
    let dir = tempfile::tempdir().unwrap();
    let repo = dir.path().join("r");
    ok(cairn(
        &repo,
        &["init", "--chunk-size", "4K", "--segment-size", "64K"],
    ));
    let v1 = noise(200_000, 1);
    let mut v2 = v1.clone();
    v2[70_000] ^= 1; // in the chunk at 0x11000
    v2[131_072..139_264].fill(0); // two whole chunks at 0x20000
    let id1 = commit(&repo, dir.path(), &v1);
    let id2 = commit(&repo, dir.path(), &v2);

    let out = ok(cairn(&repo, &["--json", "diff", "vm@1", "vm@2"]));
    let got: Value = serde_json::from_str(&out).unwrap();
    // Height-1 trees: both roots, and both leaves of segments 1 and 2.
    assert_eq!(
        got,
        json!({
            "a": id1,
            "b": id2,
            "ranges": [
                {"offset": 69_632, "len": 4096},
                {"offset": 131_072, "len": 8192},
            ],
            "changed_bytes": 12_288,
            "chunks_added": 1,
            "chunks_removed": 3,
            "nodes_read": 6,
            "a_size_bytes": 200_000,
            "b_size_bytes": 200_000,
        })
    );

    let out = ok(cairn(&repo, &["--json", "diff", "--stat", "vm@1", "vm"]));
    let got: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        got,
        json!({
            "a": id1,
            "b": id2,
            "changed_bytes": 12_288,
            "chunks_added": 1,
            "chunks_removed": 3,
            "nodes_read": 6,
            "a_size_bytes": 200_000,
            "b_size_bytes": 200_000,
        })
    );

    let out = ok(cairn(&repo, &["diff", "vm@1", "vm@2"]));
    assert_eq!(
        out,
        "0x11000 +4.0 KiB\n0x20000 +8.0 KiB\n\
         2 ranges, 12.0 KiB changed, +1 chunk, -3 chunks, 6 manifest nodes read\n"
    );
    let out = ok(cairn(&repo, &["diff", "--stat", "vm@2", "vm@1"]));
    assert_eq!(
        out,
        "2 ranges, 12.0 KiB changed, +3 chunks, -1 chunk, 6 manifest nodes read\n"
    );
    let out = ok(cairn(&repo, &["diff", "vm@2", "vm@2"]));
    assert_eq!(
        out,
        "0 ranges, 0 B changed, +0 chunks, -0 chunks, 0 manifest nodes read\n"
    );

    let out = cairn(&repo, &["diff", "vm@1", "vm@3"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        String::from_utf8_lossy(&out.stderr).trim_end(),
        "cairn: error: vm@3: image \"vm\" has no version 3 (its newest is vm@2)"
    );

    // Versions of different sizes: the size change is said, and the grown part compares as
    // zeros followed by the new data.
    let mut v3 = v2.clone();
    v3.resize(300_000, 0);
    v3[280_000..284_096].copy_from_slice(&noise(4096, 3));
    commit(&repo, dir.path(), &v3);
    let out = ok(cairn(&repo, &["diff", "--stat", "vm@2", "vm@3"]));
    assert!(
        out.starts_with(
            "size 195.3 KiB → 293.0 KiB (200000 → 300000 bytes; the smaller compared as if \
             zero-extended)\n"
        ),
        "{out}"
    );
    let got: Value =
        serde_json::from_str(&ok(cairn(&repo, &["--json", "diff", "vm@3", "vm@2"]))).unwrap();
    assert_eq!(
        (got["a_size_bytes"].as_u64(), got["b_size_bytes"].as_u64()),
        (Some(300_000), Some(200_000))
    );
}

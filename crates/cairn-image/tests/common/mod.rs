//! Shared helpers of the qcow2 tests: the real qemu-img / qemu-io, deterministic raw images
//! and allocation-map checks.
#![allow(dead_code)]

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::Command;

use cairn_image::MapRun;

pub const KIB: u64 = 1024;
pub const MIB: u64 = 1024 * 1024;

/// Runs a QEMU tool; a missing binary or a failure fails the test with the tool's output.
pub fn run(tool: &str, args: &[&str]) -> String {
    let out = Command::new(tool).args(args).output().unwrap_or_else(|e| {
        panic!("cannot run {tool} ({e}): these tests need QEMU's tools (Debian: apt-get install qemu-utils)")
    });
    assert!(
        out.status.success(),
        "{tool} {args:?} failed: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn qemu_img(args: &[&str]) -> String {
    run("qemu-img", args)
}

pub fn qemu_io(args: &[&str]) -> String {
    run("qemu-io", args)
}

pub fn s(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

/// splitmix64: a small deterministic PRNG.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let x = self.next().to_le_bytes();
            chunk.copy_from_slice(&x[..chunk.len()]);
        }
    }
}

/// Writes a sparse raw image of `size` bytes: segments of random bytes, compressible text,
/// holes, written zeros and lone nonzero bytes inside zeros. Returns its contents.
pub fn make_raw(path: &Path, size: u64, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed);
    let mut data = vec![0u8; size as usize];
    let file = File::create(path).unwrap();
    let mut pos = 0u64;
    while pos < size {
        let len = (1 + rng.below(300 * KIB)).min(size - pos);
        let seg = &mut data[pos as usize..(pos + len) as usize];
        match rng.below(20) {
            0..=7 => rng.fill(seg),
            8..=11 => {
                let words: [&[u8]; 4] = [b"cairn ", b"qcow2 ", b"cluster ", b"backing\n"];
                let mut i = 0;
                while i < seg.len() {
                    let w = words[rng.below(4) as usize];
                    let n = w.len().min(seg.len() - i);
                    seg[i..i + n].copy_from_slice(&w[..n]);
                    i += n;
                }
            }
            12..=15 => {} // a hole: never written
            16..=18 => {} // zeros, written below
            _ => {
                for _ in 0..4 {
                    let at = rng.below(len) as usize;
                    seg[at] = 1 + rng.below(255) as u8;
                }
            }
        }
        if !seg.iter().all(|&b| b == 0) || rng.below(2) == 0 {
            file.write_all_at(seg, pos).unwrap();
        }
        pos += len;
    }
    file.set_len(size).unwrap();
    data
}

/// Checks the invariants of an allocation map (see `cairn_image::contract::check_map`).
pub fn check_map(runs: &[MapRun], size: u64, chain_len: usize, raw: Option<&[u8]>) {
    cairn_image::contract::check_map("image", runs, size, chain_len, raw);
}

/// The run containing `offset`.
pub fn run_at(runs: &[MapRun], offset: u64) -> MapRun {
    *runs
        .iter()
        .find(|r| r.start <= offset && offset < r.end())
        .unwrap_or_else(|| panic!("no run at 0x{offset:x}"))
}

fn be64(b: &[u8], at: u64) -> u64 {
    u64::from_be_bytes(b[at as usize..at as usize + 8].try_into().unwrap())
}

/// Counts the compressed clusters of a valid qcow2 file (a test-side walk of its tables).
pub fn count_compressed(bytes: &[u8]) -> usize {
    let cluster_bits = u32::from_be_bytes(bytes[20..24].try_into().unwrap());
    let cs = 1u64 << cluster_bits;
    let l1_size = u32::from_be_bytes(bytes[36..40].try_into().unwrap()) as u64;
    let l1_off = be64(bytes, 40);
    let mut n = 0;
    for i in 0..l1_size {
        let l2 = be64(bytes, l1_off + 8 * i) & 0x00ff_ffff_ffff_fe00;
        if l2 != 0 {
            n += (0..cs / 8)
                .filter(|j| be64(bytes, l2 + 8 * j) & (1 << 62) != 0)
                .count();
        }
    }
    n
}

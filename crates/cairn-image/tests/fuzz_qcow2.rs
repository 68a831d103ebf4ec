//! Mutation fuzzing of the qcow2 reader: small valid images made by qemu-img, mutated at the
//! places a parser trusts (header fields, L1 and L2 entries, compressed data, the length),
//! must give `Ok` or `Err` from `parse_bytes`, `open`, `map` and `read_at`: never a panic, a
//! hang or a huge allocation. `CAIRN_FUZZ_CASES` raises the number of cases (default 256).

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cairn_image::qcow2::{OpenOptions, Qcow2Image};
use cairn_image::DiskImage;
use common::*;
use proptest::prelude::*;
use proptest::sample::Index;

/// A seed image and where its structures are.
struct Seed {
    name: String,
    bytes: Vec<u8>,
    /// Byte ranges worth mutating: header, header extensions, L1 table, L2 tables,
    /// compressed data.
    regions: Vec<(u64, u64)>,
    /// Offsets of 8-byte table entries (L1 and allocated L2 entries).
    entries: Vec<u64>,
}

struct Corpus {
    _dir: tempfile::TempDir,
    dir: PathBuf,
    seeds: Vec<Seed>,
}

fn be64(b: &[u8], at: u64) -> u64 {
    u64::from_be_bytes(b[at as usize..at as usize + 8].try_into().unwrap())
}

fn be32(b: &[u8], at: u64) -> u64 {
    u32::from_be_bytes(b[at as usize..at as usize + 4].try_into().unwrap()) as u64
}

/// Finds the structures of a valid image (a test-side parse, trusting the image).
fn seed(name: &str, path: &Path) -> Seed {
    let bytes = fs::read(path).unwrap();
    Qcow2Image::parse_bytes(&bytes).unwrap_or_else(|e| panic!("seed {name}: {e}"));
    let cluster_bits = be32(&bytes, 20);
    let cs = 1u64 << cluster_bits;
    let l1_size = be32(&bytes, 36);
    let l1_off = be64(&bytes, 40);
    let mut regions = vec![(0, 112), (72, 512.min(bytes.len() as u64))];
    let mut entries = Vec::new();
    if l1_size > 0 {
        regions.push((l1_off, l1_off + 8 * l1_size));
    }
    for i in 0..l1_size {
        entries.push(l1_off + 8 * i);
        let l2 = be64(&bytes, l1_off + 8 * i) & 0x00ff_ffff_ffff_fe00;
        if l2 == 0 {
            continue;
        }
        regions.push((l2, l2 + cs));
        for j in 0..cs / 8 {
            let e = be64(&bytes, l2 + 8 * j);
            if e == 0 {
                continue;
            }
            entries.push(l2 + 8 * j);
            if e & (1 << 62) != 0 {
                let x = 62 - (cluster_bits - 8);
                let host = e & ((1 << x) - 1);
                regions.push((host, (host + 64).min(bytes.len() as u64)));
            }
        }
    }
    Seed {
        name: name.to_string(),
        bytes,
        regions,
        entries,
    }
}

fn corpus() -> &'static Corpus {
    static CORPUS: OnceLock<Corpus> = OnceLock::new();
    CORPUS.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        let d = tmp.path().to_path_buf();
        let raw = d.join("base.raw");
        make_raw(&raw, 256 * KIB, 77);
        let mut seeds = Vec::new();
        let mut convert = |name: &str, opts: &[&str]| {
            let out = d.join(name);
            let mut args = vec!["convert", "-f", "raw", "-O", "qcow2"];
            args.extend_from_slice(opts);
            args.push(s(&raw));
            args.push(s(&out));
            qemu_img(&args);
            seeds.push(seed(name, &out));
        };
        convert("v3-4k.qcow2", &["-o", "cluster_size=4096"]);
        convert("v2-1k.qcow2", &["-o", "compat=0.10,cluster_size=1024"]);
        convert("v3-deflate.qcow2", &["-c", "-o", "cluster_size=4096"]);
        convert(
            "v3-zstd.qcow2",
            &["-c", "-o", "cluster_size=4096,compression_type=zstd"],
        );
        convert(
            "v2-deflate.qcow2",
            &["-c", "-o", "compat=0.10,cluster_size=2048"],
        );
        convert("v3-64k.qcow2", &[]);
        // Overlays with a backing name, data and zero clusters.
        for (name, compat) in [("v3-overlay.qcow2", "1.1"), ("v2-overlay.qcow2", "0.10")] {
            let out = d.join(name);
            qemu_img(&[
                "create",
                "-f",
                "qcow2",
                "-o",
                &format!("compat={compat},cluster_size=4096"),
                "-b",
                "base.raw",
                "-F",
                "raw",
                s(&out),
            ]);
            qemu_io(&["-f", "qcow2", "-c", "write -P 0x42 8k 12k", s(&out)]);
            qemu_io(&["-f", "qcow2", "-c", "write -z 64k 16k", s(&out)]);
            qemu_io(&["-f", "qcow2", "-c", "write -z -u 128k 8k", s(&out)]);
            seeds.push(seed(name, &out));
        }
        Corpus {
            dir: d,
            _dir: tmp,
            seeds,
        }
    })
}

/// Offsets of header fields, with their widths.
const FIELDS: &[(u64, usize)] = &[
    (4, 4),   // version
    (8, 8),   // backing_file_offset
    (16, 4),  // backing_file_size
    (20, 4),  // cluster_bits
    (24, 8),  // size
    (32, 4),  // crypt_method
    (36, 4),  // l1_size
    (40, 8),  // l1_table_offset
    (48, 8),  // refcount_table_offset
    (56, 4),  // refcount_table_clusters
    (60, 4),  // nb_snapshots
    (64, 8),  // snapshots_offset
    (72, 8),  // incompatible_features
    (80, 8),  // compatible_features
    (96, 4),  // refcount_order
    (100, 4), // header_length
    (104, 1), // compression_type
];

/// A value that is often interesting for a field of a file of `len` bytes.
fn value(pick: u64, random: u64, len: u64) -> u64 {
    match pick % 12 {
        0 => 0,
        1 => 1,
        2 => u64::MAX,
        3 => 1 << 63,
        4 => random % 64,
        5 => len,
        6 => len.wrapping_sub(random % 4096),
        7 => random & !0xfff,
        8 => 1u64 << (random % 64),
        9 => random | (1 << 62),
        10 => (random % len.max(1)) & !511,
        _ => random,
    }
}

type Mutation = (u8, Index, Index, u64, u64);

fn mutate(seed: &Seed, mutations: &[Mutation]) -> Vec<u8> {
    let mut b = seed.bytes.clone();
    for &(kind, region, at, pick, random) in mutations {
        let len = b.len() as u64;
        if len == 0 {
            break;
        }
        let (rs, re) = seed.regions[region.index(seed.regions.len())];
        let pos = if re > rs {
            rs + at.index((re - rs) as usize) as u64
        } else {
            rs
        };
        match kind % 7 {
            0 => {
                if pos < len {
                    b[pos as usize] ^= 1 << (random % 8);
                }
            }
            1 => {
                if pos < len {
                    b[pos as usize] = random as u8;
                }
            }
            2 => {
                let (off, width) = FIELDS[at.index(FIELDS.len())];
                let v = value(pick, random, len).to_be_bytes();
                let end = (off as usize + width).min(b.len());
                if (off as usize) < end {
                    let n = end - off as usize;
                    b[off as usize..end].copy_from_slice(&v[8 - width..8 - width + n]);
                }
            }
            3 => {
                // An L1 or L2 entry.
                if !seed.entries.is_empty() {
                    let e = seed.entries[at.index(seed.entries.len())] as usize;
                    if e + 8 <= b.len() {
                        let v = value(pick, random, len);
                        b[e..e + 8].copy_from_slice(&v.to_be_bytes());
                    }
                }
            }
            4 => {
                // Truncate somewhere in a region, or anywhere.
                let cut = if pick % 2 == 0 { pos } else { random % len };
                b.truncate(cut as usize);
            }
            5 => {
                // Flip a bit of an entry (reserved bits, the compressed flag, sizes…).
                if !seed.entries.is_empty() {
                    let e = seed.entries[at.index(seed.entries.len())] as usize;
                    let bit = random % 64;
                    if e + 8 <= b.len() {
                        b[e + 7 - (bit / 8) as usize] ^= 1 << (bit % 8);
                    }
                }
            }
            _ => {
                // Random bytes over a run of a region.
                let n = (pick % 32) as usize;
                let mut r = Rng(random);
                for i in 0..n {
                    let p = pos as usize + i;
                    if p < b.len() {
                        b[p] = r.next() as u8;
                    }
                }
            }
        }
    }
    b
}

/// Everything a caller may do with an image: none of it may panic.
fn exercise(bytes: &[u8], dir: &Path, name: &str) {
    let _ = Qcow2Image::parse_bytes(bytes);
    // Written beside the seeds, so that a backing name still resolves to base.raw.
    let path = dir.join(format!("mut-{}-{name}", std::process::id()));
    fs::write(&path, bytes).unwrap();
    let opened = Qcow2Image::open(&path, OpenOptions::default());
    if let Ok(img) = opened {
        let size = img.size();
        if let Ok(runs) = img.map() {
            check_map(&runs, size, img.layers().len(), None);
        }
        let _ = img.layers();
        let _ = img.describe();
        // The whole guest when it is small; its start and end otherwise.
        let mut buf = vec![0u8; MIB as usize];
        let ranges: Vec<(u64, u64)> = if size <= 16 * MIB {
            (0..size.div_ceil(MIB))
                .map(|i| (i * MIB, MIB.min(size - i * MIB)))
                .collect()
        } else {
            vec![(0, MIB), (size - MIB, MIB), (size / 2, MIB)]
        };
        for (off, len) in ranges {
            let _ = img.read_at(&mut buf[..len as usize], off);
        }
    }
    fs::remove_file(&path).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cairn_testkit::fuzz_cases(),
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn mutated_images_never_panic(
        which in any::<Index>(),
        mutations in prop::collection::vec(
            (any::<u8>(), any::<Index>(), any::<Index>(), any::<u64>(), any::<u64>()),
            1..8,
        ),
    ) {
        let corpus = corpus();
        let seed = &corpus.seeds[which.index(corpus.seeds.len())];
        let bytes = mutate(seed, &mutations);
        exercise(&bytes, &corpus.dir, &seed.name);
    }

    #[test]
    fn random_bytes_after_the_magic_never_panic(
        version in prop_oneof![Just(2u32), Just(3u32), any::<u32>()],
        cluster_bits in prop_oneof![9u32..=21, any::<u32>()],
        rest in prop::collection::vec(any::<u8>(), 0..8192),
    ) {
        let mut bytes = b"QFI\xfb".to_vec();
        bytes.extend_from_slice(&version.to_be_bytes());
        bytes.extend_from_slice(&rest);
        if bytes.len() >= 24 {
            bytes[20..24].copy_from_slice(&cluster_bits.to_be_bytes());
        }
        let corpus = corpus();
        exercise(&bytes, &corpus.dir, "random");
    }
}

/// The seeds themselves read like qemu-img reads them.
#[test]
fn seeds_read_as_qemu_reads_them() {
    let corpus = corpus();
    for seed in &corpus.seeds {
        let path = corpus.dir.join(&seed.name);
        let img = Qcow2Image::open(&path, OpenOptions::default()).unwrap();
        let out = corpus.dir.join(format!("{}.out", seed.name));
        qemu_img(&["convert", "-O", "raw", s(&path), s(&out)]);
        let want = fs::read(&out).unwrap();
        let mut got = vec![0u8; img.size() as usize];
        img.read_at(&mut got, 0).unwrap();
        assert!(got == want, "{} reads differently", seed.name);
        check_map(
            &img.map().unwrap(),
            img.size(),
            img.layers().len(),
            Some(&want),
        );
    }
}

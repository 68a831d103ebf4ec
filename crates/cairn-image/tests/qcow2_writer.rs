//! The compact qcow2 writer, checked with QEMU's own tools: `qemu-img check` (no errors, no
//! leaks), `qemu-img compare` against the intended raw content, `qemu-img map` (unwritten
//! clusters are not data) and `qemu-img info`. qemu-img is required: without it these tests
//! fail.

use std::collections::BTreeSet;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use cairn_image::qcow2::Qcow2Writer;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// SplitMix64: a small deterministic generator, enough for test patterns.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
    fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(len + 8);
        while v.len() < len {
            v.extend_from_slice(&self.next().to_le_bytes());
        }
        v.truncate(len);
        v
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = (self.next() % (i as u64 + 1)) as usize;
            v.swap(i, j);
        }
    }
}

/// Runs qemu-img; returns (exit code, stdout + stderr). Panics if qemu-img cannot be run.
fn qemu_img(args: &[&str]) -> (i32, String) {
    let out = Command::new("qemu-img")
        .args(args)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run qemu-img ({e}): the qcow2 writer tests need QEMU's qemu-img on PATH \
             (Debian/Ubuntu: apt-get install qemu-utils)"
            )
        });
    let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.push_str(&String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn open_rw(path: &Path) -> File {
    OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .unwrap()
}

type Write = (u64, Vec<u8>);

/// Writes `writes` through a `Qcow2Writer` from `threads` threads (each takes the next write
/// in list order) and the same bytes into a sparse raw file; returns (qcow2, raw) paths.
fn build(
    dir: &Path,
    name: &str,
    size: u64,
    cluster_bits: u32,
    writes: &[Write],
    threads: usize,
) -> (PathBuf, PathBuf) {
    let qcow2 = dir.join(format!("{name}.qcow2"));
    let raw = dir.join(format!("{name}.raw"));
    let writer = Qcow2Writer::create(open_rw(&qcow2), &qcow2, size, cluster_bits).unwrap();
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some((offset, data)) = writes.get(i) else {
                    break;
                };
                writer.write_at(data, *offset).unwrap();
            });
        }
    });
    writer.finish().unwrap();

    let raw_file = open_rw(&raw);
    raw_file.set_len(size).unwrap();
    for (offset, data) in writes {
        raw_file.write_all_at(data, *offset).unwrap();
    }
    (qcow2, raw)
}

/// The guest clusters that must be allocated: those where some written byte is non-zero.
fn data_clusters(writes: &[Write], cluster_bits: u32) -> BTreeSet<u64> {
    let mut set = BTreeSet::new();
    for (offset, data) in writes {
        for (i, &b) in data.iter().enumerate() {
            if b != 0 {
                set.insert((offset + i as u64) >> cluster_bits);
            }
        }
    }
    set
}

/// Merged `[start, end)` byte ranges of a set of clusters, clipped to `size`.
fn cluster_ranges(clusters: &BTreeSet<u64>, cluster_bits: u32, size: u64) -> Vec<(u64, u64)> {
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for &c in clusters {
        let (start, end) = (c << cluster_bits, ((c + 1) << cluster_bits).min(size));
        match ranges.last_mut() {
            Some(last) if last.1 == start => last.1 = end,
            _ => ranges.push((start, end)),
        }
    }
    ranges
}

/// The value of `"key": value` in one flat JSON object.
fn json_field<'a>(obj: &'a str, key: &str) -> &'a str {
    let pat = format!("\"{key}\":");
    let at = obj
        .find(&pat)
        .unwrap_or_else(|| panic!("no {key} in {obj}"));
    let rest = &obj[at + pat.len()..];
    rest[..rest.find([',', '}']).unwrap_or(rest.len())].trim()
}

/// Merged `[start, end)` ranges that `qemu-img map` reports as data.
fn mapped_data(qcow2: &Path) -> Vec<(u64, u64)> {
    let (code, out) = qemu_img(&["map", "--output=json", "-f", "qcow2", s(qcow2)]);
    assert_eq!(code, 0, "qemu-img map failed: {out}");
    let mut ranges: Vec<(u64, u64)> = Vec::new();
    for obj in out.split('{').skip(1) {
        if json_field(obj, "data") != "true" {
            continue;
        }
        let start: u64 = json_field(obj, "start").parse().unwrap();
        let end = start + json_field(obj, "length").parse::<u64>().unwrap();
        match ranges.last_mut() {
            Some(last) if last.1 == start => last.1 = end,
            _ => ranges.push((start, end)),
        }
    }
    ranges
}

fn header_u32(qcow2: &Path, at: u64) -> u32 {
    let mut b = [0u8; 4];
    File::open(qcow2)
        .unwrap()
        .read_exact_at(&mut b, at)
        .unwrap();
    u32::from_be_bytes(b)
}

/// Checks the image with qemu-img and returns its host file length in clusters, which must
/// be exactly the header, the data clusters, the L2 and L1 tables and the refcount clusters.
/// (QEMU rounds virtual sizes up to whole 512-byte sectors.)
fn verify(qcow2: &Path, raw: &Path, size: u64, cluster_bits: u32, writes: &[Write]) -> u64 {
    let (code, out) = qemu_img(&["check", "-f", "qcow2", s(qcow2)]);
    assert!(
        code == 0 && out.contains("No errors were found on the image."),
        "qemu-img check {} (exit {code}):\n{out}",
        qcow2.display()
    );
    assert!(!out.contains("leaked"), "{out}");

    let (code, out) = qemu_img(&["info", "--output=json", s(qcow2)]);
    assert_eq!(code, 0, "{out}");
    let compact: String = out.chars().filter(|c| !c.is_whitespace()).collect();
    for want in [
        "\"format\":\"qcow2\"".to_string(),
        "\"compat\":\"1.1\"".to_string(),
        format!("\"virtual-size\":{},", size.next_multiple_of(512)),
        format!("\"cluster-size\":{},", 1u64 << cluster_bits),
        "\"refcount-bits\":16".to_string(),
    ] {
        assert!(
            compact.contains(&want),
            "qemu-img info lacks {want}:\n{out}"
        );
    }

    let (code, out) = qemu_img(&["compare", "-f", "qcow2", "-F", "raw", s(qcow2), s(raw)]);
    assert!(
        code == 0 && out.contains("Images are identical."),
        "qemu-img compare (exit {code}):\n{out}"
    );

    let clusters = data_clusters(writes, cluster_bits);
    assert_eq!(
        mapped_data(qcow2),
        cluster_ranges(&clusters, cluster_bits, size.next_multiple_of(512)),
        "qemu-img map data ranges"
    );

    let cluster = 1u64 << cluster_bits;
    let len = std::fs::metadata(qcow2).unwrap().len();
    assert_eq!(len % cluster, 0, "file length {len} is not whole clusters");
    let l2_bits = cluster_bits - 3;
    let l2_tables = clusters
        .iter()
        .map(|c| c >> l2_bits)
        .collect::<BTreeSet<_>>()
        .len() as u64;
    let l1_clusters = (size.div_ceil(cluster << l2_bits) * 8).div_ceil(cluster);
    let before_refcounts = 1 + clusters.len() as u64 + l2_tables + l1_clusters;
    // The least number of refcount clusters (blocks + table) that covers everything,
    // themselves included.
    let mut refcounts = 0;
    loop {
        let blocks = (before_refcounts + refcounts).div_ceil(cluster / 2);
        let needed = blocks + blocks.div_ceil(cluster / 8).max(1);
        if needed == refcounts {
            break;
        }
        refcounts = needed;
    }
    let n = len / cluster;
    assert_eq!(
        n,
        before_refcounts + refcounts,
        "{}: header + {} data + {l2_tables} L2 + {l1_clusters} L1 + {refcounts} refcount clusters",
        qcow2.display(),
        clusters.len()
    );
    n
}

/// Splits `[start, start + len)` into writes of 1..=max_piece bytes (zeros or random).
fn pieces(rng: &mut Rng, start: u64, len: u64, max_piece: u64, zeros: bool) -> Vec<Write> {
    let mut out = Vec::new();
    let mut pos = start;
    while pos < start + len {
        let n = rng.range(1, max_piece).min(start + len - pos);
        let data = if zeros {
            vec![0u8; n as usize]
        } else {
            rng.bytes(n as usize)
        };
        out.push((pos, data));
        pos += n;
    }
    out
}

#[test]
fn random_pattern_with_holes_unaligned_out_of_order_four_threads() {
    let dir = tempfile::tempdir().unwrap();
    let cluster_bits = 16;
    let size = 48 * MIB + 12_345;
    let mut rng = Rng(1);
    let mut writes = Vec::new();
    let mut pos = 0;
    while pos < size {
        let len = rng.range(1, 400 * KIB).min(size - pos);
        match rng.range(0, 9) {
            0..=3 => {} // a hole
            4 => writes.extend(pieces(&mut rng, pos, len, 200 * KIB, true)),
            _ => writes.extend(pieces(&mut rng, pos, len, 150 * KIB, false)),
        }
        pos += len;
    }
    rng.shuffle(&mut writes);
    let (qcow2, raw) = build(dir.path(), "random", size, cluster_bits, &writes, 4);
    let clusters = verify(&qcow2, &raw, size, cluster_bits, &writes);
    let data = data_clusters(&writes, cluster_bits).len() as u64;
    assert!(data > 100, "the pattern should have data ({data} clusters)");
    // Header + data + 1 L2 table + 1 L1 cluster + 1 refcount block + 1 refcount table.
    assert_eq!(clusters, data + 5);
}

#[test]
fn zero_full_cluster_writes_allocate_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let cluster_bits = 16;
    let cluster = 1u64 << cluster_bits;
    let size = 4 * MIB;
    let writes: Vec<Write> = vec![
        (0, vec![0; cluster as usize]),                        // one cluster
        (cluster, vec![0; 3 * cluster as usize]),              // several
        (8 * cluster, vec![0; (size - 8 * cluster) as usize]), // to the end
        (4 * cluster + 100, vec![0; 1000]),                    // unaligned pieces of zeros too
        (5 * cluster - 10, vec![0; 20]),
    ];
    let (qcow2, raw) = build(dir.path(), "zeros", size, cluster_bits, &writes, 2);
    assert_eq!(mapped_data(&qcow2), vec![]);
    // Header, L1 table, one refcount block, the refcount table: no L2 table, no data.
    assert_eq!(verify(&qcow2, &raw, size, cluster_bits, &writes), 4);
    assert_eq!(std::fs::metadata(&qcow2).unwrap().len(), 4 * cluster);
}

#[test]
fn zeros_written_over_data_are_written() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("over.qcow2");
    let writer = Qcow2Writer::create(open_rw(&path), &path, 4 * KIB, 9).unwrap();
    writer.write_at(&[7u8; 1024], 0).unwrap();
    writer.write_at(&[0u8; 512], 512).unwrap();
    writer.finish().unwrap();
    let raw = dir.path().join("over.raw");
    let raw_file = open_rw(&raw);
    raw_file.set_len(4 * KIB).unwrap();
    raw_file.write_all_at(&[7u8; 512], 0).unwrap();
    let (code, out) = qemu_img(&["compare", "-f", "qcow2", "-F", "raw", s(&path), s(&raw)]);
    assert_eq!(code, 0, "{out}");
    // Both clusters stay allocated (the second now holds zeros).
    assert_eq!(mapped_data(&path), vec![(0, 1024)]);
}

#[test]
fn sizes_and_cluster_sizes() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng(3);
    for cluster_bits in [9u32, 12, 16, 21] {
        let cluster = 1u64 << cluster_bits;
        for size in [0, 1, cluster - 1, cluster + 1, 3 * cluster + cluster / 2] {
            let mut writes = pieces(&mut rng, 0, size, cluster + 7, false);
            rng.shuffle(&mut writes);
            let name = format!("c{cluster_bits}-s{size}");
            let (qcow2, raw) = build(dir.path(), &name, size, cluster_bits, &writes, 3);
            verify(&qcow2, &raw, size, cluster_bits, &writes);
            if size == 0 {
                // Header, one refcount block and the refcount table; no L1 table.
                assert_eq!(std::fs::metadata(&qcow2).unwrap().len(), 3 * cluster);
                assert_eq!(header_u32(&qcow2, 36), 0, "l1_size");
            }
        }
    }
}

#[test]
fn sixty_four_gib_sparse() {
    let dir = tempfile::tempdir().unwrap();
    let size = 64 * GIB;
    let mut rng = Rng(4);
    for cluster_bits in [9u32, 12, 16, 21] {
        let started = Instant::now();
        let mut writes = vec![
            (0, rng.bytes(1000)),
            (size / 2 - 500, rng.bytes(1000)), // straddles a cluster boundary
            (size - 1, vec![0xa5]),            // the last byte
        ];
        rng.shuffle(&mut writes);
        let name = format!("big-c{cluster_bits}");
        let (qcow2, raw) = build(dir.path(), &name, size, cluster_bits, &writes, 2);
        let written = started.elapsed();
        let clusters = verify(&qcow2, &raw, size, cluster_bits, &writes);
        let len = std::fs::metadata(&qcow2).unwrap().len();
        let l1_bytes = size / (1u64 << (2 * cluster_bits - 3)) * 8;
        assert!(
            // The L1 table, its refcounts (2 bytes per 8-byte entry's cluster, at most
            // l1_bytes / 4 for 512-byte clusters, and their table) and a few clusters.
            len <= l1_bytes + l1_bytes / 64 + 16 * (1 << cluster_bits),
            "{len} bytes ({clusters} clusters)"
        );
        eprintln!(
            "64 GiB, clusters of 2^{cluster_bits}: {len} bytes, written in {written:?}, \
             verified in {:?}",
            started.elapsed() - written
        );
    }
}

/// With 512-byte clusters a refcount block covers 256 clusters and a refcount table cluster
/// 64 blocks: several megabytes of scattered data need more than one of each.
#[test]
fn refcounts_of_many_blocks_cover_themselves() {
    let dir = tempfile::tempdir().unwrap();
    let cluster_bits = 9;
    let size = GIB;
    let mut rng = Rng(5);
    let slot = 64 * KIB;
    let mut slots: Vec<u64> = (0..size / slot).collect();
    rng.shuffle(&mut slots);
    let writes: Vec<Write> = slots[..2048]
        .iter()
        .map(|&s| {
            let len = 4 * KIB;
            (s * slot + rng.range(0, slot - len), rng.bytes(len as usize))
        })
        .collect();
    let (qcow2, raw) = build(dir.path(), "fixpoint", size, cluster_bits, &writes, 4);
    let clusters = verify(&qcow2, &raw, size, cluster_bits, &writes);
    let table_clusters = header_u32(&qcow2, 56) as u64;
    assert!(clusters > 64 * 256, "{clusters} clusters");
    assert_eq!(table_clusters, clusters.div_ceil(256).div_ceil(64));
    assert!(table_clusters >= 2);
}

/// Every host-file length around the points where one more refcount block (or refcount
/// table cluster) is needed.
#[test]
fn refcount_block_boundaries() {
    let dir = tempfile::tempdir().unwrap();
    let cluster_bits = 9;
    let cluster = 512u64;
    // 64 L1 entries (one L1 cluster) of 32 KiB each.
    let size = 2 * MIB;
    let mut rng = Rng(6);
    for data_clusters in (245..=262).chain(490..=520) {
        let writes: Vec<Write> = (0..data_clusters)
            .map(|c| (c * cluster, rng.bytes(cluster as usize)))
            .collect();
        let name = format!("boundary-{data_clusters}");
        let (qcow2, raw) = build(dir.path(), &name, size, cluster_bits, &writes, 1);
        let clusters = verify(&qcow2, &raw, size, cluster_bits, &writes);
        let blocks = clusters - 1 - data_clusters - data_clusters.div_ceil(64) - 1 - 1;
        assert_eq!(
            blocks,
            clusters.div_ceil(256),
            "{data_clusters} data clusters"
        );
    }
}

#[test]
fn writes_spanning_many_clusters() {
    let dir = tempfile::tempdir().unwrap();
    let mut rng = Rng(7);
    for cluster_bits in [9u32, 16] {
        let size = 20 * MIB + 3;
        let writes = vec![
            (1, rng.bytes((5 * MIB) as usize)),
            (7 * MIB + 333, rng.bytes((13 * MIB - 333 + 3) as usize)),
        ];
        let name = format!("span-c{cluster_bits}");
        let (qcow2, raw) = build(dir.path(), &name, size, cluster_bits, &writes, 2);
        verify(&qcow2, &raw, size, cluster_bits, &writes);
    }
}

#[test]
fn write_past_the_end_is_an_error() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("short.qcow2");
    let writer = Qcow2Writer::create(open_rw(&path), &path, MIB, 16).unwrap();
    let err = writer.write_at(&[1, 2, 3, 4], MIB - 2).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "write {}: 4 bytes at offset 1048574 go past the end of the 1048576-byte image",
            path.display()
        )
    );
    let err = writer.write_at(&[1], u64::MAX).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "write {}: 1 bytes at offset 18446744073709551615 go past the end of the \
             1048576-byte image",
            path.display()
        )
    );
    // Up to the last byte is fine, and an empty write at the end too.
    writer.write_at(&[1, 2], MIB - 2).unwrap();
    writer.write_at(&[], MIB).unwrap();
    writer.finish().unwrap();
    let (code, out) = qemu_img(&["check", "-f", "qcow2", s(&path)]);
    assert_eq!(code, 0, "{out}");

    let err = Qcow2Writer::create(open_rw(&path), &path, MIB, 8)
        .err()
        .unwrap();
    assert_eq!(
        err.to_string(),
        format!(
            "{}: a qcow2 cluster size of 2^8 bytes (cluster_bits must be 9..=21) is not \
             supported",
            path.display()
        )
    );
}

/// `cargo test --release --test qcow2_writer -- --ignored --nocapture throughput`: writes
/// 1 GiB of incompressible data in unaligned 16..256 KiB pieces, out of order, from four
/// threads, and reports MB/s.
// The same writer runs in CI on real restores through `scripts/formats.py` and on every case
// above.
#[test]
#[ignore = "a measurement run by hand (it prints a rate; speed is never asserted); writing 1 GiB \
            would add half a minute of disk traffic to every CI run"]
fn throughput_one_gib() {
    let dir = tempfile::tempdir().unwrap();
    let size = GIB;
    let mut rng = Rng(8);
    let pool = rng.bytes((64 * MIB) as usize);
    let mut spans = Vec::new();
    let mut pos = 0;
    while pos < size {
        let len = rng.range(16 * KIB, 256 * KIB).min(size - pos);
        spans.push((pos, len));
        pos += len;
    }
    rng.shuffle(&mut spans);
    let path = dir.path().join("big.qcow2");
    let started = Instant::now();
    let writer = Qcow2Writer::create(open_rw(&path), &path, size, 16).unwrap();
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(offset, len)) = spans.get(i) else {
                    break;
                };
                let from = (offset % (pool.len() as u64 - len)) as usize;
                writer
                    .write_at(&pool[from..from + len as usize], offset)
                    .unwrap();
            });
        }
    });
    let written = started.elapsed();
    writer.finish().unwrap();
    let total = started.elapsed();
    eprintln!(
        "1 GiB in {} writes: write_at {:?}, finish (metadata + fsync) {:?}: {:.0} MB/s",
        spans.len(),
        written,
        total - written,
        size as f64 / total.as_secs_f64() / 1e6
    );
    let (code, out) = qemu_img(&["check", "-f", "qcow2", s(&path)]);
    assert_eq!(code, 0, "{out}");
    std::fs::remove_file(&path).unwrap();

    // Baseline: the same writes into a raw file.
    let raw = dir.path().join("big.raw");
    let started = Instant::now();
    let file = open_rw(&raw);
    file.set_len(size).unwrap();
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&(offset, len)) = spans.get(i) else {
                    break;
                };
                let from = (offset % (pool.len() as u64 - len)) as usize;
                file.write_all_at(&pool[from..from + len as usize], offset)
                    .unwrap();
            });
        }
    });
    file.sync_all().unwrap();
    let total = started.elapsed();
    eprintln!(
        "raw baseline: pwrite + fsync {total:?}: {:.0} MB/s",
        size as f64 / total.as_secs_f64() / 1e6
    );
}

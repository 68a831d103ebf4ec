//! `cairn-groups`: the format 2 study — what dedup at file-system block size
//! inside compressed chunk groups would store, before the format is changed.
//!
//! ```text
//! cairn-groups --chunk 4096,8192,16384 --group 0,65536,131072 --level 3 [--skip-test]
//!              [--reads QEMU_TRACE] FILE...
//! ```
//!
//! For every configuration (chunk size × group size × zstd level) the FILEs are "committed" in
//! order into one simulated repository, the way `cairn commit` reads them: fixed chunks over the
//! allocated extents (holes never read), zero chunks skipped, exact dedup by BLAKE3 id over
//! everything committed before. The new chunks of each file, in the order met, are cut into
//! groups of at most `--group` bytes (0: every chunk alone, which is format v1), and each group
//! is compressed as one zstd frame; a group stored raw when compression does not pay. With
//! `--skip-test`, a group whose first 8 KiB do not compress at level 1 to less than 97 % is
//! stored raw without compressing the rest (the cheap estimate the issue asks for).
//!
//! One JSON object per configuration and file on stdout:
//! - `chunks` (non-zero chunks of the file), `new_chunks`, `new_bytes` (their plain bytes);
//! - `groups`, `stored_bytes` (compressed groups as they would sit in packs, without pack
//!   headers or index), `raw_groups` (stored uncompressed), `skipped_groups` (by the estimate);
//! - `compress_cpu_s`: CPU seconds spent in zstd (all threads), `hash_s` wall seconds of BLAKE3 on all cores;
//! - `leaf_extents`: chunk references of the file's leaves (one per non-zero chunk) and
//!   `merged_extents`: the same after merging runs of logically adjacent chunks that sit
//!   back to back in one group (VMAR's extent-merged maps): the two bounds of leaf metadata;
//! - `new_leaves`, `new_leaf_refs`, `new_leaf_runs`: the leaves (1 MiB segments) this file
//!   adds that no earlier leaf equals, their chunk references, and the runs those form when
//!   references to consecutive chunks of one group merge — the leaf metadata actually stored;
//! - with `--reads` (a QEMU `blk_co_preadv` trace of a guest reading the last FILE), on the
//!   last file's line: `guest_read_bytes`, and what a lazy export with a cold cache of whole
//!   groups would fetch — `groups_fetched`, `fetched_bytes` (stored bytes, no read-ahead).
//!
//! Nothing here is cairn's code path: it measures the data, so that the sizes are chosen
//! before the format is written. Figures go to BENCHMARKS.md with the command and the date.
#![forbid(unsafe_code)]

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::process::ExitCode;
use std::time::Instant;

use rayon::prelude::*;
use serde_json::json;

/// Bytes of a group's head compressed by the cheap estimate.
const SAMPLE: usize = 8 * 1024;
/// The estimate's verdict: a sample that does not shrink below this is not compressed.
const SAMPLE_RATIO: f64 = 0.97;

#[derive(Clone, Copy, Debug)]
struct Config {
    chunk: usize,
    /// Bytes per group at most; 0: one chunk per group.
    group: usize,
    level: i32,
    skip_test: bool,
}

/// Where a stored chunk lives: its group and its index there.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Place {
    group: u32,
    slot: u32,
}

/// The simulated repository of one configuration.
struct Repo {
    config: Config,
    chunks: HashMap<[u8; 32], Place>,
    groups: u32,
    /// Stored bytes of every group, by number.
    group_bytes: Vec<u64>,
    /// Chunk index → place, for the file committed last (what a lazy export of it reads).
    last_file: HashMap<u64, Place>,
    /// Leaves stored so far (by a hash of their chunk references): a leaf equal to one
    /// stored before is shared, as content-addressed leaves are.
    leaves: std::collections::HashSet<[u8; 32]>,
}

/// cairn's default segment (one leaf) size.
const SEGMENT: u64 = 1 << 20;

/// The chunk references of one segment, in order: (chunk index, id, place).
type LeafRefs = Vec<(u64, [u8; 32], Place)>;

impl Repo {
    fn new(config: Config) -> Repo {
        Repo {
            config,
            chunks: HashMap::new(),
            groups: 0,
            group_bytes: Vec::new(),
            last_file: HashMap::new(),
            leaves: std::collections::HashSet::new(),
        }
    }

    /// Counts a finished segment's leaf if it is new: its chunk references, and the runs they
    /// form when references to consecutive chunks of one group merge.
    fn finish_leaf(&mut self, refs: &mut LeafRefs, f: &mut FileFigures) {
        if refs.is_empty() {
            return;
        }
        let mut h = blake3::Hasher::new();
        for (index, id, _) in refs.iter() {
            h.update(&index.to_le_bytes());
            h.update(id);
        }
        if self.leaves.insert(*h.finalize().as_bytes()) {
            f.new_leaves += 1;
            f.new_leaf_refs += refs.len() as u64;
            f.new_leaf_runs += 1 + refs
                .windows(2)
                .filter(|w| {
                    let ((i, _, p), (j, _, q)) = (w[0], w[1]);
                    !(i + 1 == j && p.group == q.group && p.slot + 1 == q.slot)
                })
                .count() as u64;
        }
        refs.clear();
    }

    /// Replays a guest's reads `(offset, bytes)` of the file committed last against a cold
    /// cache that holds whole groups: returns (groups fetched, bytes fetched). Zero chunks
    /// and holes cost nothing; no read-ahead.
    fn lazy_reads(&self, reads: &[(u64, u64)]) -> (u64, u64) {
        let c = self.config.chunk as u64;
        let mut fetched = std::collections::HashSet::new();
        let mut bytes = 0;
        for &(offset, len) in reads {
            for index in offset / c..(offset + len).div_ceil(c) {
                if let Some(place) = self.last_file.get(&index) {
                    if fetched.insert(place.group) {
                        bytes += self.group_bytes[place.group as usize];
                    }
                }
            }
        }
        (fetched.len() as u64, bytes)
    }
}

#[derive(Default)]
struct FileFigures {
    chunks: u64,
    new_chunks: u64,
    new_bytes: u64,
    groups: u64,
    stored_bytes: u64,
    raw_groups: u64,
    skipped_groups: u64,
    compress_cpu_s: f64,
    hash_s: f64,
    leaf_extents: u64,
    merged_extents: u64,
    /// Leaves this file adds (segments whose chunk references no earlier leaf had), their
    /// chunk references, and the runs those form (zero runs not counted).
    new_leaves: u64,
    new_leaf_refs: u64,
    new_leaf_runs: u64,
}

/// The chunk indexes of `file` that touch an allocated extent.
fn chunk_indexes(file: &File, size: u64, chunk: usize) -> std::io::Result<Vec<u64>> {
    let extents = cairn_engine::source::data_extents(file, size)?;
    let c = chunk as u64;
    let mut out: Vec<u64> = Vec::new();
    for (start, end) in extents {
        let (first, last) = (start / c, end.div_ceil(c));
        let from = out.last().map_or(first, |&l| first.max(l + 1));
        out.extend(from..last);
    }
    Ok(out)
}

/// Reads the chunks `indexes` (the last one may be short), in batches to bound memory.
fn read_chunks(
    file: &File,
    size: u64,
    chunk: usize,
    indexes: &[u64],
) -> std::io::Result<Vec<Vec<u8>>> {
    indexes
        .iter()
        .map(|&i| {
            let start = i * chunk as u64;
            let len = (size - start).min(chunk as u64) as usize;
            let mut buf = vec![0u8; len];
            file.read_exact_at(&mut buf, start)?;
            Ok(buf)
        })
        .collect()
}

fn is_zero(data: &[u8]) -> bool {
    data.iter().all(|&b| b == 0)
}

/// Compresses one group; returns (stored bytes, stored raw, skipped by the estimate, CPU s).
fn store_group(plain: &[u8], config: Config) -> (u64, bool, bool, f64) {
    let t = Instant::now();
    if config.skip_test && plain.len() > SAMPLE {
        let sample = zstd::bulk::compress(&plain[..SAMPLE], 1).expect("zstd");
        if sample.len() as f64 >= SAMPLE_RATIO * SAMPLE as f64 {
            return (plain.len() as u64, true, true, t.elapsed().as_secs_f64());
        }
    }
    let packed = zstd::bulk::compress(plain, config.level).expect("zstd");
    let secs = t.elapsed().as_secs_f64();
    if packed.len() < plain.len() {
        (packed.len() as u64, false, false, secs)
    } else {
        (plain.len() as u64, true, false, secs)
    }
}

impl Repo {
    fn commit(&mut self, path: &str) -> std::io::Result<FileFigures> {
        let c = self.config;
        let file = File::open(path)?;
        let size = file.metadata()?.len();
        let indexes = chunk_indexes(&file, size, c.chunk)?;
        let mut f = FileFigures::default();
        self.last_file.clear();
        let first_group = self.groups;
        // Chunks of the new groups being filled, in the order met.
        let mut pending: Vec<Vec<u8>> = Vec::new();
        let mut pending_bytes = 0usize;
        let mut groups: Vec<Vec<u8>> = Vec::new();
        // The file's chunk places in logical order (None: a zero chunk or a gap).
        let mut previous: Option<(u64, Place)> = None;
        let mut leaf: LeafRefs = Vec::new();
        let chunks_per_segment = SEGMENT / c.chunk as u64;
        for batch in indexes.chunks(4096) {
            let data = read_chunks(&file, size, c.chunk, batch)?;
            let t = Instant::now();
            // Wall time on all cores (hashing runs in parallel, as in a commit).
            let ids: Vec<Option<[u8; 32]>> = data
                .par_iter()
                .map(|d| (!is_zero(d)).then(|| *blake3::hash(d).as_bytes()))
                .collect();
            f.hash_s += t.elapsed().as_secs_f64();
            for ((&index, d), id) in batch.iter().zip(data).zip(ids) {
                let Some(id) = id else { continue };
                f.chunks += 1;
                let place = match self.chunks.get(&id) {
                    Some(&p) => p,
                    None => {
                        // A commit's groups are its own: its first new chunk opens one.
                        if pending.is_empty() || c.group == 0 || pending_bytes + d.len() > c.group {
                            if !pending.is_empty() {
                                groups.push(pending.concat());
                                pending.clear();
                            }
                            pending_bytes = 0;
                            self.groups += 1;
                        }
                        let p = Place {
                            group: self.groups - 1,
                            slot: pending.len() as u32,
                        };
                        f.new_chunks += 1;
                        f.new_bytes += d.len() as u64;
                        pending_bytes += d.len();
                        pending.push(d);
                        self.chunks.insert(id, p);
                        p
                    }
                };
                self.last_file.insert(index, place);
                if leaf
                    .first()
                    .is_some_and(|l| l.0 / chunks_per_segment != index / chunks_per_segment)
                {
                    self.finish_leaf(&mut leaf, &mut f);
                }
                leaf.push((index, id, place));
                f.leaf_extents += 1;
                let continues = previous.is_some_and(|(i, p)| {
                    i + 1 == index && p.group == place.group && p.slot + 1 == place.slot
                });
                if !continues {
                    f.merged_extents += 1;
                }
                previous = Some((index, place));
            }
        }
        self.finish_leaf(&mut leaf, &mut f);
        if !pending.is_empty() {
            groups.push(pending.concat());
        }
        let stored: Vec<(u64, bool, bool, f64)> =
            groups.par_iter().map(|g| store_group(g, c)).collect();
        f.groups = stored.len() as u64;
        assert_eq!(self.group_bytes.len(), first_group as usize);
        self.group_bytes.extend(stored.iter().map(|s| s.0));
        // Numbers were taken for groups that got no chunk (none today); keep them aligned.
        self.group_bytes.resize(self.groups as usize, 0);
        for (bytes, raw, skipped, secs) in stored {
            f.stored_bytes += bytes;
            f.raw_groups += u64::from(raw);
            f.skipped_groups += u64::from(skipped);
            f.compress_cpu_s += secs;
        }
        Ok(f)
    }
}

/// The guest's reads from a QEMU trace of `blk_co_preadv` (`-trace
/// enable=blk_co_preadv,file=F`): `(offset, bytes)` per line.
fn read_trace(path: &str) -> Result<Vec<(u64, u64)>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{path}: {e}"))?;
    let field = |words: &[&str], name: &str| -> Option<u64> {
        let at = words.iter().position(|w| *w == name)?;
        words.get(at + 1)?.parse().ok()
    };
    text.lines()
        .filter(|l| l.contains("blk_co_preadv"))
        .map(|l| {
            let words: Vec<&str> = l.split_whitespace().collect();
            match (field(&words, "offset"), field(&words, "bytes")) {
                (Some(o), Some(b)) => Ok((o, b)),
                _ => Err(format!("{path}: not a blk_co_preadv line: {l}")),
            }
        })
        .collect()
}

fn list(arg: &str) -> Result<Vec<i64>, String> {
    arg.split(',')
        .map(|s| s.trim().parse::<i64>().map_err(|e| format!("{s:?}: {e}")))
        .collect()
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let (mut chunks, mut groups, mut levels) = (vec![4096], vec![65536], vec![3]);
    let mut skip_test = false;
    let mut reads: Option<Vec<(u64, u64)>> = None;
    let mut files = Vec::new();
    while let Some(a) = args.next() {
        let mut value = |name: &str| -> Result<Vec<i64>, String> {
            list(&args.next().ok_or(format!("{name} needs a value"))?)
        };
        let parsed = match a.as_str() {
            "--chunk" => value("--chunk").map(|v| chunks = v),
            "--group" => value("--group").map(|v| groups = v),
            "--level" => value("--level").map(|v| levels = v),
            "--reads" => match args.next().map(|p| read_trace(&p)) {
                Some(Ok(r)) => {
                    reads = Some(r);
                    Ok(())
                }
                Some(Err(e)) => Err(format!("--reads: {e}")),
                None => Err("--reads needs a trace file".into()),
            },
            "--skip-test" => {
                skip_test = true;
                Ok(())
            }
            "-h" | "--help" => {
                eprintln!("usage: cairn-groups [--chunk N,..] [--group N,..] [--level L,..] [--skip-test] [--reads QEMU_TRACE] FILE...");
                return ExitCode::SUCCESS;
            }
            _ => {
                files.push(a);
                Ok(())
            }
        };
        if let Err(e) = parsed {
            eprintln!("cairn-groups: {e}");
            return ExitCode::from(2);
        }
    }
    if files.is_empty() {
        eprintln!("cairn-groups: give the image files to commit, in order");
        return ExitCode::from(2);
    }
    for &chunk in &chunks {
        for &group in &groups {
            if group != 0 && group < chunk {
                continue; // a group holds at least one chunk
            }
            for &level in &levels {
                let config = Config {
                    chunk: chunk as usize,
                    group: group as usize,
                    level: level as i32,
                    skip_test,
                };
                let mut repo = Repo::new(config);
                for (n, path) in files.iter().enumerate() {
                    let f = match repo.commit(path) {
                        Ok(f) => f,
                        Err(e) => {
                            eprintln!("cairn-groups: {path}: {e}");
                            return ExitCode::FAILURE;
                        }
                    };
                    let mut line = json!({
                        "chunk": chunk, "group": group, "level": level, "skip_test": skip_test,
                        "file": path,
                        "chunks": f.chunks, "new_chunks": f.new_chunks, "new_bytes": f.new_bytes,
                        "groups": f.groups, "stored_bytes": f.stored_bytes,
                        "raw_groups": f.raw_groups, "skipped_groups": f.skipped_groups,
                        "compress_cpu_s": (f.compress_cpu_s * 1000.0).round() / 1000.0,
                        "hash_s": (f.hash_s * 1000.0).round() / 1000.0,
                        "leaf_extents": f.leaf_extents, "merged_extents": f.merged_extents,
                        "new_leaves": f.new_leaves, "new_leaf_refs": f.new_leaf_refs,
                        "new_leaf_runs": f.new_leaf_runs,
                    });
                    if let (Some(reads), true) = (&reads, n + 1 == files.len()) {
                        let (groups_fetched, fetched) = repo.lazy_reads(reads);
                        line["guest_read_bytes"] = json!(reads.iter().map(|r| r.1).sum::<u64>());
                        line["groups_fetched"] = json!(groups_fetched);
                        line["fetched_bytes"] = json!(fetched);
                    }
                    println!("{line}");
                }
            }
        }
    }
    ExitCode::SUCCESS
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_testkit::noise;

    #[test]
    fn groups_cut_new_chunks_and_dedup_counts_what_was_committed_before() {
        let dir = std::env::temp_dir().join(format!("cairn-groups-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // 40 KiB of noise, 8 KiB of zeros, the first 8 KiB of noise again (dedups within the
        // file), 4 KiB of text (compresses).
        let base = noise(40 << 10, 7);
        let mut data = base.clone();
        data.extend(vec![0u8; 8 << 10]);
        data.extend_from_slice(&base[..8 << 10]);
        data.extend(b"cairn ".repeat(4096 / 6 + 1).into_iter().take(4096));
        let path = dir.join("a.raw");
        std::fs::write(&path, &data).unwrap();
        let path = path.to_str().unwrap();

        let config = Config {
            chunk: 4096,
            group: 16384,
            level: 3,
            skip_test: false,
        };
        let mut repo = Repo::new(config);
        let f = repo.commit(path).unwrap();
        assert_eq!(f.chunks, 10 + 2 + 1, "zero chunks are skipped");
        assert_eq!((f.new_chunks, f.new_bytes), (11, 11 * 4096));
        // 11 new chunks of 4 KiB in groups of at most 16 KiB: 4 + 4 + 3.
        assert_eq!(f.groups, 3);
        // The noise groups do not compress and are stored raw; the last one holds text.
        assert_eq!(f.raw_groups, 2);
        assert!(f.stored_bytes < 11 * 4096 && f.stored_bytes > 8 * 4096);
        // Runs of logically adjacent chunks back to back in one group: 0-3 (group 0), 4-7
        // (group 1), 8-9 (group 2), the repeats of 0-1 (group 0 again, after the zeros), and
        // the text chunk (group 2, but after a chunk of group 0).
        assert_eq!(f.leaf_extents, 13);
        assert_eq!(f.merged_extents, 3 + 1 + 1);
        // One segment, so one new leaf holding all 13 references in the same 5 runs.
        assert_eq!((f.new_leaves, f.new_leaf_refs, f.new_leaf_runs), (1, 13, 5));

        // A lazy reader pays whole groups, once each; zeros cost nothing.
        let (g0, g2) = (repo.group_bytes[0], repo.group_bytes[2]);
        assert_eq!(g0, 4 * 4096, "noise is stored raw");
        assert_eq!(repo.lazy_reads(&[(0, 4096)]), (1, g0));
        assert_eq!(repo.lazy_reads(&[(0, 16384), (12 * 4096, 8192)]), (1, g0));
        assert_eq!(repo.lazy_reads(&[(40 << 10, 8 << 10)]), (0, 0));
        assert_eq!(repo.lazy_reads(&[(14 * 4096, 512)]), (1, g2));

        // The same file again: nothing new, the same references.
        let again = repo.commit(path).unwrap();
        assert_eq!(
            (again.new_chunks, again.groups, again.stored_bytes),
            (0, 0, 0)
        );
        assert_eq!(again.merged_extents, f.merged_extents);
        assert_eq!(again.new_leaves, 0, "an equal leaf is shared");

        // v1's layout: every chunk its own group.
        let mut v1 = Repo::new(Config { group: 0, ..config });
        assert_eq!(v1.commit(path).unwrap().groups, 11);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

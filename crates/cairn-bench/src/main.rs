//! `cairn-limits FILE...`: the machine's upper bounds for committing each file, measured in one
//! process, so that `bench/compare.py` can say how close `cairn commit` gets to them.
//!
//! For every file it prints one JSON object on stdout:
//!
//! ```json
//! {"file": "...", "data_bytes": 0, "read_mib_s": 0.0,
//!  "blake3_chunks_all_cores_mib_s": 0.0, "blake3_rayon_mib_s": 0.0,
//!  "blake3_chunks_one_core_mib_s": 0.0}
//! ```
//!
//! - `data_bytes`: bytes in the file's allocated extents (`SEEK_DATA`/`SEEK_HOLE`, the same
//!   [`cairn_engine::source::data_extents`] a commit uses). Holes are never read by cairn, so
//!   this is the work a commit cannot avoid. All rates below are over these bytes.
//! - `read_mib_s`: **read limit**. The extents are read with `pread` in 4 MiB blocks into one
//!   reused buffer, which is the least work any reader can do: no copies, no processing. The
//!   file is read twice and the second pass is reported, i.e. from a warm page cache, which is
//!   how the benchmark measures commits too (the images are read just before). A commit must
//!   read every allocated byte, so it cannot be faster than this.
//! - `blake3_chunks_all_cores_mib_s`: **hash limit**. The data, held in memory, is hashed as
//!   independent 16 KiB chunks in parallel on all cores (rayon, one thread per core), i.e.
//!   exactly cairn's per-chunk content addressing with its default chunk size. A commit must
//!   hash every non-zero chunk, so with all cores hashing and nothing else it cannot be faster.
//! - `blake3_rayon_mib_s`: for reference, one BLAKE3 hash of the whole buffer with
//!   `Hasher::update_rayon` (BLAKE3's own tree parallelism on all cores; no per-chunk overhead).
//! - `blake3_chunks_one_core_mib_s`: for reference, the 16 KiB chunk hashing on one core; the
//!   per-core cost of hashing.
//!
//! Hash rates are the best of three passes (a limit is what the machine can do at best).
//! Zero detection, compression and pack writing are not included: those are cairn's own costs.
#![forbid(unsafe_code)]

use std::fs::File;
use std::hint::black_box;
use std::os::unix::fs::FileExt;
use std::process::ExitCode;
use std::time::Instant;

use rayon::prelude::*;
use serde_json::json;

/// cairn's default chunk size.
const CHUNK: usize = 16 * 1024;
/// Read block size of the read-limit pass.
const READ_BLOCK: usize = 4 * 1024 * 1024;
/// Passes per hash measurement; the best is reported.
const HASH_PASSES: usize = 3;

const MIB: f64 = 1024.0 * 1024.0;

fn mib_s(bytes: u64, secs: f64) -> f64 {
    (bytes as f64 / MIB / secs * 10.0).round() / 10.0
}

/// Reads every extent into `buf` block by block; returns the bytes read.
fn read_extents(file: &File, extents: &[(u64, u64)], buf: &mut [u8]) -> std::io::Result<u64> {
    let mut total = 0;
    for &(start, end) in extents {
        let mut pos = start;
        while pos < end {
            let n = ((end - pos) as usize).min(buf.len());
            file.read_exact_at(&mut buf[..n], pos)?;
            black_box(&buf[..n]);
            pos += n as u64;
            total += n as u64;
        }
    }
    Ok(total)
}

/// Loads all extents, back to back, into one buffer.
fn load_extents(file: &File, extents: &[(u64, u64)], len: u64) -> std::io::Result<Vec<u8>> {
    let mut data = vec![0u8; len as usize];
    let mut at = 0usize;
    for &(start, end) in extents {
        let n = (end - start) as usize;
        file.read_exact_at(&mut data[at..at + n], start)?;
        at += n;
    }
    Ok(data)
}

/// Best throughput of `f` over [`HASH_PASSES`] passes over `bytes` bytes.
fn best_of(bytes: u64, mut f: impl FnMut()) -> f64 {
    (0..HASH_PASSES)
        .map(|_| {
            let t = Instant::now();
            f();
            mib_s(bytes, t.elapsed().as_secs_f64())
        })
        .fold(0.0, f64::max)
}

fn measure(path: &str) -> std::io::Result<serde_json::Value> {
    let file = File::open(path)?;
    let size = file.metadata()?.len();
    let extents = cairn_engine::source::data_extents(&file, size)?;
    let data_bytes: u64 = extents.iter().map(|(s, e)| e - s).sum();

    // (a) Read limit: a cold(ish) pass to fill the page cache, then the measured warm pass.
    let mut block = vec![0u8; READ_BLOCK];
    read_extents(&file, &extents, &mut block)?;
    let t = Instant::now();
    let read = read_extents(&file, &extents, &mut block)?;
    let read_mib_s = mib_s(read, t.elapsed().as_secs_f64());
    drop(block);

    // (b) Hash limits, on the same bytes held in memory.
    let data = load_extents(&file, &extents, data_bytes)?;
    let chunks_all = best_of(data_bytes, || {
        let x: u64 = data
            .par_chunks(CHUNK)
            .map(|c| u64::from(blake3::hash(c).as_bytes()[0]))
            .sum();
        black_box(x);
    });
    let rayon_tree = best_of(data_bytes, || {
        let mut h = blake3::Hasher::new();
        h.update_rayon(&data);
        black_box(h.finalize());
    });
    let chunks_one = best_of(data_bytes, || {
        let x: u64 = data
            .chunks(CHUNK)
            .map(|c| u64::from(blake3::hash(c).as_bytes()[0]))
            .sum();
        black_box(x);
    });

    Ok(json!({
        "file": path,
        "data_bytes": data_bytes,
        "read_mib_s": read_mib_s,
        "blake3_chunks_all_cores_mib_s": chunks_all,
        "blake3_rayon_mib_s": rayon_tree,
        "blake3_chunks_one_core_mib_s": chunks_one,
    }))
}

fn main() -> ExitCode {
    let files: Vec<String> = std::env::args().skip(1).collect();
    if files.is_empty() || files.iter().any(|a| a == "-h" || a == "--help") {
        eprintln!("usage: cairn-limits FILE...  (one JSON object per file on stdout)");
        return ExitCode::from(2);
    }
    for path in &files {
        match measure(path) {
            Ok(v) => println!("{v}"),
            Err(e) => {
                eprintln!("cairn-limits: {path}: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}

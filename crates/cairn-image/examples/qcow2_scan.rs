//! Times `map()` and a full read of a qcow2 image (and its chain):
//!
//!     cargo run --release -p cairn-image --example qcow2_scan -- IMAGE [--data-only] [--drop-cache]
//!
//! Prints the chain, the map's run counts, the read throughput (time spent in `read_at`
//! only) and, for a full read, an FNV-1a checksum of the guest bytes.

use std::path::PathBuf;
use std::time::Instant;

use cairn_image::qcow2::{OpenOptions, Qcow2Image};
use cairn_image::{Allocation, DiskImage};

fn main() {
    let mut path = None;
    let mut data_only = false;
    let mut drop_cache = false;
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--data-only" => data_only = true,
            "--drop-cache" => drop_cache = true,
            _ => path = Some(PathBuf::from(arg)),
        }
    }
    let Some(path) = path else {
        eprintln!("usage: qcow2_scan IMAGE [--data-only] [--drop-cache]");
        std::process::exit(2);
    };
    let t = Instant::now();
    let img = match Qcow2Image::open(&path, OpenOptions { drop_cache }) {
        Ok(img) => img,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    };
    println!("open: {:.3} s", t.elapsed().as_secs_f64());
    for (depth, layer) in img.layers().iter().enumerate() {
        println!(
            "layer {depth}: {} ({}, {} bytes)",
            layer.path.display(),
            layer.format.name(),
            layer.size
        );
    }
    let t = Instant::now();
    let runs = img.map().unwrap_or_else(|e| {
        eprintln!("{e}");
        std::process::exit(1)
    });
    let map_time = t.elapsed().as_secs_f64();
    let data: u64 = runs
        .iter()
        .filter(|r| r.alloc == Allocation::Data)
        .map(|r| r.len)
        .sum();
    println!(
        "map: {:.3} s, {} runs, {} data bytes of {}",
        map_time,
        runs.len(),
        data,
        img.size()
    );
    let mut in_read = std::time::Duration::ZERO;
    let mut buf = vec![0u8; 4 << 20];
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    let mut read = 0u64;
    let ranges: Vec<(u64, u64)> = if data_only {
        runs.iter()
            .filter(|r| r.alloc == Allocation::Data)
            .map(|r| (r.start, r.len))
            .collect()
    } else {
        vec![(0, img.size())]
    };
    for (start, len) in ranges {
        let mut pos = start;
        while pos < start + len {
            let n = (buf.len() as u64).min(start + len - pos) as usize;
            let t = Instant::now();
            if let Err(e) = img.read_at(&mut buf[..n], pos) {
                eprintln!("{e}");
                std::process::exit(1);
            }
            in_read += t.elapsed();
            if !data_only {
                for &b in &buf[..n] {
                    hash = (hash ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
                }
            }
            pos += n as u64;
            read += n as u64;
        }
    }
    let secs = in_read.as_secs_f64();
    println!(
        "read: {read} bytes in {secs:.3} s = {:.0} MB/s{}",
        read as f64 / secs / 1e6,
        if data_only {
            String::new()
        } else {
            format!(" (fnv1a {hash:016x})")
        }
    );
}

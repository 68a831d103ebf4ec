//! Times `map()` and a full read of a qcow2 image (and its chain):
//!
//!     cargo run --release -p cairn-image --example qcow2_scan -- IMAGE [--data-only]
//!         [--drop-cache] [--compare RAW]
//!
//! Prints the chain, the map's run counts and the read throughput (time spent in `read_at`
//! only). With `--compare`, every byte read is checked against the raw file `RAW` (e.g. the
//! output of `qemu-img convert -O raw IMAGE RAW`).

use std::path::PathBuf;
use std::time::Instant;

use cairn_image::qcow2::{OpenOptions, Qcow2Image};
use cairn_image::{Allocation, DiskImage};

fn main() {
    let mut path = None;
    let mut data_only = false;
    let mut drop_cache = false;
    let mut compare = None;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--data-only" => data_only = true,
            "--drop-cache" => drop_cache = true,
            "--compare" => compare = args.next().map(PathBuf::from),
            _ => path = Some(PathBuf::from(arg)),
        }
    }
    let compare = compare.map(|p| std::fs::File::open(&p).expect("cannot open the raw file"));
    let Some(path) = path else {
        eprintln!("usage: qcow2_scan IMAGE [--data-only] [--drop-cache] [--compare RAW]");
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
    let mut want = vec![0u8; buf.len()];
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
            if let Some(raw) = &compare {
                use std::os::unix::fs::FileExt;
                raw.read_exact_at(&mut want[..n], pos)
                    .expect("cannot read the raw file");
                if buf[..n] != want[..n] {
                    eprintln!("MISMATCH in the 4 MiB at 0x{pos:x}");
                    std::process::exit(1);
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
        if compare.is_some() {
            " (all equal to the raw file)"
        } else {
            ""
        }
    );
}

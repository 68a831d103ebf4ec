//! `cairn-overlay-bench DIR SIZE_GIB...`: iROW's disk-snapshot experiment (Figs. 20–22) on
//! cairn's overlay, one JSON object per size on stdout, for `bench/overlay_snapshots.py`
//! to set beside `qemu-img snapshot` on a qcow2 image written the same way.
//!
//! Per size, in a fresh overlay of 4 KiB blocks under DIR:
//! 1. *fill*: one block written in every `--stride` (1 MiB by default) of the disk;
//!    snapshot `s1` (**create**);
//! 2. *change*: `--changes` blocks (4096) written at random places; roll back to `s1`
//!    (**rollback**);
//! 3. *rewrite*: the fill's blocks written again; delete `s1` (**delete**: every block of
//!    `s1` is hidden by the current layer, so it is all reclaimed).
//!
//! The overlay is flushed before each timed operation, so the times are the operations' own
//! metadata work (the writes' flush is not counted), as `qemu-img snapshot` works on a closed
//! image. Space the operations free (files of dropped layers, blocks of a deleted snapshot
//! nothing reads) is freed in the background; how much longer that took after the deletion
//! returned is reported too. Writes go through the same API an export's NBD writes use.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use cairn_overlay::Overlay;
use clap::Parser;
use serde_json::json;

const BLOCK: u32 = 4096;
const GIB: u64 = 1 << 30;

#[derive(Parser)]
#[command(about = "Time overlay snapshot create, rollback and delete against the disk's size")]
struct Args {
    /// Scratch directory (each size's overlay is made in it and removed after).
    dir: PathBuf,
    /// Disk sizes in GiB.
    #[arg(required = true)]
    sizes: Vec<u64>,
    /// Bytes between the blocks the fill writes.
    #[arg(long, default_value_t = 1 << 20)]
    stride: u64,
    /// Blocks the change step writes at random places.
    #[arg(long, default_value_t = 4096)]
    changes: u64,
}

/// A block of `seed`-dependent bytes (not compressible to nothing, never all zero).
fn block(seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..BLOCK / 8)
        .flat_map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()
        })
        .collect()
}

fn timed(
    f: impl FnOnce() -> Result<(), cairn_overlay::OverlayError>,
) -> Result<f64, cairn_overlay::OverlayError> {
    let t = Instant::now();
    f()?;
    Ok(t.elapsed().as_secs_f64())
}

fn run_size(args: &Args, gib: u64) -> Result<serde_json::Value, Box<dyn std::error::Error>> {
    let dir = args.dir.join(format!("overlay-{gib}g"));
    let _ = std::fs::remove_dir_all(&dir);
    let size = gib * GIB;
    let o = Overlay::open(&dir, size, BLOCK, "bench")?;
    let nblocks = o.block_count();
    let every = (args.stride / BLOCK as u64).max(1);
    let fill: Vec<u64> = (0..nblocks).step_by(every as usize).collect();
    let data = block(gib);
    for &b in &fill {
        o.write_block(b, &data)?;
    }
    o.flush()?;
    let create_s = timed(|| o.snapshot("s1"))?;

    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ gib;
    for _ in 0..args.changes {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        o.write_block(x % nblocks, &data)?;
    }
    o.flush()?;
    let rollback_s = timed(|| o.rollback("s1"))?;

    let again = block(gib + 1);
    for &b in &fill {
        o.write_block(b, &again)?;
    }
    o.flush()?;
    let before = o.stats().data_bytes_allocated;
    let delete_s = timed(|| o.delete_snapshot("s1"))?;
    // What the deletion freed, once freed (it happens in the background).
    let settle = Instant::now();
    o.settle();
    let settle_s = settle.elapsed().as_secs_f64();
    let after = o.stats();
    drop(o);
    std::fs::remove_dir_all(&dir)?;
    Ok(json!({
        "size_gib": gib,
        "blocks_written": fill.len(),
        "changes": args.changes,
        "create_s": create_s,
        "rollback_s": rollback_s,
        "delete_s": delete_s,
        "delete_space_freed_after_s": settle_s,
        "allocated_before_delete": before,
        "allocated_after_delete": after.data_bytes_allocated,
        "layers_after_delete": after.layers,
    }))
}

fn main() -> ExitCode {
    let args = Args::parse();
    for &gib in &args.sizes {
        match run_size(&args, gib) {
            Ok(v) => println!("{v}"),
            Err(e) => {
                eprintln!("cairn-overlay-bench: {gib} GiB: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    ExitCode::SUCCESS
}

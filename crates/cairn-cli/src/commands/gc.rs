use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Result};
use cairn_engine::gc::{gc, GcOptions};
use serde_json::json;

use crate::cli::GcArgs;
use crate::context::Context;
use crate::output::{bytes, print_json};

pub async fn run(ctx: &Context, args: GcArgs) -> Result<ExitCode> {
    if !(0.0..=1.0).contains(&args.repack_threshold) {
        bail!("--repack-threshold must be between 0 and 1");
    }
    let repo = ctx.open_as("gc").await?;
    let options = GcOptions {
        dry_run: args.dry_run,
        repack_threshold: args.repack_threshold,
        stale_after: Duration::from_secs(args.stale_after),
        wait_limit: Duration::from_secs(args.wait_limit),
        ..Default::default()
    };
    let r = gc(&repo, &options).await?;
    if ctx.json {
        print_json(&json!({
            "dry_run": r.dry_run,
            "live_versions": r.live_versions,
            "live_blobs": r.live_blobs,
            "dead_blobs": r.dead_blobs,
            "packs_deleted": r.packs_deleted,
            "packs_repacked": r.packs_repacked,
            "packs_written": r.packs_written,
            "orphan_packs_deleted": r.orphan_packs_deleted,
            "index_files_replaced": r.index_files_replaced,
            "rescued_blobs": r.rescued_blobs,
            "bytes_before": r.bytes_before,
            "bytes_after": r.bytes_after,
            "bytes_reclaimed": r.reclaimed(),
            "bytes_repacked": r.bytes_repacked,
            "metadata_bytes_read": r.metadata_bytes_read,
            "waited_s": r.waited_s,
            "duration_s": r.duration_s,
        }));
    } else {
        let verb = if r.dry_run {
            "would reclaim"
        } else {
            "reclaimed"
        };
        println!(
            "{verb} {} ({} → {}): {} live versions, {} live blobs, {} dead blobs; {} packs deleted, {} repacked ({} copied), {} orphan packs deleted; read {} of metadata in {:.2} s",
            bytes(r.reclaimed()),
            bytes(r.bytes_before),
            bytes(r.bytes_after),
            r.live_versions,
            r.live_blobs,
            r.dead_blobs,
            r.packs_deleted,
            r.packs_repacked,
            bytes(r.bytes_repacked),
            r.orphan_packs_deleted,
            bytes(r.metadata_bytes_read),
            r.duration_s,
        );
        if r.rescued_blobs > 0 {
            println!(
                "{} blobs were kept because concurrent commits started using them",
                r.rescued_blobs
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

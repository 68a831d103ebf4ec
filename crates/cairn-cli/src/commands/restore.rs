use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use cairn_engine::resolve::{resolve, VersionSpec};
use cairn_engine::restore::{restore, RestoreOptions, RestoreProgress, RestoreTarget};
use serde_json::json;

use crate::cli::{OutputFormatArg, RestoreArgs};
use crate::context::Context;
use crate::output::{bytes, print_json, rate};
use crate::progress::Ticker;
use crate::provenance::{FileIdentity, Provenance};

pub async fn run(ctx: &Context, args: RestoreArgs) -> Result<ExitCode> {
    let spec = VersionSpec::parse(&args.spec)?;
    let repo = ctx.open_as("restore").await?;
    let (id, record) = resolve(&repo, &spec).await?;
    let repo_id = repo.config().repo_id;
    let to_stdout = args.output.as_os_str() == "-";
    let qcow2 = args.format == OutputFormatArg::Qcow2;
    let target = match (to_stdout, qcow2) {
        (true, true) => anyhow::bail!("--format qcow2 needs an output file, not stdout"),
        (true, false) => RestoreTarget::Stdout,
        (false, false) => RestoreTarget::Path(args.output.clone()),
        (false, true) => RestoreTarget::Qcow2(args.output.clone()),
    };
    let progress = Arc::new(RestoreProgress::default());
    progress.total.store(record.logical_size, Ordering::Relaxed);
    let ticker = {
        let p = progress.clone();
        let total = Arc::new(std::sync::atomic::AtomicU64::new(record.logical_size));
        Ticker::start(
            ctx.progress,
            total,
            move || p.done.load(Ordering::Relaxed),
            String::new,
        )
    };
    let started = Instant::now();
    let options = RestoreOptions {
        progress: Some(progress),
        force: args.force,
        allow_damage: args.allow_damage,
        ..Default::default()
    };
    let stats = restore(repo, &record, target, options).await;
    drop(ticker);
    let stats = stats?;
    let elapsed = started.elapsed();
    if !to_stdout && stats.damaged.is_empty() {
        // A regular file now holds this version: an overlay on it commits incrementally.
        Provenance::for_repo(&repo_id).record(&args.output, FileIdentity::of(&args.output), &id);
    }
    let damaged_bytes: u64 = stats.damaged.iter().map(|d| d.len).sum();
    let summary = json!({
        "id": id.to_hex(),
        "image": record.image,
        "seq": record.seq,
        "output": args.output.display().to_string(),
        "format": if qcow2 { "qcow2" } else { "raw" },
        "logical_bytes": stats.logical_bytes,
        "data_bytes": stats.data_bytes,
        "fetched_bytes": stats.fetched_bytes,
        "reads": stats.reads,
        "duration_s": elapsed.as_secs_f64(),
        "damaged_bytes": damaged_bytes,
        "damaged": stats.damaged.iter().map(|d| json!({
            "offset": d.offset,
            "len": d.len,
            "reason": d.reason,
        })).collect::<Vec<_>>(),
    });
    if ctx.json && !to_stdout {
        print_json(&summary);
    } else if to_stdout {
        tracing::info!("{summary}");
        for d in &stats.damaged {
            eprintln!(
                "damaged: bytes {}..{} written as zeros: {}",
                d.offset,
                d.offset + d.len,
                d.reason
            );
        }
    } else {
        for d in &stats.damaged {
            println!(
                "damaged: bytes {}..{} ({}) written as zeros: {}",
                d.offset,
                d.offset + d.len,
                bytes(d.len),
                d.reason
            );
        }
        println!(
            "restored {}@{} to {} — {} logical, {} data in {:.2} s ({}){}",
            record.image,
            record.seq,
            args.output.display(),
            bytes(stats.logical_bytes),
            bytes(stats.data_bytes),
            elapsed.as_secs_f64(),
            rate(stats.data_bytes, elapsed),
            if stats.damaged.is_empty() {
                String::new()
            } else {
                format!(
                    "; {} in {} ranges could not be read and are zeros",
                    bytes(damaged_bytes),
                    stats.damaged.len()
                )
            }
        );
    }
    Ok(if stats.damaged.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    })
}

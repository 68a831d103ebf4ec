use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use cairn_engine::commit::{commit, CommitOptions, CommitProgress};
use cairn_engine::source::{open_path, Source, StreamSource};
use cairn_format::name::validate_image_name;

use crate::cli::CommitArgs;
use crate::context::Context;
use crate::output::{bytes, print_json, rate, version_json};
use crate::progress::Ticker;

pub async fn run(ctx: &Context, args: CommitArgs) -> Result<ExitCode> {
    validate_image_name(&args.image).map_err(|e| anyhow::anyhow!("invalid {e}"))?;
    if let Some(export) = &args.from_export {
        return crate::commands::export::commit_from(ctx, &args.image, export, &args.message).await;
    }
    let path = args
        .source
        .clone()
        .expect("clap requires SOURCE without --from-export");
    let repo = ctx.open_as("commit").await?;
    let source: Box<dyn Source> = if path.as_os_str() == "-" {
        Box::new(StreamSource::new("stdin", std::io::stdin()))
    } else {
        open_path(&path)?
    };
    let progress = Arc::new(CommitProgress::default());
    let ticker = {
        let (p1, p2) = (progress.clone(), progress.clone());
        let total = Arc::new(std::sync::atomic::AtomicU64::new(
            source.data_hint().unwrap_or(0),
        ));
        Ticker::start(
            ctx.progress,
            total,
            move || p1.read.load(Ordering::Relaxed),
            move || {
                let read = p2.read.load(Ordering::Relaxed).max(1);
                let new = p2.new_bytes.load(Ordering::Relaxed);
                format!(
                    "new {} ({:.1}%)",
                    bytes(new),
                    new as f64 * 100.0 / read as f64
                )
            },
        )
    };
    let started = Instant::now();
    let options = CommitOptions {
        message: args.message,
        workers: args.threads,
        progress: Some(progress),
        ..Default::default()
    };
    let result = commit(repo, &args.image, source, options).await;
    drop(ticker);
    let result = result?;
    let elapsed = started.elapsed();
    let r = &result.record;
    if ctx.json {
        let mut v = version_json(&result.id, r);
        v["duration_s"] = serde_json::json!(elapsed.as_secs_f64());
        print_json(&v);
    } else {
        println!(
            "committed {}@{} {} — {} logical, {} data, {} new, {} stored, in {:.2} s ({})",
            r.image,
            r.seq,
            result.id.short(),
            bytes(r.logical_size),
            bytes(r.stats.data_bytes),
            bytes(r.stats.new_chunk_bytes),
            bytes(r.stats.stored_bytes),
            elapsed.as_secs_f64(),
            rate(r.stats.data_bytes, elapsed),
        );
    }
    Ok(ExitCode::SUCCESS)
}

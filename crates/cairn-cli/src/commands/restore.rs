use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use cairn_engine::resolve::{resolve, VersionSpec};
use cairn_engine::restore::{restore, RestoreOptions, RestoreProgress, RestoreTarget};
use serde_json::json;

use crate::cli::RestoreArgs;
use crate::context::Context;
use crate::output::{bytes, print_json, rate};
use crate::progress::Ticker;

pub async fn run(ctx: &Context, args: RestoreArgs) -> Result<ExitCode> {
    let spec = VersionSpec::parse(&args.spec)?;
    let repo = ctx.open_as("restore").await?;
    let (id, record) = resolve(&repo, &spec).await?;
    let to_stdout = args.output.as_os_str() == "-";
    let target = if to_stdout {
        RestoreTarget::Stdout
    } else {
        RestoreTarget::Path(args.output.clone())
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
        ..Default::default()
    };
    let stats = restore(repo, &record, target, options).await;
    drop(ticker);
    let stats = stats?;
    let elapsed = started.elapsed();
    let summary = json!({
        "id": id.to_hex(),
        "image": record.image,
        "seq": record.seq,
        "output": args.output.display().to_string(),
        "logical_bytes": stats.logical_bytes,
        "data_bytes": stats.data_bytes,
        "fetched_bytes": stats.fetched_bytes,
        "reads": stats.reads,
        "duration_s": elapsed.as_secs_f64(),
    });
    if ctx.json && !to_stdout {
        print_json(&summary);
    } else if to_stdout {
        tracing::info!("{summary}");
    } else {
        println!(
            "restored {}@{} to {} — {} logical, {} data in {:.2} s ({})",
            record.image,
            record.seq,
            args.output.display(),
            bytes(stats.logical_bytes),
            bytes(stats.data_bytes),
            elapsed.as_secs_f64(),
            rate(stats.data_bytes, elapsed)
        );
    }
    Ok(ExitCode::SUCCESS)
}

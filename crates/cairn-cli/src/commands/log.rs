use std::process::ExitCode;

use anyhow::Result;
use cairn_engine::resolve::history;
use serde_json::Value;

use crate::cli::LogArgs;
use crate::context::Context;
use crate::output::{bytes, print_json, time, version_json};

pub async fn run(ctx: &Context, args: LogArgs) -> Result<ExitCode> {
    let repo = ctx.open().await?;
    let versions = history(&repo, &args.image).await?;
    if ctx.json {
        print_json(&Value::Array(
            versions.iter().map(|(id, r)| version_json(id, r)).collect(),
        ));
    } else {
        for (id, r) in &versions {
            println!(
                "{}@{:<4} {}  {}  {:>10} logical {:>10} stored  {}",
                r.image,
                r.seq,
                id.short(),
                time(r.time_ns),
                bytes(r.logical_size),
                bytes(r.stats.stored_bytes),
                r.message
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

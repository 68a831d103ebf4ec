use std::process::ExitCode;

use anyhow::Result;
use cairn_engine::resolve::history;
use serde_json::{json, Value};

use crate::context::Context;
use crate::output::{bytes, print_json, time};

pub async fn run(ctx: &Context) -> Result<ExitCode> {
    let repo = ctx.open().await?;
    let mut rows = Vec::new();
    // The live versions of each image (deleted ones are not counted).
    for image in repo.images().await? {
        let versions = history(&repo, &image).await?;
        if let Some((id, r)) = versions.first() {
            rows.push((image, versions.len(), *id, r.clone()));
        }
    }
    if ctx.json {
        print_json(&Value::Array(
            rows.iter()
                .map(|(image, count, id, r)| {
                    json!({
                        "image": image,
                        "versions": count,
                        "newest_seq": r.seq,
                        "head": id.to_hex(),
                        "time": time(r.time_ns),
                        "logical_bytes": r.logical_size,
                    })
                })
                .collect(),
        ));
    } else {
        for (image, count, id, r) in &rows {
            outln!(
                "{image}  {count} versions, newest @{} {} at {} ({})",
                r.seq,
                id.short(),
                time(r.time_ns),
                bytes(r.logical_size)
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

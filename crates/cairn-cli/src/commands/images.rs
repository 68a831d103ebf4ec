use std::process::ExitCode;

use anyhow::Result;
use serde_json::{json, Value};

use crate::context::Context;
use crate::output::{bytes, print_json, time};

pub async fn run(ctx: &Context) -> Result<ExitCode> {
    let repo = ctx.open().await?;
    let mut rows = Vec::new();
    for image in repo.images().await? {
        if let Some(head) = repo.head(&image).await? {
            let r = repo.load_version(&head.version).await?;
            rows.push((image, head.version, r));
        }
    }
    if ctx.json {
        print_json(&Value::Array(
            rows.iter()
                .map(|(image, id, r)| {
                    json!({
                        "image": image,
                        "versions": r.seq,
                        "head": id.to_hex(),
                        "time": time(r.time_ns),
                        "logical_bytes": r.logical_size,
                    })
                })
                .collect(),
        ));
    } else {
        for (image, id, r) in &rows {
            println!(
                "{image}  {} versions, newest {} at {} ({})",
                r.seq,
                id.short(),
                time(r.time_ns),
                bytes(r.logical_size)
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

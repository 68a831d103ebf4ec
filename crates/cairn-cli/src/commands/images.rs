use std::process::ExitCode;

use anyhow::Result;
use cairn_engine::resolve::history;
use serde_json::{json, Value};

use crate::context::Context;
use crate::output::{bytes, print_json, time, version_json};

pub async fn run(ctx: &Context) -> Result<ExitCode> {
    let repo = ctx.open().await?;
    let mut rows = Vec::new();
    // The live versions of each image (deleted ones are not counted).
    for image in repo.images().await? {
        let versions = history(&repo, &image).await?;
        if let Some((id, r)) = versions.first() {
            let tags: Vec<String> = if ctx.json {
                let all = repo.tags(&image).await?;
                all.into_iter()
                    .filter_map(|(name, target)| (target == *id).then_some(name))
                    .collect()
            } else {
                Vec::new()
            };
            rows.push((image, versions.len(), *id, r.clone(), tags));
        }
    }
    if ctx.json {
        print_json(&Value::Array(
            rows.iter()
                .map(|(image, count, id, r, tags)| {
                    // The newest version is the same object `log` and `show` print.
                    json!({
                        "image": image,
                        "versions": count,
                        "newest": version_json(id, r, tags),
                    })
                })
                .collect(),
        ));
    } else {
        for (image, count, id, r, _) in &rows {
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

use std::collections::HashMap;
use std::process::ExitCode;

use anyhow::Result;
use cairn_engine::resolve::{history, origin};
use cairn_format::Id;
use serde_json::Value;

use crate::cli::LogArgs;
use crate::context::Context;
use crate::output::{bytes, print_json, time, version_json};

pub async fn run(ctx: &Context, args: LogArgs) -> Result<ExitCode> {
    let repo = ctx.open().await?;
    let versions = history(&repo, &args.image).await?;
    let mut tags: HashMap<Id, Vec<String>> = HashMap::new();
    for (name, id) in repo.tags(&args.image).await? {
        tags.entry(id).or_default().push(name);
    }
    let tags_of = |id: &Id| tags.get(id).cloned().unwrap_or_default();
    if ctx.json {
        print_json(&Value::Array(
            versions
                .iter()
                .map(|(id, r)| version_json(id, r, &tags_of(id)))
                .collect(),
        ));
    } else {
        for (id, r) in &versions {
            let names = tags_of(id);
            let tag_text = if names.is_empty() {
                String::new()
            } else {
                format!("[{}] ", names.join(", "))
            };
            outln!(
                "{}@{:<4} {}  {}  {:>10} logical {:>10} stored  {tag_text}{}",
                r.image,
                r.seq,
                id.short(),
                time(r.time_ns),
                bytes(r.logical_size),
                bytes(r.stats.stored_bytes),
                r.message
            );
        }
        if let Some((id, r)) = origin(&repo, &args.image).await? {
            outln!("cloned from {}@{} ({})", r.image, r.seq, id.short());
        }
    }
    Ok(ExitCode::SUCCESS)
}

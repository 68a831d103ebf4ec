use std::process::ExitCode;

use anyhow::Result;
use cairn_engine::resolve::{resolve, VersionSpec};

use crate::cli::ShowArgs;
use crate::context::Context;
use crate::output::{bytes, print_json, time, version_json};

pub async fn run(ctx: &Context, args: ShowArgs) -> Result<ExitCode> {
    let spec = VersionSpec::parse(&args.spec)?;
    let repo = ctx.open().await?;
    let (id, r) = resolve(&repo, &spec).await?;
    // The tags naming this version, as `log` shows them.
    let tags: Vec<String> = repo
        .tags(&r.image)
        .await?
        .into_iter()
        .filter_map(|(name, target)| (target == id).then_some(name))
        .collect();
    if ctx.json {
        print_json(&version_json(&id, &r, &tags));
    } else {
        outln!("version   {}@{}", r.image, r.seq);
        outln!("id        {id}");
        outln!(
            "parent    {}",
            r.parent.map_or("(none)".to_string(), |p| p.to_hex())
        );
        outln!("time      {}", time(r.time_ns));
        outln!("message   {}", r.message);
        if !tags.is_empty() {
            outln!("tags      {}", tags.join(", "));
        }
        outln!(
            "size      {} ({} bytes)",
            bytes(r.logical_size),
            r.logical_size
        );
        outln!(
            "data      {} in {} chunks",
            bytes(r.stats.data_bytes),
            r.stats.chunks
        );
        outln!(
            "new       {} in {} chunks; {} stored by this commit",
            bytes(r.stats.new_chunk_bytes),
            r.stats.new_chunks,
            bytes(r.stats.stored_bytes)
        );
        outln!(
            "manifest  root {} height {} segments of {}",
            r.root.map_or("(all zeros)".to_string(), |p| p.short()),
            r.height,
            bytes(r.segment_size as u64)
        );
    }
    Ok(ExitCode::SUCCESS)
}

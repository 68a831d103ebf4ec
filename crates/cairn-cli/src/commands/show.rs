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
    if ctx.json {
        print_json(&version_json(&id, &r));
    } else {
        println!("version   {}@{}", r.image, r.seq);
        println!("id        {id}");
        println!(
            "parent    {}",
            r.parent.map_or("(none)".to_string(), |p| p.to_hex())
        );
        println!("time      {}", time(r.time_ns));
        println!("message   {}", r.message);
        println!(
            "size      {} ({} bytes)",
            bytes(r.logical_size),
            r.logical_size
        );
        println!(
            "data      {} in {} chunks",
            bytes(r.stats.data_bytes),
            r.stats.chunks
        );
        println!(
            "new       {} in {} chunks; {} stored by this commit",
            bytes(r.stats.new_chunk_bytes),
            r.stats.new_chunks,
            bytes(r.stats.stored_bytes)
        );
        println!(
            "manifest  root {} height {} segments of {}",
            r.root.map_or("(all zeros)".to_string(), |p| p.short()),
            r.height,
            bytes(r.segment_size as u64)
        );
    }
    Ok(ExitCode::SUCCESS)
}

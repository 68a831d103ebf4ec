use std::process::ExitCode;

use anyhow::Result;
use cairn_engine::stats::repo_stats;
use serde_json::json;

use crate::context::Context;
use crate::output::{bytes, print_json};

pub async fn run(ctx: &Context) -> Result<ExitCode> {
    let repo = ctx.open().await?;
    let s = repo_stats(&repo).await?;
    let ratio = if s.stored_bytes == 0 {
        0.0
    } else {
        s.data_bytes as f64 / s.stored_bytes as f64
    };
    if ctx.json {
        print_json(&json!({
            "images": s.images,
            "versions": s.versions,
            "logical_bytes": s.logical_bytes,
            "data_bytes": s.data_bytes,
            "stored_bytes": s.stored_bytes,
            "pack_bytes": s.pack_bytes,
            "metadata_bytes": s.metadata_bytes,
            "packs": s.packs,
            "blobs": s.blobs,
            "tree_nodes": s.tree_nodes,
            "tree_bytes": s.tree_bytes,
            "reduction": ratio,
        }));
    } else {
        outln!("images          {}", s.images);
        outln!("versions        {}", s.versions);
        outln!("logical size    {} (all versions)", bytes(s.logical_bytes));
        outln!("non-zero data   {}", bytes(s.data_bytes));
        outln!(
            "stored          {} ({} in {} packs, {} other)",
            bytes(s.stored_bytes),
            bytes(s.pack_bytes),
            s.packs,
            bytes(s.metadata_bytes)
        );
        outln!(
            "tree nodes      {} in {} nodes (inside the packs)",
            bytes(s.tree_bytes),
            s.tree_nodes
        );
        outln!("reduction       {ratio:.1}x of non-zero data");
    }
    Ok(ExitCode::SUCCESS)
}

use std::process::ExitCode;

use anyhow::Result;
use cairn_engine::resolve::{resolve, VersionSpec};
use cairn_engine::stats::{repo_stats, version_layout};
use serde_json::json;

use crate::context::Context;
use crate::output::{bytes, print_json};

pub async fn run(ctx: &Context, version: Option<&str>) -> Result<ExitCode> {
    if let Some(spec) = version {
        return layout(ctx, spec).await;
    }
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

/// `cairn stats IMAGE[@REF]`: where one version's data lies in the packs.
async fn layout(ctx: &Context, spec: &str) -> Result<ExitCode> {
    let spec = VersionSpec::parse(spec)?;
    let repo = ctx.open().await?;
    let (_, record) = resolve(&repo, &spec).await?;
    let l = version_layout(&repo, &record).await?;
    if ctx.json {
        print_json(&json!({
            "image": record.image,
            "seq": record.seq,
            "data_bytes": l.data_bytes,
            "groups": l.groups,
            "group_bytes": l.group_bytes,
            "packs": l.packs,
            "reads": l.reads,
            "reads_per_gib": l.reads_per_gib(),
        }));
    } else {
        outln!("version         {}@{}", record.image, record.seq);
        outln!("data            {}", bytes(l.data_bytes));
        outln!(
            "groups          {} ({} stored) in {} packs",
            l.groups,
            bytes(l.group_bytes),
            l.packs
        );
        outln!(
            "restore reads   {} ({:.1} per GiB of data: seeks on a disk, requests on S3)",
            l.reads,
            l.reads_per_gib()
        );
    }
    Ok(ExitCode::SUCCESS)
}

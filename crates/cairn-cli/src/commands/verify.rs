use std::process::ExitCode;

use anyhow::Result;
use cairn_engine::verify::verify;
use serde_json::json;

use crate::context::Context;
use crate::output::{bytes, print_json};

pub async fn run(ctx: &Context) -> Result<ExitCode> {
    let repo = ctx.open_as("verify").await?;
    let report = verify(repo).await?;
    if ctx.json {
        print_json(&json!({
            "clean": report.is_clean(),
            "packs_checked": report.packs_checked,
            "blobs_checked": report.blobs_checked,
            "bytes_read": report.bytes_read,
            "versions_checked": report.versions_checked,
            "problems": report.problems,
            "damaged_versions": report.damaged_versions.iter().map(|d| json!({
                "image": d.image,
                "seq": d.seq,
                "id": d.id.to_hex(),
                "reason": d.reason,
            })).collect::<Vec<_>>(),
        }));
    } else {
        println!(
            "checked {} packs ({}), {} blobs, {} versions",
            report.packs_checked,
            bytes(report.bytes_read),
            report.blobs_checked,
            report.versions_checked
        );
        for p in &report.problems {
            println!("problem: {p}");
        }
        for d in &report.damaged_versions {
            println!(
                "damaged: {}@{} ({}): {}",
                d.image,
                d.seq,
                d.id.short(),
                d.reason
            );
        }
        if report.is_clean() {
            println!("no problems found");
        } else {
            println!(
                "{} problems, {} damaged versions",
                report.problems.len(),
                report.damaged_versions.len()
            );
        }
    }
    Ok(if report.is_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    })
}

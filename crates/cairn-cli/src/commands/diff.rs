//! `cairn diff A B [--stat]`: the byte ranges where two versions may differ.

use std::process::ExitCode;

use anyhow::Result;
use cairn_engine::diff::{diff, DiffReport};
use cairn_engine::resolve::{resolve, VersionSpec};
use cairn_format::Id;
use serde_json::{json, Value};

use crate::cli::DiffArgs;
use crate::context::Context;
use crate::output::{bytes, print_json};

pub async fn run(ctx: &Context, args: DiffArgs) -> Result<ExitCode> {
    let spec_a = VersionSpec::parse(&args.a)?;
    let spec_b = VersionSpec::parse(&args.b)?;
    let repo = ctx.open().await?;
    let (id_a, a) = resolve(&repo, &spec_a).await?;
    let (id_b, b) = resolve(&repo, &spec_b).await?;
    let report = diff(&repo, &a, &b).await?;
    if ctx.json {
        print_json(&report_json(&id_a, &id_b, &report, args.stat));
        return Ok(ExitCode::SUCCESS);
    }
    if !args.stat {
        for r in &report.ranges {
            outln!("{:#x} +{}", r.offset, bytes(r.len));
        }
    }
    if report.size_a != report.size_b {
        outln!(
            "size {} → {} ({} → {} bytes; the smaller compared as if zero-extended)",
            bytes(report.size_a),
            bytes(report.size_b),
            report.size_a,
            report.size_b
        );
    }
    outln!("{}", summary(&report));
    Ok(ExitCode::SUCCESS)
}

/// `N ranges, X changed, +A chunks, -R chunks, M manifest nodes read`.
fn summary(r: &DiffReport) -> String {
    format!(
        "{} {}, {} changed, +{} {}, -{} {}, {} manifest {} read",
        r.ranges.len(),
        plural(r.ranges.len() as u64, "range", "ranges"),
        bytes(r.changed_bytes),
        r.chunks_added,
        plural(r.chunks_added, "chunk", "chunks"),
        r.chunks_removed,
        plural(r.chunks_removed, "chunk", "chunks"),
        r.nodes_read,
        plural(r.nodes_read, "node", "nodes"),
    )
}

fn plural(n: u64, one: &'static str, many: &'static str) -> &'static str {
    if n == 1 {
        one
    } else {
        many
    }
}

fn report_json(a: &Id, b: &Id, r: &DiffReport, stat: bool) -> Value {
    let mut v = json!({
        "a": a.to_hex(),
        "b": b.to_hex(),
        "changed_bytes": r.changed_bytes,
        "chunks_added": r.chunks_added,
        "chunks_removed": r.chunks_removed,
        "nodes_read": r.nodes_read,
        "a_size_bytes": r.size_a,
        "b_size_bytes": r.size_b,
    });
    if !stat {
        v["ranges"] = r
            .ranges
            .iter()
            .map(|c| json!({"offset": c.offset, "len": c.len}))
            .collect();
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_engine::diff::ChangedRange;

    #[test]
    fn summary_line() {
        let r = DiffReport {
            ranges: vec![ChangedRange {
                offset: 4096,
                len: 8192,
            }],
            changed_bytes: 8192,
            chunks_added: 2,
            chunks_removed: 1,
            nodes_read: 4,
            ..DiffReport::default()
        };
        assert_eq!(
            summary(&r),
            "1 range, 8.0 KiB changed, +2 chunks, -1 chunk, 4 manifest nodes read"
        );
        assert_eq!(
            summary(&DiffReport::default()),
            "0 ranges, 0 B changed, +0 chunks, -0 chunks, 0 manifest nodes read"
        );
    }
}

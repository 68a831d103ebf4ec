//! `cairn prune (IMAGE | --all) --keep-*`: remove the versions a retention policy does not keep.

use cairn_repo::SessionKind;
use std::collections::HashMap;
use std::process::ExitCode;

use anyhow::{bail, Result};
use cairn_engine::resolve::history;
use cairn_engine::retention::prune;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use serde_json::{json, Value};

use crate::cli::PruneArgs;
use crate::commands::gc::{free_deleted, report_json, report_line};
use crate::commands::rm::GC_HINT;
use crate::context::Context;
use crate::output::{print_json, time};

pub async fn run(ctx: &Context, args: PruneArgs) -> Result<ExitCode> {
    let policy = args.keep.policy();
    if policy.is_empty() {
        bail!("refusing to remove every version: give at least one --keep-* option");
    }
    let repo = ctx.open_as(SessionKind::Edit).await?;
    let images = match (&args.image, args.all) {
        (Some(image), false) => vec![image.clone()],
        (None, true) => repo.images().await?,
        _ => bail!("give either an IMAGE or --all"),
    };
    let mut json_rows = Vec::new();
    let (mut kept, mut removed) = (0usize, 0usize);
    for image in &images {
        // The records, for times and messages (prune works on the same history).
        let records: HashMap<Id, VersionRecord> =
            history(&repo, image).await?.into_iter().collect();
        let decisions = prune(&repo, image, &policy, args.dry_run).await?;
        for d in &decisions {
            let time_ns = match records.get(&d.id) {
                Some(r) => r.time_ns,
                None => repo.load_version(&d.id).await?.time_ns, // committed meanwhile
            };
            if d.keep {
                kept += 1;
            } else {
                removed += 1;
            }
            if ctx.json {
                json_rows.push(json!({
                    "image": image,
                    "id": d.id.to_hex(),
                    "seq": d.seq,
                    "time": time(time_ns),
                    "keep": d.keep,
                    "reasons": d.reasons,
                }));
            } else {
                outln!(
                    "{:<6} {image}@{:<4} {}  {}  {}",
                    if d.keep { "keep" } else { "remove" },
                    d.seq,
                    d.id.short(),
                    time(time_ns),
                    d.reasons.join(", ")
                );
            }
        }
    }
    // Space is given back when this run removed something, or when an earlier deletion's
    // GC did not run (another GC held the lock: two prunes at once): the next prune frees
    // it, not only the next `gc`.
    let pending = removed == 0
        && !args.dry_run
        && !args.no_gc
        && cairn_engine::gc::has_unfreed_deletions(&repo)
            .await
            .unwrap_or(false);
    let freed = if args.dry_run || args.no_gc || (removed == 0 && !pending) {
        None
    } else {
        free_deleted(ctx, &repo).await
    };
    if ctx.json {
        print_json(&json!({
            "versions": Value::Array(json_rows),
            "gc": freed.as_ref().map(report_json),
        }));
        return Ok(ExitCode::SUCCESS);
    }
    let versions = |n: usize| if n == 1 { "version" } else { "versions" };
    if args.dry_run {
        outln!(
            "dry run: would keep {kept} {}, remove {removed} {}; nothing was changed",
            versions(kept),
            versions(removed)
        );
    } else {
        outln!(
            "kept {kept} {}, removed {removed} {}",
            versions(kept),
            versions(removed)
        );
        match &freed {
            Some(r) => outln!("{}", report_line(r)),
            None if removed > 0 && args.no_gc => outln!("{GC_HINT}"),
            None => {}
        }
    }
    Ok(ExitCode::SUCCESS)
}

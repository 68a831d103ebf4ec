//! `cairn rm IMAGE@REF...` (versions) and `cairn rm IMAGE` (a whole image).

use cairn_repo::SessionKind;
use std::process::ExitCode;

use anyhow::{bail, Result};
use cairn_engine::remove::{image_removal, remove_image, remove_versions, RemovedImage};
use cairn_engine::resolve::VersionSpec;
use serde_json::{json, Value};

use crate::cli::RmArgs;
use crate::commands::gc::{free_deleted, report_json, report_line};
use crate::context::Context;
use crate::failure::Refused;
use crate::output::{print_json, time, version_json};

pub const GC_HINT: &str = "run `cairn gc` to reclaim space";

pub async fn run(ctx: &Context, args: RmArgs) -> Result<ExitCode> {
    let mut versions = Vec::new();
    let mut images = Vec::new();
    for arg in &args.targets {
        let spec = VersionSpec::parse(arg)?;
        if spec.reference.is_some() {
            versions.push(spec);
        } else if !images.contains(&spec.image) {
            images.push(spec.image);
        }
    }
    let repo = ctx.open_as(SessionKind::Edit).await?;
    // Check every whole image before changing anything (versions are checked by
    // remove_versions, which also changes nothing unless all of them can go).
    for image in &images {
        if repo.head(image).await?.is_none() {
            bail!("image {image:?} does not exist");
        }
        let versions = image_removal(&repo, image).await?;
        if !args.yes {
            let n = versions.len();
            return Err(Refused(format!(
                "`cairn rm {image}` removes the whole image and its {n} {}; run again with \
                 --yes to do it, or name versions ({image}@N)",
                if n == 1 { "version" } else { "versions" }
            ))
            .into());
        }
    }
    let removed = remove_versions(&repo, &versions).await?;
    let mut removed_images: Vec<RemovedImage> = Vec::with_capacity(images.len());
    for image in &images {
        removed_images.push(remove_image(&repo, image).await?);
    }
    let freed = if args.no_gc {
        None
    } else {
        free_deleted(ctx, &repo).await
    };

    if ctx.json {
        print_json(&json!({
            "versions": Value::Array(removed.iter().map(|(id, r)| version_json(id, r, &[])).collect()),
            "images": Value::Array(removed_images.iter().map(|i| json!({
                "image": i.image,
                "versions": Value::Array(i.versions.iter().map(|(id, r)| version_json(id, r, &[])).collect()),
            })).collect()),
            "gc": freed.as_ref().map(report_json),
        }));
        return Ok(ExitCode::SUCCESS);
    }
    for (id, r) in &removed {
        outln!(
            "removed {}@{} {}  {}  {}",
            r.image,
            r.seq,
            id.short(),
            time(r.time_ns),
            r.message
        );
    }
    for i in &removed_images {
        outln!(
            "removed image {} ({} {})",
            i.image,
            i.versions.len(),
            if i.versions.len() == 1 {
                "version"
            } else {
                "versions"
            },
        );
        for (id, r) in &i.versions {
            outln!(
                "  {}@{} {}  {}  {}",
                r.image,
                r.seq,
                id.short(),
                time(r.time_ns),
                r.message
            );
        }
    }
    match &freed {
        Some(r) => outln!("{}", report_line(r)),
        None if args.no_gc => outln!("{GC_HINT}"),
        None => {}
    }
    Ok(ExitCode::SUCCESS)
}

//! `cairn tag IMAGE[@REF] NAME`, `cairn tag --delete IMAGE NAME` and `cairn tags IMAGE`.

use cairn_repo::SessionKind;
use std::process::ExitCode;

use anyhow::{bail, Result};
use cairn_engine::resolve::{resolve, VersionSpec};
use cairn_engine::EngineError;
use cairn_format::name::validate_image_name;
use cairn_format::refs::validate_tag_name;
use serde_json::{json, Value};

use crate::cli::{TagArgs, TagsArgs};
use crate::context::Context;
use crate::output::{print_json, time, version_json};

pub async fn run(ctx: &Context, args: TagArgs) -> Result<ExitCode> {
    validate_tag_name(&args.name).map_err(EngineError::from)?;
    if args.delete {
        return delete(ctx, args).await;
    }
    let spec = VersionSpec::parse(&args.spec)?;
    let repo = ctx.open_as(SessionKind::Edit).await?;
    let (id, record) = resolve(&repo, &spec).await?;
    repo.create_tag(&spec.image, &args.name, &id).await?;
    if ctx.json {
        print_json(&json!({
            "image": spec.image,
            "name": args.name,
            "id": id.to_hex(),
            "seq": record.seq,
        }));
    } else {
        outln!(
            "tagged {}@{} {} as {}",
            record.image,
            record.seq,
            id.short(),
            args.name
        );
    }
    Ok(ExitCode::SUCCESS)
}

async fn delete(ctx: &Context, args: TagArgs) -> Result<ExitCode> {
    let image = args.spec;
    if image.contains('@') {
        bail!("{image:?}: with --delete, give the image and the tag name: cairn tag --delete IMAGE NAME");
    }
    validate_image_name(&image).map_err(EngineError::from)?;
    let repo = ctx.open_as(SessionKind::Edit).await?;
    let Some(id) = repo.tag(&image, &args.name).await? else {
        bail!("image {image:?} has no tag {:?}", args.name);
    };
    repo.delete_tag(&image, &args.name).await?;
    if ctx.json {
        print_json(&json!({
            "image": image,
            "name": args.name,
            "id": id.to_hex(),
            "deleted": true,
        }));
    } else {
        outln!("deleted tag {} of {image} (was {})", args.name, id.short());
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn list(ctx: &Context, args: TagsArgs) -> Result<ExitCode> {
    validate_image_name(&args.image).map_err(EngineError::from)?;
    let repo = ctx.open().await?;
    let tags = repo.tags(&args.image).await?;
    if tags.is_empty() && repo.head(&args.image).await?.is_none() {
        bail!("image {:?} does not exist", args.image);
    }
    let mut rows = Vec::with_capacity(tags.len());
    for (name, id) in tags {
        let record = repo.load_version(&id).await?;
        rows.push((name, id, record));
    }
    if ctx.json {
        print_json(&Value::Array(
            rows.iter()
                .map(|(name, id, r)| {
                    // What the text shows: the tag, and its version as everywhere else.
                    json!({"name": name, "version": version_json(id, r, &[])})
                })
                .collect(),
        ));
    } else {
        let width = rows.iter().map(|(n, _, _)| n.len()).max().unwrap_or(0);
        for (name, id, r) in &rows {
            outln!(
                "{name:<width$}  {}@{} {}  {}  {}",
                r.image,
                r.seq,
                id.short(),
                time(r.time_ns),
                r.message
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

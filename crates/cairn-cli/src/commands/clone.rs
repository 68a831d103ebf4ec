//! `cairn clone SRC[@REF] NEWIMAGE`: a new image starting from an existing version, in O(1).

use cairn_repo::SessionKind;
use std::process::ExitCode;

use anyhow::Result;
use cairn_engine::clone::clone_version;
use cairn_engine::resolve::VersionSpec;

use crate::cli::CloneArgs;
use crate::context::Context;
use crate::output::{print_json, version_json};

pub async fn run(ctx: &Context, args: CloneArgs) -> Result<ExitCode> {
    let source = VersionSpec::parse(&args.source)?;
    let repo = ctx.open_as(SessionKind::Edit).await?;
    let (id, record) = clone_version(&repo, &source, &args.new_image, args.message).await?;
    if ctx.json {
        print_json(&version_json(&id, &record, &[]));
    } else {
        let from = match record.parent {
            Some(p) => {
                let o = repo.load_version(&p).await?;
                format!("{}@{}", o.image, o.seq)
            }
            None => source.to_string(),
        };
        outln!(
            "cloned {from} to {}@{} {}",
            record.image,
            record.seq,
            id.short()
        );
    }
    Ok(ExitCode::SUCCESS)
}

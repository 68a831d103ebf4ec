//! `cairn ls|cat IMAGE@V:/path`: files inside a version's guest file system, without a mount.

use std::io::Write;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{anyhow, Context as _, Result};
use cairn_engine::resolve::{resolve, VersionSpec};
use cairn_export::{policy, Base, ExportStats};
use cairn_files::guest::disk::DiskReader;
use cairn_files::guest::{split_guest_path, GuestEntry, GuestFs};
use cairn_files::FilesError;
use cairn_repo::SessionKind;
use serde_json::{json, Value};

use crate::cli::GuestArgs;
use crate::commands::export::open_cache;
use crate::context::Context;
use crate::output::{print_json, time};

/// A [`FilesError`] as the error the CLI classifies: the repository's and the engine's own
/// errors come out of their wrapper, so that their exit codes hold.
pub fn files_error(e: FilesError) -> anyhow::Error {
    match e {
        FilesError::Engine(e) => e.into(),
        FilesError::Repo(e) => e.into(),
        FilesError::Export(cairn_export::ExportError::Repo(e)) => e.into(),
        e => e.into(),
    }
}

/// Opens the version SPEC names (before its `:/path`) for lazy reading: the disk, the guest
/// path, the version's name (`IMAGE@N`, which errors begin with) and the base the disk reads
/// (whose read-ahead is stopped once the command is done).
async fn open(ctx: &Context, spec: &str) -> Result<(DiskReader, String, String, Arc<Base>)> {
    let (version, path) = split_guest_path(spec).ok_or_else(|| {
        cairn_engine::EngineError::BadInput(format!(
            "{spec:?}: expected IMAGE[@V]:/path (a path in the guest, starting with /)"
        ))
    })?;
    let spec = VersionSpec::parse(version)?;
    let repo = ctx.open_as(SessionKind::Read).await?;
    let (id, record) = resolve(&repo, &spec).await?;
    let cache = open_cache(None, 10 << 30)?;
    let base = Base::open(
        repo.clone(),
        cache,
        Arc::new(ExportStats::default()),
        id,
        record.clone(),
        policy::readahead(&repo, None),
    )
    .await
    .with_context(|| format!("cannot open {}@{}", record.image, record.seq))?;
    let base = Arc::new(base);
    let disk = DiskReader::new(base.clone(), tokio::runtime::Handle::current());
    let name = format!("{}@{}", record.image, record.seq);
    Ok((disk, path.to_string(), name, base))
}

fn entry_json(e: &GuestEntry) -> Value {
    json!({
        "name": e.name,
        "type": e.kind,
        "size": e.size,
        "mode": format!("{:04o}", e.mode),
        "uid": e.uid,
        "gid": e.gid,
        "mtime": e.mtime,
        "target": e.target,
    })
}

pub async fn ls(ctx: &Context, args: GuestArgs) -> Result<ExitCode> {
    let (disk, path, name, base) = open(ctx, &args.spec).await?;
    let partition = args.partition;
    let listed =
        tokio::task::spawn_blocking(move || GuestFs::open(&disk, partition)?.list(&path)).await;
    // Stopped before any error is reported: a read-ahead cut off later would log after it.
    base.stop_background().await;
    let entries = listed
        .context("the guest reader failed")?
        .map_err(files_error)
        .context(name)?;
    if ctx.json {
        print_json(&Value::Array(entries.iter().map(entry_json).collect()));
        return Ok(ExitCode::SUCCESS);
    }
    let width = entries
        .iter()
        .map(|e| e.size.to_string().len())
        .max()
        .unwrap_or(1);
    for e in &entries {
        let target = e
            .target
            .as_ref()
            .map(|t| format!(" -> {t}"))
            .unwrap_or_default();
        outln!(
            "{} {:>5} {:>5} {:>width$} {} {}{target}",
            e.mode_string(),
            e.uid,
            e.gid,
            e.size,
            &time(e.mtime.saturating_mul(1_000_000_000))[..16],
            e.name
        );
    }
    Ok(ExitCode::SUCCESS)
}

pub async fn cat(ctx: &Context, args: GuestArgs) -> Result<ExitCode> {
    let (disk, path, name, base) = open(ctx, &args.spec).await?;
    let partition = args.partition;
    let spec = args.spec.clone();
    let copied = tokio::task::spawn_blocking(move || -> Result<()> {
        let fs = GuestFs::open(&disk, partition)
            .map_err(files_error)
            .context(name.clone())?;
        let (mut file, size) = fs.open_file(&path).map_err(files_error).context(name)?;
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        let copied = std::io::copy(&mut file, &mut out)
            .map_err(|e| anyhow!("cannot copy {spec} to standard output: {e}"))?;
        out.flush().context("cannot flush standard output")?;
        if copied != size {
            return Err(anyhow!("{spec}: read {copied} of its {size} bytes"));
        }
        Ok(())
    })
    .await;
    base.stop_background().await;
    copied.context("the guest reader failed")??;
    Ok(ExitCode::SUCCESS)
}

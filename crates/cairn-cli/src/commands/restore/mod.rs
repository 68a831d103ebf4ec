use cairn_repo::SessionKind;
use std::path::Path;
use std::process::ExitCode;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context as _, Result};
use cairn_engine::resolve::{resolve, VersionSpec};
use cairn_engine::restore::{restore, QcowBase, RestoreOptions, RestoreProgress, RestoreTarget};
use serde_json::json;

use crate::cli::{OutputFormatArg, RestoreArgs};
use crate::context::Context;
use crate::output::{bytes, print_json, rate};
use crate::progress::Ticker;
use crate::provenance::{FileIdentity, Provenance};

mod in_place;

/// The format asked for, or the one OUTPUT's name says (`.qcow2`, any case), or raw.
fn output_format(asked: Option<OutputFormatArg>, output: &std::path::Path) -> OutputFormatArg {
    asked.unwrap_or_else(|| {
        let named_qcow2 = output
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("qcow2"));
        match named_qcow2 {
            true => OutputFormatArg::Qcow2,
            false => OutputFormatArg::Raw,
        }
    })
}

pub async fn run(ctx: &Context, args: RestoreArgs) -> Result<ExitCode> {
    let spec = VersionSpec::parse(&args.spec)?;
    let repo = ctx.open_as(SessionKind::Restore).await?;
    let (id, record) = resolve(&repo, &spec).await?;
    if args.in_place {
        return in_place::run(ctx, &args, repo, id, record).await;
    }
    let repo_id = repo.config().repo_id;
    let to_stdout = args.output.as_os_str() == "-";
    let qcow2 = args.backing.is_some()
        || output_format(args.format, &args.output) == OutputFormatArg::Qcow2;
    if args.backing.is_some() && args.format == Some(OutputFormatArg::Raw) {
        bail!("--backing writes a qcow2 overlay, not --format raw");
    }
    if !to_stdout {
        refuse_export_files(&args.output).await?;
    }
    let base = args.backing.as_deref().map(open_base).transpose()?;
    let target = match (to_stdout, qcow2, base.clone()) {
        (true, true, _) => anyhow::bail!("--format qcow2 needs an output file, not stdout"),
        (true, false, _) => RestoreTarget::Stdout,
        (false, false, _) => RestoreTarget::Path(args.output.clone()),
        (false, true, None) => RestoreTarget::Qcow2(args.output.clone()),
        (false, true, Some(base)) => RestoreTarget::Qcow2Overlay {
            path: args.output.clone(),
            base,
        },
    };
    let progress = Arc::new(RestoreProgress::default());
    progress.total.store(record.logical_size, Ordering::Relaxed);
    let ticker = {
        let p = progress.clone();
        let total = Arc::new(std::sync::atomic::AtomicU64::new(record.logical_size));
        Ticker::start(
            ctx.progress,
            total,
            move || p.done.load(Ordering::Relaxed),
            String::new,
        )
    };
    let started = Instant::now();
    let options = RestoreOptions {
        progress: Some(progress),
        force: args.force,
        allow_damage: args.allow_damage,
        seeds: open_seeds(ctx, &args.seeds, base.as_ref()),
        ..Default::default()
    };
    let stats = restore(repo, &record, target, options).await;
    drop(ticker);
    let stats = stats?;
    let elapsed = started.elapsed();
    if !to_stdout && stats.damaged.is_empty() {
        // A regular file now holds this version: an overlay on it commits incrementally. The
        // restore stamped it with the version's time; a file whose mtime moved since was
        // written to after it appeared (the write is not the version's).
        let now = FileIdentity::of(&args.output).filter(|i| i.mtime_ns() == record.time_ns);
        Provenance::for_repo(&repo_id).record(&args.output, now, &id);
    }
    let damaged_bytes: u64 = stats.damaged.iter().map(|d| d.len).sum();
    let summary = json!({
        "id": id.to_hex(),
        "image": record.image,
        "seq": record.seq,
        "output": args.output.display().to_string(),
        "format": if qcow2 { "qcow2" } else { "raw" },
        "logical_bytes": stats.logical_bytes,
        "data_bytes": stats.data_bytes,
        "fetched_bytes": stats.fetched_bytes,
        "reads": stats.reads,
        "seeded_bytes": stats.seeded_bytes,
        "duration_s": elapsed.as_secs_f64(),
        "damaged_bytes": damaged_bytes,
        "damaged": stats.damaged.iter().map(|d| json!({
            "offset": d.offset,
            "len": d.len,
            "reason": d.reason,
        })).collect::<Vec<_>>(),
    });
    if ctx.json && !to_stdout {
        print_json(&summary);
    } else if to_stdout {
        // Standard output holds the image: the summary goes to standard error, as the one
        // JSON line a script asked for, or as a log line.
        if ctx.json {
            eprintln!("{summary}");
        } else {
            tracing::info!("{summary}");
        }
        for d in &stats.damaged {
            eprintln!(
                "damaged: bytes {}..{} written as zeros: {}",
                d.offset,
                d.offset + d.len,
                d.reason
            );
        }
    } else {
        for d in &stats.damaged {
            outln!(
                "damaged: bytes {}..{} ({}) written as zeros: {}",
                d.offset,
                d.offset + d.len,
                bytes(d.len),
                d.reason
            );
        }
        outln!(
            "restored {}@{} to {} — {} logical, {} data in {:.2} s ({}){}{}",
            record.image,
            record.seq,
            args.output.display(),
            bytes(stats.logical_bytes),
            bytes(stats.data_bytes),
            elapsed.as_secs_f64(),
            rate(stats.data_bytes, elapsed),
            match args.seeds.is_empty() {
                true => String::new(),
                false => format!(
                    "; {} from seeds, {} fetched",
                    bytes(stats.seeded_bytes),
                    bytes(stats.fetched_bytes)
                ),
            },
            if stats.damaged.is_empty() {
                String::new()
            } else {
                format!(
                    "; {} in {} ranges could not be read and are zeros",
                    bytes(damaged_bytes),
                    stats.damaged.len()
                )
            }
        );
    }
    Ok(if stats.damaged.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    })
}

/// The seeds that open (raw or qcow2, detected); one that does not is left out with a
/// warning, as the help promises.
pub(crate) fn open_seeds(
    ctx: &Context,
    paths: &[std::path::PathBuf],
    base: Option<&QcowBase>,
) -> cairn_engine::segment::Seeds {
    use cairn_engine::source::{open_image, ReadPolicy, SourceFormat};
    let mut images: Vec<_> = base.map(|b| b.image.clone()).into_iter().collect();
    for path in paths {
        match open_image(path, SourceFormat::Auto, ReadPolicy::default()) {
            Ok(image) => images.push(image),
            Err(e) => ctx.warn(&format!("seed {} is left out: {e}", path.display())),
        }
    }
    cairn_engine::segment::Seeds::new(images)
}

/// The base of a qcow2 overlay output: opened (raw or qcow2, detected), and named in the
/// overlay's header by its absolute path with its format.
fn open_base(path: &Path) -> Result<QcowBase> {
    use cairn_engine::source::{open_image, ReadPolicy, SourceFormat};
    let absolute = std::fs::canonicalize(path)
        .with_context(|| format!("cannot use {} as the backing file", path.display()))?;
    let image = open_image(&absolute, SourceFormat::Auto, ReadPolicy::default())?;
    let format = match image.layers().first().map(|l| l.format) {
        Some(cairn_image::ImageFormat::Qcow2) => "qcow2",
        _ => "raw",
    };
    let file = absolute
        .to_str()
        .with_context(|| format!("{} is not UTF-8: QEMU cannot name it", absolute.display()))?
        .to_string();
    Ok(QcowBase {
        backing: cairn_image::qcow2::Backing { file, format },
        image,
    })
}

/// Refuses to restore onto what a running export of this host serves from: its overlay
/// directory or its socket. (Restoring there would pull the disk from under a running VM.)
pub(super) async fn refuse_export_files(output: &Path) -> Result<()> {
    let run = cairn_export::lifecycle::run_dir();
    if !run.is_dir() {
        return Ok(());
    }
    let real = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    // The target may not exist yet: its directory decides then.
    let target = match output.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) if !output.exists() => real(dir).join(output.file_name().unwrap_or_default()),
        _ => real(output),
    };
    let live = cairn_export::lifecycle::live_exports(&run)
        .await
        .unwrap_or_default();
    for export in live {
        let overlay = export.state.overlay.as_deref().map(real);
        let socket = export.state.socket.as_deref().map(real);
        let inside =
            overlay.is_some_and(|o| target.starts_with(&o)) || socket.is_some_and(|s| s == target);
        if inside {
            bail!(
                "will not restore to {}: it belongs to the running export {} (pid {}); stop it \
                 first with `cairn exports stop {}`",
                output.display(),
                export.state.name,
                export.pid,
                export.state.name
            );
        }
    }
    Ok(())
}

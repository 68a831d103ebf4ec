//! `cairn mount MOUNTPOINT`: every version as a file, until a signal unmounts it.

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{Context as _, Result};
use cairn_export::policy;
use cairn_export::ExportStats;
use cairn_files::{check_mount_point, mount, unmount, Shared, UnmountError};
use cairn_repo::SessionKind;
use serde_json::json;
use tokio::signal::unix::{signal, SignalKind};

use crate::cli::MountArgs;
use crate::commands::export::open_cache;
use crate::commands::guest::files_error;
use crate::context::Context;
use crate::output::bytes;

pub async fn run(ctx: &Context, args: MountArgs) -> Result<ExitCode> {
    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    // Refuse a bad mount point before opening anything.
    check_mount_point(&args.mountpoint).map_err(files_error)?;
    let repo = ctx.open_as(SessionKind::Export).await?;
    let cache = open_cache(args.cache.cache_dir.clone(), args.cache.cache_size)?;
    let stats = Arc::new(ExportStats::default());
    let shared = Arc::new(Shared::new(
        repo.clone(),
        cache.clone(),
        stats.clone(),
        policy::readahead(&repo, args.cache.readahead),
    ));
    let mounted = mount(
        shared.clone(),
        tokio::runtime::Handle::current(),
        &args.mountpoint,
        args.allow_other,
    )
    .map_err(files_error)?;
    let path = mounted.path().to_path_buf();
    if ctx.json {
        // One JSON line per event, as `cairn export` prints them: a caller reads the first
        // to know the mount is there.
        let line = json!({ "mounted": path, "pid": std::process::id() });
        outln!("{line}");
    } else {
        ctx.note(&format!(
            "mounted the versions read-only at {} (IMAGE/@N.raw, IMAGE/@TAG.raw, IMAGE/latest.raw); \
             Ctrl-C or SIGTERM unmounts",
            path.display()
        ));
    }

    let mut session = tokio::task::spawn_blocking(move || mounted.wait());
    let mut signals = 0;
    let stopped_by = loop {
        let sig = tokio::select! {
            r = &mut session => {
                r.context("the FUSE session thread failed")?
                    .context("the FUSE session ended with an error")?;
                break "an unmount from outside".to_string();
            }
            _ = sigterm.recv() => "SIGTERM",
            _ = sigint.recv() => "SIGINT",
        };
        signals += 1;
        let lazy = signals > 1;
        match unmount(&path, lazy) {
            Ok(()) => {
                if lazy && shared.open_files() > 0 {
                    ctx.note(&format!(
                        "detached {}; serving the {} files still open until they close",
                        path.display(),
                        shared.open_files()
                    ));
                }
                session
                    .await
                    .context("the FUSE session thread failed")?
                    .context("the FUSE session ended with an error")?;
                break sig.to_string();
            }
            Err(UnmountError::Busy) => ctx.note(&format!(
                "{} is busy ({} files open, or a process works inside it): close them and \
                 stop again, or send a second signal to detach it now",
                path.display(),
                shared.open_files()
            )),
            Err(UnmountError::Other(e)) => {
                ctx.note(&format!("cannot unmount {}: {e}", path.display()))
            }
        }
    };
    // What was fetched reaches the host-wide cache before the mount says it stopped.
    shared.stop_background().await;
    let _ = tokio::task::spawn_blocking(move || cache.flush()).await;
    let fetched = stats
        .bytes_fetched
        .load(std::sync::atomic::Ordering::Relaxed);
    if ctx.json {
        let mut v = json!({ "unmounted": path, "stopped_by": stopped_by });
        if let (Some(o), serde_json::Value::Object(s)) = (v.as_object_mut(), stats.to_json()) {
            o.extend(s);
        }
        outln!("{v}");
    } else {
        ctx.note(&format!(
            "unmounted {} ({stopped_by}); fetched {}",
            path.display(),
            bytes(fetched)
        ));
    }
    Ok(ExitCode::SUCCESS)
}

//! `cairn exports [stop NAME]`: the exports running on this host; and `cairn overlay list`
//! / `overlay discard NAME`, which work on overlays on disk with no export running.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _, Result};
use cairn_export::control;
use cairn_export::lifecycle::{self, LiveExport, Probe};
use cairn_format::Id;
use cairn_overlay::{Overlay, OverlayError, OverlayInfo};
use serde_json::{json, Value};

use crate::cli::{ExportsAction, ExportsArgs};
use crate::context::Context;
use crate::output::{bytes, print_json, time};

/// How long `exports stop` waits for an export to flush and exit.
const STOP_PATIENCE: Duration = Duration::from_secs(300);

pub async fn run(ctx: &Context, args: ExportsArgs) -> Result<ExitCode> {
    match args.action {
        None => list(ctx).await,
        Some(ExportsAction::Stop { name }) => stop(ctx, &name).await,
    }
}

/// The exports running on this host (none if the run directory does not exist yet).
async fn running() -> Result<Vec<LiveExport>> {
    let run = lifecycle::run_dir();
    if !run.exists() {
        return Ok(Vec::new());
    }
    lifecycle::ensure_private_dir(&run)?;
    Ok(lifecycle::live_exports(&run).await?)
}

async fn list(ctx: &Context) -> Result<ExitCode> {
    let mut rows = Vec::new();
    for x in running().await? {
        // The live status: the version may have moved on (COMMIT) since the export started.
        let status = control::request(&x.state.name, control::Request::Status)
            .await
            .ok();
        rows.push((x, status));
    }
    if ctx.json {
        let list: Vec<Value> = rows
            .iter()
            .map(|(x, status)| {
                let s = &x.state;
                let (version, id) = live_version(x, status.as_ref());
                let overlay = status
                    .as_ref()
                    .and_then(|v| v.get("overlay"))
                    .map(|o| {
                        json!({
                            "dir": o["dir"],
                            "held_bytes": o["held_bytes"],
                            "blocks_held": o["blocks_held"],
                            "snapshots": o["snapshots"],
                        })
                    })
                    .or_else(|| {
                        s.overlay
                            .as_ref()
                            .map(|d| json!({"dir": d.display().to_string()}))
                    });
                json!({
                    "name": s.name,
                    "version": version,
                    "id": id,
                    "pid": x.pid,
                    "uri": s.uri,
                    "socket": s.socket.as_ref().map(|p| p.display().to_string()),
                    "listen": s.listen,
                    "writable": s.writable,
                    "tls": s.tls,
                    "overlay": overlay,
                    "started": time(s.started as i64 * 1_000_000_000),
                })
            })
            .collect();
        print_json(&Value::Array(list));
        return Ok(ExitCode::SUCCESS);
    }
    if rows.is_empty() {
        outln!("no running exports");
    }
    for (x, status) in &rows {
        let s = &x.state;
        let (version, id) = live_version(x, status.as_ref());
        let overlay = match (status.as_ref().and_then(|v| v.get("overlay")), &s.overlay) {
            (Some(o), _) => format!(
                "overlay {} ({} held)",
                o["dir"].as_str().unwrap_or_default(),
                bytes(o["held_bytes"].as_u64().unwrap_or(0))
            ),
            (None, Some(d)) => format!("overlay {}", d.display()),
            (None, None) => "read-only".to_string(),
        };
        outln!(
            "{}  {version} ({}), pid {}, {}, {overlay}",
            s.name,
            &id[..id.len().min(12)],
            x.pid,
            s.uri
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// (`IMAGE@N`, id) an export serves now, from its status (else from its state file).
fn live_version(x: &LiveExport, status: Option<&Value>) -> (String, String) {
    match status {
        Some(v) if v["image"].is_string() => (
            format!("{}@{}", v["image"].as_str().unwrap_or_default(), v["seq"]),
            v["id"].as_str().unwrap_or_default().to_string(),
        ),
        _ => (x.state.version.clone(), x.state.id.clone()),
    }
}

async fn stop(ctx: &Context, name: &str) -> Result<ExitCode> {
    let run = lifecycle::run_dir();
    let ctl = lifecycle::control_path(&run, name);
    if run.exists() {
        lifecycle::ensure_private_dir(&run)?;
    }
    let state = lifecycle::read_states(&run)
        .into_iter()
        .find(|s| s.name == name);
    let pid = match lifecycle::probe(&ctl).await? {
        Probe::Live { pid: Some(pid) } => pid,
        Probe::Live { pid: None } if state.is_some() => state.as_ref().expect("state").pid,
        _ => bail!(
            "no running export named {name:?} (run directory {})",
            run.display()
        ),
    };
    // Every export this process serves stops with it.
    let mut names: Vec<String> = lifecycle::read_states(&run)
        .into_iter()
        .filter(|s| s.pid == pid)
        .map(|s| s.name)
        .collect();
    if !names.iter().any(|n| n == name) {
        names.insert(0, name.to_string());
    }
    let pid_t = i32::try_from(pid).context("pid out of range")?;
    // SAFETY: kill has no memory-safety preconditions; the pid is the one listening on the
    // export's control socket (SO_PEERCRED), in our private run directory.
    if unsafe { libc::kill(pid_t, libc::SIGTERM) } != 0 {
        let e = std::io::Error::last_os_error();
        bail!("cannot send SIGTERM to export {name} (pid {pid}): {e}");
    }
    let deadline = Instant::now() + STOP_PATIENCE;
    while matches!(lifecycle::probe(&ctl).await?, Probe::Live { .. }) || process_alive(pid) {
        if Instant::now() > deadline {
            bail!(
                "export {name} (pid {pid}) did not stop within {} s of SIGTERM",
                STOP_PATIENCE.as_secs()
            );
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    if ctx.json {
        print_json(&json!({"stopped": names, "pid": pid}));
    } else if names.len() == 1 {
        outln!("stopped export {} (pid {pid})", names[0]);
    } else {
        outln!("stopped exports {} (pid {pid})", names.join(", "));
    }
    Ok(ExitCode::SUCCESS)
}

/// Whether process `pid` still runs (a zombie, which has exited but was not reaped yet, does
/// not).
fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name.
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state != "Z" && state != "X"),
        Err(_) => false,
    }
}

/// Where overlays live by default: `$XDG_STATE_HOME/cairn/overlays`, else
/// `~/.local/state/cairn/overlays`.
pub fn overlay_root() -> PathBuf {
    std::env::var_os("XDG_STATE_HOME")
        .filter(|d| !d.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))
        .unwrap_or_else(std::env::temp_dir)
        .join("cairn/overlays")
}

/// The default overlay directory of export `name`.
pub fn default_overlay_dir(name: &str) -> PathBuf {
    overlay_dir_in(&overlay_root(), name)
}

/// `name`'s overlay directory under `root`: its own (`lifecycle::file_key`), or, when only
/// the one an older cairn named it by exists, that one. The older name could be another
/// image's too (`vm/disk0` and `vm_disk0` shared it), which opening it finds out: an overlay
/// holding writes on another version is refused (its base differs).
fn overlay_dir_in(root: &Path, name: &str) -> PathBuf {
    let dir = root.join(lifecycle::file_key(name));
    let legacy = root.join(lifecycle::legacy_file_key(name));
    match !dir.exists() && legacy != dir && legacy.exists() {
        true => legacy,
        false => dir,
    }
}

/// The running export that holds the overlay in `dir`, if one does.
fn holder(live: &[LiveExport], dir: &Path) -> Option<(String, u32)> {
    let dir = std::path::absolute(dir).unwrap_or(dir.to_path_buf());
    live.iter()
        .find(|x| x.state.overlay.as_deref() == Some(dir.as_path()))
        .map(|x| (x.state.name.clone(), x.pid))
}

/// `cairn overlay list` (no export): the overlays under the default root.
pub async fn list_overlays(ctx: &Context) -> Result<ExitCode> {
    let root = overlay_root();
    let live = running().await?;
    let mut dirs: Vec<PathBuf> = match std::fs::read_dir(&root) {
        Ok(d) => d
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.join("meta.json").exists())
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(e).with_context(|| format!("cannot list {}", root.display())),
    };
    dirs.sort();
    // Name base versions when a repository is at hand.
    let repo = match ctx.repo.as_deref() {
        Some(r) if !r.is_empty() => ctx.open().await.ok(),
        _ => None,
    };
    let mut rows = Vec::new();
    for dir in dirs {
        let info = Overlay::inspect(&dir)
            .with_context(|| format!("cannot read the overlay {}", dir.display()))?;
        let version = match (&repo, info.base.parse::<Id>()) {
            (Some(repo), Ok(id)) => repo
                .load_version(&id)
                .await
                .ok()
                .map(|r| format!("{}@{}", r.image, r.seq)),
            _ => None,
        };
        let held_by = holder(&live, &dir);
        rows.push((info, version, held_by));
    }
    if ctx.json {
        print_json(&Value::Array(
            rows.iter()
                .map(|(i, version, held_by)| {
                    json!({
                        "name": file_name(&i.dir),
                        "dir": i.dir.display().to_string(),
                        "base": i.base,
                        "base_version": version,
                        "held_bytes": i.held_bytes,
                        "blocks_held": i.blocks_held,
                        "snapshots": i.snapshots,
                        "export": held_by.as_ref().map(|(n, p)| json!({"name": n, "pid": p})),
                    })
                })
                .collect(),
        ));
        return Ok(ExitCode::SUCCESS);
    }
    if rows.is_empty() {
        outln!("no overlays in {}", root.display());
    }
    for (i, version, held_by) in &rows {
        let short = &i.base[..i.base.len().min(12)];
        let base = match version {
            Some(v) => format!("{v} ({short})"),
            None => short.to_string(),
        };
        let snapshots = if i.snapshots.is_empty() {
            "no snapshots".to_string()
        } else {
            format!("snapshots {}", i.snapshots.join(", "))
        };
        let used = match held_by {
            Some((n, p)) => format!("in use by export {n:?} (pid {p})"),
            None => "not in use".to_string(),
        };
        outln!(
            "{}  base {base}, {} held in {} block{}, {snapshots}, {used}",
            file_name(&i.dir),
            bytes(i.held_bytes),
            i.blocks_held,
            if i.blocks_held == 1 { "" } else { "s" },
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// The export name an overlay directory under the root is for (its file key decoded).
fn file_name(dir: &Path) -> String {
    dir.file_name()
        .map(|n| lifecycle::name_of_file_key(&n.to_string_lossy()))
        .unwrap_or_default()
}

/// `cairn overlay discard NAME [--yes]`: NAME is an export name (its overlay under the
/// default root) or, starting with `/` or `.`, an overlay directory.
pub async fn discard_overlay(ctx: &Context, name: &str, yes: bool) -> Result<ExitCode> {
    let root = overlay_root();
    let by_path = name.starts_with('/') || name.starts_with('.');
    let (label, dir) = if by_path {
        (name.to_string(), PathBuf::from(name))
    } else {
        (name.to_string(), overlay_dir_in(&root, name))
    };
    let info: OverlayInfo = match Overlay::inspect(&dir) {
        Ok(i) => i,
        Err(OverlayError::NotAnOverlay { .. }) if !by_path => {
            bail!("no overlay named {label} in {}", root.display())
        }
        Err(OverlayError::NotAnOverlay { .. }) => bail!("no overlay in {}", dir.display()),
        Err(e) => return Err(e.into()),
    };
    let live = running().await?;
    if let Some((export, pid)) = holder(&live, &dir) {
        bail!(
            "overlay {} is in use by export {export:?} (pid {pid}); stop it first with `cairn \
             exports stop {export}`",
            dir.display()
        );
    }
    let held = bytes(info.held_bytes);
    if !yes {
        return Err(crate::failure::Refused(format!(
            "discarding overlay {label} deletes {} and its {held} of writes that were never \
             committed; run again with --yes to do it",
            dir.display()
        ))
        .into());
    }
    match Overlay::discard(&dir) {
        Ok(()) => {}
        Err(OverlayError::Locked { .. }) => bail!(
            "overlay {} is in use by another process (its lock is held)",
            dir.display()
        ),
        Err(e) => return Err(e.into()),
    }
    if ctx.json {
        print_json(&json!({"discarded": dir.display().to_string(), "held_bytes": info.held_bytes}));
    } else {
        outln!("discarded overlay {label} ({held} of writes)");
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlay_dirs_of_names_that_older_cairns_confused_stay_apart() {
        let root = tempfile::tempdir().unwrap();
        let a = overlay_dir_in(root.path(), "vm/disk0");
        let b = overlay_dir_in(root.path(), "vm_disk0");
        assert_ne!(a, b);
        assert_eq!(a, root.path().join("vm%2Fdisk0"));
        // An overlay an older cairn made for vm/disk0 (as vm_disk0) is still found by it.
        std::fs::create_dir(root.path().join("vm_disk0")).unwrap();
        assert_eq!(
            overlay_dir_in(root.path(), "vm/disk0"),
            root.path().join("vm_disk0")
        );
        assert_eq!(
            overlay_dir_in(root.path(), "vm_disk0"),
            root.path().join("vm_disk0")
        );
        // Once its own exists, that one is used.
        std::fs::create_dir(&a).unwrap();
        assert_eq!(overlay_dir_in(root.path(), "vm/disk0"), a);
    }
}

//! Saving a running QEMU's memory and device state for a VM version (iROW's memory state).
//!
//! The state is QEMU's own migration stream, sent to a Unix socket cairn listens on and laid
//! out as a memory state image as it arrives ([`crate::migration::receive`]). The guest runs
//! while its RAM is copied; QEMU pauses it for the last pass ("downtime"), and it stays paused
//! until the disks' point in time is taken: disks and memory are one instant. Then it runs
//! again. No guest agent freeze is asked for: a guest resumed from this state must not wake
//! up frozen, and it needs no freeze, since its memory holds everything in flight.
//!
//! A migration leaves QEMU's disks inactive (handed over, as for a destination); exporting a
//! node over NBD makes QEMU take them back (QEMU's `block-export-add` activates its node), so
//! the point in time can be taken before the guest runs. A marker file in the run directory
//! says while cairn holds the guest paused: if cairn is killed then, the next backup resumes
//! the guest.

use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::error::{VmError, VmResult};
use crate::migration::{receive, Received};
use crate::qmp::Qmp;

/// How long the copy may take before the guest is paused so that it finishes (a guest that
/// writes memory faster than it can be copied never lets a live migration end).
const CONVERGE: Duration = Duration::from_secs(60);
/// Bandwidth asked of the migration while cairn copies (QEMU's default is 128 MiB/s, for
/// networks; this is a local socket).
const BANDWIDTH: u64 = 16 << 30;

/// A memory state saved into an image file; the guest is paused until [`resume`].
#[derive(Debug)]
pub struct Saved {
    pub file: PathBuf,
    pub received: Received,
    /// The guest's pause as QEMU measured it (the last pass), in ms.
    pub downtime: Duration,
    /// When the migration completed (the guest has been paused since).
    pub paused_at: Instant,
    /// The copy took so long that cairn paused the guest to finish it.
    pub forced_pause: bool,
    pub duration: Duration,
}

/// What to undo when the guest may run again.
struct Marker {
    was_running: bool,
    bandwidth: Option<u64>,
}

impl Marker {
    fn to_json(&self) -> String {
        json!({"was_running": self.was_running, "bandwidth": self.bandwidth}).to_string()
    }

    /// A marker that cannot be read errs toward letting the guest run.
    fn parse(text: &str) -> Marker {
        let v: serde_json::Value = serde_json::from_str(text).unwrap_or_default();
        Marker {
            was_running: v["was_running"].as_bool().unwrap_or(true),
            bandwidth: v["bandwidth"].as_u64(),
        }
    }
}

fn marker_path(vm_key: &str) -> PathBuf {
    cairn_export::lifecycle::run_dir().join(format!("backup-vm-{vm_key}.paused"))
}

/// Saves the memory state into `file` (created owner-only; the guest's RAM is private).
pub async fn save(qmp: &mut Qmp, vm_key: &str, file: &Path, socket: &Path) -> VmResult<Saved> {
    let started = Instant::now();
    let status = qmp.execute("query-status", json!({})).await?;
    let was_running = status["running"].as_bool().unwrap_or(false);
    let params = qmp.execute("query-migrate-parameters", json!({})).await?;
    let marker = Marker {
        was_running,
        bandwidth: params["max-bandwidth"].as_u64(),
    };
    write_marker(vm_key, &marker)?;
    qmp.execute(
        "migrate-set-parameters",
        json!({"max-bandwidth": BANDWIDTH}),
    )
    .await?;
    let image = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(file)
            .map_err(|e| VmError::io(format!("memory state file {}", file.display()), e))?
    };
    let _ = std::fs::remove_file(socket);
    let listener = UnixListener::bind(socket)
        .map_err(|e| VmError::io(format!("migration socket {}", socket.display()), e))?;
    let reader = tokio::task::spawn_blocking(move || {
        let (stream, _) = listener.accept()?;
        receive(stream, &image).map_err(|e| std::io::Error::other(e.to_string()))
    });
    let outcome = migrate(qmp, socket).await;
    if outcome.is_err() {
        // Unblocks the reader if QEMU never connected.
        let _ = std::os::unix::net::UnixStream::connect(socket);
    }
    let received = reader
        .await
        .map_err(|e| VmError::State(format!("memory state reader: {e}")));
    let _ = std::fs::remove_file(socket);
    let (downtime, forced_pause) = outcome?;
    let received =
        received?.map_err(|e| VmError::State(format!("the migration stream QEMU sent: {e}")))?;
    Ok(Saved {
        file: file.to_path_buf(),
        received,
        downtime,
        paused_at: Instant::now(),
        forced_pause,
        duration: started.elapsed(),
    })
}

/// Runs the migration to `socket` until QEMU says it completed; (downtime, forced pause).
async fn migrate(qmp: &mut Qmp, socket: &Path) -> VmResult<(Duration, bool)> {
    qmp.execute(
        "migrate",
        json!({"uri": format!("unix:{}", socket.display())}),
    )
    .await?;
    let started = Instant::now();
    let mut forced = false;
    loop {
        let info = qmp.execute("query-migrate", json!({})).await?;
        match info["status"].as_str().unwrap_or("") {
            "completed" => {
                let ms = info["downtime"].as_u64().unwrap_or(0);
                return Ok((Duration::from_millis(ms), forced));
            }
            s @ ("failed" | "cancelled") => {
                return Err(VmError::State(format!(
                    "saving the memory state: the migration {s}{}",
                    info["error-desc"]
                        .as_str()
                        .map(|d| format!(": {d}"))
                        .unwrap_or_default()
                )))
            }
            _ => {}
        }
        if !forced && started.elapsed() > CONVERGE {
            tracing::warn!("the guest writes memory faster than it is copied: pausing it");
            qmp.execute("stop", json!({})).await?;
            forced = true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Lets the guest run again (when it ran before) and puts the migration settings back.
pub async fn resume(qmp: &mut Qmp, vm_key: &str) -> VmResult<bool> {
    let path = marker_path(vm_key);
    let Ok(text) = std::fs::read_to_string(&path) else {
        return Ok(false);
    };
    let marker = Marker::parse(&text);
    let info = qmp.execute("query-migrate", json!({})).await?;
    if matches!(
        info["status"].as_str(),
        Some("active" | "setup" | "pre-switchover" | "device")
    ) {
        qmp.execute("migrate_cancel", json!({})).await?;
    }
    if let Some(b) = marker.bandwidth {
        qmp.execute("migrate-set-parameters", json!({"max-bandwidth": b}))
            .await?;
    }
    let status = qmp.execute("query-status", json!({})).await?;
    let resumed = marker.was_running && !status["running"].as_bool().unwrap_or(true);
    if resumed {
        qmp.execute("cont", json!({})).await?;
    }
    let _ = std::fs::remove_file(&path);
    Ok(resumed)
}

fn write_marker(vm_key: &str, marker: &Marker) -> VmResult<()> {
    let path = marker_path(vm_key);
    let text = marker.to_json();
    cairn_export::lifecycle::ensure_private_dir(&cairn_export::lifecycle::run_dir())
        .map_err(|e| VmError::State(format!("run directory: {e}")))?;
    std::fs::write(&path, text).map_err(|e| VmError::io(format!("{}", path.display()), e))
}

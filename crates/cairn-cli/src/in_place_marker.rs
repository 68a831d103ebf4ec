//! The marker of an in-place restore: while one runs, and after one was interrupted, its
//! target holds part of the version being restored and part of what it held before — neither.
//!
//! `restore --in-place` writes the marker (synced) before the first byte of its target
//! changes and removes it after the last one is synced. While a marker stands:
//! - the provenance records never say the target holds a version (`provenance.rs`), so
//!   neither a commit of an overlay on it nor another in-place restore trusts its content;
//! - `commit` refuses the target as its source;
//! - `restore --in-place` into it compares by hash, which is how running it again finishes
//!   the job.
//!
//! Markers are host-local, one file per target, named by the hash of its canonical path:
//! `STATE_DIR/in-place/HASH.json` (see `provenance::state_dir`), shared by all repositories,
//! since a torn file is torn whichever repository it would be committed to.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use serde::{Deserialize, Serialize};

/// What a marker says.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Marker {
    /// The target, as its canonical path.
    pub target: PathBuf,
    /// The version being restored: `IMAGE@SEQ` and its id.
    pub version: String,
    pub id: String,
    /// The restoring process, and its start time (ticks since boot), to tell whether it runs.
    pub pid: u32,
    pub start_ticks: u64,
}

impl Marker {
    /// Whether the restore that wrote the marker is still running.
    pub fn running(&self) -> bool {
        cairn_repo::session::process_alive(self.pid, self.start_ticks)
    }

    /// One line on the state of the target, for refusals.
    pub fn describe(&self) -> String {
        match self.running() {
            true => format!(
                "an in-place restore of {} into it is running (pid {})",
                self.version, self.pid
            ),
            false => format!(
                "an in-place restore of {} into it was interrupted, so it holds part of that \
                 version and part of what it held before; run `cairn restore {} {} \
                 --in-place` again to finish it",
                self.version,
                self.version,
                self.target.display()
            ),
        }
    }
}

fn marker_file(canonical: &Path) -> PathBuf {
    let hash = cairn_format::Id::of(canonical.as_os_str().as_encoded_bytes()).to_hex();
    crate::provenance::state_dir()
        .join("in-place")
        .join(format!("{}.json", &hash[..32]))
}

/// The marker of the target at `path`, if an in-place restore into it runs or was
/// interrupted.
pub fn find(path: &Path) -> Option<Marker> {
    let canonical = fs::canonicalize(path).ok()?;
    let raw = fs::read(marker_file(&canonical)).ok()?;
    let marker: Marker = serde_json::from_slice(&raw).ok()?;
    (marker.target == canonical).then_some(marker)
}

/// A marker written for a running in-place restore; [`Guard::finish`] removes it. Dropped
/// without it (the restore failed), the marker stays.
pub struct Guard {
    file: PathBuf,
}

/// Writes the marker for an in-place restore of `version` (`IMAGE@SEQ`, id `id`) into the
/// target at `path`, synced, before any byte of it changes.
pub fn begin(path: &Path, version: &str, id: &str) -> Result<Guard> {
    let canonical = fs::canonicalize(path)
        .with_context(|| format!("cannot resolve the path {}", path.display()))?;
    let marker = Marker {
        target: canonical.clone(),
        version: version.to_string(),
        id: id.to_string(),
        pid: std::process::id(),
        start_ticks: cairn_repo::session::current_process().map_or(0, |p| p.start_ticks),
    };
    let file = marker_file(&canonical);
    let dir = file.parent().expect("a marker file has a directory");
    let write = || -> std::io::Result<()> {
        fs::create_dir_all(dir)?;
        let tmp = file.with_extension(format!("json.tmp-{}", std::process::id()));
        let mut f = fs::File::create(&tmp)?;
        f.write_all(&serde_json::to_vec(&marker).map_err(std::io::Error::other)?)?;
        f.sync_all()?;
        fs::rename(&tmp, &file)?;
        fs::File::open(dir)?.sync_all()
    };
    write().with_context(|| {
        format!(
            "cannot write the in-place restore marker {} (nothing was written to {})",
            file.display(),
            path.display()
        )
    })?;
    Ok(Guard { file })
}

impl Guard {
    /// The target holds the version, synced: the marker goes.
    pub fn finish(self) {
        if let Err(e) = fs::remove_file(&self.file) {
            tracing::warn!(file = %self.file.display(), "cannot remove the in-place marker: {e}");
        }
    }
}

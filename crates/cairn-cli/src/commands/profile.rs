//! Boot profiles on `cairn export`: `--record-profile PATH` writes the guest's first reads to
//! PATH once the recording is over (or when the export stops); `--profile PATH` fetches them
//! ahead of the guest. A profile that does not fit is ignored with a warning: it can only
//! ever make fetches earlier, never change what is served.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cairn_export::profile::{self, BootProfile, Recorder};
use cairn_export::{Base, ExportStats};

use crate::context::Context;

/// Reads the profile at `path` and starts fetching its reads for `base`, unless it does not
/// fit `base`'s image and size (then a warning says why, and nothing is fetched).
pub fn start_prefetch(ctx: &Context, path: &Path, base: Arc<Base>, stats: Arc<ExportStats>) {
    let parsed = std::fs::read(path)
        .map_err(|e| e.to_string())
        .and_then(|bytes| BootProfile::parse(&bytes));
    let p = match parsed {
        Ok(p) => p,
        Err(e) => {
            ctx.warn(&format!("boot profile {} is ignored: {e}", path.display()));
            return;
        }
    };
    let record = base.record();
    if let Some(why) = p.misfit(&record.image, record.logical_size) {
        ctx.warn(&format!(
            "boot profile {} is ignored: {why} (serving {}@{}, {} bytes)",
            path.display(),
            record.image,
            record.seq,
            record.logical_size
        ));
        return;
    }
    tracing::info!(
        "prefetching {} bytes in {} reads from boot profile {}",
        p.bytes(),
        p.reads.len(),
        path.display()
    );
    tokio::spawn(profile::prefetch(base, p, stats));
}

/// Writes what a recorder recorded to its file, once.
pub struct ProfileWriter {
    path: PathBuf,
    recorder: Arc<Recorder>,
    image: String,
    size: u64,
    written: AtomicBool,
}

impl ProfileWriter {
    pub fn new(path: PathBuf, recorder: Arc<Recorder>, base: &Base) -> Arc<ProfileWriter> {
        Arc::new(ProfileWriter {
            path,
            recorder,
            image: base.record().image.clone(),
            size: base.size(),
            written: AtomicBool::new(false),
        })
    }

    /// Writes the profile when the recording is over (checked every second).
    pub fn write_when_done(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move {
            while !me.recorder.done() {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            me.write();
        });
    }

    /// Writes the profile (private to its owner, put in place whole) unless it was written;
    /// a failure is a warning: the export goes on.
    pub fn write(&self) {
        if self.written.swap(true, Ordering::SeqCst) {
            return;
        }
        let p = self.recorder.profile(&self.image, self.size);
        let tmp = self.path.with_extension("tmp");
        let result = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&tmp)
            .and_then(|mut f| {
                f.write_all(&serde_json::to_vec(&p).map_err(std::io::Error::other)?)?;
                f.sync_all()
            })
            .and_then(|()| std::fs::rename(&tmp, &self.path));
        match result {
            Ok(()) => tracing::info!(
                "boot profile {}: {} bytes in {} reads",
                self.path.display(),
                p.bytes(),
                p.reads.len()
            ),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                tracing::warn!("cannot write boot profile {}: {e}", self.path.display());
            }
        }
    }
}

//! What this store's listings saw of each directory they read, so that the sweep for stale
//! temporary files need not read those directories again (a GC listed all 257 pack
//! directories, then would walk them all once more for temporaries).
//!
//! Why it is sound: the sweep removes temporaries last written before a cutoff that precedes
//! the start of every writer still alive. A temporary written before the cutoff existed
//! before any directory read that began after it, and a read of a directory returns every
//! entry present for the whole read; so such a read saw it. A subdirectory created after the
//! read holds only files written after it, which are too new to remove. Reads that began
//! less than [`SLACK`] after the cutoff are not trusted (file times come from a coarse
//! clock), nor are reads that could not tell every entry's type.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};

/// How much later than the cutoff a read must have begun to be trusted by the sweep.
pub(super) const SLACK: Duration = Duration::from_secs(1);

/// One read of a directory: when it began, its subdirectories and its temporary files.
#[derive(Clone, Debug)]
pub(super) struct SeenDir {
    pub(super) read_at: SystemTime,
    pub(super) subdirs: Vec<PathBuf>,
    pub(super) temporaries: Vec<PathBuf>,
}

impl SeenDir {
    /// A read of a directory beginning now.
    pub(super) fn begin() -> SeenDir {
        SeenDir {
            read_at: SystemTime::now(),
            subdirs: Vec::new(),
            temporaries: Vec::new(),
        }
    }
}

/// The latest complete read of each directory a listing read (one entry per directory of
/// the store at most: bounded by the store's own layout).
#[derive(Debug, Default)]
pub(super) struct SeenDirs(Mutex<HashMap<PathBuf, SeenDir>>);

impl SeenDirs {
    /// Records the read of `dir`.
    pub(super) fn record(&self, dir: &Path, seen: SeenDir) {
        self.0
            .lock()
            .expect("seen-dirs lock")
            .insert(dir.to_path_buf(), seen);
    }

    /// The read of `dir` the sweep for temporaries last written before `cutoff` may use
    /// instead of reading it: one that began at least [`SLACK`] after the cutoff.
    pub(super) fn usable(&self, dir: &Path, cutoff: SystemTime) -> Option<SeenDir> {
        let seen = self.0.lock().expect("seen-dirs lock").get(dir).cloned()?;
        (seen.read_at >= cutoff + SLACK).then_some(seen)
    }
}

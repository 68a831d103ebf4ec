//! Which local files hold which version, so a qcow2 overlay on top of one is committed
//! incrementally without being told its parent.
//!
//! When cairn commits a local file in full, or restores a version to a regular file, it
//! records the file's identity — path, device, inode, size, mtime and ctime — and the
//! version. When a later commit's source is a qcow2 overlay, the files of its backing chain
//! are looked up: a file whose identity still matches exactly holds that version's bytes (any
//! write since would have changed its mtime and ctime, and ctime cannot be set back by
//! users), so only the layers above it need reading.
//!
//! Two races are closed. A file modified within [`RACY_NS`] of the moment its identity is
//! taken is not recorded (a write in the same clock tick would not change its mtime). A
//! restore stamps the file it wrote with the version's time as its mtime before it links it
//! into place, and records it only if the file still has that mtime afterwards: a process
//! that wrote to it once it appeared has changed the mtime to its own now.
//!
//! The records are a host-local cache (`$XDG_CACHE_HOME/cairn/provenance/REPO_ID.json`, or
//! `$CAIRN_STATE_DIR`): losing them costs one full scan, never correctness. Concurrent
//! writers may lose each other's records (last rename wins), with the same consequence.

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use cairn_format::Id;
use serde::{Deserialize, Serialize};

/// Records kept per repository (the oldest are dropped beyond it).
const MAX_RECORDS: usize = 4096;

/// What identifies a file's current content without reading it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileIdentity {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i64,
    ctime_ns: i64,
}

/// How recent a modification must be to make an identity "racily clean" (git's term): a
/// write in the same tick of the file system's clock as the one before leaves the mtime as
/// it was, so a file modified this recently may change without its identity showing it.
/// Generous (file systems keep times in ticks of a few ms, some in seconds).
const RACY_NS: i64 = 2_000_000_000;

impl FileIdentity {
    /// The file's modification time (ns since the epoch).
    pub fn mtime_ns(&self) -> i64 {
        self.mtime_ns
    }

    /// The identity of a regular file now, if it was last modified long enough ago that any
    /// later write will show in it (not racily clean; see [`RACY_NS`]).
    pub fn settled(path: &Path) -> Option<FileIdentity> {
        FileIdentity::of(path).filter(|i| i.mtime_ns <= cairn_repo::session::now_ns() - RACY_NS)
    }

    /// The identity of a regular file now (`None` for anything else or on error).
    pub fn of(path: &Path) -> Option<FileIdentity> {
        let m = fs::metadata(path).ok()?;
        m.is_file().then(|| FileIdentity {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
            ctime_ns: m.ctime() * 1_000_000_000 + m.ctime_nsec(),
        })
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    identity: FileIdentity,
    version: String,
    /// When the record was written (ns since the epoch), to drop the oldest.
    at_ns: i64,
}

/// Where the host-local records live: `$CAIRN_STATE_DIR`, or the user's cache directory.
pub fn state_dir() -> PathBuf {
    std::env::var_os("CAIRN_STATE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| cairn_repo::user_cache_dir().join("provenance"))
}

pub struct Provenance {
    file: PathBuf,
}

impl Provenance {
    /// The records of the repository with id `repo_id`.
    pub fn for_repo(repo_id: &[u8; 16]) -> Provenance {
        Provenance {
            file: state_dir().join(format!("{}.json", hex::encode(repo_id))),
        }
    }

    /// Forgets what `path` held (it is about to be rewritten).
    pub fn forget(&self, path: &Path) {
        let Ok(canonical) = fs::canonicalize(path) else {
            return;
        };
        let mut records = self.load();
        if records.remove(&canonical).is_some() {
            if let Err(e) = self.save(&records) {
                tracing::debug!(file = %self.file.display(), "cannot save provenance: {e}");
            }
        }
    }

    fn load(&self) -> BTreeMap<PathBuf, Record> {
        fs::read(&self.file)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default()
    }

    /// Records that `path` holds `version`, if its identity is still `before` (the file did
    /// not change while it was read or written). Failures are logged, never fatal.
    pub fn record(&self, path: &Path, before: Option<FileIdentity>, version: &Id) {
        let (Some(before), Ok(canonical)) = (before, fs::canonicalize(path)) else {
            return;
        };
        if FileIdentity::of(path) != Some(before) {
            tracing::debug!(path = %path.display(), "changed while cairn used it; not recorded");
            return;
        }
        let mut records = self.load();
        records.insert(
            canonical,
            Record {
                identity: before,
                version: version.to_hex(),
                at_ns: cairn_repo::session::now_ns(),
            },
        );
        while records.len() > MAX_RECORDS {
            let oldest = records
                .iter()
                .min_by_key(|(_, r)| r.at_ns)
                .map(|(p, _)| p.clone())
                .expect("non-empty");
            records.remove(&oldest);
        }
        if let Err(e) = self.save(&records) {
            tracing::debug!(file = %self.file.display(), "cannot save provenance: {e}");
        }
    }

    fn save(&self, records: &BTreeMap<PathBuf, Record>) -> std::io::Result<()> {
        let dir = self.file.parent().expect("provenance file has a directory");
        fs::create_dir_all(dir)?;
        let tmp = self
            .file
            .with_extension(format!("json.tmp-{}", std::process::id()));
        let mut f = fs::File::create(&tmp)?;
        f.write_all(&serde_json::to_vec(records).map_err(std::io::Error::other)?)?;
        f.sync_all()?;
        fs::rename(&tmp, &self.file)
    }

    /// The version `path` holds, if cairn recorded it and the file has not changed since.
    pub fn lookup(&self, path: &Path) -> Option<Id> {
        let canonical = fs::canonicalize(path).ok()?;
        if crate::in_place_marker::find(&canonical).is_some() {
            return None; // torn by an in-place restore: neither version
        }
        let identity = FileIdentity::of(&canonical)?;
        let records = self.load();
        let r = records.get(&canonical)?;
        (r.identity == identity)
            .then(|| r.version.parse().ok())
            .flatten()
    }
}

/// The records answer the engine's question "which version does this file hold?" when it
/// plans a commit of a qcow2 overlay.
impl cairn_engine::commit::plan::KnownVersions for Provenance {
    fn lookup(&self, path: &Path) -> Option<Id> {
        Provenance::lookup(self, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_holds_until_the_file_changes() {
        let dir = tempfile::tempdir().unwrap();
        let state = dir.path().join("state");
        let p = Provenance {
            file: state.join("r.json"),
        };
        let img = dir.path().join("base.raw");
        fs::write(&img, b"version one").unwrap();
        let id = Id::of(b"v1");
        p.record(&img, FileIdentity::of(&img), &id);
        assert_eq!(p.lookup(&img), Some(id));
        // A write changes mtime/ctime (and here the size): the record no longer applies.
        std::thread::sleep(std::time::Duration::from_millis(20));
        fs::write(&img, b"version two").unwrap();
        assert_eq!(p.lookup(&img), None);
        // A file that changed while being committed is not recorded at all.
        let before = FileIdentity::of(&img);
        std::thread::sleep(std::time::Duration::from_millis(20));
        fs::write(&img, b"version three").unwrap();
        p.record(&img, before, &Id::of(b"v3"));
        assert_eq!(p.lookup(&img), None);
    }
}

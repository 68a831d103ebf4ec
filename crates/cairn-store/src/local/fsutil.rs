//! Blocking filesystem helpers of the local store: durable writes, the ref lock, listing.
//!
//! Everything here is synchronous and runs inside `spawn_blocking`.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use super::seen_dirs::{SeenDir, SeenDirs};
use crate::key::TEMP_PREFIX;
use crate::{ObjectMeta, StoreError, StoreResult};

/// Whether `err` means "there is no file there": missing, or a path component (or the path
/// itself) is a directory where a file was expected. Keys map to files, so all of these mean
/// "no such object".
pub(super) fn is_absent(err: &io::Error) -> bool {
    err.kind() == io::ErrorKind::NotFound
        || matches!(err.raw_os_error(), Some(libc::ENOTDIR) | Some(libc::EISDIR))
}

/// Flush a directory's entries, so that a file created, linked, renamed or removed in it
/// survives a crash. Without this, `sync_all` on the file alone does not persist its name.
pub(super) fn fsync_dir(dir: &Path) -> StoreResult<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| StoreError::io("fsync directory", dir, e))
}

/// The permissions of what a local repository creates. Private to the owner (0600 files,
/// 0700 directories, as restic's) unless the repository root grants more: each read bit the
/// root gives its group or others is given to files (and with its search bit to
/// directories) — `chmod 750 REPO` makes a repository readable by its group. Never write
/// bits: under any umask, nothing cairn writes is writable by another user.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Modes {
    pub file: u32,
    pub dir: u32,
}

impl Modes {
    /// What a new repository's root gets: private.
    pub const PRIVATE: Modes = Modes {
        file: 0o600,
        dir: 0o700,
    };

    /// The modes for a repository whose root has permission bits `root`.
    pub fn of_root(root: u32) -> Modes {
        let read = root & 0o044;
        let search = root & 0o011;
        Modes {
            file: 0o600 | read,
            dir: 0o700 | read | (read >> 2 & search),
        }
    }
}

/// Create `base/rel` and every missing directory in between, fsyncing the parent of each
/// directory created so the new names are durable. `base` must exist.
///
/// Concurrent creators may race; `AlreadyExists` is fine, and the parent is fsynced anyway so
/// neither racer returns before the directory is durable.
pub(super) fn create_dirs(base: &Path, rel: &Path, modes: Modes) -> StoreResult<()> {
    let mut dir = base.to_path_buf();
    for component in rel.components() {
        let parent = dir.clone();
        dir.push(component);
        match fs::symlink_metadata(&dir) {
            Ok(m) if m.is_dir() => continue,
            Ok(_) => {
                let e = io::Error::from_raw_os_error(libc::ENOTDIR);
                return Err(StoreError::io("create directory", &dir, e));
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(StoreError::io("stat", &dir, e)),
        }
        match fs::DirBuilder::new().mode(modes.dir).create(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && dir.is_dir() => {}
            Err(e) => return Err(StoreError::io("create directory", &dir, e)),
        }
        fsync_dir(&parent)?;
    }
    Ok(())
}

/// Write `data` to a fresh `.tmp-<random>` file in `dir` and fsync it. The name is created
/// with O_EXCL so two writers can never share a temp file. On error the file is removed.
pub(super) fn write_temp(dir: &Path, data: &[u8], modes: Modes) -> StoreResult<PathBuf> {
    let path = dir.join(format!(
        "{TEMP_PREFIX}{}",
        hex::encode(rand::random::<[u8; 8]>())
    ));
    let mut file = OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(modes.file)
        .open(&path)
        .map_err(|e| StoreError::io("create temporary file", &path, e))?;
    let written = file
        .write_all(data)
        .map_err(|e| StoreError::io("write", &path, e))
        .and_then(|()| {
            file.sync_all()
                .map_err(|e| StoreError::io("fsync", &path, e))
        });
    if let Err(e) = written {
        let _ = fs::remove_file(&path);
        return Err(e);
    }
    Ok(path)
}

/// Removes every `.tmp-*` file under `root` (objects and refs) last modified before `before`:
/// what writers killed between writing a temporary file and linking or renaming it left.
/// Returns how many were removed and their bytes. A directory a listing read recently enough
/// (`seen`) is not read again: that read saw every temporary old enough to remove.
pub(super) fn remove_temp_files(
    root: &Path,
    before: SystemTime,
    seen: &SeenDirs,
) -> StoreResult<(u64, u64)> {
    let mut removed = (0u64, 0u64);
    let mut dirs = vec![root.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        if let Some(read) = seen.usable(&dir, before) {
            dirs.extend(read.subdirs);
            let mut changed = false;
            for path in &read.temporaries {
                changed |= remove_if_stale(path, before, &mut removed)?;
            }
            if changed {
                fsync_dir(&dir)?;
            }
            continue;
        }
        let entries = match fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if is_absent(&e) => continue,
            Err(e) => return Err(StoreError::io("list directory", &dir, e)),
        };
        let mut changed = false;
        for entry in entries {
            let entry = entry.map_err(|e| StoreError::io("list directory", &dir, e))?;
            let path = entry.path();
            // The directory entry's type costs no call on most file systems; only temporary
            // files are stat'ed (a walk of a large repository stats nothing else).
            let Ok(file_type) = entry.file_type() else {
                continue; // gone meanwhile
            };
            if file_type.is_dir() {
                dirs.push(path);
                continue;
            }
            let is_temp = entry
                .file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(TEMP_PREFIX));
            if is_temp {
                changed |= remove_if_stale(&path, before, &mut removed)?;
            }
        }
        if changed {
            fsync_dir(&dir)?;
        }
    }
    Ok(removed)
}

/// Removes the temporary file `path` if it is a file last modified before `before`, counting
/// it in `removed`; whether it did.
fn remove_if_stale(path: &Path, before: SystemTime, removed: &mut (u64, u64)) -> StoreResult<bool> {
    let Ok(meta) = fs::symlink_metadata(path) else {
        return Ok(false); // gone meanwhile
    };
    if !meta.is_file() || !meta.modified().is_ok_and(|m| m < before) {
        return Ok(false);
    }
    match fs::remove_file(path) {
        Ok(()) => {
            removed.0 += 1;
            removed.1 += meta.len();
            Ok(true)
        }
        Err(e) if is_absent(&e) => Ok(false),
        Err(e) => Err(StoreError::io("remove", path, e)),
    }
}

/// An exclusive `flock` on a lock file, released when dropped (closing the descriptor
/// releases it). `flock` locks belong to the open file description, so two opens of the
/// same file — in one process or in several — exclude each other.
pub(super) struct FileLock {
    _file: File,
}

impl FileLock {
    /// Block until the exclusive lock on `path` (created if missing) is held.
    pub(super) fn exclusive(path: &Path, modes: Modes) -> StoreResult<Self> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(modes.file)
            .open(path)
            .map_err(|e| StoreError::io("open lock file", path, e))?;
        loop {
            // SAFETY: `file` owns a valid open descriptor for the whole call; flock only
            // reads the integer and has no memory-safety preconditions.
            let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX) };
            if rc == 0 {
                return Ok(FileLock { _file: file });
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(StoreError::io("lock", path, err));
            }
        }
    }
}

/// Every file under `base` whose path relative to `base` starts with `prefix`, sorted by key;
/// with its size when `sizes` (one stat a file), else size 0.
///
/// Only directories that can hold matching keys are read: the complete segments of `prefix`
/// are followed directly, the partial last segment filters the entries of that directory,
/// and only matching subdirectories are walked in full. Temp files and names in `skip_top`
/// (at the top level only) are ignored. What each directory read held of subdirectories and
/// temporary files goes to `seen`.
pub(super) fn list_files(
    base: &Path,
    prefix: &str,
    skip_top: &[&str],
    sizes: bool,
    seen: &SeenDirs,
) -> StoreResult<Vec<ObjectMeta>> {
    let (dir_part, partial) = match prefix.rfind('/') {
        Some(i) => (&prefix[..=i], &prefix[i + 1..]),
        None => ("", prefix),
    };
    if !dir_part.is_empty() && skip_top.contains(&dir_part.split('/').next().unwrap_or("")) {
        return Ok(Vec::new());
    }
    let start = base.join(dir_part);
    let skip = if dir_part.is_empty() { skip_top } else { &[] };
    let mut out = Vec::new();
    let listing = Listing { sizes, seen };
    walk(&start, dir_part, Some(partial), skip, &listing, &mut out)?;
    out.sort_unstable_by(|a, b| a.key.cmp(&b.key));
    Ok(out)
}

/// What a listing asks of each file, and where it records the directories it reads.
struct Listing<'a> {
    sizes: bool,
    seen: &'a SeenDirs,
}

/// Collect the files under `dir` (whose key prefix is `key_prefix`, empty or ending in '/').
/// `filter`, if given, keeps only entries whose name starts with it.
fn walk(
    dir: &Path,
    key_prefix: &str,
    filter: Option<&str>,
    skip: &[&str],
    listing: &Listing,
    out: &mut Vec<ObjectMeta>,
) -> StoreResult<()> {
    let mut read = SeenDir::begin();
    let mut complete = true;
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if is_absent(&e) => return Ok(()),
        Err(e) => return Err(StoreError::io("list directory", dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| StoreError::io("list directory", dir, e))?;
        let name = entry.file_name();
        // What the sweep for temporaries needs, whatever the listing keeps: every
        // subdirectory and every temporary file (the type comes with the entry on most
        // file systems: no call).
        let file_type = entry.file_type();
        match &file_type {
            Ok(t) if t.is_dir() => read.subdirs.push(entry.path()),
            Ok(t) if t.is_file() && name.as_bytes().starts_with(TEMP_PREFIX.as_bytes()) => {
                read.temporaries.push(entry.path())
            }
            Ok(_) => {}
            Err(_) => complete = false,
        }
        let Some(name) = name.to_str() else {
            tracing::debug!(dir = %dir.display(), ?name, "skipping non-UTF-8 name");
            continue;
        };
        if name.starts_with(TEMP_PREFIX)
            || skip.contains(&name)
            || filter.is_some_and(|f| !name.starts_with(f))
        {
            continue;
        }
        let path = entry.path();
        let file_type = file_type.map_err(|e| StoreError::io("stat", &path, e))?;
        let key = format!("{key_prefix}{name}");
        if file_type.is_dir() {
            walk(&path, &format!("{key}/"), None, &[], listing, out)?;
        } else if file_type.is_file() && !listing.sizes {
            out.push(ObjectMeta { key, size: 0 });
        } else if file_type.is_file() {
            let size = match entry.metadata() {
                Ok(m) => m.len(),
                // Deleted between readdir and stat: it is simply no longer listed.
                Err(e) if is_absent(&e) => continue,
                Err(e) => return Err(StoreError::io("stat", &path, e)),
            };
            out.push(ObjectMeta { key, size });
        } else {
            tracing::debug!(path = %path.display(), "skipping entry that is not a file");
        }
    }
    if complete {
        listing.seen.record(dir, read);
    }
    Ok(())
}

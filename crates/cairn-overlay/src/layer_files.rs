//! The files of one layer (`layer-<id>.data`, `layer-<id>.bitmap`), the directory lock, and
//! the clean-up of leftovers at open.

use std::collections::HashSet;
use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::time::{Duration, Instant};

use crate::bitmap::Bitmap;
use crate::fsutil::{self, atomic_write};
use crate::{Layer, OverlayError, LOCK_FILE, META_FILE};

pub(crate) fn data_name(id: u64) -> String {
    format!("layer-{id}.data")
}

pub(crate) fn bitmap_name(id: u64) -> String {
    format!("layer-{id}.bitmap")
}

/// The layer id of a `layer-<id>.data` / `layer-<id>.bitmap` file name.
fn parse_layer_file(name: &str) -> Option<u64> {
    let rest = name.strip_prefix("layer-")?;
    let id = rest
        .strip_suffix(".data")
        .or_else(|| rest.strip_suffix(".bitmap"))?;
    if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    id.parse().ok()
}

/// How long [`lock_dir`] keeps trying before it reports the directory as open elsewhere. A
/// lock can be held for a moment by no one: between `fork` and `exec`, a child process spawned
/// by any thread of this process holds a copy of every descriptor (close-on-exec closes them
/// only at `exec`), so an overlay dropped a moment ago can still look locked.
const LOCK_PATIENCE: Duration = Duration::from_millis(500);

/// Takes the directory's exclusive lock, held until the returned file is closed.
/// The directory must be this user's alone (see [`check_owned`]).
pub(crate) fn lock_dir(dir: &Path) -> Result<File, OverlayError> {
    check_owned(dir)?;
    let path = dir.join(LOCK_FILE);
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| OverlayError::io("open", &path, e))?;
    let deadline = Instant::now() + LOCK_PATIENCE;
    loop {
        // SAFETY: plain syscall on a valid, owned descriptor.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(f);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(OverlayError::io("lock", &path, e));
        }
        if Instant::now() >= deadline {
            return Err(OverlayError::Locked {
                path: dir.to_path_buf(),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Refuses an overlay directory that another user owns or could write into: its files hold
/// a guest's writes that `commit --from-export` stores, so whoever can write there could
/// make a commit of root's store their bytes. (Its own files are created 0600 in a 0700
/// directory: a guest's plaintext, even of an encrypted repository.)
pub(crate) fn check_owned(dir: &Path) -> Result<(), OverlayError> {
    let meta = fs::symlink_metadata(dir).map_err(|e| OverlayError::io("stat", dir, e))?;
    // SAFETY: geteuid has no preconditions and cannot fail.
    let me = unsafe { libc::geteuid() };
    let why = if !meta.is_dir() {
        Some("not a directory (a symbolic link is not followed)".to_string())
    } else if meta.uid() != me {
        Some(format!(
            "owned by uid {}, not by you (uid {me})",
            meta.uid()
        ))
    } else if meta.mode() & 0o022 != 0 {
        Some(format!(
            "writable by other users (mode {:o}); `chmod go-w` it",
            meta.mode() & 0o7777
        ))
    } else {
        None
    };
    match why {
        Some(why) => Err(OverlayError::Untrusted {
            path: dir.to_path_buf(),
            why,
        }),
        None => Ok(()),
    }
}

/// Creates (or truncates) layer `id`'s data file and writes its empty bitmap durably.
pub(crate) fn create_layer(dir: &Path, id: u64, nblocks: u64) -> Result<Layer, OverlayError> {
    let dpath = dir.join(data_name(id));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&dpath)
        .map_err(|e| OverlayError::io("create", &dpath, e))?;
    let bitmap = Bitmap::new(nblocks);
    // The rename's directory fsync also makes the data file's directory entry durable.
    atomic_write(dir, &bitmap_name(id), &bitmap.encode(id))?;
    Ok(Layer {
        id,
        parent: None,
        name: None,
        deleted: false,
        file,
        bitmap,
    })
}

/// Before creating a fresh overlay: errors if the directory holds layer data that only a
/// (now missing) manifest could explain.
pub(crate) fn check_no_lost_layers(dir: &Path, meta_path: &Path) -> Result<(), OverlayError> {
    let entries = fs::read_dir(dir).map_err(|e| OverlayError::io("list", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| OverlayError::io("list", dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let Some(id) = parse_layer_file(name) else {
            continue;
        };
        let empty_data =
            name == data_name(0) && entry.metadata().map(|m| m.len() == 0).unwrap_or(false);
        if id != 0 || (name != bitmap_name(0) && !empty_data) {
            return Err(OverlayError::corrupt(
                meta_path,
                format!("missing, but the directory holds layer data ({name})"),
            ));
        }
    }
    Ok(())
}

/// Whether `name` is one of the files an overlay directory may hold.
pub(crate) fn is_overlay_file(name: &str) -> bool {
    name == META_FILE || name == LOCK_FILE || parse_layer_file(name).is_some() || is_our_tmp(name)
}

/// Whether `name` is a temporary of [`atomic_write`] for one of our files.
fn is_our_tmp(name: &str) -> bool {
    name.strip_suffix(".tmp")
        .is_some_and(|n| n == META_FILE || parse_layer_file(n).is_some())
}

/// Removes temporaries and files of layers not in `keep`. Best effort.
pub(crate) fn gc(dir: &Path, keep: &HashSet<u64>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    let mut removed = false;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        let stale =
            is_our_tmp(name) || parse_layer_file(name).is_some_and(|id| !keep.contains(&id));
        if stale {
            let p = entry.path();
            match fs::remove_file(&p) {
                Ok(()) => {
                    removed = true;
                    tracing::debug!(path = %p.display(), "removed leftover overlay file");
                }
                Err(e) => {
                    tracing::warn!(path = %p.display(), error = %e, "cannot remove leftover overlay file")
                }
            }
        }
    }
    if removed {
        let _ = fsutil::sync_dir(dir);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layer_file_names() {
        assert_eq!(parse_layer_file("layer-12.data"), Some(12));
        assert_eq!(parse_layer_file("layer-0.bitmap"), Some(0));
        assert_eq!(parse_layer_file("layer-.data"), None);
        assert_eq!(parse_layer_file("layer-1.bitmap.tmp"), None);
        assert_eq!(parse_layer_file("layer-+1.data"), None);
        assert_eq!(parse_layer_file("meta.json"), None);
        assert!(is_our_tmp("meta.json.tmp"));
        assert!(is_our_tmp("layer-3.bitmap.tmp"));
        assert!(!is_our_tmp("notes.tmp"));
    }
}

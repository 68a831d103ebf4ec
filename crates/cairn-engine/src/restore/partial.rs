//! The temporary file a restore writes before it links the finished image into place, and a
//! host-local registry of them, so that one left by a killed restore can be found and removed.
//!
//! A restore to `DIR/NAME` writes `DIR/.NAME.cairn-partial-PID-RANDOM` (created new, 0600, never
//! through a symbolic link), next to its target (the final
//! link or rename must not cross file systems). Before creating it, it records the path in
//! `~/.cache/cairn/partials/PID-START` (`$XDG_CACHE_HOME`), where START is the process's
//! start time: an entry whose process no longer runs (or whose pid now belongs to another
//! process) names a stale partial file. [`remove_stale`] deletes those — run by every restore
//! and by `cairn gc`. A partial file never holds a plausible image (it is only renamed into
//! place complete and synced), so deleting a stale one loses nothing.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use cairn_repo::session::{current_process, process_alive};

/// The registry directory of this user.
fn registry_dir() -> PathBuf {
    cairn_repo::user_cache_dir().join("partials")
}

/// A partial output file being written by this process; removed (with its registry entry)
/// when dropped unless [`Partial::keep`] was called after it was linked into place.
#[derive(Debug)]
pub struct Partial {
    pub path: PathBuf,
    entry: Option<PathBuf>,
    done: bool,
}

impl Partial {
    /// Creates (truncating) the partial file for `target` and registers it.
    pub fn create(target: &Path) -> io::Result<(Partial, File)> {
        let dir = target
            .parent()
            .filter(|d| !d.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        let name = target
            .file_name()
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no file name"))?;
        let pid = std::process::id();
        // A name nobody can guess, created new and never through a symbolic link: in a
        // directory another user can write, a planted link must not make root overwrite the
        // file it points at.
        let path = dir.join(format!(
            ".{}.cairn-partial-{pid}-{:016x}",
            name.to_string_lossy(),
            rand::random::<u64>()
        ));
        let entry = current_process().and_then(|me| {
            let dir = registry_dir();
            fs::create_dir_all(&dir).ok()?;
            let entry = dir.join(format!("{pid}-{}", me.start_ticks));
            // An absolute path, so the cleanup does not depend on the working directory.
            let abs = std::path::absolute(&path).ok()?;
            fs::write(&entry, abs.as_os_str().as_encoded_bytes()).ok()?;
            Some(entry)
        });
        let file = OpenOptions::new()
            .write(true)
            .read(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .mode(0o600)
            .open(&path);
        let partial = Partial {
            path,
            entry,
            done: false,
        };
        let file = file?; // on error, dropping `partial` removes the entry
        Ok((partial, file))
    }

    /// The partial file is now the target (linked or renamed into place): forget it.
    pub fn keep(mut self) {
        self.done = true;
    }
}

impl Drop for Partial {
    fn drop(&mut self) {
        if !self.done {
            let _ = fs::remove_file(&self.path);
        }
        if let Some(entry) = &self.entry {
            let _ = fs::remove_file(entry);
        }
    }
}

/// Deletes the partial files of restores whose process is gone; returns them with their sizes.
pub fn remove_stale() -> Vec<(PathBuf, u64)> {
    let mut removed = Vec::new();
    let Ok(entries) = fs::read_dir(registry_dir()) else {
        return removed;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((pid, start)) = name
            .to_str()
            .and_then(|n| n.split_once('-'))
            .and_then(|(p, s)| Some((p.parse::<u32>().ok()?, s.parse::<u64>().ok()?)))
        else {
            continue;
        };
        if process_alive(pid, start) {
            continue;
        }
        if let Ok(raw) = fs::read(entry.path()) {
            let partial = PathBuf::from(String::from_utf8_lossy(&raw).into_owned());
            // Only ever delete what this scheme names: `.NAME.cairn-partial-PID-RANDOM`.
            let ours = partial
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| {
                    n.starts_with('.')
                        && n.rsplit_once('-').is_some_and(|(head, random)| {
                            head.ends_with(&format!(".cairn-partial-{pid}"))
                                && random.len() == 16
                                && random.bytes().all(|b| b.is_ascii_hexdigit())
                        })
                });
            if ours {
                if let Ok(m) = fs::symlink_metadata(&partial) {
                    if m.is_file() && fs::remove_file(&partial).is_ok() {
                        removed.push((partial, m.len()));
                    }
                }
            }
        }
        let _ = fs::remove_file(entry.path());
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_partial_file_has_a_name_nobody_can_guess_and_is_private() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("disk.raw");
        let (a, _) = Partial::create(&target).unwrap();
        let (b, _) = Partial::create(&target).unwrap();
        assert_ne!(a.path, b.path);
        let mode = fs::metadata(&a.path).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o600);
    }
}

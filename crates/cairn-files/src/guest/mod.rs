//! Files inside a version's guest file system, read without a mount: `cairn ls|cat
//! IMAGE@V:/path`. Only the blocks the request touches are fetched, through the same lazy
//! reader as exports.
//!
//! The file system is read by `ext4-view` (ext2/3/4, read-only, no unsafe code, fuzzed by
//! its authors). No maintained Rust crate reads xfs or NTFS; for those, `cairn mount` and a
//! read-only loop mount read any file system the kernel knows.
//!
//! Everything here blocks: call it from `spawn_blocking`.

pub mod disk;
pub mod volumes;

use ext4_view::{Ext4, Ext4Error, Metadata};

use crate::error::{FilesError, FilesResult};
use disk::DiskReader;
use volumes::Volume;

/// `IMAGE@V:/path` split at the first `:/`.
pub fn split_guest_path(spec: &str) -> Option<(&str, &str)> {
    let at = spec.find(":/")?;
    Some((&spec[..at], &spec[at + 1..]))
}

/// A guest file system opened for reading.
pub struct GuestFs {
    fs: Ext4,
    volume: Volume,
}

/// One file's description, as `ls -l` gives it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuestEntry {
    pub name: String,
    /// `file`, `dir`, `symlink`, `block`, `char`, `fifo` or `socket`.
    pub kind: &'static str,
    pub size: u64,
    /// Permission bits (`0o7777`).
    pub mode: u16,
    pub uid: u32,
    pub gid: u32,
    /// Seconds since the epoch.
    pub mtime: i64,
    /// Where a symlink points.
    pub target: Option<String>,
}

impl GuestEntry {
    /// `ls -l`'s type-and-mode column, e.g. `drwxr-xr-x`.
    pub fn mode_string(&self) -> String {
        let t = match self.kind {
            "dir" => 'd',
            "symlink" => 'l',
            "block" => 'b',
            "char" => 'c',
            "fifo" => 'p',
            "socket" => 's',
            _ => '-',
        };
        let mut s = String::from(t);
        for shift in [6, 3, 0] {
            let bits = (self.mode >> shift) & 7;
            s.push(if bits & 4 != 0 { 'r' } else { '-' });
            s.push(if bits & 2 != 0 { 'w' } else { '-' });
            s.push(if bits & 1 != 0 { 'x' } else { '-' });
        }
        s
    }
}

fn kind_name(m: &Metadata) -> &'static str {
    let t = m.file_type();
    if t.is_dir() {
        "dir"
    } else if t.is_symlink() {
        "symlink"
    } else if t.is_block_dev() {
        "block"
    } else if t.is_char_dev() {
        "char"
    } else if t.is_fifo() {
        "fifo"
    } else if t.is_socket() {
        "socket"
    } else {
        "file"
    }
}

impl GuestFs {
    /// Finds and opens the ext file system of `disk` (partition `partition`, or the only one).
    pub fn open(disk: &DiskReader, partition: Option<u32>) -> FilesResult<GuestFs> {
        let found = volumes::volumes(disk)?;
        let volume = volumes::choose(&found, partition)?;
        let reader = disk.window(volume.start, volume.len);
        let fs = Ext4::load(Box::new(reader)).map_err(|e| {
            FilesError::NoFileSystem(format!("{volume} cannot be read as ext2/3/4: {e}"))
        })?;
        Ok(GuestFs { fs, volume })
    }

    /// Where the file system lies in the image.
    pub fn volume(&self) -> &Volume {
        &self.volume
    }

    fn guest_err(path: &str, e: Ext4Error) -> FilesError {
        let reason = match e {
            Ext4Error::NotFound => {
                return FilesError::GuestMissing {
                    path: path.to_string(),
                }
            }
            Ext4Error::IsADirectory => "is a directory".to_string(),
            Ext4Error::NotADirectory => "a component of the path is not a directory".to_string(),
            Ext4Error::NotAbsolute => "the path must start with /".to_string(),
            e => e.to_string(),
        };
        FilesError::Guest {
            path: path.to_string(),
            reason,
        }
    }

    fn entry(&self, name: String, path: &str, m: &Metadata) -> GuestEntry {
        let target = m
            .is_symlink()
            .then(|| self.fs.read_link(path).ok())
            .flatten()
            .map(|t| t.display().to_string());
        GuestEntry {
            name,
            kind: kind_name(m),
            size: m.len(),
            mode: m.mode(),
            uid: m.uid(),
            gid: m.gid(),
            mtime: m.modified().seconds(),
            target,
        }
    }

    /// A directory's entries by name (without `.` and `..`), or the one entry of anything
    /// else. A symlink is listed as itself, not followed, unless it is the directory asked.
    pub fn list(&self, path: &str) -> FilesResult<Vec<GuestEntry>> {
        let err = |e| Self::guest_err(path, e);
        let meta = self.fs.symlink_metadata(path).map_err(err)?;
        let followed_dir = meta.is_symlink() && self.fs.metadata(path).is_ok_and(|m| m.is_dir());
        if !meta.is_dir() && !followed_dir {
            let name = path.rsplit('/').next().unwrap_or(path).to_string();
            return Ok(vec![self.entry(name, path, &meta)]);
        }
        let mut out = Vec::new();
        for d in self.fs.read_dir(path).map_err(err)? {
            let d = d.map_err(err)?;
            let name = d.file_name().display().to_string();
            if name == "." || name == ".." {
                continue;
            }
            let child = d.path();
            let child = child.display().to_string();
            let m = d.metadata().map_err(|e| Self::guest_err(&child, e))?;
            out.push(self.entry(name, &child, &m));
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// A regular file for reading (symlinks followed), and its size.
    pub fn open_file(&self, path: &str) -> FilesResult<(ext4_view::File, u64)> {
        let err = |e| Self::guest_err(path, e);
        let meta = self.fs.metadata(path).map_err(err)?;
        if meta.is_dir() {
            return Err(err(Ext4Error::IsADirectory));
        }
        if !meta.file_type().is_regular_file() {
            return Err(FilesError::Guest {
                path: path.to_string(),
                reason: format!("is a {}, not a regular file", kind_name(&meta)),
            });
        }
        Ok((self.fs.open(path).map_err(err)?, meta.len()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guest_path_splits_at_the_first_colon_slash() {
        assert_eq!(
            split_guest_path("vm@3:/etc/hosts"),
            Some(("vm@3", "/etc/hosts"))
        );
        assert_eq!(split_guest_path("vm:/"), Some(("vm", "/")));
        assert_eq!(split_guest_path("vm@3:/a:/b"), Some(("vm@3", "/a:/b")));
        assert_eq!(split_guest_path("vm@3"), None);
        assert_eq!(split_guest_path("vm@3:etc"), None);
    }

    #[test]
    fn the_mode_column_reads_as_ls_prints_it() {
        let e = GuestEntry {
            name: "x".into(),
            kind: "dir",
            size: 0,
            mode: 0o755,
            uid: 0,
            gid: 0,
            mtime: 0,
            target: None,
        };
        assert_eq!(e.mode_string(), "drwxr-xr-x");
        let f = GuestEntry {
            kind: "file",
            mode: 0o640,
            ..e
        };
        assert_eq!(f.mode_string(), "-rw-r-----");
    }
}

//! Mounting the versions: the checks a mount point must pass, the FUSE mount itself, and the
//! unmount that never pulls a file out from under a reader unless asked twice.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use fuser::{BackgroundSession, Config, MountOption, SessionACL};
use tokio::runtime::Handle;

use crate::error::{FilesError, FilesResult};
use crate::fuse_fs::{Shared, VersionFs};

/// A live mount, served on fuser's thread until it is unmounted.
pub struct Mounted {
    path: PathBuf,
    shared: Arc<Shared>,
    session: BackgroundSession,
}

/// Checks that `path` can take a mount and returns it made absolute: an existing, empty
/// directory that is not a mount point already. Each refusal is one line saying what to do.
pub fn check_mount_point(path: &Path) -> FilesResult<PathBuf> {
    let refuse = |reason: &str| FilesError::MountPoint {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    };
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(refuse("does not exist (create the directory first)"))
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => {
            return Err(refuse(
                "is a FUSE mount whose server is gone (a killed `cairn mount`?): run `umount` on it first",
            ))
        }
        Err(e) => return Err(refuse(&format!("cannot be read: {e}"))),
    };
    if !meta.is_dir() {
        return Err(refuse("is not a directory"));
    }
    let path = path
        .canonicalize()
        .map_err(|e| refuse(&format!("cannot be resolved: {e}")))?;
    if is_mount_point(&path)? {
        return Err(refuse(
            "is already a mount point: unmount it first or choose another directory",
        ));
    }
    let mut entries =
        std::fs::read_dir(&path).map_err(|e| refuse(&format!("cannot be listed: {e}")))?;
    if entries.next().is_some() {
        return Err(refuse("is not empty: a mount would hide its files"));
    }
    Ok(path)
}

/// Whether `path` (absolute, resolved) is where something is mounted, by the kernel's table.
fn is_mount_point(path: &Path) -> FilesResult<bool> {
    let table =
        std::fs::read_to_string("/proc/self/mountinfo").map_err(|e| FilesError::MountPoint {
            path: path.to_path_buf(),
            reason: format!("cannot read /proc/self/mountinfo: {e}"),
        })?;
    Ok(table
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|p| Path::new(&unescape_mountinfo(p)) == path))
}

/// Undoes the kernel's octal escapes of space, tab, newline and backslash in mountinfo.
fn unescape_mountinfo(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)));
        match (b[i], octal) {
            (b'\\', Some(d)) => {
                out.push((d[0] - b'0') * 64 + (d[1] - b'0') * 8 + (d[2] - b'0'));
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Mounts the versions read-only on `path` (checked with [`check_mount_point`]); FUSE requests
/// are answered on `rt`. `allow_other` lets other users read (FUSE's `allow_other`).
pub fn mount(
    shared: Arc<Shared>,
    rt: Handle,
    path: &Path,
    allow_other: bool,
) -> FilesResult<Mounted> {
    let path = check_mount_point(path)?;
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::RO,
        MountOption::FSName("cairn".into()),
        MountOption::Subtype("cairn".into()),
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::DefaultPermissions,
    ];
    if allow_other {
        config.acl = SessionACL::All;
    }
    let fs = VersionFs::new(shared.clone(), rt);
    let session = fuser::spawn_mount(fs, &path, &config).map_err(|source| FilesError::Mount {
        path: path.clone(),
        source,
    })?;
    Ok(Mounted {
        path,
        shared,
        session,
    })
}

impl Mounted {
    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Blocks until the FUSE session ends: after [`unmount`], or an `umount` from outside.
    pub fn wait(self) -> io::Result<()> {
        self.session.join()
    }
}

/// Why an unmount did not happen.
#[derive(Debug)]
pub enum UnmountError {
    /// Files are open or a process works inside it; nothing was changed.
    Busy,
    Other(io::Error),
}

/// Unmounts `path`. Without `lazy` a busy mount is left as it is ([`UnmountError::Busy`]);
/// with it the mount leaves the name space at once and its server keeps answering the files
/// still open until they close (the kernel's lazy unmount). Without root it asks
/// `fusermount3 -u`, as libfuse does.
pub fn unmount(path: &Path, lazy: bool) -> Result<(), UnmountError> {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|e| UnmountError::Other(io::Error::other(e)))?;
    let flags = if lazy { libc::MNT_DETACH } else { 0 };
    // SAFETY: `c` is a NUL-terminated path that outlives the call.
    if unsafe { libc::umount2(c.as_ptr(), flags) } == 0 {
        return Ok(());
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EBUSY) => Err(UnmountError::Busy),
        Some(libc::EPERM) => {
            let out = Command::new("fusermount3")
                .arg(if lazy { "-uz" } else { "-u" })
                .arg(path)
                .output()
                .map_err(|e| UnmountError::Other(io::Error::other(format!("fusermount3: {e}"))))?;
            if out.status.success() {
                Ok(())
            } else if String::from_utf8_lossy(&out.stderr).contains("busy") {
                Err(UnmountError::Busy)
            } else {
                Err(UnmountError::Other(io::Error::other(
                    String::from_utf8_lossy(&out.stderr).trim().to_string(),
                )))
            }
        }
        _ => Err(UnmountError::Other(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mountinfo(r"/mnt/a\040b\134c"), r"/mnt/a b\c");
        assert_eq!(unescape_mountinfo(r"/plain\x"), r"/plain\x");
        assert_eq!(unescape_mountinfo("/"), "/");
    }

    #[test]
    fn a_mount_point_must_exist_be_an_empty_directory_and_not_be_mounted() {
        let dir = tempfile::tempdir().unwrap();
        let err = |p: &Path| check_mount_point(p).unwrap_err().to_string();
        let missing = dir.path().join("nope");
        assert_eq!(
            err(&missing),
            format!(
                "mount point {}: does not exist (create the directory first)",
                missing.display()
            )
        );
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(
            err(&file).ends_with(": is not a directory"),
            "{}",
            err(&file)
        );
        assert!(err(dir.path()).ends_with(": is not empty: a mount would hide its files"));
        let empty = dir.path().join("empty");
        std::fs::create_dir(&empty).unwrap();
        assert_eq!(
            check_mount_point(&empty).unwrap(),
            empty.canonicalize().unwrap()
        );
        assert!(err(Path::new("/proc")).contains("is already a mount point"));
    }
}

//! What a restore may write to, decided before any byte is written: a restore never
//! replaces something by surprise.
//!
//! - a path that does not exist: created (under a temporary name, then linked into place
//!   with no-replace semantics, so a file that appears meanwhile is not clobbered either);
//! - an existing regular file: replaced only with `force`, and never while another process
//!   holds a lock on it (QEMU locks the images a VM uses);
//! - a block device: written only with `force`, opened `O_EXCL`, so a device that is
//!   mounted or held by another exclusive opener (a VM, LVM, a RAID) is refused;
//! - character devices, FIFOs, sockets, directories: refused (standard output is `-`).
//!
//! Symbolic links are followed (`/dev/vg0/web01` is a link to `/dev/dm-3`).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::{EngineError, EngineResult};

/// What a restore path turned out to be.
#[derive(Debug)]
pub enum OutputKind {
    /// Nothing there yet: create `path`.
    New(PathBuf),
    /// A regular file the caller allowed to be replaced (the resolved path).
    Replace(PathBuf),
    /// A block device, opened for writing with `O_EXCL`.
    Device { path: PathBuf, file: File },
}

pub(crate) fn refuse(path: &Path, why: impl Into<String>) -> EngineError {
    EngineError::Output {
        op: "will not restore to",
        path: path.to_path_buf(),
        source: io::Error::new(io::ErrorKind::InvalidInput, why.into()),
    }
}

/// Decides what restoring to `path` means, refusing anything that would clobber by surprise.
pub fn check_output(path: &Path, force: bool, qcow2: bool) -> EngineResult<OutputKind> {
    let meta = match std::fs::metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if std::fs::symlink_metadata(path).is_ok() {
                return Err(refuse(path, "it is a dangling symbolic link"));
            }
            return Ok(OutputKind::New(path.to_path_buf()));
        }
        Err(e) => {
            return Err(EngineError::Output {
                op: "cannot inspect",
                path: path.to_path_buf(),
                source: e,
            })
        }
    };
    let real = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let ft = meta.file_type();
    if ft.is_file() {
        if !force {
            return Err(refuse(
                path,
                "it exists; pass --force to replace it (the new image is written aside and \
                 renamed over it only when complete)",
            ));
        }
        if let Some(holder) = crate::file_lock::lock_holder(&real) {
            return Err(refuse(
                path,
                format!("it is in use: {holder}; stop it first"),
            ));
        }
        return Ok(OutputKind::Replace(real));
    }
    if ft.is_block_device() {
        if qcow2 {
            return Err(refuse(
                path,
                "a block device takes raw output, not --format qcow2",
            ));
        }
        if !force {
            return Err(refuse(
                path,
                "it is a block device and every byte of it would be overwritten; pass --force",
            ));
        }
        let file = open_device_exclusive(path, &real, false)?;
        return Ok(OutputKind::Device { path: real, file });
    }
    let what = if ft.is_dir() {
        "it is a directory"
    } else if ft.is_char_device() {
        "it is a character device"
    } else if ft.is_fifo() {
        "it is a FIFO"
    } else if ft.is_socket() {
        "it is a socket"
    } else {
        "it is not a regular file or block device"
    };
    Err(refuse(
        path,
        format!("{what}; restore writes files and block devices (`-` writes to standard output)"),
    ))
}

/// Opens the block device `real` (named `path` by the user) for writing, and for reading too
/// with `read`, with `O_EXCL`: the kernel refuses it while the device is mounted or held
/// exclusively by another opener (a VM, LVM, a RAID).
pub(crate) fn open_device_exclusive(path: &Path, real: &Path, read: bool) -> EngineResult<File> {
    OpenOptions::new()
        .read(read)
        .write(true)
        .custom_flags(libc::O_EXCL)
        .open(real)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::EBUSY) => refuse(
                path,
                "the device is in use (mounted, or held open exclusively by another process)",
            ),
            _ => EngineError::Output {
                op: "cannot open",
                path: path.to_path_buf(),
                source: e,
            },
        })
}

/// The loop device that has the regular file `real` (a canonical path) as its backing
/// file, if any (`/sys/block/loopN/loop/backing_file`): a file system may be mounted from
/// it, so writing the file under it would corrupt that file system.
pub(crate) fn loop_device_backed_by(real: &Path) -> Option<String> {
    let entries = std::fs::read_dir("/sys/block").ok()?;
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if !name.starts_with("loop") {
            continue;
        }
        let Ok(backing) = std::fs::read_to_string(entry.path().join("loop/backing_file")) else {
            continue;
        };
        if Path::new(backing.trim_end_matches('\n')) == real {
            return Some(format!("/dev/{name}"));
        }
    }
    None
}

/// Gives the file at `new` (a restore's finished partial file, about to be renamed over
/// `old`) the owner, group, mode and extended attributes of `old`, so that `restore --force`
/// keeps what the hypervisor set up (libvirt's `qemu:qemu 0600` disk and its SELinux label
/// must not become `root 0644`). An owner that cannot be set (not root) is left as it is;
/// an attribute the file system refuses fails the restore, which leaves `old` untouched.
pub(crate) fn carry_identity(old: &Path, new: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let meta = std::fs::metadata(old)?;
    let file = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(new)?;
    if let Err(e) = std::os::unix::fs::fchown(&file, Some(meta.uid()), Some(meta.gid())) {
        if e.raw_os_error() != Some(libc::EPERM) {
            return Err(e);
        }
    }
    file.set_permissions(std::fs::Permissions::from_mode(meta.mode() & 0o7777))?;
    for name in xattr::list(old)? {
        if let Some(value) = xattr::get(old, &name)? {
            xattr::FileExt::set_xattr(&file, &name, &value)?;
        }
    }
    file.sync_all()
}

/// Sets the modification time of the file at `path` (not followed if a link) to `time_ns`
/// (ns since the epoch; before it, the epoch).
pub(crate) fn stamp_time(path: &Path, time_ns: i64) -> std::io::Result<()> {
    let file = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NOFOLLOW)
        .open(path)?;
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_nanos(time_ns.max(0) as u64);
    file.set_modified(at)
}

//! Errors of the file views. Callers match the kind: a refused mount point is the user's to
//! fix; the rest come from the repository or the guest's file system.

use std::path::PathBuf;

use cairn_engine::EngineError;
use cairn_export::ExportError;
use cairn_repo::RepoError;

#[derive(Debug, thiserror::Error)]
pub enum FilesError {
    /// The mount point cannot take a mount; `reason` says why in words a user can act on.
    #[error("mount point {}: {reason}", path.display())]
    MountPoint { path: PathBuf, reason: String },
    /// The kernel refused the FUSE mount.
    #[error("cannot mount on {}: {source}", path.display())]
    Mount {
        path: PathBuf,
        source: std::io::Error,
    },
    /// No guest file system cairn can read was found where it looked.
    #[error("{0}")]
    NoFileSystem(String),
    /// No such file or directory in the guest file system.
    #[error("{path}: no such file or directory in the guest")]
    GuestMissing { path: String },
    /// The guest file system refused the request (a missing path, a file that is a directory,
    /// damaged metadata).
    #[error("{path}: {reason}")]
    Guest { path: String, reason: String },
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Export(#[from] ExportError),
    #[error(transparent)]
    Repo(#[from] RepoError),
}

pub type FilesResult<T> = Result<T, FilesError>;

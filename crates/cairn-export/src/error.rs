//! Errors of an export.
//!
//! Inside the export every failure keeps its type ([`ExportError`]); at the NBD boundary it
//! becomes an `io::Error` (the client only ever sees EIO) that still carries the typed error
//! as its source, so logs and control replies print the whole chain and
//! [`ExportError::is_damage`] can be asked of it again ([`ExportError::damage_in`]).

use std::io;

use cairn_engine::EngineError;
use cairn_overlay::OverlayError;
use cairn_repo::tree_walk::NodeError;
use cairn_repo::RepoError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ExportError {
    /// Reading the stored version failed (damage, a missing pack, the store).
    #[error(transparent)]
    Repo(#[from] RepoError),
    /// The local overlay failed.
    #[error("overlay: {0}")]
    Overlay(#[from] OverlayError),
    /// COMMIT failed.
    #[error("commit: {0}")]
    Commit(#[from] EngineError),
    /// A chunk's or group run's size disagrees with the leaf that names it.
    #[error("{piece} holds {got} bytes where the manifest says {want}")]
    PieceSize {
        piece: String,
        got: usize,
        want: u32,
    },
    #[error("the export is read-only (start it with --writable)")]
    ReadOnly,
    #[error("the export is stopping")]
    Stopping,
    /// COMMIT into an image whose newest version is not the export's base, without force.
    #[error("{0}")]
    BaseNotNewest(String),
    /// A fetch task failed (a panic or a cancellation: a bug, not the repository).
    #[error("internal error: {0}")]
    Task(#[from] tokio::task::JoinError),
}

pub type ExportResult<T> = Result<T, ExportError>;

impl From<NodeError> for ExportError {
    fn from(e: NodeError) -> Self {
        ExportError::Repo(RepoError::Node(e))
    }
}

impl From<ExportError> for io::Error {
    /// Keeps `e` as the source; a read-only export refuses writes with EPERM.
    fn from(e: ExportError) -> io::Error {
        match e {
            ExportError::ReadOnly => io::Error::new(io::ErrorKind::PermissionDenied, e),
            e => io::Error::other(e),
        }
    }
}

impl ExportError {
    /// Whether stored data is damaged or missing.
    pub fn is_damage(&self) -> bool {
        match self {
            ExportError::Repo(e) => e.is_damage(),
            ExportError::Commit(e) => e.is_damage(),
            ExportError::PieceSize { .. } => true,
            _ => false,
        }
    }

    /// Whether the `io::Error` an export returned carries damage of stored data.
    pub fn damage_in(e: &io::Error) -> bool {
        e.get_ref()
            .and_then(|inner| inner.downcast_ref::<ExportError>())
            .is_some_and(ExportError::is_damage)
    }
}

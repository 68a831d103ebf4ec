//! Errors of the engine. Policy: one line naming what failed and where; library errors keep
//! their source so the CLI can print the whole chain on that one line.

use std::io;
use std::path::PathBuf;

use cairn_format::FormatError;
use cairn_repo::RepoError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum EngineError {
    #[error("{0}")]
    Repo(#[from] RepoError),
    #[error("{op} {}: {source}", path.display())]
    Source {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("{op} {}: {source}", path.display())]
    Output {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("invalid {0}")]
    Name(#[from] FormatError),
    #[error("{0}")]
    BadRef(String),
    /// A changed block of a patch could not be read (see `patch::PatchSource`).
    #[error("reading changed block {index} of the patch: {source}")]
    PatchRead {
        index: u64,
        #[source]
        source: io::Error,
    },
    #[error("commit pipeline: {0}")]
    Pipeline(String),
    /// GC declined to act (it never acts on a partial view); the text says why and what to do.
    #[error("gc: {0}")]
    Gc(String),
    /// A SIGINT or SIGTERM asked the work to stop (see [`crate::interrupt`]).
    #[error("interrupted by {signal}")]
    Interrupted { signal: &'static str },
    /// A disk image source could not be opened or read.
    #[error("{0}")]
    Image(#[from] cairn_image::ImageError),
}

impl From<cairn_store::StoreError> for EngineError {
    fn from(e: cairn_store::StoreError) -> Self {
        EngineError::Repo(RepoError::Store(e))
    }
}

pub type EngineResult<T> = Result<T, EngineError>;

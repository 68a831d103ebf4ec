//! Errors of the engine.
//!
//! Policy:
//! - Every variant says what it means, not where it arose: damage of stored data
//!   ([`EngineError::Manifest`], or a [`RepoError`] whose `is_damage()` holds), input the
//!   caller gave that is not acceptable ([`EngineError::BadInput`], [`EngineError::Name`]),
//!   a named thing that does not exist or already does, a protected version
//!   ([`EngineError::Tagged`]), a format only read ([`EngineError::ReadOnlyFormat`]), a source
//!   or output file that failed, a refusal of GC, an interruption, a bug
//!   ([`EngineError::Internal`]). Callers branch on the variant, never on the text.
//! - Each message is one line naming what failed and where (an id, a path, a segment);
//!   errors of lower layers are kept as the source, so the CLI prints the whole chain on that
//!   one line and can classify it ([`EngineError::is_damage`] → exit status 3).
//! - Nothing here is logged: the caller decides whether an error is fatal, tolerated
//!   (`--allow-damage`) or retried.

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
    /// A name the caller gave is not valid (an image or tag name): a usage error.
    #[error("invalid {0}")]
    Name(#[from] FormatError),
    /// What the caller named does not exist: an image, a version, a tag.
    #[error("{0}")]
    NotFound(String),
    /// What the caller would create exists already (an image to clone into).
    #[error("{0}")]
    Exists(String),
    /// A changed block of a patch could not be read (see `patch::PatchSource`).
    #[error("reading changed block {index} of the patch: {source}")]
    PatchRead {
        index: u64,
        #[source]
        source: io::Error,
    },
    /// A manifest tree is damaged beyond its nodes' own bytes (those are
    /// `RepoError::Node`): a leaf that covers the wrong number of bytes, a chunk whose size
    /// disagrees with its leaf, a tree whose shape disagrees with its version record.
    #[error("damaged manifest: {0}")]
    Manifest(String),
    /// The source changed size while it was read: its data is not one point in time.
    #[error(
        "{what} changed size while it was read ({was} -> {now} bytes); nothing was \
         published: commit a stopped VM's disk, or a snapshot of it"
    )]
    SourceResized { what: String, was: u64, now: u64 },
    /// The input of a command is not acceptable (a malformed reference, an ambiguous id
    /// prefix, a patch that would shrink its image, an empty retention policy): a usage error.
    #[error("{0}")]
    BadInput(String),
    /// A GC that judged this commit dead removed blobs it reuses; nothing was published.
    #[error(
        "a garbage collection that treated this commit as dead removed {missing} blobs it \
         reuses; nothing was published, run the commit again"
    )]
    RacedGc { missing: usize },
    /// A worker thread or task of the command failed or stopped early: a bug or a panic,
    /// never a property of the repository.
    #[error("internal error: {what}: {detail}")]
    Internal { what: &'static str, detail: String },
    /// GC declined to act (it never acts on a partial view); the text says why and what to do.
    #[error("gc: {0}")]
    Gc(String),
    /// A SIGINT or SIGTERM asked the work to stop (see [`crate::interrupt`]).
    #[error("interrupted by {signal}")]
    Interrupted { signal: &'static str },
    /// A disk image source could not be opened or read.
    #[error("{0}")]
    Image(#[from] cairn_image::ImageError),
    /// `IMAGE` without a version names its newest, and that cannot be read: an older one is
    /// never used in its place unless named.
    #[error(
        "the newest version of {image} is unreadable ({reason}); name a version (`{image}@N`, \
         see `cairn log {image}`) to use an older one, or run `cairn repair`"
    )]
    NewestUnreadable { image: String, reason: String },
    /// A version to remove is tagged: tags protect versions until they are deleted.
    #[error(
        "{version} is tagged as {tag}; delete the tag first (`cairn tag --delete {image} {tag}`)"
    )]
    Tagged {
        image: String,
        version: String,
        tag: String,
    },
    /// A tag names the VM version.
    #[error(
        "{version} is tagged as {tag}; delete the tag first (`cairn vm tag --delete {vm} {tag}`)"
    )]
    VmTagged {
        version: String,
        vm: String,
        tag: String,
    },
    /// The version is a disk of a live VM version: it goes with that VM version.
    #[error(
        "{version} is a disk of VM version {vm_version}; remove the VM version instead \
         (`cairn vm rm {vm_version}`)"
    )]
    BoundToVm { version: String, vm_version: String },
    /// An operation that writes, on a repository format this cairn only reads (format 1).
    #[error(
        "{operation}: {location} is a format 1 repository, which this cairn only reads; copy \
         it into a format 2 repository (`cairn copy --from`) to write to it"
    )]
    ReadOnlyFormat {
        operation: &'static str,
        location: String,
    },
}

impl From<cairn_repo::tree_walk::NodeError> for EngineError {
    fn from(e: cairn_repo::tree_walk::NodeError) -> Self {
        EngineError::Repo(RepoError::Node(e))
    }
}

impl EngineError {
    /// Refuses `operation` on a repository cairn only reads: every engine entry point that
    /// writes packs, index runs or summaries calls it first, so no caller can write format 1.
    pub(crate) fn ensure_writable(
        repo: &cairn_repo::Repo,
        operation: &'static str,
    ) -> EngineResult<()> {
        match repo.v2() {
            Some(_) => Ok(()),
            None => Err(EngineError::ReadOnlyFormat {
                operation,
                location: repo.describe(),
            }),
        }
    }

    /// A worker (`what`) that failed, from its join or channel error.
    pub(crate) fn internal(what: &'static str, detail: impl std::fmt::Display) -> Self {
        EngineError::Internal {
            what,
            detail: detail.to_string(),
        }
    }

    /// Whether the error means stored data is damaged or missing (exit status 3 in the CLI),
    /// as opposed to a failure of the store, the input or the program.
    pub fn is_damage(&self) -> bool {
        match self {
            EngineError::Repo(r) => r.is_damage(),
            EngineError::Manifest(_) | EngineError::NewestUnreadable { .. } => true,
            _ => false,
        }
    }
}

pub type EngineResult<T> = Result<T, EngineError>;

//! Errors of the repository layer.
//!
//! Policy:
//! - Every error names *what* failed and *where* (an object key, a blob id, a version), in one
//!   line, so the CLI can print it as is.
//! - A variant says what the error means, so callers match on it and never on the text:
//!   damage of stored data ([`RepoError::is_damage`]), a store that could not be asked, input
//!   the caller gave that is not acceptable ([`RepoError::BadInput`]: a usage error), a named
//!   thing that does not exist or already does, a protected thing, a race, a bug.
//! - Lower layers' errors are kept as the source.

use cairn_format::{FormatError, Id};
use cairn_store::StoreError;
use thiserror::Error;

#[derive(Debug, Error)]
pub enum RepoError {
    #[error("{0}")]
    Store(#[from] StoreError),
    #[error("{key}: {source}")]
    Corrupt {
        key: String,
        #[source]
        source: FormatError,
    },
    #[error("no cairn repository at {location} (run `cairn init` first)")]
    NotARepository { location: String },
    #[error("a repository already exists at {location}")]
    AlreadyExists { location: String },
    #[error("blob {id} is not in any index (repository damaged or incomplete)")]
    BlobMissing { id: Id },
    #[error("blob {id} in pack {pack} at offset {offset}: {source}")]
    BadBlob {
        id: Id,
        pack: Id,
        offset: u32,
        #[source]
        source: FormatError,
    },
    #[error("pack {pack} is missing (needed for blob {id})")]
    PackMissing { pack: Id, id: Id },
    #[error(
        "blob {id} in pack {pack}: the only copy is damaged (quarantined); commit its data \
         again or run `cairn repair --from IMAGE_FILE`"
    )]
    Quarantined { id: Id, pack: Id },
    /// A manifest node that does not decode, or sits at the wrong level.
    #[error(transparent)]
    Node(#[from] crate::tree_walk::NodeError),
    #[error("version {id} does not exist")]
    VersionMissing { id: Id },
    /// Input the caller gave is not acceptable (a tag name, a config, a key slot prefix that
    /// names several slots, a key operation on a plain repository): a usage error.
    #[error("{0}")]
    BadInput(String),
    /// A thing the caller named does not exist (a tag, a key slot).
    #[error("{0}")]
    NotFound(String),
    /// A thing the caller would create exists already (a tag: tags never move silently).
    #[error("{0}")]
    Exists(String),
    /// The operation would lose something it protects (the last key slot); the message says
    /// what to do first.
    #[error("{0}")]
    Refused(String),
    /// The index (an index run or file), or a tag, is damaged, and the operation needs a
    /// complete view of it: damage, which `cairn repair` rebuilds.
    #[error("{0}")]
    IndexDamaged(String),
    /// A ref changed under the operation (another process acted at once); trying again works.
    #[error("{0}")]
    Conflict(String),
    /// A task of the operation did not run to its end, or a result read back wrong: a bug or
    /// a panic, never a property of the repository.
    #[error("{what}: {detail}")]
    Internal { what: &'static str, detail: String },
    #[error("image {0:?} has no versions")]
    NoSuchImage(String),
    #[error("ref of image {image:?} changed concurrently {attempts} times; giving up")]
    Contention { image: String, attempts: u32 },
    /// An encrypted repository opened without a passphrase.
    #[error(
        "{location} is encrypted: give its passphrase (CAIRN_PASSWORD, --password-file, \
         --password-command, or type it at a terminal)"
    )]
    Locked { location: String },
    /// The passphrase could not be had (no source, an unreadable file, a failed command).
    #[error("{0}")]
    NoPassphrase(String),
    /// A plain config next to key slots: the config of an encrypted repository was replaced.
    #[error(
        "{location}: the config says the repository is not encrypted, yet it holds key slots \
         (keys/); refusing to write plain data into it (was the config replaced? restore it \
         from a copy)"
    )]
    Downgraded { location: String },
    /// No key slot opens with the passphrase given.
    #[error("wrong passphrase: none of the {slots} key slot(s) of {location} opens with it")]
    WrongPassphrase { location: String, slots: usize },
}

pub type RepoResult<T> = Result<T, RepoError>;

impl RepoError {
    /// The error an index run's entry source gave (see [`crate::Repo::put_run_sorted`]):
    /// the store's own, if it carries one (a staged file that could not be read).
    pub fn from_entries(e: std::io::Error) -> RepoError {
        let text = e.to_string();
        match e.into_inner().map(|inner| inner.downcast::<StoreError>()) {
            Some(Ok(store)) => RepoError::Store(*store),
            _ => RepoError::internal("an index run's entries", text),
        }
    }

    /// A task (`what`) that failed, from its join or channel error.
    pub fn internal(what: &'static str, detail: impl std::fmt::Display) -> Self {
        RepoError::Internal {
            what,
            detail: detail.to_string(),
        }
    }

    pub fn corrupt(key: impl Into<String>, source: FormatError) -> Self {
        RepoError::Corrupt {
            key: key.into(),
            source,
        }
    }

    /// Whether the store's disk (or quota) is full: no write can succeed until space is freed.
    pub fn is_disk_full(&self) -> bool {
        matches!(self, RepoError::Store(StoreError::Full { .. }))
    }

    /// Whether this error means stored data is damaged or missing — a finding about the
    /// repository — rather than that the store could not be asked (which says nothing about
    /// the data and must never be mistaken for damage). An object written in a newer format
    /// is not damage either: it is refused, never set aside or skipped.
    pub fn is_damage(&self) -> bool {
        if self.is_too_new() {
            return false;
        }
        matches!(
            self,
            RepoError::Corrupt { .. }
                | RepoError::VersionMissing { .. }
                | RepoError::BlobMissing { .. }
                | RepoError::BadBlob { .. }
                | RepoError::PackMissing { .. }
                | RepoError::Quarantined { .. }
                | RepoError::Node(_)
                | RepoError::Downgraded { .. }
                | RepoError::IndexDamaged(_)
        )
    }

    /// Whether the object read does not exist.
    pub fn is_not_found(&self) -> bool {
        matches!(self, RepoError::Store(StoreError::NotFound { .. }))
    }

    /// Whether an object is in a format newer than this cairn reads ("upgrade cairn").
    pub fn is_too_new(&self) -> bool {
        matches!(
            self,
            RepoError::Corrupt {
                source: FormatError::TooNew { .. },
                ..
            } | RepoError::Node(crate::tree_walk::NodeError::Corrupt {
                source: FormatError::TooNew { .. },
                ..
            })
        )
    }
}

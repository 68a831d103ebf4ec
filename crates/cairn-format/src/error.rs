//! Errors of decoding and validating the format's structures.
//!
//! Policy:
//! - A decoder never panics and never trusts a length: every error is a [`FormatError`], and
//!   the bytes it was given are all it read (no I/O here).
//! - A message names the structure (`what`), never where it came from: the caller knows the
//!   object key or pack offset and adds it (`RepoError::Corrupt`), so the user gets one line.
//! - The variants say what went wrong: cut short, not a cairn structure, a checksum that does
//!   not match, a version newer than this build reads (refused, never taken for damage:
//!   "upgrade cairn"), or a value the format does not allow.

use thiserror::Error;

/// A structure could not be decoded. Messages name the structure (`what`) so that the
/// caller, which knows *where* it came from (an object key, a pack offset), can give the user
/// one complete line.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum FormatError {
    #[error("{what}: truncated (needs {needed} bytes, has {available})")]
    Truncated {
        what: &'static str,
        needed: u64,
        available: u64,
    },
    #[error("{what}: bad magic (not a cairn {what}, or corrupt)")]
    BadMagic { what: &'static str },
    #[error("{what}: checksum mismatch (corrupt)")]
    Checksum { what: &'static str },
    #[error("{what}: format version {found} is newer than this cairn supports ({supported}); upgrade cairn")]
    TooNew {
        what: &'static str,
        found: u32,
        supported: u32,
    },
    #[error("{what}: {reason}")]
    Invalid { what: &'static str, reason: String },
}

impl FormatError {
    pub fn invalid(what: &'static str, reason: impl Into<String>) -> Self {
        FormatError::Invalid {
            what,
            reason: reason.into(),
        }
    }
}

pub type FormatResult<T> = Result<T, FormatError>;

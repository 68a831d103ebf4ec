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

//! Errors of the store layer.
//!
//! Every message is one line and names both what failed and where, because these errors end
//! up in front of an operator who has nothing else to go on.

use std::path::PathBuf;

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The object does not exist. Callers match on this to tell "absent" from "broken".
    #[error("object not found: {key}")]
    NotFound { key: String },

    /// A ranged read asked for bytes the object does not have. Returned instead of a short
    /// read so that a truncated object can never be mistaken for a complete one.
    #[error("range {start}..{end} is past the end of {key} ({size} bytes)")]
    RangeOutOfBounds {
        key: String,
        start: u64,
        end: u64,
        size: u64,
    },

    /// The key (or listing prefix) is not one every backend can store; see
    /// [`validate_key`](crate::validate_key).
    #[error("invalid object key {key:?}: {reason}")]
    InvalidKey { key: String, reason: &'static str },

    /// A filesystem operation of the local store failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A request to a remote store (S3) failed after its retries, or the remote store lacks
    /// a capability the contract needs (such as conditional writes). `location` is the full
    /// object URL (never with credentials); `reason` is one line.
    #[error("{op} {location}: {reason}")]
    Remote {
        op: &'static str,
        location: String,
        reason: String,
    },

    /// The file system holding a local repository is full (or over quota).
    #[error(
        "the file system of {location} is full: free space, or delete versions with `cairn rm` \
         or `cairn prune` (they can run on a full disk)"
    )]
    Full { location: String },

    /// The store cannot be reached at all (network, credentials, runtime shutting down).
    #[error("store {location} is unavailable: {reason}")]
    Unavailable { location: String, reason: String },
}

/// Result of a store operation.
pub type StoreResult<T> = Result<T, StoreError>;

impl StoreError {
    /// Shorthand for [`StoreError::Io`].
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        StoreError::Io {
            op,
            path: path.into(),
            source,
        }
    }

    /// Shorthand for [`StoreError::NotFound`].
    pub(crate) fn not_found(key: &str) -> Self {
        StoreError::NotFound {
            key: key.to_owned(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_one_line_and_name_the_place() {
        let e = StoreError::io(
            "open",
            "/repo/packs/ab",
            std::io::Error::from_raw_os_error(libc::ENOENT),
        );
        let msg = e.to_string();
        assert!(msg.starts_with("open /repo/packs/ab: "), "{msg}");
        let e = StoreError::RangeOutOfBounds {
            key: "k".into(),
            start: 3,
            end: 9,
            size: 5,
        };
        assert_eq!(e.to_string(), "range 3..9 is past the end of k (5 bytes)");
        let e = StoreError::InvalidKey {
            key: "a\nb".into(),
            reason: "bad",
        };
        assert_eq!(e.to_string(), "invalid object key \"a\\nb\": bad");
        assert!(!e.to_string().contains('\n'));
    }
}

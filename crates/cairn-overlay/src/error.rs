//! Errors of the overlay.
//!
//! Every message is one line and names what failed and where (the file, the block, the
//! snapshot), because these errors end up in front of an operator.

use std::path::PathBuf;

/// Why an overlay operation failed.
#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    /// A filesystem operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A metadata file is missing, truncated, fails its checksum or is otherwise unusable.
    /// The overlay refuses to open rather than risk a wrong read.
    #[error("corrupt overlay file {}: {reason}", path.display())]
    Corrupt { path: PathBuf, reason: String },

    /// The overlay in this directory was created for a different image.
    #[error("overlay {} was created with {field} {stored}, but {requested} was requested", path.display())]
    Mismatch {
        path: PathBuf,
        field: &'static str,
        stored: String,
        requested: String,
    },

    /// The directory has no overlay manifest (`meta.json`).
    #[error("{} is not an overlay (no meta.json)", path.display())]
    NotAnOverlay { path: PathBuf },

    /// A file in an overlay directory that is not the overlay's: discarding the directory
    /// would delete it too, so nothing is deleted.
    #[error("{} is not an overlay file; refusing to delete the overlay's directory with it", path.display())]
    ForeignFile { path: PathBuf },

    /// The directory is not this user's alone: another user could plant or change what the
    /// overlay holds (writes a commit would store), so it is not used.
    #[error("overlay {} is not safe to use: {why}", path.display())]
    Untrusted { path: PathBuf, why: String },

    /// Another `Overlay` (in this or another process) has the directory open.
    #[error("overlay {} is already open elsewhere (lock held)", path.display())]
    Locked { path: PathBuf },

    /// The block size is not a power of two in 4 KiB..=4 MiB.
    #[error("invalid overlay block size {0}: must be a power of two between 4096 and 4194304")]
    InvalidBlockSize(u32),

    /// The image is too large for this block size (block count does not fit in memory).
    #[error("image of {size} bytes has too many blocks of {block_size} bytes for an overlay")]
    TooLarge { size: u64, block_size: u32 },

    /// A block index past the end of the image.
    #[error("block {block} is out of range (the image has {blocks} blocks)")]
    BlockOutOfRange { block: u64, blocks: u64 },

    /// A write whose length is not the block's length.
    #[error("write to block {block} has {got} bytes, but the block is {expected} bytes")]
    BadLength { block: u64, expected: u64, got: u64 },

    /// A read that does not fit inside its block.
    #[error(
        "read of {len} bytes at offset {offset} does not fit in block {block} ({block_len} bytes)"
    )]
    ReadOutsideBlock {
        block: u64,
        offset: u32,
        len: u64,
        block_len: u64,
    },

    /// `read_block` on a block no layer holds (read it from the base instead).
    #[error("block {block} is not held by the overlay")]
    NotHeld { block: u64 },

    /// A snapshot with that name already exists.
    #[error("snapshot {0:?} already exists")]
    SnapshotExists(String),

    /// No snapshot has that name.
    #[error("no snapshot named {0:?}")]
    NoSuchSnapshot(String),

    /// Snapshot names are 1..=255 bytes without control characters.
    #[error("invalid snapshot name {name:?}: {reason}")]
    InvalidName { name: String, reason: &'static str },

    /// The layer stack is full (at most 65535 layers).
    #[error("too many overlay layers ({0}); delete some snapshots first")]
    TooManyLayers(usize),

    /// An earlier fsync of overlay data failed; the kernel may have dropped the unflushed
    /// data, so the overlay refuses further writes and flushes until it is reopened.
    #[error("overlay is failed after an earlier I/O error ({0}); reopen it")]
    Failed(String),
}

impl OverlayError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        OverlayError::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub(crate) fn corrupt(path: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        OverlayError::Corrupt {
            path: path.into(),
            reason: reason.into(),
        }
    }
}

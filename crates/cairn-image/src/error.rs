//! Errors of image parsing and I/O: one line that names the file and what is wrong with it.

use std::path::PathBuf;

pub type ImageResult<T> = Result<T, ImageError>;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// The OS refused an operation on the file.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file is not a valid image of its format (corrupt or truncated).
    #[error("{path}: {what}")]
    Corrupt { path: PathBuf, what: String },
    /// A valid image that uses a feature cairn cannot read (encryption, external data files…).
    #[error("{path}: {what} is not supported")]
    Unsupported { path: PathBuf, what: String },
    /// The backing file named by an image cannot be opened.
    #[error("backing file {backing} of {path} cannot be opened: {source}")]
    Backing {
        path: PathBuf,
        backing: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A remote source (NBD) failed.
    #[error("{source_name}: {what}")]
    Remote { source_name: String, what: String },
}

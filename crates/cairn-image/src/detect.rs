//! Container detection for `--format auto`: the qcow2 magic, else raw.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use crate::error::{ImageError, ImageResult};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ImageFormat {
    Raw,
    Qcow2,
}

impl ImageFormat {
    pub fn name(self) -> &'static str {
        match self {
            ImageFormat::Raw => "raw",
            ImageFormat::Qcow2 => "qcow2",
        }
    }
}

/// The qcow2 magic, "QFI\xfb".
pub const QCOW2_MAGIC: [u8; 4] = *b"QFI\xfb";

/// Detects the container of an open file from its first bytes (a file shorter than the
/// magic is raw).
pub fn detect_format(file: &File, path: &Path) -> ImageResult<ImageFormat> {
    // Read the magic without readahead and without leaving it cached: a readahead here
    // would mark pages that a later polite scan finds "already cached" and keeps.
    crate::raw::advise(file, libc::POSIX_FADV_RANDOM);
    crate::pagecache::read_politely(file, 0, 4, || read_magic(file, path))
}

fn read_magic(file: &File, path: &Path) -> ImageResult<ImageFormat> {
    let mut magic = [0u8; 4];
    let mut got = 0;
    while got < magic.len() {
        match file.read_at(&mut magic[got..], got as u64) {
            Ok(0) => return Ok(ImageFormat::Raw),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => {
                return Err(ImageError::Io {
                    op: "cannot read",
                    path: path.to_path_buf(),
                    source: e,
                })
            }
        }
    }
    Ok(if magic == QCOW2_MAGIC {
        ImageFormat::Qcow2
    } else {
        ImageFormat::Raw
    })
}

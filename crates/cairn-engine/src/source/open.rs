//! Opening a local path as a disk image: format detection (`--format auto`) and the read
//! policy of a scan (rate limit, page-cache politeness, `O_DIRECT`).

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use cairn_image::qcow2::{self, Qcow2Image};
use cairn_image::{detect_format, DiskImage, ImageError, ImageFormat, RawImage, RawOptions};

use super::{ImageSource, RateLimited, Source};
use crate::error::{EngineError, EngineResult};

/// The container of a local source.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum SourceFormat {
    /// qcow2 if the file starts with the qcow2 magic, else raw.
    #[default]
    Auto,
    Raw,
    Qcow2,
}

/// How a scan reads its source.
#[derive(Debug, Clone, Copy)]
pub struct ReadPolicy {
    /// Average read rate cap in bytes per second.
    pub rate_limit: Option<u64>,
    /// Drop the pages a read brought into the page cache (pages cached before stay).
    pub drop_cache: bool,
    /// Read with `O_DIRECT` (raw files and block devices only).
    pub direct: bool,
}

impl Default for ReadPolicy {
    fn default() -> Self {
        ReadPolicy {
            rate_limit: None,
            drop_cache: true,
            direct: false,
        }
    }
}

/// Opens a local file or block device as a disk image.
pub fn open_image(
    path: &Path,
    format: SourceFormat,
    policy: ReadPolicy,
) -> EngineResult<Arc<dyn DiskImage>> {
    // A FIFO is not a disk image: opening one with no writer would wait for ever, and what
    // it carries is a stream (`cairn commit IMAGE -` reads one). Checked without opening.
    if std::fs::metadata(path).is_ok_and(|m| {
        use std::os::unix::fs::FileTypeExt;
        m.file_type().is_fifo()
    }) {
        return Err(EngineError::BadInput(format!(
            "{} is a FIFO, not a disk image: pipe it in instead (`cairn commit IMAGE - < {}`)",
            path.display(),
            path.display()
        )));
    }
    let format = match format {
        SourceFormat::Raw => ImageFormat::Raw,
        SourceFormat::Qcow2 => ImageFormat::Qcow2,
        SourceFormat::Auto => {
            let file = File::open(path).map_err(|e| ImageError::Io {
                op: "cannot open source",
                path: path.to_path_buf(),
                source: e,
            })?;
            // Something unreadable (a directory…) is left to the raw reader's precise error.
            detect_format(&file, path).unwrap_or(ImageFormat::Raw)
        }
    };
    let image: Box<dyn DiskImage> = match format {
        ImageFormat::Raw => Box::new(RawImage::open(
            path,
            RawOptions {
                drop_cache: policy.drop_cache,
                direct: policy.direct,
            },
        )?),
        ImageFormat::Qcow2 => {
            if policy.direct {
                return Err(EngineError::BadInput(format!(
                    "{}: O_DIRECT reads (--direct) work on raw files and block devices, not on \
                     qcow2 images",
                    path.display()
                )));
            }
            Box::new(Qcow2Image::open(
                path,
                qcow2::OpenOptions {
                    drop_cache: policy.drop_cache,
                },
            )?)
        }
    };
    Ok(match policy.rate_limit {
        Some(rate) => Arc::new(RateLimited::new(image, rate)),
        None => Arc::from(image),
    })
}

/// Opens a path as a commit source with format detection and the default read policy.
pub fn open_path(path: &Path) -> EngineResult<Box<dyn Source>> {
    let image = open_image(path, SourceFormat::Auto, ReadPolicy::default())?;
    Ok(Box::new(ImageSource::new(image)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};

    #[test]
    fn sparse_file_reads_only_data_segments() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse.raw");
        let mut f = File::create(&path).unwrap();
        f.set_len(64 << 20).unwrap();
        f.seek(SeekFrom::Start(10 << 20)).unwrap();
        f.write_all(&[7u8; 5000]).unwrap();
        f.sync_all().unwrap();
        let mut src = open_path(&path).unwrap();
        assert_eq!(src.size_hint(), Some(64 << 20));
        let mut segs = Vec::new();
        while let Some(s) = src.next_segment(1 << 20, Vec::new()).unwrap() {
            segs.push(s.index);
            assert_eq!(&s.data[..5000], &[7u8; 5000][..]);
        }
        // Depending on the file system's allocation granularity the data sits in segment 10.
        assert_eq!(segs, vec![10]);
    }

    #[test]
    fn a_fifo_is_refused_at_once_never_waited_on() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pipe");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path for the duration of the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let err = open_path(&fifo).err().unwrap().to_string();
        assert!(err.contains("is a FIFO, not a disk image"), "{err}");
    }

    #[test]
    fn missing_source_names_the_path() {
        let err = open_path(Path::new("/nonexistent/disk.raw")).err().unwrap();
        assert_eq!(
            err.to_string(),
            "cannot open source /nonexistent/disk.raw: No such file or directory (os error 2)"
        );
    }
}

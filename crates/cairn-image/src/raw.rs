//! Raw images: a regular file (sparse-aware) or a block device, read with positional reads.
//!
//! Files are mapped with `SEEK_DATA`/`SEEK_HOLE`, so holes are never read and a commit's work
//! is proportional to data, not to the disk's size. Reads can be polite to the host
//! ([`crate::pagecache`]) and can bypass the page cache altogether (`O_DIRECT`).

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{ImageError, ImageResult};
use crate::{Allocation, DiskImage, ImageFormat, Layer, MapRun};

/// How to read a raw image.
#[derive(Debug, Clone, Copy, Default)]
pub struct RawOptions {
    /// Drop the pages a read brought into the page cache (see [`crate::pagecache`]).
    pub drop_cache: bool,
    /// Read with `O_DIRECT`, bypassing the page cache.
    pub direct: bool,
}

/// Alignment of `O_DIRECT` buffers, offsets and lengths: 4 KiB covers every logical block
/// size in use.
const DIRECT_ALIGN: u64 = 4096;

pub struct RawImage {
    path: PathBuf,
    file: File,
    size: u64,
    is_device: bool,
    /// A second descriptor opened with `O_DIRECT`, when asked for.
    direct: Option<File>,
    options: RawOptions,
    polite: crate::pagecache::Polite,
}

impl Drop for RawImage {
    fn drop(&mut self) {
        if self.options.drop_cache {
            self.polite.finish(&self.file);
        }
    }
}

impl RawImage {
    /// Opens a regular file or a block device.
    pub fn open(path: &Path, options: RawOptions) -> ImageResult<RawImage> {
        let io_err = |op: &'static str, e: io::Error| ImageError::Io {
            op,
            path: path.to_path_buf(),
            source: e,
        };
        let file = File::open(path).map_err(|e| io_err("cannot open source", e))?;
        let meta = file
            .metadata()
            .map_err(|e| io_err("cannot stat source", e))?;
        let ft = meta.file_type();
        let (size, is_device) = if ft.is_block_device() {
            (
                device_size(&file).map_err(|e| io_err("cannot size block device", e))?,
                true,
            )
        } else if ft.is_file() {
            (meta.len(), false)
        } else {
            let what = if ft.is_dir() {
                "is a directory"
            } else {
                "not a regular file or block device"
            };
            return Err(io_err(
                "cannot read source",
                io::Error::new(io::ErrorKind::InvalidInput, what),
            ));
        };
        let direct = if options.direct {
            Some(
                OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(path)
                    .map_err(|e| {
                        if e.raw_os_error() == Some(libc::EINVAL) {
                            io_err(
                                "cannot open with O_DIRECT (not supported by its file system)",
                                e,
                            )
                        } else {
                            io_err("cannot open with O_DIRECT", e)
                        }
                    })?,
            )
        } else {
            None
        };
        // Readahead would bring pages in ahead of the reads, where the polite check would
        // then find them "already cached" and keep them: a polite scan reads without it (its
        // reads are large anyway).
        advise(
            &file,
            if options.drop_cache {
                libc::POSIX_FADV_RANDOM
            } else {
                libc::POSIX_FADV_SEQUENTIAL
            },
        );
        Ok(RawImage {
            path: path.to_path_buf(),
            file,
            size,
            is_device,
            direct,
            options,
            polite: Default::default(),
        })
    }

    fn read_direct(&self, direct: &File, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let start = offset / DIRECT_ALIGN * DIRECT_ALIGN;
        let end = (offset + buf.len() as u64).div_ceil(DIRECT_ALIGN) * DIRECT_ALIGN;
        let len = (end - start) as usize;
        // An over-allocated Vec, used from its first aligned byte: no unsafe needed.
        let mut raw = vec![0u8; len + DIRECT_ALIGN as usize];
        let skip = raw.as_ptr().align_offset(DIRECT_ALIGN as usize);
        let aligned = &mut raw[skip..skip + len];
        let mut got = 0;
        while got < len {
            match direct.read_at(&mut aligned[got..], start + got as u64) {
                Ok(0) => break, // end of file: the tail past it is not needed
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let from = (offset - start) as usize;
        if got < from + buf.len() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "file shrank while being read",
            ));
        }
        buf.copy_from_slice(&aligned[from..from + buf.len()]);
        Ok(())
    }
}

impl DiskImage for RawImage {
    fn describe(&self) -> String {
        self.path.display().to_string()
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn size_now(&self) -> Option<u64> {
        // A device's size does not change under a reader; a file's can (truncate, resize).
        (!self.is_device)
            .then(|| self.file.metadata().ok().map(|m| m.len()))
            .flatten()
    }
    fn map(&self) -> ImageResult<Vec<MapRun>> {
        let extents = if self.is_device {
            vec![(0, self.size)]
        } else {
            data_extents(&self.file, self.size).map_err(|e| ImageError::Io {
                op: "cannot map extents of",
                path: self.path.clone(),
                source: e,
            })?
        };
        Ok(runs_from_extents(&extents, self.size, 0, 1))
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ImageResult<()> {
        let res = match &self.direct {
            Some(direct) => self.read_direct(direct, buf, offset),
            None if self.options.drop_cache => {
                self.polite.read(&self.file, offset, buf.len() as u64, || {
                    self.file.read_exact_at(buf, offset)
                })
            }
            None => self.file.read_exact_at(buf, offset),
        };
        res.map_err(|e| ImageError::Io {
            op: "read error in",
            path: self.path.clone(),
            source: if e.kind() == io::ErrorKind::UnexpectedEof {
                io::Error::new(e.kind(), "file shrank while being read")
            } else {
                e
            },
        })
    }
    fn layers(&self) -> Vec<Layer> {
        vec![Layer {
            path: self.path.clone(),
            format: ImageFormat::Raw,
            size: self.size,
        }]
    }
}

/// Turns sorted data extents into a full allocation map: extents are `Data` at `depth`, the
/// gaps `Unallocated` at `unallocated_depth`.
pub fn runs_from_extents(
    extents: &[(u64, u64)],
    size: u64,
    depth: usize,
    unallocated_depth: usize,
) -> Vec<MapRun> {
    let mut runs: Vec<MapRun> = Vec::new();
    let mut push = |start: u64, end: u64, alloc: Allocation, depth: usize| {
        if end <= start {
            return;
        }
        match runs.last_mut() {
            Some(last) if last.end() == start && last.alloc == alloc && last.depth == depth => {
                last.len += end - start
            }
            _ => runs.push(MapRun {
                start,
                len: end - start,
                alloc,
                depth,
            }),
        }
    };
    let mut pos = 0;
    for &(s, e) in extents {
        let (s, e) = (s.max(pos).min(size), e.min(size));
        push(pos, s, Allocation::Unallocated, unallocated_depth);
        push(s, e, Allocation::Data, depth);
        pos = pos.max(e);
    }
    push(pos, size, Allocation::Unallocated, unallocated_depth);
    runs
}

fn device_size(file: &File) -> io::Result<u64> {
    // SAFETY: lseek on a valid, owned file descriptor has no memory-safety preconditions.
    let end = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_END) };
    if end < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(end as u64)
}

/// Advises the kernel of the access pattern of the whole file.
pub(crate) fn advise(file: &File, advice: libc::c_int) {
    // SAFETY: posix_fadvise only takes an fd and integers; failure is harmless (a hint).
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), 0, 0, advice);
    }
}

/// The allocated extents of a file as (start, end) pairs, from `SEEK_DATA`/`SEEK_HOLE`.
/// File systems without support report the whole file as data, which is correct.
pub fn data_extents(file: &File, size: u64) -> io::Result<Vec<(u64, u64)>> {
    let fd = file.as_raw_fd();
    let mut out = Vec::new();
    let mut pos: u64 = 0;
    while pos < size {
        // SAFETY: lseek on a valid fd; no memory is passed.
        let data = unsafe { libc::lseek(fd, pos as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            let err = io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::ENXIO) => break, // no data after pos
                Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) if out.is_empty() && pos == 0 => {
                    return Ok(vec![(0, size)])
                }
                _ => return Err(err),
            }
        }
        let data = data as u64;
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data as libc::off_t, libc::SEEK_HOLE) };
        if hole < 0 {
            return Err(io::Error::last_os_error());
        }
        let hole = (hole as u64).min(size);
        if hole > data {
            out.push((data, hole));
        }
        pos = hole.max(data + 1);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Seek, SeekFrom, Write};

    fn sparse_file(dir: &Path) -> PathBuf {
        let path = dir.join("sparse.raw");
        let mut f = File::create(&path).unwrap();
        f.set_len(64 << 20).unwrap();
        f.seek(SeekFrom::Start(10 << 20)).unwrap();
        f.write_all(&[7u8; 5000]).unwrap();
        f.sync_all().unwrap();
        path
    }

    #[test]
    fn maps_holes_and_reads_data() {
        let dir = tempfile::tempdir().unwrap();
        let path = sparse_file(dir.path());
        let img = RawImage::open(&path, RawOptions::default()).unwrap();
        let map = img.map().unwrap();
        let data: Vec<_> = map.iter().filter(|r| r.alloc == Allocation::Data).collect();
        assert_eq!(data.len(), 1);
        assert!(data[0].start <= 10 << 20 && data[0].end() >= (10 << 20) + 5000);
        assert!(data[0].len < 1 << 20, "only the written block is data");
        assert_eq!(map.iter().map(|r| r.len).sum::<u64>(), 64 << 20);
        let mut buf = vec![0u8; 6000];
        img.read_at(&mut buf, (10 << 20) - 500).unwrap();
        assert_eq!(&buf[..500], &[0u8; 500][..]);
        assert_eq!(&buf[500..5500], &[7u8; 5000][..]);
    }

    #[test]
    fn size_now_follows_the_file_after_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = sparse_file(dir.path());
        let img = RawImage::open(&path, RawOptions::default()).unwrap();
        assert_eq!(img.size_now(), Some(64 << 20));
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(65 << 20)
            .unwrap();
        assert_eq!((img.size(), img.size_now()), (64 << 20, Some(65 << 20)));
    }

    #[test]
    fn direct_and_polite_reads_return_the_same_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let path = sparse_file(dir.path());
        let plain = RawImage::open(&path, RawOptions::default()).unwrap();
        let polite = RawImage::open(
            &path,
            RawOptions {
                drop_cache: true,
                direct: false,
            },
        )
        .unwrap();
        let mut a = vec![0u8; 12345];
        let mut b = vec![1u8; 12345];
        plain.read_at(&mut a, (10 << 20) - 77).unwrap();
        polite.read_at(&mut b, (10 << 20) - 77).unwrap();
        assert_eq!(a, b);
        // O_DIRECT is refused by some file systems (tmpfs); where it opens, it must agree.
        if let Ok(direct) = RawImage::open(
            &path,
            RawOptions {
                drop_cache: false,
                direct: true,
            },
        ) {
            let mut c = vec![2u8; 12345];
            direct.read_at(&mut c, (10 << 20) - 77).unwrap();
            assert_eq!(a, c);
            let mut tail = vec![3u8; 100];
            direct.read_at(&mut tail, (64 << 20) - 100).unwrap();
            assert_eq!(tail, vec![0u8; 100]);
        }
    }

    #[test]
    fn missing_source_names_the_path() {
        let err = RawImage::open(Path::new("/nonexistent/disk.raw"), RawOptions::default())
            .err()
            .unwrap();
        assert_eq!(
            err.to_string(),
            "cannot open source /nonexistent/disk.raw: No such file or directory (os error 2)"
        );
    }

    #[test]
    fn runs_cover_the_image_and_merge() {
        let runs = runs_from_extents(&[(0, 10), (10, 20), (30, 40)], 50, 0, 1);
        let got: Vec<_> = runs.iter().map(|r| (r.start, r.len, r.alloc)).collect();
        assert_eq!(
            got,
            vec![
                (0, 20, Allocation::Data),
                (20, 10, Allocation::Unallocated),
                (30, 10, Allocation::Data),
                (40, 10, Allocation::Unallocated)
            ]
        );
    }
}

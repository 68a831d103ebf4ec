//! Where a commit reads from: a raw image file, a block device, or a stream.
//!
//! Files are read sparse-aware: `SEEK_DATA`/`SEEK_HOLE` find the allocated extents and holes
//! are never read, so work is proportional to data, not to the disk's size. A segment that
//! lies entirely in holes is not produced at all (it is zeros in the manifest).

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use crate::error::{EngineError, EngineResult};

/// One segment read from a source. `data.len()` is the segment's logical length (the last
/// segment may be short); bytes in holes are zero.
pub struct Segment {
    pub index: u64,
    pub data: Vec<u8>,
}

/// A source of image data, read segment by segment, in increasing order.
pub trait Source: Send {
    /// What the source is, for messages.
    fn describe(&self) -> String;
    /// Logical size if known before reading (files, devices), for progress.
    fn size_hint(&self) -> Option<u64>;
    /// Bytes that will actually be read (allocated extents), for progress.
    fn data_hint(&self) -> Option<u64>;
    /// The next segment holding data, or `None` at the end. `buf` is a recycled buffer.
    fn next_segment(&mut self, segment_size: u32, buf: Vec<u8>) -> EngineResult<Option<Segment>>;
    /// The logical size, valid once `next_segment` returned `None`.
    fn final_size(&self) -> u64;
}

/// Opens a path as a source: a regular file (sparse-aware) or a block device.
pub fn open_path(path: &Path) -> EngineResult<Box<dyn Source>> {
    let io_err = |op: &'static str, e: io::Error| EngineError::Source {
        op,
        path: path.to_path_buf(),
        source: e,
    };
    let file = File::open(path).map_err(|e| io_err("cannot open source", e))?;
    let meta = file
        .metadata()
        .map_err(|e| io_err("cannot stat source", e))?;
    let ft = meta.file_type();
    if ft.is_dir() {
        return Err(io_err(
            "cannot read source",
            io::Error::new(io::ErrorKind::InvalidInput, "is a directory"),
        ));
    }
    let (size, extents) = if ft.is_block_device() {
        let size = device_size(&file).map_err(|e| io_err("cannot size block device", e))?;
        (size, vec![(0, size)])
    } else if ft.is_file() {
        let size = meta.len();
        let extents = data_extents(&file, size).map_err(|e| io_err("cannot map extents of", e))?;
        (size, extents)
    } else {
        return Err(io_err(
            "cannot read source",
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "not a regular file or block device",
            ),
        ));
    };
    advise_sequential(&file);
    Ok(Box::new(FileSource {
        path: path.to_path_buf(),
        file,
        size,
        extents,
        next_extent: 0,
        next_seg: 0,
    }))
}

fn device_size(file: &File) -> io::Result<u64> {
    // SAFETY: lseek on a valid, owned file descriptor has no memory-safety preconditions.
    let end = unsafe { libc::lseek(file.as_raw_fd(), 0, libc::SEEK_END) };
    if end < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(end as u64)
}

fn advise_sequential(file: &File) {
    // SAFETY: posix_fadvise only takes an fd and integers; failure is harmless (a hint).
    unsafe {
        libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL);
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

struct FileSource {
    path: PathBuf,
    file: File,
    size: u64,
    extents: Vec<(u64, u64)>,
    /// First extent that may still overlap unread segments.
    next_extent: usize,
    /// First segment not yet produced.
    next_seg: u64,
}

impl Source for FileSource {
    fn describe(&self) -> String {
        self.path.display().to_string()
    }
    fn size_hint(&self) -> Option<u64> {
        Some(self.size)
    }
    fn data_hint(&self) -> Option<u64> {
        Some(self.extents.iter().map(|(s, e)| e - s).sum())
    }
    fn final_size(&self) -> u64 {
        self.size
    }

    fn next_segment(
        &mut self,
        segment_size: u32,
        mut buf: Vec<u8>,
    ) -> EngineResult<Option<Segment>> {
        let seg_size = segment_size as u64;
        // Skip extents that end before the next unread segment.
        while self.next_extent < self.extents.len()
            && self.extents[self.next_extent].1 <= self.next_seg * seg_size
        {
            self.next_extent += 1;
        }
        let Some(&(ext_start, _)) = self.extents.get(self.next_extent) else {
            return Ok(None);
        };
        let seg = (ext_start / seg_size).max(self.next_seg);
        let start = seg * seg_size;
        let end = (start + seg_size).min(self.size);
        buf.clear();
        buf.resize((end - start) as usize, 0);
        // Read every extent part that overlaps this segment; holes stay zero.
        for &(es, ee) in &self.extents[self.next_extent..] {
            if es >= end {
                break;
            }
            let (rs, re) = (es.max(start), ee.min(end));
            if rs < re {
                let dst = &mut buf[(rs - start) as usize..(re - start) as usize];
                self.file
                    .read_exact_at(dst, rs)
                    .map_err(|e| EngineError::Source {
                        op: "read error in",
                        path: self.path.clone(),
                        source: if e.kind() == io::ErrorKind::UnexpectedEof {
                            io::Error::new(e.kind(), "file shrank while being read")
                        } else {
                            e
                        },
                    })?;
            }
        }
        self.next_seg = seg + 1;
        Ok(Some(Segment {
            index: seg,
            data: buf,
        }))
    }
}

/// A stream (stdin or a pipe): read in full, every byte, in order.
pub struct StreamSource<R: Read + Send> {
    name: String,
    reader: R,
    next_seg: u64,
    total: u64,
    done: bool,
}

impl<R: Read + Send> StreamSource<R> {
    pub fn new(name: impl Into<String>, reader: R) -> Self {
        StreamSource {
            name: name.into(),
            reader,
            next_seg: 0,
            total: 0,
            done: false,
        }
    }
}

impl<R: Read + Send> Source for StreamSource<R> {
    fn describe(&self) -> String {
        self.name.clone()
    }
    fn size_hint(&self) -> Option<u64> {
        None
    }
    fn data_hint(&self) -> Option<u64> {
        None
    }
    fn final_size(&self) -> u64 {
        self.total
    }

    fn next_segment(
        &mut self,
        segment_size: u32,
        mut buf: Vec<u8>,
    ) -> EngineResult<Option<Segment>> {
        if self.done {
            return Ok(None);
        }
        buf.clear();
        buf.resize(segment_size as usize, 0);
        let mut filled = 0;
        while filled < buf.len() {
            match self.reader.read(&mut buf[filled..]) {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    return Err(EngineError::Source {
                        op: "read error in",
                        path: PathBuf::from(&self.name),
                        source: e,
                    })
                }
            }
        }
        if filled < buf.len() {
            self.done = true;
            buf.truncate(filled);
        }
        self.total += filled as u64;
        if filled == 0 {
            return Ok(None);
        }
        let index = self.next_seg;
        self.next_seg += 1;
        Ok(Some(Segment { index, data: buf }))
    }
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
    fn stream_source_splits_and_counts() {
        let data = vec![3u8; 2500];
        let mut src = StreamSource::new("stdin", &data[..]);
        let a = src.next_segment(1024, Vec::new()).unwrap().unwrap();
        let b = src.next_segment(1024, Vec::new()).unwrap().unwrap();
        let c = src.next_segment(1024, Vec::new()).unwrap().unwrap();
        assert!(src.next_segment(1024, Vec::new()).unwrap().is_none());
        assert_eq!(
            (a.data.len(), b.data.len(), c.data.len()),
            (1024, 1024, 452)
        );
        assert_eq!(src.final_size(), 2500);
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

//! The qcow2 reader: an image and its whole backing chain (qcow2 and raw files), its
//! allocation map and positional reads.

use std::collections::HashSet;
use std::ffi::OsStr;
use std::fs::File;
use std::io::{self, Seek, SeekFrom};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use super::header::{corrupt, read_error, unsupported};
use super::io::{FileIo, HostIo, SliceIo};
use super::layer::{Cluster, Qcow2File};
use crate::detect::detect_format;
use crate::error::{ImageError, ImageResult};
use crate::{Allocation, DiskImage, ImageFormat, Layer, MapRun};

/// Longest backing chain we follow (QEMU has no fixed limit; a longer one is surely a loop
/// or a mistake).
pub const MAX_CHAIN_LEN: usize = 64;

/// How to open an image.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// After reading data clusters from a file, tell the kernel they are not needed again
    /// (`posix_fadvise(DONTNEED)`), so a scan does not evict the host's page cache.
    pub drop_cache: bool,
}

enum Kind {
    Qcow2(Box<Qcow2File<FileIo>>),
    Raw(FileIo),
}

struct ChainLayer {
    path: PathBuf,
    size: u64,
    kind: Kind,
}

impl ChainLayer {
    fn format(&self) -> ImageFormat {
        match self.kind {
            Kind::Qcow2(_) => ImageFormat::Qcow2,
            Kind::Raw(_) => ImageFormat::Raw,
        }
    }
}

/// An open qcow2 image with its whole backing chain.
pub struct Qcow2Image {
    /// Top first.
    layers: Vec<ChainLayer>,
}

fn open_error(path: &Path, source: io::Error) -> ImageError {
    ImageError::Io {
        op: "cannot open",
        path: path.to_path_buf(),
        source,
    }
}

/// The length of a regular file, or of a block device (whose metadata says 0).
fn host_len(file: &File, meta: &std::fs::Metadata, path: &Path) -> ImageResult<u64> {
    if meta.is_file() {
        return Ok(meta.len());
    }
    let mut f = file;
    f.seek(SeekFrom::End(0)).map_err(|e| ImageError::Io {
        op: "cannot find the size of",
        path: path.to_path_buf(),
        source: e,
    })
}

/// Where a backing file name points, relative to the image naming it.
fn resolve_backing(naming: &Path, name: &[u8]) -> ImageResult<PathBuf> {
    let shown = String::from_utf8_lossy(name);
    // QEMU reads "proto:rest" (no '/' before the ':') as a protocol: nbd:, json:, http:…
    if let Some(colon) = name.iter().position(|&b| b == b':') {
        if !name[..colon].contains(&b'/') {
            return Err(unsupported(
                naming,
                format!("a backing file on a protocol ('{shown}')"),
            ));
        }
    }
    let name = Path::new(OsStr::from_bytes(name));
    if name.is_absolute() {
        return Ok(name.to_path_buf());
    }
    let dir = naming.parent().unwrap_or(Path::new(""));
    Ok(dir.join(name))
}

impl Qcow2Image {
    /// Opens `path` and its backing chain (qcow2 or raw backing files; relative backing
    /// names resolve against the directory of the image naming them).
    pub fn open(path: &Path, options: OpenOptions) -> ImageResult<Qcow2Image> {
        let mut layers: Vec<ChainLayer> = Vec::new();
        let mut seen: HashSet<(u64, u64)> = HashSet::new();
        let file = File::open(path).map_err(|e| open_error(path, e))?;
        // The next file to open: (path, file, forced format, the image naming it).
        let mut next: Option<(PathBuf, File, Option<ImageFormat>)> =
            Some((path.to_path_buf(), file, Some(ImageFormat::Qcow2)));
        while let Some((path, file, format)) = next.take() {
            let meta = file.metadata().map_err(|e| open_error(&path, e))?;
            if !meta.is_file() && !meta.file_type().is_block_device() {
                let source = io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "not a regular file or block device",
                );
                return Err(match layers.last() {
                    None => open_error(&path, source),
                    Some(naming) => ImageError::Backing {
                        path: naming.path.clone(),
                        backing: path,
                        source,
                    },
                });
            }
            if !seen.insert((meta.dev(), meta.ino())) {
                let naming = &layers.last().expect("the top is never seen twice").path;
                return Err(corrupt(
                    naming,
                    format!(
                        "backing chain loops: backing file {} is already in the chain",
                        path.display()
                    ),
                ));
            }
            let len = host_len(&file, &meta, &path)?;
            let format = match format {
                Some(f) => f,
                None => detect_format(&file, &path)?,
            };
            let io = FileIo::new(file, len, options.drop_cache);
            match format {
                ImageFormat::Raw => {
                    layers.push(ChainLayer {
                        path,
                        size: len,
                        kind: Kind::Raw(io),
                    });
                }
                ImageFormat::Qcow2 => {
                    let q = Qcow2File::open(io, path.clone())?;
                    if let Some(name) = q.header.backing_name.clone() {
                        if layers.len() + 1 >= MAX_CHAIN_LEN {
                            return Err(corrupt(
                                &path,
                                format!("backing chain too deep (more than {MAX_CHAIN_LEN} files)"),
                            ));
                        }
                        let backing = resolve_backing(&path, &name)?;
                        let forced = match q.header.backing_format.as_deref() {
                            None => None,
                            Some("raw") | Some("file") => Some(ImageFormat::Raw),
                            Some("qcow2") => Some(ImageFormat::Qcow2),
                            Some(other) => {
                                return Err(unsupported(
                                    &path,
                                    format!(
                                        "a backing file in format '{other}' ({})",
                                        backing.display()
                                    ),
                                ))
                            }
                        };
                        let bfile = File::open(&backing).map_err(|e| ImageError::Backing {
                            path: path.clone(),
                            backing: backing.clone(),
                            source: e,
                        })?;
                        next = Some((backing, bfile, forced));
                    }
                    layers.push(ChainLayer {
                        path,
                        size: q.size(),
                        kind: Kind::Qcow2(Box::new(q)),
                    });
                }
            }
        }
        Ok(Qcow2Image { layers })
    }

    /// Parses only the bytes of one image file with no backing chain (for the fuzz target).
    ///
    /// Checks the header, its extensions, the L1 table, every L2 table it references and
    /// every cluster descriptor, and decompresses each distinct compressed cluster (up to a
    /// total of 256 MiB of output, so a hostile image cannot make this run for long; past
    /// that, compressed clusters are only checked for where they are).
    pub fn parse_bytes(bytes: &[u8]) -> ImageResult<()> {
        const DECOMPRESS_BUDGET: u64 = 256 << 20;
        let q = Qcow2File::open(SliceIo(bytes), PathBuf::from("<bytes>"))?;
        let cs = q.cluster_size();
        let mut budget = DECOMPRESS_BUDGET;
        let mut done: HashSet<(u64, u64)> = HashSet::new();
        q.walk(0, q.size(), &mut |start, _end, cluster| {
            if let Cluster::Compressed { host, len } = cluster {
                if budget >= cs && done.insert((host, len)) {
                    budget -= cs;
                    q.decompress(host, len, start)?;
                }
            }
            Ok(())
        })
    }

    fn map_range(
        &self,
        depth: usize,
        start: u64,
        end: u64,
        out: &mut RunBuilder,
    ) -> ImageResult<()> {
        let chain = self.layers.len();
        let Some(layer) = self.layers.get(depth) else {
            out.push(start, end, Allocation::Unallocated, chain);
            return Ok(());
        };
        let inside = end.min(layer.size);
        if start < inside {
            match &layer.kind {
                Kind::Qcow2(q) => {
                    // Unallocated segments are gathered and handed to the backing file at once.
                    let mut pending: Option<(u64, u64)> = None;
                    q.walk(start, inside, &mut |s, e, cluster| {
                        let alloc = match cluster {
                            Cluster::Unallocated => {
                                pending = match pending {
                                    Some((ps, pe)) if pe == s => Some((ps, e)),
                                    Some((ps, pe)) => {
                                        self.map_range(depth + 1, ps, pe, out)?;
                                        Some((s, e))
                                    }
                                    None => Some((s, e)),
                                };
                                return Ok(());
                            }
                            Cluster::Zero => Allocation::Zero,
                            Cluster::Data(_) | Cluster::Compressed { .. } => Allocation::Data,
                        };
                        if let Some((ps, pe)) = pending.take() {
                            self.map_range(depth + 1, ps, pe, out)?;
                        }
                        out.push(s, e, alloc, depth);
                        Ok(())
                    })?;
                    if let Some((ps, pe)) = pending {
                        self.map_range(depth + 1, ps, pe, out)?;
                    }
                }
                Kind::Raw(io) => map_raw(io, &layer.path, start, inside, depth, chain, out)?,
            }
        }
        if inside < end {
            // Past this layer's end, the layers below define nothing.
            out.push(start.max(inside), end, Allocation::Unallocated, chain);
        }
        Ok(())
    }

    fn read_range(&self, depth: usize, buf: &mut [u8], offset: u64) -> ImageResult<()> {
        let Some(layer) = self.layers.get(depth) else {
            buf.fill(0);
            return Ok(());
        };
        let inside = layer.size.saturating_sub(offset).min(buf.len() as u64) as usize;
        let (buf, past) = buf.split_at_mut(inside);
        past.fill(0);
        if buf.is_empty() {
            return Ok(());
        }
        match &layer.kind {
            Kind::Raw(io) => {
                io.read_exact_at(buf, offset)
                    .map_err(|e| read_error(&layer.path, e))?;
                Ok(())
            }
            Kind::Qcow2(q) => self.read_qcow2(depth, q, buf, offset),
        }
    }

    fn read_qcow2(
        &self,
        depth: usize,
        q: &Qcow2File<FileIo>,
        buf: &mut [u8],
        offset: u64,
    ) -> ImageResult<()> {
        // Adjacent segments of the same kind (and contiguous on the host, for data) are
        // served by one read.
        #[derive(Clone, Copy)]
        enum Pending {
            Backing,
            Zero,
            Data(u64),
        }
        let flush = |buf: &mut [u8], p: Option<(Pending, usize, usize)>| -> ImageResult<()> {
            let Some((kind, a, b)) = p else {
                return Ok(());
            };
            let part = &mut buf[a..b];
            match kind {
                Pending::Backing => self.read_range(depth + 1, part, offset + a as u64),
                Pending::Zero => {
                    part.fill(0);
                    Ok(())
                }
                Pending::Data(host) => {
                    q.io.read_exact_at(part, host)
                        .map_err(|e| read_error(q.path(), e))?;
                    Ok(())
                }
            }
        };
        let mut pending: Option<(Pending, usize, usize)> = None;
        let cs = q.cluster_size();
        q.walk(offset, offset + buf.len() as u64, &mut |s, e, cluster| {
            let a = (s - offset) as usize;
            let b = (e - offset) as usize;
            let this = match cluster {
                Cluster::Unallocated => Pending::Backing,
                Cluster::Zero => Pending::Zero,
                Cluster::Data(host) => Pending::Data(host),
                Cluster::Compressed { host, len } => {
                    flush(buf, pending.take())?;
                    let cluster_start = s & !(cs - 1);
                    let data = q.compressed_cluster(host, len, cluster_start)?;
                    let from = (s - cluster_start) as usize;
                    buf[a..b].copy_from_slice(&data[from..from + (b - a)]);
                    return Ok(());
                }
            };
            pending = match (pending, this) {
                (Some((Pending::Backing, pa, pb)), Pending::Backing) if pb == a => {
                    Some((Pending::Backing, pa, b))
                }
                (Some((Pending::Zero, pa, pb)), Pending::Zero) if pb == a => {
                    Some((Pending::Zero, pa, b))
                }
                (Some((Pending::Data(h), pa, pb)), Pending::Data(host))
                    if pb == a && h + (pb - pa) as u64 == host =>
                {
                    Some((Pending::Data(h), pa, b))
                }
                (p, this) => {
                    flush(buf, p)?;
                    Some((this, a, b))
                }
            };
            Ok(())
        })?;
        flush(buf, pending)
    }
}

/// Maps `[start, end)` of a raw layer with `SEEK_DATA`/`SEEK_HOLE`: data at `depth`, holes
/// unallocated. A file system (or block device) that cannot tell is all data.
fn map_raw(
    io: &FileIo,
    path: &Path,
    start: u64,
    end: u64,
    depth: usize,
    chain: usize,
    out: &mut RunBuilder,
) -> ImageResult<()> {
    let fd = io.file().as_raw_fd();
    let seek = |pos: u64, whence: libc::c_int| -> io::Result<Option<u64>> {
        let Ok(off) = libc::off_t::try_from(pos) else {
            return Ok(None);
        };
        // SAFETY: lseek takes our open descriptor (kept alive by `io`) and integers, and
        // touches no memory of ours. It moves the descriptor's file position, which nothing
        // else uses: every read is a pread.
        let r = unsafe { libc::lseek(fd, off, whence) };
        if r < 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::ENXIO) {
                return Ok(None);
            }
            return Err(e);
        }
        Ok(Some(r as u64))
    };
    let mut pos = start;
    while pos < end {
        let data = match seek(pos, libc::SEEK_DATA) {
            Ok(Some(d)) => d.max(pos),
            Ok(None) => end,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => pos,
            Err(e) => {
                return Err(ImageError::Io {
                    op: "cannot map",
                    path: path.to_path_buf(),
                    source: e,
                })
            }
        };
        let data = data.min(end);
        out.push(pos, data, Allocation::Unallocated, chain);
        if data >= end {
            break;
        }
        let hole = match seek(data, libc::SEEK_HOLE) {
            Ok(Some(h)) => h,
            Ok(None) => end,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => end,
            Err(e) => {
                return Err(ImageError::Io {
                    op: "cannot map",
                    path: path.to_path_buf(),
                    source: e,
                })
            }
        };
        // A hole at `data` itself would mean the file changed under us: take a byte as data
        // so that the loop always advances.
        let hole = hole.clamp(data + 1, end);
        out.push(data, hole, Allocation::Data, depth);
        pos = hole;
    }
    Ok(())
}

/// Collects map runs, merging each with the previous one when they touch and match.
struct RunBuilder {
    runs: Vec<MapRun>,
}

impl RunBuilder {
    fn push(&mut self, start: u64, end: u64, alloc: Allocation, depth: usize) {
        if end <= start {
            return;
        }
        if let Some(last) = self.runs.last_mut() {
            if last.end() == start && last.alloc == alloc && last.depth == depth {
                last.len += end - start;
                return;
            }
        }
        self.runs.push(MapRun {
            start,
            len: end - start,
            alloc,
            depth,
        });
    }
}

impl DiskImage for Qcow2Image {
    fn describe(&self) -> String {
        self.layers[0].path.display().to_string()
    }
    fn size(&self) -> u64 {
        self.layers[0].size
    }
    fn map(&self) -> ImageResult<Vec<MapRun>> {
        let mut out = RunBuilder { runs: Vec::new() };
        self.map_range(0, 0, self.size(), &mut out)?;
        Ok(out.runs)
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ImageResult<()> {
        let fits = offset
            .checked_add(buf.len() as u64)
            .is_some_and(|end| end <= self.size());
        if !fits {
            return Err(read_error(
                &self.layers[0].path,
                io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!(
                        "a read of {} bytes at 0x{offset:x} goes past the virtual size ({} bytes)",
                        buf.len(),
                        self.size()
                    ),
                ),
            ));
        }
        self.read_range(0, buf, offset)
    }
    fn layers(&self) -> Vec<Layer> {
        self.layers
            .iter()
            .map(|l| Layer {
                path: l.path.clone(),
                format: l.format(),
                size: l.size,
            })
            .collect()
    }
}

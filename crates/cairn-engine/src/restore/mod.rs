//! Restore: write a version out, bit-exact.
//!
//! The segments are read in a rolling window of batches of leaves (`window.rs`), every byte
//! checked against its id, and written in segment order at their offsets with `pwrite`.
//! Zero runs are never written to a regular file: it is sized first, so they stay holes. A
//! block device gets explicit zeros; stdout gets every byte, in order.
//!
//! A qcow2 output (`RestoreTarget::Qcow2`) takes the same positioned writes through
//! [`Qcow2Writer`]: clusters are allocated as data arrives, all-zero pieces are skipped, so
//! clusters without data stay unallocated, and the metadata is written at the end.
//!
//! A regular-file output (raw or qcow2) is written under a temporary name and put into place
//! only once complete and synced, so a failed restore never leaves a plausible-looking
//! partial image ([`partial`]). What may be written at all — never an existing file without
//! `force`, never a mounted device, never a FIFO — is decided first ([`target`]).

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cairn_format::version::VersionRecord;
use cairn_image::qcow2::Qcow2Writer;
use cairn_repo::Repo;

use crate::error::{EngineError, EngineResult};

pub mod in_place;
mod window;
use window::run;
pub(crate) use window::LEAVES_PER_READ;
pub mod partial;
pub mod target;

use partial::Partial;
use target::{check_output, OutputKind};

/// Where to restore to.
#[derive(Debug, Clone)]
pub enum RestoreTarget {
    /// A regular file (created, or replaced with `force`) or a block device (with `force`), raw.
    Path(PathBuf),
    /// A compact qcow2 v3 file (created, or replaced with `force`): clusters without data stay
    /// unallocated.
    Qcow2(PathBuf),
    /// A qcow2 v3 overlay on a local base image (created, or replaced with `force`): only
    /// the clusters where the version differs from the base are stored; the others read
    /// from the base, which the header names as its backing file.
    Qcow2Overlay { path: PathBuf, base: QcowBase },
    /// Standard output, in order.
    Stdout,
}

/// The base image of a qcow2 overlay output.
#[derive(Clone)]
pub struct QcowBase {
    /// How the overlay's header names it.
    pub backing: cairn_image::qcow2::Backing,
    /// Its bytes, compared with the version's cluster by cluster.
    pub image: Arc<dyn cairn_image::DiskImage>,
}

impl std::fmt::Debug for QcowBase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QcowBase")
            .field("backing", &self.backing)
            .finish()
    }
}

/// Live counters of a running restore.
#[derive(Debug, Default)]
pub struct RestoreProgress {
    /// Logical bytes of the image.
    pub total: AtomicU64,
    /// Logical bytes done (data written and zeros skipped).
    pub done: AtomicU64,
    /// Bytes fetched from the store.
    pub fetched: AtomicU64,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RestoreStats {
    pub logical_bytes: u64,
    pub data_bytes: u64,
    pub fetched_bytes: u64,
    /// Ranged reads issued (a measure of fragmentation).
    pub reads: u64,
    /// With `allow_damage`: the byte ranges that could not be read and were written as
    /// zeros, sorted and merged.
    pub damaged: Vec<DamagedRange>,
    /// Bytes of data taken from seeds instead of fetched.
    pub seeded_bytes: u64,
}

/// A range of the image a damaged restore filled with zeros, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DamagedRange {
    pub offset: u64,
    pub len: u64,
    pub reason: String,
}

/// Sorts ranges and merges those that touch or overlap (keeping the first reason).
fn merge_ranges(mut ranges: Vec<DamagedRange>) -> Vec<DamagedRange> {
    ranges.sort_by_key(|r| r.offset);
    let mut out: Vec<DamagedRange> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match out.last_mut() {
            Some(last) if r.offset <= last.offset + last.len => {
                last.len = last.len.max(r.offset + r.len - last.offset);
            }
            _ => out.push(r),
        }
    }
    out
}

#[derive(Debug, Clone)]
pub struct RestoreOptions {
    /// Ranged reads in flight.
    pub parallel_reads: usize,
    pub progress: Option<Arc<RestoreProgress>>,
    /// Replace an existing file, or overwrite a block device (see [`target`]).
    pub force: bool,
    /// Write everything readable and fill what is damaged or missing with zeros, listing
    /// those ranges in [`RestoreStats::damaged`], instead of failing at the first damage.
    pub allow_damage: bool,
    /// Local images to take chunks from instead of fetching them (not with `allow_damage`).
    pub seeds: crate::segment::Seeds,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        RestoreOptions {
            parallel_reads: 8,
            progress: None,
            force: false,
            allow_damage: false,
            seeds: Default::default(),
        }
    }
}

/// The output being written.
enum Sink {
    /// Regular file or device: positioned writes from many threads.
    File { file: Arc<File>, zeros_needed: bool },
    /// Stdout: every byte, in order.
    Stdout,
    /// A qcow2 image being written: positioned writes from many threads; with a base, an
    /// overlay that stores only the clusters that differ from it.
    Qcow2 {
        writer: Arc<Qcow2Writer>,
        base: Option<Arc<dyn cairn_image::DiskImage>>,
    },
}

/// Cluster size of qcow2 outputs: QEMU's default.
const QCOW2_CLUSTER_BITS: u32 = 16;

pub async fn restore(
    repo: Arc<Repo>,
    version: &VersionRecord,
    target: RestoreTarget,
    options: RestoreOptions,
) -> EngineResult<RestoreStats> {
    let progress = options.progress.clone().unwrap_or_default();
    progress
        .total
        .store(version.logical_size, Ordering::Relaxed);
    match target {
        RestoreTarget::Stdout => {
            run(
                repo,
                version,
                &Sink::Stdout,
                &options,
                &progress,
                Path::new("-"),
            )
            .await
        }
        RestoreTarget::Path(path) => {
            restore_to_path(repo, version, &path, None, &options, &progress).await
        }
        RestoreTarget::Qcow2(path) => {
            restore_to_path(repo, version, &path, Some(None), &options, &progress).await
        }
        RestoreTarget::Qcow2Overlay { path, base } => {
            if u64::from(version.segment_size) % (1 << QCOW2_CLUSTER_BITS) != 0 {
                return Err(EngineError::BadInput(format!(
                    "a qcow2 overlay needs segments of whole {}-byte clusters; {}@{} has \
                     {}-byte segments",
                    1 << QCOW2_CLUSTER_BITS,
                    version.image,
                    version.seq,
                    version.segment_size
                )));
            }
            restore_to_path(repo, version, &path, Some(Some(base)), &options, &progress).await
        }
    }
}

async fn restore_to_path(
    repo: Arc<Repo>,
    version: &VersionRecord,
    path: &Path,
    qcow2: Option<Option<QcowBase>>,
    options: &RestoreOptions,
    progress: &Arc<RestoreProgress>,
) -> EngineResult<RestoreStats> {
    let out_err = |op: &'static str, p: &Path, e: io::Error| EngineError::Output {
        op,
        path: p.to_path_buf(),
        source: e,
    };
    let removed = partial::remove_stale();
    if !removed.is_empty() {
        tracing::info!(
            files = removed.len(),
            "removed partial files of restores that were killed"
        );
    }
    let (target, replace) = match check_output(path, options.force, qcow2.is_some())? {
        OutputKind::Device { path: dev, file } => {
            return restore_to_device(repo, version, path, &dev, file, options, progress).await
        }
        OutputKind::New(p) => (p, false),
        OutputKind::Replace(p) => (p, true),
    };

    // A file: written under a temporary name next to it, synced, then put in place.
    let (partial, file) =
        Partial::create(&target).map_err(|e| out_err("cannot create a file next to", path, e))?;
    let tmp = partial.path.clone();
    let sink = if let Some(base) = qcow2 {
        Sink::Qcow2 {
            // Errors name the output the user asked for, not the hidden partial file.
            writer: Arc::new(Qcow2Writer::create_overlay(
                file,
                path,
                version.logical_size,
                QCOW2_CLUSTER_BITS,
                base.as_ref().map(|b| b.backing.clone()),
            )?),
            base: base.map(|b| b.image),
        }
    } else {
        file.set_len(version.logical_size)
            .map_err(|e| out_err("cannot size", path, e))?;
        Sink::File {
            file: Arc::new(file),
            zeros_needed: false,
        }
    };
    let stats = run(repo, version, &sink, options, progress, path).await?;
    match sink {
        Sink::File { file, .. } => file
            .sync_all()
            .map_err(|e| out_err("cannot sync", path, e))?,
        Sink::Qcow2 { writer, .. } => {
            let writer = Arc::into_inner(writer).ok_or_else(|| {
                EngineError::internal("qcow2 writer", "still in use after the restore")
            })?;
            writer.finish()?; // syncs
        }
        Sink::Stdout => unreachable!("a path restore has no stdout sink"),
    }
    // Stamped with the version's time before it appears under its name: a later write by
    // anyone moves the mtime to their now, which is how the CLI's provenance record tells
    // a file that still holds exactly this version (`cairn-cli/src/provenance.rs`).
    target::stamp_time(&tmp, version.time_ns)
        .map_err(|e| out_err("cannot set the modification time of", path, e))?;
    if replace {
        target::carry_identity(&target, &tmp).map_err(|e| {
            out_err(
                "cannot give the restored file the owner, mode and extended attributes of",
                path,
                e,
            )
        })?;
        std::fs::rename(&tmp, &target).map_err(|e| out_err("cannot rename into place", path, e))?;
    } else {
        // No-replace: a file that appeared at the target since the check is not clobbered.
        match std::fs::hard_link(&tmp, &target) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                return Err(out_err(
                    "will not restore to",
                    path,
                    io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        "a file appeared there during the restore; pass --force to replace it",
                    ),
                ))
            }
            Err(e) => return Err(out_err("cannot link into place", path, e)),
        }
        let _ = std::fs::remove_file(&tmp);
    }
    partial.keep();
    let dir = target
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(stats)
}

/// Restores onto a block device opened by [`check_output`]: every byte is written, zeros too.
async fn restore_to_device(
    repo: Arc<Repo>,
    version: &VersionRecord,
    shown: &Path,
    dev: &Path,
    file: File,
    options: &RestoreOptions,
    progress: &Arc<RestoreProgress>,
) -> EngineResult<RestoreStats> {
    let out_err = |op: &'static str, e: io::Error| EngineError::Output {
        op,
        path: shown.to_path_buf(),
        source: e,
    };
    let dev_size = {
        use cairn_image::DiskImage;
        cairn_image::RawImage::open(dev, Default::default())?.size()
    };
    if dev_size < version.logical_size {
        return Err(out_err(
            "cannot restore to",
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "device has {dev_size} bytes, the image needs {}",
                    version.logical_size
                ),
            ),
        ));
    }
    let sink = Sink::File {
        file: Arc::new(file),
        zeros_needed: true,
    };
    let stats = run(repo, version, &sink, options, progress, shown).await?;
    if let Sink::File { file, .. } = &sink {
        file.sync_all().map_err(|e| out_err("cannot sync", e))?;
    }
    Ok(stats)
}

/// The zeros in `[from, to)`: nothing for a sparse file or qcow2 (unwritten bytes read as
/// zeros), explicit zeros on a device and on stdout.
fn write_zeros(sink: &Sink, from: u64, to: u64, path: &Path) -> EngineResult<()> {
    if to <= from {
        return Ok(());
    }
    match sink {
        Sink::File {
            file,
            zeros_needed: true,
        } => write_zero_runs(file, &[(from, to - from)], path),
        Sink::File { .. } | Sink::Qcow2 { base: None, .. } => Ok(()),
        // Over a base, zeros must be said: the base may hold data there.
        Sink::Qcow2 {
            writer,
            base: Some(base),
        } => {
            let cluster = 1u64 << QCOW2_CLUSTER_BITS;
            let mut at = from;
            while at < to {
                let end = to.min(at - at % cluster + cluster);
                write_qcow2_overlay(writer, base.as_ref(), &vec![0; (end - at) as usize], at)?;
                at = end;
            }
            Ok(())
        }
        Sink::Stdout => {
            let zeros = vec![0u8; 1 << 20];
            let mut left = to - from;
            while left > 0 {
                let n = left.min(zeros.len() as u64) as usize;
                write_stdout(&zeros[..n])?;
                left -= n as u64;
            }
            Ok(())
        }
    }
}

/// Writes a chunk at `off`. On a sparse target, all-zero 4 KiB blocks inside the chunk are
/// skipped so the restored file is as sparse as the original (the file was sized up front,
/// so skipped blocks read as zeros).
fn write_file(f: &File, sparse: bool, data: &[u8], off: u64, path: &Path) -> EngineResult<()> {
    const BLOCK: usize = 4096;
    // Runs of data are written at most 16 KiB at a time. Measured on the CI machine (kernel
    // 6.18, ext4, a Firecracker VM): a format 2 restore writing whole 1 MiB runs spent 2x the
    // system time of one writing 16 KiB pieces (1.40-1.50 s against 0.65-0.72 s for su-5,
    // wall 1.6 s against 1.1 s), the page cache's large folios being the difference.
    const MAX_WRITE: usize = 16 << 10;
    let err = |e| EngineError::Output {
        op: "write error on",
        path: path.to_path_buf(),
        source: e,
    };
    if !sparse {
        return f.write_all_at(data, off).map_err(err);
    }
    let mut run_start: Option<usize> = None;
    let mut pos = 0;
    while pos < data.len() {
        let end = (pos + BLOCK).min(data.len());
        let zero = crate::chunker::is_zero(&data[pos..end]);
        match (zero, run_start) {
            (false, None) => run_start = Some(pos),
            (true, Some(s)) => {
                f.write_all_at(&data[s..pos], off + s as u64).map_err(err)?;
                run_start = None;
            }
            (false, Some(s)) if pos - s >= MAX_WRITE => {
                f.write_all_at(&data[s..pos], off + s as u64).map_err(err)?;
                run_start = Some(pos);
            }
            _ => {}
        }
        pos = end;
    }
    if let Some(s) = run_start {
        f.write_all_at(&data[s..], off + s as u64).map_err(err)?;
    }
    Ok(())
}

/// Writes a segment into a qcow2 overlay on `base`: a cluster where the segment's bytes are
/// the base's is left unallocated (it reads from the base), one of zeros gets the zero flag,
/// any other is written whole. `off` is cluster aligned (segments are whole clusters).
fn write_qcow2_overlay(
    writer: &Qcow2Writer,
    base: &dyn cairn_image::DiskImage,
    data: &[u8],
    off: u64,
) -> EngineResult<()> {
    let cluster = 1usize << QCOW2_CLUSTER_BITS;
    let mut held = vec![0u8; data.len()];
    let have = base.size().saturating_sub(off).min(data.len() as u64) as usize;
    if have > 0 {
        base.read_at(&mut held[..have], off)?;
    }
    for (i, (want, was)) in data.chunks(cluster).zip(held.chunks(cluster)).enumerate() {
        let at = off + (i * cluster) as u64;
        if want == was {
            continue;
        }
        match crate::chunker::is_zero(want) {
            true => writer.zero_cluster(at)?,
            false => writer.write_whole(want, at)?,
        }
    }
    Ok(())
}

/// Writes a chunk into a qcow2 output, cluster piece by cluster piece, skipping all-zero
/// pieces: every guest byte is written at most once and unwritten bytes read as zeros, so a
/// cluster holding only zeros is never allocated.
fn write_qcow2(writer: &Qcow2Writer, data: &[u8], off: u64) -> EngineResult<()> {
    let cluster = 1u64 << QCOW2_CLUSTER_BITS;
    let mut pos = 0usize;
    while pos < data.len() {
        let at = off + pos as u64;
        let end = (pos as u64 + cluster - at % cluster).min(data.len() as u64) as usize;
        let piece = &data[pos..end];
        if !crate::chunker::is_zero(piece) {
            writer.write_at(piece, at)?;
        }
        pos = end;
    }
    Ok(())
}

/// Starts writing `[from, to)` of `file` back to its disk without waiting for it, so that the
/// sync that ends a restore finds little left: the disk works while the next segments are
/// decoded (a 1 GiB restore's final fsync took 0.34 s of its 1.1 s without this). A hint: a
/// failure here is met again, and reported, by that sync.
fn start_writeback(file: &File, from: u64, to: u64) {
    use std::os::unix::io::AsRawFd;
    let (Ok(off), Ok(n)) = (
        libc::off64_t::try_from(from),
        libc::off64_t::try_from(to.saturating_sub(from)),
    ) else {
        return;
    };
    // SAFETY: `file` owns a valid descriptor for the whole call; sync_file_range takes no
    // pointer.
    let rc =
        unsafe { libc::sync_file_range(file.as_raw_fd(), off, n, libc::SYNC_FILE_RANGE_WRITE) };
    if rc != 0 {
        tracing::debug!(
            "sync_file_range: {} (left to the final sync)",
            io::Error::last_os_error()
        );
    }
}

fn write_zero_runs(file: &File, runs: &[(u64, u64)], path: &Path) -> EngineResult<()> {
    let zeros = vec![0u8; 1 << 20];
    for &(mut off, mut len) in runs {
        while len > 0 {
            let n = len.min(zeros.len() as u64) as usize;
            file.write_all_at(&zeros[..n], off)
                .map_err(|e| EngineError::Output {
                    op: "write error on",
                    path: path.to_path_buf(),
                    source: e,
                })?;
            off += n as u64;
            len -= n as u64;
        }
    }
    Ok(())
}

fn write_stdout(data: &[u8]) -> EngineResult<()> {
    let mut out = io::stdout().lock();
    out.write_all(data)
        .and_then(|()| out.flush())
        .map_err(|e| EngineError::Output {
            op: "write error on",
            path: PathBuf::from("stdout"),
            source: e,
        })
}

//! Restore: write a version out, bit-exact.
//!
//! The manifest is walked in batches of leaves. For each batch, the chunks are grouped by
//! pack and nearby blobs are coalesced into one ranged read; ranges are fetched in parallel,
//! decoded and verified against their ids on blocking threads, and written at their offsets
//! (out of order) with `pwrite`. Zero runs are never written to a regular file: it is sized
//! first, so they stay holes. A block device gets explicit zeros; stdout gets every byte,
//! in order, one batch at a time.
//!
//! A qcow2 output (`RestoreTarget::Qcow2`) takes the same positioned writes through
//! [`Qcow2Writer`]: clusters are allocated as data arrives, all-zero pieces are skipped, so
//! clusters without data stay unallocated, and the metadata is written at the end.
//!
//! A regular-file output (raw or qcow2) is written under a temporary name and renamed into
//! place only once complete and synced, so a failed restore never leaves a plausible-looking
//! partial image.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cairn_format::node::{Extent, Leaf};
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_image::qcow2::Qcow2Writer;
use cairn_repo::{BlobLocation, Repo};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::error::{EngineError, EngineResult};
use crate::tree::{for_each_leaf_batch, AsyncLeafVisitor};

/// Where to restore to.
#[derive(Debug, Clone)]
pub enum RestoreTarget {
    /// A regular file (created or replaced) or an existing block device, raw.
    Path(PathBuf),
    /// A compact qcow2 v3 file (created or replaced): clusters without data stay
    /// unallocated.
    Qcow2(PathBuf),
    /// Standard output, in order.
    Stdout,
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

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RestoreStats {
    pub logical_bytes: u64,
    pub data_bytes: u64,
    pub fetched_bytes: u64,
    /// Ranged reads issued (a measure of fragmentation).
    pub reads: u64,
}

#[derive(Debug, Clone)]
pub struct RestoreOptions {
    /// Ranged reads in flight.
    pub parallel_reads: usize,
    /// Blobs closer than this in one pack are fetched in one read (default: the store's
    /// hint — small on a local disk, megabytes on S3).
    pub coalesce_gap: Option<u64>,
    /// Upper bound of one coalesced read.
    pub max_read: u64,
    pub progress: Option<Arc<RestoreProgress>>,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        RestoreOptions {
            parallel_reads: 8,
            coalesce_gap: None,
            max_read: 16 * 1024 * 1024,
            progress: None,
        }
    }
}

/// The output being written.
enum Sink {
    /// Regular file or device: positioned writes from many threads.
    File { file: Arc<File>, zeros_needed: bool },
    /// Stdout: the current batch is assembled in memory, then written in order.
    Stdout { batch: Arc<Mutex<Vec<u8>>> },
    /// A qcow2 image being written: positioned writes from many threads.
    Qcow2 { writer: Arc<Qcow2Writer> },
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
            let sink = Sink::Stdout {
                batch: Arc::new(Mutex::new(Vec::new())),
            };
            run(repo, version, &sink, &options, &progress, Path::new("-")).await
        }
        RestoreTarget::Path(path) => {
            restore_to_path(repo, version, &path, false, &options, &progress).await
        }
        RestoreTarget::Qcow2(path) => {
            restore_to_path(repo, version, &path, true, &options, &progress).await
        }
    }
}

async fn restore_to_path(
    repo: Arc<Repo>,
    version: &VersionRecord,
    path: &Path,
    qcow2: bool,
    options: &RestoreOptions,
    progress: &Arc<RestoreProgress>,
) -> EngineResult<RestoreStats> {
    let out_err = |op: &'static str, p: &Path, e: io::Error| EngineError::Output {
        op,
        path: p.to_path_buf(),
        source: e,
    };
    let is_device = std::fs::metadata(path)
        .map(|m| m.file_type().is_block_device())
        .unwrap_or(false);
    if is_device && qcow2 {
        return Err(out_err(
            "cannot restore to",
            path,
            io::Error::new(
                io::ErrorKind::InvalidInput,
                "a block device takes raw output, not --format qcow2",
            ),
        ));
    }
    if is_device {
        let file = OpenOptions::new()
            .write(true)
            .open(path)
            .map_err(|e| out_err("cannot open", path, e))?;
        let dev_size = {
            use cairn_image::DiskImage;
            cairn_image::RawImage::open(path, Default::default())?.size()
        };
        if dev_size < version.logical_size {
            return Err(out_err(
                "cannot restore to",
                path,
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
        let stats = run(repo, version, &sink, options, progress, path).await?;
        if let Sink::File { file, .. } = &sink {
            file.sync_all()
                .map_err(|e| out_err("cannot sync", path, e))?;
        }
        return Ok(stats);
    }

    // Regular file: write a temporary sibling, then rename over the target.
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path.file_name().ok_or_else(|| {
        out_err(
            "cannot restore to",
            path,
            io::ErrorKind::InvalidInput.into(),
        )
    })?;
    let tmp = dir.join(format!(
        ".{}.cairn-partial-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let file = OpenOptions::new()
        .write(true)
        .read(true)
        .create(true)
        .truncate(true)
        .open(&tmp)
        .map_err(|e| out_err("cannot create", &tmp, e))?;
    let result = async {
        let sink = if qcow2 {
            Sink::Qcow2 {
                writer: Arc::new(Qcow2Writer::create(
                    file,
                    &tmp,
                    version.logical_size,
                    QCOW2_CLUSTER_BITS,
                )?),
            }
        } else {
            file.set_len(version.logical_size)
                .map_err(|e| out_err("cannot size", &tmp, e))?;
            Sink::File {
                file: Arc::new(file),
                zeros_needed: false,
            }
        };
        let stats = run(repo, version, &sink, options, progress, path).await?;
        match sink {
            Sink::File { file, .. } => file
                .sync_all()
                .map_err(|e| out_err("cannot sync", &tmp, e))?,
            Sink::Qcow2 { writer } => {
                let writer = Arc::into_inner(writer).ok_or_else(|| {
                    EngineError::Pipeline("qcow2 writer still in use after the restore".into())
                })?;
                writer.finish()?; // syncs
            }
            Sink::Stdout { .. } => unreachable!("a path restore has no stdout sink"),
        }
        std::fs::rename(&tmp, path).map_err(|e| out_err("cannot rename into place", path, e))?;
        if let Ok(d) = File::open(dir) {
            let _ = d.sync_all();
        }
        Ok(stats)
    }
    .await;
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

async fn run(
    repo: Arc<Repo>,
    version: &VersionRecord,
    sink: &Sink,
    options: &RestoreOptions,
    progress: &Arc<RestoreProgress>,
    path: &Path,
) -> EngineResult<RestoreStats> {
    let mut writer = BatchWriter {
        repo: repo.clone(),
        version,
        sink,
        options,
        coalesce_gap: options
            .coalesce_gap
            .unwrap_or(repo.store().hints().read_gap),
        progress: progress.clone(),
        path,
        written_to: 0,
        stats: RestoreStats {
            logical_bytes: version.logical_size,
            ..Default::default()
        },
    };
    for_each_leaf_batch(&repo, version, &mut writer).await?;
    writer.finish_zeros(version.logical_size).await?;
    progress.done.store(version.logical_size, Ordering::Relaxed);
    Ok(writer.stats)
}

struct BatchWriter<'a> {
    repo: Arc<Repo>,
    version: &'a VersionRecord,
    sink: &'a Sink,
    options: &'a RestoreOptions,
    /// Blobs closer than this in one pack share a read.
    coalesce_gap: u64,
    progress: Arc<RestoreProgress>,
    path: &'a Path,
    /// Everything before this offset has been written (stdout) or handled.
    written_to: u64,
    stats: RestoreStats,
}

/// One coalesced read: a byte range of a pack and the blobs inside it.
struct Read {
    pack: Id,
    start: u64,
    end: u64,
    blobs: Vec<BlobLocation>,
}

impl AsyncLeafVisitor for &mut BatchWriter<'_> {
    async fn visit(&mut self, batch: Vec<(u64, Leaf)>) -> EngineResult<()> {
        // Stdout assembles each part in memory, so its parts stay small; files and devices
        // take the whole batch at once (fewer pauses between parallel rounds).
        let part_len = match self.sink {
            Sink::Stdout { .. } => 32,
            Sink::File { .. } | Sink::Qcow2 { .. } => batch.len().max(1),
        };
        for part in batch.chunks(part_len) {
            self.visit_part(part).await?;
        }
        Ok(())
    }
}

impl BatchWriter<'_> {
    async fn visit_part(&mut self, part: &[(u64, Leaf)]) -> EngineResult<()> {
        let seg_size = self.version.segment_size as u64;
        let first = part[0].0 * seg_size;
        let last = ((part[part.len() - 1].0 + 1) * seg_size).min(self.version.logical_size);
        // Zeros between the previous batch and this one.
        self.finish_zeros(first).await?;

        // Where each chunk goes, and which zero runs a device needs.
        let mut places: HashMap<Id, Vec<(u64, u32)>> = HashMap::new();
        let mut zeros: Vec<(u64, u64)> = Vec::new();
        let mut next = first;
        for (seg, leaf) in part {
            let mut off = seg * seg_size;
            // Segments absent from the tree inside this batch are zeros too.
            if off > next {
                zeros.push((next, off - next));
            }
            next = ((seg + 1) * seg_size).min(self.version.logical_size);
            for e in &leaf.extents {
                match *e {
                    Extent::Zero { len } => zeros.push((off, len as u64)),
                    Extent::Chunk { id, len } => places.entry(id).or_default().push((off, len)),
                }
                off += e.len() as u64;
            }
            if leaf.len() != (seg_size).min(self.version.logical_size - seg * seg_size) {
                return Err(EngineError::Pipeline(format!(
                    "manifest leaf of segment {seg} covers {} bytes, expected {}",
                    leaf.len(),
                    seg_size.min(self.version.logical_size - seg * seg_size)
                )));
            }
        }

        let reads = self.plan_reads(&places)?;
        self.stats.reads += reads.len() as u64;
        if let Sink::Stdout { batch } = self.sink {
            let mut b = batch.lock().expect("batch lock");
            b.clear();
            b.resize((last - first) as usize, 0);
        }
        let places = Arc::new(places);
        let limit = Arc::new(Semaphore::new(self.options.parallel_reads.max(1)));
        let mut tasks = JoinSet::new();
        for read in reads {
            let permit = limit.clone().acquire_owned().await.expect("semaphore open");
            let (repo, places, progress) =
                (self.repo.clone(), places.clone(), self.progress.clone());
            let sink = match self.sink {
                Sink::File { file, zeros_needed } => SinkRef::File(file.clone(), !zeros_needed),
                Sink::Stdout { batch } => SinkRef::Buffer(batch.clone(), first),
                Sink::Qcow2 { writer } => SinkRef::Qcow2(writer.clone()),
            };
            let path = self.path.to_path_buf();
            tasks.spawn(async move {
                let bytes = repo.read_pack_range(&read.pack, read.start..read.end).await;
                let bytes = match bytes {
                    Ok(b) => b,
                    Err(e) => return Err(EngineError::from(missing_pack_context(e, &read))),
                };
                progress
                    .fetched
                    .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                let n = bytes.len() as u64;
                let written = tokio::task::spawn_blocking(move || {
                    write_blobs(&read, &bytes, &places, &sink, &path)
                })
                .await
                .map_err(|e| EngineError::Pipeline(format!("restore writer: {e}")))??;
                drop(permit);
                Ok::<_, EngineError>((n, written))
            });
            // Surface errors early rather than after the whole batch.
            while let Some(done) = tasks.try_join_next() {
                self.account(done)?;
            }
        }
        while let Some(done) = tasks.join_next().await {
            self.account(done)?;
        }

        if let Sink::File {
            file,
            zeros_needed: true,
        } = self.sink
        {
            write_zero_runs(file, &zeros, self.path)?;
        }
        if let Sink::Stdout { batch } = self.sink {
            let b = std::mem::take(&mut *batch.lock().expect("batch lock"));
            write_stdout(&b)?;
        }
        self.written_to = last;
        self.progress.done.store(last, Ordering::Relaxed);
        Ok(())
    }

    fn account(
        &mut self,
        done: Result<EngineResult<(u64, u64)>, tokio::task::JoinError>,
    ) -> EngineResult<()> {
        let (fetched, data) =
            done.map_err(|e| EngineError::Pipeline(format!("restore task: {e}")))??;
        self.stats.fetched_bytes += fetched;
        self.stats.data_bytes += data;
        Ok(())
    }

    /// Groups the batch's blobs by pack and coalesces neighbours into ranged reads.
    fn plan_reads(&self, places: &HashMap<Id, Vec<(u64, u32)>>) -> EngineResult<Vec<Read>> {
        let mut locs = Vec::with_capacity(places.len());
        for id in places.keys() {
            locs.push(self.repo.locate(id)?);
        }
        locs.sort_by_key(|l| (l.pack, l.entry.offset));
        let mut reads: Vec<Read> = Vec::new();
        for loc in locs {
            let r = loc.entry.range();
            match reads.last_mut() {
                Some(cur)
                    if cur.pack == loc.pack
                        && r.start <= cur.end + self.coalesce_gap
                        && r.end - cur.start <= self.options.max_read =>
                {
                    cur.end = cur.end.max(r.end);
                    cur.blobs.push(loc);
                }
                _ => reads.push(Read {
                    pack: loc.pack,
                    start: r.start,
                    end: r.end,
                    blobs: vec![loc],
                }),
            }
        }
        Ok(reads)
    }

    /// Handles the zeros in `[written_to, upto)`: nothing for a sparse file, explicit zeros
    /// for a device, zero bytes on stdout.
    async fn finish_zeros(&mut self, upto: u64) -> EngineResult<()> {
        if upto <= self.written_to {
            return Ok(());
        }
        match self.sink {
            Sink::File {
                file,
                zeros_needed: true,
            } => write_zero_runs(
                file,
                &[(self.written_to, upto - self.written_to)],
                self.path,
            )?,
            Sink::File { .. } | Sink::Qcow2 { .. } => {}
            Sink::Stdout { .. } => {
                let zeros = vec![0u8; 1 << 20];
                let mut left = upto - self.written_to;
                while left > 0 {
                    let n = left.min(zeros.len() as u64) as usize;
                    write_stdout(&zeros[..n])?;
                    left -= n as u64;
                }
            }
        }
        self.written_to = upto;
        self.progress.done.store(upto, Ordering::Relaxed);
        Ok(())
    }
}

enum SinkRef {
    /// The file, and whether zero blocks may be left as holes.
    File(Arc<File>, bool),
    /// The batch buffer and the logical offset of its first byte.
    Buffer(Arc<Mutex<Vec<u8>>>, u64),
    Qcow2(Arc<Qcow2Writer>),
}

fn missing_pack_context(e: cairn_repo::RepoError, read: &Read) -> cairn_repo::RepoError {
    use cairn_repo::RepoError;
    use cairn_store::StoreError;
    match e {
        RepoError::Store(StoreError::NotFound { .. }) => RepoError::PackMissing {
            pack: read.pack,
            id: read.blobs[0].entry.id,
        },
        RepoError::Store(StoreError::RangeOutOfBounds { .. }) => RepoError::BadBlob {
            id: read.blobs[0].entry.id,
            pack: read.pack,
            offset: read.blobs[0].entry.offset,
            source: cairn_format::FormatError::invalid("blob", "pack is truncated"),
        },
        other => other,
    }
}

/// Decodes and verifies every blob of one read and writes it wherever the batch uses it.
/// Returns the plain bytes written.
fn write_blobs(
    read: &Read,
    bytes: &[u8],
    places: &HashMap<Id, Vec<(u64, u32)>>,
    sink: &SinkRef,
    path: &Path,
) -> EngineResult<u64> {
    let mut written = 0;
    for loc in &read.blobs {
        let r = loc.entry.range();
        let stored = &bytes[(r.start - read.start) as usize..(r.end - read.start) as usize];
        let plain = Repo::decode_blob(loc, stored)?;
        for &(off, len) in &places[&loc.entry.id] {
            if len as usize != plain.len() {
                return Err(EngineError::Pipeline(format!(
                    "chunk {} has {} bytes but the manifest says {len}",
                    loc.entry.id,
                    plain.len()
                )));
            }
            match sink {
                SinkRef::File(f, sparse) => write_file(f, *sparse, &plain, off, path)?,
                SinkRef::Buffer(buf, base) => {
                    let start = (off - base) as usize;
                    buf.lock().expect("batch lock")[start..start + plain.len()]
                        .copy_from_slice(&plain);
                }
                SinkRef::Qcow2(writer) => write_qcow2(writer, &plain, off)?,
            }
            written += len as u64;
        }
    }
    Ok(written)
}

/// Writes a chunk at `off`. On a sparse target, all-zero 4 KiB blocks inside the chunk are
/// skipped so the restored file is as sparse as the original (the file was sized up front,
/// so skipped blocks read as zeros).
fn write_file(f: &File, sparse: bool, data: &[u8], off: u64, path: &Path) -> EngineResult<()> {
    const BLOCK: usize = 4096;
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
            _ => {}
        }
        pos = end;
    }
    if let Some(s) = run_start {
        f.write_all_at(&data[s..], off + s as u64).map_err(err)?;
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

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
//! A regular-file output (raw or qcow2) is written under a temporary name and put into place
//! only once complete and synced, so a failed restore never leaves a plausible-looking
//! partial image ([`partial`]). What may be written at all — never an existing file without
//! `force`, never a mounted device, never a FIFO — is decided first ([`target`]).

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
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
use crate::tree::{for_each_leaf_batch, for_each_readable_leaf_batch, AsyncLeafVisitor};

mod grouped;
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
    /// Blobs closer than this in one pack are fetched in one read (default: the store's
    /// hint — small on a local disk, megabytes on S3).
    pub coalesce_gap: Option<u64>,
    /// Upper bound of one coalesced read.
    pub max_read: u64,
    pub progress: Option<Arc<RestoreProgress>>,
    /// Replace an existing file, or overwrite a block device (see [`target`]).
    pub force: bool,
    /// Write everything readable and fill what is damaged or missing with zeros, listing
    /// those ranges in [`RestoreStats::damaged`], instead of failing at the first damage.
    pub allow_damage: bool,
}

impl Default for RestoreOptions {
    fn default() -> Self {
        RestoreOptions {
            parallel_reads: 8,
            coalesce_gap: None,
            max_read: 16 * 1024 * 1024,
            progress: None,
            force: false,
            allow_damage: false,
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
    let removed = partial::remove_stale();
    if !removed.is_empty() {
        tracing::info!(
            files = removed.len(),
            "removed partial files of restores that were killed"
        );
    }
    let (target, replace) = match check_output(path, options.force, qcow2)? {
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
    let sink = if qcow2 {
        Sink::Qcow2 {
            // Errors name the output the user asked for, not the hidden partial file.
            writer: Arc::new(Qcow2Writer::create(
                file,
                path,
                version.logical_size,
                QCOW2_CLUSTER_BITS,
            )?),
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
        Sink::Qcow2 { writer } => {
            let writer = Arc::into_inner(writer).ok_or_else(|| {
                EngineError::internal("qcow2 writer", "still in use after the restore")
            })?;
            writer.finish()?; // syncs
        }
        Sink::Stdout { .. } => unreachable!("a path restore has no stdout sink"),
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

async fn run(
    repo: Arc<Repo>,
    version: &VersionRecord,
    sink: &Sink,
    options: &RestoreOptions,
    progress: &Arc<RestoreProgress>,
    path: &Path,
) -> EngineResult<RestoreStats> {
    if repo.v2().is_some() {
        return grouped::run_grouped(&repo, version, sink, options, progress, path).await;
    }
    let mut writer = BatchWriter {
        repo: repo.clone(),
        version,
        sink,
        options,
        coalesce_gap: options.coalesce_gap.unwrap_or(repo.store_hints().read_gap),
        progress: progress.clone(),
        path,
        written_to: 0,
        stats: RestoreStats {
            logical_bytes: version.logical_size,
            ..Default::default()
        },
        damaged: Vec::new(),
    };
    if options.allow_damage {
        let mut skipped = Vec::new();
        for_each_readable_leaf_batch(&repo, version, &mut writer, &mut skipped).await?;
        let seg = version.segment_size as u64;
        for (first, count, reason) in skipped {
            let offset = first.saturating_mul(seg).min(version.logical_size);
            let end = first
                .saturating_add(count)
                .saturating_mul(seg)
                .min(version.logical_size);
            if end > offset {
                writer.damaged.push(DamagedRange {
                    offset,
                    len: end - offset,
                    reason,
                });
            }
        }
    } else {
        for_each_leaf_batch(&repo, version, &mut writer).await?;
    }
    writer.finish_zeros(version.logical_size).await?;
    progress.done.store(version.logical_size, Ordering::Relaxed);
    writer.stats.damaged = merge_ranges(std::mem::take(&mut writer.damaged));
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
    /// Damaged ranges found so far (with `allow_damage`).
    damaged: Vec<DamagedRange>,
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
        crate::interrupt::check()?;
        let seg_size = self.version.segment_size as u64;
        let first = part[0].0 * seg_size;
        let last = ((part[part.len() - 1].0 + 1) * seg_size).min(self.version.logical_size);
        // Zeros between the previous batch and this one.
        self.finish_zeros(first).await?;

        // Where each chunk goes, which zero runs a device needs, and what is damaged.
        let mut part_damage: Vec<DamagedRange> = Vec::new();
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
            let expected = seg_size.min(self.version.logical_size - seg * seg_size);
            if leaf.len() != expected {
                let reason = format!(
                    "manifest leaf of segment {seg} covers {} bytes, expected {expected}",
                    leaf.len()
                );
                if !self.options.allow_damage {
                    return Err(EngineError::Manifest(reason));
                }
                // Its chunks are not placed: the whole segment counts as damaged.
                for v in places.values_mut() {
                    v.retain(|&(off, _)| off < seg * seg_size || off >= seg * seg_size + expected);
                }
                places.retain(|_, v| !v.is_empty());
                zeros.retain(|&(off, _)| off < seg * seg_size || off >= seg * seg_size + expected);
                part_damage.push(DamagedRange {
                    offset: seg * seg_size,
                    len: expected,
                    reason,
                });
            }
        }

        let reads = self.plan_reads(&places, &mut part_damage)?;
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
            let tolerant = self.options.allow_damage;
            tasks.spawn(async move {
                let bytes = repo.read_pack_range(&read.pack, read.start..read.end).await;
                let bytes = match bytes {
                    Ok(b) => b,
                    Err(e) => {
                        let e = missing_pack_context(e, &read);
                        if !(tolerant && e.is_damage()) {
                            return Err(EngineError::from(
                                repo.quarantine_if_damaged(e, &read.blobs[0]),
                            ));
                        }
                        // Every blob of the read is lost: zeros where each one goes.
                        let reason = e.to_string();
                        let mut damaged = Vec::new();
                        for loc in &read.blobs {
                            repo.quarantine(loc, &reason);
                            damaged.extend(places[&loc.entry.id].iter().map(|&(off, len)| {
                                DamagedRange {
                                    offset: off,
                                    len: len as u64,
                                    reason: reason.clone(),
                                }
                            }));
                        }
                        drop(permit);
                        return Ok((0, 0, damaged));
                    }
                };
                progress
                    .fetched
                    .fetch_add(bytes.len() as u64, Ordering::Relaxed);
                let n = bytes.len() as u64;
                let (written, damaged) = tokio::task::spawn_blocking(move || {
                    write_blobs(&repo, &read, &bytes, &places, &sink, &path, tolerant)
                })
                .await
                .map_err(|e| EngineError::internal("restore writer", e))??;
                drop(permit);
                Ok::<_, EngineError>((n, written, damaged))
            });
            // Surface errors early rather than after the whole batch.
            while let Some(done) = tasks.try_join_next() {
                self.account(done, &mut part_damage)?;
            }
        }
        while let Some(done) = tasks.join_next().await {
            self.account(done, &mut part_damage)?;
        }

        if let Sink::File {
            file,
            zeros_needed: true,
        } = self.sink
        {
            // A device held other data there: damaged ranges are written as zeros too.
            zeros.extend(part_damage.iter().map(|d| (d.offset, d.len)));
            write_zero_runs(file, &zeros, self.path)?;
        }
        self.damaged.append(&mut part_damage);
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
        done: Result<ReadOutcome, tokio::task::JoinError>,
        damaged: &mut Vec<DamagedRange>,
    ) -> EngineResult<()> {
        let (fetched, data, mut lost) =
            done.map_err(|e| EngineError::internal("restore task", e))??;
        self.stats.fetched_bytes += fetched;
        self.stats.data_bytes += data;
        // The bar moves with every read, not only at the end of a batch: the batch's data
        // lies in [written_to, last), so `done` stays below the `last` stored at its end.
        self.progress.done.fetch_add(data, Ordering::Relaxed);
        damaged.append(&mut lost);
        Ok(())
    }

    /// Groups the batch's blobs by pack and coalesces neighbours into ranged reads. With
    /// `allow_damage`, a chunk no index locates is added to `damaged` instead of failing.
    fn plan_reads(
        &self,
        places: &HashMap<Id, Vec<(u64, u32)>>,
        damaged: &mut Vec<DamagedRange>,
    ) -> EngineResult<Vec<Read>> {
        let mut locs = Vec::with_capacity(places.len());
        for (id, at) in places {
            match self.repo.locate(id) {
                Ok(loc) => locs.push(loc),
                Err(e) if self.options.allow_damage && e.is_damage() => {
                    let reason = e.to_string();
                    damaged.extend(at.iter().map(|&(offset, len)| DamagedRange {
                        offset,
                        len: len as u64,
                        reason: reason.clone(),
                    }));
                }
                Err(e) => return Err(e.into()),
            }
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
        write_zeros(self.sink, self.written_to, upto, self.path)?;
        self.written_to = upto;
        self.progress.done.store(upto, Ordering::Relaxed);
        Ok(())
    }
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
        Sink::File { .. } | Sink::Qcow2 { .. } => Ok(()),
        Sink::Stdout { .. } => {
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

/// What one read task did: bytes fetched, plain bytes written, ranges lost to damage.
type ReadOutcome = EngineResult<(u64, u64, Vec<DamagedRange>)>;

/// Decodes and verifies every blob of one read and writes it wherever the batch uses it.
/// A blob that fails its check is quarantined; with `tolerant` its places are returned as
/// damaged (left as zeros) instead of failing the restore. Returns the plain bytes written.
fn write_blobs(
    repo: &Repo,
    read: &Read,
    bytes: &[u8],
    places: &HashMap<Id, Vec<(u64, u32)>>,
    sink: &SinkRef,
    path: &Path,
    tolerant: bool,
) -> EngineResult<(u64, Vec<DamagedRange>)> {
    let mut written = 0;
    let mut damaged = Vec::new();
    for loc in &read.blobs {
        let r = loc.entry.range();
        let stored = &bytes[(r.start - read.start) as usize..(r.end - read.start) as usize];
        let plain =
            match repo.check_blob(loc, stored) {
                Ok(plain) => plain,
                Err(e) if tolerant => {
                    let reason = e.to_string();
                    damaged.extend(places[&loc.entry.id].iter().map(|&(offset, len)| {
                        DamagedRange {
                            offset,
                            len: len as u64,
                            reason: reason.clone(),
                        }
                    }));
                    continue;
                }
                Err(e) => return Err(e.into()),
            };
        for &(off, len) in &places[&loc.entry.id] {
            if len as usize != plain.len() {
                let reason = format!(
                    "chunk {} has {} bytes but the manifest says {len}",
                    loc.entry.id,
                    plain.len()
                );
                if !tolerant {
                    return Err(EngineError::Manifest(reason));
                }
                damaged.push(DamagedRange {
                    offset: off,
                    len: len as u64,
                    reason,
                });
                continue;
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
    Ok((written, damaged))
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

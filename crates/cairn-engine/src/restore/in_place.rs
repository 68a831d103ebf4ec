//! In-place restore: turn an existing raw image file or block device into a version by
//! writing only what differs (CloudVS's in-place restore, §3.3).
//!
//! What differs is found one of two ways:
//!
//! - **By diff.** The caller knows which version TARGET holds unchanged
//!   ([`InPlaceOptions::holds`]: the CLI's provenance records). The two trees are compared
//!   (`diff.rs`, O(changes)); TARGET is not read, and only the segments of V under a changed
//!   range are fetched; their bytes inside the ranges are written.
//! - **By compare.** Every segment of TARGET is read and hashed with the repository's id
//!   hash, and the hash compared with the segment digest V's level-1 nodes carry for its leaf
//!   (format 2). A match is skipped; a mismatch fetches V's segment and writes only its 4 KiB
//!   blocks that differ. A segment whose leaf has no digest (format 1, older leaves) is
//!   fetched and compared block by block; a segment V does not store (zeros) is zeroed where
//!   TARGET is not zeros already.
//!
//! Zeros are holes punched into a regular file (it stays sparse) and written zeros on a
//! device. TARGET is written where it is, so its owner, mode, labels and inode stay; a
//! regular file is held with an OFD write lock over its whole length meanwhile (QEMU, which
//! locks the same way, refuses to open it), a device is opened `O_EXCL` (refused while
//! mounted or in use). At the end TARGET is synced, and a regular file is stamped with V's
//! time, as a full restore's file is.
//!
//! An interrupted in-place restore leaves TARGET torn, part V and part what it held. The
//! caller keeps a marker for that (the CLI's `provenance.rs`), so TARGET is never taken for
//! either version; running the restore again compares by hash and finishes the job.

use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use cairn_format::version::VersionRecord;
use cairn_repo::Repo;

use super::target::{loop_device_backed_by, open_device_exclusive, refuse};
use super::window::Fetched;
use super::RestoreProgress;
use crate::chunker::is_zero;
use crate::error::{EngineError, EngineResult};
use crate::segment::{patch_segments, read_segments, PatchInput};
use crate::tree::{leaf_refs, TreeLeaf};

/// The unit compared and written: a page, what file systems and guests write.
const BLOCK: usize = 4096;
/// Runs of data written in one call at most (as a full restore writes them; see
/// `restore::write_file`).
const MAX_WRITE: usize = 16 << 10;
/// Segments handled together: their V bytes are fetched in one batch of reads.
const SEGMENTS_PER_BATCH: usize = 4;

/// How to restore in place.
#[derive(Debug, Clone)]
pub struct InPlaceOptions {
    /// The version TARGET is known to hold unchanged, if any: what differs then comes from
    /// the two trees, and TARGET is not read.
    pub holds: Option<VersionRecord>,
    /// Batches of segments in flight.
    pub parallel_reads: usize,
    pub progress: Option<Arc<RestoreProgress>>,
}

impl Default for InPlaceOptions {
    fn default() -> Self {
        InPlaceOptions {
            holds: None,
            parallel_reads: 8,
            progress: None,
        }
    }
}

/// How an in-place restore found what differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InPlaceMethod {
    /// From the trees of the version TARGET held and of the one restored.
    Diff,
    /// By reading TARGET and comparing it with the version.
    Compare,
}

impl InPlaceMethod {
    pub fn as_str(self) -> &'static str {
        match self {
            InPlaceMethod::Diff => "diff",
            InPlaceMethod::Compare => "compare",
        }
    }
}

/// What an in-place restore did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InPlaceStats {
    pub method: InPlaceMethod,
    pub logical_bytes: u64,
    /// TARGET's size before, when it was resized.
    pub resized_from: Option<u64>,
    /// Bytes of TARGET read to compare them.
    pub target_read_bytes: u64,
    /// Segments left alone because TARGET already held them (by digest or as zeros).
    pub segments_unchanged: u64,
    /// Bytes of data written.
    pub written_bytes: u64,
    /// Bytes made zero (holes punched in a file, zeros written on a device).
    pub zeroed_bytes: u64,
    /// Bytes fetched from the store, and the ranged reads that fetched them.
    pub fetched_bytes: u64,
    pub reads: u64,
}

/// One segment to bring to V.
#[derive(Debug, Clone)]
struct Work {
    index: u64,
    /// Where the segment starts in the image.
    offset: u64,
    /// V's leaf of the segment (`None`: V holds zeros there).
    leaf: Option<TreeLeaf>,
    /// The byte ranges (within the segment) known to differ; `None`: compare the segment.
    ranges: Option<Vec<(usize, usize)>>,
}

/// TARGET, opened and checked for an in-place restore, not yet written: the caller puts
/// its marker in place between [`InPlaceTarget::open`] and [`restore_in_place`].
#[derive(Debug)]
pub struct InPlaceTarget {
    path: PathBuf,
    file: File,
    /// A regular file (holes can be punched, its time stamped), not a device.
    regular: bool,
    /// The file's size, when it is to be resized to the version's.
    resize_from: Option<u64>,
}

impl InPlaceTarget {
    /// Opens the file or block device at `path` for an in-place restore of `version`,
    /// refusing what must not be written: a missing path, anything but a regular file or a
    /// block device, a file another process locks (a VM) or a loop device is backed by, a
    /// device that is mounted or in use, one of the wrong size (a file: unless `resize`), a
    /// qcow2 file (unless `known`: the caller knows it holds a version as it is).
    pub fn open(
        path: &Path,
        version: &VersionRecord,
        resize: bool,
        known: bool,
    ) -> EngineResult<InPlaceTarget> {
        open_target(path, version, resize, known)
    }

    /// Whether TARGET is a regular file (not a block device).
    pub fn is_regular_file(&self) -> bool {
        self.regular
    }
}

/// Restores `version` into the existing file or block device at `path`, writing only what
/// differs (see the module documentation).
pub async fn restore_in_place(
    repo: Arc<Repo>,
    version: &VersionRecord,
    target: InPlaceTarget,
    options: InPlaceOptions,
) -> EngineResult<InPlaceStats> {
    let progress = options.progress.clone().unwrap_or_default();
    progress
        .total
        .store(version.logical_size, Ordering::Relaxed);
    let path = target.path.as_path();
    let out_err = |op: &'static str, e: io::Error| EngineError::Output {
        op,
        path: path.to_path_buf(),
        source: e,
    };
    if target.resize_from.is_some() {
        target
            .file
            .set_len(version.logical_size)
            .map_err(|e| out_err("cannot resize", e))?;
    }
    let leaves = leaf_refs(&repo, version).await?;
    let holds = options.holds.as_ref().filter(|u| {
        // The trees are compared only where their geometry is the same.
        u.segment_size == version.segment_size && u.fanout == version.fanout
    });
    let seg = u64::from(version.segment_size);
    let len_of = |index: u64| seg.min(version.logical_size.saturating_sub(index * seg)) as usize;
    let (method, work) = match holds {
        Some(u) => {
            let diff = crate::diff::diff(&repo, u, version).await?;
            let mut work: Vec<Work> = Vec::new();
            for r in diff.ranges {
                let end = r.end().min(version.logical_size);
                let mut at = r.offset;
                while at < end {
                    let index = at / seg;
                    let stop = end.min((index + 1) * seg);
                    let piece = ((at - index * seg) as usize, (stop - index * seg) as usize);
                    match work.last_mut() {
                        Some(w) if w.index == index => w.ranges.get_or_insert_default().push(piece),
                        _ => work.push(Work {
                            index,
                            offset: index * seg,
                            leaf: leaves.get(&index).copied(),
                            ranges: Some(vec![piece]),
                        }),
                    }
                    at = stop;
                }
            }
            (InPlaceMethod::Diff, work)
        }
        None => {
            let count = crate::tree::segment_count(version.logical_size, version.segment_size);
            let work = (0..count)
                .map(|index| Work {
                    index,
                    offset: index * seg,
                    leaf: leaves.get(&index).copied(),
                    ranges: None,
                })
                .collect();
            (InPlaceMethod::Compare, work)
        }
    };

    let mut stats = InPlaceStats {
        method,
        logical_bytes: version.logical_size,
        resized_from: target.resize_from,
        target_read_bytes: 0,
        segments_unchanged: 0,
        written_bytes: 0,
        zeroed_bytes: 0,
        fetched_bytes: 0,
        reads: 0,
    };
    let before = Fetched::of(&repo);
    let (mut stored, mut fetched_segments) = (0u64, 0u64);
    let file = Arc::new(target.file);
    let shared = Arc::new(Shared {
        repo: repo.clone(),
        file: file.clone(),
        sparse: target.regular,
        path: path.to_path_buf(),
    });
    // A rolling window of batches, as a full restore reads; each batch writes its own
    // segments (positioned writes need no order).
    let window = options.parallel_reads.max(1);
    let mut batches = work.chunks(SEGMENTS_PER_BATCH).map(|batch| {
        let shared = shared.clone();
        let batch: Vec<(Work, usize)> =
            batch.iter().map(|w| (w.clone(), len_of(w.index))).collect();
        tokio::spawn(async move { shared.apply_batch(batch).await })
    });
    let mut in_flight: std::collections::VecDeque<_> = batches.by_ref().take(window).collect();
    let unchanged_before = work.iter().map(|w| len_of(w.index) as u64).sum::<u64>();
    progress.done.store(
        version.logical_size.saturating_sub(unchanged_before),
        Ordering::Relaxed,
    );
    while let Some(task) = in_flight.pop_front() {
        crate::interrupt::check()?;
        let done = task
            .await
            .map_err(|e| EngineError::internal("in-place restore task", e))??;
        in_flight.extend(batches.next());
        stats.target_read_bytes += done.target_read;
        stats.segments_unchanged += done.unchanged;
        stats.written_bytes += done.written;
        stats.zeroed_bytes += done.zeroed;
        stored += done.stored;
        fetched_segments += done.fetched_segments;
        progress.done.fetch_add(done.covered, Ordering::Relaxed);
        let now = Fetched::of(&repo).since(&before, stored, fetched_segments);
        progress.fetched.store(now.bytes, Ordering::Relaxed);
    }
    let fetched = Fetched::of(&repo).since(&before, stored, fetched_segments);
    stats.fetched_bytes = fetched.bytes;
    stats.reads = fetched.reads;
    file.sync_all().map_err(|e| out_err("cannot sync", e))?;
    if target.regular {
        // As a full restore stamps its file: a later write by anyone moves the mtime to their
        // now, which is how the CLI's provenance tells a file that still holds this version.
        let at =
            std::time::UNIX_EPOCH + std::time::Duration::from_nanos(version.time_ns.max(0) as u64);
        file.set_modified(at)
            .map_err(|e| out_err("cannot set the modification time of", e))?;
    }
    Ok(stats)
}

/// Opens TARGET for an in-place restore of `version`, refusing what must not be written.
fn open_target(
    path: &Path,
    version: &VersionRecord,
    resize: bool,
    known: bool,
) -> EngineResult<InPlaceTarget> {
    let meta = std::fs::metadata(path).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => refuse(
            path,
            "it does not exist; --in-place rewrites an existing image (without it, restore \
             creates the file)",
        ),
        _ => EngineError::Output {
            op: "cannot inspect",
            path: path.to_path_buf(),
            source: e,
        },
    })?;
    let real = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
    let out_err = |op: &'static str, e: io::Error| EngineError::Output {
        op,
        path: path.to_path_buf(),
        source: e,
    };
    let ft = meta.file_type();
    if ft.is_block_device() {
        let file = open_device_exclusive(path, &real, true)?;
        let size = file_size(&file).map_err(|e| out_err("cannot size", e))?;
        if size < version.logical_size {
            return Err(refuse(
                path,
                format!(
                    "the device has {size} bytes and the version {}; a device cannot be resized",
                    version.logical_size
                ),
            ));
        }
        refuse_qcow2(&file, path, known)?;
        return Ok(InPlaceTarget {
            path: path.to_path_buf(),
            file,
            regular: false,
            resize_from: None,
        });
    }
    if !ft.is_file() {
        return Err(refuse(
            path,
            "it is not a regular file or block device; --in-place rewrites an image file or a \
             device",
        ));
    }
    if let Some(holder) = crate::file_lock::lock_holder(&real) {
        return Err(refuse(
            path,
            format!("it is in use: {holder}; stop it first"),
        ));
    }
    if let Some(dev) = loop_device_backed_by(&real) {
        return Err(refuse(
            path,
            format!(
                "it backs the loop device {dev} (a file system may be mounted from it); \
                 unmount it and detach the loop device first (losetup -d {dev})"
            ),
        ));
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&real)
        .map_err(|e| out_err("cannot open", e))?;
    if !crate::file_lock::lock_whole_file(&file).map_err(|e| out_err("cannot lock", e))? {
        return Err(refuse(
            path,
            "it is in use: another process holds a lock on it (a running VM?); stop it first",
        ));
    }
    refuse_qcow2(&file, path, known)?;
    let size = meta.len();
    let mut resize_from = None;
    if size != version.logical_size {
        if !resize {
            return Err(refuse(
                path,
                format!(
                    "it has {size} bytes and {}@{} has {}; pass --resize to make it that size",
                    version.image, version.seq, version.logical_size
                ),
            ));
        }
        resize_from = Some(size);
    }
    Ok(InPlaceTarget {
        path: path.to_path_buf(),
        file,
        regular: true,
        resize_from,
    })
}

/// Refuses a TARGET that is a qcow2 image (its raw bytes are not the guest's disk), unless
/// the caller knows it holds a version as it is.
fn refuse_qcow2(file: &File, path: &Path, known: bool) -> EngineResult<()> {
    let mut magic = [0u8; 4];
    let qcow2 = file.read_exact_at(&mut magic, 0).is_ok() && magic == *b"QFI\xfb";
    match qcow2 && !known {
        true => Err(refuse(
            path,
            "it is a qcow2 image; --in-place rewrites raw images and devices (restore with \
             --format qcow2 --force to replace it)",
        )),
        false => Ok(()),
    }
}

/// The size of a file or block device (a device's `st_size` is 0).
fn file_size(file: &File) -> io::Result<u64> {
    use std::io::Seek;
    let mut f = file;
    f.seek(io::SeekFrom::End(0))
}

/// What every batch needs.
struct Shared {
    repo: Arc<Repo>,
    file: Arc<File>,
    sparse: bool,
    path: PathBuf,
}

/// What one batch did.
#[derive(Debug, Default)]
struct BatchDone {
    covered: u64,
    target_read: u64,
    unchanged: u64,
    written: u64,
    zeroed: u64,
    stored: u64,
    fetched_segments: u64,
}

impl Shared {
    /// Brings the batch's segments (work, segment length) to V.
    async fn apply_batch(self: Arc<Self>, batch: Vec<(Work, usize)>) -> EngineResult<BatchDone> {
        let mut done = BatchDone {
            covered: batch.iter().map(|(_, len)| *len as u64).sum(),
            ..Default::default()
        };
        // 1. The segments to compare: TARGET's bytes, and whether they are V's already.
        let compare: Vec<(u64, usize, Expect)> = batch
            .iter()
            .filter(|(w, _)| w.ranges.is_none())
            .map(|(w, len)| {
                let expect = match w.leaf {
                    None => Expect::Zeros,
                    Some(leaf) => leaf
                        .digest
                        .map_or(Expect::Unknown, |d| Expect::Digest(d.digest)),
                };
                (w.offset, *len, expect)
            })
            .collect();
        let this = self.clone();
        let read = tokio::task::spawn_blocking(move || this.read_target(&compare))
            .await
            .map_err(|e| EngineError::internal("in-place restore reader", e))??;
        let mut have = read.into_iter();

        // 2. What needs V's bytes, fetched together.
        let mut plan: Vec<(Work, usize, Option<Vec<u8>>)> = Vec::new();
        for (w, len) in batch {
            let held = match w.ranges {
                Some(_) => None,
                None => {
                    let (bytes, matches) = have.next().expect("one read per compared segment");
                    done.target_read += len as u64;
                    if matches {
                        done.unchanged += 1;
                        continue;
                    }
                    Some(bytes)
                }
            };
            plan.push((w, len, held));
        }
        // A compared segment that differs is patched chunk by chunk: only the group runs
        // whose chunks differ are fetched. The others (ranges from the diff; format 1) are
        // fetched whole, together.
        let mut jobs: Vec<Job> = Vec::with_capacity(plan.len());
        let mut whole = Vec::new();
        let mut patch = Vec::new();
        for (w, len, held) in plan {
            match (w.leaf, held) {
                (Some(_), Some(held)) => patch.push((w, held)),
                (_, held) => whole.push((w, len, held)),
            }
        }
        if !patch.is_empty() {
            let mut inputs: Vec<PatchInput<'_>> = patch
                .iter_mut()
                .map(|(w, held)| PatchInput {
                    leaf: w.leaf.expect("a leaf").id,
                    held: held.as_mut_slice(),
                    alternatives: Vec::new(),
                    seeds: None,
                })
                .collect();
            let patched = patch_segments(&self.repo, &mut inputs).await?;
            drop(inputs);
            match patched {
                Some(patched) => {
                    for ((w, held), p) in patch.into_iter().zip(patched) {
                        done.stored += p.stored;
                        done.fetched_segments += 1;
                        jobs.push(Job {
                            offset: w.offset,
                            want: Some(held),
                            held: None,
                            ranges: p.changed,
                        });
                    }
                }
                // Format 1: the segments are read whole and compared block by block.
                None => whole.extend(patch.into_iter().map(|(w, held)| {
                    let len = held.len();
                    (w, len, Some(held))
                })),
            }
        }
        let wanted: Vec<(cairn_format::Id, u64)> = whole
            .iter()
            .filter_map(|(w, len, _)| w.leaf.map(|l| (l.id, *len as u64)))
            .collect();
        let mut fetched = match wanted.is_empty() {
            true => Vec::new(),
            false => read_segments(&self.repo, &wanted).await?,
        }
        .into_iter();
        for (w, len, held) in whole {
            // V's bytes; `None`: zeros (V stores nothing there).
            let want = w.leaf.map(|_| {
                let read = fetched.next().expect("one read per leaf");
                done.stored += read.stored;
                done.fetched_segments += 1;
                read.data
            });
            jobs.push(Job {
                offset: w.offset,
                want,
                held,
                ranges: w.ranges.unwrap_or_else(|| vec![(0, len)]),
            });
        }

        // 3. The writes.
        let this = self.clone();
        let (written, zeroed) = tokio::task::spawn_blocking(move || {
            let (mut written, mut zeroed) = (0, 0);
            for job in jobs {
                let (d, z) = this.write_differences(
                    job.offset,
                    job.want.as_deref(),
                    job.held.as_deref(),
                    &job.ranges,
                )?;
                written += d;
                zeroed += z;
            }
            EngineResult::Ok((written, zeroed))
        })
        .await
        .map_err(|e| EngineError::internal("in-place restore writer", e))??;
        done.written = written;
        done.zeroed = zeroed;
        Ok(done)
    }

    /// Whether TARGET's bytes of each segment (offset, length) are what V holds there
    /// already, and the bytes of those that are not. (One buffer is read into, so the
    /// segments that match — most, usually — cost no allocation.)
    fn read_target(&self, segments: &[(u64, usize, Expect)]) -> EngineResult<Vec<(Vec<u8>, bool)>> {
        let mut buf = vec![0u8; segments.iter().map(|s| s.1).max().unwrap_or(0)];
        let mut out = Vec::with_capacity(segments.len());
        for &(offset, len, expect) in segments {
            let bytes = &mut buf[..len];
            self.file
                .read_exact_at(bytes, offset)
                .map_err(|e| EngineError::Output {
                    op: "read error on",
                    path: self.path.clone(),
                    source: e,
                })?;
            let matches = match expect {
                Expect::Zeros => is_zero(bytes),
                Expect::Digest(digest) => self.repo.id_of(bytes) == digest,
                Expect::Unknown => false,
            };
            out.push(match matches {
                true => (Vec::new(), true),
                false => (bytes.to_vec(), false),
            });
        }
        Ok(out)
    }

    /// Writes the 4 KiB blocks of `want` (V's bytes of the segment at `offset`; `None`:
    /// zeros) inside `ranges` that differ from `held` (TARGET's bytes; `None`: known to
    /// differ). Returns (data bytes written, bytes zeroed).
    fn write_differences(
        &self,
        offset: u64,
        want: Option<&[u8]>,
        held: Option<&[u8]>,
        ranges: &[(usize, usize)],
    ) -> EngineResult<(u64, u64)> {
        let mut out = Writes {
            shared: self,
            offset,
            want,
            pending: None,
            written: 0,
            zeroed: 0,
        };
        for &(start, end) in ranges {
            let mut at = start;
            while at < end {
                let stop = end.min((at / BLOCK + 1) * BLOCK);
                let (same, zeros) = match want {
                    Some(w) => (
                        held.is_some_and(|h| h[at..stop] == w[at..stop]),
                        is_zero(&w[at..stop]),
                    ),
                    None => (held.is_some_and(|h| is_zero(&h[at..stop])), true),
                };
                match same {
                    true => out.flush()?,
                    false => out.add(at, stop, zeros)?,
                }
                at = stop;
            }
        }
        out.flush()?;
        Ok((out.written, out.zeroed))
    }
}

/// The writes of one segment: within `ranges`, the blocks of `want` (V's bytes; `None`:
/// zeros) that differ from `held` (TARGET's bytes; `None`: known to differ).
struct Job {
    offset: u64,
    want: Option<Vec<u8>>,
    held: Option<Vec<u8>>,
    ranges: Vec<(usize, usize)>,
}

/// What a compared segment of TARGET should hold.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// Zeros: V stores nothing there.
    Zeros,
    /// Bytes whose digest is this.
    Digest(cairn_format::Id),
    /// Bytes known only by reading V.
    Unknown,
}

/// Consecutive pieces of one kind are written (or zeroed) together.
struct Writes<'a> {
    shared: &'a Shared,
    offset: u64,
    want: Option<&'a [u8]>,
    /// (start, end, zeros) within the segment.
    pending: Option<(usize, usize, bool)>,
    written: u64,
    zeroed: u64,
}

impl Writes<'_> {
    fn add(&mut self, start: usize, end: usize, zeros: bool) -> EngineResult<()> {
        match self.pending {
            Some((s, e, z)) if e == start && z == zeros && (zeros || end - s <= MAX_WRITE) => {
                self.pending = Some((s, end, z));
                Ok(())
            }
            _ => {
                self.flush()?;
                self.pending = Some((start, end, zeros));
                Ok(())
            }
        }
    }

    fn flush(&mut self) -> EngineResult<()> {
        let Some((start, end, zeros)) = self.pending.take() else {
            return Ok(());
        };
        let at = self.offset + start as u64;
        let len = (end - start) as u64;
        let err = |e| EngineError::Output {
            op: "write error on",
            path: self.shared.path.clone(),
            source: e,
        };
        let file = &self.shared.file;
        if !zeros {
            let want = self.want.expect("data pieces come from V's bytes");
            file.write_all_at(&want[start..end], at).map_err(err)?;
            self.written += len;
            return Ok(());
        }
        self.zeroed += len;
        if self.shared.sparse && punch_hole(file, at, len).map_err(err)? {
            return Ok(());
        }
        write_zeros(file, at, len).map_err(err)
    }
}

/// Writes `len` zeros at `at`.
fn write_zeros(file: &File, mut at: u64, mut len: u64) -> io::Result<()> {
    static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
    while len > 0 {
        let n = len.min(ZEROS.len() as u64);
        file.write_all_at(&ZEROS[..n as usize], at)?;
        at += n;
        len -= n;
    }
    Ok(())
}

/// Punches a hole of `len` bytes at `at` into a regular file (it reads as zeros after):
/// `false` where the file system cannot (the caller writes zeros instead).
fn punch_hole(file: &File, at: u64, len: u64) -> io::Result<bool> {
    use std::os::unix::io::AsRawFd;
    let (Ok(off), Ok(n)) = (libc::off_t::try_from(at), libc::off_t::try_from(len)) else {
        return Ok(false);
    };
    // SAFETY: `file` owns a valid descriptor for the whole call; fallocate takes no pointer.
    let rc = unsafe {
        libc::fallocate(
            file.as_raw_fd(),
            libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
            off,
            n,
        )
    };
    if rc == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EOPNOTSUPP) | Some(libc::ENOSYS) => Ok(false),
        _ => Err(e),
    }
}

//! The plain bytes of one segment of a version, read through its leaf: what a restore writes
//! and what `cairn copy` sends. Format 1 leaves name chunks (fetched with coalesced ranged
//! reads); format 2 leaves name runs of slots of groups (a leaf's groups opened together,
//! neighbouring ones in one read). Every byte is checked against its id on the way.

use std::sync::Arc;

use cairn_format::leaf_v2::{RunExtent, RunLeaf};
use cairn_format::node::Extent;
use cairn_format::Id;
use cairn_repo::v2::V2Reader;
use cairn_repo::{Repo, RepoError};

use crate::error::{EngineError, EngineResult};
pub use crate::seeds::Seeds;
use crate::tree::read_leaf;

/// The `len` plain bytes of the segment whose leaf is `id` (zero extents as zeros), and how
/// many of them are stored data.
pub async fn read_segment(repo: &Arc<Repo>, id: &Id, len: u64) -> EngineResult<(Vec<u8>, u64)> {
    match repo.v2() {
        Some(reader) => {
            let read = read_run_segment(repo, reader, id, len, false).await?;
            Ok((read.data, read.stored))
        }
        None => read_chunk_segment(repo, id, len).await,
    }
}

/// A segment read that went on past damage (format 2).
#[derive(Debug, Default)]
pub struct SegmentRead {
    /// The segment's bytes; what could not be read is zeros.
    pub data: Vec<u8>,
    /// Bytes of stored data read.
    pub stored: u64,
    /// Ranges (offset in the segment, length) that could not be read, and why.
    pub damaged: Vec<(u64, u64, String)>,
    /// Bytes of stored data taken from seeds instead of fetched ([`read_segments_seeded`]).
    pub seeded: u64,
}

/// Like [`read_segment`], but in format 2 a group run that cannot be read is zeros and
/// listed instead of failing the read (`restore --allow-damage`); a leaf that cannot be read
/// (in format 1, any of its chunks) still fails it.
pub async fn read_segment_allowing_damage(
    repo: &Arc<Repo>,
    id: &Id,
    len: u64,
) -> EngineResult<SegmentRead> {
    match repo.v2() {
        Some(reader) => read_run_segment(repo, reader, id, len, true).await,
        None => {
            let (data, stored) = read_chunk_segment(repo, id, len).await?;
            Ok(SegmentRead {
                data,
                stored,
                ..Default::default()
            })
        }
    }
}

/// Format 1: the leaf's chunks, read together.
async fn read_chunk_segment(repo: &Arc<Repo>, id: &Id, len: u64) -> EngineResult<(Vec<u8>, u64)> {
    let leaf = read_leaf(repo, id).await?;
    let ids: Vec<Id> = leaf.chunk_ids().collect();
    let mut chunks = repo.read_blobs(&ids).await?.into_iter();
    let mut data = Vec::with_capacity(len as usize);
    let mut stored = 0;
    for e in &leaf.extents {
        match e {
            Extent::Chunk { id: chunk, len } => {
                let bytes = chunks.next().expect("one read per chunk");
                if bytes.len() != *len as usize {
                    return Err(EngineError::Manifest(format!(
                        "leaf {id}: chunk {chunk} has {} bytes, the leaf says {len}",
                        bytes.len()
                    )));
                }
                data.extend_from_slice(&bytes);
                stored += u64::from(*len);
            }
            other => data.resize(data.len() + other.len() as usize, 0),
        }
    }
    check_len(id, data.len() as u64, len)?;
    Ok((data, stored))
}

fn check_len(leaf: &Id, covers: u64, len: u64) -> EngineResult<()> {
    match covers == len {
        true => Ok(()),
        false => Err(EngineError::Manifest(format!(
            "leaf {leaf} covers {covers} bytes where its segment has {len}"
        ))),
    }
}

/// The segments of `leaves` (leaf id, segment length), in order, read as [`read_segment`]
/// reads each, but together: on format 2 the leaves come in one read where they lie side by
/// side, and the groups of all of them in as few ranged reads as their places allow (the
/// groups of consecutive segments are written side by side) — a restore's reads are then a
/// few hundred KiB to a few MiB each, not one per leaf and one per leaf's groups.
pub async fn read_segments(
    repo: &Arc<Repo>,
    leaves: &[(Id, u64)],
) -> EngineResult<Vec<SegmentRead>> {
    let Some(reader) = repo.v2() else {
        let mut out = Vec::with_capacity(leaves.len());
        for &(id, len) in leaves {
            let (data, stored) = read_chunk_segment(repo, &id, len).await?;
            out.push(SegmentRead {
                data,
                stored,
                ..Default::default()
            });
        }
        return Ok(out);
    };
    if leaves.len() > 1 {
        let ids: Vec<Id> = leaves.iter().map(|(id, _)| *id).collect();
        reader.prefetch_nodes(&ids).await;
    }
    let mut decoded = Vec::with_capacity(leaves.len());
    for (id, len) in leaves {
        decoded.push(read_run_leaf(repo, id, *len).await?);
    }
    let fast: Vec<usize> = (0..leaves.len())
        .filter(|&i| decoded[i].digest().is_some())
        .collect();
    let runs: Vec<(Id, u16, u16)> = fast.iter().flat_map(|&i| decoded[i].group_runs()).collect();
    let mut out: Vec<Option<SegmentRead>> = (0..leaves.len()).map(|_| None).collect();
    if !runs.is_empty() {
        if let Some(read) = reader.read_runs_unchecked(&runs).await? {
            let mut read = read.into_iter();
            for &i in &fast {
                out[i] = assemble_checked(repo, &decoded[i], &mut read, leaves[i].1);
            }
        }
    }
    let mut segments = Vec::with_capacity(leaves.len());
    for (i, read) in out.into_iter().enumerate() {
        segments.push(match read {
            Some(read) => read,
            // Damage or a mismatch: the checked path names and quarantines it.
            None => {
                read_checked_segment(repo, reader, &leaves[i].0, &decoded[i], leaves[i].1, false)
                    .await?
            }
        });
    }
    Ok(segments)
}

/// A format 2 leaf, read and checked against its segment's length.
async fn read_run_leaf(repo: &Repo, id: &Id, len: u64) -> EngineResult<RunLeaf> {
    let raw = repo.read_blob(id).await?;
    let leaf =
        RunLeaf::decode(&raw).map_err(|e| RepoError::corrupt(format!("manifest node {id}"), e))?;
    check_len(id, leaf.len(), len)?;
    Ok(leaf)
}

/// The segment `leaf` describes, from its runs' bytes read unchecked (one item of `read` per
/// run, taken in order), if it has `len` bytes that match the leaf's digest; `None` sends
/// the caller to the checked path.
fn assemble_checked(
    repo: &Repo,
    leaf: &RunLeaf,
    read: &mut impl Iterator<Item = bytes::Bytes>,
    len: u64,
) -> Option<SegmentRead> {
    let digest = leaf.digest()?;
    let mut data = spare_buffer(len as usize);
    let mut stored = 0;
    for e in leaf.extents() {
        match *e {
            RunExtent::Zero { len } => data.resize(data.len() + len as usize, 0),
            RunExtent::Run { len, .. } => {
                data.extend_from_slice(&read.next().expect("one result per run"));
                stored += u64::from(len);
            }
        }
    }
    (data.len() as u64 == len && repo.id_of(&data) == digest).then_some(SegmentRead {
        data,
        stored,
        ..Default::default()
    })
}

/// Segment buffers given back once written ([`give_back`]), for the next segments read: a
/// new 1 MiB buffer is a new mapping (page faults and zeroed pages for every segment, ~10% of
/// a restore's CPU time). Only a restore gives buffers back, and it drops the rest when it
/// ends ([`drop_spare_buffers`]).
static SPARE_BUFFERS: std::sync::Mutex<Vec<Vec<u8>>> = std::sync::Mutex::new(Vec::new());

/// Buffers kept at most: a restore's window of segments in flight, and a few more.
const SPARE_MAX: usize = 48;

/// An empty buffer that holds `len` bytes without growing: a spare one if there is one.
pub(crate) fn spare_buffer(len: usize) -> Vec<u8> {
    let spare = SPARE_BUFFERS.lock().expect("spare buffers").pop();
    let mut buf = spare.unwrap_or_default();
    buf.clear();
    buf.reserve(len);
    buf
}

/// Keeps a segment's buffer, once written, for [`spare_buffer`].
pub(crate) fn give_back(buf: Vec<u8>) {
    let mut spare = SPARE_BUFFERS.lock().expect("spare buffers");
    if spare.len() < SPARE_MAX && buf.capacity() > 0 {
        spare.push(buf);
    }
}

/// Frees the buffers kept.
pub(crate) fn drop_spare_buffers() {
    std::mem::take(&mut *SPARE_BUFFERS.lock().expect("spare buffers"));
}

/// Format 2: the leaf's group runs through [`V2Reader::read_runs`] (a leaf's neighbouring
/// groups in one read; a damaged group's slots from other copies of their chunks). With
/// `tolerant`, a run that cannot be read is zeros and listed; otherwise it fails the read.
async fn read_run_segment(
    repo: &Repo,
    reader: &V2Reader,
    id: &Id,
    len: u64,
    tolerant: bool,
) -> EngineResult<SegmentRead> {
    let leaf = read_run_leaf(repo, id, len).await?;
    let runs: Vec<(Id, u16, u16)> = leaf.group_runs().collect();
    // A leaf with its segment's digest: read without hashing every 4 KiB chunk, then the
    // whole segment checked against the digest in one pass. Anything else — no digest, a
    // group that does not open, bytes that do not match — takes the checked path below,
    // which names (and quarantines) what is damaged.
    if leaf.digest().is_some() {
        if let Some(read) = reader.read_runs_unchecked(&runs).await? {
            if let Some(read) = assemble_checked(repo, &leaf, &mut read.into_iter(), len) {
                return Ok(read);
            }
        }
    }
    read_checked_segment(repo, reader, id, &leaf, len, tolerant).await
}

/// The segment of `leaf` (leaf `id`) read through [`V2Reader::read_runs`], every chunk
/// checked and damage named; with `tolerant`, a run that cannot be read is zeros and listed.
async fn read_checked_segment(
    repo: &Repo,
    reader: &V2Reader,
    id: &Id,
    leaf: &RunLeaf,
    len: u64,
    tolerant: bool,
) -> EngineResult<SegmentRead> {
    let runs: Vec<(Id, u16, u16)> = leaf.group_runs().collect();
    let mut read = reader.read_runs(&runs).await?.into_iter();
    let mut out = SegmentRead {
        data: Vec::with_capacity(len as usize),
        ..Default::default()
    };
    for e in leaf.extents() {
        match *e {
            RunExtent::Zero { len } => out.data.resize(out.data.len() + len as usize, 0),
            RunExtent::Run {
                group,
                first,
                count,
                len,
            } => {
                let bytes = read.next().expect("one result per run").and_then(|bytes| {
                    match bytes.len() == len as usize {
                        true => Ok(bytes),
                        false => Err(RepoError::corrupt(
                            format!("manifest node {id}"),
                            cairn_format::FormatError::invalid(
                                "leaf",
                                format!(
                                    "slots {first}..{} of group {group} hold {} bytes, the \
                                     leaf says {len}",
                                    u32::from(first) + u32::from(count),
                                    bytes.len()
                                ),
                            ),
                        )),
                    }
                });
                match bytes {
                    Ok(bytes) => {
                        out.data.extend_from_slice(&bytes);
                        out.stored += u64::from(len);
                    }
                    Err(e) if tolerant && e.is_damage() => {
                        let at = out.data.len() as u64;
                        out.damaged.push((at, u64::from(len), e.to_string()));
                        out.data.resize(out.data.len() + len as usize, 0);
                    }
                    Err(e) => return Err(e.into()),
                }
            }
        }
    }
    // The digest future commits trust to reuse this leaf (the parent fast path) must be
    // the segment's: every chunk was checked, so a mismatch is a bad leaf.
    if let Some(digest) = leaf.digest().filter(|_| out.damaged.is_empty()) {
        if repo.id_of(&out.data) != digest {
            return Err(RepoError::corrupt(
                format!("manifest node {id}"),
                cairn_format::FormatError::invalid(
                    "leaf",
                    "its segment's bytes do not match its digest",
                ),
            )
            .into());
        }
    }
    Ok(out)
}

/// The chunks slots `first .. first + count` of `group` hold (ids and lengths from the
/// group's descriptor), checked to add up to the `len` bytes leaf `leaf` says they hold.
pub(crate) async fn run_chunks_checked(
    reader: &V2Reader,
    leaf: &Id,
    group: &Id,
    first: u16,
    count: u16,
    len: u32,
) -> EngineResult<Vec<cairn_format::group::GroupChunk>> {
    let chunks = reader.run_chunks(group, first, count).await?;
    match chunks.iter().map(|c| u64::from(c.len)).sum::<u64>() == u64::from(len) {
        true => Ok(chunks),
        false => Err(EngineError::Manifest(format!(
            "leaf {leaf}: slots {first}..{} of group {group} do not hold its {len} bytes",
            u32::from(first) + u32::from(count)
        ))),
    }
}

/// What [`patch_segments`] changed in one segment.
#[derive(Debug, Default)]
pub struct PatchedSegment {
    /// The byte ranges (in the segment, sorted, not touching) now holding V's bytes where
    /// they held others.
    pub changed: Vec<(usize, usize)>,
    /// Bytes of stored data fetched.
    pub stored: u64,
    /// Bytes of V's data found in `held`, an alternative or the seeds' index (not fetched).
    pub reused: u64,
}

/// One segment to patch: its format 2 leaf, the bytes found elsewhere (`held`: the target of
/// an in-place restore, the first seed), and more bytes of the same segment to try after
/// them (`alternatives`: other seeds), all of the segment's length; then chunks found by
/// content anywhere in `seeds` (when their index is built).
pub struct PatchInput<'a> {
    pub leaf: Id,
    pub held: &'a mut [u8],
    pub alternatives: Vec<&'a [u8]>,
    pub seeds: Option<&'a Seeds>,
}

/// Slots of a group run to fetch for one segment: (group, first slot, count, offset in the
/// segment, bytes).
type WantedRun = (Id, u16, u16, usize, usize);

/// Turns each `held` into the bytes of the segment whose format 2 leaf is `leaf`, fetching
/// only what differs: every chunk of the leaf's group runs is compared by id with `held`'s
/// bytes at its place (the ids come from the groups' descriptors, no data is read), then with
/// each alternative in turn, and only the runs of slots whose chunks none of them holds are
/// read — those of all the segments together, in as few ranged reads as their places allow,
/// each chunk checked on the way; a zero extent zeroes what is not zeros already. Each result
/// is checked against its leaf's segment digest when it has one. `None` for a format 1
/// repository (the caller reads the segments whole).
pub async fn patch_segments(
    repo: &Arc<Repo>,
    inputs: &mut [PatchInput<'_>],
) -> EngineResult<Option<Vec<PatchedSegment>>> {
    let Some(reader) = repo.v2() else {
        return Ok(None);
    };
    let mut plans = Vec::with_capacity(inputs.len());
    for input in inputs.iter_mut() {
        plans.push(plan_patch(repo, reader, input).await?);
    }
    let runs: Vec<(Id, u16, u16)> = plans
        .iter()
        .flat_map(|(_, wanted, _)| wanted.iter().map(|w| (w.0, w.1, w.2)))
        .collect();
    let mut fetched = match runs.is_empty() {
        true => Vec::new(),
        false => reader.read_runs(&runs).await?,
    }
    .into_iter();
    let mut out = Vec::with_capacity(inputs.len());
    for (input, (digest, wanted, mut patched)) in inputs.iter_mut().zip(plans) {
        let id = input.leaf;
        for w in &wanted {
            let bytes = fetched.next().expect("one read per run")?;
            if bytes.len() != w.4 {
                return Err(EngineError::Manifest(format!(
                    "leaf {id}: slots {}..{} of group {} hold {} bytes, their descriptor says {}",
                    w.1,
                    u32::from(w.1) + u32::from(w.2),
                    w.0,
                    bytes.len(),
                    w.4
                )));
            }
            input.held[w.3..w.3 + w.4].copy_from_slice(&bytes);
            patched.stored += w.4 as u64;
        }
        if !wanted.is_empty() {
            // Zero extents, alternatives and fetched runs: one sorted, merged list.
            patched
                .changed
                .extend(wanted.iter().map(|w| (w.3, w.3 + w.4)));
            patched.changed.sort_unstable();
            let mut merged: Vec<(usize, usize)> = Vec::with_capacity(patched.changed.len());
            for (s, e) in patched.changed.drain(..) {
                mark(&mut merged, s, e);
            }
            patched.changed = merged;
        }
        if digest.is_some_and(|d| repo.id_of(input.held) != d) {
            return Err(EngineError::Manifest(format!(
                "leaf {id}: the segment patched chunk by chunk does not match its digest"
            )));
        }
        out.push(patched);
    }
    Ok(Some(out))
}

/// Appends `start..end` to sorted ranges, joined with the last one if they touch.
fn mark(changed: &mut Vec<(usize, usize)>, start: usize, end: usize) {
    match changed.last_mut() {
        Some(last) if last.1 == start => last.1 = end,
        _ => changed.push((start, end)),
    }
}

/// One segment's part of [`patch_segments`] before the fetch: zero extents and chunks found
/// in an alternative are applied to `held`; returns the leaf's digest, the runs to fetch, and
/// what was changed and reused so far.
async fn plan_patch(
    repo: &Arc<Repo>,
    reader: &V2Reader,
    input: &mut PatchInput<'_>,
) -> EngineResult<(Option<Id>, Vec<WantedRun>, PatchedSegment)> {
    let id = input.leaf;
    let held = &mut *input.held;
    let leaf = read_run_leaf(repo, &id, held.len() as u64).await?;
    let mut out = PatchedSegment::default();
    let mut wanted: Vec<WantedRun> = Vec::new();
    let mut pos = 0usize;
    for e in leaf.extents() {
        match *e {
            RunExtent::Zero { len } => {
                let end = pos + len as usize;
                let mut at = pos;
                while at < end {
                    let stop = end.min(at + 4096);
                    if !crate::chunker::is_zero(&held[at..stop]) {
                        held[at..stop].fill(0);
                        mark(&mut out.changed, at, stop);
                    }
                    at = stop;
                }
                pos = end;
            }
            RunExtent::Run {
                group,
                first,
                count,
                len,
            } => {
                let chunks = run_chunks_checked(reader, &id, &group, first, count, len).await?;
                let mut at = pos;
                for (i, c) in chunks.iter().enumerate() {
                    let end = at + c.len as usize;
                    if repo.id_of(&held[at..end]) == c.id {
                        out.reused += u64::from(c.len);
                    } else if let Some(alt) = input
                        .alternatives
                        .iter()
                        .find(|alt| repo.id_of(&alt[at..end]) == c.id)
                    {
                        held[at..end].copy_from_slice(&alt[at..end]);
                        mark(&mut out.changed, at, end);
                        out.reused += u64::from(c.len);
                    } else if let Some(found) = input
                        .seeds
                        .filter(|_| end - at == 4096)
                        .and_then(|seeds| seeds.find(&c.id, |b| repo.id_of(b)))
                    {
                        held[at..end].copy_from_slice(&found);
                        mark(&mut out.changed, at, end);
                        out.reused += u64::from(c.len);
                    } else {
                        let slot = first + i as u16;
                        match wanted.last_mut() {
                            Some(w) if w.0 == group && w.1 + w.2 == slot && w.3 + w.4 == at => {
                                w.2 += 1;
                                w.4 += c.len as usize;
                            }
                            _ => wanted.push((group, slot, 1, at, c.len as usize)),
                        }
                    }
                    at = end;
                }
                pos += len as usize;
            }
        }
    }
    check_len(&id, pos as u64, held.len() as u64)?;
    Ok((leaf.digest(), wanted, out))
}

/// Like [`read_segments`] (leaf id, segment length, the segment's offset in the image), but
/// each segment is taken from `seeds` where they hold it: whole when the first seed's bytes
/// match the leaf's digest, else chunk by chunk ([`patch_segments`]), fetching only the chunks
/// no seed holds. Format 1 leaves are read as [`read_segments`] reads them.
pub async fn read_segments_seeded(
    repo: &Arc<Repo>,
    leaves: &[(Id, u64, u64)],
    seeds: &Seeds,
) -> EngineResult<Vec<SegmentRead>> {
    let from = seeds.clone();
    let at: Vec<(u64, usize)> = leaves
        .iter()
        .map(|&(_, len, off)| (off, len as usize))
        .collect();
    let ids = repo.clone();
    let copies: Vec<Vec<Vec<u8>>> = tokio::task::spawn_blocking(move || {
        if ids.v2().is_some() {
            // Once per restore: the first window waits for it.
            from.index_with(|b| ids.id_of(b));
        }
        at.into_iter()
            .map(|(off, len)| from.read(off, len))
            .collect()
    })
    .await
    .map_err(|e| EngineError::internal("seed reader", e))?;
    let mut out: Vec<Option<SegmentRead>> = (0..leaves.len()).map(|_| None).collect();
    // Taken whole where the first seed matches the leaf's digest; patched otherwise (past
    // every seed's end, from zeros: the index may still hold its chunks).
    let mut patch: Vec<(usize, Vec<u8>, Vec<Vec<u8>>)> = Vec::new();
    for (i, (&(id, len, _), mut copies)) in leaves.iter().zip(copies).enumerate() {
        if repo.v2().is_none() {
            continue;
        }
        let held = match copies.is_empty() {
            true => vec![0u8; len as usize],
            false => copies.remove(0),
        };
        let leaf = read_run_leaf(repo, &id, len).await?;
        if leaf.digest().is_some_and(|d| repo.id_of(&held) == d) {
            let data_bytes: u64 = leaf
                .extents()
                .iter()
                .map(|e| match *e {
                    RunExtent::Run { len, .. } => u64::from(len),
                    RunExtent::Zero { .. } => 0,
                })
                .sum();
            out[i] = Some(SegmentRead {
                data: held,
                stored: data_bytes,
                seeded: data_bytes,
                ..Default::default()
            });
        } else {
            patch.push((i, held, copies));
        }
    }
    if !patch.is_empty() {
        let mut inputs: Vec<PatchInput<'_>> = patch
            .iter_mut()
            .map(|(i, held, copies)| PatchInput {
                leaf: leaves[*i].0,
                held: held.as_mut_slice(),
                alternatives: copies.iter().map(|c| c.as_slice()).collect(),
                seeds: Some(seeds),
            })
            .collect();
        let patched = patch_segments(repo, &mut inputs)
            .await?
            .expect("a format 2 repository");
        drop(inputs);
        for ((i, held, _), p) in patch.into_iter().zip(patched) {
            out[i] = Some(SegmentRead {
                data: held,
                stored: p.stored + p.reused,
                seeded: p.reused,
                ..Default::default()
            });
        }
    }
    // What no seed covers: read as without seeds, together.
    let rest: Vec<(Id, u64)> = leaves
        .iter()
        .zip(&out)
        .filter(|(_, o)| o.is_none())
        .map(|(&(id, len, _), _)| (id, len))
        .collect();
    let mut rest = match rest.is_empty() {
        true => Vec::new(),
        false => read_segments(repo, &rest).await?,
    }
    .into_iter();
    Ok(out
        .into_iter()
        .map(|o| o.unwrap_or_else(|| rest.next().expect("one read per uncovered segment")))
        .collect())
}

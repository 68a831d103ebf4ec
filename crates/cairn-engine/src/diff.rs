//! Comparing two versions: which byte ranges may differ, at chunk/extent granularity.
//!
//! Both manifest trees are walked together. Two subtrees with the same id hold the same
//! content, so they are skipped without being read: the cost of a diff is proportional to the
//! change (the nodes on the paths to the changed leaves), not to the size of the images.
//!
//! Semantics of a changed range: a byte is *changed* if the extents that cover it in A and in
//! B differ: different chunks, the same chunk at a different position, or a chunk on one side
//! and zeros on the other. Zeros on both sides are never a change, whether they are zero runs,
//! absent subtrees or bytes beyond the end of the smaller image. So a diff is exact at the
//! granularity of extents, and conservative within one (a rewritten chunk is reported whole,
//! even where its bytes happen to be equal).
//!
//! Format 2 leaves name runs of group slots; a diff reads the chunk id of every slot of a
//! changed leaf from its group's descriptor (the pack trailer, cached per pack), so it
//! compares chunks exactly as on format 1 — a block that moved into another group with the
//! same content is not a change.
//!
//! Trees of different heights (images of different sizes) are aligned by *lifting*: the root
//! of the shorter tree covers the same segments as slot 0, at every higher level, of the
//! taller tree (segment indices are digits in base `fanout`, see `cairn_format::node`).

use std::sync::Arc;

use cairn_format::leaf_v2::{RunExtent, RunLeaf};
use cairn_format::node::{Extent, Leaf};
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::{Repo, RepoError};
use tokio::task::JoinSet;

use crate::error::{EngineError, EngineResult};
use crate::tree::{read_interior, read_leaf};

/// A range of logical offsets where two versions may differ.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChangedRange {
    pub offset: u64,
    pub len: u64,
}

impl ChangedRange {
    /// One past the last changed byte.
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// What differs between two versions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DiffReport {
    /// Changed ranges, sorted by offset, adjacent ranges merged.
    pub ranges: Vec<ChangedRange>,
    /// Sum of the ranges' lengths.
    pub changed_bytes: u64,
    /// Chunk references of B (each extent counted once) that overlap a changed range.
    pub chunks_added: u64,
    /// Chunk references of A (each extent counted once) that overlap a changed range.
    pub chunks_removed: u64,
    /// Manifest nodes (interior nodes and leaves) read to compute the diff.
    pub nodes_read: u64,
    /// The logical sizes of A and B. The ranges compare the smaller as if it were extended
    /// with zeros (as a grown disk reads), so where they differ in size, these say so.
    pub size_a: u64,
    pub size_b: u64,
}

impl DiffReport {
    /// Appends a changed range, merging it with the previous one if they touch. Ranges must
    /// arrive in increasing order.
    fn push(&mut self, offset: u64, len: u64) {
        if len == 0 {
            return;
        }
        self.changed_bytes += len;
        if let Some(last) = self.ranges.last_mut() {
            debug_assert!(last.end() <= offset, "ranges out of order");
            if last.end() == offset {
                last.len += len;
                return;
            }
        }
        self.ranges.push(ChangedRange { offset, len });
    }
}

/// One side of the walk at some level of the (taller) tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    /// All zeros: no node.
    Absent,
    /// A real node at the current level.
    Node(Id),
    /// The root of a shorter tree, at `level` below the current one: the current level's
    /// virtual node has it (or its lifted image) as its only child, at slot 0.
    Lifted(Id, u8),
}

impl Side {
    /// Equal real nodes (or two absent subtrees) hold the same content.
    fn same_as(&self, other: &Side) -> bool {
        matches!((self, other), (Side::Absent, Side::Absent))
            || matches!((self, other), (Side::Node(a), Side::Node(b)) if a == b)
    }
}

/// The children of one side of a pair at `level` (a slot-sorted list).
async fn children(repo: &Repo, side: Side, level: u8) -> EngineResult<(Vec<(u16, Side)>, u64)> {
    match side {
        Side::Absent => Ok((Vec::new(), 0)),
        Side::Lifted(id, at) => {
            let child = if at + 1 == level {
                Side::Node(id)
            } else {
                Side::Lifted(id, at)
            };
            Ok((vec![(0, child)], 0))
        }
        Side::Node(id) => {
            let node = read_interior(repo, &id, level).await?;
            let kids = node
                .children
                .into_iter()
                .map(|(slot, child)| (slot, Side::Node(child)))
                .collect();
            Ok((kids, 1))
        }
    }
}

/// Pairs two slot-sorted child lists by slot (absent where one side has no child), dropping
/// pairs that are known to be equal.
fn zip_children(a: Vec<(u16, Side)>, b: Vec<(u16, Side)>) -> Vec<(u16, Side, Side)> {
    let mut out = Vec::with_capacity(a.len().max(b.len()));
    let (mut ia, mut ib) = (a.into_iter().peekable(), b.into_iter().peekable());
    loop {
        let pair = match (ia.peek(), ib.peek()) {
            (None, None) => break,
            (Some(&(sa, ca)), Some(&(sb, cb))) if sa == sb => {
                ia.next();
                ib.next();
                (sa, ca, cb)
            }
            (Some(&(sa, ca)), Some(&(sb, _))) if sa < sb => {
                ia.next();
                (sa, ca, Side::Absent)
            }
            (Some(&(sa, ca)), None) => {
                ia.next();
                (sa, ca, Side::Absent)
            }
            (_, Some(&(sb, cb))) => {
                ib.next();
                (sb, Side::Absent, cb)
            }
        };
        if !pair.1.same_as(&pair.2) {
            out.push(pair);
        }
    }
    out
}

/// Compares two versions of (usually) the same image. See the module documentation for what
/// a changed range means. Both versions must have the same tree geometry (segment size and
/// fanout).
pub async fn diff(
    repo: &Arc<Repo>,
    a: &VersionRecord,
    b: &VersionRecord,
) -> EngineResult<DiffReport> {
    if a.segment_size != b.segment_size || a.fanout != b.fanout {
        return Err(EngineError::BadInput(format!(
            "cannot diff {}@{} and {}@{}: their manifest trees have different geometry \
             (segment size {} vs {}, fanout {} vs {})",
            a.image, a.seq, b.image, b.seq, a.segment_size, b.segment_size, a.fanout, b.fanout
        )));
    }
    let segment_size = a.segment_size as u64;
    let fanout = a.fanout as u64;
    let mut report = DiffReport {
        size_a: a.logical_size,
        size_b: b.logical_size,
        ..DiffReport::default()
    };
    if a.root == b.root && a.height == b.height {
        return Ok(report);
    }
    let top = a.height.max(b.height);
    let side = |root: Option<Id>, height: u8| match root {
        None => Side::Absent,
        Some(id) if height == top => Side::Node(id),
        Some(id) => Side::Lifted(id, height),
    };

    // Depth-first, children pushed in reverse so that they pop (and report) in order.
    // Entries: (level, first segment covered, side A, side B).
    let mut stack = vec![(top, 0u64, side(a.root, a.height), side(b.root, b.height))];
    while let Some((level, first_seg, sa, sb)) = stack.pop() {
        if sa.same_as(&sb) {
            continue;
        }
        let (ka, kb) = if let (Side::Node(_), Side::Node(_)) = (sa, sb) {
            // Both reads at once: on a remote store, latency dominates.
            tokio::try_join!(children(repo, sa, level), children(repo, sb, level))?
        } else {
            (
                children(repo, sa, level).await?,
                children(repo, sb, level).await?,
            )
        };
        report.nodes_read += ka.1 + kb.1;
        let pairs = zip_children(ka.0, kb.0);
        // Segments covered by one child of a node at this level (saturating: a record that
        // lies about its height fails on the level check of the nodes, not here).
        let span = fanout.saturating_pow(level as u32 - 1);
        if level > 1 {
            for &(slot, ca, cb) in pairs.iter().rev() {
                let first = first_seg.saturating_add((slot as u64).saturating_mul(span));
                stack.push((level - 1, first, ca, cb));
            }
            continue;
        }
        compare_leaf_batch(repo, first_seg, segment_size, pairs, &mut report).await?;
    }
    Ok(report)
}

/// Reads the differing leaf pairs under one level-1 pair in parallel and compares them in
/// segment order.
async fn compare_leaf_batch(
    repo: &Arc<Repo>,
    first_seg: u64,
    segment_size: u64,
    pairs: Vec<(u16, Side, Side)>,
    report: &mut DiffReport,
) -> EngineResult<()> {
    let mut tasks = JoinSet::new();
    for (i, &(_, la, lb)) in pairs.iter().enumerate() {
        for (which, side) in [(0usize, la), (1, lb)] {
            match side {
                Side::Absent => {}
                Side::Node(id) => {
                    let repo = repo.clone();
                    tasks.spawn(async move {
                        read_leaf_chunks(&repo, &id).await.map(|l| (i, which, l))
                    });
                }
                Side::Lifted(..) => {
                    return Err(EngineError::Manifest("a lifted root below level 1".into()))
                }
            }
        }
    }
    let mut leaves: Vec<[Option<Leaf>; 2]> = vec![[None, None]; pairs.len()];
    while let Some(r) = tasks.join_next().await {
        let (i, which, leaf) = r.map_err(|e| EngineError::internal("leaf reader", e))??;
        report.nodes_read += 1;
        leaves[i][which] = Some(leaf);
    }
    for (&(slot, la, lb), [leaf_a, leaf_b]) in pairs.iter().zip(&leaves) {
        let base = (first_seg + slot as u64) * segment_size;
        compare_extents(
            base,
            leaf_extents(leaf_a.as_ref(), la, segment_size)?,
            leaf_extents(leaf_b.as_ref(), lb, segment_size)?,
            report,
        );
    }
    Ok(())
}

/// Leaf `id` as chunk extents: a format 1 leaf as it is; a format 2 leaf's group runs as the
/// chunks their slots hold (ids from the groups' descriptors).
async fn read_leaf_chunks(repo: &Repo, id: &Id) -> EngineResult<Leaf> {
    let Some(reader) = repo.v2() else {
        return read_leaf(repo, id).await;
    };
    let raw = repo.read_blob(id).await?;
    let leaf =
        RunLeaf::decode(&raw).map_err(|e| RepoError::corrupt(format!("manifest node {id}"), e))?;
    let mut out = Leaf::default();
    for e in leaf.extents() {
        match *e {
            RunExtent::Zero { len } => out.push(Extent::Zero { len }),
            RunExtent::Run {
                group,
                first,
                count,
                len,
            } => {
                let chunks =
                    crate::segment::run_chunks_checked(reader, id, &group, first, count, len)
                        .await?;
                for c in &chunks {
                    out.push(Extent::Chunk {
                        id: c.id,
                        len: c.len,
                    });
                }
            }
        }
    }
    Ok(out)
}

/// The extents of a leaf that was read (none for an absent one), checked to fit a segment.
fn leaf_extents(leaf: Option<&Leaf>, side: Side, segment_size: u64) -> EngineResult<&[Extent]> {
    let Some(leaf) = leaf else { return Ok(&[]) };
    if leaf.len() > segment_size {
        let id = match side {
            Side::Node(id) | Side::Lifted(id, _) => id.to_hex(),
            Side::Absent => String::new(),
        };
        return Err(EngineError::Manifest(format!(
            "leaf {id} covers {} bytes, more than a segment ({segment_size})",
            leaf.len()
        )));
    }
    Ok(&leaf.extents)
}

/// What covers a piece of a segment, for comparison: zeros, or a chunk starting at `start`.
#[derive(PartialEq, Eq)]
enum Cover {
    Zero,
    Chunk { id: Id, start: u64 },
}

/// Compares two extent lists of the same segment positionally (bytes past the end of a list
/// are zeros) and reports where they differ, counting each chunk extent that overlaps a change
/// once.
fn compare_extents(base: u64, a: &[Extent], b: &[Extent], report: &mut DiffReport) {
    struct Cursor<'a> {
        extents: &'a [Extent],
        index: usize,
        start: u64,
        counted: Option<usize>,
    }
    impl Cursor<'_> {
        /// The current extent's end (`u64::MAX` past the list) and cover.
        fn current(&self) -> (u64, Cover) {
            match self.extents.get(self.index) {
                None => (u64::MAX, Cover::Zero),
                Some(e) => {
                    let end = self.start + e.len() as u64;
                    match *e {
                        Extent::Zero { .. } => (end, Cover::Zero),
                        Extent::Chunk { id, .. } => (
                            end,
                            Cover::Chunk {
                                id,
                                start: self.start,
                            },
                        ),
                    }
                }
            }
        }
        /// Counts the current extent if it is a chunk not counted yet.
        fn count(&mut self) -> u64 {
            let is_chunk = matches!(self.extents.get(self.index), Some(Extent::Chunk { .. }));
            if is_chunk && self.counted != Some(self.index) {
                self.counted = Some(self.index);
                1
            } else {
                0
            }
        }
        fn advance_to(&mut self, pos: u64, end: u64) {
            if end == pos && self.index < self.extents.len() {
                self.index += 1;
                self.start = pos;
            }
        }
        fn len(&self) -> u64 {
            self.extents.iter().map(|e| e.len() as u64).sum()
        }
    }
    let mut ca = Cursor {
        extents: a,
        index: 0,
        start: 0,
        counted: None,
    };
    let mut cb = Cursor {
        extents: b,
        index: 0,
        start: 0,
        counted: None,
    };
    let end = ca.len().max(cb.len());
    let mut pos = 0u64;
    while pos < end {
        let (end_a, cover_a) = ca.current();
        let (end_b, cover_b) = cb.current();
        let piece_end = end_a.min(end_b).min(end);
        if cover_a != cover_b {
            report.push(base + pos, piece_end - pos);
            report.chunks_removed += ca.count();
            report.chunks_added += cb.count();
        }
        pos = piece_end;
        ca.advance_to(pos, end_a);
        cb.advance_to(pos, end_b);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(tag: u8, len: u32) -> Extent {
        Extent::Chunk {
            id: Id::of(&[tag]),
            len,
        }
    }

    fn zero(len: u32) -> Extent {
        Extent::Zero { len }
    }

    fn run(a: &[Extent], b: &[Extent]) -> (Vec<(u64, u64)>, u64, u64) {
        let mut r = DiffReport::default();
        compare_extents(1000, a, b, &mut r);
        let ranges = r.ranges.iter().map(|c| (c.offset, c.len)).collect();
        assert_eq!(r.changed_bytes, r.ranges.iter().map(|c| c.len).sum::<u64>());
        (ranges, r.chunks_added, r.chunks_removed)
    }

    #[test]
    fn equal_extents_do_not_differ() {
        let l = [chunk(1, 10), zero(5), chunk(2, 10)];
        assert_eq!(run(&l, &l), (vec![], 0, 0));
        // Zero runs split differently are still zeros.
        assert_eq!(run(&[zero(10)], &[]), (vec![], 0, 0));
    }

    #[test]
    fn different_chunks_and_zeros() {
        let a = [chunk(1, 10), chunk(2, 10), zero(10), chunk(3, 10)];
        let b = [chunk(1, 10), chunk(9, 10), chunk(8, 10), chunk(3, 10)];
        assert_eq!(run(&a, &b), (vec![(1010, 20)], 2, 1));
        assert_eq!(run(&b, &a), (vec![(1010, 20)], 1, 2));
    }

    #[test]
    fn unaligned_boundaries_split_and_count_once() {
        // A: one 30-byte chunk; B: the same chunk id at 0 but shorter, then another.
        let a = [chunk(1, 30)];
        let b = [chunk(2, 10), chunk(3, 10), chunk(4, 10)];
        assert_eq!(run(&a, &b), (vec![(1000, 30)], 3, 1));
        // The same chunk at another position is a change.
        let a = [chunk(1, 10), zero(10)];
        let b = [zero(5), chunk(1, 10), zero(5)];
        assert_eq!(run(&a, &b), (vec![(1000, 15)], 1, 1));
    }

    #[test]
    fn beyond_the_end_is_zeros() {
        let a = [chunk(1, 10)];
        let b = [chunk(1, 10), zero(10), chunk(2, 5), zero(5)];
        assert_eq!(run(&a, &b), (vec![(1020, 5)], 1, 0));
        assert_eq!(run(&b, &a), (vec![(1020, 5)], 0, 1));
        assert_eq!(run(&[], &b), (vec![(1000, 10), (1020, 5)], 2, 0));
    }

    #[test]
    fn zip_drops_equal_pairs() {
        let (x, y, z) = (Id::of(b"x"), Id::of(b"y"), Id::of(b"z"));
        let a = vec![(1, Side::Node(x)), (3, Side::Node(y)), (7, Side::Node(z))];
        let b = vec![(0, Side::Node(x)), (3, Side::Node(y)), (7, Side::Node(x))];
        assert_eq!(
            zip_children(a, b),
            vec![
                (0, Side::Absent, Side::Node(x)),
                (1, Side::Node(x), Side::Absent),
                (7, Side::Node(z), Side::Node(x)),
            ]
        );
    }
}

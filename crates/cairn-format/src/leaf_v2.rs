//! Manifest leaves of format 2: a segment as zero runs and *group runs*, and the
//! digest of the segment's bytes.
//!
//! With 4 KiB chunks a v1 leaf (a 37-byte extent per chunk) would cost 3.3% of the stored
//! bytes of the su-* series (BENCHMARKS.md, *Studies behind the design*). A v2 extent names a run of consecutive slots of
//! one chunk group instead (VMAR's extent-merged maps): a commit's new data lies in its groups
//! in logical order, and data found again in an old group mostly lies there in runs too, so a
//! 1 MiB segment needs a handful of extents rather than 256 (0.44% over the series).
//!
//! ```text
//! leaf   = "CL" | version (u8) = 2 | flags (u8) | n (u32) | [digest (32)] | n × extent
//!          flags bit 0: the digest is there (other bits zero)
//! extent = 0 (u8) | length (u32)                                        zero run
//!        | 2 (u8) | length (u32) | group id (32) | first slot (u16) | count (u16)  group run
//! ```
//! A group run is the plain bytes of slots `first .. first + count` of the group, in order;
//! `length` is their sum (so offsets map without reading the group; a reader checks it against
//! the group's descriptor). The encoding is canonical, because a node's id is the hash of its
//! bytes and one segment should have one leaf: no extent is empty, and no two neighbouring
//! extents could be one (two zero runs, or two runs of one group whose slots follow each
//! other). v1 readers refuse the leaf by its version.
//!
//! The digest is the (keyed, in an encrypted repository) BLAKE3 of the segment's plain bytes,
//! zeros included: a commit that hashes a segment of its source whole — one pass at full SIMD
//! width, where 4 KiB chunks use a quarter of it — and finds the digest among its parent's
//! leaves reuses that leaf without chunking, hashing or looking up a block (the parent fast
//! path). Commits write it; leaves older builds wrote have none (flag clear).

use crate::codec::{Decoder, Encoder};
use crate::node::LEAF_MAGIC;
use crate::{FormatError, FormatResult, Id};

pub const VERSION: u8 = 2;
const KIND_ZERO: u8 = 0;
const KIND_RUN: u8 = 2;
const RUN_LEN: usize = 1 + 4 + 32 + 2 + 2;

/// One extent of a v2 leaf.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RunExtent {
    /// `len` bytes of zeros: never stored.
    Zero { len: u32 },
    /// Slots `first .. first + count` of the group `group`: `len` plain bytes.
    Run {
        group: Id,
        first: u16,
        count: u16,
        len: u32,
    },
}

impl RunExtent {
    pub fn len(&self) -> u32 {
        match *self {
            RunExtent::Zero { len } | RunExtent::Run { len, .. } => len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The one extent `self` followed by `next` make, if they make one.
    fn merged(&self, next: &RunExtent) -> Option<RunExtent> {
        match (*self, *next) {
            (RunExtent::Zero { len: a }, RunExtent::Zero { len: b }) => Some(RunExtent::Zero {
                len: a.checked_add(b)?,
            }),
            (
                RunExtent::Run {
                    group,
                    first,
                    count,
                    len,
                },
                RunExtent::Run {
                    group: g2,
                    first: f2,
                    count: c2,
                    len: l2,
                },
            ) if group == g2 && u32::from(first) + u32::from(count) == u32::from(f2) => {
                Some(RunExtent::Run {
                    group,
                    first,
                    count: count.checked_add(c2)?,
                    len: len.checked_add(l2)?,
                })
            }
            _ => None,
        }
    }
}

/// Flags bit 0: a segment digest follows the extent count.
const FLAG_DIGEST: u8 = 1;

/// What a level-1 interior node knows of a child leaf that carries a segment digest (format 2,
/// `node::Interior`): the digest and the leaf's figures. With them a commit finds its
/// parent's reusable leaves, and counts what they hold, from the interior nodes alone — a
/// few objects where reading every leaf opened a pack per commit that ever changed one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeafDigest {
    /// The segment digest (the leaf's own).
    pub digest: Id,
    /// Slots the leaf's group runs name (its chunks), at least 1.
    pub chunks: u32,
    /// Plain bytes of its group runs (the segment's non-zero data), at least `chunks`.
    pub data_bytes: u32,
}

/// The extents of one segment, in order, merged on construction, and the digest of its bytes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RunLeaf {
    extents: Vec<RunExtent>,
    digest: Option<Id>,
}

impl RunLeaf {
    /// Appends `e`, merging it into the last extent when the two make one. Empty extents and
    /// runs of no slot are dropped.
    pub fn push(&mut self, e: RunExtent) {
        if e.is_empty() || matches!(e, RunExtent::Run { count: 0, .. }) {
            return;
        }
        if let Some(last) = self.extents.last_mut() {
            if let Some(m) = last.merged(&e) {
                *last = m;
                return;
            }
        }
        self.extents.push(e);
    }

    pub fn extents(&self) -> &[RunExtent] {
        &self.extents
    }

    /// The digest of the segment's plain bytes, if the leaf carries one.
    pub fn digest(&self) -> Option<Id> {
        self.digest
    }

    /// Records the digest of the segment's plain bytes (see the module docs).
    pub fn set_digest(&mut self, digest: Id) {
        self.digest = Some(digest);
    }

    /// The digest and figures a level-1 node carries for this leaf: `None` for a leaf without
    /// a digest or without data (never stored).
    pub fn leaf_digest(&self) -> Option<LeafDigest> {
        let digest = self.digest?;
        let (mut chunks, mut data_bytes) = (0u32, 0u32);
        for e in &self.extents {
            if let RunExtent::Run { count, len, .. } = *e {
                chunks = chunks.saturating_add(u32::from(count));
                data_bytes = data_bytes.saturating_add(len);
            }
        }
        (chunks > 0).then_some(LeafDigest {
            digest,
            chunks,
            data_bytes,
        })
    }

    /// The group runs, in order, as (group id, first slot, count): what the leaf uses.
    pub fn group_runs(&self) -> impl Iterator<Item = (Id, u16, u16)> + '_ {
        self.extents.iter().filter_map(|e| match *e {
            RunExtent::Run {
                group,
                first,
                count,
                ..
            } => Some((group, first, count)),
            RunExtent::Zero { .. } => None,
        })
    }

    /// Logical bytes covered.
    pub fn len(&self) -> u64 {
        self.extents.iter().map(|e| u64::from(e.len())).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.extents.is_empty()
    }

    /// True if the leaf holds no group run (all zeros): such leaves are never stored.
    pub fn is_all_zero(&self) -> bool {
        self.extents
            .iter()
            .all(|e| matches!(e, RunExtent::Zero { .. }))
    }

    /// The groups the leaf refers to, in order (a group may repeat).
    pub fn groups(&self) -> impl Iterator<Item = Id> + '_ {
        self.extents.iter().filter_map(|e| match e {
            RunExtent::Run { group, .. } => Some(*group),
            RunExtent::Zero { .. } => None,
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::with_capacity(8 + 32 + self.extents.len() * RUN_LEN);
        let flags = if self.digest.is_some() {
            FLAG_DIGEST
        } else {
            0
        };
        e.bytes(&LEAF_MAGIC)
            .u8(VERSION)
            .u8(flags)
            .u32(self.extents.len() as u32);
        if let Some(digest) = &self.digest {
            e.id(digest);
        }
        for x in &self.extents {
            match x {
                RunExtent::Zero { len } => e.u8(KIND_ZERO).u32(*len),
                RunExtent::Run {
                    group,
                    first,
                    count,
                    len,
                } => e.u8(KIND_RUN).u32(*len).id(group).u16(*first).u16(*count),
            };
        }
        e.finish()
    }

    pub fn decode(data: &[u8]) -> FormatResult<Self> {
        const WHAT: &str = "manifest leaf";
        let invalid = |reason: &str| FormatError::invalid(WHAT, reason.to_string());
        let mut d = Decoder::new(data, WHAT);
        if d.take(2)? != LEAF_MAGIC {
            return Err(FormatError::BadMagic { what: WHAT });
        }
        match d.u8()? {
            VERSION => {}
            v if v > VERSION => {
                return Err(FormatError::TooNew {
                    what: WHAT,
                    found: v.into(),
                    supported: VERSION.into(),
                })
            }
            v => {
                return Err(FormatError::invalid(
                    WHAT,
                    format!("version {v} is not a v2 leaf"),
                ))
            }
        }
        let flags = d.u8()?;
        if flags & !FLAG_DIGEST != 0 {
            return Err(invalid("unknown flags"));
        }
        let n = d.u32()? as usize;
        let digest = match flags & FLAG_DIGEST {
            0 => None,
            _ => Some(d.id()?),
        };
        // Each extent takes at least 5 bytes: bound the allocation by what can follow.
        let mut leaf = RunLeaf {
            extents: Vec::with_capacity(n.min(d.remaining() / 5)),
            digest,
        };
        for _ in 0..n {
            let kind = d.u8()?;
            let len = d.u32()?;
            if len == 0 {
                return Err(invalid("empty extent"));
            }
            let e = match kind {
                KIND_ZERO => RunExtent::Zero { len },
                KIND_RUN => {
                    let group = d.id()?;
                    let (first, count) = (d.u16()?, d.u16()?);
                    if group.is_zero() {
                        return Err(invalid("zero group id"));
                    }
                    if count == 0 || u32::from(first) + u32::from(count) > 1 << 16 {
                        return Err(invalid("group run of no slot or past slot 65535"));
                    }
                    RunExtent::Run {
                        group,
                        first,
                        count,
                        len,
                    }
                }
                k => {
                    return Err(FormatError::invalid(
                        WHAT,
                        format!("unknown extent kind {k}"),
                    ))
                }
            };
            if leaf.extents.last().is_some_and(|l| l.merged(&e).is_some()) {
                return Err(invalid("two neighbouring extents that make one"));
            }
            leaf.extents.push(e);
        }
        d.finish()?;
        Ok(leaf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn run(g: &[u8], first: u16, count: u16) -> RunExtent {
        RunExtent::Run {
            group: Id::of(g),
            first,
            count,
            len: u32::from(count) * 4096,
        }
    }

    #[test]
    fn pushes_merge_runs_of_one_group_and_zero_runs() {
        let mut l = RunLeaf::default();
        l.push(run(b"a", 0, 3));
        l.push(run(b"a", 3, 2)); // follows on: merged
        l.push(run(b"a", 6, 1)); // skips slot 5: not merged
        l.push(RunExtent::Zero { len: 10 });
        l.push(RunExtent::Zero { len: 0 });
        l.push(RunExtent::Zero { len: 6 });
        l.push(run(b"b", 0, 0)); // no slot: dropped
        l.push(run(b"b", 0, 1));
        assert_eq!(
            l.extents(),
            &[
                run(b"a", 0, 5),
                run(b"a", 6, 1),
                RunExtent::Zero { len: 16 },
                run(b"b", 0, 1)
            ]
        );
        assert_eq!(l.len(), 7 * 4096 + 16);
        assert_eq!(l.groups().count(), 3);
        assert_eq!(RunLeaf::decode(&l.encode()).unwrap(), l);
    }

    #[test]
    fn non_canonical_and_malformed_leaves_are_refused() {
        let mut l = RunLeaf::default();
        l.push(run(b"a", 0, 2));
        let good = l.encode();
        let with = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut b = good.clone();
            f(&mut b);
            RunLeaf::decode(&b).unwrap_err().to_string()
        };
        assert!(with(&|b| b[3] = 2).contains("unknown flags"));
        // The digest flag set without the digest: the extent is read as a digest and the
        // leaf ends early.
        assert!(RunLeaf::decode(&{
            let mut b = good.clone();
            b[3] = 1;
            b
        })
        .is_err());
        assert!(with(&|b| b[2] = 1).contains("not a v2 leaf"));
        assert!(
            with(&|b| b[2] = 3).contains("newer"),
            "{}",
            with(&|b| b[2] = 3)
        );
        assert!(with(&|b| b[8] = 1).contains("unknown extent kind 1"));
        assert!(with(&|b| b[9..13].fill(0)).contains("empty extent"));
        assert!(with(&|b| b[13..45].fill(0)).contains("zero group id"));
        assert!(with(&|b| b[47..49].fill(0)).contains("no slot"));
        assert!(with(&|b| b[45..47].copy_from_slice(&u16::MAX.to_le_bytes())).contains("past"));
        // Two extents that a writer would have merged.
        let mut two = good.clone();
        two[4] = 2;
        two.extend_from_slice(&good[8..]);
        two[49 + 37..49 + 39].copy_from_slice(&2u16.to_le_bytes());
        assert!(RunLeaf::decode(&two)
            .unwrap_err()
            .to_string()
            .contains("make one"));
        // A v1 reader refuses a v2 leaf by its version.
        assert!(matches!(
            crate::node::Leaf::decode(&good),
            Err(FormatError::TooNew { found: 2, .. })
        ));
    }

    proptest! {
        #[test]
        fn leaves_round_trip(parts in proptest::collection::vec(
            (any::<bool>(), 0u8..4, 0u16..40, 1u16..20, 1u32..100_000), 0..200)) {
            let mut l = RunLeaf::default();
            if parts.len() % 2 == 1 {
                l.set_digest(Id::of(&[parts.len() as u8]));
            }
            for (zero, g, first, count, len) in parts {
                l.push(if zero { RunExtent::Zero { len } } else {
                    RunExtent::Run { group: Id::of(&[g]), first, count, len }
                });
            }
            prop_assert_eq!(RunLeaf::decode(&l.encode()).unwrap(), l);
        }

        #[test]
        fn the_decoder_never_panics(data in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = RunLeaf::decode(&data);
        }
    }
}

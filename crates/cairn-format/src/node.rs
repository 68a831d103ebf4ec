//! Manifest tree nodes (BlobSeer-style versioned segment trees).
//!
//! A version's manifest maps logical offsets to chunks. The disk is cut into segments of
//! `segment_size` bytes; segment `s` covers `[s*segment_size, (s+1)*segment_size)`.
//! A *leaf* describes one segment as a list of extents (a chunk or a zero run). An *interior*
//! node at level L ≥ 1 has up to `fanout` children; child slot `k` of a level-L node covers
//! segments whose index has digit `k` at position L-1 in base `fanout`. Level-1 children are
//! leaves. Children that are entirely zero are simply absent (sparse nodes), so a 100 GiB
//! image with a few MiB of data has a tiny manifest.
//!
//! Nodes are stored as blobs (kind `Node`) in packs, addressed by the BLAKE3 of their encoding,
//! which doubles as their checksum. Two versions that share a subtree share its node ids, so a
//! new version writes only changed leaves and the path to the root, a clone is a new pointer
//! to an existing root, and a diff can skip equal subtrees.
//!
//! Leaf encoding:     "CL" 0x01 0x00 | n (u32) | n × extent
//!   extent:          kind (u8: 0 zero run, 1 chunk) | length (u32) | chunk id (32, chunks only)
//! Interior encoding: "CI" 0x01 level (u8) | n (u16) | n × (slot (u16) | child id (32)),
//!                    slots strictly increasing.
//! Format 2, level 1, when a child's leaf digest is known (older commits wrote the form above):
//!                    "CI" 0x02 0x01 | n (u16) | n × (slot (u16) | child id (32) | flags (u8)
//!                    | [segment digest (32) | chunks (u32) | data bytes (u32)] if flags bit 0)
//!                    — the child leaf's `LeafDigest`, so a commit learns its parent's segment
//!                    digests from the level-1 nodes instead of every leaf.

use crate::codec::{Decoder, Encoder};
use crate::leaf_v2::LeafDigest;
use crate::{FormatError, FormatResult, Id};

pub(crate) const LEAF_MAGIC: [u8; 2] = *b"CL";
const INTERIOR_MAGIC: [u8; 2] = *b"CI";
const NODE_VERSION: u8 = 1;
/// The version of a level-1 node that carries its leaves' digests (format 2).
const INTERIOR_DIGESTS_VERSION: u8 = 2;
/// Flags bit 0 of a version 2 entry: the child's `LeafDigest` follows.
const CHILD_HAS_DIGEST: u8 = 1;

/// One extent of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Extent {
    /// `len` bytes of zeros: never stored.
    Zero { len: u32 },
    /// `len` bytes held by the chunk `id`.
    Chunk { id: Id, len: u32 },
}

impl Extent {
    pub fn len(&self) -> u32 {
        match *self {
            Extent::Zero { len } | Extent::Chunk { len, .. } => len,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The extents of one segment, in order. Adjacent zero runs are merged on construction.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Leaf {
    pub extents: Vec<Extent>,
}

impl Leaf {
    pub fn push(&mut self, e: Extent) {
        if e.is_empty() {
            return;
        }
        if let (Some(Extent::Zero { len: prev }), Extent::Zero { len }) =
            (self.extents.last_mut(), e)
        {
            *prev += len;
            return;
        }
        self.extents.push(e);
    }

    /// Logical bytes covered.
    pub fn len(&self) -> u64 {
        self.extents.iter().map(|e| e.len() as u64).sum()
    }

    /// The ids of the chunks the leaf refers to, in order (zero extents have none).
    pub fn chunk_ids(&self) -> impl Iterator<Item = Id> + '_ {
        self.extents.iter().filter_map(|e| match e {
            Extent::Chunk { id, .. } => Some(*id),
            Extent::Zero { .. } => None,
        })
    }

    pub fn is_empty(&self) -> bool {
        self.extents.is_empty()
    }

    /// True if the leaf holds no chunk (all zeros): such leaves are never stored.
    pub fn is_all_zero(&self) -> bool {
        self.extents
            .iter()
            .all(|e| matches!(e, Extent::Zero { .. }))
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::with_capacity(8 + self.extents.len() * 37);
        e.bytes(&LEAF_MAGIC)
            .u8(NODE_VERSION)
            .u8(0)
            .u32(self.extents.len() as u32);
        for x in &self.extents {
            match x {
                Extent::Zero { len } => e.u8(0).u32(*len),
                Extent::Chunk { id, len } => e.u8(1).u32(*len).id(id),
            };
        }
        e.finish()
    }

    pub fn decode(data: &[u8]) -> FormatResult<Self> {
        let mut d = Decoder::new(data, "manifest leaf");
        if d.take(2)? != LEAF_MAGIC {
            return Err(FormatError::BadMagic {
                what: "manifest leaf",
            });
        }
        check_version(d.u8()?, "manifest leaf")?;
        let _reserved = d.u8()?;
        let n = d.u32()? as usize;
        let mut extents = Vec::with_capacity(n.min(d.remaining() / 5));
        for _ in 0..n {
            let kind = d.u8()?;
            let len = d.u32()?;
            if len == 0 {
                return Err(FormatError::invalid("manifest leaf", "empty extent"));
            }
            extents.push(match kind {
                0 => Extent::Zero { len },
                1 => Extent::Chunk { id: d.id()?, len },
                k => {
                    return Err(FormatError::invalid(
                        "manifest leaf",
                        format!("unknown extent kind {k}"),
                    ))
                }
            });
        }
        d.finish()?;
        Ok(Leaf { extents })
    }
}

/// An interior node: sparse list of (slot, child id).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Interior {
    pub level: u8,
    pub children: Vec<(u16, Id)>,
    /// Format 2, level 1: each child leaf's digest and figures, in the order of `children`,
    /// where the writer knew them. Empty (or no `Some`): the node is encoded as version 1.
    pub leaf_digests: Vec<Option<LeafDigest>>,
}

impl Interior {
    /// A node without leaf digests (version 1).
    pub fn new(level: u8, children: Vec<(u16, Id)>) -> Self {
        Interior {
            level,
            children,
            leaf_digests: Vec::new(),
        }
    }

    /// Whether the node is encoded as version 2 (a level-1 node with a leaf digest).
    fn carries_digests(&self) -> bool {
        self.level == 1 && self.leaf_digests.iter().any(Option::is_some)
    }

    pub fn encode(&self) -> Vec<u8> {
        if self.carries_digests() {
            assert_eq!(
                self.leaf_digests.len(),
                self.children.len(),
                "one leaf digest entry per child"
            );
            let mut e = Encoder::with_capacity(6 + self.children.len() * 75);
            e.bytes(&INTERIOR_MAGIC)
                .u8(INTERIOR_DIGESTS_VERSION)
                .u8(self.level)
                .u16(self.children.len() as u16);
            for ((slot, id), digest) in self.children.iter().zip(&self.leaf_digests) {
                e.u16(*slot).id(id);
                match digest {
                    None => e.u8(0),
                    Some(d) => e
                        .u8(CHILD_HAS_DIGEST)
                        .id(&d.digest)
                        .u32(d.chunks)
                        .u32(d.data_bytes),
                };
            }
            return e.finish();
        }
        let mut e = Encoder::with_capacity(6 + self.children.len() * 34);
        e.bytes(&INTERIOR_MAGIC)
            .u8(NODE_VERSION)
            .u8(self.level)
            .u16(self.children.len() as u16);
        for (slot, id) in &self.children {
            e.u16(*slot).id(id);
        }
        e.finish()
    }

    pub fn decode(data: &[u8]) -> FormatResult<Self> {
        const WHAT: &str = "manifest node";
        let mut d = Decoder::new(data, WHAT);
        if d.take(2)? != INTERIOR_MAGIC {
            return Err(FormatError::BadMagic { what: WHAT });
        }
        let version = d.u8()?;
        let with_digests = version == INTERIOR_DIGESTS_VERSION;
        if !with_digests {
            check_version(version, WHAT)?;
        }
        let level = d.u8()?;
        if level == 0 {
            return Err(FormatError::invalid(WHAT, "interior node at level 0"));
        }
        if with_digests && level != 1 {
            return Err(FormatError::invalid(
                WHAT,
                format!("leaf digests in a node at level {level}"),
            ));
        }
        let n = d.u16()? as usize;
        let mut children = Vec::with_capacity(n.min(d.remaining() / 34));
        let mut leaf_digests = Vec::new();
        let mut prev: Option<u16> = None;
        for _ in 0..n {
            let slot = d.u16()?;
            if prev.is_some_and(|p| p >= slot) {
                return Err(FormatError::invalid(WHAT, "slots not increasing"));
            }
            prev = Some(slot);
            let id = d.id()?;
            if id.is_zero() {
                return Err(FormatError::invalid(WHAT, "zero child id"));
            }
            children.push((slot, id));
            if with_digests {
                leaf_digests.push(decode_leaf_digest(&mut d)?);
            }
        }
        d.finish()?;
        if with_digests && leaf_digests.iter().all(Option::is_none) {
            // One encoding per node: without a digest it is written as version 1.
            return Err(FormatError::invalid(
                WHAT,
                "version 2 without a leaf digest",
            ));
        }
        Ok(Interior {
            level,
            children,
            leaf_digests,
        })
    }

    /// The child at `slot`, if present.
    pub fn child(&self, slot: u16) -> Option<Id> {
        self.children
            .binary_search_by_key(&slot, |(s, _)| *s)
            .ok()
            .map(|i| self.children[i].1)
    }

    /// The leaf digest the node carries for its `i`-th child, if any.
    pub fn leaf_digest(&self, i: usize) -> Option<LeafDigest> {
        self.leaf_digests.get(i).copied().flatten()
    }
}

/// One entry's flags and, if flagged, its `LeafDigest` (a leaf holds data: 1 ≤ chunks ≤ data
/// bytes, since every chunk has at least one byte).
fn decode_leaf_digest(d: &mut Decoder<'_>) -> FormatResult<Option<LeafDigest>> {
    const WHAT: &str = "manifest node";
    match d.u8()? {
        0 => Ok(None),
        CHILD_HAS_DIGEST => {
            let digest = d.id()?;
            let (chunks, data_bytes) = (d.u32()?, d.u32()?);
            if chunks == 0 || chunks > data_bytes {
                return Err(FormatError::invalid(
                    WHAT,
                    format!("a leaf of {chunks} chunks and {data_bytes} data bytes"),
                ));
            }
            Ok(Some(LeafDigest {
                digest,
                chunks,
                data_bytes,
            }))
        }
        f => Err(FormatError::invalid(
            WHAT,
            format!("unknown child flags {f:#x}"),
        )),
    }
}

/// v1 nodes carry version 1 and nothing else: a v2 leaf (`leaf_v2`) is refused here by its
/// version even once this build writes v2, so the two decoders never read each other's bytes.
fn check_version(v: u8, what: &'static str) -> FormatResult<()> {
    match v {
        NODE_VERSION => Ok(()),
        0 => Err(FormatError::invalid(what, "version 0")),
        _ => Err(FormatError::TooNew {
            what,
            found: v as u32,
            supported: NODE_VERSION as u32,
        }),
    }
}

/// Number of interior levels needed for `segments` segments with `fanout` children per node
/// (at least 1, so the root is always an interior node).
pub fn tree_height(segments: u64, fanout: u16) -> u8 {
    let mut h = 1u8;
    let mut cover = fanout as u64;
    while cover < segments {
        cover = cover.saturating_mul(fanout as u64);
        h += 1;
    }
    h
}

/// The slot of segment `seg` in a node at `level`.
pub fn slot_at(seg: u64, level: u8, fanout: u16) -> u16 {
    let f = fanout as u64;
    ((seg / f.pow(level as u32 - 1)) % f) as u16
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn leaf_merges_zero_runs() {
        let mut l = Leaf::default();
        l.push(Extent::Zero { len: 10 });
        l.push(Extent::Zero { len: 5 });
        l.push(Extent::Chunk {
            id: Id::of(b"a"),
            len: 7,
        });
        l.push(Extent::Zero { len: 0 });
        assert_eq!(l.extents.len(), 2);
        assert_eq!(l.len(), 22);
        assert!(!l.is_all_zero());
    }

    #[test]
    fn heights_and_slots() {
        assert_eq!(tree_height(0, 256), 1);
        assert_eq!(tree_height(256, 256), 1);
        assert_eq!(tree_height(257, 256), 2);
        assert_eq!(tree_height(65536, 256), 2);
        assert_eq!(tree_height(65537, 256), 3);
        assert_eq!(slot_at(0x1234, 1, 256), 0x34);
        assert_eq!(slot_at(0x1234, 2, 256), 0x12);
    }

    proptest! {
        #[test]
        fn leaf_round_trip(lens in proptest::collection::vec((any::<bool>(), 1u32..1_000_000), 0..300)) {
            let mut l = Leaf::default();
            for (i, (zero, len)) in lens.into_iter().enumerate() {
                l.push(if zero { Extent::Zero { len } } else {
                    Extent::Chunk { id: Id::of(&i.to_le_bytes()), len }
                });
            }
            prop_assert_eq!(Leaf::decode(&l.encode()).unwrap(), l);
        }

        #[test]
        fn interior_round_trip(slots in proptest::collection::btree_set(0u16..256, 0..256)) {
            let n = Interior::new(
                2,
                slots.into_iter().map(|s| (s, Id::of(&s.to_le_bytes()))).collect(),
            );
            prop_assert_eq!(Interior::decode(&n.encode()).unwrap(), n);
        }

        #[test]
        fn level1_digests_round_trip(
            children in proptest::collection::btree_map(0u16..256, any::<Option<(u32, u32)>>(), 1..64),
        ) {
            let n = Interior {
                level: 1,
                children: children.keys().map(|&s| (s, Id::of(&s.to_le_bytes()))).collect(),
                leaf_digests: children.iter().map(|(&s, d)| d.map(|(a, b)| LeafDigest {
                    digest: Id::of(&[s as u8, 1]),
                    chunks: a.min(b).max(1),
                    data_bytes: a.max(b).max(1),
                })).collect(),
            };
            let decoded = Interior::decode(&n.encode()).unwrap();
            if n.leaf_digests.iter().any(Option::is_some) {
                prop_assert_eq!(decoded, n);
            } else {
                // Without a digest the node is version 1, which carries none.
                prop_assert_eq!(decoded, Interior::new(1, n.children.clone()));
            }
        }

        #[test]
        fn decoders_never_panic(data in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = Leaf::decode(&data);
            let _ = Interior::decode(&data);
        }
    }
}

//! Reference summaries: a Bloom filter of every blob a manifest tree refers to (the VM-centric
//! dedup paper's per-snapshot "reference summary vector", §3.2).
//!
//! Object `summaries/<root id>`, written by the commit that creates the root before its version
//! record is published, so every published version with that root has one (clones share it).
//! Fast deletion asks "could a live version still refer to blob B?" of the summaries of the
//! live versions: a Bloom filter never answers "no" for a member, so a blob they all reject is
//! unreferenced for certain; a false "maybe" only leaks the blob until the exact `gc --repair`.
//!
//! Two filters, because a false positive on a manifest node would keep its whole subtree:
//! chunks get `bits_per_chunk` bits each (configurable, default 24), nodes 256 bits and 16
//! probes each (see [`BITS_PER_NODE`]). Sizes are powers of two so that filters of one image, sized
//! the same way, can be merged with a bitwise OR. Probes use double hashing over the blob id,
//! which is already a uniform BLAKE3 hash: h1 = id[0..8], h2 = id[8..16] | 1 (little-endian),
//! bit i = (h1 + i·h2) mod 2^log2_bits.
//!
//! Envelope "CRNSUMM\0": chunk items (u64) | node items (u64) | chunk filter | node filter,
//! where a filter is log2 of its bit count (u8) | probes (u8) | 2^log2_bits / 8 bytes.

use crate::codec::{Decoder, Encoder};
use crate::envelope;
use crate::{FormatError, FormatResult, Id};

const MAGIC: &[u8; 8] = b"CRNSUMM\0";

/// Default bits per chunk; with the power-of-two rounding a filter has 24–48 bits per chunk.
pub const DEFAULT_BITS_PER_CHUNK: u8 = 24;
/// Bits and probes per manifest node. Far more than for chunks, for two reasons: a false
/// positive on a node keeps its whole subtree, and nodes churn much faster than chunks (a leaf
/// changes when any of its chunks does), so the OR of an image's summaries holds several times
/// more distinct nodes than one summary. At 256 bits and 16 probes the merged filter of ten
/// versions that share no node at all still answers wrongly less than once in 10^5.
pub const BITS_PER_NODE: u16 = 256;
pub const NODE_PROBES: u8 = 16;
/// Smallest and largest filter (2^9 bits = 64 bytes; 2^36 bits = 8 GiB).
const MIN_LOG2_BITS: u8 = 9;
const MAX_LOG2_BITS: u8 = 36;

/// The part of a blob id the filters use: (h1, h2 | 1) from its first 16 bytes. Writers that
/// collect many ids keep these 16 bytes instead of the whole id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ProbeKey(u64, u64);

impl ProbeKey {
    pub fn of(id: &Id) -> ProbeKey {
        let b = id.as_bytes();
        ProbeKey(
            u64::from_le_bytes(b[0..8].try_into().expect("8 bytes")),
            u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")) | 1,
        )
    }

    /// The two 64-bit hashes (for filters of other shapes than [`Bloom`]).
    pub fn halves(self) -> (u64, u64) {
        (self.0, self.1)
    }

    /// The probes of an 8-byte key alone (index runs version 2, whose filter must be
    /// rebuildable from their entries): h1 = the key, h2 = (key × 0x9E3779B97F4A7C15) rotated
    /// left by 32 bits, | 1 — the multiply spreads every key bit into h2's low bits, which
    /// the filter's mask keeps, so two keys share all probes only if they are equal.
    pub fn of_key(key: u64) -> ProbeKey {
        ProbeKey(
            key,
            key.wrapping_mul(0x9E37_79B9_7F4A_7C15).rotate_left(32) | 1,
        )
    }
}

/// A Bloom filter of blob ids with 2^log2_bits bits and `probes` hash functions.
#[derive(Clone, PartialEq, Eq)]
pub struct Bloom {
    log2_bits: u8,
    probes: u8,
    words: Vec<u64>,
}

impl std::fmt::Debug for Bloom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Bloom(2^{} bits, {} probes)",
            self.log2_bits, self.probes
        )
    }
}

/// Probes for `bits_per_item` bits per item: about half of it, which is a little below the
/// optimum (bits·ln 2) for a single filter and right for the OR of several versions' filters,
/// which together hold more distinct items than each one.
pub fn probes_for(bits_per_item: u8) -> u8 {
    (bits_per_item / 2).clamp(1, 32)
}

impl Bloom {
    /// An empty filter for `items` items at `bits_per_item` (rounded up to a power of two).
    pub fn with_capacity(items: u64, bits_per_item: u16, probes: u8) -> Bloom {
        let want = items.max(1).saturating_mul(bits_per_item.max(1) as u64);
        let log2 = (64 - (want - 1).leading_zeros()) as u8;
        let log2_bits = log2.clamp(MIN_LOG2_BITS, MAX_LOG2_BITS);
        Bloom {
            log2_bits,
            probes: probes.clamp(1, 32),
            words: vec![0; 1usize << (log2_bits - 6)],
        }
    }

    /// (log2 of the bit count, probes): filters with equal geometry can be merged.
    pub fn geometry(&self) -> (u8, u8) {
        (self.log2_bits, self.probes)
    }

    pub fn bit_count(&self) -> u64 {
        1u64 << self.log2_bits
    }

    pub fn byte_len(&self) -> usize {
        self.words.len() * 8
    }

    fn positions(&self, key: ProbeKey) -> impl Iterator<Item = usize> {
        let mask = self.bit_count() - 1;
        let ProbeKey(h1, h2) = key;
        (0..self.probes as u64).map(move |i| (h1.wrapping_add(i.wrapping_mul(h2)) & mask) as usize)
    }

    pub fn insert(&mut self, key: ProbeKey) {
        for p in self.positions(key) {
            self.words[p / 64] |= 1 << (p % 64);
        }
    }

    /// False means `id` was certainly never inserted.
    pub fn contains(&self, id: &Id) -> bool {
        self.contains_probe(ProbeKey::of(id))
    }

    /// False means `key` was certainly never inserted.
    pub fn contains_probe(&self, key: ProbeKey) -> bool {
        self.positions(key)
            .all(|p| self.words[p / 64] & (1 << (p % 64)) != 0)
    }

    /// Adds every member of `other` (same geometry required).
    pub fn union_with(&mut self, other: &Bloom) -> FormatResult<()> {
        if self.geometry() != other.geometry() {
            return Err(FormatError::invalid(
                "summary",
                "cannot merge filters of different geometry",
            ));
        }
        for (a, b) in self.words.iter_mut().zip(&other.words) {
            *a |= b;
        }
        Ok(())
    }

    /// Fraction of bits set (the false-positive rate is about this to the power `probes`).
    pub fn fill(&self) -> f64 {
        let ones: u64 = self.words.iter().map(|w| w.count_ones() as u64).sum();
        ones as f64 / self.bit_count() as f64
    }

    pub(crate) fn encode_into(&self, e: &mut Encoder) {
        e.u8(self.log2_bits).u8(self.probes);
        let mut raw = Vec::with_capacity(self.byte_len());
        for w in &self.words {
            raw.extend_from_slice(&w.to_le_bytes());
        }
        e.bytes(&raw);
    }

    /// Decodes a filter of the structure `what` (errors name it).
    pub(crate) fn decode_from(d: &mut Decoder<'_>, what: &'static str) -> FormatResult<Bloom> {
        let log2_bits = d.u8()?;
        let probes = d.u8()?;
        if !(MIN_LOG2_BITS..=MAX_LOG2_BITS).contains(&log2_bits) || !(1..=32).contains(&probes) {
            return Err(FormatError::invalid(
                what,
                format!("bad filter geometry 2^{log2_bits} bits, {probes} probes"),
            ));
        }
        let len = 1usize << (log2_bits - 3);
        let raw = d.take(len)?;
        let words = raw
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
            .collect();
        Ok(Bloom {
            log2_bits,
            probes,
            words,
        })
    }
}

/// The reference summary of one manifest tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Summary {
    /// Distinct chunks and nodes inserted (for sizing and for the leak estimate).
    pub chunk_items: u64,
    pub node_items: u64,
    pub chunks: Bloom,
    pub nodes: Bloom,
}

impl Summary {
    /// Builds the summary of a tree from the keys of its chunks and nodes (duplicates are
    /// removed here).
    pub fn build(
        mut chunks: Vec<ProbeKey>,
        mut nodes: Vec<ProbeKey>,
        bits_per_chunk: u8,
    ) -> Summary {
        for v in [&mut chunks, &mut nodes] {
            v.sort_unstable();
            v.dedup();
        }
        let mut s = Summary {
            chunk_items: chunks.len() as u64,
            node_items: nodes.len() as u64,
            chunks: Bloom::with_capacity(
                chunks.len() as u64,
                bits_per_chunk as u16,
                probes_for(bits_per_chunk),
            ),
            nodes: Bloom::with_capacity(nodes.len() as u64, BITS_PER_NODE, NODE_PROBES),
        };
        chunks.into_iter().for_each(|k| s.chunks.insert(k));
        nodes.into_iter().for_each(|k| s.nodes.insert(k));
        s
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::with_capacity(32 + self.chunks.byte_len() + self.nodes.byte_len());
        e.u64(self.chunk_items).u64(self.node_items);
        self.chunks.encode_into(&mut e);
        self.nodes.encode_into(&mut e);
        envelope::seal(MAGIC, &e.finish())
    }

    pub fn decode(data: &[u8]) -> FormatResult<Summary> {
        let mut d = Decoder::new(envelope::open(MAGIC, data, "summary")?, "summary");
        let s = Summary {
            chunk_items: d.u64()?,
            node_items: d.u64()?,
            chunks: Bloom::decode_from(&mut d, "summary")?,
            nodes: Bloom::decode_from(&mut d, "summary")?,
        };
        d.finish()?;
        Ok(s)
    }
}

/// The paper's equation (1): the chance that a blob outside a merged filter of `bits` bits
/// with `probes` hash functions, holding `items` distinct items, is judged a member.
pub fn false_positive_rate(bits: u64, probes: u8, items: u64) -> f64 {
    let zero = (1.0 - 1.0 / bits as f64).powf(probes as f64 * items as f64);
    (1.0 - zero).powi(probes as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(tag: &str, n: u64) -> Vec<Id> {
        (0..n)
            .map(|i| Id::of(format!("{tag}{i}").as_bytes()))
            .collect()
    }

    fn keys(ids: &[Id]) -> Vec<ProbeKey> {
        ids.iter().map(ProbeKey::of).collect()
    }

    #[test]
    fn members_are_always_found_and_round_trip() {
        let c = ids("c", 5000);
        let n = ids("n", 80);
        let s = Summary::build(keys(&c), keys(&n), DEFAULT_BITS_PER_CHUNK);
        assert!(c.iter().all(|id| s.chunks.contains(id)));
        assert!(n.iter().all(|id| s.nodes.contains(id)));
        let back = Summary::decode(&s.encode()).unwrap();
        assert_eq!(back, s);
        assert_eq!(s.chunks.bit_count(), 1 << 17); // 5000 × 24 = 120000 → 2^17
        assert_eq!(s.chunks.geometry().1, 12);
    }

    #[test]
    fn false_positive_rate_matches_equation_one() {
        let members = ids("m", 20_000);
        let s = Summary::build(keys(&members), vec![], 10);
        let others = ids("x", 200_000);
        let fp = others.iter().filter(|id| s.chunks.contains(id)).count() as f64 / 2e5;
        let predicted = false_positive_rate(s.chunks.bit_count(), 5, 20_000);
        assert!(
            (fp - predicted).abs() < predicted * 0.25 + 1e-4,
            "measured {fp}, predicted {predicted}"
        );
    }

    #[test]
    fn union_holds_both_and_refuses_other_geometry() {
        let a = ids("a", 1000);
        let b = ids("b", 1000);
        let mut sa = Summary::build(keys(&a), vec![], 24);
        let sb = Summary::build(keys(&b), vec![], 24);
        sa.chunks.union_with(&sb.chunks).unwrap();
        assert!(a.iter().chain(&b).all(|id| sa.chunks.contains(id)));
        let big = Summary::build(keys(&ids("c", 100_000)), vec![], 24);
        assert!(sa.chunks.union_with(&big.chunks).is_err());
    }

    #[test]
    fn rejects_bad_geometry() {
        let s = Summary::build(keys(&ids("a", 3)), vec![], 24);
        let raw = s.encode();
        let mut payload = envelope::open(MAGIC, &raw, "summary").unwrap().to_vec();
        // The chunk filter's log2 byte follows the two u64 counts.
        payload[16] = 60;
        let err = Summary::decode(&envelope::seal(MAGIC, &payload)).unwrap_err();
        assert!(err.to_string().contains("bad filter geometry"), "{err}");
    }
}

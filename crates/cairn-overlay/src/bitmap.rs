//! One bit per block, and its checksummed on-disk encoding.
//!
//! File layout (all integers little-endian):
//!
//! ```text
//! offset  size  field
//!      0     8  magic "CAIRNOVB"
//!      8     4  format version (1)
//!     12     4  encoding: 0 = dense (one bit per block), 1 = sparse (list of block indexes)
//!     16     8  layer id the bitmap belongs to
//!     24     8  number of blocks of the image
//!     32     8  number of set bits
//!     40     n  payload: dense = ceil(blocks/64) u64 words (bit i of word w is block 64w+i);
//!               sparse = the set block indexes as u64, strictly increasing
//!   40+n    32  BLAKE3 of bytes 0..40+n
//! ```
//!
//! The smaller encoding is chosen on write, so the bitmap of an empty or nearly empty layer
//! costs a few bytes whatever the image size.

use std::path::Path;

use crate::OverlayError;

const MAGIC: &[u8; 8] = b"CAIRNOVB";
const VERSION: u32 = 1;
const ENC_DENSE: u32 = 0;
const ENC_SPARSE: u32 = 1;
const HEADER: usize = 40;
const TRAILER: usize = 32;

/// A fixed-size set of block indexes.
///
/// Two levels, so that the work of a snapshot operation follows the blocks its layers hold,
/// not the image's size: the words (one bit per block) are allocated at the first set bit, and
/// a summary (one bit per word) says which words have any bit set, so iterating and combining
/// touch only those.
#[derive(Clone, Debug)]
pub(crate) struct Bitmap {
    /// Empty until a bit is set.
    words: Vec<u64>,
    /// Bit `w` is set iff `words[w] != 0`; empty while `words` is.
    summary: Vec<u64>,
    nblocks: u64,
    count: u64,
}

impl PartialEq for Bitmap {
    fn eq(&self, other: &Bitmap) -> bool {
        self.nblocks == other.nblocks
            && self.count == other.count
            && self.nonzero_words().eq(other.nonzero_words())
    }
}

impl Eq for Bitmap {}

impl Bitmap {
    pub(crate) fn new(nblocks: u64) -> Bitmap {
        Bitmap {
            words: Vec::new(),
            summary: Vec::new(),
            nblocks,
            count: 0,
        }
    }

    fn word_count(&self) -> usize {
        self.nblocks.div_ceil(64) as usize
    }

    fn allocate(&mut self) {
        if self.words.is_empty() {
            self.words = vec![0; self.word_count()];
            self.summary = vec![0; self.word_count().div_ceil(64)];
        }
    }

    /// Word `wi` (0 when nothing is allocated).
    fn word(&self, wi: usize) -> u64 {
        self.words.get(wi).copied().unwrap_or(0)
    }

    /// Stores word `wi`, keeping the summary and the count.
    fn put_word(&mut self, wi: usize, w: u64) {
        let old = self.words[wi];
        if old == w {
            return;
        }
        self.words[wi] = w;
        self.count = self.count - u64::from(old.count_ones()) + u64::from(w.count_ones());
        let (si, m) = (wi / 64, 1u64 << (wi % 64));
        if w == 0 {
            self.summary[si] &= !m;
        } else {
            self.summary[si] |= m;
        }
    }

    /// `(index, word)` of the words with a bit set, in increasing order.
    fn nonzero_words(&self) -> impl Iterator<Item = (usize, u64)> + '_ {
        self.summary.iter().enumerate().flat_map(move |(si, &s)| {
            let mut s = s;
            std::iter::from_fn(move || {
                if s == 0 {
                    return None;
                }
                let wi = si * 64 + s.trailing_zeros() as usize;
                s &= s - 1;
                Some((wi, self.words[wi]))
            })
        })
    }

    pub(crate) fn count(&self) -> u64 {
        self.count
    }

    pub(crate) fn get(&self, block: u64) -> bool {
        block < self.nblocks && self.word((block / 64) as usize) & (1 << (block % 64)) != 0
    }

    /// Sets the bit; returns whether it was clear before.
    pub(crate) fn set(&mut self, block: u64) -> bool {
        self.allocate();
        let wi = (block / 64) as usize;
        let m = 1u64 << (block % 64);
        let w = self.words[wi];
        if w & m != 0 {
            return false;
        }
        self.put_word(wi, w | m);
        true
    }

    /// Adds every block of `other` (of the same image).
    pub(crate) fn union_with(&mut self, other: &Bitmap) {
        debug_assert_eq!(self.nblocks, other.nblocks);
        if other.count == 0 {
            return;
        }
        self.allocate();
        for (wi, o) in other.nonzero_words() {
            let w = self.words[wi];
            self.put_word(wi, w | o);
        }
    }

    /// The blocks both hold (work follows the blocks of the one with fewer).
    pub(crate) fn intersection(a: &Bitmap, b: &Bitmap) -> Bitmap {
        let (small, large) = if a.count <= b.count { (a, b) } else { (b, a) };
        let mut out = Bitmap::new(a.nblocks);
        for (wi, w) in small.nonzero_words() {
            let both = w & large.word(wi);
            if both != 0 {
                out.allocate();
                out.put_word(wi, both);
            }
        }
        out
    }

    /// Keeps only the blocks `other` holds too.
    pub(crate) fn intersect_with(&mut self, other: &Bitmap) {
        self.retain_words(|wi, w| w & other.word(wi));
    }

    /// Drops every block `other` holds.
    pub(crate) fn subtract(&mut self, other: &Bitmap) {
        self.retain_words(|wi, w| w & !other.word(wi));
    }

    /// Replaces each word with a bit set by `f(index, word)` (which may only clear bits).
    fn retain_words(&mut self, f: impl Fn(usize, u64) -> u64) {
        let changed: Vec<(usize, u64)> =
            self.nonzero_words().map(|(wi, w)| (wi, f(wi, w))).collect();
        for (wi, w) in changed {
            self.put_word(wi, w);
        }
    }

    /// Whether any block in `start..end` is set (the words between the ends are asked
    /// through the summary).
    pub(crate) fn any_in(&self, start: u64, end: u64) -> bool {
        let end = end.min(self.nblocks);
        if start >= end || self.count == 0 {
            return false;
        }
        let (w0, w1) = ((start / 64) as usize, ((end - 1) / 64) as usize);
        let lo = u64::MAX << (start % 64);
        let hi = u64::MAX >> (63 - (end - 1) % 64);
        if w0 == w1 {
            return self.word(w0) & lo & hi != 0;
        }
        self.word(w0) & lo != 0 || self.word(w1) & hi != 0 || self.any_word_in(w0 + 1, w1)
    }

    /// Whether any word in `a..b` has a bit set.
    fn any_word_in(&self, a: usize, b: usize) -> bool {
        if a >= b {
            return false;
        }
        let (s0, s1) = (a / 64, (b - 1) / 64);
        let lo = u64::MAX << (a % 64);
        let hi = u64::MAX >> (63 - (b - 1) % 64);
        if s0 == s1 {
            return self.summary[s0] & lo & hi != 0;
        }
        self.summary[s0] & lo != 0
            || self.summary[s1] & hi != 0
            || self.summary[s0 + 1..s1].iter().any(|&w| w != 0)
    }

    /// Runs of consecutive set blocks, as `(first, count)`, in increasing order.
    pub(crate) fn runs(&self) -> Vec<(u64, u64)> {
        let mut runs: Vec<(u64, u64)> = Vec::new();
        for b in self.iter() {
            match runs.last_mut() {
                Some((first, n)) if *first + *n == b => *n += 1,
                _ => runs.push((b, 1)),
            }
        }
        runs
    }

    /// Set blocks in increasing order (only words with a bit set are visited).
    pub(crate) fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.nonzero_words().flat_map(|(wi, w)| {
            let mut w = w;
            std::iter::from_fn(move || {
                if w == 0 {
                    return None;
                }
                let bit = w.trailing_zeros() as u64;
                w &= w - 1;
                Some(wi as u64 * 64 + bit)
            })
        })
    }

    /// Encodes the bitmap of layer `layer_id`.
    pub(crate) fn encode(&self, layer_id: u64) -> Vec<u8> {
        let dense_len = self.word_count() * 8;
        let sparse_len = self.count as usize * 8;
        let (enc, payload_len) = if sparse_len < dense_len {
            (ENC_SPARSE, sparse_len)
        } else {
            (ENC_DENSE, dense_len)
        };
        let mut out = Vec::with_capacity(HEADER + payload_len + TRAILER);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&enc.to_le_bytes());
        out.extend_from_slice(&layer_id.to_le_bytes());
        out.extend_from_slice(&self.nblocks.to_le_bytes());
        out.extend_from_slice(&self.count.to_le_bytes());
        if enc == ENC_SPARSE {
            for b in self.iter() {
                out.extend_from_slice(&b.to_le_bytes());
            }
        } else {
            for wi in 0..self.word_count() {
                out.extend_from_slice(&self.word(wi).to_le_bytes());
            }
        }
        let hash = blake3::hash(&out);
        out.extend_from_slice(hash.as_bytes());
        out
    }

    /// Decodes and verifies the bitmap file `path`, which must belong to layer `layer_id` of
    /// an image of `nblocks` blocks.
    pub(crate) fn decode(
        bytes: &[u8],
        path: &Path,
        layer_id: u64,
        nblocks: u64,
    ) -> Result<Bitmap, OverlayError> {
        let bad = |reason: String| OverlayError::corrupt(path, reason);
        if bytes.len() < HEADER + TRAILER {
            return Err(bad(format!(
                "truncated: {} bytes, a bitmap file has at least {}",
                bytes.len(),
                HEADER + TRAILER
            )));
        }
        if &bytes[..8] != MAGIC {
            return Err(bad("not an overlay bitmap (bad magic)".into()));
        }
        let (body, sum) = bytes.split_at(bytes.len() - TRAILER);
        if blake3::hash(body).as_bytes() != sum {
            return Err(bad("checksum mismatch (truncated or corrupted)".into()));
        }
        let u32_at = |o: usize| u32::from_le_bytes(body[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(body[o..o + 8].try_into().unwrap());
        let version = u32_at(8);
        if version != VERSION {
            return Err(bad(format!("unsupported bitmap format version {version}")));
        }
        let enc = u32_at(12);
        let id = u64_at(16);
        if id != layer_id {
            return Err(bad(format!(
                "belongs to layer {id}, expected layer {layer_id}"
            )));
        }
        let n = u64_at(24);
        if n != nblocks {
            return Err(bad(format!("covers {n} blocks, the image has {nblocks}")));
        }
        let count = u64_at(32);
        let payload = &body[HEADER..];
        let mut bm = Bitmap::new(nblocks);
        match enc {
            ENC_DENSE => {
                if payload.len() != bm.word_count() * 8 {
                    return Err(bad(format!(
                        "dense payload is {} bytes, expected {}",
                        payload.len(),
                        bm.word_count() * 8
                    )));
                }
                if nblocks & 63 != 0 {
                    let last = u64::from_le_bytes(payload[payload.len() - 8..].try_into().unwrap());
                    if last >> (nblocks % 64) != 0 {
                        return Err(bad("bits set past the end of the image".into()));
                    }
                }
                for (wi, c) in payload.chunks_exact(8).enumerate() {
                    let w = u64::from_le_bytes(c.try_into().unwrap());
                    if w != 0 {
                        bm.allocate();
                        bm.put_word(wi, w);
                    }
                }
                if bm.count != count {
                    return Err(bad(format!(
                        "header says {count} blocks, bitmap has {}",
                        bm.count
                    )));
                }
            }
            ENC_SPARSE => {
                if payload.len() as u64 != count.saturating_mul(8) {
                    return Err(bad(format!(
                        "sparse payload is {} bytes for {count} blocks",
                        payload.len()
                    )));
                }
                let mut prev: Option<u64> = None;
                for c in payload.chunks_exact(8) {
                    let b = u64::from_le_bytes(c.try_into().unwrap());
                    if b >= nblocks || prev.is_some_and(|p| p >= b) {
                        return Err(bad(format!("invalid block index {b} in sparse bitmap")));
                    }
                    prev = Some(b);
                    bm.set(b);
                }
            }
            other => return Err(bad(format!("unknown bitmap encoding {other}"))),
        }
        Ok(bm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Fuzzing the parser: arbitrary bytes never panic.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400), n in 0u64..2000) {
            let _ = Bitmap::decode(&bytes, Path::new("f.bitmap"), 1, n);
        }
    }

    #[test]
    fn every_bit_flip_and_truncation_is_rejected() {
        let p = Path::new("x.bitmap");
        for n in [100u64, 5000] {
            let mut bm = Bitmap::new(n);
            for b in (0..n).step_by(7) {
                bm.set(b);
            }
            let good = bm.encode(9);
            for i in 0..good.len() {
                for bit in 0..8 {
                    let mut bad = good.clone();
                    bad[i] ^= 1 << bit;
                    assert!(Bitmap::decode(&bad, p, 9, n).is_err(), "flip {i}:{bit}");
                }
                assert!(
                    Bitmap::decode(&good[..i], p, 9, n).is_err(),
                    "truncated to {i}"
                );
            }
        }
    }

    #[test]
    fn set_operations_and_runs() {
        let of = |bits: &[u64]| {
            let mut bm = Bitmap::new(200);
            for &b in bits {
                bm.set(b);
            }
            bm
        };
        let mut a = of(&[1, 2, 3, 64, 65, 199]);
        let b = of(&[2, 3, 4, 65, 150]);
        let mut i = a.clone();
        i.intersect_with(&b);
        assert_eq!(i, of(&[2, 3, 65]));
        assert_eq!(Bitmap::intersection(&a, &b), i);
        assert_eq!(Bitmap::intersection(&b, &a), i);
        let mut u = a.clone();
        u.union_with(&b);
        assert_eq!(u, of(&[1, 2, 3, 4, 64, 65, 150, 199]));
        a.subtract(&b);
        assert_eq!(a, of(&[1, 64, 199]));
        assert_eq!(u.runs(), vec![(1, 4), (64, 2), (150, 1), (199, 1)]);
        assert!(u.any_in(0, 2) && u.any_in(63, 65) && u.any_in(150, 151));
        assert!(!u.any_in(5, 64) && !u.any_in(66, 150) && !u.any_in(151, 199));
        assert!(!u.any_in(0, 0) && u.any_in(199, 1000));
        // Long ranges go through the summary.
        let mut big = Bitmap::new(1 << 20);
        assert!(!big.any_in(0, 1 << 20));
        big.set(300_000);
        assert!(big.any_in(0, 1 << 20) && big.any_in(300_000, 300_001));
        assert!(!big.any_in(0, 300_000) && !big.any_in(300_001, 1 << 20));
        assert!(big.any_in(299_000, 400_000) && big.any_in(4096 * 64, 300_001));
        let mut cleared = big.clone();
        cleared.subtract(&big);
        assert_eq!(cleared, Bitmap::new(1 << 20));
        assert!(!cleared.any_in(0, 1 << 20));
    }

    #[test]
    fn round_trip_both_encodings() {
        let p = Path::new("x.bitmap");
        for n in [0u64, 1, 63, 64, 65, 1000] {
            let mut bm = Bitmap::new(n);
            assert_eq!(Bitmap::decode(&bm.encode(3), p, 3, n).unwrap(), bm);
            for b in (0..n).step_by(2) {
                bm.set(b);
            }
            let enc = bm.encode(3);
            let back = Bitmap::decode(&enc, p, 3, n).unwrap();
            assert_eq!(back, bm);
            assert_eq!(
                back.iter().collect::<Vec<_>>(),
                (0..n).step_by(2).collect::<Vec<_>>()
            );
            assert!(Bitmap::decode(&enc, p, 4, n).is_err());
            for cut in [1, 7, enc.len() / 2] {
                assert!(Bitmap::decode(&enc[..enc.len() - cut], p, 3, n).is_err());
            }
        }
        let mut bm = Bitmap::new(10_000);
        bm.set(9_999);
        // Sparse encoding keeps small layers small.
        assert_eq!(bm.encode(0).len(), HEADER + 8 + TRAILER);
    }
}

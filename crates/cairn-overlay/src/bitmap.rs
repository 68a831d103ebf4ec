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
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Bitmap {
    words: Vec<u64>,
    nblocks: u64,
    count: u64,
}

impl Bitmap {
    pub(crate) fn new(nblocks: u64) -> Bitmap {
        Bitmap {
            words: vec![0; nblocks.div_ceil(64) as usize],
            nblocks,
            count: 0,
        }
    }

    pub(crate) fn count(&self) -> u64 {
        self.count
    }

    pub(crate) fn get(&self, block: u64) -> bool {
        block < self.nblocks && self.words[(block / 64) as usize] & (1 << (block % 64)) != 0
    }

    /// Sets the bit; returns whether it was clear before.
    pub(crate) fn set(&mut self, block: u64) -> bool {
        let w = &mut self.words[(block / 64) as usize];
        let m = 1u64 << (block % 64);
        if *w & m == 0 {
            *w |= m;
            self.count += 1;
            true
        } else {
            false
        }
    }

    /// Set blocks in increasing order (skips empty words).
    pub(crate) fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.words.iter().enumerate().flat_map(|(wi, &w)| {
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
        let dense_len = self.words.len() * 8;
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
            for w in &self.words {
                out.extend_from_slice(&w.to_le_bytes());
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
                if payload.len() != bm.words.len() * 8 {
                    return Err(bad(format!(
                        "dense payload is {} bytes, expected {}",
                        payload.len(),
                        bm.words.len() * 8
                    )));
                }
                for (w, c) in bm.words.iter_mut().zip(payload.chunks_exact(8)) {
                    *w = u64::from_le_bytes(c.try_into().unwrap());
                }
                if nblocks & 63 != 0 {
                    let last = *bm.words.last().unwrap();
                    if last >> (nblocks % 64) != 0 {
                        return Err(bad("bits set past the end of the image".into()));
                    }
                }
                bm.count = bm.words.iter().map(|w| w.count_ones() as u64).sum();
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

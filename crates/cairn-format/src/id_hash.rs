//! A fast hasher for maps keyed by [`Id`]: std's SipHash costs more than the rest of a
//! commit's per-chunk bookkeeping (the trace benchmark measured SipHash at a third of its
//! time), and ids need little: they are BLAKE3 digests or keyed MACs already.
//!
//! Not a bare prefix, though: in an unencrypted repository a chunk id is the BLAKE3 of bytes
//! a guest chose, and a map indexed by raw id bits lets whoever writes the disk cheaply craft
//! many ids that fall into one bucket chain. The hasher folds every 8-byte word of the input
//! and finishes with a keyed bijective mix (SplitMix64's finalizer over the fold xor a key
//! drawn per map from std's `RandomState`), so two ids collide only where their folds do,
//! which no one can aim at without the key.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasher, Hasher};

use crate::Id;

/// Builds [`IdHasher`]s with a per-map random key.
#[derive(Clone, Debug)]
pub struct IdHashBuilder {
    key: u64,
}

impl Default for IdHashBuilder {
    fn default() -> Self {
        IdHashBuilder {
            key: std::hash::RandomState::new().hash_one(0x6361_6972_6e5f_6964_u64),
        }
    }
}

impl BuildHasher for IdHashBuilder {
    type Hasher = IdHasher;

    fn build_hasher(&self) -> IdHasher {
        IdHasher {
            key: self.key,
            fold: 0,
        }
    }
}

/// See the module's doc.
#[derive(Debug, Clone)]
pub struct IdHasher {
    key: u64,
    fold: u64,
}

impl IdHasher {
    fn word(&mut self, w: u64) {
        self.fold = (self.fold ^ w)
            .wrapping_mul(0x9e37_79b9_7f4a_7c15)
            .rotate_left(29);
    }
}

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut words = bytes.chunks_exact(8);
        for w in words.by_ref() {
            self.word(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        }
        let rest = words.remainder();
        if !rest.is_empty() {
            let mut last = [0u8; 8];
            last[..rest.len()].copy_from_slice(rest);
            self.word(u64::from_le_bytes(last) ^ (rest.len() as u64) << 59);
        }
    }

    fn write_usize(&mut self, n: usize) {
        self.word(n as u64);
    }

    fn finish(&self) -> u64 {
        let mut z = self.fold ^ self.key;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// A map keyed by ids, hashed with [`IdHasher`].
pub type IdMap<V> = HashMap<Id, V, IdHashBuilder>;
/// A set of ids, hashed with [`IdHasher`].
pub type IdSet = HashSet<Id, IdHashBuilder>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_ids_hash_equal_and_every_byte_counts() {
        let b = IdHashBuilder::default();
        let a = Id::of(b"a");
        assert_eq!(b.hash_one(a), b.hash_one(a));
        for byte in [0, 7, 8, 31] {
            let mut c = a;
            c.0[byte] ^= 1;
            assert_ne!(b.hash_one(a), b.hash_one(c), "byte {byte}");
        }
        // Each map has its own key.
        assert_ne!(b.hash_one(a), IdHashBuilder::default().hash_one(a));
    }

    #[test]
    fn maps_work_with_it() {
        let mut m: IdMap<u32> = IdMap::default();
        for i in 0..1000u32 {
            m.insert(Id::of(&i.to_le_bytes()), i);
        }
        assert!((0..1000u32).all(|i| m[&Id::of(&i.to_le_bytes())] == i));
        let s: IdSet = m.keys().copied().collect();
        assert_eq!(s.len(), 1000);
    }
}

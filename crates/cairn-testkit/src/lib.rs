//! Test data shared by the tests of every cairn crate (a dev-dependency only).
//!
//! Store wrappers for fault injection and counting live in `cairn-store`
//! (`FailingStore`, `CountingStore`), beside the stores they wrap.
#![forbid(unsafe_code)]

/// Deterministic pseudo-random bytes (xorshift64 from `seed`): incompressible data that
/// never deduplicates against another seed's, the same on every run.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn noise_is_deterministic_and_seed_dependent() {
        assert_eq!(noise(64, 1), noise(64, 1));
        assert_ne!(noise(64, 1), noise(64, 2));
        assert_eq!(
            &noise(8, 1)[..],
            &noise(64, 1)[..8],
            "a prefix of a longer run"
        );
    }
}

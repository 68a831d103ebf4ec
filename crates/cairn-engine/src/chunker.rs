//! Cutting a segment into chunks.
//!
//! Chunk boundaries restart at every segment boundary, so a change in one segment never moves
//! the chunks of another: fixed-size chunks stay aligned to the disk's blocks (VM images are
//! block-aligned, which is why fixed chunks dedup nearly as well as CDC on disk images and
//! are far cheaper), and FastCDC (optional) resynchronises within the segment.

use std::ops::Range;

use cairn_format::config::{Chunker, RepoConfig};

/// The chunk ranges of `data` (one segment, or the shorter last one).
pub fn chunk_ranges(config: &RepoConfig, data: &[u8]) -> Vec<Range<usize>> {
    let size = config.chunk_size as usize;
    match config.chunker {
        Chunker::Fixed => (0..data.len())
            .step_by(size)
            .map(|start| start..(start + size).min(data.len()))
            .collect(),
        Chunker::FastCdc => {
            if data.len() <= size / 4 {
                return std::iter::once(0..data.len())
                    .filter(|r| !r.is_empty())
                    .collect();
            }
            let min = (size / 4) as u32;
            let avg = size as u32;
            let max = (size * 4) as u32;
            fastcdc::v2020::FastCDC::new(data, min, avg, max)
                .map(|c| c.offset..c.offset + c.length)
                .collect()
        }
    }
}

/// True if every byte is zero. Word-at-a-time; the hot path of sparse-ish images.
pub fn is_zero(data: &[u8]) -> bool {
    let (head, words, tail) = {
        // SAFETY: every bit pattern is a valid u64, and align_to only reinterprets the
        // correctly aligned middle part of the slice.
        unsafe { data.align_to::<u64>() }
    };
    head.iter().all(|&b| b == 0) && tail.iter().all(|&b| b == 0) && words.iter().all(|&w| w == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_format::config::Compression;
    use proptest::prelude::*;

    fn cfg(chunker: Chunker, chunk_size: u32) -> RepoConfig {
        RepoConfig {
            chunker,
            chunk_size,
            compression: Compression::None,
            ..RepoConfig::default()
        }
    }

    proptest! {
        #[test]
        fn chunks_tile_the_segment(len in 0usize..300_000, cdc in any::<bool>(), seed in any::<u64>()) {
            let mut x = seed | 1;
            let data: Vec<u8> = (0..len).map(|_| { x ^= x << 13; x ^= x >> 7; x ^= x << 17; x as u8 }).collect();
            let c = cfg(if cdc { Chunker::FastCdc } else { Chunker::Fixed }, 16384);
            let ranges = chunk_ranges(&c, &data);
            let mut pos = 0;
            for r in &ranges {
                prop_assert_eq!(r.start, pos);
                prop_assert!(r.end > r.start);
                prop_assert!(r.len() <= 4 * 16384);
                pos = r.end;
            }
            prop_assert_eq!(pos, len);
        }
    }

    #[test]
    fn fixed_chunks_are_aligned() {
        let data = vec![1u8; 40000];
        let r = chunk_ranges(&cfg(Chunker::Fixed, 16384), &data);
        assert_eq!(r, vec![0..16384, 16384..32768, 32768..40000]);
    }

    #[test]
    fn zero_detection() {
        let mut v = vec![0u8; 4099];
        assert!(is_zero(&v));
        assert!(is_zero(&v[1..]));
        v[4098] = 1;
        assert!(!is_zero(&v));
        assert!(!is_zero(&v[3..]));
        assert!(is_zero(&[]));
    }
}

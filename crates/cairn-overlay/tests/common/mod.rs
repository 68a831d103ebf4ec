#![allow(dead_code)]

use cairn_overlay::Overlay;

pub const BS: u32 = 4096;

/// Deterministic content for (block, seed): distinct per block and seed, never all zero.
pub fn pattern(block: u64, seed: u64, len: usize) -> Vec<u8> {
    let mut x = block
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(seed.wrapping_mul(0xD1B5_4A32_D192_ED03))
        | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8 | 1
        })
        .collect()
}

pub fn write(o: &Overlay, block: u64, seed: u64) {
    let len = o.block_len(block) as usize;
    o.write_block(block, &pattern(block, seed, len)).unwrap();
}

/// Whole content of a held block, or None.
pub fn read(o: &Overlay, block: u64) -> Option<Vec<u8>> {
    let mut buf = vec![0u8; o.block_len(block) as usize];
    o.read_if_held(block, 0, &mut buf).unwrap().then_some(buf)
}

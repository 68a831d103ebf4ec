#![allow(dead_code)]

use cairn_overlay::Overlay;

pub const BS: u32 = 4096;

/// Deterministic content for (block, seed): distinct per block and seed, never all zero.
pub fn pattern(block: u64, seed: u64, len: usize) -> Vec<u8> {
    cairn_testkit::nonzero_noise(len, block.wrapping_mul(0x1_0000_0001) ^ seed)
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

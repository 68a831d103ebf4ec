//! The [`Export`] contract as one executable check, for the tests of every backend (the
//! in-memory export, cairn's lazy version export with and without an overlay): the server
//! relies on it for every byte it sends.
//!
//! [`check`] panics with a message naming the broken rule. It only makes calls the server
//! would make (`offset + len <= size()`, `len > 0`, at most 32 MiB, writes only to a writable
//! export), and leaves a writable export holding different bytes than it found.

use std::sync::Arc;

use bytes::Bytes;

use crate::Export;

/// Checks `export`, whose bytes are `expected`:
///
/// 1. `size()` is `expected.len()`; the preferred block size is a power of two ≥ 512;
/// 2. `read` returns `expected` in odd-sized, unaligned pieces and from eight concurrent
///    calls;
/// 3. `block_status` answers every range with at least one extent, none empty, none past the
///    range, and the ranges it calls zero read as zeros;
/// 4. `cache` is harmless;
/// 5. if writable: unaligned writes (with and without FUA) read back, `write_zeroes` reads
///    back as zeros and may be reported zero, concurrent writes to disjoint ranges all land,
///    `flush` succeeds, and bytes around every write are untouched.
pub async fn check(export: Arc<dyn Export>, expected: Vec<u8>) {
    let size = export.size();
    assert_eq!(size, expected.len() as u64, "size()");
    let bs = export.preferred_block_size();
    assert!(
        bs >= 512 && bs.is_power_of_two(),
        "preferred block size {bs}"
    );
    let mut model = expected;

    check_reads(&export, &model).await;
    check_block_status(&export, &model).await;
    if size > 0 {
        export
            .cache(0, size.min(1 << 20) as u32)
            .await
            .expect("cache()");
    }
    check_reads(&export, &model).await;
    if export.read_only() || size < 64 << 10 {
        return;
    }

    // Unaligned writes, one with FUA.
    for (i, (offset, len)) in [
        (1u64, 1usize),
        (4095, 2),
        (size / 3 + 7, 70_001),
        (size - 3, 3),
    ]
    .into_iter()
    .enumerate()
    {
        let data: Vec<u8> = (0..len).map(|k| (k as u8) ^ (0x5a + i as u8)).collect();
        export
            .write(offset, Bytes::from(data.clone()), i == 1)
            .await
            .unwrap_or_else(|e| panic!("write({offset}, {len}): {e}"));
        model[offset as usize..offset as usize + len].copy_from_slice(&data);
    }
    check_reads(&export, &model).await;

    // Zeroes, unaligned and block-sized.
    for (offset, len) in [(size / 2 + 5, 9_000u32), (0, 4096)] {
        export
            .write_zeroes(offset, len, true, false)
            .await
            .unwrap_or_else(|e| panic!("write_zeroes({offset}, {len}): {e}"));
        model[offset as usize..offset as usize + len as usize].fill(0);
    }
    check_reads(&export, &model).await;
    check_block_status(&export, &model).await;

    // Concurrent writes to disjoint ranges.
    let stripe = (size / 8).min(1 << 20);
    let mut tasks = Vec::new();
    for t in 0..8u64 {
        let export = export.clone();
        let offset = t * (size / 8) + 11;
        let len = (stripe - 22) as usize;
        let data: Vec<u8> = (0..len)
            .map(|k| (k as u8).wrapping_mul(t as u8 + 3))
            .collect();
        model[offset as usize..offset as usize + len].copy_from_slice(&data);
        tasks.push(tokio::spawn(async move {
            export.write(offset, Bytes::from(data), false).await
        }));
    }
    for t in tasks {
        t.await.expect("write task").expect("concurrent write");
    }
    export.flush().await.expect("flush()");
    check_reads(&export, &model).await;
    check_block_status(&export, &model).await;
}

/// Reads the whole export in odd-sized pieces, then eight ranges at once.
async fn check_reads(export: &Arc<dyn Export>, model: &[u8]) {
    let size = model.len() as u64;
    let mut offset = 0u64;
    let mut step = 1_021u64;
    while offset < size {
        let len = step.min(size - offset).min(32 << 20) as u32;
        let got = export
            .read(offset, len)
            .await
            .unwrap_or_else(|e| panic!("read({offset}, {len}): {e}"));
        assert!(
            got[..] == model[offset as usize..offset as usize + len as usize],
            "read({offset}, {len}) differs"
        );
        offset += len as u64;
        step = step * 13 % 1_500_007 + 1;
    }
    let mut tasks = Vec::new();
    for t in 0..8u64 {
        let export = export.clone();
        let offset = (t * 524_309) % size.max(1);
        let len = (131_071 + t as u32).min((size - offset) as u32);
        if len == 0 {
            continue;
        }
        tasks.push(tokio::spawn(async move {
            (offset, len, export.read(offset, len).await)
        }));
    }
    for t in tasks {
        let (offset, len, got) = t.await.expect("read task");
        let got = got.unwrap_or_else(|e| panic!("concurrent read({offset}, {len}): {e}"));
        assert!(
            got[..] == model[offset as usize..offset as usize + len as usize],
            "concurrent read({offset}, {len}) differs"
        );
    }
}

/// Asks for the status of the whole export (in requests of up to 4 MiB) and of an unaligned
/// range; checks the extents against the bytes.
async fn check_block_status(export: &Arc<dyn Export>, model: &[u8]) {
    let size = model.len() as u64;
    let ranges = [(0u64, size), (size / 3 + 1, (size / 3).max(1))];
    for (start, len) in ranges {
        let end = (start + len).min(size);
        let mut at = start;
        while at < end {
            let ask = (end - at).min(4 << 20) as u32;
            let extents = export
                .block_status(at, ask)
                .await
                .unwrap_or_else(|e| panic!("block_status({at}, {ask}): {e}"));
            assert!(!extents.is_empty(), "block_status({at}, {ask}): no extent");
            let mut pos = at;
            for e in &extents {
                assert!(e.len > 0, "block_status({at}, {ask}): an empty extent");
                let stop = pos + e.len as u64;
                assert!(
                    stop <= at + ask as u64,
                    "block_status({at}, {ask}): extents past the range"
                );
                if e.zero {
                    let bytes = &model[pos as usize..stop as usize];
                    assert!(
                        bytes.iter().all(|&b| b == 0),
                        "block_status({at}, {ask}): {pos}..{stop} called zero holds data"
                    );
                }
                pos = stop;
            }
            at = pos;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemoryExport;

    fn data(len: usize) -> Vec<u8> {
        let mut v: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
        v[len / 4..len / 2].fill(0); // a hole
        v
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_memory_export_keeps_the_contract() {
        let len = (3 << 20) + 4096;
        check(Arc::new(MemoryExport::from_vec(data(len))), data(len)).await;
        let ro = MemoryExport::from_vec(data(len)).read_only(true);
        check(Arc::new(ro), data(len)).await;
    }
}

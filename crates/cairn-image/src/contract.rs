//! The [`DiskImage`] contract as one executable check, for the tests of every implementation
//! (raw files, qcow2 chains, NBD exports, wrappers such as rate limiting): whatever reads
//! an image must see the same guest bytes and a well-formed allocation map.
//!
//! [`check`] panics with a message naming the image and the broken rule; it is meant to be
//! called from tests with the bytes the image is known to hold.

use std::sync::Arc;

use crate::{Allocation, DiskImage, MapRun};

/// Checks an allocation map of an image of `size` bytes and a chain of `chain_len` layers:
/// runs that cover exactly `[0, size)`, sorted, non-empty, non-overlapping, adjacent runs of
/// equal `(alloc, depth)` merged, unallocated runs at depth `chain_len` and the others above
/// it; and, given the image's bytes, zeros in every run that is not `Data`.
pub fn check_map(what: &str, map: &[MapRun], size: u64, chain_len: usize, bytes: Option<&[u8]>) {
    let mut at = 0;
    for (i, run) in map.iter().enumerate() {
        assert!(run.len > 0, "{what}: run {i} is empty: {run:?}");
        assert_eq!(
            run.start, at,
            "{what}: run {i} {run:?} does not start where the last ended"
        );
        at = run.end();
        match run.alloc {
            Allocation::Unallocated => assert_eq!(
                run.depth, chain_len,
                "{what}: unallocated run {i} {run:?} is not at the chain's depth"
            ),
            _ => assert!(
                run.depth < chain_len,
                "{what}: run {i} {run:?} is defined by a layer past the chain ({chain_len})"
            ),
        }
        if i > 0 {
            let prev = &map[i - 1];
            assert!(
                (prev.alloc, prev.depth) != (run.alloc, run.depth),
                "{what}: runs {prev:?} and {run:?} are equal neighbours, not merged"
            );
        }
        if let (Some(bytes), false) = (bytes, run.alloc == Allocation::Data) {
            let held = &bytes[run.start as usize..run.end() as usize];
            if let Some(nz) = held.iter().position(|&b| b != 0) {
                panic!(
                    "{what}: nonzero byte at 0x{:x} inside the non-data run {run:?}",
                    run.start + nz as u64
                );
            }
        }
    }
    assert_eq!(at, size, "{what}: the map ends at {at}, not at the size");
}

/// Checks `image` against `expected`, its guest bytes:
///
/// 1. `size()` is `expected.len()`; `layers()` is not empty and its top has that size;
/// 2. `map()` covers exactly `[0, size)` with sorted, non-empty, non-overlapping runs,
///    adjacent runs of equal `(alloc, depth)` merged, unallocated runs at depth
///    `layers().len()` and the others above it;
/// 3. ranges mapped `Zero` or `Unallocated` hold zeros;
/// 4. `read_at` returns `expected`, read whole, in odd-sized pieces, at unaligned offsets,
///    with empty buffers, and from four threads at once;
/// 5. a read that crosses the end is an error, not a short or padded read.
pub fn check(image: Arc<dyn DiskImage>, expected: &[u8]) {
    let what = image.describe();
    let size = image.size();
    assert_eq!(size, expected.len() as u64, "{what}: size()");
    let layers = image.layers();
    assert!(!layers.is_empty(), "{what}: layers() is empty");
    assert_eq!(layers[0].size, size, "{what}: the top layer's size");

    let map = image.map().unwrap_or_else(|e| panic!("{what}: map(): {e}"));
    check_map(&what, &map, size, layers.len(), Some(expected));

    let read = |offset: u64, len: usize| {
        let mut buf = vec![0xA5u8; len];
        image
            .read_at(&mut buf, offset)
            .unwrap_or_else(|e| panic!("{what}: read_at({offset}, {len}): {e}"));
        buf
    };
    assert!(read(0, 0).is_empty());
    assert!(read(size, 0).is_empty(), "{what}: an empty read at the end");
    assert!(
        read(0, size as usize) == expected,
        "{what}: the whole image"
    );
    // Odd-sized pieces at unaligned offsets, walking the whole image.
    let mut offset = 0u64;
    let mut step = 511u64;
    while offset < size {
        let len = step.min(size - offset) as usize;
        assert!(
            read(offset, len) == expected[offset as usize..offset as usize + len],
            "{what}: read_at({offset}, {len})"
        );
        offset += len as u64;
        step = step * 7 % 300_007 + 1;
    }
    // Four threads reading different ranges at once.
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let image = image.clone();
            let what = &what;
            s.spawn(move || {
                let mut offset = (t * 4099) % size.max(1);
                for _ in 0..64 {
                    let len = (65_537 + t * 13).min(size - offset) as usize;
                    let mut buf = vec![0u8; len];
                    image
                        .read_at(&mut buf, offset)
                        .unwrap_or_else(|e| panic!("{what}: thread {t}: {e}"));
                    assert!(
                        buf == expected[offset as usize..offset as usize + len],
                        "{what}: thread {t}: read_at({offset}, {len})"
                    );
                    offset = (offset + 1_048_583) % size.max(1);
                }
            });
        }
    });

    let mut past = vec![0u8; 2];
    if size > 0 {
        assert!(
            image.read_at(&mut past, size - 1).is_err(),
            "{what}: a read crossing the end must fail"
        );
    }
    assert!(
        image.read_at(&mut past, size + 4096).is_err(),
        "{what}: a read past the end must fail"
    );
}

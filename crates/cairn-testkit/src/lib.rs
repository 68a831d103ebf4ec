//! Test data shared by the tests of every cairn crate (a dev-dependency only).
//!
//! Store wrappers for fault injection and counting live in `cairn-store`
//! (`FailingStore`, `CountingStore`), beside the stores they wrap.
#![forbid(unsafe_code)]

#[cfg(feature = "engine")]
pub mod engine;
#[cfg(feature = "tls")]
pub mod tls;

/// Flips bits `mask` of the byte at `at` (the last byte if the file is shorter) of the file
/// at `path`, in place: bit rot, or a damaged object of a local repository.
pub fn flip_file_byte(path: &std::path::Path, at: usize, mask: u8) {
    let mut bytes = std::fs::read(path).expect("read the file to damage");
    let at = at.min(bytes.len().saturating_sub(1));
    bytes[at] ^= mask;
    std::fs::write(path, bytes).expect("write the damaged file");
}

/// Deterministic pseudo-random bytes (xorshift64 from `seed`): incompressible data that
/// never deduplicates against another seed's, the same on every run.
pub fn noise(len: usize, seed: u64) -> Vec<u8> {
    xorshift(seed).take(len).map(|x| x as u8).collect()
}

/// Like [`noise`], but no byte is zero: data that zero detection never skips.
pub fn nonzero_noise(len: usize, seed: u64) -> Vec<u8> {
    xorshift(seed)
        .take(len)
        .map(|x| (x >> 24) as u8 | 1)
        .collect()
}

/// The xorshift64 sequence from `seed` (never stuck at zero).
fn xorshift(seed: u64) -> impl Iterator<Item = u64> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    std::iter::repeat_with(move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    })
}

/// Cases per property of the stable fuzz tests: `CAIRN_FUZZ_CASES`, else 256.
pub fn fuzz_cases() -> u32 {
    std::env::var("CAIRN_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

/// Every file under `dir`, recursively, sorted.
pub fn files_under(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).expect("read a test directory") {
            let p = e.expect("a directory entry").path();
            match p.is_dir() {
                true => stack.push(p),
                false => out.push(p),
            }
        }
    }
    out.sort();
    out
}

/// Every file under a local repository `dir` with its bytes, sessions left out: what "the
/// command changed nothing" compares.
pub fn repo_snapshot(dir: &std::path::Path) -> Vec<(String, Vec<u8>)> {
    let sessions = dir.join("refs/sessions");
    files_under(dir)
        .into_iter()
        .filter(|p| !p.starts_with(&sessions))
        .map(|p| {
            let bytes = std::fs::read(&p).expect("read a test file");
            (p.display().to_string(), bytes)
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
        let n = nonzero_noise(4096, 3);
        assert!(n.iter().all(|&b| b != 0));
        assert_ne!(n, nonzero_noise(4096, 4));
    }
}

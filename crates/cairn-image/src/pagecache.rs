//! Page-cache politeness for scans of a live host (CloudVS §3.4).
//!
//! Reading a whole disk image through the page cache would push out what the host's running
//! VMs and services keep cached. CloudVS calls `posix_fadvise(DONTNEED)` on what it read; we
//! go one step further and drop only the pages this read brought in: pages that were
//! resident before (a running VM's hot blocks) stay cached. Residency comes from `mincore`
//! on a short-lived read-only mapping of the range.
//!
//! Limits: Linux reports residency of a file's pages only to processes that may write the
//! file (or own it); for others every page looks non-resident, so all read pages are dropped
//! — still polite to everyone else, just less kind to pages cached before.

use std::fs::File;
use std::os::unix::io::AsRawFd;

/// The page size of this machine.
pub fn page_size() -> u64 {
    // SAFETY: sysconf takes an integer name and has no memory-safety preconditions.
    let n = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if n > 0 {
        n as u64
    } else {
        4096
    }
}

/// Which pages of `[offset, offset + len)` are resident in the page cache, one flag per page
/// starting at the page containing `offset`. `None` when the kernel cannot say (the range is
/// then treated as not resident by callers).
pub fn residency(file: &File, offset: u64, len: u64) -> Option<Vec<bool>> {
    if len == 0 {
        return Some(Vec::new());
    }
    let page = page_size();
    let start = offset / page * page;
    let map_len = (offset + len - start) as usize;
    let pages = map_len.div_ceil(page as usize);
    // SAFETY: a fresh read-only shared mapping of a valid fd; the kernel picks the address.
    // The mapping is only passed to mincore and unmapped below; it is never dereferenced, so
    // a concurrent truncation of the file cannot fault us.
    let addr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            map_len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            start as libc::off_t,
        )
    };
    if addr == libc::MAP_FAILED {
        return None;
    }
    let mut vec = vec![0u8; pages];
    // SAFETY: `addr` is a live mapping of `map_len` bytes and `vec` has one byte per page of
    // it, as mincore requires.
    let rc = unsafe { libc::mincore(addr, map_len, vec.as_mut_ptr()) };
    // SAFETY: unmaps exactly the mapping created above.
    unsafe {
        libc::munmap(addr, map_len);
    }
    (rc == 0).then(|| vec.iter().map(|b| b & 1 == 1).collect())
}

/// Tells the kernel that `[offset, offset + len)` of `file` is not needed again. A hint:
/// failure is ignored.
pub fn drop_range(file: &File, offset: u64, len: u64) {
    if len == 0 {
        return;
    }
    // SAFETY: posix_fadvise only takes an fd and integers; failure is harmless (a hint).
    unsafe {
        libc::posix_fadvise(
            file.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            libc::POSIX_FADV_DONTNEED,
        );
    }
}

/// Polite reads of one file: drops what they bring in, and remembers what it dropped so it
/// can drop it once more when the scan ends ([`Polite::finish`]). The kernel cannot drop
/// pages that still sit in another CPU's LRU batch right after a read; the second pass gets
/// those (about 1% of a scan's pages otherwise stay cached).
#[derive(Debug, Default)]
pub struct Polite {
    dropped: std::sync::Mutex<Vec<(u64, u64)>>,
}

impl Polite {
    /// Like [`read_politely`], remembering the range.
    pub fn read<T>(&self, file: &File, offset: u64, len: u64, read: impl FnOnce() -> T) -> T {
        let mut runs = Vec::new();
        let out = read_and_drop(file, offset, len, read, |s, n| runs.push((s, s + n)));
        let mut d = self.dropped.lock().expect("polite lock");
        for (start, end) in runs {
            match d.last_mut() {
                Some(last) if last.1 == start => last.1 = end,
                _ => d.push((start, end)),
            }
        }
        out
    }

    /// Drops once more every page run the reads dropped (never a page that was cached
    /// before its read).
    pub fn finish(&self, file: &File) {
        let ranges = std::mem::take(&mut *self.dropped.lock().expect("polite lock"));
        for (start, end) in ranges {
            drop_range(file, start, end - start);
        }
    }
}

/// Runs `read` over `[offset, offset + len)` of `file` and then drops from the page cache
/// the pages of that range that were not resident before it.
pub fn read_politely<T>(file: &File, offset: u64, len: u64, read: impl FnOnce() -> T) -> T {
    read_and_drop(file, offset, len, read, |_, _| {})
}

/// [`read_politely`], telling `dropped` each (offset, len) run it dropped.
fn read_and_drop<T>(
    file: &File,
    offset: u64,
    len: u64,
    read: impl FnOnce() -> T,
    mut dropped: impl FnMut(u64, u64),
) -> T {
    let before = residency(file, offset, len);
    let out = read();
    let page = page_size();
    let first = offset / page;
    let mut drop_range = |start: u64, n: u64| {
        drop_range(file, start, n);
        dropped(start, n);
    };
    match before {
        None => drop_range(first * page, offset + len - first * page),
        Some(flags) => {
            // Drop maximal runs of pages that were not resident.
            let mut i = 0;
            while i < flags.len() {
                if flags[i] {
                    i += 1;
                    continue;
                }
                let run_start = i;
                while i < flags.len() && !flags[i] {
                    i += 1;
                }
                drop_range(
                    (first + run_start as u64) * page,
                    (i - run_start) as u64 * page,
                );
            }
        }
    }
    out
}

/// Resident bytes of the whole file (like `fincore`), for measurements and tests.
pub fn resident_bytes(file: &File) -> std::io::Result<u64> {
    let len = file.metadata()?.len();
    let page = page_size();
    let mut total = 0;
    // In pieces, so a huge file does not need one huge flag vector.
    let step = 1u64 << 30;
    let mut off = 0;
    while off < len {
        let n = step.min(len - off);
        let flags = residency(file, off, n)
            .ok_or_else(|| std::io::Error::other("mincore is not available for this file"))?;
        total += flags.iter().filter(|&&r| r).count() as u64 * page;
        off += n;
    }
    Ok(total.min(len))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::FileExt;

    #[test]
    fn a_polite_read_drops_only_the_pages_it_brought_in() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let mut f = File::create(&path).unwrap();
        f.write_all(&vec![7u8; 8 << 20]).unwrap();
        f.sync_all().unwrap();
        let f = File::open(&path).unwrap();
        // No readahead beyond what the test reads (see `crate::raw`).
        crate::raw::advise(&f, libc::POSIX_FADV_RANDOM);
        drop_range(&f, 0, 8 << 20);
        // Cache the first MiB ("a running VM's hot data"), then read everything politely.
        let mut buf = vec![0u8; 1 << 20];
        f.read_exact_at(&mut buf, 0).unwrap();
        assert!(resident_bytes(&f).unwrap() >= 1 << 20);
        let mut all = vec![0u8; 8 << 20];
        read_politely(&f, 0, 8 << 20, || f.read_exact_at(&mut all, 0).unwrap());
        assert_eq!(all, vec![7u8; 8 << 20]);
        let flags = residency(&f, 0, 8 << 20).unwrap();
        let pages_per_mib = ((1 << 20) / page_size()) as usize;
        assert!(
            flags[..pages_per_mib].iter().all(|&r| r),
            "the hot MiB stays cached"
        );
        assert!(
            flags[pages_per_mib..].iter().all(|&r| !r),
            "the rest was dropped"
        );
    }
}

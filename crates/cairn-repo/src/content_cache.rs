//! A local, content-addressed cache of immutable objects, verified on every read.
//!
//! Two caches use it: the host-wide chunk cache of exports (chunks fetched from any repository
//! by any export on this host, stored once by content id — VMAR: identical blocks of different
//! images are served from one cached copy), and the metadata cache of remote repositories
//! (index files and manifest nodes, so repeated operations do not download them again).
//! Anything whose id is the BLAKE3 of its bytes can live here; nothing else may.
//!
//! Layout: `<dir>/<first two hex digits>/<id hex>`, the object's bytes. Files are written to
//! `<dir>/tmp/` and renamed into place, so a reader never sees a partial object, and every
//! read is checked against the id (a damaged file is deleted and counts as a miss). Recency
//! is the file's modification time, refreshed on every hit; when the cache grows past its
//! limit, the oldest files are deleted until it is at 90% of the limit. Several processes may
//! share one directory: each keeps its own estimate of the total and rescans when the
//! estimate crosses the limit.

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use cairn_format::Id;

/// `$XDG_CACHE_HOME/cairn`, else `~/.cache/cairn` (else a directory under the temp dir).
pub fn user_cache_dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("cairn")
}

/// (last use, size, path) of one cached object.
type CachedFile = (SystemTime, u64, PathBuf);

#[derive(Debug)]
pub struct ContentCache {
    dir: PathBuf,
    limit: u64,
    /// This process's estimate of the bytes in the cache.
    size: AtomicU64,
    /// One lock per object being fetched, so concurrent readers of an object fetch it once.
    in_flight: Mutex<HashMap<Id, Arc<tokio::sync::Mutex<()>>>>,
    evictions: AtomicU64,
}

impl ContentCache {
    /// Opens (creating) the cache in `dir` with a limit of `limit` bytes.
    pub fn open(dir: &Path, limit: u64) -> io::Result<ContentCache> {
        fs::create_dir_all(dir.join("tmp"))?;
        let cache = ContentCache {
            dir: dir.to_path_buf(),
            limit,
            size: AtomicU64::new(0),
            in_flight: Mutex::new(HashMap::new()),
            evictions: AtomicU64::new(0),
        };
        let (total, _) = cache.scan()?;
        cache.size.store(total, Ordering::Relaxed);
        Ok(cache)
    }

    /// The chunk cache's default location: `$CAIRN_CACHE_DIR`, else
    /// `$XDG_CACHE_HOME/cairn/chunks`, else `~/.cache/cairn/chunks`.
    pub fn default_chunk_dir() -> PathBuf {
        std::env::var_os("CAIRN_CACHE_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| user_cache_dir().join("chunks"))
    }

    /// The metadata cache's default location: `$CAIRN_META_CACHE_DIR`, else
    /// `$XDG_CACHE_HOME/cairn/meta`, else `~/.cache/cairn/meta`.
    pub fn default_meta_dir() -> PathBuf {
        std::env::var_os("CAIRN_META_CACHE_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| user_cache_dir().join("meta"))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn size_estimate(&self) -> u64 {
        self.size.load(Ordering::Relaxed)
    }

    pub fn evictions(&self) -> u64 {
        self.evictions.load(Ordering::Relaxed)
    }

    fn path(&self, id: &Id) -> PathBuf {
        let hex = id.to_hex();
        self.dir.join(&hex[..2]).join(hex)
    }

    /// The object's bytes if cached and intact.
    pub fn get(&self, id: &Id) -> Option<Vec<u8>> {
        let path = self.path(id);
        let data = fs::read(&path).ok()?;
        if Id::of(&data) != *id {
            tracing::warn!(path = %path.display(), "damaged object in the cache; dropping it");
            let _ = fs::remove_file(&path);
            return None;
        }
        // Refresh recency; failure only makes eviction less accurate.
        if let Ok(f) = fs::File::options().write(true).open(&path) {
            let _ = f.set_modified(SystemTime::now());
        }
        Some(data)
    }

    pub fn contains(&self, id: &Id) -> bool {
        self.path(id).exists()
    }

    /// Stores an object (whose id the caller has verified).
    pub fn put(&self, id: &Id, data: &[u8]) -> io::Result<()> {
        let path = self.path(id);
        if path.exists() {
            return Ok(());
        }
        let tmp =
            self.dir
                .join("tmp")
                .join(format!("{}.{:016x}", id.to_hex(), rand::random::<u64>()));
        let mut f = fs::File::create(&tmp)?;
        f.write_all(data)?;
        drop(f);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent)?;
        }
        if let Err(e) = fs::rename(&tmp, &path) {
            let _ = fs::remove_file(&tmp);
            return Err(e);
        }
        let total = self.size.fetch_add(data.len() as u64, Ordering::Relaxed) + data.len() as u64;
        if total > self.limit {
            self.evict()?;
        }
        Ok(())
    }

    /// The lock that serializes fetches of `id` in this process.
    pub fn fetch_lock(&self, id: &Id) -> Arc<tokio::sync::Mutex<()>> {
        self.in_flight
            .lock()
            .expect("cache lock")
            .entry(*id)
            .or_default()
            .clone()
    }

    /// Forgets the fetch lock of `id` once nobody waits on it.
    pub fn release_fetch_lock(&self, id: &Id) {
        let mut map = self.in_flight.lock().expect("cache lock");
        if map.get(id).is_some_and(|l| Arc::strong_count(l) == 1) {
            map.remove(id);
        }
    }

    /// (total bytes, files with their size and modification time).
    fn scan(&self) -> io::Result<(u64, Vec<CachedFile>)> {
        let mut total = 0;
        let mut files = Vec::new();
        for sub in fs::read_dir(&self.dir)? {
            let sub = sub?;
            if sub.file_name() == "tmp" || !sub.file_type()?.is_dir() {
                continue;
            }
            for f in fs::read_dir(sub.path())? {
                let Ok(f) = f else { continue };
                let Ok(meta) = f.metadata() else { continue };
                total += meta.len();
                files.push((
                    meta.modified().unwrap_or(SystemTime::UNIX_EPOCH),
                    meta.len(),
                    f.path(),
                ));
            }
        }
        Ok((total, files))
    }

    /// Deletes the least recently used objects until the cache is at 90% of its limit.
    fn evict(&self) -> io::Result<()> {
        let (mut total, mut files) = self.scan()?;
        let target = self.limit / 10 * 9;
        files.sort();
        for (_, len, path) in files {
            if total <= target {
                break;
            }
            if fs::remove_file(&path).is_ok() {
                total -= len;
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.size.store(total, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stores_verifies_and_evicts_least_recently_used() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ContentCache::open(dir.path(), 10 * 1000).unwrap();
        let chunks: Vec<Vec<u8>> = (0..12u8).map(|i| vec![i; 1000]).collect();
        for (i, c) in chunks.iter().enumerate().take(9) {
            cache.put(&Id::of(c), c).unwrap();
            // Distinct modification times, oldest first; chunk 0 is then used again.
            let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000 + i as u64);
            let f = fs::File::options()
                .write(true)
                .open(cache.path(&Id::of(c)))
                .unwrap();
            f.set_modified(t).unwrap();
        }
        assert_eq!(cache.get(&Id::of(&chunks[0])).unwrap(), chunks[0]);
        for c in &chunks[9..] {
            cache.put(&Id::of(c), c).unwrap();
        }
        // The 11th chunk took the cache past 10 000 bytes: it was evicted down to 9 000, oldest
        // first (1 and 2; not 0, used again); the 12th brought it back to 10 000.
        assert!(cache.get(&Id::of(&chunks[0])).is_some());
        for c in &chunks[1..3] {
            assert!(!cache.contains(&Id::of(c)));
        }
        assert!(cache.contains(&Id::of(&chunks[3])));
        assert!(cache.get(&Id::of(&chunks[11])).is_some());
        assert_eq!(cache.size_estimate(), 10_000);
        assert_eq!(cache.evictions(), 2);

        // A damaged file is a miss, and is removed.
        let id = Id::of(&chunks[11]);
        fs::write(cache.path(&id), b"garbage").unwrap();
        assert!(cache.get(&id).is_none());
        assert!(!cache.contains(&id));

        // A second process (here: a second handle) sees what the first stored.
        let other = ContentCache::open(dir.path(), 10 * 1000).unwrap();
        assert_eq!(other.get(&Id::of(&chunks[0])).unwrap(), chunks[0]);
    }
}

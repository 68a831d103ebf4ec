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
//! limit, the oldest files are deleted until it is at 90% of the limit (`usage`). Several
//! processes may share one directory: each keeps its own estimate of the total and rescans,
//! in the background, when the estimate crosses the limit (and once after its first store).
//!
//! The cache holds plain bytes of other people's disks, so no other account may read it: the
//! directory is created with mode 0700 (files 0600), a directory of ours that others can
//! enter is tightened to 0700 at open, and one that belongs to someone else and is open to
//! others is refused.

mod behind;
mod host_lock;
mod usage;

use std::collections::HashMap;
use std::fs;
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::SystemTime;

use cairn_format::Id;
use usage::Usage;

/// `$XDG_CACHE_HOME/cairn`, else `~/.cache/cairn` (else a directory under the temp dir).
pub fn user_cache_dir() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("cairn")
}

#[derive(Debug)]
pub struct ContentCache {
    dir: PathBuf,
    usage: Arc<Usage>,
    /// The background scan (and eviction) running or last run, if any.
    housekeeper: Mutex<Option<JoinHandle<()>>>,
    /// One lock per object being fetched, so concurrent readers of an object fetch it once.
    in_flight: Mutex<HashMap<Id, Arc<tokio::sync::Mutex<()>>>>,
    /// The same across the processes sharing the directory, opened at the first fetch lock
    /// (`None` when the lock file cannot be opened: fetches then go ahead without it).
    host: OnceLock<Option<Arc<host_lock::HostLocks>>>,
    /// Objects stored in the background ([`Self::put_behind`]).
    behind: behind::Behind,
}

impl ContentCache {
    /// Opens (creating) the cache in `dir` with a limit of `limit` bytes. Nothing is scanned
    /// here: opening costs the same whatever the cache holds.
    pub fn open(dir: &Path, limit: u64) -> io::Result<ContentCache> {
        make_private_dir(dir)?;
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir.join("tmp"))?;
        Ok(ContentCache {
            dir: dir.to_path_buf(),
            usage: Arc::new(Usage::new(dir, limit)),
            housekeeper: Mutex::new(None),
            in_flight: Mutex::new(HashMap::new()),
            host: OnceLock::new(),
            behind: behind::Behind::default(),
        })
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

    /// The bytes in the cache as this process estimates them: the last scan's total and what
    /// it stored since (before a scan, only what it stored).
    pub fn size_estimate(&self) -> u64 {
        self.usage.estimate()
    }

    /// Objects this process's scans evicted.
    pub fn evictions(&self) -> u64 {
        self.usage.evictions()
    }

    /// Waits for the background scan, if one runs (tests, and callers about to report the
    /// cache's size).
    pub fn settle(&self) {
        let running = self.housekeeper.lock().expect("cache lock").take();
        if let Some(handle) = running {
            let _ = handle.join();
        }
    }

    /// Starts a background scan (and eviction) unless one is running. A store that ran
    /// past the limit during a scan starts the next one.
    fn start_housekeeping(&self) {
        let mut slot = self.housekeeper.lock().expect("cache lock");
        if slot.as_ref().is_some_and(|h| !h.is_finished()) {
            return;
        }
        let usage = self.usage.clone();
        let spawned = std::thread::Builder::new()
            .name("cache-scan".into())
            .spawn(move || {
                if let Err(e) = usage.housekeep() {
                    tracing::warn!("scanning the cache failed: {e}");
                }
            });
        match spawned {
            Ok(handle) => *slot = Some(handle),
            Err(e) => tracing::warn!("cannot start the cache's scan: {e}"),
        }
    }

    fn path(&self, id: &Id) -> PathBuf {
        let hex = id.to_hex();
        self.dir.join(&hex[..2]).join(hex)
    }

    /// The object's bytes if cached and intact.
    pub fn get(&self, id: &Id) -> Option<Vec<u8>> {
        self.get_with(id, Id::of)
    }

    /// [`Self::get`] for ids made by `id_of` (an encrypted repository's keyed ids: a cached
    /// chunk of one repository can match no id of another).
    pub fn get_with(&self, id: &Id, id_of: impl Fn(&[u8]) -> Id) -> Option<Vec<u8>> {
        if let Some(data) = self.behind.get(id) {
            return (id_of(&data) == *id).then(|| data.to_vec());
        }
        let path = self.path(id);
        let data = fs::read(&path).ok()?;
        if id_of(&data) != *id {
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
        self.behind.contains(id) || self.path(id).exists()
    }

    /// Stores an object (whose id the caller has verified).
    pub fn put(&self, id: &Id, data: &[u8]) -> io::Result<()> {
        if store_file(&self.dir, id, data)? {
            self.usage.add(data.len() as u64);
            if self.usage.due() {
                self.start_housekeeping();
            }
        }
        Ok(())
    }

    /// Stores an object (whose id the caller has verified) in the background, for readers
    /// that must not wait for the cache: it is readable from the cache at once and on disk
    /// once the cache's thread has written it ([`Self::flush`] waits for that). When that
    /// thread is far behind, the object is not cached ([`Self::dropped`]).
    pub fn put_behind(&self, id: &Id, data: &[u8]) {
        self.behind.put(&self.dir, &self.usage, id, data);
        if self.usage.due() {
            self.start_housekeeping();
        }
    }

    /// Waits until every object given to [`Self::put_behind`] before the call is on disk
    /// (or dropped).
    pub fn flush(&self) {
        self.behind.flush();
    }

    /// Objects [`Self::put_behind`] did not cache because its thread was too far behind.
    pub fn dropped(&self) -> u64 {
        self.behind.dropped()
    }

    /// Takes the lock that serializes fetches of `id` on this host, waiting for a fetch in
    /// progress to end: in this process (always), then in the other processes that share the
    /// directory (for at most `host_lock::WAIT`). The holder checks the cache again before
    /// it fetches; another process's fetch is on disk by the time its lock is let go.
    pub async fn lock_fetch(&self, id: &Id) -> FetchGuard<'_> {
        self.lock_fetch_until(id, host_lock::deadline(), || false)
            .await
    }

    /// [`Self::lock_fetch`] that stops waiting for another process at `deadline`, or as soon
    /// as `done` says what the fetch would bring is cached (then nothing is fetched: the
    /// caller finds it when it checks the cache again).
    pub async fn lock_fetch_until(
        &self,
        id: &Id,
        deadline: tokio::time::Instant,
        done: impl Fn() -> bool,
    ) -> FetchGuard<'_> {
        // Declared first, dropped last: a wait cancelled below still forgets the lock.
        let mut held = FetchGuard {
            cache: self,
            id: *id,
            guard: None,
            host: None,
        };
        let lock = self.fetch_lock(id);
        held.guard = Some(lock.lock_owned().await);
        if let Some(host) = self.host() {
            if !done() && host.lock(id, deadline, &done).await {
                held.host = Some(host);
            }
        }
        held
    }

    /// When a wait for other processes' fetches that starts now gives up.
    pub fn fetch_deadline() -> tokio::time::Instant {
        host_lock::deadline()
    }

    /// The fetch lock of `id` if no fetch of it is in progress on this host.
    pub fn try_lock_fetch(&self, id: &Id) -> Option<FetchGuard<'_>> {
        let guard = self.fetch_lock(id).try_lock_owned().ok();
        let mut held = FetchGuard {
            cache: self,
            id: *id,
            guard: Some(guard?),
            host: None,
        };
        if let Some(host) = self.host() {
            match host.try_lock(id) {
                Ok(true) => held.host = Some(host),
                Ok(false) => return None,
                Err(e) => tracing::debug!(%id, "fetch lock: {e}"),
            }
        }
        Some(held)
    }

    fn host(&self) -> Option<Arc<host_lock::HostLocks>> {
        self.host
            .get_or_init(|| match host_lock::HostLocks::open(&self.dir) {
                Ok(h) => Some(Arc::new(h)),
                Err(e) => {
                    tracing::debug!(dir = %self.dir.display(), "no fetch lock file: {e}");
                    None
                }
            })
            .clone()
    }

    fn fetch_lock(&self, id: &Id) -> Arc<tokio::sync::Mutex<()>> {
        self.in_flight
            .lock()
            .expect("cache lock")
            .entry(*id)
            .or_default()
            .clone()
    }

    /// Forgets the fetch lock of `id` once nobody holds or waits on it.
    fn release_fetch_lock(&self, id: &Id) {
        let mut map = self.in_flight.lock().expect("cache lock");
        if map.get(id).is_some_and(|l| Arc::strong_count(l) == 1) {
            map.remove(id);
        }
    }

    /// Fetch locks known now (held, waited on, or not yet forgotten).
    pub fn fetch_locks(&self) -> usize {
        self.in_flight.lock().expect("cache lock").len()
    }
}

/// A held fetch lock ([`ContentCache::lock_fetch`]). Dropping it lets the next fetch of its id
/// in this process go at once (what was fetched is readable from the cache's queue), and
/// another process's once what this one queued for the cache is on disk; the lock is
/// forgotten when nobody waits, however its holder ends: done, failed, or cancelled at an
/// await.
pub struct FetchGuard<'a> {
    cache: &'a ContentCache,
    id: Id,
    guard: Option<tokio::sync::OwnedMutexGuard<()>>,
    host: Option<Arc<host_lock::HostLocks>>,
}

impl Drop for FetchGuard<'_> {
    fn drop(&mut self) {
        drop(self.guard.take());
        if let Some(host) = self.host.take() {
            self.cache.behind.unlock_after(host, &self.id);
        }
        self.cache.release_fetch_lock(&self.id);
    }
}

impl Drop for ContentCache {
    /// What was queued in the background reaches the disk before the cache goes.
    fn drop(&mut self) {
        self.behind.close();
    }
}

/// Writes `data` as object `id` of the cache in `dir`: to `tmp/`, then renamed into place, so
/// no reader sees part of it. False when the object was there already.
fn store_file(dir: &Path, id: &Id, data: &[u8]) -> io::Result<bool> {
    let hex = id.to_hex();
    let path = dir.join(&hex[..2]).join(&hex);
    if path.exists() {
        return Ok(false);
    }
    let tmp = dir
        .join("tmp")
        .join(format!("{hex}.{:016x}", rand::random::<u64>()));
    let mut f = fs::File::options()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    f.write_all(data)?;
    drop(f);
    if let Some(parent) = path.parent() {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(parent)?;
    }
    if let Err(e) = fs::rename(&tmp, &path) {
        let _ = fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(true)
}

/// Creates `dir` (mode 0700) or makes sure no other account can enter it. A directory open
/// to others is tightened only if it is ours and holds nothing but a cache's own layout (an
/// older cairn's cache, or an empty directory); anything else — someone else's directory, or
/// a shared one such as `/tmp` given by mistake — is refused and left as it is.
fn make_private_dir(dir: &Path) -> io::Result<()> {
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let meta = fs::metadata(dir)?;
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o077 == 0 {
        return Ok(());
    }
    let ours = meta.uid() == rustix::process::geteuid().as_raw();
    if !ours || mode & 0o1000 != 0 || !holds_only_a_cache(dir)? {
        let whose = if ours {
            ""
        } else {
            "belongs to another user, "
        };
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "cache directory {} {whose}is open to other accounts (mode {mode:o}) and is not \
                 a cache of cairn's to make private; give this user a directory of its own \
                 (--cache-dir, CAIRN_CACHE_DIR, CAIRN_META_CACHE_DIR)",
                dir.display()
            ),
        ));
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))?;
    tracing::info!(dir = %dir.display(), "cache directory was mode {mode:o}: now 0700");
    Ok(())
}

/// Whether `dir` holds only what a content cache puts there: `tmp/`, two-hex-digit
/// directories and the fetch lock file.
fn holds_only_a_cache(dir: &Path) -> io::Result<bool> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let kind = entry.file_type()?;
        let cache_dir =
            name == "tmp" || (name.len() == 2 && name.bytes().all(|b| b.is_ascii_hexdigit()));
        let ours = match kind.is_dir() {
            true => cache_dir,
            false => kind.is_file() && name == host_lock::FILE,
        };
        if !ours {
            return Ok(false);
        }
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Sets the last use of cached object `c` to `secs` after the epoch.
    fn last_used(cache: &ContentCache, c: &[u8], secs: u64) {
        let t = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(secs);
        let f = fs::File::options()
            .write(true)
            .open(cache.path(&Id::of(c)))
            .unwrap();
        f.set_modified(t).unwrap();
    }

    #[tokio::test]
    async fn fetch_locks_are_forgotten_however_their_holders_end() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ContentCache::open(dir.path(), 1 << 20).unwrap();
        let (a, b) = (Id::of(b"a"), Id::of(b"b"));
        let held = cache.lock_fetch(&a).await;
        // A second fetch of `a` waits; one that is cancelled while waiting leaves nothing.
        assert!(cache.try_lock_fetch(&a).is_none());
        let waiting = tokio::time::timeout(Duration::from_millis(20), cache.lock_fetch(&a));
        assert!(waiting.await.is_err());
        let other = cache.try_lock_fetch(&b).expect("b is free");
        assert_eq!(cache.fetch_locks(), 2);
        drop(other);
        assert_eq!(cache.fetch_locks(), 1);
        drop(held);
        assert_eq!(cache.fetch_locks(), 0);
        // A holder whose task is aborted mid-fetch lets go as well.
        let cache = Arc::new(cache);
        let (tx, rx) = tokio::sync::oneshot::channel();
        let c = cache.clone();
        let task = tokio::spawn(async move {
            let _g = c.lock_fetch(&a).await;
            tx.send(()).unwrap();
            std::future::pending::<()>().await;
        });
        rx.await.unwrap();
        assert_eq!(cache.fetch_locks(), 1);
        task.abort();
        assert!(task.await.unwrap_err().is_cancelled());
        assert_eq!(cache.fetch_locks(), 0);
        assert!(cache.try_lock_fetch(&a).is_some());
    }

    #[tokio::test]
    async fn a_fetch_in_another_process_is_waited_for_and_its_object_is_then_on_disk() {
        // Two caches on one directory hold separate lock files, as two processes do.
        let dir = tempfile::tempdir().unwrap();
        let one = ContentCache::open(dir.path(), 1 << 20).unwrap();
        let two = ContentCache::open(dir.path(), 1 << 20).unwrap();
        let data = vec![7u8; 4096];
        let id = Id::of(&data);
        let other = Id::of(b"other");

        let held = one.lock_fetch(&id).await;
        assert!(two.try_lock_fetch(&id).is_none());
        assert!(two.try_lock_fetch(&other).is_some(), "another id is free");
        let waiting = tokio::time::timeout(Duration::from_millis(50), two.lock_fetch(&id));
        assert!(waiting.await.is_err(), "waits while the other holds it");
        assert_eq!(two.fetch_locks(), 0, "a cancelled wait leaves nothing");
        // A wait stops as soon as what it would fetch is cached.
        let far = tokio::time::Instant::now() + Duration::from_secs(60);
        let skipped = tokio::time::timeout(
            Duration::from_secs(5),
            two.lock_fetch_until(&id, far, || true),
        );
        assert!(skipped.await.unwrap().host.is_none());

        // The holder caches what it fetched in the background and lets go: the waiter gets
        // the lock only once the object is on disk, where it finds it.
        one.put_behind(&id, &data);
        let (two_waits, _) = tokio::join!(
            async {
                let g = two.lock_fetch(&id).await;
                assert_eq!(two.get(&id).as_deref(), Some(&data[..]));
                drop(g);
            },
            async move { drop(held) }
        );
        two_waits
    }

    #[test]
    fn stores_verifies_and_evicts_least_recently_used() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ContentCache::open(dir.path(), 10 * 1000).unwrap();
        let put = |c: &[u8]| {
            cache.put(&Id::of(c), c).unwrap();
            cache.settle();
        };
        let chunks: Vec<Vec<u8>> = (0..12u8).map(|i| vec![i; 1000]).collect();
        for (i, c) in chunks.iter().enumerate().take(9) {
            put(c);
            // Distinct modification times, oldest first; chunk 0 is then used again.
            last_used(&cache, c, 1000 + i as u64);
        }
        assert_eq!(cache.get(&Id::of(&chunks[0])).unwrap(), chunks[0]);
        for c in &chunks[9..] {
            put(c);
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

    #[test]
    fn an_object_stored_behind_is_readable_at_once_on_disk_after_a_flush_and_never_waited_for() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ContentCache::open(dir.path(), 1 << 30).unwrap();
        // The first store starts a scan of the cache; once it is over, the size estimate only
        // grows by what this process stores (a scan racing the writer may count a file twice).
        let z = vec![0u8; 100];
        cache.put(&Id::of(&z), &z).unwrap();
        cache.settle();
        let a = vec![1u8; 4096];
        let id = Id::of(&a);
        cache.put_behind(&id, &a);
        assert!(cache.contains(&id));
        assert_eq!(cache.get(&id).unwrap(), a);
        cache.flush();
        assert_eq!(fs::read(cache.path(&id)).unwrap(), a);
        assert_eq!(cache.size_estimate(), 100 + 4096);
        // Checked against its id like a file: asked under another id, it is no hit, whether
        // still queued or already written (a file that fails the check is removed, so this is
        // another object than the one checked on disk above).
        let c = vec![3u8; 4096];
        cache.put_behind(&Id::of(&c), &c);
        assert!(cache.get_with(&Id::of(&c), |_| Id::of(b"other")).is_none());

        // Far more objects than the queue holds, given at once: none waits, every one is on
        // disk after the flush or counted as dropped, and a second handle (another process)
        // reads what reached the disk.
        let many: Vec<Vec<u8>> = (0..4 * behind::QUEUE as u32)
            .map(|i| i.to_le_bytes().repeat(64))
            .collect();
        for c in &many {
            cache.put_behind(&Id::of(c), c);
        }
        cache.flush();
        let on_disk = many
            .iter()
            .filter(|c| cache.path(&Id::of(c)).exists())
            .count() as u64;
        assert_eq!(on_disk + cache.dropped(), many.len() as u64);
        assert!(on_disk >= behind::QUEUE as u64, "{on_disk}");
        let other = ContentCache::open(dir.path(), 1 << 30).unwrap();
        assert_eq!(other.get(&id).unwrap(), a);

        // Dropping the cache writes what is still queued.
        let b = vec![2u8; 4096];
        cache.put_behind(&Id::of(&b), &b);
        drop(cache);
        assert_eq!(other.get(&Id::of(&b)).unwrap(), b);
    }

    #[test]
    fn opening_scans_nothing_and_the_first_store_brings_the_cache_under_its_limit() {
        let dir = tempfile::tempdir().unwrap();
        let big = ContentCache::open(dir.path(), 1 << 20).unwrap();
        let chunks: Vec<Vec<u8>> = (0..21u8).map(|i| vec![i; 1000]).collect();
        for (i, c) in chunks.iter().enumerate().take(20) {
            big.put(&Id::of(c), c).unwrap();
            last_used(&big, c, 1000 + i as u64);
        }
        big.settle();
        assert_eq!(big.evictions(), 0);

        // A process with a smaller limit opens it: nothing is read or deleted yet.
        let small = ContentCache::open(dir.path(), 10 * 1000).unwrap();
        assert_eq!(small.size_estimate(), 0);
        assert!(chunks[..20].iter().all(|c| small.contains(&Id::of(c))));
        // Its first store scans in the background: 21,000 bytes, down to 9,000, oldest first.
        small.put(&Id::of(&chunks[20]), &chunks[20]).unwrap();
        small.settle();
        assert_eq!(small.size_estimate(), 9_000);
        assert_eq!(small.evictions(), 12);
        for (i, c) in chunks.iter().enumerate() {
            assert_eq!(small.contains(&Id::of(c)), i >= 12, "chunk {i}");
        }
    }

    fn mode(path: &Path) -> u32 {
        fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    #[test]
    fn no_other_account_can_read_the_cache() {
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("a/b/chunks");
        let cache = ContentCache::open(&dir, 1 << 20).unwrap();
        cache.put(&Id::of(b"secret"), b"secret").unwrap();
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&cache.path(&Id::of(b"secret"))), 0o600);
        assert_eq!(
            mode(cache.path(&Id::of(b"secret")).parent().unwrap()),
            0o700
        );

        // A cache made by an older cairn (mode 0755) is tightened when opened.
        fs::set_permissions(&dir, fs::Permissions::from_mode(0o755)).unwrap();
        let again = ContentCache::open(&dir, 1 << 20).unwrap();
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(again.get(&Id::of(b"secret")).unwrap(), b"secret");

        // Someone else's directory that others can open is refused, and left as it is (only
        // root can make one here; the suite runs as root).
        if rustix::process::geteuid().is_root() {
            let theirs = base.path().join("theirs");
            fs::create_dir(&theirs).unwrap();
            fs::set_permissions(&theirs, fs::Permissions::from_mode(0o755)).unwrap();
            std::os::unix::fs::chown(&theirs, Some(65534), None).unwrap();
            let err = ContentCache::open(&theirs, 1 << 20).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::PermissionDenied);
            assert!(err.to_string().contains("belongs to another user"), "{err}");
            assert_eq!(mode(&theirs), 0o755);
        } else {
            eprintln!("not root: the foreign-directory case is not exercised");
        }

        // A shared directory of ours (sticky, as /tmp) or one holding other things is refused,
        // not made private under its other users.
        let shared = base.path().join("shared");
        fs::create_dir(&shared).unwrap();
        fs::set_permissions(&shared, fs::Permissions::from_mode(0o1777)).unwrap();
        let err = ContentCache::open(&shared, 1 << 20).unwrap_err();
        assert!(err.to_string().contains("mode 1777"), "{err}");
        let shared_mode = fs::metadata(&shared).unwrap().permissions().mode() & 0o7777;
        assert_eq!(shared_mode, 0o1777);
        let home = base.path().join("home");
        fs::create_dir(&home).unwrap();
        fs::write(home.join("notes.txt"), b"x").unwrap();
        fs::set_permissions(&home, fs::Permissions::from_mode(0o755)).unwrap();
        assert!(ContentCache::open(&home, 1 << 20).is_err());
        assert_eq!(mode(&home), 0o755);
    }
}

//! A repository on a local directory.
//!
//! Objects are plain files at `<root>/<key>`; refs are files at `<root>/refs/<key>`. Objects
//! are published with `link(2)`, which fails if the name exists, so an object is never
//! overwritten and never seen half-written. Refs are swapped under one repository-wide
//! `flock`, which excludes other cairn processes too.

mod fsutil;
pub(crate) mod reserve;
mod seen_dirs;

pub use reserve::RESERVE_NAME;

use std::fs::{self, File};
use std::io;
use std::ops::Range;
use std::os::unix::fs::{DirBuilderExt, FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use bytes::Bytes;

use self::fsutil::{
    create_dirs, fsync_dir, is_absent, list_files, remove_temp_files, write_temp, FileLock, Modes,
};
use self::seen_dirs::SeenDirs;
use crate::key::{
    validate_object_key, validate_prefix, validate_ref_key, REFS_SEGMENT, REF_LOCK_NAME,
};
use crate::{
    CasOutcome, ObjectMeta, ObjectStore, PutOutcome, RefState, RefVersion, StagedFile, StoreError,
    StoreResult,
};

/// An [`ObjectStore`] on a local directory. Cheap to clone; several stores (in one process or
/// many) may share a root.
#[derive(Debug, Clone)]
pub struct LocalStore {
    root: PathBuf,
    /// Writes that hit a full file system may release the space reserve (see
    /// [`LocalStore::for_deletion`]).
    may_use_reserve: bool,
    /// What listings saw of each directory they read (for the sweep of temporaries).
    seen: Arc<SeenDirs>,
    /// The permissions of what it creates, from the root's (see [`Modes`]).
    modes: Modes,
}

impl LocalStore {
    /// Open an existing repository directory. Fails, naming the path, if `root` does not
    /// exist or is not a directory, so a typo never silently creates an empty repository.
    pub fn open(root: impl Into<PathBuf>) -> StoreResult<Self> {
        let root = root.into();
        let meta = fs::metadata(&root).map_err(|e| StoreError::io("open repository", &root, e))?;
        if !meta.is_dir() {
            let e = io::Error::from_raw_os_error(libc::ENOTDIR);
            return Err(StoreError::io("open repository", &root, e));
        }
        Ok(LocalStore {
            root,
            may_use_reserve: false,
            seen: Arc::default(),
            modes: Modes::of_root(meta.permissions().mode()),
        })
    }

    /// This store, allowed to release the space reserve when the file system is full: for
    /// commands that free space (`rm`, `prune`, `gc`, `repair`), never for commits.
    pub fn for_deletion(mut self) -> Self {
        self.may_use_reserve = true;
        self
    }

    /// Preallocates the space reserve (`cairn init`; 0 bytes: none). See the `reserve` module.
    pub fn create_reserve(&self, bytes: u64) -> StoreResult<()> {
        reserve::create(&self.root, bytes)
            .map_err(|e| StoreError::io("create space reserve", reserve::path(&self.root), e))
    }

    /// Runs a blocking write; on a full file system a store opened [`for_deletion`] releases
    /// the reserve and tries once more, and the error says the disk is full (never naming a
    /// temporary file).
    ///
    /// [`for_deletion`]: LocalStore::for_deletion
    async fn write<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: Fn() -> StoreResult<T> + Clone + Send + 'static,
    {
        let is_full = |r: &StoreResult<T>| matches!(r, Err(StoreError::Io { source, .. }) if reserve::is_full(source));
        let first = self.blocking(f.clone()).await;
        if !is_full(&first) {
            return first;
        }
        if self.may_use_reserve {
            let root = self.root.clone();
            let freed = self.blocking(move || Ok(reserve::release(&root))).await?;
            if freed > 0 {
                tracing::warn!(
                    "{}: the file system is full; released the {} MiB space reserve to free space",
                    self.root.display(),
                    freed >> 20
                );
                let again = self.blocking(f).await;
                if !is_full(&again) {
                    return again;
                }
            }
        }
        Err(StoreError::Full {
            location: self.describe(),
        })
    }

    /// Open `root`, creating it (and its parents) first if missing.
    pub fn create(root: impl Into<PathBuf>) -> StoreResult<Self> {
        let root = root.into();
        if let Some(parent) = root.parent().filter(|p| !p.as_os_str().is_empty()) {
            fs::create_dir_all(parent)
                .map_err(|e| StoreError::io("create repository", &root, e))?;
        }
        // A new repository is private to its owner (see `Modes`); an existing directory
        // keeps the mode its owner gave it.
        match fs::DirBuilder::new().mode(Modes::PRIVATE.dir).create(&root) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists && root.is_dir() => {}
            Err(e) => return Err(StoreError::io("create repository", &root, e)),
        }
        if let Some(parent) = root.parent().filter(|p| !p.as_os_str().is_empty()) {
            fsync_dir(parent)?;
        }
        Self::open(root)
    }

    /// The repository directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn refs_dir(&self) -> PathBuf {
        self.root.join(REFS_SEGMENT)
    }

    /// Run blocking filesystem work off the async runtime's worker threads.
    async fn blocking<T, F>(&self, f: F) -> StoreResult<T>
    where
        T: Send + 'static,
        F: FnOnce() -> StoreResult<T> + Send + 'static,
    {
        match tokio::task::spawn_blocking(f).await {
            Ok(result) => result,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(StoreError::Unavailable {
                location: self.describe(),
                reason: format!("blocking task did not run: {e}"),
            }),
        }
    }
}

/// Read a whole file; `Ok(None)` if there is no file at `path`.
fn read_optional(path: &Path) -> StoreResult<Option<Vec<u8>>> {
    match fs::read(path) {
        Ok(data) => Ok(Some(data)),
        Err(e) if is_absent(&e) => Ok(None),
        Err(e) => Err(StoreError::io("read", path, e)),
    }
}

/// A ref's version is the hash of its content: equal contents share a version, which is
/// exactly what compare-and-swap on content needs, and survives process restarts.
fn ref_version(data: &[u8]) -> RefVersion {
    RefVersion(blake3::hash(data).to_hex().to_string())
}

/// Publish `data` at `base/key` unless something is there already.
fn put_blocking(base: &Path, key: &str, data: &[u8], modes: Modes) -> StoreResult<PutOutcome> {
    let (path, dir) = prepare_publish(base, key, modes)?;
    if path_is_file(&path) {
        return exists(&dir);
    }
    let tmp = write_temp(&dir, data, modes)?;
    let linked = link_into_place(&tmp, &path);
    let removed = fs::remove_file(&tmp);
    let outcome = linked?;
    removed.map_err(|e| StoreError::io("remove", &tmp, e))?;
    fsync_dir(&dir)?;
    Ok(outcome)
}

/// Publish the staged file `tmp` (open as `file`) at `base/key` unless something is there
/// already; the staged name stays (its owner removes it).
fn publish_blocking(
    base: &Path,
    key: &str,
    tmp: &Path,
    file: &File,
    modes: Modes,
) -> StoreResult<PutOutcome> {
    file.sync_all()
        .map_err(|e| StoreError::io("fsync", tmp, e))?;
    let (path, dir) = prepare_publish(base, key, modes)?;
    if path_is_file(&path) {
        return exists(&dir);
    }
    let outcome = link_into_place(tmp, &path)?;
    fsync_dir(&dir)?;
    Ok(outcome)
}

/// The path of object `key` and its directory, created if missing.
fn prepare_publish(base: &Path, key: &str, modes: Modes) -> StoreResult<(PathBuf, PathBuf)> {
    let path = base.join(key);
    let dir = path.parent().unwrap_or(base).to_path_buf();
    if let Some(rel) = Path::new(key).parent() {
        create_dirs(base, rel, modes)?;
    }
    Ok((path, dir))
}

fn path_is_file(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok_and(|m| m.is_file())
}

/// The object is there already. The fsync makes sure the object the caller is about to rely
/// on is durable even if its writer has not finished publishing it yet. (The check before
/// is a cheap early exit; the link is what guarantees no overwrite.)
fn exists(dir: &Path) -> StoreResult<PutOutcome> {
    fsync_dir(dir)?;
    Ok(PutOutcome::AlreadyExists)
}

/// Links the durable file `tmp` to `path`, which must not exist.
fn link_into_place(tmp: &Path, path: &Path) -> StoreResult<PutOutcome> {
    match fs::hard_link(tmp, path) {
        Ok(()) => Ok(PutOutcome::Created),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            if !path_is_file(path) {
                let e = io::Error::from_raw_os_error(libc::EISDIR);
                return Err(StoreError::io("link", path, e));
            }
            Ok(PutOutcome::AlreadyExists)
        }
        Err(e) => Err(StoreError::io("link", path, e)),
    }
}

fn get_range_blocking(path: &Path, key: &str, range: Range<u64>) -> StoreResult<Bytes> {
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if is_absent(&e) => return Err(StoreError::not_found(key)),
        Err(e) => return Err(StoreError::io("open", path, e)),
    };
    let meta = file
        .metadata()
        .map_err(|e| StoreError::io("stat", path, e))?;
    if meta.is_dir() {
        return Err(StoreError::not_found(key));
    }
    let size = meta.len();
    if range.start > range.end || range.end > size {
        return Err(StoreError::RangeOutOfBounds {
            key: key.to_owned(),
            start: range.start,
            end: range.end,
            size,
        });
    }
    let len = usize::try_from(range.end - range.start)
        .map_err(|_| StoreError::io("read", path, io::Error::from_raw_os_error(libc::EOVERFLOW)))?;
    let mut buf = vec![0u8; len];
    file.read_exact_at(&mut buf, range.start)
        .map_err(|e| StoreError::io("read", path, e))?;
    Ok(Bytes::from(buf))
}

/// Remove a file if present and make the removal durable.
fn remove_blocking(path: &Path) -> StoreResult<()> {
    match fs::remove_file(path) {
        Ok(()) => match path.parent() {
            Some(dir) => fsync_dir(dir),
            None => Ok(()),
        },
        Err(e) if is_absent(&e) => Ok(()),
        Err(e) => Err(StoreError::io("remove", path, e)),
    }
}

/// The compare-and-swap itself, under the repository's ref lock.
fn cas_blocking(
    refs: &Path,
    key: &str,
    expected: Option<RefVersion>,
    new: Option<Bytes>,
    modes: Modes,
) -> StoreResult<CasOutcome> {
    if !refs.is_dir() {
        let root = refs.parent().unwrap_or(refs);
        create_dirs(root, Path::new(REFS_SEGMENT), modes)?;
    }
    let _lock = FileLock::exclusive(&refs.join(REF_LOCK_NAME), modes)?;
    let path = refs.join(key);
    let current = read_optional(&path)?.map(|data| {
        let version = ref_version(&data);
        RefState {
            data: Bytes::from(data),
            version,
        }
    });
    if current.as_ref().map(|s| &s.version) != expected.as_ref() {
        return Ok(CasOutcome::Conflict { current });
    }
    let Some(data) = new else {
        remove_blocking(&path)?;
        return Ok(CasOutcome::Swapped { version: None });
    };
    let dir = path.parent().unwrap_or(refs).to_path_buf();
    if let Some(rel) = Path::new(key).parent() {
        create_dirs(refs, rel, modes)?;
    }
    let tmp = write_temp(&dir, &data, modes)?;
    if let Err(e) = fs::rename(&tmp, &path) {
        let _ = fs::remove_file(&tmp);
        return Err(StoreError::io("rename", &path, e));
    }
    fsync_dir(&dir)?;
    Ok(CasOutcome::Swapped {
        version: Some(ref_version(&data)),
    })
}

#[async_trait]
impl ObjectStore for LocalStore {
    fn describe(&self) -> String {
        self.root.display().to_string()
    }

    async fn put_if_absent(&self, key: &str, data: Bytes) -> StoreResult<PutOutcome> {
        validate_object_key(key)?;
        let (root, key, modes) = (self.root.clone(), key.to_owned(), self.modes);
        self.write(move || put_blocking(&root, &key, &data, modes))
            .await
    }

    async fn stage(&self, prefix: &str) -> StoreResult<Option<StagedFile>> {
        validate_prefix(prefix)?;
        let (root, prefix, location) = (self.root.clone(), prefix.to_owned(), self.describe());
        let modes = self.modes;
        let staged = self
            .write(move || {
                create_dirs(&root, Path::new(&prefix), modes)?;
                StagedFile::create(&root.join(&prefix), location.clone(), modes.file)
            })
            .await?;
        Ok(Some(staged))
    }

    async fn publish_staged(&self, key: &str, staged: &mut StagedFile) -> StoreResult<PutOutcome> {
        validate_object_key(key)?;
        let file = Arc::new(staged.handle()?);
        let (root, key, tmp) = (self.root.clone(), key.to_owned(), staged.path().to_owned());
        let modes = self.modes;
        let outcome = self
            .write(move || publish_blocking(&root, &key, &tmp, &file, modes))
            .await?;
        if outcome == PutOutcome::Created {
            staged.set_published();
        }
        Ok(outcome)
    }

    async fn get(&self, key: &str) -> StoreResult<Bytes> {
        validate_object_key(key)?;
        let path = self.root.join(key);
        let data = self.blocking(move || read_optional(&path)).await?;
        data.map(Bytes::from)
            .ok_or_else(|| StoreError::not_found(key))
    }

    async fn get_range(&self, key: &str, range: Range<u64>) -> StoreResult<Bytes> {
        validate_object_key(key)?;
        let (path, key) = (self.root.join(key), key.to_owned());
        self.blocking(move || get_range_blocking(&path, &key, range))
            .await
    }

    async fn head(&self, key: &str) -> StoreResult<Option<u64>> {
        validate_object_key(key)?;
        let path = self.root.join(key);
        self.blocking(move || match fs::metadata(&path) {
            Ok(m) if m.is_file() => Ok(Some(m.len())),
            Ok(_) => Ok(None),
            Err(e) if is_absent(&e) => Ok(None),
            Err(e) => Err(StoreError::io("stat", &path, e)),
        })
        .await
    }

    async fn list(&self, prefix: &str) -> StoreResult<Vec<ObjectMeta>> {
        validate_prefix(prefix)?;
        let (root, prefix, seen) = (self.root.clone(), prefix.to_owned(), self.seen.clone());
        self.blocking(move || {
            list_files(&root, &prefix, &[REFS_SEGMENT, RESERVE_NAME], true, &seen)
        })
        .await
    }

    async fn list_keys(&self, prefix: &str) -> StoreResult<Vec<String>> {
        validate_prefix(prefix)?;
        let (root, prefix, seen) = (self.root.clone(), prefix.to_owned(), self.seen.clone());
        let listed = self
            .blocking(move || {
                list_files(&root, &prefix, &[REFS_SEGMENT, RESERVE_NAME], false, &seen)
            })
            .await?;
        Ok(listed.into_iter().map(|m| m.key).collect())
    }

    async fn delete(&self, key: &str) -> StoreResult<()> {
        validate_object_key(key)?;
        let path = self.root.join(key);
        self.blocking(move || remove_blocking(&path)).await
    }

    async fn read_ref(&self, key: &str) -> StoreResult<Option<RefState>> {
        validate_ref_key(key)?;
        let path = self.refs_dir().join(key);
        let data = self.blocking(move || read_optional(&path)).await?;
        Ok(data.map(|data| RefState {
            version: ref_version(&data),
            data: Bytes::from(data),
        }))
    }

    async fn list_refs(&self, prefix: &str) -> StoreResult<Vec<String>> {
        validate_prefix(prefix)?;
        let (refs, prefix, seen) = (self.refs_dir(), prefix.to_owned(), self.seen.clone());
        let metas = self
            .blocking(move || list_files(&refs, &prefix, &[REF_LOCK_NAME], true, &seen))
            .await?;
        Ok(metas.into_iter().map(|m| m.key).collect())
    }

    async fn cas_ref(
        &self,
        key: &str,
        expected: Option<&RefVersion>,
        new: Option<Bytes>,
    ) -> StoreResult<CasOutcome> {
        validate_ref_key(key)?;
        let (refs, key, expected) = (self.refs_dir(), key.to_owned(), expected.cloned());
        let modes = self.modes;
        self.write(move || cas_blocking(&refs, &key, expected.clone(), new.clone(), modes))
            .await
    }

    async fn remove_stale_temporaries(&self, before: SystemTime) -> StoreResult<(u64, u64)> {
        let (root, seen) = (self.root.clone(), self.seen.clone());
        self.blocking(move || remove_temp_files(&root, before, &seen))
            .await
    }

    async fn replenish_reserve(&self) -> StoreResult<bool> {
        let root = self.root.clone();
        self.blocking(move || {
            reserve::replenish(&root)
                .map_err(|e| StoreError::io("reallocate space reserve", reserve::path(&root), e))
        })
        .await
    }
}

//! Objects written to a file before they are published: a large object (a pack) that is
//! built piece by piece then costs no memory while it is filled and stored. Only a store
//! that can publish a file without copying it (the local store: `link(2)`) offers staging
//! ([`ObjectStore::stage`](crate::ObjectStore::stage)); elsewhere callers build objects in
//! memory, which a single PUT needs anyway.

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use crate::key::TEMP_PREFIX;
use crate::{StoreError, StoreResult};

/// A file being written for [`ObjectStore::publish_staged`](crate::ObjectStore::publish_staged).
/// Its name is a temporary one (`.tmp-…`), so listings skip it and the sweep of stale
/// temporaries removes it if its writer dies; dropping it removes it (after a publication
/// only its temporary name goes: the object is another link to the same file).
#[derive(Debug)]
pub struct StagedFile {
    path: PathBuf,
    file: File,
    /// The store's description, for a full file system's error.
    location: String,
    /// Published: the file is the object now, and never changes again.
    published: bool,
}

impl StagedFile {
    /// A fresh temporary file in `dir` (created with O_EXCL: two writers never share one).
    pub(crate) fn create(dir: &Path, location: String, file_mode: u32) -> StoreResult<StagedFile> {
        let path = dir.join(format!(
            "{TEMP_PREFIX}{}",
            hex::encode(rand::random::<[u8; 8]>())
        ));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(file_mode)
            .open(&path)
            .map_err(|e| StoreError::io("create temporary file", &path, e))?;
        Ok(StagedFile {
            path,
            file,
            location,
            published: false,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Its size now.
    pub fn len(&self) -> StoreResult<u64> {
        self.file
            .metadata()
            .map(|m| m.len())
            .map_err(|e| StoreError::io("stat", &self.path, e))
    }

    pub fn is_empty(&self) -> StoreResult<bool> {
        Ok(self.len()? == 0)
    }

    /// Overwrites bytes at `offset` (a pack's salt, when its key was taken). Not once it is
    /// published.
    pub fn write_at(&self, offset: u64, bytes: &[u8]) -> StoreResult<()> {
        assert!(!self.published, "a published object never changes");
        self.file
            .write_all_at(bytes, offset)
            .map_err(|e| self.error("write", e))
    }

    /// Reads bytes at `offset` into `buf` (all of them, or an error).
    pub fn read_at(&self, offset: u64, buf: &mut [u8]) -> StoreResult<()> {
        self.file
            .read_exact_at(buf, offset)
            .map_err(|e| self.error("read", e))
    }

    /// The store error for an I/O error `e` of `op` on this file: a full file system says
    /// so, as the store's own writes do.
    pub fn error(&self, op: &'static str, e: io::Error) -> StoreError {
        self.errors()(op, e)
    }

    /// [`StagedFile::error`], for when the file is out of reach (inside a writer that failed).
    pub fn errors(&self) -> impl Fn(&'static str, io::Error) -> StoreError {
        let (path, location) = (self.path.clone(), self.location.clone());
        move |op, e| {
            if crate::local::reserve::is_full(&e) {
                StoreError::Full {
                    location: location.clone(),
                }
            } else {
                StoreError::io(op, &path, e)
            }
        }
    }

    /// A second handle on the file (to make it durable off the caller's thread).
    pub(crate) fn handle(&self) -> StoreResult<File> {
        self.file
            .try_clone()
            .map_err(|e| StoreError::io("duplicate handle", &self.path, e))
    }

    /// Its whole content (for a store that copies it).
    pub(crate) fn read_all(&self) -> StoreResult<Vec<u8>> {
        let mut buf = vec![0; usize::try_from(self.len()?).expect("fits memory")];
        self.read_at(0, &mut buf)?;
        Ok(buf)
    }

    /// Records that the file became the object.
    pub(crate) fn set_published(&mut self) {
        self.published = true;
    }
}

/// Appends go straight to the file (wrap it in a `BufWriter` for small pieces); map an
/// error with [`StagedFile::error`].
impl Write for StagedFile {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        assert!(!self.published, "a published object never changes");
        self.file.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for StagedFile {
    fn drop(&mut self) {
        if let Err(e) = fs::remove_file(&self.path) {
            if e.kind() != io::ErrorKind::NotFound {
                tracing::debug!(path = %self.path.display(), "removing a staged file: {e}");
            }
        }
    }
}

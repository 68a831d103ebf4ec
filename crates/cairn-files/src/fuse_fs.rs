//! The FUSE file system of a mount: read-only, a directory per image, a file per version.
//!
//! FUSE calls arrive on fuser's thread and are answered from tasks on the tokio runtime, so a
//! read that waits for the store does not hold up the next request (two readers, or a loop
//! device's queue, proceed at once). A version's file reads through an export's [`Base`]: the
//! same lazy reader, verification and host-wide chunk cache as `cairn export`. Its content
//! never changes, so the kernel may keep its pages across opens (`FOPEN_KEEP_CACHE`).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cairn_export::{Base, ContentCache, ExportStats};
use cairn_format::Id;
use cairn_repo::Repo;
use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation, INodeNo, LockOwner,
    OpenAccMode, OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry,
    ReplyOpen, ReplyXattr, Request,
};
use tokio::runtime::Handle;
use tokio::sync::OnceCell;

use crate::error::{FilesError, FilesResult};
use crate::namespace::{Child, Namespace, Node, ROOT};

/// How long the kernel may trust a name or an attribute: as long as the listing is trusted.
const TTL: Duration = crate::namespace::LISTING_TTL;

/// What the FUSE callbacks share with the tasks that answer them.
pub struct Shared {
    names: Namespace,
    repo: Arc<Repo>,
    cache: Arc<ContentCache>,
    stats: Arc<ExportStats>,
    readahead: usize,
    bases: Mutex<HashMap<Id, Arc<OnceCell<Arc<Base>>>>>,
    open_files: AtomicU64,
    uid: u32,
    gid: u32,
    mounted_at: SystemTime,
}

impl Shared {
    pub fn new(
        repo: Arc<Repo>,
        cache: Arc<ContentCache>,
        stats: Arc<ExportStats>,
        readahead: usize,
    ) -> Shared {
        // SAFETY: geteuid and getegid cannot fail and touch no memory of ours.
        let (uid, gid) = unsafe { (libc::geteuid(), libc::getegid()) };
        Shared {
            names: Namespace::new(repo.clone()),
            repo,
            cache,
            stats,
            readahead,
            bases: Mutex::new(HashMap::new()),
            open_files: AtomicU64::new(0),
            uid,
            gid,
            mounted_at: SystemTime::now(),
        }
    }

    /// The counters of every version read through the mount.
    pub fn stats(&self) -> &Arc<ExportStats> {
        &self.stats
    }

    /// Files open through the mount now.
    pub fn open_files(&self) -> u64 {
        self.open_files.load(Ordering::Relaxed)
    }

    /// The reader of version `id`, opened (its interior nodes read) on first use and kept.
    /// Stops the read-ahead of every version opened (before the process says it stopped).
    pub async fn stop_background(&self) {
        let bases: Vec<Arc<Base>> = self
            .bases
            .lock()
            .expect("bases lock")
            .values()
            .filter_map(|cell| cell.get().cloned())
            .collect();
        for base in bases {
            base.stop_background().await;
        }
    }

    async fn base(&self, id: Id) -> FilesResult<Arc<Base>> {
        let cell = self
            .bases
            .lock()
            .expect("bases lock")
            .entry(id)
            .or_default()
            .clone();
        let base = cell
            .get_or_try_init(|| async {
                let record = self.names.record(&id).ok_or_else(|| FilesError::Guest {
                    path: id.to_hex(),
                    reason: "no longer listed".into(),
                })?;
                let base = Base::open(
                    self.repo.clone(),
                    self.cache.clone(),
                    self.stats.clone(),
                    id,
                    record,
                    self.readahead,
                )
                .await?;
                Ok::<_, FilesError>(Arc::new(base))
            })
            .await?;
        Ok(base.clone())
    }

    fn dir_attr(&self, ino: u64) -> FileAttr {
        self.attr(ino, FileType::Directory, 0, 0o555, self.mounted_at)
    }

    fn file_attr(&self, ino: u64, id: &Id) -> Option<FileAttr> {
        let r = self.names.record(id)?;
        let mtime = UNIX_EPOCH + Duration::from_nanos(r.time_ns.max(0) as u64);
        Some(self.attr(ino, FileType::RegularFile, r.logical_size, 0o444, mtime))
    }

    fn attr(&self, ino: u64, kind: FileType, size: u64, perm: u16, time: SystemTime) -> FileAttr {
        FileAttr {
            ino: INodeNo(ino),
            size,
            blocks: size.div_ceil(512),
            atime: time,
            mtime: time,
            ctime: time,
            crtime: time,
            kind,
            perm,
            nlink: if kind == FileType::Directory { 2 } else { 1 },
            uid: self.uid,
            gid: self.gid,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    async fn lookup(&self, parent: u64, name: &str) -> FilesResult<Option<FileAttr>> {
        let Some(children) = self.children(parent).await? else {
            return Ok(None);
        };
        Ok(children
            .into_iter()
            .find(|c| c.name == name)
            .and_then(|c| self.child_attr(&c)))
    }

    fn child_attr(&self, c: &Child) -> Option<FileAttr> {
        match &c.version {
            Some(id) => self.file_attr(c.ino, id),
            None => Some(self.dir_attr(c.ino)),
        }
    }

    /// The names in directory `ino`; `None` when it is not a directory.
    async fn children(&self, ino: u64) -> FilesResult<Option<Vec<Child>>> {
        match self.names.node(ino) {
            Some(Node::Dir(path)) => Ok(Some(self.names.children(&path).await?)),
            _ => Ok(None),
        }
    }

    async fn read(&self, id: Id, offset: u64, size: u32) -> FilesResult<Vec<u8>> {
        let base = self.base(id).await?;
        let end = (offset + u64::from(size)).min(base.size());
        if offset >= end {
            return Ok(Vec::new());
        }
        let mut buf = vec![0u8; (end - offset) as usize];
        base.read(offset, &mut buf).await?;
        self.stats.reads.fetch_add(1, Ordering::Relaxed);
        self.stats
            .bytes_read
            .fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(buf)
    }
}

/// An error the kernel gets as EIO; the operator reads why in the log.
fn eio(what: &str, e: FilesError) -> Errno {
    tracing::warn!("{what}: {e}");
    Errno::EIO
}

/// The fuser side: each call is handed to a task on `rt`.
pub struct VersionFs {
    shared: Arc<Shared>,
    rt: Handle,
}

impl VersionFs {
    pub fn new(shared: Arc<Shared>, rt: Handle) -> VersionFs {
        VersionFs { shared, rt }
    }
}

impl Filesystem for VersionFs {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let Some(name) = name.to_str().map(str::to_owned) else {
            return reply.error(Errno::ENOENT);
        };
        let s = self.shared.clone();
        self.rt.spawn(async move {
            match s.lookup(parent.0, &name).await {
                Ok(Some(attr)) => reply.entry(&TTL, &attr, Generation(0)),
                Ok(None) => reply.error(Errno::ENOENT),
                Err(e) => reply.error(eio(&format!("listing for {name}"), e)),
            }
        });
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        let s = &self.shared;
        match s.names.node(ino.0) {
            Some(Node::Dir(_)) => reply.attr(&TTL, &s.dir_attr(ino.0)),
            Some(Node::Version(id)) => match s.file_attr(ino.0, &id) {
                Some(attr) => reply.attr(&TTL, &attr),
                None => reply.error(Errno::ENOENT),
            },
            None => reply.error(Errno::ENOENT),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        let s = self.shared.clone();
        self.rt.spawn(async move {
            let children = match s.children(ino.0).await {
                Ok(Some(c)) => c,
                Ok(None) => return reply.error(Errno::ENOTDIR),
                Err(e) => return reply.error(eio("listing the repository", e)),
            };
            let dots = [
                (ino.0, FileType::Directory, ".".to_string()),
                (ROOT, FileType::Directory, "..".to_string()),
            ];
            let children = children.into_iter().map(|c| {
                let kind = match c.version {
                    Some(_) => FileType::RegularFile,
                    None => FileType::Directory,
                };
                (c.ino, kind, c.name)
            });
            for (i, (child, kind, name)) in dots
                .into_iter()
                .chain(children)
                .enumerate()
                .skip(offset as usize)
            {
                if reply.add(INodeNo(child), i as u64 + 1, kind, &name) {
                    break;
                }
            }
            reply.ok();
        });
    }

    fn open(&self, _req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if flags.acc_mode() != OpenAccMode::O_RDONLY {
            return reply.error(Errno::EROFS);
        }
        let Some(Node::Version(id)) = self.shared.names.node(ino.0) else {
            return reply.error(Errno::EISDIR);
        };
        let s = self.shared.clone();
        self.rt.spawn(async move {
            match s.base(id).await {
                Ok(_) => {
                    s.open_files.fetch_add(1, Ordering::Relaxed);
                    reply.opened(FileHandle(0), FopenFlags::FOPEN_KEEP_CACHE);
                }
                Err(e) => reply.error(eio(&format!("opening version {}", id.short()), e)),
            }
        });
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(Node::Version(id)) = self.shared.names.node(ino.0) else {
            return reply.error(Errno::EISDIR);
        };
        let s = self.shared.clone();
        self.rt.spawn(async move {
            match s.read(id, offset, size).await {
                Ok(data) => reply.data(&data),
                Err(e) => reply.error(eio(
                    &format!("reading {size} bytes at {offset} of version {}", id.short()),
                    e,
                )),
            }
        });
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.shared.open_files.fetch_sub(1, Ordering::Relaxed);
        reply.ok();
    }

    /// Nothing is ever written, so there is nothing to flush or sync.
    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply.ok();
    }

    /// No extended attributes (the kernel asks for security labels).
    fn getxattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _name: &OsStr,
        _size: u32,
        reply: ReplyXattr,
    ) {
        reply.error(Errno::ENODATA);
    }

    fn listxattr(&self, _req: &Request, _ino: INodeNo, size: u32, reply: ReplyXattr) {
        if size == 0 {
            reply.size(0);
        } else {
            reply.data(&[]);
        }
    }
}

//! The life of exports on a host: the private run directory, one small state file per
//! running export, telling a socket that a live process serves from a stale one, and
//! claiming an export name or a socket path so that no second export takes it over.
//!
//! Files in the run directory (`$CAIRN_RUN_DIR`, else `$XDG_RUNTIME_DIR/cairn`, else
//! `$TMPDIR/cairn-<uid>`; always mode 0700 and owned by the user, checked as OpenSSH checks
//! the directory of its agent socket), per export name `NAME` (`/` written as `_`):
//!
//! | file | what |
//! |---|---|
//! | `NAME.ctl` | the control socket (status, COMMIT, overlay snapshots) |
//! | `NAME.json` | the state file: pid, version, URI, socket or address, overlay, start time; written atomically once the export serves, removed when it stops |
//! | `NAME.sock` | the NBD socket when no `--socket` was given |
//! | `NAME.lock` | `flock`ed by the process that holds the name; never deleted (deleting a lock file others may be opening would let two processes hold it) |
//! | `sock-HASH.lock` | the same for an NBD socket path (HASH: of the absolute path) |
//!
//! A socket is live when a connection to it succeeds (the kernel refuses connections to a
//! socket file whose listener is gone, whatever process now has its old pid); the peer's
//! credentials (`SO_PEERCRED`) then name the process that listens.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::net::{UnixListener, UnixStream};

/// Why an export cannot start, or its files cannot be handled.
#[derive(Debug, thiserror::Error)]
pub enum LifecycleError {
    /// The run directory could let another user swap sockets or state files.
    #[error("unsafe run directory {}: {reason}", path.display())]
    UnsafeDir { path: PathBuf, reason: String },
    /// A file operation failed.
    #[error("{op} {}: {source}", path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// Another process serves this socket path.
    #[error("socket {} is in use by {holder}; {advice}", path.display())]
    SocketBusy {
        path: PathBuf,
        holder: String,
        advice: String,
    },
    /// Another export has this name.
    #[error("export name {name:?} is in use by {holder} ({}); stop it with `cairn exports stop {name}` or choose another --name", control.display())]
    NameBusy {
        name: String,
        holder: String,
        control: PathBuf,
    },
    /// The socket path holds something else (a file, a directory).
    #[error("{} exists and is not a socket", path.display())]
    NotASocket { path: PathBuf },
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> LifecycleError + 'a {
    move |source| LifecycleError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// Where control sockets, state files and default NBD sockets live: `$CAIRN_RUN_DIR`, else
/// `$XDG_RUNTIME_DIR/cairn`, else `$TMPDIR/cairn-<uid>` (never a folder shared by users).
pub fn run_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("CAIRN_RUN_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d).join("cairn");
    }
    // SAFETY: getuid has no preconditions and cannot fail.
    let uid = unsafe { libc::getuid() };
    std::env::temp_dir().join(format!("cairn-{uid}"))
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Creates `dir` (mode 0700) if it is missing, then checks that it is a real directory (not
/// a symbolic link), owned by the effective user, and that no one else may enter it.
pub fn ensure_private_dir(dir: &Path) -> Result<(), LifecycleError> {
    ensure_private_dir_of(dir, euid())
}

fn ensure_private_dir_of(dir: &Path, uid: u32) -> Result<(), LifecycleError> {
    let unsafe_dir = |reason: String| LifecycleError::UnsafeDir {
        path: dir.to_path_buf(),
        reason,
    };
    let meta = match fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                fs::create_dir_all(parent).map_err(io_err("create directory", parent))?;
            }
            match fs::DirBuilder::new().mode(0o700).create(dir) {
                Ok(()) => {
                    // The umask may have taken bits away; set exactly 0700 (and check it).
                    fs::set_permissions(dir, fs::Permissions::from_mode(0o700))
                        .map_err(io_err("chmod 700", dir))?;
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io_err("create directory", dir)(e)),
            }
            fs::symlink_metadata(dir).map_err(io_err("stat", dir))?
        }
        Err(e) => return Err(io_err("stat", dir)(e)),
    };
    if meta.file_type().is_symlink() {
        return Err(unsafe_dir("it is a symbolic link; remove it".into()));
    }
    if !meta.is_dir() {
        return Err(unsafe_dir("it is not a directory; remove it".into()));
    }
    if meta.uid() != uid {
        return Err(unsafe_dir(format!(
            "owned by uid {}, not by you (uid {uid}); remove it",
            meta.uid()
        )));
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o077 != 0 {
        return Err(unsafe_dir(format!(
            "mode {mode:04o} lets other users in; it must be 0700 and yours (uid {uid}): \
             remove it or chmod 700 it"
        )));
    }
    Ok(())
}

/// The file-name form of an export name: `/` (which cannot be in a file name) as `%2F`, and
/// `%` as `%25`, so that two names never share a socket, a state file or an overlay
/// (`vm/disk0` and `vm_disk0` stay apart).
pub fn file_key(name: &str) -> String {
    name.replace('%', "%25").replace('/', "%2F")
}

/// The export name a file key stands for (the inverse of [`file_key`]).
pub fn name_of_file_key(key: &str) -> String {
    key.replace("%2F", "/").replace("%25", "%")
}

/// The file-name form older cairns gave export `name` (`/` as `_`, which two names could
/// share): where an overlay they made for it may still be.
pub fn legacy_file_key(name: &str) -> String {
    name.replace('/', "_")
}

/// The control socket of export `name` in `run`.
pub fn control_path(run: &Path, name: &str) -> PathBuf {
    run.join(format!("{}.ctl", file_key(name)))
}

/// The state file of export `name` in `run`.
pub fn state_path(run: &Path, name: &str) -> PathBuf {
    run.join(format!("{}.json", file_key(name)))
}

/// What is at a socket path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Probe {
    /// Nothing.
    Absent,
    /// A socket file nobody listens on (its process ended without removing it).
    Stale,
    /// A socket a process listens on (its pid when the kernel says).
    Live { pid: Option<u32> },
    /// Something that is not a socket.
    NotASocket,
}

/// How long a connection attempt may take before a socket counts as live but busy.
const PROBE_PATIENCE: Duration = Duration::from_secs(2);

/// Finds out whether a process listens on the Unix socket `path`, by connecting to it.
pub async fn probe(path: &Path) -> Result<Probe, LifecycleError> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {}
        Ok(_) => return Ok(Probe::NotASocket),
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Probe::Absent),
        Err(e) => return Err(io_err("stat", path)(e)),
    }
    match tokio::time::timeout(PROBE_PATIENCE, UnixStream::connect(path)).await {
        // A listener whose backlog is full: alive, but too busy to say who it is.
        Err(_) => Ok(Probe::Live { pid: None }),
        Ok(Ok(stream)) => {
            let pid = stream
                .peer_cred()
                .ok()
                .and_then(|c| c.pid())
                .and_then(|p| u32::try_from(p).ok())
                .filter(|&p| p > 0);
            Ok(Probe::Live { pid })
        }
        Ok(Err(e)) => match e.raw_os_error() {
            Some(libc::ECONNREFUSED) => Ok(Probe::Stale),
            Some(libc::ENOENT) => Ok(Probe::Absent),
            _ => Err(io_err("connect to", path)(e)),
        },
    }
}

/// Takes `flock` on `path` (created if missing) without waiting; `None` if another process
/// holds it.
fn try_lock(path: &Path) -> Result<Option<File>, LifecycleError> {
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .read(true)
        .write(true)
        .open(path)
        .map_err(io_err("open", path))?;
    // A lock held for a moment by no one: a child that inherited the descriptor between
    // fork and exec (close-on-exec closes it at exec). Try a few times.
    for _ in 0..25 {
        // SAFETY: plain syscall on a valid descriptor we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return Ok(Some(f));
        }
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EWOULDBLOCK) {
            return Err(io_err("lock", path)(e));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(None)
}

fn holder(pid: Option<u32>) -> String {
    match pid {
        Some(p) => format!("pid {p}"),
        None => "another process".to_string(),
    }
}

/// An export name held by this process until it is dropped.
#[derive(Debug)]
pub struct NameClaim {
    _lock: File,
}

/// Claims export name `name` in `run`: refused with [`LifecycleError::NameBusy`] (naming
/// the holder's pid) if a running export has it. Files a dead export of that name left
/// behind (control socket, state file) are removed.
pub async fn claim_name(run: &Path, name: &str) -> Result<NameClaim, LifecycleError> {
    let control = control_path(run, name);
    let busy = |pid: Option<u32>| LifecycleError::NameBusy {
        name: name.to_string(),
        holder: holder(pid),
        control: control.clone(),
    };
    let lock_path = run.join(format!("{}.lock", file_key(name)));
    let Some(lock) = try_lock(&lock_path)? else {
        let pid = match probe(&control).await? {
            Probe::Live { pid } => pid,
            _ => read_state(&state_path(run, name)).map(|s| s.pid),
        };
        return Err(busy(pid));
    };
    match probe(&control).await? {
        // A process that does not take the lock (an older cairn) still serves it.
        Probe::Live { pid } => return Err(busy(pid)),
        Probe::Stale | Probe::NotASocket => remove_quietly(&control),
        Probe::Absent => {}
    }
    remove_quietly(&state_path(run, name));
    Ok(NameClaim { _lock: lock })
}

/// An NBD socket this process listens on, held until dropped; [`SocketClaim::remove`]
/// deletes the socket file if it is still ours.
#[derive(Debug)]
pub struct SocketClaim {
    path: PathBuf,
    /// (device, inode) of the socket file we bound.
    file: (u64, u64),
    _lock: File,
}

impl SocketClaim {
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Deletes the socket file, unless something else has replaced it meanwhile.
    pub fn remove(&self) {
        if let Ok(m) = fs::symlink_metadata(&self.path) {
            if (m.dev(), m.ino()) == self.file {
                remove_quietly(&self.path);
            }
        }
    }
}

/// Binds the NBD socket `path`, never taking over a socket that a live process serves: that
/// is refused with [`LifecycleError::SocketBusy`], naming the export (from the state files
/// in `run`) or the pid that holds it. A stale socket file is replaced; anything that is not
/// a socket is refused.
pub async fn claim_socket(
    run: &Path,
    path: &Path,
) -> Result<(SocketClaim, UnixListener), LifecycleError> {
    let absolute = std::path::absolute(path).map_err(io_err("resolve", path))?;
    let hash = blake3::hash(absolute.as_os_str().as_encoded_bytes()).to_hex();
    let lock_path = run.join(format!("sock-{}.lock", &hash[..16]));
    let lock = try_lock(&lock_path)?;
    let probed = probe(path).await?;
    let busy = |pid: Option<u32>| {
        let export = read_states(run).into_iter().find(|s| {
            s.socket
                .as_deref()
                .and_then(|p| std::path::absolute(p).ok())
                == Some(absolute.clone())
        });
        match export {
            Some(s) => LifecycleError::SocketBusy {
                path: path.to_path_buf(),
                holder: format!("export {:?} (pid {})", s.name, pid.unwrap_or(s.pid)),
                advice: format!(
                    "stop it with `cairn exports stop {}` or choose another --socket",
                    s.name
                ),
            },
            None => LifecycleError::SocketBusy {
                path: path.to_path_buf(),
                holder: holder(pid),
                advice: "choose another --socket".into(),
            },
        }
    };
    let Some(lock) = lock else {
        let pid = match probed {
            Probe::Live { pid } => pid,
            _ => None,
        };
        return Err(busy(pid));
    };
    match probed {
        Probe::Live { pid } => return Err(busy(pid)),
        Probe::NotASocket => {
            return Err(LifecycleError::NotASocket {
                path: path.to_path_buf(),
            })
        }
        Probe::Stale => fs::remove_file(path).map_err(io_err("remove the stale socket", path))?,
        Probe::Absent => {}
    }
    let listener = UnixListener::bind(path).map_err(io_err("bind", path))?;
    let m = fs::symlink_metadata(path).map_err(io_err("stat", path))?;
    Ok((
        SocketClaim {
            path: path.to_path_buf(),
            file: (m.dev(), m.ino()),
            _lock: lock,
        },
        listener,
    ))
}

fn remove_quietly(path: &Path) {
    if let Err(e) = fs::remove_file(path) {
        if e.kind() != io::ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), error = %e, "cannot remove");
        }
    }
}

/// The state file of a running export (`<run dir>/<name>.json`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExportState {
    /// The export name.
    pub name: String,
    pub pid: u32,
    /// The version it started with, as IMAGE@N, and its id.
    pub version: String,
    pub id: String,
    /// How clients reach it.
    pub uri: String,
    /// Its Unix socket or TCP address (neither for stdin/socket activation).
    pub socket: Option<PathBuf>,
    pub listen: Option<String>,
    pub writable: bool,
    pub tls: bool,
    /// The overlay directory of a writable export.
    pub overlay: Option<PathBuf>,
    /// Start time, seconds since the Unix epoch.
    pub started: u64,
}

impl ExportState {
    /// Writes the state file atomically (a temporary renamed into place).
    pub fn write(&self, run: &Path) -> Result<(), LifecycleError> {
        let path = state_path(run, &self.name);
        let tmp = run.join(format!(".{}.json.{}.tmp", file_key(&self.name), self.pid));
        let body = serde_json::to_vec_pretty(self).expect("state serializes");
        fs::write(&tmp, body).map_err(io_err("write", &tmp))?;
        fs::rename(&tmp, &path).map_err(io_err("rename into place", &path))
    }

    /// Removes the state file of export `name`.
    pub fn remove(run: &Path, name: &str) {
        remove_quietly(&state_path(run, name));
    }
}

fn read_state(path: &Path) -> Option<ExportState> {
    serde_json::from_slice(&fs::read(path).ok()?).ok()
}

/// Every state file in `run`, live or not, by name.
pub fn read_states(run: &Path) -> Vec<ExportState> {
    let mut out: Vec<ExportState> = fs::read_dir(run)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.ends_with(".json") && !n.starts_with('.')
        })
        .filter_map(|e| read_state(&e.path()))
        .collect();
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

/// A running export: its state file and the pid that answers on its control socket.
#[derive(Debug, Clone)]
pub struct LiveExport {
    pub state: ExportState,
    pub pid: u32,
}

/// The exports running on this host (whose control socket answers), by name. State files of
/// exports that are gone are deleted, with the sockets they left behind.
pub async fn live_exports(run: &Path) -> Result<Vec<LiveExport>, LifecycleError> {
    let mut live = Vec::new();
    for state in read_states(run) {
        let control = control_path(run, &state.name);
        match probe(&control).await? {
            Probe::Live { pid } => {
                let pid = pid.unwrap_or(state.pid);
                live.push(LiveExport { state, pid });
            }
            gone => {
                tracing::debug!(name = %state.name, pid = state.pid, "removing the files of an export that is gone");
                ExportState::remove(run, &state.name);
                if gone == Probe::Stale {
                    remove_quietly(&control);
                }
                if let Some(sock) = &state.socket {
                    if probe(sock).await? == Probe::Stale {
                        remove_quietly(sock);
                    }
                }
            }
        }
    }
    Ok(live)
}

#[cfg(test)]
mod tests {

    #[test]
    fn file_keys_are_one_to_one() {
        let names = [
            "vm/disk0",
            "vm_disk0",
            "vm%2Fdisk0",
            "vm%252Fdisk0",
            "a/b/c",
            "a_b/c",
        ];
        let keys: std::collections::HashSet<String> = names.iter().map(|n| file_key(n)).collect();
        assert_eq!(keys.len(), names.len(), "{keys:?}");
        assert_eq!(file_key("vm/disk0"), "vm%2Fdisk0");
        assert!(keys.iter().all(|k| !k.contains('/')));
        for n in names {
            assert_eq!(name_of_file_key(&file_key(n)), n);
        }
    }

    use super::*;

    #[test]
    fn private_dirs_are_checked_like_openssh_does() {
        let t = tempfile::tempdir().unwrap();
        let me = euid();
        // Missing: created 0700 (parents too).
        let d = t.path().join("a/b/run");
        ensure_private_dir_of(&d, me).unwrap();
        assert_eq!(fs::metadata(&d).unwrap().mode() & 0o7777, 0o700);
        ensure_private_dir_of(&d, me).unwrap();
        // Someone else's.
        let err = ensure_private_dir_of(&d, me + 1).unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "unsafe run directory {}: owned by uid {me}, not by you (uid {}); remove it",
                d.display(),
                me + 1
            )
        );
        // Open to others: refused, never chmod-ed silently.
        fs::set_permissions(&d, fs::Permissions::from_mode(0o750)).unwrap();
        let err = ensure_private_dir_of(&d, me).unwrap_err().to_string();
        assert!(err.contains("mode 0750 lets other users in"), "{err}");
        assert_eq!(fs::metadata(&d).unwrap().mode() & 0o7777, 0o750);
        // Not a directory.
        let f = t.path().join("file");
        fs::write(&f, b"").unwrap();
        let err = ensure_private_dir_of(&f, me).unwrap_err().to_string();
        assert!(err.ends_with("it is not a directory; remove it"), "{err}");
    }

    #[tokio::test]
    async fn sockets_are_probed_and_claimed_once() {
        let t = tempfile::tempdir().unwrap();
        let run = t.path().join("run");
        ensure_private_dir(&run).unwrap();
        let sock = t.path().join("s.sock");
        assert_eq!(probe(&sock).await.unwrap(), Probe::Absent);
        let (claim, listener) = claim_socket(&run, &sock).await.unwrap();
        assert_eq!(
            probe(&sock).await.unwrap(),
            Probe::Live {
                pid: Some(std::process::id())
            }
        );
        // A second claim (same process, another lock descriptor) is refused.
        let err = claim_socket(&run, &sock).await.unwrap_err().to_string();
        assert_eq!(
            err,
            format!(
                "socket {} is in use by pid {}; choose another --socket",
                sock.display(),
                std::process::id()
            )
        );
        drop(listener);
        assert_eq!(probe(&sock).await.unwrap(), Probe::Stale);
        claim.remove();
        assert_eq!(probe(&sock).await.unwrap(), Probe::Absent);
        drop(claim);
        // A stale socket is replaced; a plain file is not.
        drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
        assert_eq!(probe(&sock).await.unwrap(), Probe::Stale);
        let (claim, _l) = claim_socket(&run, &sock).await.unwrap();
        claim.remove();
        drop(claim);
        fs::write(&sock, b"data").unwrap();
        assert_eq!(probe(&sock).await.unwrap(), Probe::NotASocket);
        assert!(matches!(
            claim_socket(&run, &sock).await,
            Err(LifecycleError::NotASocket { .. })
        ));
    }

    #[tokio::test]
    async fn names_are_claimed_once_and_stale_state_is_cleaned() {
        let t = tempfile::tempdir().unwrap();
        let run = t.path().to_path_buf();
        let claim = claim_name(&run, "web/disk").await.unwrap();
        let err = claim_name(&run, "web/disk").await.unwrap_err();
        assert!(matches!(err, LifecycleError::NameBusy { .. }), "{err}");
        drop(claim);
        // A dead export's files.
        let state = ExportState {
            name: "web/disk".into(),
            pid: 1,
            version: "vm@1".into(),
            id: "00".into(),
            uri: "nbd+unix:///web/disk?socket=/nowhere".into(),
            socket: Some(t.path().join("gone.sock")),
            listen: None,
            writable: false,
            tls: false,
            overlay: None,
            started: 0,
        };
        state.write(&run).unwrap();
        drop(std::os::unix::net::UnixListener::bind(control_path(&run, "web/disk")).unwrap());
        drop(std::os::unix::net::UnixListener::bind(t.path().join("gone.sock")).unwrap());
        assert_eq!(read_states(&run), vec![state]);
        assert!(live_exports(&run).await.unwrap().is_empty());
        assert!(read_states(&run).is_empty());
        assert!(!control_path(&run, "web/disk").exists());
        assert!(!t.path().join("gone.sock").exists());
        let _claim = claim_name(&run, "web/disk").await.unwrap();
    }
}

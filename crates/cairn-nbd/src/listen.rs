//! Accept loops: TCP, Unix socket, and a single connection on stdin/stdout.
//!
//! Each accepted connection runs in its own task, so a misbehaving client
//! (garbage, mid-request disconnect, panicking export) only ends its own
//! connection; errors are logged, never propagated to the accept loop.

use std::io;
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::sync::Arc;

use tokio::net::{TcpListener, ToSocketAddrs, UnixListener};
use tracing::{debug, warn};

use crate::error::NbdError;
use crate::server::Server;

/// Bind `addr` and serve forever (IANA port for NBD is 10809).
pub async fn serve_tcp<A: ToSocketAddrs>(server: Arc<Server>, addr: A) -> io::Result<()> {
    serve_tcp_listener(server, TcpListener::bind(addr).await?).await
}

/// Serve forever on an already-bound TCP listener.
pub async fn serve_tcp_listener(server: Arc<Server>, listener: TcpListener) -> io::Result<()> {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                // Transient accept failures (EMFILE, ECONNABORTED) must not
                // stop the server.
                warn!(error = %e, "nbd: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        // The spec asks both sides to disable Nagle.
        let _ = stream.set_nodelay(true);
        let server = server.clone();
        tokio::spawn(async move {
            log_end(&peer.to_string(), server.serve(stream).await);
        });
    }
}

/// Bind a Unix socket at `path` (replacing a stale socket file, but never a
/// non-socket file) and serve forever.
pub async fn serve_unix(server: Arc<Server>, path: impl AsRef<Path>) -> io::Result<()> {
    let path = path.as_ref();
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)?,
        Ok(_) => {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!("{} exists and is not a socket", path.display()),
            ))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    serve_unix_listener(server, UnixListener::bind(path)?).await
}

/// Serve forever on an already-bound Unix listener.
pub async fn serve_unix_listener(server: Arc<Server>, listener: UnixListener) -> io::Result<()> {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(x) => x,
            Err(e) => {
                warn!(error = %e, "nbd: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let server = server.clone();
        tokio::spawn(async move {
            log_end("unix", server.serve(stream).await);
        });
    }
}

/// Serve one connection on stdin/stdout, the way libnbd's
/// `nbd_connect_command` runs a server (note: the `nbdinfo [ CMD ]` syntax
/// uses socket activation instead; see [`serve_socket_activation`]). When stdin is a
/// socket (libnbd passes one end of a socketpair as both stdin and stdout)
/// it is used directly for both directions; otherwise the two pipes are
/// joined.
pub async fn serve_stdio(server: Arc<Server>) -> Result<(), NbdError> {
    if fd_is_socket(0) && fd_is_socket(1) && same_file(0, 1) {
        // SAFETY: dup returns a fresh descriptor we exclusively own.
        let fd = unsafe { libc::dup(0) };
        if fd >= 0 {
            use std::os::fd::FromRawFd;
            // SAFETY: `fd` is a valid, owned socket descriptor.
            let std_stream = unsafe { std::os::unix::net::UnixStream::from_raw_fd(fd) };
            std_stream.set_nonblocking(true)?;
            let stream = tokio::net::UnixStream::from_std(std_stream)?;
            return server.serve(stream).await;
        }
    }
    let stream = tokio::io::join(tokio::io::stdin(), tokio::io::stdout());
    server.serve(stream).await
}

/// First file descriptor passed by systemd-style socket activation.
const SD_LISTEN_FDS_START: i32 = 3;

/// Serve forever on a listening socket handed over by systemd-style socket
/// activation (`LISTEN_PID` = our pid, `LISTEN_FDS` >= 1, socket on fd 3).
/// This is how `nbdinfo [ CMD ]`, `nbdcopy [ CMD ] ...` and libnbd's
/// `nbd_connect_systemd_socket_activation` start a server. Fails with
/// `NotFound` if the environment does not describe an activation for this
/// process.
pub async fn serve_socket_activation(server: Arc<Server>) -> io::Result<()> {
    let pid_ok = std::env::var("LISTEN_PID")
        .ok()
        .and_then(|p| p.trim().parse::<u32>().ok())
        == Some(std::process::id());
    let fds = std::env::var("LISTEN_FDS")
        .ok()
        .and_then(|n| n.trim().parse::<u32>().ok())
        .unwrap_or(0);
    if !pid_ok || fds < 1 {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            "no socket-activation listener (LISTEN_PID/LISTEN_FDS) for this process",
        ));
    }
    let fd = SD_LISTEN_FDS_START;
    // SAFETY: getsockname writes at most `len` bytes into `addr`.
    let family = unsafe {
        let mut addr: libc::sockaddr_storage = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        if libc::getsockname(fd, &mut addr as *mut _ as *mut libc::sockaddr, &mut len) != 0 {
            return Err(io::Error::last_os_error());
        }
        addr.ss_family as i32
    };
    use std::os::fd::FromRawFd;
    if family == libc::AF_UNIX {
        // SAFETY: fd 3 was handed to us for exclusive use by the activator.
        let l = unsafe { std::os::unix::net::UnixListener::from_raw_fd(fd) };
        l.set_nonblocking(true)?;
        serve_unix_listener(server, UnixListener::from_std(l)?).await
    } else {
        // SAFETY: as above.
        let l = unsafe { std::net::TcpListener::from_raw_fd(fd) };
        l.set_nonblocking(true)?;
        serve_tcp_listener(server, TcpListener::from_std(l)?).await
    }
}

fn fstat(fd: i32) -> Option<libc::stat> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a full `stat` on success; we only read it then.
    let rc = unsafe { libc::fstat(fd, st.as_mut_ptr()) };
    // SAFETY: only when fstat returned 0, i.e. it initialised the whole `stat`.
    (rc == 0).then(|| unsafe { st.assume_init() })
}

fn fd_is_socket(fd: i32) -> bool {
    fstat(fd).is_some_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFSOCK)
}

fn same_file(a: i32, b: i32) -> bool {
    match (fstat(a), fstat(b)) {
        (Some(x), Some(y)) => x.st_dev == y.st_dev && x.st_ino == y.st_ino,
        _ => false,
    }
}

fn log_end(peer: &str, res: Result<(), NbdError>) {
    match res {
        Ok(()) => debug!(peer, "nbd connection closed"),
        Err(e) => debug!(peer, error = %e, "nbd connection dropped"),
    }
}

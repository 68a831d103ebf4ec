//! `sd_notify`: tells systemd (a `Type=notify` service) that the export serves
//! (`READY=1`) and that it stops (`STOPPING=1`).
//!
//! The protocol is one datagram to the Unix socket named by `$NOTIFY_SOCKET` — a path, or an
//! abstract socket when it starts with `@` — so it is written here by hand rather than taken
//! from a crate: a dozen lines, no `unsafe`, no dependency.

use std::ffi::OsStr;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::net::UnixDatagram;
use std::path::Path;

/// Sends `message` (`KEY=VALUE` lines) to `$NOTIFY_SOCKET`. `Ok(false)` when the variable is
/// not set (not started by systemd, or not as `Type=notify`).
pub fn notify(message: &str) -> io::Result<bool> {
    match std::env::var_os("NOTIFY_SOCKET") {
        Some(target) if !target.is_empty() => notify_to(&target, message).map(|()| true),
        _ => Ok(false),
    }
}

/// Sends `message` to the notification socket `target` (a path, or `@name` for an abstract
/// socket).
pub fn notify_to(target: &OsStr, message: &str) -> io::Result<()> {
    let socket = UnixDatagram::unbound()?;
    let bytes = target.as_bytes();
    if let Some(name) = bytes.strip_prefix(b"@") {
        #[cfg(target_os = "linux")]
        {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            socket.send_to_addr(message.as_bytes(), &addr)?;
            return Ok(());
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = name;
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "abstract notification sockets exist only on Linux",
            ));
        }
    }
    socket.send_to(message.as_bytes(), Path::new(target))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn datagrams_reach_path_and_abstract_sockets() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let rx = UnixDatagram::bind(&path).unwrap();
        notify_to(path.as_os_str(), "READY=1\nSTATUS=serving").unwrap();
        let mut buf = [0u8; 256];
        let n = rx.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1\nSTATUS=serving");

        #[cfg(target_os = "linux")]
        {
            use std::os::linux::net::SocketAddrExt;
            let name = format!("cairn-notify-test-{}", std::process::id());
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
            let rx = UnixDatagram::bind_addr(&addr).unwrap();
            notify_to(OsStr::new(&format!("@{name}")), "STOPPING=1").unwrap();
            let n = rx.recv(&mut buf).unwrap();
            assert_eq!(&buf[..n], b"STOPPING=1");
        }

        let gone = dir.path().join("nobody");
        assert!(notify_to(gone.as_os_str(), "READY=1").is_err());
    }
}

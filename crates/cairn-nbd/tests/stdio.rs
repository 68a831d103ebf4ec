//! How a client tool spawns a server process: `serve_socket_activation`
//! (what `nbdinfo [ CMD ]` uses) and `serve_stdio` (what libnbd's
//! `nbd_connect_command` uses: a socketpair as stdin/stdout).
//!
//! This test binary has no libtest harness because it doubles as the
//! server: with `CAIRN_NBD_CHILD` set it serves a MemoryExport (libtest
//! would print to stdout and corrupt the stdio protocol stream); otherwise
//! it runs the tests, spawning itself as the server.

mod common;

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::sync::Arc;

use cairn_nbd::protocol::*;
use cairn_nbd::{serve_socket_activation, serve_stdio, MemoryExport, Server};
use common::{patterned, patterned_map, require_tool, run_ok};

const CHILD_ENV: &str = "CAIRN_NBD_CHILD";
const SIZE: usize = 256 * 1024;

fn child(mode: &str) -> ! {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let export = Arc::new(MemoryExport::from_vec(patterned(SIZE)));
    let server = Arc::new(Server::new().with_default_export(export));
    let res = match mode {
        "stdio" => rt.block_on(serve_stdio(server)).map_err(|e| e.to_string()),
        "activation" => rt
            .block_on(serve_socket_activation(server))
            .map_err(|e| e.to_string()),
        other => Err(format!("unknown child mode {other}")),
    };
    match res {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("child server ({mode}): {e}");
            std::process::exit(1)
        }
    }
}

fn nbdinfo_socket_activation() {
    require_tool("nbdinfo", "libnbd-bin");
    let exe = std::env::current_exe().unwrap();
    let nbdinfo = |arg: &str| {
        let out = run_ok(
            Command::new("nbdinfo")
                .arg(arg)
                .arg("[")
                .arg(&exe)
                .arg("]")
                .env(CHILD_ENV, "activation"),
        );
        String::from_utf8(out.stdout).unwrap()
    };
    assert_eq!(nbdinfo("--map"), patterned_map(SIZE));
    assert_eq!(nbdinfo("--size").trim(), SIZE.to_string());
}

fn stdio_socketpair() {
    let exe = std::env::current_exe().unwrap();
    let (mut ours, theirs) = UnixStream::pair().unwrap();
    let theirs_out = theirs.try_clone().unwrap();
    let mut child = Command::new(exe)
        .env(CHILD_ENV, "stdio")
        .stdin(Stdio::from(OwnedFd::from(theirs)))
        .stdout(Stdio::from(OwnedFd::from(theirs_out)))
        .spawn()
        .unwrap();
    ours.set_read_timeout(Some(std::time::Duration::from_secs(10)))
        .unwrap();

    let mut greeting = [0u8; GREETING_LEN];
    ours.read_exact(&mut greeting).unwrap();
    assert_eq!(&greeting[..16], b"NBDMAGICIHAVEOPT");
    ours.write_all(&NBD_FLAG_C_FIXED_NEWSTYLE.to_be_bytes())
        .unwrap();
    ours.write_all(&encode_option_request(
        NBD_OPT_GO,
        &encode_info_request("", &[]),
    ))
    .unwrap();
    loop {
        let mut h = [0u8; 20];
        ours.read_exact(&mut h).unwrap();
        let h = decode_option_reply_header(&h).unwrap();
        let mut payload = vec![0u8; h.len as usize];
        ours.read_exact(&mut payload).unwrap();
        if h.reply_type == NBD_REP_ACK {
            break;
        }
        assert_eq!(h.reply_type, NBD_REP_INFO);
    }
    let req = Request {
        flags: 0,
        command: NBD_CMD_READ,
        cookie: 42,
        offset: 4096,
        len: 8192,
    };
    ours.write_all(&encode_request(&req)).unwrap();
    let mut h = [0u8; SIMPLE_REPLY_LEN];
    ours.read_exact(&mut h).unwrap();
    assert_eq!(
        decode_reply_header(&h).unwrap(),
        ReplyHeader::Simple {
            error: 0,
            cookie: 42
        }
    );
    let mut data = vec![0u8; 8192];
    ours.read_exact(&mut data).unwrap();
    assert_eq!(data, patterned(SIZE)[4096..4096 + 8192]);
    ours.write_all(&encode_request(&Request {
        command: NBD_CMD_DISC,
        len: 0,
        offset: 0,
        ..req
    }))
    .unwrap();
    let status = child.wait().unwrap();
    assert!(status.success(), "stdio server exited with {status}");
}

fn main() {
    if let Ok(mode) = std::env::var(CHILD_ENV) {
        child(&mode);
    }
    // Honour a `cargo test -- <filter>` substring like libtest would.
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let tests: [(&str, fn()); 2] = [
        ("nbdinfo_socket_activation", nbdinfo_socket_activation),
        ("stdio_socketpair", stdio_socketpair),
    ];
    for (name, f) in tests {
        if filters.is_empty() || filters.iter().any(|flt| name.contains(flt.as_str())) {
            f();
            println!("test {name} ... ok");
        }
    }
}

//! Interoperability with real NBD clients (qemu-img, qemu-io from
//! `qemu-utils`; nbdinfo, nbdcopy from `libnbd-bin`) run as subprocesses
//! against an in-process server.

mod common;

use std::process::Command;
use std::sync::Arc;

use cairn_nbd::{MemoryExport, Server};
use common::{patterned, patterned_map, require_tool, run, run_ok, TestServer};

const SIZE: usize = 1024 * 1024;

fn two_exports() -> (TestServer, Arc<MemoryExport>, Arc<MemoryExport>) {
    let disk = Arc::new(MemoryExport::from_vec(patterned(SIZE)));
    let rw = Arc::new(MemoryExport::new(SIZE));
    let mut server = Server::new()
        .with_export("disk", disk.clone())
        .with_export("rw", rw.clone());
    server.set_description("disk", "patterned test disk");
    (TestServer::start(server), disk, rw)
}

#[test]
fn qemu_img_convert_reads_bit_exact() {
    require_tool("qemu-img", "qemu-utils");
    let (srv, _disk, _rw) = two_exports();
    let out = srv.path("out.raw");
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-f", "raw", "-O", "raw"])
            .arg(srv.uri("disk"))
            .arg(&out),
    );
    assert!(
        std::fs::read(&out).unwrap() == patterned(SIZE),
        "converted image differs"
    );
}

#[test]
fn qemu_img_convert_writes_bit_exact() {
    require_tool("qemu-img", "qemu-utils");
    let (srv, _disk, rw) = two_exports();
    let src = srv.path("src.raw");
    let mut data = patterned(SIZE);
    data.reverse();
    std::fs::write(&src, &data).unwrap();
    run_ok(
        Command::new("qemu-img")
            .args(["convert", "-n", "-f", "raw", "-O", "raw"])
            .arg(&src)
            .arg(srv.uri("rw")),
    );
    assert!(rw.contents() == data, "export contents differ from source");
}

#[test]
fn qemu_io_write_then_read() {
    require_tool("qemu-io", "qemu-utils");
    let (srv, _disk, rw) = two_exports();
    run_ok(
        Command::new("qemu-io")
            .args(["-f", "raw", "-c", "write -P 0xab 4096 65536"])
            .arg(srv.uri("rw")),
    );
    let out = run_ok(
        Command::new("qemu-io")
            .args(["-f", "raw", "-c", "read -P 0xab 4096 65536"])
            .arg(srv.uri("rw")),
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("read 65536/65536 bytes"), "{text}");
    // A pattern mismatch makes qemu-io print "Pattern verification failed".
    assert!(!text.contains("Pattern verification failed"), "{text}");
    let contents = rw.contents();
    assert!(contents[..4096].iter().all(|&b| b == 0));
    assert!(contents[4096..4096 + 65536].iter().all(|&b| b == 0xab));
    assert!(contents[4096 + 65536..].iter().all(|&b| b == 0));
    let written = rw.written_blocks();
    assert!(!written[0] && written[1..17].iter().all(|&w| w) && !written[17]);

    // Reading a different pattern must be noticed (the check is real).
    let out = run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "read -P 0xcd 4096 4096"])
        .arg(srv.uri("rw")));
    assert!(String::from_utf8_lossy(&out.stdout).contains("Pattern verification failed"));
}

#[test]
fn qemu_io_write_to_read_only_export_fails() {
    require_tool("qemu-io", "qemu-utils");
    let ro = Arc::new(MemoryExport::from_vec(patterned(SIZE)).read_only(true));
    let srv = TestServer::start(Server::new().with_export("ro", ro.clone()));
    let out = run(Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0xab 0 4096"])
        .arg(srv.uri("ro")));
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success() || all.contains("failed"),
        "write to a read-only export appeared to succeed: {all}"
    );
    assert!(ro.contents() == patterned(SIZE));
    // Reads still work.
    run_ok(
        Command::new("qemu-io")
            .args(["-r", "-f", "raw", "-c", "read 0 4096"])
            .arg(srv.uri("ro")),
    );
}

/// qemu refuses to even open a read-only export for writing, so to see the
/// server's own EPERM check, flip the export to read-only while qemu-io has
/// it open: the second write must fail with "Operation not permitted".
#[test]
fn qemu_io_write_rejected_after_export_turns_read_only() {
    require_tool("qemu-io", "qemu-utils");
    let rw = Arc::new(MemoryExport::new(SIZE));
    let srv = TestServer::start(Server::new().with_export("rw", rw.clone()));
    let child = Command::new("qemu-io")
        .args([
            "-f",
            "raw",
            "-c",
            "write -P 0x11 0 4096",
            "-c",
            "sleep 2000",
            "-c",
            "write -P 0x22 0 4096",
        ])
        .arg(srv.uri("rw"))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn qemu-io");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while rw.contents()[0] != 0x11 {
        assert!(
            std::time::Instant::now() < deadline,
            "first write never arrived"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    rw.set_read_only(true);
    let out = child.wait_with_output().unwrap();
    let all = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{all}");
    assert!(all.contains("Operation not permitted"), "{all}");
    assert!(rw.contents()[..4096].iter().all(|&b| b == 0x11));
}

#[test]
fn nbdinfo_lists_exports() {
    require_tool("nbdinfo", "libnbd-bin");
    let (srv, _disk, _rw) = two_exports();
    let out = run_ok(Command::new("nbdinfo").arg("--list").arg(srv.uri("")));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("export=\"disk\""), "{text}");
    assert!(text.contains("export=\"rw\""), "{text}");
    assert!(text.contains("description: patterned test disk"), "{text}");
    assert!(text.contains(&format!("export-size: {SIZE}")), "{text}");
}

#[test]
fn nbdinfo_map_shows_allocation() {
    require_tool("nbdinfo", "libnbd-bin");
    let (srv, _disk, _rw) = two_exports();
    let out = run_ok(Command::new("nbdinfo").arg("--map").arg(srv.uri("disk")));
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(text, patterned_map(SIZE));
}

#[test]
fn nbdcopy_bit_exact() {
    require_tool("nbdcopy", "libnbd-bin");
    let (srv, _disk, _rw) = two_exports();
    let out = srv.path("copy.raw");
    run_ok(Command::new("nbdcopy").arg(srv.uri("disk")).arg(&out));
    assert!(
        std::fs::read(&out).unwrap() == patterned(SIZE),
        "copied image differs"
    );
}

#[test]
fn tcp_and_unix_listeners() {
    require_tool("nbdinfo", "libnbd-bin");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let disk = Arc::new(MemoryExport::from_vec(patterned(SIZE)));
    let server = Arc::new(Server::new().with_export("disk", disk));

    // TCP on an ephemeral port.
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let port = listener.local_addr().unwrap().port();
    rt.spawn(cairn_nbd::serve_tcp_listener(server.clone(), listener));
    let out =
        run_ok(Command::new("nbdinfo").args(["--size", &format!("nbd://127.0.0.1:{port}/disk")]));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        SIZE.to_string()
    );

    // serve_unix replaces a stale socket file...
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    rt.spawn(cairn_nbd::serve_unix(server.clone(), sock.clone()));
    let uri = format!("nbd+unix:///disk?socket={}", sock.display());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let out = run(Command::new("nbdinfo").args(["--size", &uri]));
        if out.status.success() {
            assert_eq!(
                String::from_utf8_lossy(&out.stdout).trim(),
                SIZE.to_string()
            );
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "serve_unix never came up"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // ...but refuses to delete a regular file.
    let file = dir.path().join("not-a-socket");
    std::fs::write(&file, b"precious").unwrap();
    let err = rt
        .block_on(cairn_nbd::serve_unix(server, file.clone()))
        .unwrap_err();
    assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists);
    assert_eq!(std::fs::read(&file).unwrap(), b"precious");
    rt.shutdown_background();
}

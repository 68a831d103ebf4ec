//! The blocking NBD client ([`cairn_nbd::NbdImage`]) against real servers — qemu-nbd over
//! Unix and TCP sockets, qemu-storage-daemon with a dirty bitmap driven over QMP, cairn's own
//! server — and against scripted fake servers: dropped connections, hangs, error chunks,
//! old servers, and garbage (proptest).
//!
//! The QEMU tools are required: a missing tool fails the test with the package to install.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::fs::FileExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use cairn_image::{Allocation, DiskImage, ImageFormat, MapRun};
use cairn_nbd::protocol::*;
use cairn_nbd::{MemoryExport, NbdImage, Server};
use common::{require_tool, run_ok, TestServer};
use proptest::prelude::*;

const MIB: u64 = 1 << 20;

// ================================================================ helpers

/// A server process, killed (SIGKILL) and reaped on drop.
struct Daemon {
    name: &'static str,
    child: Child,
    stderr_path: PathBuf,
}

impl Daemon {
    fn spawn(name: &'static str, cmd: &mut Command, dir: &Path) -> Daemon {
        let stderr_path = dir.join(format!("{name}.stderr"));
        let stderr = std::fs::File::create(&stderr_path).expect("stderr file");
        eprintln!("$ {cmd:?}");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Daemon {
            name,
            child,
            stderr_path,
        }
    }

    /// Waits until `probe` succeeds, failing if the process exits or 20 s pass.
    fn wait_ready(&mut self, mut probe: impl FnMut() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if probe() {
                return;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "{} exited ({status}) before it was ready: {}",
                    self.name,
                    std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
                );
            }
            assert!(
                Instant::now() < deadline,
                "{} did not become ready",
                self.name
            );
            thread::sleep(Duration::from_millis(20));
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.kill();
    }
}

fn unix_ready(path: &Path) -> impl FnMut() -> bool + '_ {
    move || UnixStream::connect(path).is_ok()
}

fn require_qemu() {
    require_tool("qemu-nbd", "qemu-utils");
    require_tool("qemu-img", "qemu-utils");
    require_tool("qemu-io", "qemu-utils");
}

/// A port nobody listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .unwrap()
        .port()
}

/// Deterministic pseudo-random bytes, none zero.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    cairn_testkit::nonzero_noise(len, seed)
}

/// A sparse raw image of `size` bytes, laid out per MiB: `i % 4 == 0` full of data,
/// `== 2` two small unaligned data islands, others holes; returns its contents.
fn make_raw(path: &Path, size: u64) -> Vec<u8> {
    let file = std::fs::File::create(path).expect("create image");
    file.set_len(size).unwrap();
    let mut expect = vec![0u8; size as usize];
    let mut put = |at: u64, data: Vec<u8>| {
        file.write_all_at(&data, at).unwrap();
        expect[at as usize..at as usize + data.len()].copy_from_slice(&data);
    };
    for i in 0..size.div_ceil(MIB) {
        let base = i * MIB;
        let len = MIB.min(size - base);
        match i % 4 {
            0 => put(base, pattern(i, len as usize)),
            2 => {
                put(base + 65536, pattern(i, 4096));
                if len > 524288 + 2000 {
                    put(base + 524288 + 1000, pattern(i + 1000, 777));
                }
            }
            _ => {}
        }
    }
    expect
}

/// Checks a map against the image contents (the `DiskImage` contract's map rules); an NBD
/// export is one layer that never leaves a range unallocated. Returns the bytes mapped Zero.
fn check_map(map: &[MapRun], data: &[u8]) -> u64 {
    cairn_image::contract::check_map("nbd", map, data.len() as u64, 1, Some(data));
    assert!(map
        .iter()
        .all(|r| r.depth == 0 && r.alloc != Allocation::Unallocated));
    map.iter()
        .filter(|r| r.alloc == Allocation::Zero)
        .map(|r| r.len)
        .sum()
}

/// Reads an image every which way and compares with `expect`; checks its map.
fn check_image(img: &NbdImage, url: &str, expect: &[u8]) {
    let size = expect.len() as u64;
    assert_eq!(img.size(), size);
    assert_eq!(img.describe(), url);
    assert_eq!(
        img.layers(),
        vec![cairn_image::Layer {
            path: PathBuf::from(url),
            format: ImageFormat::Raw,
            size
        }]
    );
    let (align, max_request) = img.request_limits();
    assert!(max_request <= 32 * MIB && max_request >= align);

    // All of it in one call: split into several requests.
    assert!(size > max_request, "the image must exceed one request");
    let mut all = vec![0xeeu8; size as usize];
    img.read_at(&mut all, 0).unwrap();
    assert!(all == expect, "whole-image read differs");

    // Unaligned pieces of many sizes, including ones that straddle request boundaries.
    let mut x = 12345u64;
    for _ in 0..200 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let off = (x >> 20) % size;
        let len = match (x >> 8) % 4 {
            0 => 1 + (x >> 40) % 100,
            1 => 1 + (x >> 40) % 70000,
            2 => 1 + (x >> 40) % (3 * MIB),
            _ => 1 + (x >> 40) % (40 * MIB),
        }
        .min(size - off);
        let mut buf = vec![0xeeu8; len as usize];
        img.read_at(&mut buf, off).unwrap();
        assert!(
            buf == expect[off as usize..(off + len) as usize],
            "read of {len} bytes at {off} differs"
        );
    }
    for off in [0, 1, 511, 512, 4095, size - 1] {
        let mut b = [0u8; 1];
        img.read_at(&mut b, off).unwrap();
        assert_eq!(b[0], expect[off as usize], "byte at {off}");
    }
    let mut tail = vec![0u8; 10000];
    img.read_at(&mut tail, size - 10000).unwrap();
    assert!(tail == expect[(size - 10000) as usize..]);
    img.read_at(&mut [], size).unwrap();

    // Out of range: a clean error.
    let err = img
        .read_at(&mut [0u8; 2], size - 1)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        format!(
            "{url}: read of 2 bytes at offset {} is beyond the end of the export ({size} bytes)",
            size - 1
        )
    );

    // The map: every hole MiB (i % 4 == 1 or 3) must be Zero, data must be Data.
    let map = img.map().unwrap();
    eprintln!(
        "map of {url}: {} runs, first {:?}",
        map.len(),
        &map[..map.len().min(6)]
    );
    check_map(&map, expect);
    for i in 0..size / MIB {
        let (s, e) = (i * MIB, (i + 1) * MIB);
        let want = match i % 4 {
            1 | 3 => Allocation::Zero,
            0 => Allocation::Data,
            _ => continue,
        };
        for r in map.iter().filter(|r| r.start < e && r.end() > s) {
            assert_eq!(r.alloc, want, "MiB {i} overlaps {r:?}");
        }
    }
}

/// `qemu-nbd` serving `image` read-only on a Unix socket as export `disk`.
fn qemu_nbd_unix(dir: &Path, image: &Path) -> (Daemon, String) {
    let sock = dir.join("nbd.sock");
    let mut d = Daemon::spawn(
        "qemu-nbd",
        Command::new("qemu-nbd")
            .args(["-f", "raw", "-r", "-t", "-e", "8", "-x", "disk", "-k"])
            .arg(&sock)
            .arg(image),
        dir,
    );
    d.wait_ready(unix_ready(&sock));
    (d, format!("nbd+unix:///disk?socket={}", sock.display()))
}

// ================================================================ qemu-nbd

#[test]
fn qemu_nbd_unix_reads_and_maps() {
    require_qemu();
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("disk.raw");
    let expect = make_raw(&image, 40 * MIB + 65536);
    let (_qemu, url) = qemu_nbd_unix(dir.path(), &image);

    let img = NbdImage::connect(&url, None).unwrap();
    check_image(&img, &url, &expect);

    // Send + Sync: several threads share one connection.
    let img = Arc::new(img);
    cairn_image::contract::check(img.clone(), &expect);
    let expect = Arc::new(expect);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (img, expect) = (img.clone(), expect.clone());
            thread::spawn(move || {
                for k in 0..20u64 {
                    let off = (t * 7919 + k * 1_048_573) % (expect.len() as u64 - MIB);
                    let mut buf = vec![0u8; (MIB - k * 1000) as usize];
                    img.read_at(&mut buf, off).unwrap();
                    assert!(buf == expect[off as usize..off as usize + buf.len()]);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn qemu_nbd_tcp_reads_and_maps() {
    require_qemu();
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("disk.raw");
    let expect = make_raw(&image, 36 * MIB);
    let port = free_port();
    let mut qemu = Daemon::spawn(
        "qemu-nbd",
        Command::new("qemu-nbd")
            .args(["-f", "raw", "-r", "-t", "-e", "8", "-b", "127.0.0.1"])
            .args(["-p", &port.to_string(), "-x", "my disk"])
            .arg(&image),
        dir.path(),
    );
    qemu.wait_ready(|| std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    // The export name is percent-decoded.
    let url = format!("nbd://127.0.0.1:{port}/my%20disk");
    let img = NbdImage::connect(&url, None).unwrap();
    check_image(&img, &url, &expect);

    // An export the server does not have.
    let bad = format!("nbd://127.0.0.1:{port}/nope");
    let err = NbdImage::connect(&bad, None).unwrap_err().to_string();
    eprintln!("{err}");
    assert!(
        err.starts_with(&format!("{bad}: export \"nope\" not found")),
        "{err}"
    );
}

#[test]
fn qemu_nbd_killed_during_a_read_loop() {
    require_qemu();
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("disk.raw");
    let size = 64 * MIB;
    std::fs::write(&image, pattern(7, size as usize)).unwrap();
    let (mut qemu, url) = qemu_nbd_unix(dir.path(), &image);
    let img = Arc::new(NbdImage::connect(&url, None).unwrap());

    let reads = Arc::new(AtomicUsize::new(0));
    let reader = {
        let (img, reads) = (img.clone(), reads.clone());
        thread::spawn(move || {
            let mut buf = vec![0u8; 8 * MIB as usize];
            for i in 0u64.. {
                if let Err(e) = img.read_at(&mut buf, (i * 8 * MIB) % size) {
                    return e.to_string();
                }
                reads.fetch_add(1, Ordering::SeqCst);
            }
            unreachable!()
        })
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while reads.load(Ordering::SeqCst) < 3 {
        assert!(Instant::now() < deadline, "no reads happened");
        thread::sleep(Duration::from_millis(1));
    }
    qemu.kill();
    let err = reader.join().unwrap();
    eprintln!("{err}");
    let prefix = format!("{url}: connection closed by the server during a read at offset ");
    assert!(err.starts_with(&prefix), "{err}");
    let offset: u64 = err[prefix.len()..].parse().expect("offset");
    assert_eq!(offset % MIB, 0, "{err}");

    // The connection is abandoned; later calls say why.
    let again = img.read_at(&mut [0u8; 512], 0).unwrap_err().to_string();
    assert_eq!(
        again,
        format!(
            "{url}: the connection is unusable after an earlier error: {}",
            &err[url.len() + 2..]
        )
    );
}

// ================================================================ qemu-storage-daemon + QMP

/// A QMP session: greeting read, capabilities negotiated.
struct Qmp {
    reader: BufReader<UnixStream>,
}

impl Qmp {
    fn connect(path: &Path) -> Qmp {
        let stream = UnixStream::connect(path).expect("connect to QMP");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .unwrap();
        let mut qmp = Qmp {
            reader: BufReader::new(stream),
        };
        let greeting = qmp.line();
        assert!(greeting.contains("\"QMP\""), "QMP greeting: {greeting}");
        qmp.execute(r#"{"execute":"qmp_capabilities"}"#);
        qmp
    }

    fn line(&mut self) -> String {
        let mut line = String::new();
        self.reader.read_line(&mut line).expect("QMP read");
        assert!(!line.is_empty(), "QMP connection closed");
        line
    }

    /// Sends a command; returns its `return` line, skipping events. Fails on `error`.
    fn execute(&mut self, cmd: &str) -> String {
        eprintln!("QMP> {cmd}");
        let stream = self.reader.get_mut();
        stream.write_all(cmd.as_bytes()).unwrap();
        stream.write_all(b"\n").unwrap();
        loop {
            let line = self.line();
            eprintln!("QMP< {}", line.trim_end());
            if line.contains("\"return\"") {
                return line;
            }
            assert!(
                !line.contains("\"error\""),
                "QMP command {cmd} failed: {line}"
            );
        }
    }
}

#[test]
fn qsd_dirty_bitmap_extents() {
    require_qemu();
    require_tool("qemu-storage-daemon", "qemu-system-common");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let qcow2 = d.join("d.qcow2");
    let (sock, qmp_sock) = (d.join("nbd.sock"), d.join("qmp.sock"));
    run_ok(
        Command::new("qemu-img")
            .args(["create", "-f", "qcow2"])
            .arg(&qcow2)
            .arg("64M"),
    );
    run_ok(
        Command::new("qemu-io")
            .args(["-f", "qcow2"])
            .arg(&qcow2)
            .args(["-c", "write -P 0x11 0 1M", "-c", "write -P 0x22 10M 256k"]),
    );

    let mut qsd = Daemon::spawn(
        "qemu-storage-daemon",
        Command::new("qemu-storage-daemon")
            .arg("--blockdev")
            .arg(format!(
                "driver=file,node-name=file0,filename={}",
                qcow2.display()
            ))
            .args(["--blockdev", "driver=qcow2,node-name=disk0,file=file0"])
            .arg("--nbd-server")
            .arg(format!("addr.type=unix,addr.path={}", sock.display()))
            .arg("--chardev")
            .arg(format!(
                "socket,id=qmp0,path={},server=on,wait=off",
                qmp_sock.display()
            ))
            .args(["--monitor", "chardev=qmp0"]),
        d,
    );
    qsd.wait_ready(unix_ready(&qmp_sock));
    let mut qmp = Qmp::connect(&qmp_sock);
    // The bitmap must exist before the export that publishes it.
    qmp.execute(
        r#"{"execute":"block-dirty-bitmap-add","arguments":{"node":"disk0","name":"b0","persistent":true,"granularity":65536}}"#,
    );
    qmp.execute(
        r#"{"execute":"block-export-add","arguments":{"type":"nbd","id":"exp0","node-name":"disk0","name":"disk","writable":true,"bitmaps":["b0"]}}"#,
    );
    let url = format!("nbd+unix:///disk?socket={}", sock.display());

    // Nothing written since the bitmap was created.
    let img = NbdImage::connect(&url, Some("b0")).unwrap();
    assert_eq!(img.dirty_extents().unwrap(), vec![]);
    drop(img);

    run_ok(Command::new("qemu-io").args(["-f", "raw"]).arg(&url).args([
        "-c",
        "write -P 0x5a 5M 128k",
        "-c",
        "write -P 0x33 20M 64k",
        "-c",
        "write -P 0x44 30001k 3k",
    ]));

    let img = NbdImage::connect(&url, Some("b0")).unwrap();
    assert_eq!(img.size(), 64 * MIB);
    let dirty = img.dirty_extents().unwrap();
    // The writes rounded out to the 64 KiB granularity.
    assert_eq!(
        dirty,
        vec![
            (5 * MIB, 5 * MIB + 131072),
            (20 * MIB, 20 * MIB + 65536),
            (30670848, 30736384),
        ]
    );
    for (start, end) in &dirty {
        let mut buf = vec![0u8; (end - start) as usize];
        img.read_at(&mut buf, *start).unwrap();
        let expect_byte = |off: u64| match off {
            o if (5 * MIB..5 * MIB + 131072).contains(&o) => 0x5a,
            o if (20 * MIB..20 * MIB + 65536).contains(&o) => 0x33,
            o if (30001 * 1024..30004 * 1024).contains(&o) => 0x44,
            _ => 0,
        };
        for (i, b) in buf.iter().enumerate() {
            assert_eq!(
                *b,
                expect_byte(start + i as u64),
                "byte at {}",
                start + i as u64
            );
        }
    }
    // base:allocation works alongside the bitmap context.
    let mut whole = vec![0u8; 64 * MIB as usize];
    img.read_at(&mut whole, 0).unwrap();
    let zero = check_map(&img.map().unwrap(), &whole);
    assert!(zero >= 60 * MIB, "only {zero} bytes mapped Zero");
    assert!(whole[..MIB as usize].iter().all(|&b| b == 0x11));
    assert!(whole[10 * MIB as usize..(10 * MIB + 262144) as usize]
        .iter()
        .all(|&b| b == 0x22));
    drop(img);

    // A bitmap the server does not have.
    let err = NbdImage::connect(&url, Some("nope"))
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        format!(
            "{url}: NBD server has no dirty bitmap \"nope\" (qemu:dirty-bitmap:nope was not offered)"
        )
    );
    // No bitmap asked for.
    let img = NbdImage::connect(&url, None).unwrap();
    assert_eq!(
        img.dirty_extents().unwrap_err().to_string(),
        format!("{url}: no dirty bitmap was asked for when connecting")
    );
}

// ================================================================ cairn's own server

#[test]
fn cairn_server_odd_size() {
    // An export whose size is not a multiple of 512, with holes.
    let size = 3 * MIB as usize + 1000;
    let mut data = common::patterned(size);
    data[size - 300..].iter_mut().for_each(|b| *b = 0x77);
    let srv = TestServer::start(
        Server::new().with_export("disk", Arc::new(MemoryExport::from_vec(data.clone()))),
    );
    let url = srv.uri("disk");
    let img = NbdImage::connect(&url, None).unwrap();
    assert_eq!(img.size(), size as u64);
    let mut all = vec![0u8; size];
    img.read_at(&mut all, 0).unwrap();
    assert!(all == data);
    for (off, len) in [
        (size - 1, 1),
        (size - 777, 777),
        (4095, 5000),
        (1, size - 1),
    ] {
        let mut buf = vec![0u8; len];
        img.read_at(&mut buf, off as u64).unwrap();
        assert!(buf == data[off..off + len], "read {len} at {off}");
    }
    let map = img.map().unwrap();
    let zero = check_map(&map, &data);
    assert!(zero > 0, "no zero runs in {map:?}");
}

// ================================================================ failures

#[test]
fn connection_refused_and_bad_urls() {
    let err = NbdImage::connect("nbd://127.0.0.1:1/", None)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "nbd://127.0.0.1:1/: cannot connect to 127.0.0.1:1: Connection refused (os error 111)"
    );
    let err = NbdImage::connect("nbd+unix:///disk?socket=/nonexistent/x.sock", None)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "nbd+unix:///disk?socket=/nonexistent/x.sock: cannot connect to unix socket \
         /nonexistent/x.sock: No such file or directory (os error 2)"
    );
    for (url, what) in [
        ("nbds://host/disk", "TLS (nbds://) is not supported"),
        ("nbds+unix:///disk?socket=/s", "TLS (nbds+unix://) is not supported"),
        (
            "nbd+unix:///disk",
            "nbd+unix:// URLs need a socket=PATH query parameter (nbd+unix:///EXPORT?socket=PATH)",
        ),
        (
            "http://host/disk",
            "unknown URL scheme \"http\" (expected nbd://HOST[:PORT][/EXPORT] or nbd+unix:///EXPORT?socket=PATH)",
        ),
        ("nbd://host/disk?tls-type=x509", "TLS is not supported (URL query parameter tls-type=)"),
    ] {
        let err = NbdImage::connect(url, None).unwrap_err().to_string();
        assert_eq!(err, format!("{url}: {what}"));
    }
}

/// What a [`FakeServer`] does.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Script {
    /// Serves reads and block status properly.
    Serve,
    /// Closes the connection when the first read arrives.
    CloseAtFirstRead,
    /// Never answers the first read.
    HangAtFirstRead,
    /// Answers the first read with an error chunk, then serves.
    ErrorChunkOnce,
    /// Answers the first read with a data chunk reaching past the request.
    OversizedChunk,
}

/// A minimal scripted NBD server on a Unix socket.
struct FakeServer {
    _dir: tempfile::TempDir,
    url: String,
}

#[derive(Clone)]
struct FakeOptions {
    script: Script,
    structured: bool,
    go: bool,
    data: Arc<Vec<u8>>,
}

impl FakeServer {
    fn start(opts: FakeOptions) -> FakeServer {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("fake.sock");
        let listener = UnixListener::bind(&sock).unwrap();
        thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let opts = opts.clone();
                thread::spawn(move || fake_session(stream, &opts));
            }
        });
        FakeServer {
            url: format!("nbd+unix:///disk?socket={}", sock.display()),
            _dir: dir,
        }
    }
}

fn fake_session(mut s: UnixStream, o: &FakeOptions) -> std::io::Result<()> {
    let size = o.data.len() as u64;
    s.write_all(&encode_greeting(
        NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES,
    ))?;
    let mut flags = [0u8; 4];
    s.read_exact(&mut flags)?;
    let tflags = NBD_FLAG_HAS_FLAGS | NBD_FLAG_READ_ONLY;
    let mut structured = false;
    loop {
        let mut h = [0u8; OPTION_HEADER_LEN];
        s.read_exact(&mut h)?;
        let h = decode_option_header(&h).expect("option header");
        let mut data = vec![0u8; h.len as usize];
        s.read_exact(&mut data)?;
        let reply = |t: u32, d: &[u8]| encode_option_reply(h.option, t, d);
        match h.option {
            NBD_OPT_STRUCTURED_REPLY if o.structured => {
                structured = true;
                s.write_all(&reply(NBD_REP_ACK, &[]))?;
            }
            NBD_OPT_SET_META_CONTEXT if structured => {
                s.write_all(&reply(
                    NBD_REP_META_CONTEXT,
                    &encode_rep_meta_context(7, BASE_ALLOCATION),
                ))?;
                s.write_all(&reply(NBD_REP_ACK, &[]))?;
            }
            NBD_OPT_GO if o.go => {
                s.write_all(&reply(NBD_REP_INFO, &encode_info_export(size, tflags)))?;
                s.write_all(&reply(NBD_REP_ACK, &[]))?;
                break;
            }
            NBD_OPT_EXPORT_NAME => {
                s.write_all(&encode_export_name_reply(size, tflags, true))?;
                break;
            }
            _ => s.write_all(&reply(NBD_REP_ERR_UNSUP, &[]))?,
        }
    }
    let mut first_read = true;
    loop {
        let mut r = [0u8; REQUEST_LEN];
        s.read_exact(&mut r)?;
        let r = decode_request(&r).expect("request");
        let (start, end) = (r.offset as usize, r.offset as usize + r.len as usize);
        match r.command {
            NBD_CMD_READ => {
                let script = if first_read { o.script } else { Script::Serve };
                first_read = false;
                match script {
                    Script::CloseAtFirstRead => return Ok(()),
                    Script::HangAtFirstRead => {
                        thread::sleep(Duration::from_secs(30));
                        return Ok(());
                    }
                    Script::ErrorChunkOnce => {
                        s.write_all(&encode_error_chunk(r.cookie, NBD_EIO, "disk on fire"))?;
                    }
                    Script::OversizedChunk => {
                        s.write_all(&encode_offset_data_header(
                            r.cookie,
                            NBD_REPLY_FLAG_DONE,
                            r.offset,
                            r.len + 4096,
                        ))?;
                        s.write_all(&vec![1u8; r.len as usize + 4096])?;
                    }
                    Script::Serve if structured => {
                        s.write_all(&encode_offset_data_header(
                            r.cookie,
                            NBD_REPLY_FLAG_DONE,
                            r.offset,
                            r.len,
                        ))?;
                        s.write_all(&o.data[start..end])?;
                    }
                    Script::Serve => {
                        s.write_all(&encode_simple_reply(0, r.cookie))?;
                        s.write_all(&o.data[start..end])?;
                    }
                }
            }
            NBD_CMD_BLOCK_STATUS => {
                // Two extents, the second reaching past the request (allowed: clipped).
                let half = (r.len / 2).max(1);
                s.write_all(&encode_block_status(
                    r.cookie,
                    NBD_REPLY_FLAG_DONE,
                    7,
                    &[
                        BlockDescriptor {
                            len: half,
                            flags: 0,
                        },
                        BlockDescriptor {
                            len: r.len - half + 512,
                            flags: NBD_STATE_HOLE | NBD_STATE_ZERO,
                        },
                    ],
                ))?;
            }
            NBD_CMD_DISC => return Ok(()),
            _ => s.write_all(&encode_simple_reply(NBD_EINVAL, r.cookie))?,
        }
    }
}

fn fake(script: Script) -> FakeServer {
    FakeServer::start(FakeOptions {
        script,
        structured: true,
        go: true,
        data: Arc::new(pattern(3, 4 * MIB as usize)),
    })
}

#[test]
fn connection_closed_during_a_read() {
    let srv = fake(Script::CloseAtFirstRead);
    let img = NbdImage::connect(&srv.url, None).unwrap();
    let mut buf = vec![0u8; 65536];
    let err = img.read_at(&mut buf, 1048576).unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "{}: connection closed by the server during a read at offset 1048576",
            srv.url
        )
    );
    let err = img.map().unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "{}: the connection is unusable after an earlier error: \
             connection closed by the server during a read at offset 1048576",
            srv.url
        )
    );
}

#[test]
fn hung_server_times_out() {
    let srv = fake(Script::HangAtFirstRead);
    let img = NbdImage::connect_with_timeout(&srv.url, None, Duration::from_secs(1)).unwrap();
    let t = Instant::now();
    let err = img.read_at(&mut [0u8; 4096], 8192).unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "{}: no reply from the server within 1 s during a read at offset 8192",
            srv.url
        )
    );
    assert!(t.elapsed() < Duration::from_secs(10));
}

#[test]
fn error_chunk_fails_one_read_only() {
    let srv = fake(Script::ErrorChunkOnce);
    let img = NbdImage::connect(&srv.url, None).unwrap();
    let err = img.read_at(&mut [0u8; 4096], 4096).unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "{}: the server failed a read at offset 4096 (4096 bytes): \
             EIO (input/output error): disk on fire",
            srv.url
        )
    );
    // The connection is still good.
    let mut buf = vec![0u8; 100_000];
    img.read_at(&mut buf, 12345).unwrap();
    assert!(buf == pattern(3, 4 * MIB as usize)[12345..112345]);
    // Block status: the fake's final extent reaches past the query and is clipped.
    let map = img.map().unwrap();
    assert_eq!(map.iter().map(|r| r.len).sum::<u64>(), 4 * MIB);
    assert_eq!(map.len(), 2);
    assert_eq!((map[0].alloc, map[0].len), (Allocation::Data, 2 * MIB));
    assert_eq!((map[1].alloc, map[1].len), (Allocation::Zero, 2 * MIB));
}

#[test]
fn oversized_chunk_is_a_protocol_error() {
    let srv = fake(Script::OversizedChunk);
    let img = NbdImage::connect(&srv.url, None).unwrap();
    let err = img.read_at(&mut [0u8; 4096], 0).unwrap_err().to_string();
    assert_eq!(
        err,
        format!(
            "{}: NBD protocol error from the server during a read at offset 0: \
             chunk [0, +8192) outside the read [0, +4096)",
            srv.url
        )
    );
}

#[test]
fn old_servers_simple_replies_and_export_name() {
    let data = Arc::new(pattern(9, 2 * MIB as usize + 4096));
    for (structured, go) in [(false, true), (false, false), (true, false)] {
        let srv = FakeServer::start(FakeOptions {
            script: Script::Serve,
            structured,
            go,
            data: data.clone(),
        });
        let img = NbdImage::connect(&srv.url, None).unwrap();
        assert_eq!(img.size(), data.len() as u64);
        let mut all = vec![0u8; data.len()];
        img.read_at(&mut all, 0).unwrap();
        assert!(all == *data, "structured={structured} go={go}");
        let mut buf = vec![0u8; 1000];
        img.read_at(&mut buf, 333).unwrap();
        assert!(buf == data[333..1333]);
        let map = img.map().unwrap();
        if structured {
            assert_eq!(map.len(), 2);
        } else {
            // No block status without structured replies: all data.
            assert_eq!(
                map,
                vec![MapRun {
                    start: 0,
                    len: data.len() as u64,
                    alloc: Allocation::Data,
                    depth: 0
                }]
            );
        }
        if !structured {
            let err = NbdImage::connect(&srv.url, Some("b0"))
                .unwrap_err()
                .to_string();
            assert_eq!(
                err,
                format!(
                    "{}: NBD server has no dirty bitmap \"b0\" \
                     (qemu:dirty-bitmap:b0 was not offered: no structured replies)",
                    srv.url
                )
            );
        }
    }
}

// ================================================================ garbage from the server

/// A server that sends `bytes` whatever the client says, then closes its side, draining
/// what the client sends so it never blocks.
fn garbage_server(bytes: Vec<u8>) -> FakeServer {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("garbage.sock");
    let listener = UnixListener::bind(&sock).unwrap();
    thread::spawn(move || {
        if let Ok((mut s, _)) = listener.accept() {
            let _ = s.write_all(&bytes);
            let _ = s.shutdown(std::net::Shutdown::Write);
            let _ = std::io::copy(&mut s, &mut std::io::sink());
        }
    });
    FakeServer {
        url: format!("nbd+unix:///disk?socket={}", sock.display()),
        _dir: dir,
    }
}

const T_SIZE: u64 = MIB;

/// A well-formed server transcript: the handshake, the reply to a 64 KiB read at 0
/// (cookie 1: data, hole) and to a block status query over the export (cookie 2).
fn transcript() -> (Vec<u8>, usize) {
    let mut t = Vec::new();
    t.extend_from_slice(&encode_greeting(
        NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES,
    ));
    t.extend(encode_option_reply(
        NBD_OPT_STRUCTURED_REPLY,
        NBD_REP_ACK,
        &[],
    ));
    t.extend(encode_option_reply(
        NBD_OPT_SET_META_CONTEXT,
        NBD_REP_META_CONTEXT,
        &encode_rep_meta_context(1, BASE_ALLOCATION),
    ));
    t.extend(encode_option_reply(
        NBD_OPT_SET_META_CONTEXT,
        NBD_REP_ACK,
        &[],
    ));
    t.extend(encode_option_reply(
        NBD_OPT_GO,
        NBD_REP_INFO,
        &encode_info_export(T_SIZE, NBD_FLAG_HAS_FLAGS | NBD_FLAG_READ_ONLY),
    ));
    t.extend(encode_option_reply(
        NBD_OPT_GO,
        NBD_REP_INFO,
        &encode_info_block_size(1, 4096, 32 * 1024 * 1024),
    ));
    t.extend(encode_option_reply(NBD_OPT_GO, NBD_REP_ACK, &[]));
    let handshake_len = t.len();
    t.extend_from_slice(&encode_offset_data_header(1, 0, 0, 4096));
    t.extend(pattern(1, 4096));
    t.extend_from_slice(&encode_offset_hole(1, 0, 4096, 61440));
    t.extend_from_slice(&encode_none_chunk(1));
    t.extend_from_slice(&encode_block_status(
        2,
        NBD_REPLY_FLAG_DONE,
        1,
        &[
            BlockDescriptor {
                len: 65536,
                flags: 0,
            },
            BlockDescriptor {
                len: (T_SIZE - 65536) as u32,
                flags: NBD_STATE_HOLE | NBD_STATE_ZERO,
            },
        ],
    ));
    (t, handshake_len)
}

/// Runs the transcript's client side; returns what happened (errors as strings).
fn drive(bytes: Vec<u8>) -> Result<(Vec<u8>, Vec<MapRun>), String> {
    let srv = garbage_server(bytes);
    let img = NbdImage::connect_with_timeout(&srv.url, None, Duration::from_secs(10))
        .map_err(|e| e.to_string())?;
    let mut buf = vec![0u8; 65536];
    let read = img.read_at(&mut buf, 0);
    let map = img.map();
    read.map_err(|e| e.to_string())?;
    Ok((buf, map.map_err(|e| e.to_string())?))
}

#[test]
fn transcript_is_understood() {
    let (t, _) = transcript();
    let (buf, map) = drive(t).unwrap();
    let mut expect = pattern(1, 4096);
    expect.resize(65536, 0);
    assert!(buf == expect);
    assert_eq!(
        map,
        vec![
            MapRun {
                start: 0,
                len: 65536,
                alloc: Allocation::Data,
                depth: 0
            },
            MapRun {
                start: 65536,
                len: T_SIZE - 65536,
                alloc: Allocation::Zero,
                depth: 0
            },
        ]
    );
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Set(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    /// A 32-bit field (length, size, cookie half…) set to an extreme value.
    Word(usize, u32),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), 1..=255u8).prop_map(|(p, b)| Mutation::Flip(p, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(p, b)| Mutation::Set(p, b)),
        any::<usize>().prop_map(Mutation::Truncate),
        (
            any::<usize>(),
            proptest::collection::vec(any::<u8>(), 1..40)
        )
            .prop_map(|(p, v)| Mutation::Insert(p, v)),
        (
            any::<usize>(),
            prop_oneof![
                Just(0u32),
                Just(1),
                Just(u32::MAX),
                Just(0x8000_0000),
                any::<u32>()
            ]
        )
            .prop_map(|(p, w)| Mutation::Word(p, w)),
    ]
}

fn apply(t: &mut Vec<u8>, m: &Mutation) {
    if t.is_empty() {
        return;
    }
    match m {
        Mutation::Flip(p, b) => {
            let i = p % t.len();
            t[i] ^= b;
        }
        Mutation::Set(p, b) => {
            let i = p % t.len();
            t[i] = *b;
        }
        Mutation::Truncate(p) => t.truncate(p % t.len()),
        Mutation::Insert(p, v) => {
            let i = p % t.len();
            t.splice(i..i, v.iter().copied());
        }
        Mutation::Word(p, w) => {
            let i = p % t.len();
            let n = 4.min(t.len() - i);
            t[i..i + n].copy_from_slice(&w.to_be_bytes()[..n]);
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Random bytes, possibly after a valid handshake prefix: an error, never a panic or hang.
    #[test]
    fn garbage_is_an_error(prefix in 0..4usize, noise in proptest::collection::vec(any::<u8>(), 0..1500)) {
        let (t, handshake_len) = transcript();
        let cut = [0, 16, 18, handshake_len][prefix];
        let mut bytes = t[..cut].to_vec();
        bytes.extend(noise);
        let started = Instant::now();
        let result = drive(bytes);
        prop_assert!(started.elapsed() < Duration::from_secs(8));
        prop_assert!(result.is_err(), "garbage accepted: {result:?}");
    }

    /// A valid transcript with a few mutations: whatever happens, no panic and no hang; any
    /// error names the URL.
    #[test]
    fn mutated_transcripts_never_panic(ms in proptest::collection::vec(mutation(), 1..4)) {
        let (mut t, _) = transcript();
        for m in &ms {
            apply(&mut t, m);
        }
        let started = Instant::now();
        if let Err(e) = drive(t) {
            prop_assert!(e.starts_with("nbd+unix:///disk?socket="), "{}", e);
            prop_assert!(!e.contains('\n'), "{}", e);
        }
        prop_assert!(started.elapsed() < Duration::from_secs(8));
    }
}

//! Protocol edge cases driven by a hand-rolled blocking client over the
//! Unix socket: malformed input, mid-request disconnects, error replies,
//! option negotiation corner cases, pipelining.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cairn_nbd::protocol::*;
use cairn_nbd::{Export, Extent, MemoryExport, Server};
use common::{patterned, TestServer};

const SIZE: usize = 1024 * 1024;

struct Client {
    s: UnixStream,
    structured: bool,
    context_id: Option<u32>,
}

#[derive(Debug, Default)]
struct Reply {
    error: u32,
    /// Reassembled READ data (holes expanded), relative to the request offset.
    data: Vec<u8>,
    /// Structured chunks: (type, flags, payload).
    chunks: Vec<(u16, u16, Vec<u8>)>,
}

impl Client {
    fn connect_with_flags(path: &Path, flags: u32) -> Client {
        let s = UnixStream::connect(path).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut c = Client {
            s,
            structured: false,
            context_id: None,
        };
        let mut g = [0u8; GREETING_LEN];
        c.s.read_exact(&mut g).unwrap();
        assert_eq!(&g[..16], b"NBDMAGICIHAVEOPT");
        assert_eq!(
            u16::from_be_bytes([g[16], g[17]]),
            NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES
        );
        c.s.write_all(&flags.to_be_bytes()).unwrap();
        c
    }

    fn connect(path: &Path) -> Client {
        Self::connect_with_flags(path, NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES)
    }

    /// Send an option and collect replies up to the final one.
    fn opt(&mut self, option: u32, data: &[u8]) -> Vec<(u32, Vec<u8>)> {
        self.s
            .write_all(&encode_option_request(option, data))
            .unwrap();
        let mut out = Vec::new();
        loop {
            let mut h = [0u8; 20];
            self.s.read_exact(&mut h).unwrap();
            let h = decode_option_reply_header(&h).unwrap();
            assert_eq!(h.option, option);
            let mut payload = vec![0u8; h.len as usize];
            self.s.read_exact(&mut payload).unwrap();
            out.push((h.reply_type, payload));
            if !matches!(
                h.reply_type,
                NBD_REP_SERVER | NBD_REP_INFO | NBD_REP_META_CONTEXT
            ) {
                return out;
            }
        }
    }

    /// Negotiate structured replies and base:allocation, then GO.
    fn go_full(path: &Path, name: &str) -> Client {
        let mut c = Client::connect(path);
        let r = c.opt(NBD_OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(r[0].0, NBD_REP_ACK);
        c.structured = true;
        let r = c.opt(
            NBD_OPT_SET_META_CONTEXT,
            &encode_meta_request(name, &["base:allocation"]),
        );
        assert_eq!(r.len(), 2, "{r:?}");
        assert_eq!(r[0].0, NBD_REP_META_CONTEXT);
        assert_eq!(&r[0].1[4..], b"base:allocation");
        c.context_id = Some(u32::from_be_bytes(r[0].1[..4].try_into().unwrap()));
        c.go(name);
        c
    }

    /// GO with simple replies only.
    fn go_simple(path: &Path, name: &str) -> Client {
        let mut c = Client::connect(path);
        c.go(name);
        c
    }

    fn go(&mut self, name: &str) -> u16 {
        let r = self.opt(NBD_OPT_GO, &encode_info_request(name, &[]));
        assert_eq!(r.last().unwrap().0, NBD_REP_ACK, "{r:?}");
        let info = r
            .iter()
            .find(|(t, p)| *t == NBD_REP_INFO && p[..2] == [0, 0])
            .expect("NBD_INFO_EXPORT");
        u16::from_be_bytes([info.1[10], info.1[11]])
    }

    fn send(&mut self, flags: u16, command: u16, cookie: u64, offset: u64, len: u32) {
        let req = Request {
            flags,
            command,
            cookie,
            offset,
            len,
        };
        self.s.write_all(&encode_request(&req)).unwrap();
    }

    /// Read one complete reply; `read_len` is the length of the READ this
    /// answers (needed to frame simple replies), else 0.
    fn reply(&mut self, read_lens: &HashMap<u64, (u64, u32)>) -> (u64, Reply) {
        let mut magic = [0u8; 4];
        self.s.read_exact(&mut magic).unwrap();
        let mut rep = Reply::default();
        if u32::from_be_bytes(magic) == SIMPLE_REPLY_MAGIC {
            let mut rest = [0u8; 12];
            self.s.read_exact(&mut rest).unwrap();
            let mut h = magic.to_vec();
            h.extend_from_slice(&rest);
            let ReplyHeader::Simple { error, cookie } = decode_reply_header(&h).unwrap() else {
                unreachable!()
            };
            rep.error = error;
            if error == 0 {
                if let Some(&(_, len)) = read_lens.get(&cookie) {
                    rep.data = vec![0u8; len as usize];
                    self.s.read_exact(&mut rep.data).unwrap();
                }
            }
            return (cookie, rep);
        }
        let mut cookie_out = None;
        loop {
            let mut h = magic.to_vec();
            let mut rest = [0u8; 16];
            self.s.read_exact(&mut rest).unwrap();
            h.extend_from_slice(&rest);
            let ReplyHeader::Structured {
                flags,
                reply_type,
                cookie,
                len,
            } = decode_reply_header(&h).unwrap()
            else {
                panic!("expected a structured chunk")
            };
            if let Some(c) = cookie_out {
                assert_eq!(c, cookie, "chunks of one reply must not interleave here");
            }
            cookie_out = Some(cookie);
            let mut payload = vec![0u8; len as usize];
            self.s.read_exact(&mut payload).unwrap();
            match reply_type {
                NBD_REPLY_TYPE_ERROR => {
                    rep.error = u32::from_be_bytes(payload[..4].try_into().unwrap())
                }
                NBD_REPLY_TYPE_OFFSET_DATA | NBD_REPLY_TYPE_OFFSET_HOLE => {
                    let (base, rlen) = read_lens[&cookie];
                    if rep.data.is_empty() {
                        rep.data = vec![0xee; rlen as usize];
                    }
                    let off = u64::from_be_bytes(payload[..8].try_into().unwrap()) - base;
                    if reply_type == NBD_REPLY_TYPE_OFFSET_DATA {
                        let d = &payload[8..];
                        rep.data[off as usize..off as usize + d.len()].copy_from_slice(d);
                    } else {
                        let n = u32::from_be_bytes(payload[8..12].try_into().unwrap());
                        rep.data[off as usize..(off + n as u64) as usize].fill(0);
                    }
                }
                _ => {}
            }
            rep.chunks.push((reply_type, flags, payload));
            if flags & NBD_REPLY_FLAG_DONE != 0 {
                return (cookie, rep);
            }
            self.s.read_exact(&mut magic).unwrap();
        }
    }

    fn read(&mut self, cookie: u64, offset: u64, len: u32) -> Reply {
        self.send(0, NBD_CMD_READ, cookie, offset, len);
        let lens = HashMap::from([(cookie, (offset, len))]);
        let (c, r) = self.reply(&lens);
        assert_eq!(c, cookie);
        r
    }

    fn simple_cmd(&mut self, flags: u16, cmd: u16, cookie: u64, offset: u64, len: u32) -> Reply {
        self.send(flags, cmd, cookie, offset, len);
        let (c, r) = self.reply(&HashMap::new());
        assert_eq!(c, cookie);
        r
    }

    fn write(&mut self, flags: u16, cookie: u64, offset: u64, data: &[u8]) -> Reply {
        self.send(flags, NBD_CMD_WRITE, cookie, offset, data.len() as u32);
        self.s.write_all(data).unwrap();
        let (c, r) = self.reply(&HashMap::new());
        assert_eq!(c, cookie);
        r
    }

    /// True if the server closed the connection.
    fn is_closed(&mut self) -> bool {
        let mut b = [0u8; 1];
        matches!(self.s.read(&mut b), Ok(0) | Err(_))
    }
}

fn setup() -> (TestServer, Arc<MemoryExport>, Arc<MemoryExport>) {
    let disk = Arc::new(MemoryExport::from_vec(patterned(SIZE)));
    let ro = Arc::new(MemoryExport::from_vec(patterned(SIZE)).read_only(true));
    let server = Server::new()
        .with_export("disk", disk.clone())
        .with_export("ro", ro.clone())
        .with_default_export(disk.clone());
    (TestServer::start(server), disk, ro)
}

#[test]
fn garbage_after_handshake_only_ends_that_connection() {
    let (srv, _disk, _) = setup();
    let mut bad = Client::go_full(&srv.socket, "disk");
    bad.s.write_all(&[0x5a; 64]).unwrap();
    assert!(
        bad.is_closed(),
        "server should hard-disconnect on bad magic"
    );

    let mut good = Client::go_full(&srv.socket, "disk");
    let r = good.read(1, 0, 8192);
    assert_eq!(r.error, 0);
    assert_eq!(r.data, patterned(SIZE)[..8192]);
}

#[test]
fn garbage_during_handshake_only_ends_that_connection() {
    let (srv, _disk, _) = setup();
    let mut bad = Client::connect(&srv.socket);
    bad.s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    assert!(bad.is_closed());
    // Unknown client flags.
    let mut bad = Client::connect_with_flags(&srv.socket, 0xffff_ffff);
    assert!(bad.is_closed());
    // Oversized option payload.
    let mut bad = Client::connect(&srv.socket);
    let mut hdr = encode_option_request(NBD_OPT_GO, &[]);
    hdr[12..16].copy_from_slice(&u32::MAX.to_be_bytes());
    bad.s.write_all(&hdr).unwrap();
    assert!(bad.is_closed());

    let mut good = Client::go_simple(&srv.socket, "disk");
    assert_eq!(good.read(1, 0, 512).error, 0);
}

#[test]
fn client_without_fixed_newstyle_is_refused() {
    let (srv, _, _) = setup();
    let mut c = Client::connect_with_flags(&srv.socket, 0);
    assert!(c.is_closed());
}

#[test]
fn disconnect_mid_write_only_ends_that_connection() {
    let (srv, disk, _) = setup();
    {
        let mut c = Client::go_full(&srv.socket, "disk");
        c.send(0, NBD_CMD_WRITE, 1, 0, 65536);
        c.s.write_all(&[0xff; 1000]).unwrap();
        // Dropped here, mid-payload.
    }
    {
        // And mid-header.
        let mut c = Client::go_full(&srv.socket, "disk");
        c.s.write_all(
            &encode_request(&Request {
                flags: 0,
                command: NBD_CMD_READ,
                cookie: 1,
                offset: 0,
                len: 512,
            })[..10],
        )
        .unwrap();
    }
    let mut c = Client::go_full(&srv.socket, "disk");
    let r = c.read(2, 0, 65536);
    assert_eq!(r.error, 0);
    assert_eq!(r.data, patterned(SIZE)[..65536]);
    assert!(
        disk.contents() == patterned(SIZE),
        "partial write must not be applied"
    );
}

#[test]
fn read_past_end_is_einval_and_connection_continues() {
    let (srv, _, _) = setup();
    for structured in [false, true] {
        let mut c = if structured {
            Client::go_full(&srv.socket, "disk")
        } else {
            Client::go_simple(&srv.socket, "disk")
        };
        assert_eq!(c.read(1, SIZE as u64 - 512, 1024).error, NBD_EINVAL);
        assert_eq!(c.read(2, u64::MAX - 10, 512).error, NBD_EINVAL);
        let r = c.read(3, SIZE as u64 - 512, 512);
        assert_eq!(r.error, 0);
        assert_eq!(r.data, patterned(SIZE)[SIZE - 512..]);
    }
}

#[test]
fn request_validation_errors() {
    let (srv, _disk, ro) = setup();
    let mut c = Client::go_full(&srv.socket, "disk");
    assert_eq!(c.read(1, 0, 0).error, NBD_EINVAL, "zero length");
    assert_eq!(c.read(2, 0, MAX_PAYLOAD + 1).error, NBD_EINVAL, "oversized");
    assert_eq!(
        c.simple_cmd(0, 99, 3, 0, 512).error,
        NBD_EINVAL,
        "unknown command"
    );
    assert_eq!(
        c.simple_cmd(NBD_CMD_FLAG_FAST_ZERO, NBD_CMD_WRITE_ZEROES, 4, 0, 512)
            .error,
        NBD_EINVAL,
        "unadvertised flag"
    );
    // Write past the end: ENOSPC, and the payload is consumed so the
    // stream stays in sync.
    assert_eq!(c.write(0, 5, SIZE as u64 - 10, &[1; 20]).error, NBD_ENOSPC);
    assert_eq!(
        c.simple_cmd(0, NBD_CMD_WRITE_ZEROES, 6, SIZE as u64, 1)
            .error,
        NBD_ENOSPC
    );
    assert_eq!(
        c.simple_cmd(0, NBD_CMD_TRIM, 7, SIZE as u64, 1).error,
        NBD_EINVAL
    );
    assert_eq!(c.simple_cmd(0, NBD_CMD_FLUSH, 8, 0, 0).error, 0);
    assert_eq!(c.simple_cmd(0, NBD_CMD_CACHE, 9, 0, 4096).error, 0);
    assert_eq!(c.read(10, 0, 512).error, 0);

    // Read-only export: EPERM for every write-type command.
    let mut c = Client::go_full(&srv.socket, "ro");
    assert_eq!(c.write(0, 1, 0, &[1; 512]).error, NBD_EPERM);
    assert_eq!(
        c.simple_cmd(0, NBD_CMD_WRITE_ZEROES, 2, 0, 512).error,
        NBD_EPERM
    );
    assert_eq!(c.simple_cmd(0, NBD_CMD_TRIM, 3, 0, 512).error, NBD_EPERM);
    assert_eq!(c.read(4, 0, 512).error, 0);
    assert!(ro.contents() == patterned(SIZE));

    // Block status needs the negotiated context.
    let mut c = Client::go_simple(&srv.socket, "disk");
    assert_eq!(
        c.simple_cmd(0, NBD_CMD_BLOCK_STATUS, 1, 0, 4096).error,
        NBD_EINVAL
    );
    let mut c = Client::connect(&srv.socket);
    c.opt(NBD_OPT_STRUCTURED_REPLY, &[]);
    c.structured = true;
    c.go("disk");
    assert_eq!(
        c.simple_cmd(0, NBD_CMD_BLOCK_STATUS, 1, 0, 4096).error,
        NBD_EINVAL
    );
}

#[test]
fn writes_flags_and_zeroes_round_trip() {
    let (srv, disk, _) = setup();
    let mut c = Client::go_full(&srv.socket, "disk");
    assert_eq!(c.write(NBD_CMD_FLAG_FUA, 1, 100, b"hello").error, 0);
    assert_eq!(&disk.contents()[100..105], b"hello");
    assert_eq!(
        c.simple_cmd(NBD_CMD_FLAG_NO_HOLE, NBD_CMD_WRITE_ZEROES, 2, 8192, 4096)
            .error,
        0
    );
    assert_eq!(c.simple_cmd(0, NBD_CMD_TRIM, 3, 16384, 8192).error, 0);
    let r = c.read(4, 8192, 4096);
    assert_eq!(r.error, 0);
    assert!(r.data.iter().all(|&b| b == 0));
    // An all-zero read is sent as a single hole chunk.
    assert_eq!(r.chunks.len(), 1);
    assert_eq!(r.chunks[0].0, NBD_REPLY_TYPE_OFFSET_HOLE);
    let written = disk.written_blocks();
    assert!(written[2], "NO_HOLE keeps the block allocated");
    assert!(!written[4] && !written[5], "trim deallocates");
    assert_eq!(c.simple_cmd(0, NBD_CMD_FLUSH, 5, 0, 0).error, 0);
    // DF is advertised with structured replies and accepted on reads.
    c.send(NBD_CMD_FLAG_DF, NBD_CMD_READ, 6, 0, 4096);
    let (_, r) = c.reply(&HashMap::from([(6, (0, 4096))]));
    assert_eq!(r.error, 0);
    assert_eq!(r.chunks.len(), 1);
}

#[test]
fn block_status_reports_allocation() {
    let (srv, _, _) = setup();
    let mut c = Client::go_full(&srv.socket, "disk");
    let id = c.context_id.unwrap();
    let descs = |r: &Reply| -> Vec<(u32, u32)> {
        assert_eq!(r.chunks.len(), 1);
        let (t, _, p) = &r.chunks[0];
        assert_eq!(*t, NBD_REPLY_TYPE_BLOCK_STATUS);
        assert_eq!(u32::from_be_bytes(p[..4].try_into().unwrap()), id);
        p[4..]
            .chunks(8)
            .map(|d| {
                (
                    u32::from_be_bytes(d[..4].try_into().unwrap()),
                    u32::from_be_bytes(d[4..].try_into().unwrap()),
                )
            })
            .collect()
    };
    let r = c.simple_cmd(0, NBD_CMD_BLOCK_STATUS, 1, 0, SIZE as u32);
    let d = descs(&r);
    assert_eq!(d.len(), 16);
    assert_eq!(d[0], (65536, 0));
    assert_eq!(d[1], (65536, NBD_STATE_HOLE | NBD_STATE_ZERO));
    let r = c.simple_cmd(
        NBD_CMD_FLAG_REQ_ONE,
        NBD_CMD_BLOCK_STATUS,
        2,
        4096,
        SIZE as u32 - 4096,
    );
    assert_eq!(descs(&r), vec![(61440, 0)]);
    let r = c.simple_cmd(NBD_CMD_FLAG_REQ_ONE, NBD_CMD_BLOCK_STATUS, 3, 65536, 1000);
    assert_eq!(descs(&r), vec![(1000, 3)]);
    // A range past the end of the export is invalid.
    let r = c.simple_cmd(0, NBD_CMD_BLOCK_STATUS, 4, 0, u32::MAX);
    assert_eq!(r.error, NBD_EINVAL, "beyond the end");
}

#[test]
fn pipelined_requests_all_answered() {
    let (srv, disk, _) = setup();
    let mut c = Client::go_full(&srv.socket, "disk");
    let mut lens = HashMap::new();
    // Interleave writes to the second half with reads of the first half,
    // without waiting for any reply.
    for i in 0..64u64 {
        if i % 2 == 0 {
            let off = i * 8192;
            c.send(0, NBD_CMD_READ, i, off, 8192);
            lens.insert(i, (off, 8192));
        } else {
            let off = SIZE as u64 / 2 + i * 4096;
            c.send(0, NBD_CMD_WRITE, i, off, 4096);
            c.s.write_all(&[i as u8; 4096]).unwrap();
        }
    }
    let mut seen = HashMap::new();
    for _ in 0..64 {
        let (cookie, r) = c.reply(&lens);
        assert_eq!(r.error, 0);
        assert!(seen.insert(cookie, r).is_none(), "duplicate reply {cookie}");
    }
    let pat = patterned(SIZE);
    let contents = disk.contents();
    for i in 0..64u64 {
        if i % 2 == 0 {
            let off = (i * 8192) as usize;
            assert_eq!(seen[&i].data, pat[off..off + 8192]);
        } else {
            let off = SIZE / 2 + i as usize * 4096;
            assert!(contents[off..off + 4096].iter().all(|&b| b == i as u8));
        }
    }
    // Soft disconnect: no reply, server closes.
    c.send(0, NBD_CMD_DISC, 99, 0, 0);
    assert!(c.is_closed());
}

#[test]
fn option_negotiation() {
    let (srv, _, _) = setup();
    let mut c = Client::connect(&srv.socket);
    assert_eq!(c.opt(1234, b"xyz")[0].0, NBD_REP_ERR_UNSUP);
    assert_eq!(c.opt(NBD_OPT_STARTTLS, &[])[0].0, NBD_REP_ERR_POLICY);
    assert_eq!(c.opt(NBD_OPT_EXTENDED_HEADERS, &[])[0].0, NBD_REP_ERR_UNSUP);
    assert_eq!(c.opt(NBD_OPT_LIST, &[1])[0].0, NBD_REP_ERR_INVALID);
    assert_eq!(
        c.opt(NBD_OPT_INFO, &encode_info_request("nope", &[]))[0].0,
        NBD_REP_ERR_UNKNOWN
    );
    assert_eq!(
        c.opt(NBD_OPT_INFO, &[0, 0, 0, 99])[0].0,
        NBD_REP_ERR_INVALID
    );
    assert_eq!(
        c.opt(
            NBD_OPT_SET_META_CONTEXT,
            &encode_meta_request("disk", &["base:allocation"])
        )[0]
        .0,
        NBD_REP_ERR_INVALID,
        "meta contexts need structured replies first"
    );
    let list = c.opt(NBD_OPT_LIST, &[]);
    let names: Vec<String> = list
        .iter()
        .filter(|(t, _)| *t == NBD_REP_SERVER)
        .map(|(_, p)| {
            let n = u32::from_be_bytes(p[..4].try_into().unwrap()) as usize;
            String::from_utf8(p[4..4 + n].to_vec()).unwrap()
        })
        .collect();
    assert_eq!(names, ["", "disk", "ro"]);
    assert_eq!(list.last().unwrap().0, NBD_REP_ACK);

    c.opt(NBD_OPT_STRUCTURED_REPLY, &[]);
    let r = c.opt(NBD_OPT_LIST_META_CONTEXT, &encode_meta_request("disk", &[]));
    assert_eq!(r[0].0, NBD_REP_META_CONTEXT);
    assert_eq!(&r[0].1[4..], b"base:allocation");
    let r = c.opt(
        NBD_OPT_LIST_META_CONTEXT,
        &encode_meta_request("disk", &["qemu:x"]),
    );
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0, NBD_REP_ACK);

    let r = c.opt(
        NBD_OPT_INFO,
        &encode_info_request("ro", &[NBD_INFO_NAME, NBD_INFO_BLOCK_SIZE]),
    );
    assert_eq!(r.last().unwrap().0, NBD_REP_ACK);
    let by_type: HashMap<u16, Vec<u8>> = r
        .iter()
        .filter(|(t, _)| *t == NBD_REP_INFO)
        .map(|(_, p)| (u16::from_be_bytes([p[0], p[1]]), p[2..].to_vec()))
        .collect();
    let export = &by_type[&NBD_INFO_EXPORT];
    assert_eq!(
        u64::from_be_bytes(export[..8].try_into().unwrap()),
        SIZE as u64
    );
    let tflags = u16::from_be_bytes([export[8], export[9]]);
    assert!(tflags & NBD_FLAG_HAS_FLAGS != 0 && tflags & NBD_FLAG_READ_ONLY != 0);
    assert!(tflags & NBD_FLAG_SEND_DF != 0 && tflags & NBD_FLAG_CAN_MULTI_CONN != 0);
    assert_eq!(by_type[&NBD_INFO_NAME], b"ro");
    let bs = &by_type[&NBD_INFO_BLOCK_SIZE];
    assert_eq!(bs[..4], 1u32.to_be_bytes());
    assert_eq!(bs[4..8], 4096u32.to_be_bytes());
    assert_eq!(bs[8..12], MAX_PAYLOAD.to_be_bytes());

    assert_eq!(c.opt(NBD_OPT_ABORT, &[])[0].0, NBD_REP_ACK);
    assert!(c.is_closed());
}

#[test]
fn export_name_option_and_default_export() {
    let (srv, _, _) = setup();
    for no_zeroes in [true, false] {
        let flags = NBD_FLAG_C_FIXED_NEWSTYLE | if no_zeroes { NBD_FLAG_C_NO_ZEROES } else { 0 };
        let mut c = Client::connect_with_flags(&srv.socket, flags);
        c.s.write_all(&encode_option_request(NBD_OPT_EXPORT_NAME, b""))
            .unwrap();
        let mut r = vec![0u8; if no_zeroes { 10 } else { 134 }];
        c.s.read_exact(&mut r).unwrap();
        assert_eq!(u64::from_be_bytes(r[..8].try_into().unwrap()), SIZE as u64);
        assert!(r[10..].iter().all(|&b| b == 0));
        let rd = c.read(1, 4096, 4096);
        assert_eq!(rd.error, 0);
        assert_eq!(rd.data, patterned(SIZE)[4096..8192]);
    }
    // Unknown export via EXPORT_NAME: the server must drop the connection.
    let mut c = Client::connect(&srv.socket);
    c.s.write_all(&encode_option_request(NBD_OPT_EXPORT_NAME, b"nope"))
        .unwrap();
    assert!(c.is_closed());
}

/// An export whose reads panic or fail, to check errors stay per-request.
struct Faulty;

#[async_trait::async_trait]
impl Export for Faulty {
    fn size(&self) -> u64 {
        1 << 20
    }
    fn read_only(&self) -> bool {
        false
    }
    async fn read(&self, offset: u64, _len: u32) -> std::io::Result<Bytes> {
        match offset {
            0 => panic!("deliberate test panic"),
            4096 => Err(std::io::Error::from_raw_os_error(libc::ENOSPC)),
            _ => Err(std::io::Error::other("disk on fire")),
        }
    }
    async fn write(&self, _: u64, _: Bytes, _: bool) -> std::io::Result<()> {
        Err(std::io::Error::from_raw_os_error(libc::EACCES))
    }
    async fn write_zeroes(&self, _: u64, _: u32, _: bool, _: bool) -> std::io::Result<()> {
        Ok(())
    }
    async fn trim(&self, _: u64, _: u32) -> std::io::Result<()> {
        Ok(())
    }
    async fn flush(&self) -> std::io::Result<()> {
        Ok(())
    }
    async fn cache(&self, _: u64, _: u32) -> std::io::Result<()> {
        Ok(())
    }
    async fn block_status(&self, _: u64, len: u32) -> std::io::Result<Vec<Extent>> {
        Ok(vec![Extent {
            len,
            hole: false,
            zero: false,
        }])
    }
}

#[test]
fn export_errors_map_to_nbd_errors() {
    let srv = TestServer::start(Server::new().with_export("f", Arc::new(Faulty)));
    for structured in [false, true] {
        let mut c = if structured {
            Client::go_full(&srv.socket, "f")
        } else {
            Client::go_simple(&srv.socket, "f")
        };
        assert_eq!(c.read(1, 0, 512).error, NBD_EIO, "panic becomes EIO");
        assert_eq!(c.read(2, 4096, 512).error, NBD_ENOSPC);
        assert_eq!(c.read(3, 8192, 512).error, NBD_EIO);
        assert_eq!(c.write(0, 4, 0, &[0; 512]).error, NBD_EPERM);
        assert_eq!(c.simple_cmd(0, NBD_CMD_FLUSH, 5, 0, 0).error, 0);
    }
}

/// A client that connects and never negotiates is dropped once the handshake's time is up,
/// so idle connections cannot pile up (here after 200 ms instead of a minute).
#[tokio::test]
async fn a_client_that_never_negotiates_is_dropped() {
    let mut server = Server::new().with_export("x", Arc::new(MemoryExport::new(4096)));
    server.set_handshake_timeout(Duration::from_millis(200));
    let (_client, conn) = tokio::io::duplex(4096);
    let err = server.serve(conn).await.unwrap_err();
    assert!(
        matches!(err, cairn_nbd::NbdError::HandshakeTimeout(_)),
        "{err}"
    );
}

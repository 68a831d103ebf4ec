//! One client connection: the fixed-newstyle handshake and the transmission-phase commands
//! (`READ`, `BLOCK_STATUS`, `DISC`), one request in flight at a time.
//!
//! Everything the server sends is treated as hostile: every length is checked against the
//! request it answers and against fixed caps before anything is allocated or read, so a
//! buggy or malicious server produces a [`Fail`], never a panic, a huge allocation or an
//! out-of-range write.

use std::io::{self, BufReader, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use crate::protocol::*;

/// The transport under a connection.
pub(super) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
    /// A scripted server for fuzzing: reads come from the bytes, writes go nowhere.
    Script(io::Cursor<Vec<u8>>),
}

impl Stream {
    pub(super) fn set_timeouts(&self, timeout: Duration) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => {
                s.set_nodelay(true)?;
                s.set_read_timeout(Some(timeout))?;
                s.set_write_timeout(Some(timeout))
            }
            Stream::Unix(s) => {
                s.set_read_timeout(Some(timeout))?;
                s.set_write_timeout(Some(timeout))
            }
            Stream::Script(_) => Ok(()),
        }
    }
    fn shutdown(&self) {
        let _ = match self {
            Stream::Tcp(s) => s.shutdown(Shutdown::Both),
            Stream::Unix(s) => s.shutdown(Shutdown::Both),
            Stream::Script(_) => Ok(()),
        };
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
            Stream::Script(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
            Stream::Script(_) => Ok(buf.len()),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Why a handshake step or a request failed.
#[derive(Debug)]
pub(super) enum Fail {
    /// The server closed the connection (EOF, reset, broken pipe).
    Closed,
    /// No data from (or no room towards) the server within the timeout.
    TimedOut,
    /// Another socket error.
    Io(io::Error),
    /// The server broke the protocol; the stream can no longer be trusted.
    Protocol(String),
    /// The server answered a well-formed error (the message is complete). After a
    /// transmission-phase `Server` failure the connection is still usable.
    Server(String),
}

impl Fail {
    fn io(e: io::Error) -> Fail {
        match e.kind() {
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => Fail::Closed,
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => Fail::TimedOut,
            _ => Fail::Io(e),
        }
    }

    /// Whether the connection must be abandoned after this failure.
    pub(super) fn is_fatal(&self) -> bool {
        !matches!(self, Fail::Server(_))
    }

    /// One line, e.g. `connection closed by the server during a read at offset 1048576`.
    pub(super) fn message(&self, during: &str, timeout: Duration) -> String {
        match self {
            Fail::Closed => format!("connection closed by the server during {during}"),
            Fail::TimedOut => format!(
                "no reply from the server within {} s during {during}",
                timeout.as_secs_f64()
            ),
            Fail::Io(e) => format!("i/o error during {during}: {e}"),
            Fail::Protocol(what) => {
                format!("NBD protocol error from the server during {during}: {what}")
            }
            Fail::Server(what) => what.clone(),
        }
    }
}

fn protocol<T>(what: impl Into<String>) -> Result<T, Fail> {
    Err(Fail::Protocol(what.into()))
}

/// Most chunks accepted in one read reply (each covers at least one byte; real servers send
/// one per allocation extent, a few thousand at most per 32 MiB).
const MAX_READ_CHUNKS: usize = 1 << 18;
/// Largest `NBD_REPLY_TYPE_BLOCK_STATUS` payload accepted (the spec's 2^20 descriptors).
const MAX_BLOCK_STATUS_PAYLOAD: u32 = 4 + 8 * (1 << 20);
/// Most replies accepted to one handshake option.
const MAX_OPTION_REPLIES: usize = 256;

/// What the handshake settled.
#[derive(Debug, Clone)]
pub(super) struct Negotiated {
    pub size: u64,
    pub transmission_flags: u16,
    /// `(minimum, preferred, maximum)` from `NBD_INFO_BLOCK_SIZE`, if the server sent it.
    pub block_sizes: Option<(u32, u32, u32)>,
    pub structured: bool,
    /// The metadata contexts the server selected: `(id, name)`.
    pub contexts: Vec<(u32, String)>,
}

/// A reply header of the transmission phase.
enum Header {
    Simple { error: u32 },
    Chunk { flags: u16, kind: u16, len: u32 },
}

/// A connected socket and its protocol state.
pub(super) struct Conn {
    io: BufReader<Stream>,
    next_cookie: u64,
    structured: bool,
    /// Ids of every selected metadata context: a block status reply has one chunk for each.
    context_ids: Vec<u32>,
    /// Why the connection was abandoned, if it was.
    pub(super) broken: Option<String>,
}

impl Conn {
    pub(super) fn new(stream: Stream) -> Conn {
        Conn {
            io: BufReader::with_capacity(128 * 1024, stream),
            next_cookie: 1,
            structured: false,
            context_ids: Vec::new(),
            broken: None,
        }
    }

    // ------------------------------------------------------------ raw I/O

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), Fail> {
        self.io.read_exact(buf).map_err(Fail::io)
    }
    fn read_u16(&mut self) -> Result<u16, Fail> {
        let mut b = [0u8; 2];
        self.read_exact(&mut b)?;
        Ok(u16::from_be_bytes(b))
    }
    fn read_u32(&mut self) -> Result<u32, Fail> {
        let mut b = [0u8; 4];
        self.read_exact(&mut b)?;
        Ok(u32::from_be_bytes(b))
    }
    fn read_u64(&mut self) -> Result<u64, Fail> {
        let mut b = [0u8; 8];
        self.read_exact(&mut b)?;
        Ok(u64::from_be_bytes(b))
    }
    /// Reads a payload whose length the caller has already bounded.
    fn read_vec(&mut self, len: usize) -> Result<Vec<u8>, Fail> {
        let mut v = vec![0u8; len];
        self.read_exact(&mut v)?;
        Ok(v)
    }
    fn send(&mut self, bytes: &[u8]) -> Result<(), Fail> {
        self.io.get_mut().write_all(bytes).map_err(Fail::io)
    }

    /// Shuts the socket down (both directions); later I/O fails at once.
    pub(super) fn shutdown(&mut self) {
        self.io.get_ref().shutdown();
    }

    // ------------------------------------------------------------ handshake

    /// Fixed-newstyle negotiation: structured replies, the metadata contexts `queries`, then
    /// `NBD_OPT_GO` for `export` (falling back to `NBD_OPT_EXPORT_NAME` on old servers).
    pub(super) fn handshake(&mut self, export: &str, queries: &[&str]) -> Result<Negotiated, Fail> {
        let magic = self.read_u64()?;
        if magic != NBD_MAGIC {
            return protocol(format!(
                "not an NBD server (greeting {magic:#018x} instead of NBDMAGIC)"
            ));
        }
        let style = self.read_u64()?;
        if style == OLDSTYLE_MAGIC {
            return protocol("the server speaks oldstyle negotiation, which is not supported");
        }
        if style != IHAVEOPT {
            return protocol(format!("bad greeting magic {style:#018x}"));
        }
        let server_flags = self.read_u16()?;
        if server_flags & NBD_FLAG_FIXED_NEWSTYLE == 0 {
            return protocol("the server does not support fixed newstyle negotiation");
        }
        let no_zeroes = server_flags & NBD_FLAG_NO_ZEROES != 0;
        let mut client_flags = NBD_FLAG_C_FIXED_NEWSTYLE;
        if no_zeroes {
            client_flags |= NBD_FLAG_C_NO_ZEROES;
        }
        self.send(&client_flags.to_be_bytes())?;

        // Structured replies: needed for sparse reads and for block status.
        self.send(&encode_option_request(NBD_OPT_STRUCTURED_REPLY, &[]))?;
        let (reply, _) = self.option_reply(NBD_OPT_STRUCTURED_REPLY)?;
        self.structured = match reply {
            NBD_REP_ACK => true,
            t if t & NBD_REP_FLAG_ERROR != 0 => false,
            t => return protocol(format!("unexpected reply {t} to NBD_OPT_STRUCTURED_REPLY")),
        };

        let mut contexts = Vec::new();
        if self.structured && !queries.is_empty() {
            self.send(&encode_option_request(
                NBD_OPT_SET_META_CONTEXT,
                &encode_meta_request(export, queries),
            ))?;
            let mut acked = false;
            for _ in 0..MAX_OPTION_REPLIES {
                let (reply, data) = self.option_reply(NBD_OPT_SET_META_CONTEXT)?;
                match reply {
                    NBD_REP_META_CONTEXT => {
                        if data.len() < 4 {
                            return protocol("NBD_REP_META_CONTEXT shorter than 4 bytes");
                        }
                        let id = u32::from_be_bytes([data[0], data[1], data[2], data[3]]);
                        let name = String::from_utf8_lossy(&data[4..]).into_owned();
                        if contexts.iter().any(|(i, _)| *i == id) {
                            return protocol(format!("metadata context id {id} given twice"));
                        }
                        contexts.push((id, name));
                    }
                    NBD_REP_ACK => {
                        acked = true;
                        break;
                    }
                    // The server cannot select contexts: no block status then.
                    t if t & NBD_REP_FLAG_ERROR != 0 => {
                        contexts.clear();
                        acked = true;
                        break;
                    }
                    t => {
                        return protocol(format!(
                            "unexpected reply {t} to NBD_OPT_SET_META_CONTEXT"
                        ))
                    }
                }
            }
            if !acked {
                return protocol("too many replies to NBD_OPT_SET_META_CONTEXT");
            }
        }
        self.context_ids = contexts.iter().map(|(id, _)| *id).collect();

        self.send(&encode_option_request(
            NBD_OPT_GO,
            &encode_info_request(export, &[NBD_INFO_BLOCK_SIZE]),
        ))?;
        let mut export_info: Option<(u64, u16)> = None;
        let mut block_sizes = None;
        for _ in 0..MAX_OPTION_REPLIES {
            let (reply, data) = self.option_reply(NBD_OPT_GO)?;
            match reply {
                NBD_REP_INFO => {
                    if data.len() < 2 {
                        return protocol("NBD_REP_INFO shorter than 2 bytes");
                    }
                    let be32 = |at: usize| {
                        u32::from_be_bytes([data[at], data[at + 1], data[at + 2], data[at + 3]])
                    };
                    match u16::from_be_bytes([data[0], data[1]]) {
                        NBD_INFO_EXPORT => {
                            if data.len() != 12 {
                                return protocol("NBD_INFO_EXPORT is not 12 bytes long");
                            }
                            let size = u64::from_be_bytes(data[2..10].try_into().expect("8"));
                            let flags = u16::from_be_bytes([data[10], data[11]]);
                            export_info = Some((size, flags));
                        }
                        NBD_INFO_BLOCK_SIZE => {
                            if data.len() != 14 {
                                return protocol("NBD_INFO_BLOCK_SIZE is not 14 bytes long");
                            }
                            block_sizes = Some((be32(2), be32(6), be32(10)));
                        }
                        // NBD_INFO_NAME, NBD_INFO_DESCRIPTION, future types: not needed.
                        _ => {}
                    }
                }
                NBD_REP_ACK => {
                    let Some((size, transmission_flags)) = export_info else {
                        return protocol("NBD_OPT_GO succeeded without NBD_INFO_EXPORT");
                    };
                    return Ok(Negotiated {
                        size,
                        transmission_flags,
                        block_sizes,
                        structured: self.structured,
                        contexts,
                    });
                }
                NBD_REP_ERR_UNSUP => return self.export_name(export, no_zeroes, contexts),
                t if t & NBD_REP_FLAG_ERROR != 0 => {
                    return Err(Fail::Server(go_error(t, export, &data)));
                }
                t => return protocol(format!("unexpected reply {t} to NBD_OPT_GO")),
            }
        }
        protocol("too many replies to NBD_OPT_GO")
    }

    /// The pre-`NBD_OPT_GO` way into transmission: the server answers with the size and
    /// flags, or (for an unknown export) just closes the connection.
    fn export_name(
        &mut self,
        export: &str,
        no_zeroes: bool,
        contexts: Vec<(u32, String)>,
    ) -> Result<Negotiated, Fail> {
        self.send(&encode_option_request(
            NBD_OPT_EXPORT_NAME,
            export.as_bytes(),
        ))?;
        let size = self.read_u64()?;
        let transmission_flags = self.read_u16()?;
        if !no_zeroes {
            let mut zeroes = [0u8; 124];
            self.read_exact(&mut zeroes)?;
        }
        Ok(Negotiated {
            size,
            transmission_flags,
            block_sizes: None,
            structured: self.structured,
            contexts,
        })
    }

    /// Reads one option reply to `option`: its type and (bounded) payload.
    fn option_reply(&mut self, option: u32) -> Result<(u32, Vec<u8>), Fail> {
        let mut raw = [0u8; 20];
        self.read_exact(&mut raw)?;
        let header = match decode_option_reply_header(&raw) {
            Ok(h) => h,
            Err(e) => return protocol(format!("bad option reply ({e})")),
        };
        if header.option != option {
            return protocol(format!(
                "reply to option {} while option {option} was pending",
                header.option
            ));
        }
        if header.len > MAX_OPTION_LEN {
            return protocol(format!(
                "option reply of {} bytes exceeds the {MAX_OPTION_LEN}-byte limit",
                header.len
            ));
        }
        let data = self.read_vec(header.len as usize)?;
        Ok((header.reply_type, data))
    }

    // ------------------------------------------------------------ transmission

    fn request(&mut self, command: u16, offset: u64, len: u32) -> Result<u64, Fail> {
        let cookie = self.next_cookie;
        self.next_cookie = self.next_cookie.wrapping_add(1);
        self.send(&encode_request(&Request {
            flags: 0,
            command,
            cookie,
            offset,
            len,
        }))?;
        Ok(cookie)
    }

    /// Reads the next reply header, which must answer `cookie`.
    fn header(&mut self, cookie: u64) -> Result<Header, Fail> {
        let magic = self.read_u32()?;
        let (header, got) = match magic {
            SIMPLE_REPLY_MAGIC => {
                let error = self.read_u32()?;
                (Header::Simple { error }, self.read_u64()?)
            }
            STRUCTURED_REPLY_MAGIC => {
                if !self.structured {
                    return protocol(
                        "structured reply chunk although structured replies were not negotiated",
                    );
                }
                let flags = self.read_u16()?;
                let kind = self.read_u16()?;
                let got = self.read_u64()?;
                let len = self.read_u32()?;
                (Header::Chunk { flags, kind, len }, got)
            }
            m => return protocol(format!("bad reply magic {m:#010x}")),
        };
        if got != cookie {
            return protocol(format!(
                "reply for cookie {got:#x} while only cookie {cookie:#x} was pending"
            ));
        }
        Ok(header)
    }

    /// Reads the payload of an error chunk (any type with bit 15 set): `ERRNO: message`.
    fn error_chunk(&mut self, kind: u16, len: u32) -> Result<String, Fail> {
        if len < 6 {
            return protocol(format!("error chunk of {len} bytes (at least 6 expected)"));
        }
        if len > MAX_OPTION_LEN {
            return protocol(format!("error chunk of {len} bytes is too long"));
        }
        let data = self.read_vec(len as usize)?;
        let code = u32::from_be_bytes([data[0], data[1], data[2], data[3]]);
        let msg_len = u16::from_be_bytes([data[4], data[5]]) as usize;
        let fixed_tail = if kind == NBD_REPLY_TYPE_ERROR_OFFSET {
            8
        } else {
            0
        };
        if 6 + msg_len + fixed_tail > data.len() {
            return protocol("error chunk message longer than the chunk");
        }
        let mut what = error_name(code);
        let msg = printable(&data[6..6 + msg_len]);
        if !msg.is_empty() {
            what.push_str(": ");
            what.push_str(&msg);
        }
        if kind == NBD_REPLY_TYPE_ERROR_OFFSET {
            let at = 6 + msg_len;
            let off = u64::from_be_bytes(data[at..at + 8].try_into().expect("8 bytes"));
            what.push_str(&format!(" (at offset {off})"));
        }
        Ok(what)
    }

    /// `NBD_CMD_READ` of `buf.len()` bytes at `offset` (aligned and within the export: the
    /// caller checks).
    pub(super) fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<(), Fail> {
        let len = buf.len() as u64;
        let cookie = self.request(NBD_CMD_READ, offset, len as u32)?;
        let failed = |e: &str| {
            Fail::Server(format!(
                "the server failed a read at offset {offset} ({len} bytes): {e}"
            ))
        };
        if !self.structured {
            return match self.header(cookie)? {
                Header::Simple { error: 0 } => self.read_exact(buf),
                Header::Simple { error } => Err(failed(&error_name(error))),
                Header::Chunk { .. } => protocol("structured reply chunk to a simple read"),
            };
        }
        let end = offset + len;
        let mut covered: Vec<(u64, u64)> = Vec::new();
        let mut error: Option<String> = None;
        loop {
            let (flags, kind, clen) = match self.header(cookie)? {
                Header::Simple { .. } => {
                    return protocol(
                        "simple reply to a read although structured replies were negotiated",
                    )
                }
                Header::Chunk { flags, kind, len } => (flags, kind, len),
            };
            match kind {
                NBD_REPLY_TYPE_OFFSET_DATA | NBD_REPLY_TYPE_OFFSET_HOLE => {
                    let (at, n) = if kind == NBD_REPLY_TYPE_OFFSET_DATA {
                        if clen < 9 {
                            return protocol(format!("data chunk of {clen} bytes"));
                        }
                        (self.read_u64()?, u64::from(clen - 8))
                    } else {
                        if clen != 12 {
                            return protocol(format!("hole chunk of {clen} bytes (12 expected)"));
                        }
                        let at = self.read_u64()?;
                        let n = u64::from(self.read_u32()?);
                        if n == 0 {
                            return protocol("empty hole chunk");
                        }
                        (at, n)
                    };
                    if at < offset || at.checked_add(n).is_none_or(|e| e > end) {
                        return protocol(format!(
                            "chunk [{at}, +{n}) outside the read [{offset}, +{len})"
                        ));
                    }
                    let dst = &mut buf[(at - offset) as usize..(at - offset + n) as usize];
                    if kind == NBD_REPLY_TYPE_OFFSET_DATA {
                        self.read_exact(dst)?;
                    } else {
                        dst.fill(0);
                    }
                    if covered.len() >= MAX_READ_CHUNKS {
                        return protocol("too many chunks in one read reply");
                    }
                    covered.push((at, at + n));
                }
                NBD_REPLY_TYPE_NONE => {
                    if clen != 0 || flags & NBD_REPLY_FLAG_DONE == 0 {
                        return protocol("malformed NBD_REPLY_TYPE_NONE chunk");
                    }
                }
                k if k & NBD_REPLY_TYPE_FLAG_ERROR != 0 => {
                    let e = self.error_chunk(k, clen)?;
                    error.get_or_insert(e);
                }
                k => return protocol(format!("unexpected chunk type {k} in a read reply")),
            }
            if flags & NBD_REPLY_FLAG_DONE != 0 {
                break;
            }
        }
        if let Some(e) = error {
            return Err(failed(&e));
        }
        covered.sort_unstable();
        let mut pos = offset;
        for (s, e) in covered {
            if s < pos {
                return protocol(format!("overlapping chunks at offset {s} in a read reply"));
            }
            if s > pos {
                break;
            }
            pos = e;
        }
        if pos != end {
            return protocol(format!(
                "the read reply did not cover [{pos}, {end}) of [{offset}, {end})"
            ));
        }
        Ok(())
    }

    /// `NBD_CMD_BLOCK_STATUS` for `[offset, offset + len)`: the extents of metadata context
    /// `want` as `(length, flags)`, clipped to the request, consecutive from `offset`, with
    /// equal neighbours merged. They may cover less than `len` (never nothing).
    pub(super) fn block_status(
        &mut self,
        offset: u64,
        len: u32,
        want: u32,
    ) -> Result<Vec<(u64, u32)>, Fail> {
        let cookie = self.request(NBD_CMD_BLOCK_STATUS, offset, len)?;
        let end = offset + u64::from(len);
        let mut seen = vec![false; self.context_ids.len()];
        let mut out: Vec<(u64, u32)> = Vec::new();
        let mut error: Option<String> = None;
        loop {
            let (flags, kind, clen) = match self.header(cookie)? {
                Header::Simple { error: 0 } => {
                    return protocol("simple reply without payload to a block status query")
                }
                Header::Simple { error: code } => {
                    error = Some(error_name(code));
                    break;
                }
                Header::Chunk { flags, kind, len } => (flags, kind, len),
            };
            match kind {
                NBD_REPLY_TYPE_BLOCK_STATUS => {
                    if clen < 12 || (clen - 4) % 8 != 0 || clen > MAX_BLOCK_STATUS_PAYLOAD {
                        return protocol(format!("block status chunk of {clen} bytes"));
                    }
                    let id = self.read_u32()?;
                    let Some(idx) = self.context_ids.iter().position(|&c| c == id) else {
                        return protocol(format!("block status for unknown metadata context {id}"));
                    };
                    if std::mem::replace(&mut seen[idx], true) {
                        return protocol(format!(
                            "two block status chunks for metadata context {id}"
                        ));
                    }
                    let mut pos = offset;
                    for _ in 0..(clen - 4) / 8 {
                        let elen = self.read_u32()?;
                        let eflags = self.read_u32()?;
                        if elen == 0 {
                            return protocol("zero-length extent in a block status reply");
                        }
                        if pos >= end {
                            return protocol(format!(
                                "extent at offset {pos} beyond the queried range [{offset}, {end})"
                            ));
                        }
                        // Only the final extent may reach past the query: clip it.
                        let e_end = (pos + u64::from(elen)).min(end);
                        if id == want {
                            match out.last_mut() {
                                Some((l, f)) if *f == eflags => *l += e_end - pos,
                                _ => out.push((e_end - pos, eflags)),
                            }
                        }
                        pos = e_end;
                    }
                }
                NBD_REPLY_TYPE_NONE => {
                    if clen != 0 || flags & NBD_REPLY_FLAG_DONE == 0 {
                        return protocol("malformed NBD_REPLY_TYPE_NONE chunk");
                    }
                }
                k if k & NBD_REPLY_TYPE_FLAG_ERROR != 0 => {
                    let e = self.error_chunk(k, clen)?;
                    error.get_or_insert(e);
                }
                k => return protocol(format!("unexpected chunk type {k} in a block status reply")),
            }
            if flags & NBD_REPLY_FLAG_DONE != 0 {
                break;
            }
        }
        if let Some(e) = error {
            return Err(Fail::Server(format!(
                "the server failed a block status query at offset {offset} ({len} bytes): {e}"
            )));
        }
        if let Some(i) = seen.iter().position(|s| !s) {
            return protocol(format!(
                "no block status for metadata context {}",
                self.context_ids[i]
            ));
        }
        if out.is_empty() {
            return protocol(format!("no block status for metadata context {want}"));
        }
        Ok(out)
    }

    /// `NBD_CMD_DISC`, then closes the socket. Errors are ignored: the connection ends anyway.
    pub(super) fn disconnect(&mut self) {
        if self.broken.is_none() {
            let _ = self.request(NBD_CMD_DISC, 0, 0);
        }
        self.shutdown();
    }
}

/// The message for an `NBD_OPT_GO` error reply.
fn go_error(reply: u32, export: &str, data: &[u8]) -> String {
    let mut what = match reply {
        NBD_REP_ERR_UNKNOWN => format!("export {export:?} not found"),
        NBD_REP_ERR_TLS_REQD => "the server requires TLS, which is not supported".to_string(),
        NBD_REP_ERR_POLICY => format!("the server refused access to export {export:?}"),
        NBD_REP_ERR_SHUTDOWN => "the server is shutting down".to_string(),
        t => format!(
            "the server refused export {export:?}: {}",
            option_error_name(t)
        ),
    };
    let msg = printable(data);
    if !msg.is_empty() {
        what.push_str(&format!(" (the server says: {msg})"));
    }
    what
}

/// A server-supplied string made safe for a one-line message: lossy UTF-8, control
/// characters replaced, at most 300 characters.
fn printable(b: &[u8]) -> String {
    let s = String::from_utf8_lossy(b);
    let mut out: String = s
        .trim()
        .chars()
        .take(300)
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if s.trim().chars().count() > 300 {
        out.push('…');
    }
    out
}

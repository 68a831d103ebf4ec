//! Wire format of the NBD protocol (`doc/proto.md` of NetworkBlockDevice/nbd).
//!
//! Everything here is pure: constants plus encode/decode functions over byte
//! slices, so the framing can be unit-tested and fuzzed without sockets.
//! Decoders treat their input as hostile: every length is checked against
//! the bytes actually present and against fixed caps, and they return
//! [`ProtocolError`] instead of panicking.

use bytes::{BufMut, Bytes, BytesMut};
use thiserror::Error;

// ---------------------------------------------------------------- magics

/// `NBDMAGIC`, first 8 bytes the server sends.
pub const NBD_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`, newstyle magic; also prefixes every option request.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Prefix of every fixed-newstyle option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Prefix of every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Prefix of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Prefix of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;
/// What an oldstyle server sends after `NBDMAGIC` (instead of `IHAVEOPT`).
pub const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;

/// The IANA-assigned NBD port, the default of `nbd://` URLs.
pub const NBD_DEFAULT_PORT: u16 = 10809;

// ---------------------------------------------------------------- handshake flags

/// Server handshake flag: fixed newstyle supported.
pub const NBD_FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// Server handshake flag: may omit the 124 zero bytes after EXPORT_NAME.
pub const NBD_FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flag: client speaks fixed newstyle.
pub const NBD_FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
/// Client flag: omit the 124 zero bytes.
pub const NBD_FLAG_C_NO_ZEROES: u32 = 1 << 1;

// ---------------------------------------------------------------- transmission flags

pub const NBD_FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const NBD_FLAG_READ_ONLY: u16 = 1 << 1;
pub const NBD_FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const NBD_FLAG_SEND_FUA: u16 = 1 << 3;
pub const NBD_FLAG_ROTATIONAL: u16 = 1 << 4;
pub const NBD_FLAG_SEND_TRIM: u16 = 1 << 5;
pub const NBD_FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const NBD_FLAG_SEND_DF: u16 = 1 << 7;
pub const NBD_FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const NBD_FLAG_SEND_CACHE: u16 = 1 << 10;
pub const NBD_FLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// ---------------------------------------------------------------- options

pub const NBD_OPT_EXPORT_NAME: u32 = 1;
pub const NBD_OPT_ABORT: u32 = 2;
pub const NBD_OPT_LIST: u32 = 3;
pub const NBD_OPT_STARTTLS: u32 = 5;
pub const NBD_OPT_INFO: u32 = 6;
pub const NBD_OPT_GO: u32 = 7;
pub const NBD_OPT_STRUCTURED_REPLY: u32 = 8;
pub const NBD_OPT_LIST_META_CONTEXT: u32 = 9;
pub const NBD_OPT_SET_META_CONTEXT: u32 = 10;
pub const NBD_OPT_EXTENDED_HEADERS: u32 = 11;

// ---------------------------------------------------------------- option replies

pub const NBD_REP_ACK: u32 = 1;
pub const NBD_REP_SERVER: u32 = 2;
pub const NBD_REP_INFO: u32 = 3;
pub const NBD_REP_META_CONTEXT: u32 = 4;
/// Bit 31 marks an option reply as an error.
pub const NBD_REP_FLAG_ERROR: u32 = 1 << 31;
pub const NBD_REP_ERR_UNSUP: u32 = NBD_REP_FLAG_ERROR | 1;
pub const NBD_REP_ERR_POLICY: u32 = NBD_REP_FLAG_ERROR | 2;
pub const NBD_REP_ERR_INVALID: u32 = NBD_REP_FLAG_ERROR | 3;
pub const NBD_REP_ERR_PLATFORM: u32 = NBD_REP_FLAG_ERROR | 4;
pub const NBD_REP_ERR_TLS_REQD: u32 = NBD_REP_FLAG_ERROR | 5;
pub const NBD_REP_ERR_UNKNOWN: u32 = NBD_REP_FLAG_ERROR | 6;
pub const NBD_REP_ERR_SHUTDOWN: u32 = NBD_REP_FLAG_ERROR | 7;
pub const NBD_REP_ERR_BLOCK_SIZE_REQD: u32 = NBD_REP_FLAG_ERROR | 8;
pub const NBD_REP_ERR_TOO_BIG: u32 = NBD_REP_FLAG_ERROR | 9;

// ---------------------------------------------------------------- info types

pub const NBD_INFO_EXPORT: u16 = 0;
pub const NBD_INFO_NAME: u16 = 1;
pub const NBD_INFO_DESCRIPTION: u16 = 2;
pub const NBD_INFO_BLOCK_SIZE: u16 = 3;

// ---------------------------------------------------------------- commands

pub const NBD_CMD_READ: u16 = 0;
pub const NBD_CMD_WRITE: u16 = 1;
pub const NBD_CMD_DISC: u16 = 2;
pub const NBD_CMD_FLUSH: u16 = 3;
pub const NBD_CMD_TRIM: u16 = 4;
pub const NBD_CMD_CACHE: u16 = 5;
pub const NBD_CMD_WRITE_ZEROES: u16 = 6;
pub const NBD_CMD_BLOCK_STATUS: u16 = 7;

pub const NBD_CMD_FLAG_FUA: u16 = 1 << 0;
pub const NBD_CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const NBD_CMD_FLAG_DF: u16 = 1 << 2;
pub const NBD_CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const NBD_CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

// ---------------------------------------------------------------- structured replies

pub const NBD_REPLY_FLAG_DONE: u16 = 1 << 0;
pub const NBD_REPLY_TYPE_NONE: u16 = 0;
pub const NBD_REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const NBD_REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const NBD_REPLY_TYPE_BLOCK_STATUS: u16 = 5;
/// Bit 15 marks a structured reply chunk type as an error chunk.
pub const NBD_REPLY_TYPE_FLAG_ERROR: u16 = 1 << 15;
pub const NBD_REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;
pub const NBD_REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) | 2;

/// `base:allocation` flag: extent is not allocated.
pub const NBD_STATE_HOLE: u32 = 1 << 0;
/// `base:allocation` flag: extent reads as zeroes.
pub const NBD_STATE_ZERO: u32 = 1 << 1;

/// The only metadata context this server knows.
pub const BASE_ALLOCATION: &str = "base:allocation";
/// Prefix of QEMU's dirty-bitmap metadata contexts (`qemu:dirty-bitmap:NAME`).
pub const QEMU_DIRTY_BITMAP_PREFIX: &str = "qemu:dirty-bitmap:";
/// `qemu:dirty-bitmap:*` flag: the extent is dirty.
pub const NBD_STATE_DIRTY: u32 = 1 << 0;

// ---------------------------------------------------------------- errors

pub const NBD_EPERM: u32 = 1;
pub const NBD_EIO: u32 = 5;
pub const NBD_ENOMEM: u32 = 12;
pub const NBD_EINVAL: u32 = 22;
pub const NBD_ENOSPC: u32 = 28;
pub const NBD_EOVERFLOW: u32 = 75;
pub const NBD_ENOTSUP: u32 = 95;
pub const NBD_ESHUTDOWN: u32 = 108;

/// A human-readable name for an NBD error code (`EIO (input/output error)`).
pub fn error_name(code: u32) -> String {
    let name = match code {
        NBD_EPERM => "EPERM (operation not permitted)",
        NBD_EIO => "EIO (input/output error)",
        NBD_ENOMEM => "ENOMEM (out of memory)",
        NBD_EINVAL => "EINVAL (invalid argument)",
        NBD_ENOSPC => "ENOSPC (no space left on device)",
        NBD_EOVERFLOW => "EOVERFLOW (value too large)",
        NBD_ENOTSUP => "ENOTSUP (operation not supported)",
        NBD_ESHUTDOWN => "ESHUTDOWN (server is shutting down)",
        other => return format!("error {other}"),
    };
    name.to_owned()
}

/// A human-readable name for an option reply error type.
pub fn option_error_name(reply_type: u32) -> String {
    let name = match reply_type {
        NBD_REP_ERR_UNSUP => "NBD_REP_ERR_UNSUP (unsupported option)",
        NBD_REP_ERR_POLICY => "NBD_REP_ERR_POLICY (forbidden by server policy)",
        NBD_REP_ERR_INVALID => "NBD_REP_ERR_INVALID (invalid option)",
        NBD_REP_ERR_PLATFORM => "NBD_REP_ERR_PLATFORM (not supported on this platform)",
        NBD_REP_ERR_TLS_REQD => "NBD_REP_ERR_TLS_REQD (TLS required)",
        NBD_REP_ERR_UNKNOWN => "NBD_REP_ERR_UNKNOWN (unknown export)",
        NBD_REP_ERR_SHUTDOWN => "NBD_REP_ERR_SHUTDOWN (server is shutting down)",
        NBD_REP_ERR_BLOCK_SIZE_REQD => {
            "NBD_REP_ERR_BLOCK_SIZE_REQD (block size negotiation required)"
        }
        NBD_REP_ERR_TOO_BIG => "NBD_REP_ERR_TOO_BIG (request too big)",
        other => return format!("option error {other:#x}"),
    };
    name.to_owned()
}

// ---------------------------------------------------------------- limits

/// Largest option payload we accept; real options are tiny, so anything
/// bigger is treated as hostile and ends the connection.
pub const MAX_OPTION_LEN: u32 = 64 * 1024;
/// Largest string (export name, query, ...) per the spec.
pub const MAX_STRING_LEN: usize = 4096;
/// Largest READ/WRITE payload we accept (the spec's interoperable maximum).
pub const MAX_PAYLOAD: u32 = 32 * 1024 * 1024;
/// Most metadata queries accepted in one option.
pub const MAX_META_QUERIES: usize = 128;

/// Size of the server's opening greeting.
pub const GREETING_LEN: usize = 18;
/// Size of an option request header (magic, option, length).
pub const OPTION_HEADER_LEN: usize = 16;
/// Size of a transmission request header.
pub const REQUEST_LEN: usize = 28;
/// Size of a simple reply header.
pub const SIMPLE_REPLY_LEN: usize = 16;
/// Size of a structured reply chunk header.
pub const STRUCTURED_HEADER_LEN: usize = 20;

/// Malformed input from the peer.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ProtocolError {
    #[error("buffer too short: need {need} bytes, have {have}")]
    Short { need: usize, have: usize },
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
    #[error("unknown client flags {0:#x}")]
    UnknownClientFlags(u32),
    #[error("option payload of {0} bytes exceeds the limit")]
    OptionTooLong(u32),
    #[error("string of {0} bytes exceeds the limit")]
    StringTooLong(usize),
    #[error("string is not valid UTF-8")]
    NotUtf8,
    #[error("malformed option payload: {0}")]
    Malformed(&'static str),
}

type Result<T> = std::result::Result<T, ProtocolError>;

fn need(buf: &[u8], n: usize) -> Result<()> {
    if buf.len() < n {
        Err(ProtocolError::Short {
            need: n,
            have: buf.len(),
        })
    } else {
        Ok(())
    }
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Bounds-checked big-endian reader over an option payload.
struct Cursor<'a> {
    buf: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(ProtocolError::Malformed(what));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn u16(&mut self, what: &'static str) -> Result<u16> {
        Ok(be16(self.take(2, what)?, 0))
    }
    fn u32(&mut self, what: &'static str) -> Result<u32> {
        Ok(be32(self.take(4, what)?, 0))
    }
    /// A string prefixed by a 32-bit length.
    fn string(&mut self, what: &'static str) -> Result<String> {
        let len = self.u32(what)? as usize;
        if len > MAX_STRING_LEN {
            return Err(ProtocolError::StringTooLong(len));
        }
        decode_string(self.take(len, what)?)
    }
    fn finish(&self, what: &'static str) -> Result<()> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(ProtocolError::Malformed(what))
        }
    }
}

fn decode_string(b: &[u8]) -> Result<String> {
    if b.len() > MAX_STRING_LEN {
        return Err(ProtocolError::StringTooLong(b.len()));
    }
    let s = std::str::from_utf8(b).map_err(|_| ProtocolError::NotUtf8)?;
    if s.contains('\0') {
        return Err(ProtocolError::Malformed("NUL in string"));
    }
    Ok(s.to_owned())
}

// ================================================================ handshake

/// The server's opening: NBDMAGIC, IHAVEOPT, handshake flags.
pub fn encode_greeting(handshake_flags: u16) -> [u8; GREETING_LEN] {
    let mut out = [0u8; GREETING_LEN];
    out[..8].copy_from_slice(&NBD_MAGIC.to_be_bytes());
    out[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    out[16..].copy_from_slice(&handshake_flags.to_be_bytes());
    out
}

/// Client flags as negotiated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClientFlags {
    pub fixed_newstyle: bool,
    pub no_zeroes: bool,
}

/// Decode the client's 32-bit flags. Unknown bits are an error: the spec
/// says the server MUST drop the connection then.
pub fn decode_client_flags(buf: &[u8]) -> Result<ClientFlags> {
    need(buf, 4)?;
    let flags = be32(buf, 0);
    let known = NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES;
    if flags & !known != 0 {
        return Err(ProtocolError::UnknownClientFlags(flags));
    }
    Ok(ClientFlags {
        fixed_newstyle: flags & NBD_FLAG_C_FIXED_NEWSTYLE != 0,
        no_zeroes: flags & NBD_FLAG_C_NO_ZEROES != 0,
    })
}

/// Header of an option request; its payload (`len` bytes) follows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub len: u32,
}

/// Decode a 16-byte option header, rejecting bad magic and payloads over
/// [`MAX_OPTION_LEN`] (so the caller never allocates an attacker-chosen size).
pub fn decode_option_header(buf: &[u8]) -> Result<OptionHeader> {
    need(buf, OPTION_HEADER_LEN)?;
    let magic = be64(buf, 0);
    if magic != IHAVEOPT {
        return Err(ProtocolError::BadMagic(magic));
    }
    let option = be32(buf, 8);
    let len = be32(buf, 12);
    if len > MAX_OPTION_LEN {
        return Err(ProtocolError::OptionTooLong(len));
    }
    Ok(OptionHeader { option, len })
}

/// Encode an option request (client side; used by tests and fuzzing).
pub fn encode_option_request(option: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(OPTION_HEADER_LEN + data.len());
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// Payload of `NBD_OPT_INFO` / `NBD_OPT_GO`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    pub name: String,
    pub info_requests: Vec<u16>,
}

/// Payload of `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MetaContextRequest {
    pub name: String,
    pub queries: Vec<String>,
}

/// A decoded option request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OptionRequest {
    ExportName(String),
    Abort,
    List,
    StartTls,
    Info(InfoRequest),
    Go(InfoRequest),
    StructuredReply,
    ListMetaContext(MetaContextRequest),
    SetMetaContext(MetaContextRequest),
    /// Anything else; answered with `NBD_REP_ERR_UNSUP`.
    Unknown(u32),
}

/// Decode an option's payload. An `Err` should be answered with
/// `NBD_REP_ERR_INVALID` (or, for `NBD_OPT_EXPORT_NAME`, a disconnect).
pub fn decode_option(option: u32, data: &[u8]) -> Result<OptionRequest> {
    if data.len() > MAX_OPTION_LEN as usize {
        return Err(ProtocolError::OptionTooLong(data.len() as u32));
    }
    let no_data = |req: OptionRequest| {
        if data.is_empty() {
            Ok(req)
        } else {
            Err(ProtocolError::Malformed("option takes no data"))
        }
    };
    match option {
        NBD_OPT_EXPORT_NAME => Ok(OptionRequest::ExportName(decode_string(data)?)),
        // The spec says to ignore data sent with ABORT.
        NBD_OPT_ABORT => Ok(OptionRequest::Abort),
        NBD_OPT_LIST => no_data(OptionRequest::List),
        NBD_OPT_STARTTLS => no_data(OptionRequest::StartTls),
        NBD_OPT_STRUCTURED_REPLY => no_data(OptionRequest::StructuredReply),
        NBD_OPT_INFO => Ok(OptionRequest::Info(decode_info_request(data)?)),
        NBD_OPT_GO => Ok(OptionRequest::Go(decode_info_request(data)?)),
        NBD_OPT_LIST_META_CONTEXT => Ok(OptionRequest::ListMetaContext(decode_meta_request(data)?)),
        NBD_OPT_SET_META_CONTEXT => Ok(OptionRequest::SetMetaContext(decode_meta_request(data)?)),
        other => Ok(OptionRequest::Unknown(other)),
    }
}

fn decode_info_request(data: &[u8]) -> Result<InfoRequest> {
    let mut c = Cursor { buf: data };
    let name = c.string("export name")?;
    let n = c.u16("info request count")? as usize;
    let mut info_requests = Vec::with_capacity(n.min(64));
    for _ in 0..n {
        info_requests.push(c.u16("info request")?);
    }
    c.finish("trailing bytes after info requests")?;
    Ok(InfoRequest {
        name,
        info_requests,
    })
}

fn decode_meta_request(data: &[u8]) -> Result<MetaContextRequest> {
    let mut c = Cursor { buf: data };
    let name = c.string("export name")?;
    let n = c.u32("query count")? as usize;
    if n > MAX_META_QUERIES {
        return Err(ProtocolError::Malformed("too many queries"));
    }
    let mut queries = Vec::with_capacity(n);
    for _ in 0..n {
        queries.push(c.string("query")?);
    }
    c.finish("trailing bytes after queries")?;
    Ok(MetaContextRequest { name, queries })
}

/// Encode the payload of an INFO/GO request (client side, for tests).
pub fn encode_info_request(name: &str, info_requests: &[u16]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(name.len() as u32).to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(info_requests.len() as u16).to_be_bytes());
    for i in info_requests {
        out.extend_from_slice(&i.to_be_bytes());
    }
    out
}

/// Encode the payload of a LIST/SET_META_CONTEXT request (client side).
pub fn encode_meta_request(name: &str, queries: &[&str]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(name.len() as u32).to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out.extend_from_slice(&(queries.len() as u32).to_be_bytes());
    for q in queries {
        out.extend_from_slice(&(q.len() as u32).to_be_bytes());
        out.extend_from_slice(q.as_bytes());
    }
    out
}

/// A fixed-newstyle option reply: magic, option, type, length, data.
pub fn encode_option_reply(option: u32, reply_type: u32, data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(20 + data.len());
    out.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply_type.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
    out
}

/// A decoded option reply header (client side; tests and fuzzing).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    pub option: u32,
    pub reply_type: u32,
    pub len: u32,
}

/// Decode the 20-byte header of an option reply.
pub fn decode_option_reply_header(buf: &[u8]) -> Result<OptionReplyHeader> {
    need(buf, 20)?;
    let magic = be64(buf, 0);
    if magic != OPTION_REPLY_MAGIC {
        return Err(ProtocolError::BadMagic(magic));
    }
    Ok(OptionReplyHeader {
        option: be32(buf, 8),
        reply_type: be32(buf, 12),
        len: be32(buf, 16),
    })
}

/// Payload of `NBD_REP_SERVER`: a length-prefixed export name, then an
/// optional human-readable description.
pub fn encode_rep_server(name: &str, description: Option<&str>) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(name.len() as u32).to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    if let Some(d) = description {
        out.extend_from_slice(d.as_bytes());
    }
    out
}

/// Payload of `NBD_REP_INFO` / `NBD_INFO_EXPORT`.
pub fn encode_info_export(size: u64, transmission_flags: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(12);
    out.extend_from_slice(&NBD_INFO_EXPORT.to_be_bytes());
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(&transmission_flags.to_be_bytes());
    out
}

/// Payload of `NBD_REP_INFO` / `NBD_INFO_BLOCK_SIZE`.
pub fn encode_info_block_size(minimum: u32, preferred: u32, maximum: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(14);
    out.extend_from_slice(&NBD_INFO_BLOCK_SIZE.to_be_bytes());
    out.extend_from_slice(&minimum.to_be_bytes());
    out.extend_from_slice(&preferred.to_be_bytes());
    out.extend_from_slice(&maximum.to_be_bytes());
    out
}

/// Payload of `NBD_REP_INFO` carrying a string (`NBD_INFO_NAME`,
/// `NBD_INFO_DESCRIPTION`).
pub fn encode_info_string(info_type: u16, s: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + s.len());
    out.extend_from_slice(&info_type.to_be_bytes());
    out.extend_from_slice(s.as_bytes());
    out
}

/// Payload of `NBD_REP_META_CONTEXT`.
pub fn encode_rep_meta_context(context_id: u32, name: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + name.len());
    out.extend_from_slice(&context_id.to_be_bytes());
    out.extend_from_slice(name.as_bytes());
    out
}

/// Reply to `NBD_OPT_EXPORT_NAME`: size, transmission flags, and 124 zero
/// bytes unless the client negotiated `NBD_FLAG_C_NO_ZEROES`.
pub fn encode_export_name_reply(size: u64, transmission_flags: u16, no_zeroes: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(10 + 124);
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(&transmission_flags.to_be_bytes());
    if !no_zeroes {
        out.extend_from_slice(&[0u8; 124]);
    }
    out
}

// ================================================================ transmission

/// A transmission-phase request header (any WRITE payload follows it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub command: u16,
    pub cookie: u64,
    pub offset: u64,
    pub len: u32,
}

/// Decode a 28-byte request header. Bad magic is an error (the caller
/// hard-disconnects: the stream can no longer be framed).
pub fn decode_request(buf: &[u8]) -> Result<Request> {
    need(buf, REQUEST_LEN)?;
    let magic = be32(buf, 0);
    if magic != REQUEST_MAGIC {
        return Err(ProtocolError::BadMagic(magic as u64));
    }
    Ok(Request {
        flags: be16(buf, 4),
        command: be16(buf, 6),
        cookie: be64(buf, 8),
        offset: be64(buf, 16),
        len: be32(buf, 24),
    })
}

/// Encode a request header (client side; tests).
pub fn encode_request(req: &Request) -> [u8; REQUEST_LEN] {
    let mut out = [0u8; REQUEST_LEN];
    out[..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&req.flags.to_be_bytes());
    out[6..8].copy_from_slice(&req.command.to_be_bytes());
    out[8..16].copy_from_slice(&req.cookie.to_be_bytes());
    out[16..24].copy_from_slice(&req.offset.to_be_bytes());
    out[24..28].copy_from_slice(&req.len.to_be_bytes());
    out
}

/// Simple reply header (data for a successful READ follows it).
pub fn encode_simple_reply(error: u32, cookie: u64) -> [u8; SIMPLE_REPLY_LEN] {
    let mut out = [0u8; SIMPLE_REPLY_LEN];
    out[..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..].copy_from_slice(&cookie.to_be_bytes());
    out
}

/// Structured reply chunk header; `len` bytes of payload follow it.
pub fn encode_structured_header(
    flags: u16,
    reply_type: u16,
    cookie: u64,
    len: u32,
) -> [u8; STRUCTURED_HEADER_LEN] {
    let mut out = [0u8; STRUCTURED_HEADER_LEN];
    out[..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&reply_type.to_be_bytes());
    out[8..16].copy_from_slice(&cookie.to_be_bytes());
    out[16..20].copy_from_slice(&len.to_be_bytes());
    out
}

/// Header plus offset of an `NBD_REPLY_TYPE_OFFSET_DATA` chunk; the caller
/// sends `data_len` bytes of data after it (kept separate to avoid copying
/// the data).
pub fn encode_offset_data_header(cookie: u64, flags: u16, offset: u64, data_len: u32) -> Bytes {
    let mut out = BytesMut::with_capacity(STRUCTURED_HEADER_LEN + 8);
    out.put_slice(&encode_structured_header(
        flags,
        NBD_REPLY_TYPE_OFFSET_DATA,
        cookie,
        data_len.saturating_add(8),
    ));
    out.put_u64(offset);
    out.freeze()
}

/// A complete `NBD_REPLY_TYPE_OFFSET_HOLE` chunk.
pub fn encode_offset_hole(cookie: u64, flags: u16, offset: u64, hole_len: u32) -> Bytes {
    let mut out = BytesMut::with_capacity(STRUCTURED_HEADER_LEN + 12);
    out.put_slice(&encode_structured_header(
        flags,
        NBD_REPLY_TYPE_OFFSET_HOLE,
        cookie,
        12,
    ));
    out.put_u64(offset);
    out.put_u32(hole_len);
    out.freeze()
}

/// A complete final `NBD_REPLY_TYPE_NONE` chunk.
pub fn encode_none_chunk(cookie: u64) -> Bytes {
    Bytes::copy_from_slice(&encode_structured_header(
        NBD_REPLY_FLAG_DONE,
        NBD_REPLY_TYPE_NONE,
        cookie,
        0,
    ))
}

/// A complete final `NBD_REPLY_TYPE_ERROR` chunk. The message is cut to a
/// UTF-8 boundary at most 4096 bytes long.
pub fn encode_error_chunk(cookie: u64, error: u32, message: &str) -> Bytes {
    let mut end = message.len().min(MAX_STRING_LEN);
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    let msg = &message.as_bytes()[..end];
    let mut out = BytesMut::with_capacity(STRUCTURED_HEADER_LEN + 6 + msg.len());
    out.put_slice(&encode_structured_header(
        NBD_REPLY_FLAG_DONE,
        NBD_REPLY_TYPE_ERROR,
        cookie,
        6 + msg.len() as u32,
    ));
    out.put_u32(error);
    out.put_u16(msg.len() as u16);
    out.put_slice(msg);
    out.freeze()
}

/// One `base:allocation` descriptor as sent on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockDescriptor {
    pub len: u32,
    pub flags: u32,
}

/// A complete `NBD_REPLY_TYPE_BLOCK_STATUS` chunk for one context.
pub fn encode_block_status(
    cookie: u64,
    flags: u16,
    context_id: u32,
    extents: &[BlockDescriptor],
) -> Bytes {
    let payload = 4 + 8 * extents.len();
    let mut out = BytesMut::with_capacity(STRUCTURED_HEADER_LEN + payload);
    out.put_slice(&encode_structured_header(
        flags,
        NBD_REPLY_TYPE_BLOCK_STATUS,
        cookie,
        payload as u32,
    ));
    out.put_u32(context_id);
    for e in extents {
        out.put_u32(e.len);
        out.put_u32(e.flags);
    }
    out.freeze()
}

/// A decoded reply header (client side; tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyHeader {
    Simple {
        error: u32,
        cookie: u64,
    },
    Structured {
        flags: u16,
        reply_type: u16,
        cookie: u64,
        len: u32,
    },
}

/// Decode a reply header: needs 16 bytes for a simple reply, 20 for a
/// structured one (check the magic in the first 4 to know which).
pub fn decode_reply_header(buf: &[u8]) -> Result<ReplyHeader> {
    need(buf, 4)?;
    match be32(buf, 0) {
        SIMPLE_REPLY_MAGIC => {
            need(buf, SIMPLE_REPLY_LEN)?;
            Ok(ReplyHeader::Simple {
                error: be32(buf, 4),
                cookie: be64(buf, 8),
            })
        }
        STRUCTURED_REPLY_MAGIC => {
            need(buf, STRUCTURED_HEADER_LEN)?;
            Ok(ReplyHeader::Structured {
                flags: be16(buf, 4),
                reply_type: be16(buf, 6),
                cookie: be64(buf, 8),
                len: be32(buf, 16),
            })
        }
        m => Err(ProtocolError::BadMagic(m as u64)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn greeting_layout() {
        let g = encode_greeting(NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES);
        assert_eq!(&g[..8], b"NBDMAGIC");
        assert_eq!(&g[8..16], b"IHAVEOPT");
        assert_eq!(&g[16..], &[0, 3]);
    }

    #[test]
    fn client_flags() {
        assert_eq!(
            decode_client_flags(&[0, 0, 0, 3]).unwrap(),
            ClientFlags {
                fixed_newstyle: true,
                no_zeroes: true
            }
        );
        assert_eq!(
            decode_client_flags(&[0, 0, 0, 1]).unwrap(),
            ClientFlags {
                fixed_newstyle: true,
                no_zeroes: false
            }
        );
        assert_eq!(
            decode_client_flags(&[0, 0, 0, 4]),
            Err(ProtocolError::UnknownClientFlags(4))
        );
        assert!(matches!(
            decode_client_flags(&[0, 0]),
            Err(ProtocolError::Short { .. })
        ));
    }

    #[test]
    fn option_header_roundtrip_and_limits() {
        let raw = encode_option_request(NBD_OPT_GO, &[1, 2, 3]);
        let h = decode_option_header(&raw).unwrap();
        assert_eq!(
            h,
            OptionHeader {
                option: NBD_OPT_GO,
                len: 3
            }
        );
        let mut big = encode_option_request(NBD_OPT_GO, &[]);
        big[12..16].copy_from_slice(&(MAX_OPTION_LEN + 1).to_be_bytes());
        assert_eq!(
            decode_option_header(&big),
            Err(ProtocolError::OptionTooLong(MAX_OPTION_LEN + 1))
        );
        let mut bad = raw.clone();
        bad[0] ^= 1;
        assert!(matches!(
            decode_option_header(&bad),
            Err(ProtocolError::BadMagic(_))
        ));
    }

    #[test]
    fn info_request_roundtrip() {
        let data = encode_info_request("disk", &[NBD_INFO_BLOCK_SIZE, NBD_INFO_NAME]);
        assert_eq!(
            decode_option(NBD_OPT_GO, &data).unwrap(),
            OptionRequest::Go(InfoRequest {
                name: "disk".into(),
                info_requests: vec![NBD_INFO_BLOCK_SIZE, NBD_INFO_NAME]
            })
        );
        // Name length pointing past the end.
        let mut bad = data.clone();
        bad[3] = 200;
        assert!(decode_option(NBD_OPT_INFO, &bad).is_err());
        // Trailing garbage.
        let mut bad = data.clone();
        bad.push(0);
        assert!(decode_option(NBD_OPT_INFO, &bad).is_err());
        // Oversized name.
        let long = "x".repeat(MAX_STRING_LEN + 1);
        assert_eq!(
            decode_option(NBD_OPT_INFO, &encode_info_request(&long, &[])),
            Err(ProtocolError::StringTooLong(MAX_STRING_LEN + 1))
        );
    }

    #[test]
    fn meta_request_roundtrip() {
        let data = encode_meta_request("", &["base:allocation", "qemu:dirty"]);
        assert_eq!(
            decode_option(NBD_OPT_SET_META_CONTEXT, &data).unwrap(),
            OptionRequest::SetMetaContext(MetaContextRequest {
                name: String::new(),
                queries: vec!["base:allocation".into(), "qemu:dirty".into()]
            })
        );
        let mut bad = data.clone();
        bad.truncate(bad.len() - 1);
        assert!(decode_option(NBD_OPT_LIST_META_CONTEXT, &bad).is_err());
    }

    #[test]
    fn option_payload_rules() {
        assert_eq!(decode_option(NBD_OPT_LIST, &[]), Ok(OptionRequest::List));
        assert!(decode_option(NBD_OPT_LIST, &[0]).is_err());
        assert!(decode_option(NBD_OPT_STRUCTURED_REPLY, &[0]).is_err());
        assert_eq!(decode_option(NBD_OPT_ABORT, &[9]), Ok(OptionRequest::Abort));
        assert_eq!(
            decode_option(NBD_OPT_EXPORT_NAME, b"disk"),
            Ok(OptionRequest::ExportName("disk".into()))
        );
        assert_eq!(
            decode_option(NBD_OPT_EXPORT_NAME, &[0xff]),
            Err(ProtocolError::NotUtf8)
        );
        assert_eq!(decode_option(77, &[1, 2]), Ok(OptionRequest::Unknown(77)));
    }

    #[test]
    fn option_reply_layout() {
        let r = encode_option_reply(NBD_OPT_LIST, NBD_REP_SERVER, &encode_rep_server("a", None));
        let h = decode_option_reply_header(&r).unwrap();
        assert_eq!(
            h,
            OptionReplyHeader {
                option: NBD_OPT_LIST,
                reply_type: NBD_REP_SERVER,
                len: 5
            }
        );
        assert_eq!(&r[20..], &[0, 0, 0, 1, b'a']);
        assert_eq!(
            encode_info_export(0x1122, 0x0304),
            vec![0, 0, 0, 0, 0, 0, 0, 0, 0x11, 0x22, 3, 4]
        );
        assert_eq!(encode_info_block_size(1, 4096, MAX_PAYLOAD).len(), 14);
        assert_eq!(encode_export_name_reply(1, 1, false).len(), 134);
        assert_eq!(encode_export_name_reply(1, 1, true).len(), 10);
    }

    #[test]
    fn request_roundtrip() {
        let req = Request {
            flags: NBD_CMD_FLAG_FUA,
            command: NBD_CMD_WRITE,
            cookie: 0xdead_beef_0000_0001,
            offset: 4096,
            len: 512,
        };
        let raw = encode_request(&req);
        assert_eq!(decode_request(&raw), Ok(req));
        let mut bad = raw;
        bad[0] = 0;
        assert!(matches!(
            decode_request(&bad),
            Err(ProtocolError::BadMagic(_))
        ));
    }

    #[test]
    fn reply_layouts() {
        let s = encode_simple_reply(NBD_EINVAL, 7);
        assert_eq!(
            decode_reply_header(&s),
            Ok(ReplyHeader::Simple {
                error: NBD_EINVAL,
                cookie: 7
            })
        );
        let e = encode_error_chunk(9, NBD_EIO, "boom");
        assert_eq!(
            decode_reply_header(&e),
            Ok(ReplyHeader::Structured {
                flags: NBD_REPLY_FLAG_DONE,
                reply_type: NBD_REPLY_TYPE_ERROR,
                cookie: 9,
                len: 10
            })
        );
        assert_eq!(&e[20..], &[0, 0, 0, 5, 0, 4, b'b', b'o', b'o', b'm']);
        let d = encode_offset_data_header(3, NBD_REPLY_FLAG_DONE, 512, 100);
        assert_eq!(d.len(), 28);
        assert_eq!(&d[16..20], &108u32.to_be_bytes());
        let h = encode_offset_hole(3, 0, 512, 4096);
        assert_eq!(&h[16..20], &12u32.to_be_bytes());
        assert_eq!(&h[28..32], &4096u32.to_be_bytes());
        let b = encode_block_status(
            4,
            NBD_REPLY_FLAG_DONE,
            1,
            &[
                BlockDescriptor {
                    len: 4096,
                    flags: 0,
                },
                BlockDescriptor {
                    len: 8192,
                    flags: NBD_STATE_HOLE | NBD_STATE_ZERO,
                },
            ],
        );
        assert_eq!(&b[16..20], &20u32.to_be_bytes());
        assert_eq!(&b[20..24], &1u32.to_be_bytes());
        assert_eq!(&b[32..40], &[0, 0, 0x20, 0, 0, 0, 0, 3]);
        assert_eq!(encode_none_chunk(5).len(), 20);
        // Long messages are cut at a char boundary.
        let long = "é".repeat(3000);
        let e = encode_error_chunk(1, NBD_EIO, &long);
        let msg_len = u16::from_be_bytes([e[24], e[25]]) as usize;
        assert!(msg_len <= MAX_STRING_LEN);
        assert!(std::str::from_utf8(&e[26..26 + msg_len]).is_ok());
    }

    proptest! {
        #[test]
        fn parsers_never_panic(option in any::<u32>(), data in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = decode_client_flags(&data);
            let _ = decode_option_header(&data);
            let _ = decode_request(&data);
            let _ = decode_reply_header(&data);
            let _ = decode_option_reply_header(&data);
            let _ = decode_option(option, &data);
            for opt in [NBD_OPT_EXPORT_NAME, NBD_OPT_INFO, NBD_OPT_GO,
                        NBD_OPT_LIST_META_CONTEXT, NBD_OPT_SET_META_CONTEXT, NBD_OPT_LIST] {
                let _ = decode_option(opt, &data);
            }
        }

        #[test]
        fn structured_option_payloads_never_panic(
            name_len in any::<u32>(), count in any::<u32>(),
            tail in proptest::collection::vec(any::<u8>(), 0..200)
        ) {
            // Plausible-looking prefixes reach deeper into the parsers than pure noise.
            let mut data = name_len.to_be_bytes().to_vec();
            data.extend_from_slice(&count.to_be_bytes());
            data.extend_from_slice(&tail);
            for opt in [NBD_OPT_INFO, NBD_OPT_GO, NBD_OPT_LIST_META_CONTEXT, NBD_OPT_SET_META_CONTEXT] {
                let _ = decode_option(opt, &data);
            }
        }

        #[test]
        fn request_roundtrips(flags in any::<u16>(), command in any::<u16>(), cookie in any::<u64>(),
                              offset in any::<u64>(), len in any::<u32>()) {
            let req = Request { flags, command, cookie, offset, len };
            prop_assert_eq!(decode_request(&encode_request(&req)), Ok(req));
        }
    }
}

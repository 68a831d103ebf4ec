//! Constants of the NBD protocol: magics, flags, option, reply, command and error codes, and
//! the limits cairn enforces on what a peer may send.

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

//! The transmission phase: request headers, simple and structured replies, block status.

use bytes::{BufMut, Bytes, BytesMut};

use super::wire::*;
use super::*;

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
        fn request_roundtrips(flags in any::<u16>(), command in any::<u16>(), cookie in any::<u64>(),
                              offset in any::<u64>(), len in any::<u32>()) {
            let req = Request { flags, command, cookie, offset, len };
            prop_assert_eq!(decode_request(&encode_request(&req)), Ok(req));
        }
    }
}

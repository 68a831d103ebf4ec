//! The handshake phase: greeting, client flags, options (INFO/GO, LIST, meta contexts) and
//! option replies, for both sides.

use super::wire::*;
use super::*;

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

#[cfg(test)]
mod tests {
    use super::*;

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
}

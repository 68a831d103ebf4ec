//! Bounds-checked big-endian readers shared by the handshake and transmission decoders.

use super::{ProtocolError, MAX_STRING_LEN};

pub(super) type Result<T> = std::result::Result<T, ProtocolError>;

pub(super) fn need(buf: &[u8], n: usize) -> Result<()> {
    if buf.len() < n {
        Err(ProtocolError::Short {
            need: n,
            have: buf.len(),
        })
    } else {
        Ok(())
    }
}

pub(super) fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
pub(super) fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
pub(super) fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Bounds-checked big-endian reader over an option payload.
pub(super) struct Cursor<'a> {
    pub(super) buf: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub(super) fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(ProtocolError::Malformed(what));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    pub(super) fn u16(&mut self, what: &'static str) -> Result<u16> {
        Ok(be16(self.take(2, what)?, 0))
    }
    pub(super) fn u32(&mut self, what: &'static str) -> Result<u32> {
        Ok(be32(self.take(4, what)?, 0))
    }
    /// A string prefixed by a 32-bit length.
    pub(super) fn string(&mut self, what: &'static str) -> Result<String> {
        let len = self.u32(what)? as usize;
        if len > MAX_STRING_LEN {
            return Err(ProtocolError::StringTooLong(len));
        }
        decode_string(self.take(len, what)?)
    }
    pub(super) fn finish(&self, what: &'static str) -> Result<()> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(ProtocolError::Malformed(what))
        }
    }
}

pub(super) fn decode_string(b: &[u8]) -> Result<String> {
    if b.len() > MAX_STRING_LEN {
        return Err(ProtocolError::StringTooLong(b.len()));
    }
    let s = std::str::from_utf8(b).map_err(|_| ProtocolError::NotUtf8)?;
    if s.contains('\0') {
        return Err(ProtocolError::Malformed("NUL in string"));
    }
    Ok(s.to_owned())
}

//! Little-endian encoding helpers with bounds-checked decoding.

use crate::{FormatError, FormatResult, Id};

/// Appends little-endian fields to a buffer.
#[derive(Default)]
pub struct Encoder {
    pub buf: Vec<u8>,
}

impl Encoder {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn with_capacity(n: usize) -> Self {
        Encoder {
            buf: Vec::with_capacity(n),
        }
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i64(&mut self, v: i64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn id(&mut self, id: &Id) -> &mut Self {
        self.buf.extend_from_slice(&id.0);
        self
    }
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self
    }
    /// A string with a u16 length prefix.
    pub fn str16(&mut self, s: &str) -> &mut Self {
        let len = u16::try_from(s.len()).expect("string longer than 64 KiB");
        self.u16(len).bytes(s.as_bytes())
    }
    /// A string with a u32 length prefix.
    pub fn str32(&mut self, s: &str) -> &mut Self {
        let len = u32::try_from(s.len()).expect("string longer than 4 GiB");
        self.u32(len).bytes(s.as_bytes())
    }
    pub fn finish(self) -> Vec<u8> {
        self.buf
    }
}

/// Reads little-endian fields from untrusted bytes; every read is bounds-checked.
pub struct Decoder<'a> {
    data: &'a [u8],
    pos: usize,
    what: &'static str,
}

impl<'a> Decoder<'a> {
    pub fn new(data: &'a [u8], what: &'static str) -> Self {
        Decoder { data, pos: 0, what }
    }

    pub fn remaining(&self) -> usize {
        self.data.len() - self.pos
    }

    pub fn take(&mut self, n: usize) -> FormatResult<&'a [u8]> {
        if self.remaining() < n {
            return Err(FormatError::Truncated {
                what: self.what,
                needed: (self.pos + n) as u64,
                available: self.data.len() as u64,
            });
        }
        let s = &self.data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    pub fn u8(&mut self) -> FormatResult<u8> {
        Ok(self.take(1)?[0])
    }
    pub fn u16(&mut self) -> FormatResult<u16> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("2")))
    }
    pub fn u32(&mut self) -> FormatResult<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    pub fn u64(&mut self) -> FormatResult<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    pub fn i64(&mut self) -> FormatResult<i64> {
        Ok(i64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    pub fn id(&mut self) -> FormatResult<Id> {
        Ok(Id(self.take(32)?.try_into().expect("32")))
    }
    fn utf8(&self, b: &[u8]) -> FormatResult<String> {
        String::from_utf8(b.to_vec())
            .map_err(|_| FormatError::invalid(self.what, "string is not UTF-8"))
    }
    pub fn str16(&mut self) -> FormatResult<String> {
        let n = self.u16()? as usize;
        let b = self.take(n)?;
        self.utf8(b)
    }
    pub fn str32(&mut self) -> FormatResult<String> {
        let n = self.u32()? as usize;
        let b = self.take(n)?;
        self.utf8(b)
    }
    /// Fails unless every byte was consumed: trailing garbage is corruption too.
    pub fn finish(&self) -> FormatResult<()> {
        if self.remaining() != 0 {
            return Err(FormatError::invalid(
                self.what,
                format!("{} unexpected trailing bytes", self.remaining()),
            ));
        }
        Ok(())
    }
}

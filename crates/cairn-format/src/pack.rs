//! Packs: many compressed blobs in one object, plus a trailer that indexes them.
//!
//! ```text
//! offset        size   field
//! 0             8      magic "CRNPACK\0"
//! 8             4      format version (u32)
//! 12            4      salt (random u32: two writers never produce the same pack id)
//! 16            ...    blob bytes, back to back (each as stored: raw or zstd frame)
//! T             48*n   trailer entries (see `BlobEntry::encode`)
//! T+48n         48     footer: n (u32), trailer length (u32), BLAKE3 of the trailer
//!                      entries (32), magic "CRNPKEND" (8)
//! ```
//! The pack id is the BLAKE3 of the whole pack. The salt makes it unique per write: an old pack
//! with the same blobs in the same order (a commit re-storing data, a GC repacking) must never
//! share a key with a new one, or deleting the old pack would delete the new one too. Each blob is verified on read by decoding it
//! and hashing the plain bytes against its id; the trailer is redundant with the index files
//! (it lets an index be rebuilt from packs alone, and lets `verify` cross-check them).

use crate::codec::{Decoder, Encoder};
use crate::config::Compression;
use crate::{FormatError, FormatResult, Id, FORMAT_VERSION};
use std::cell::RefCell;

pub const MAGIC: &[u8; 8] = b"CRNPACK\0";
pub const END_MAGIC: &[u8; 8] = b"CRNPKEND";
pub const HEADER_LEN: usize = 16;
pub const ENTRY_LEN: usize = 48;
pub const FOOTER_LEN: usize = 48;
/// Packs are addressed with 32-bit offsets.
pub const MAX_PACK_LEN: u64 = u32::MAX as u64;

/// What a blob holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlobKind {
    /// Image data: a chunk.
    Data,
    /// A manifest tree node.
    Node,
}

impl BlobKind {
    pub fn code(self) -> u8 {
        match self {
            BlobKind::Data => 0,
            BlobKind::Node => 1,
        }
    }
    pub fn from_code(c: u8, what: &'static str) -> FormatResult<Self> {
        match c {
            0 => Ok(BlobKind::Data),
            1 => Ok(BlobKind::Node),
            _ => Err(FormatError::invalid(what, format!("unknown blob kind {c}"))),
        }
    }
}

/// How a blob's bytes are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BlobEncoding {
    Raw,
    Zstd,
}

impl BlobEncoding {
    pub fn code(self) -> u8 {
        match self {
            BlobEncoding::Raw => 0,
            BlobEncoding::Zstd => 1,
        }
    }
    pub fn from_code(c: u8, what: &'static str) -> FormatResult<Self> {
        match c {
            0 => Ok(BlobEncoding::Raw),
            1 => Ok(BlobEncoding::Zstd),
            _ => Err(FormatError::invalid(
                what,
                format!("unknown blob encoding {c}"),
            )),
        }
    }
}

/// Where one blob sits inside its pack and how to decode it. 48 bytes on disk:
/// id (32) | kind (1) | encoding (1) | reserved (2) | offset (u32) | stored length (u32) |
/// raw length (u32).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlobEntry {
    pub id: Id,
    pub kind: BlobKind,
    pub encoding: BlobEncoding,
    pub offset: u32,
    pub stored_len: u32,
    pub raw_len: u32,
}

impl BlobEntry {
    pub fn encode(&self, e: &mut Encoder) {
        e.id(&self.id)
            .u8(self.kind.code())
            .u8(self.encoding.code())
            .u16(0)
            .u32(self.offset)
            .u32(self.stored_len)
            .u32(self.raw_len);
    }

    pub fn decode(d: &mut Decoder<'_>, what: &'static str) -> FormatResult<Self> {
        let id = d.id()?;
        let kind = BlobKind::from_code(d.u8()?, what)?;
        let encoding = BlobEncoding::from_code(d.u8()?, what)?;
        let _reserved = d.u16()?;
        let offset = d.u32()?;
        let stored_len = d.u32()?;
        let raw_len = d.u32()?;
        Ok(BlobEntry {
            id,
            kind,
            encoding,
            offset,
            stored_len,
            raw_len,
        })
    }

    /// Byte range of the blob within its pack.
    pub fn range(&self) -> std::ops::Range<u64> {
        self.offset as u64..self.offset as u64 + self.stored_len as u64
    }
}

thread_local! {
    /// One zstd compression context per thread, with the level it was set to. Creating a
    /// context per blob cost as much as compressing a 16 KiB chunk at level 1.
    static COMPRESSOR: RefCell<Option<(i32, zstd::bulk::Compressor<'static>)>> =
        const { RefCell::new(None) };
    /// One zstd decompression context per thread: a fresh one per blob spent 16% of a
    /// restore's CPU in `ZSTD_createDCtx`.
    static DECOMPRESSOR: RefCell<Option<zstd::bulk::Decompressor<'static>>> =
        const { RefCell::new(None) };
}

/// zstd at `level` with this thread's reused context (the output is the same as a fresh one's).
fn zstd_compress(plain: &[u8], level: i32) -> std::io::Result<Vec<u8>> {
    COMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        if !matches!(&*slot, Some((l, _)) if *l == level) {
            *slot = Some((level, zstd::bulk::Compressor::new(level)?));
        }
        let (_, c) = slot.as_mut().expect("set above");
        c.compress(plain)
    })
}

/// zstd decompression of at most `capacity` bytes with this thread's reused context.
pub(crate) fn zstd_decompress(stored: &[u8], capacity: usize) -> std::io::Result<Vec<u8>> {
    DECOMPRESSOR.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(zstd::bulk::Decompressor::new()?);
        }
        let d = slot.as_mut().expect("set above");
        let mut out = Vec::with_capacity(capacity);
        d.decompress_to_buffer(stored, &mut out)?;
        Ok(out)
    })
}

/// Encodes a blob for storage: compressed when that saves at least 1/32 of its size.
/// Returns the stored bytes and their encoding.
pub fn encode_blob(plain: &[u8], compression: Compression) -> (Vec<u8>, BlobEncoding) {
    if let Compression::Zstd { level } = compression {
        if let Ok(z) = zstd_compress(plain, level) {
            if z.len() + plain.len() / 32 < plain.len() {
                return (z, BlobEncoding::Zstd);
            }
        }
    }
    (plain.to_vec(), BlobEncoding::Raw)
}

/// Decodes stored blob bytes and verifies them against the blob's id.
pub fn decode_blob(entry: &BlobEntry, stored: &[u8]) -> FormatResult<Vec<u8>> {
    if stored.len() != entry.stored_len as usize {
        return Err(FormatError::Truncated {
            what: "blob",
            needed: entry.stored_len as u64,
            available: stored.len() as u64,
        });
    }
    let plain = match entry.encoding {
        BlobEncoding::Raw => stored.to_vec(),
        BlobEncoding::Zstd => {
            let out = zstd_decompress(stored, entry.raw_len as usize)
                .map_err(|e| FormatError::invalid("blob", format!("zstd: {e} (corrupt)")))?;
            if out.len() != entry.raw_len as usize {
                return Err(FormatError::invalid(
                    "blob",
                    format!(
                        "decompressed to {} bytes, expected {}",
                        out.len(),
                        entry.raw_len
                    ),
                ));
            }
            out
        }
    };
    if Id::of(&plain) != entry.id {
        return Err(FormatError::Checksum { what: "blob" });
    }
    Ok(plain)
}

/// Accumulates encoded blobs into one pack.
pub struct PackBuilder {
    buf: Vec<u8>,
    entries: Vec<BlobEntry>,
}

impl Default for PackBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl PackBuilder {
    pub fn new() -> Self {
        let mut buf = Vec::with_capacity(1 << 20);
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        buf.extend_from_slice(&rand::random::<u32>().to_le_bytes());
        PackBuilder {
            buf,
            entries: Vec::new(),
        }
    }

    /// Bytes the pack would have if finished now.
    pub fn len(&self) -> usize {
        self.buf.len() + self.entries.len() * ENTRY_LEN + FOOTER_LEN
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn blob_count(&self) -> usize {
        self.entries.len()
    }

    /// Appends an already encoded blob.
    pub fn push(
        &mut self,
        id: Id,
        kind: BlobKind,
        encoding: BlobEncoding,
        stored: &[u8],
        raw_len: u32,
    ) {
        let offset = u32::try_from(self.buf.len()).expect("pack grew past 4 GiB");
        self.buf.extend_from_slice(stored);
        self.entries.push(BlobEntry {
            id,
            kind,
            encoding,
            offset,
            stored_len: stored.len() as u32,
            raw_len,
        });
    }

    /// Closes the pack: returns its id, bytes and blob entries.
    pub fn finish(mut self) -> (Id, Vec<u8>, Vec<BlobEntry>) {
        let mut e = Encoder::with_capacity(self.entries.len() * ENTRY_LEN);
        for entry in &self.entries {
            entry.encode(&mut e);
        }
        let trailer = e.finish();
        let sum = blake3::hash(&trailer);
        self.buf.extend_from_slice(&trailer);
        self.buf
            .extend_from_slice(&(self.entries.len() as u32).to_le_bytes());
        self.buf
            .extend_from_slice(&(trailer.len() as u32).to_le_bytes());
        self.buf.extend_from_slice(sum.as_bytes());
        self.buf.extend_from_slice(END_MAGIC);
        let id = Id::of(&self.buf);
        (id, self.buf, self.entries)
    }
}

/// Gives a finished pack a new random salt and returns its new id. Used when a pack's key is
/// already taken (see the module documentation).
pub fn resalt(pack: &mut [u8]) -> Id {
    pack[12..16].copy_from_slice(&rand::random::<u32>().to_le_bytes());
    Id::of(pack)
}

/// Parses the footer (the last `FOOTER_LEN` bytes of a pack) and returns (entry count,
/// trailer length, trailer checksum).
pub fn parse_footer(footer: &[u8]) -> FormatResult<(u32, u32, [u8; 32])> {
    if footer.len() != FOOTER_LEN {
        return Err(FormatError::Truncated {
            what: "pack footer",
            needed: FOOTER_LEN as u64,
            available: footer.len() as u64,
        });
    }
    if &footer[40..48] != END_MAGIC {
        return Err(FormatError::BadMagic {
            what: "pack footer",
        });
    }
    let n = u32::from_le_bytes(footer[0..4].try_into().expect("4"));
    let len = u32::from_le_bytes(footer[4..8].try_into().expect("4"));
    if len as u64 != n as u64 * ENTRY_LEN as u64 {
        return Err(FormatError::invalid(
            "pack footer",
            format!("{n} entries do not fill a {len}-byte trailer"),
        ));
    }
    Ok((n, len, footer[8..40].try_into().expect("32")))
}

/// Parses and checks a whole pack's header and trailer; returns its blob entries.
/// Blob payloads are not decoded here (see [`decode_blob`]).
pub fn parse_pack(pack: &[u8]) -> FormatResult<Vec<BlobEntry>> {
    if pack.len() < HEADER_LEN + FOOTER_LEN {
        return Err(FormatError::Truncated {
            what: "pack",
            needed: (HEADER_LEN + FOOTER_LEN) as u64,
            available: pack.len() as u64,
        });
    }
    if &pack[..8] != MAGIC {
        return Err(FormatError::BadMagic { what: "pack" });
    }
    let version = u32::from_le_bytes(pack[8..12].try_into().expect("4"));
    if version > FORMAT_VERSION {
        return Err(FormatError::TooNew {
            what: "pack",
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    if version == 0 {
        return Err(FormatError::invalid("pack", "format version 0"));
    }
    let (n, len, sum) = parse_footer(&pack[pack.len() - FOOTER_LEN..])?;
    let trailer_start = pack
        .len()
        .checked_sub(FOOTER_LEN + len as usize)
        .filter(|s| *s >= HEADER_LEN)
        .ok_or(FormatError::invalid("pack", "trailer longer than the pack"))?;
    let trailer = &pack[trailer_start..pack.len() - FOOTER_LEN];
    if blake3::hash(trailer).as_bytes() != &sum {
        return Err(FormatError::Checksum {
            what: "pack trailer",
        });
    }
    let mut d = Decoder::new(trailer, "pack trailer");
    let mut entries = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let e = BlobEntry::decode(&mut d, "pack trailer")?;
        if e.offset < HEADER_LEN as u32 || e.range().end > trailer_start as u64 {
            return Err(FormatError::invalid(
                "pack trailer",
                format!("blob {} lies outside the pack's data area", e.id.short()),
            ));
        }
        entries.push(e);
    }
    d.finish()?;
    Ok(entries)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build() -> (Id, Vec<u8>, Vec<BlobEntry>, Vec<Vec<u8>>) {
        let blobs: Vec<Vec<u8>> = vec![
            vec![0xAB; 10000],
            (0..5000u32).flat_map(|i| i.to_le_bytes()).collect(),
            b"tiny".to_vec(),
        ];
        let mut p = PackBuilder::new();
        for b in &blobs {
            let (stored, enc) = encode_blob(b, Compression::Zstd { level: 3 });
            p.push(Id::of(b), BlobKind::Data, enc, &stored, b.len() as u32);
        }
        let expected_len = p.len();
        let (id, bytes, entries) = p.finish();
        assert_eq!(bytes.len(), expected_len);
        (id, bytes, entries, blobs)
    }

    #[test]
    fn round_trip() {
        let (id, bytes, entries, blobs) = build();
        assert_eq!(id, Id::of(&bytes));
        assert_eq!(parse_pack(&bytes).unwrap(), entries);
        assert_eq!(entries[0].encoding, BlobEncoding::Zstd);
        assert_eq!(
            entries[2].encoding,
            BlobEncoding::Raw,
            "tiny blob is not worth compressing"
        );
        for (e, b) in entries.iter().zip(&blobs) {
            let stored = &bytes[e.range().start as usize..e.range().end as usize];
            assert_eq!(&decode_blob(e, stored).unwrap(), b);
        }
    }

    #[test]
    fn every_flipped_byte_is_detected_somewhere() {
        let (_, bytes, entries, _) = build();
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 1;
            let trailer_ok = parse_pack(&bad).map(|e| e == entries).unwrap_or(false);
            let blobs_ok = entries.iter().all(|e| {
                decode_blob(e, &bad[e.range().start as usize..e.range().end as usize]).is_ok()
            });
            // The header's salt is the only part allowed to change unnoticed (it changes the
            // pack's id, which verify checks against the pack's key).
            if (12..16).contains(&i) {
                continue;
            }
            assert!(!(trailer_ok && blobs_ok), "flip at byte {i} went unnoticed");
        }
    }

    #[test]
    fn truncation_is_detected() {
        let (_, bytes, _, _) = build();
        for n in [0, 10, 16, bytes.len() / 2, bytes.len() - 1] {
            assert!(parse_pack(&bytes[..n]).is_err(), "truncated to {n}");
        }
    }
}

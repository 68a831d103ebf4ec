//! Index files: which pack holds each blob, and where.
//!
//! Each commit writes one index file (key `index/<id>`) covering the packs it wrote, after
//! those packs are durable and before anything refers to their blobs. Readers load every
//! index file into memory at open. Payload (inside an envelope with magic "CRNINDX\0"):
//!
//! ```text
//! pack count (u32)
//! per pack: pack id (32) | entry count (u32) | entries (48 bytes each, as in the pack trailer)
//! ```

use crate::codec::{Decoder, Encoder};
use crate::envelope;
use crate::pack::{BlobEntry, ENTRY_LEN};
use crate::{FormatResult, Id};

pub const MAGIC: &[u8; 8] = b"CRNINDX\0";
/// The blobs of one pack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackIndex {
    pub pack: Id,
    pub entries: Vec<BlobEntry>,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct IndexFile {
    pub packs: Vec<PackIndex>,
}

impl IndexFile {
    pub fn encode(&self) -> Vec<u8> {
        let n: usize = self
            .packs
            .iter()
            .map(|p| 36 + p.entries.len() * ENTRY_LEN)
            .sum();
        let mut e = Encoder::with_capacity(4 + n);
        e.u32(self.packs.len() as u32);
        for p in &self.packs {
            e.id(&p.pack).u32(p.entries.len() as u32);
            for entry in &p.entries {
                entry.encode(&mut e);
            }
        }
        envelope::seal(MAGIC, &e.finish())
    }

    pub fn decode(data: &[u8]) -> FormatResult<Self> {
        let payload = envelope::open(MAGIC, data, "index file")?;
        let mut d = Decoder::new(payload, "index file");
        let count = d.u32()? as usize;
        // Never trust a count to size an allocation: cap by what the payload can hold.
        let mut packs = Vec::with_capacity(count.min(d.remaining() / 36));
        for _ in 0..count {
            let pack = d.id()?;
            let n = d.u32()? as usize;
            let mut entries = Vec::with_capacity(n.min(d.remaining() / ENTRY_LEN));
            for _ in 0..n {
                entries.push(BlobEntry::decode(&mut d, "index file")?);
            }
            packs.push(PackIndex { pack, entries });
        }
        d.finish()?;
        Ok(IndexFile { packs })
    }

    pub fn blob_count(&self) -> usize {
        self.packs.iter().map(|p| p.entries.len()).sum()
    }
}

/// The key of an index file.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::pack::{BlobEncoding, BlobKind};

    #[test]
    fn round_trip() {
        let f = IndexFile {
            packs: vec![PackIndex {
                pack: Id::of(b"p"),
                entries: vec![BlobEntry {
                    id: Id::of(b"x"),
                    kind: BlobKind::Node,
                    encoding: BlobEncoding::Zstd,
                    offset: 16,
                    stored_len: 100,
                    raw_len: 300,
                }],
            }],
        };
        assert_eq!(IndexFile::decode(&f.encode()).unwrap(), f);
    }
}

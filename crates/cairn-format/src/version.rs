//! Version records: one immutable object per version, at key `versions/<id>` where the id is
//! the BLAKE3 of the object. Payload (inside an envelope with magic "CRNVERS\0"):
//!
//! ```text
//! image name (u16 len + UTF-8) | seq (u64) | parent version id (32, zero = none)
//! time (i64, ns since epoch) | logical size (u64) | root node id (32, zero = all zeros)
//! tree height (u8) | segment size (u32) | fanout (u16)
//! stats: data bytes (u64) | chunks (u64) | new chunks (u64) | new chunk bytes (u64)
//!        | stored bytes (u64)
//! message (u32 len + UTF-8)
//! ```
//! The tree geometry is recorded per version so a version stays readable on its own.

use crate::codec::{Decoder, Encoder};
use crate::envelope;
use crate::name::validate_image_name;
use crate::{FormatError, FormatResult, Id};

pub const MAGIC: &[u8; 8] = b"CRNVERS\0";
/// Figures about one commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CommitStats {
    /// Logical bytes that are not zero (what a sparse restore writes).
    pub data_bytes: u64,
    /// Non-zero chunks referenced by the version.
    pub chunks: u64,
    /// Chunks this commit added to the repository.
    pub new_chunks: u64,
    /// Plain bytes of those new chunks.
    pub new_chunk_bytes: u64,
    /// Bytes this commit wrote to the store: packs, index, version record.
    pub stored_bytes: u64,
}

impl CommitStats {
    /// Adds one segment's chunk figures (a commit's workers count per segment; what is
    /// stored is counted once, at publication).
    pub fn add_chunks(&mut self, other: &CommitStats) {
        self.data_bytes += other.data_bytes;
        self.chunks += other.chunks;
        self.new_chunks += other.new_chunks;
        self.new_chunk_bytes += other.new_chunk_bytes;
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionRecord {
    pub image: String,
    /// 1 for the first version of an image, parent's + 1 after.
    pub seq: u64,
    pub parent: Option<Id>,
    pub time_ns: i64,
    pub logical_size: u64,
    /// Root manifest node; `None` when the whole image is zeros (or empty).
    pub root: Option<Id>,
    pub height: u8,
    pub segment_size: u32,
    pub fanout: u16,
    pub stats: CommitStats,
    pub message: String,
}

impl VersionRecord {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::with_capacity(256 + self.message.len());
        e.str16(&self.image)
            .u64(self.seq)
            .id(&self.parent.unwrap_or(Id::ZERO))
            .i64(self.time_ns)
            .u64(self.logical_size)
            .id(&self.root.unwrap_or(Id::ZERO))
            .u8(self.height)
            .u32(self.segment_size)
            .u16(self.fanout)
            .u64(self.stats.data_bytes)
            .u64(self.stats.chunks)
            .u64(self.stats.new_chunks)
            .u64(self.stats.new_chunk_bytes)
            .u64(self.stats.stored_bytes)
            .str32(&self.message);
        envelope::seal(MAGIC, &e.finish())
    }

    pub fn decode(data: &[u8]) -> FormatResult<Self> {
        let payload = envelope::open(MAGIC, data, "version record")?;
        let mut d = Decoder::new(payload, "version record");
        let image = d.str16()?;
        validate_image_name(&image)?;
        let seq = d.u64()?;
        let parent = Some(d.id()?).filter(|p| !p.is_zero());
        let time_ns = d.i64()?;
        let logical_size = d.u64()?;
        let root = Some(d.id()?).filter(|r| !r.is_zero());
        let height = d.u8()?;
        let segment_size = d.u32()?;
        let fanout = d.u16()?;
        let stats = CommitStats {
            data_bytes: d.u64()?,
            chunks: d.u64()?,
            new_chunks: d.u64()?,
            new_chunk_bytes: d.u64()?,
            stored_bytes: d.u64()?,
        };
        let message = d.str32()?;
        d.finish()?;
        if seq == 0 || height == 0 || fanout < 2 || !segment_size.is_power_of_two() {
            return Err(FormatError::invalid(
                "version record",
                "impossible tree geometry or seq",
            ));
        }
        Ok(VersionRecord {
            image,
            seq,
            parent,
            time_ns,
            logical_size,
            root,
            height,
            segment_size,
            fanout,
            stats,
            message,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let v = VersionRecord {
            image: "web01/disk0".into(),
            seq: 3,
            parent: Some(Id::of(b"p")),
            time_ns: 123,
            logical_size: 1 << 30,
            root: None,
            height: 2,
            segment_size: 1 << 20,
            fanout: 256,
            stats: CommitStats {
                data_bytes: 5,
                chunks: 1,
                new_chunks: 1,
                new_chunk_bytes: 5,
                stored_bytes: 99,
            },
            message: "before upgrade ✓".into(),
        };
        assert_eq!(VersionRecord::decode(&v.encode()).unwrap(), v);
    }
}

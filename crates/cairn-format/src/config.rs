//! The repository config: the parameters every writer must agree on.
//!
//! Stored once at key `config`, written by `init` and never changed (a changed chunker
//! would silently stop deduplicating against old versions).

use crate::codec::{Decoder, Encoder};
use crate::envelope;
use crate::{FormatError, FormatResult};

pub const MAGIC: &[u8; 8] = b"CRNCONF\0";
pub const MIN_CHUNK: u32 = 4 * 1024;
pub const MAX_CHUNK: u32 = 4 * 1024 * 1024;
pub const MIN_SEGMENT: u32 = 64 * 1024;
pub const MAX_SEGMENT: u32 = 64 * 1024 * 1024;

/// How a segment is cut into chunks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chunker {
    /// Fixed-size chunks aligned to the segment start (the last one may be shorter).
    Fixed,
    /// FastCDC (2020 variant) with min = avg/4, max = avg*4, restarted at each segment.
    FastCdc,
}

impl Chunker {
    fn code(self) -> u8 {
        match self {
            Chunker::Fixed => 0,
            Chunker::FastCdc => 1,
        }
    }
    fn from_code(c: u8) -> FormatResult<Self> {
        match c {
            0 => Ok(Chunker::Fixed),
            1 => Ok(Chunker::FastCdc),
            _ => Err(FormatError::invalid(
                "config",
                format!("unknown chunker {c}"),
            )),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Chunker::Fixed => "fixed",
            Chunker::FastCdc => "fastcdc",
        }
    }
}

/// How blobs are compressed inside packs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    None,
    /// zstd at the given level; a blob is stored raw when compression does not pay.
    Zstd {
        level: i32,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoConfig {
    /// Random id of this repository (distinguishes repositories in caches and logs).
    pub repo_id: [u8; 16],
    pub chunker: Chunker,
    /// Fixed: the chunk size. FastCDC: the average chunk size. A power of two, 4 KiB..4 MiB.
    pub chunk_size: u32,
    /// Logical bytes per manifest leaf; a power of two and a multiple of `chunk_size`.
    pub segment_size: u32,
    /// Children per interior manifest node.
    pub fanout: u16,
    pub compression: Compression,
    /// Packs are closed once they reach this many bytes.
    pub pack_target: u32,
    /// Creation time, nanoseconds since the Unix epoch.
    pub created_ns: i64,
    /// Bits per chunk in each version's reference summary (Bloom filter), 4..=64. More bits
    /// mean less space leaked by fast deletion and bigger summaries (see `summary`).
    pub summary_bits: u8,
}

impl RepoConfig {
    /// Checks the invariants that the rest of cairn relies on.
    pub fn validate(&self) -> FormatResult<()> {
        let bad = |r: String| Err(FormatError::invalid("config", r));
        if !self.chunk_size.is_power_of_two() || !(MIN_CHUNK..=MAX_CHUNK).contains(&self.chunk_size)
        {
            return bad(format!(
                "chunk size {} must be a power of two between 4 KiB and 4 MiB",
                self.chunk_size
            ));
        }
        if !self.segment_size.is_power_of_two()
            || !(MIN_SEGMENT..=MAX_SEGMENT).contains(&self.segment_size)
        {
            return bad(format!(
                "segment size {} must be a power of two between 64 KiB and 64 MiB",
                self.segment_size
            ));
        }
        if self.segment_size < self.chunk_size {
            return bad(format!(
                "segment size {} is smaller than the chunk size {}",
                self.segment_size, self.chunk_size
            ));
        }
        if self.chunker == Chunker::FastCdc && self.segment_size < self.chunk_size * 4 {
            return bad("with fastcdc the segment must hold at least 4 average chunks".into());
        }
        if !(2..=4096).contains(&self.fanout) {
            return bad(format!("fanout {} must be between 2 and 4096", self.fanout));
        }
        if self.pack_target < 1024 * 1024 || self.pack_target > 1024 * 1024 * 1024 {
            return bad(format!(
                "pack target {} must be between 1 MiB and 1 GiB",
                self.pack_target
            ));
        }
        if !(4..=64).contains(&self.summary_bits) {
            return bad(format!(
                "summary bits {} must be between 4 and 64",
                self.summary_bits
            ));
        }
        if let Compression::Zstd { level } = self.compression {
            if !(-7..=19).contains(&level) {
                return bad(format!("zstd level {level} must be between -7 and 19"));
            }
        }
        Ok(())
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::new();
        e.bytes(&self.repo_id)
            .u8(self.chunker.code())
            .u32(self.chunk_size)
            .u32(self.segment_size)
            .u16(self.fanout)
            .u8(0); // hash algorithm: 0 = BLAKE3-256 (the only one)
        match self.compression {
            Compression::None => e.u8(0).u8(0),
            Compression::Zstd { level } => e.u8(1).u8(level as i8 as u8),
        };
        e.u32(self.pack_target)
            .i64(self.created_ns)
            .u8(self.summary_bits);
        envelope::seal(MAGIC, &e.finish())
    }

    pub fn decode(data: &[u8]) -> FormatResult<Self> {
        let payload = envelope::open(MAGIC, data, "config")?;
        let mut d = Decoder::new(payload, "config");
        let repo_id: [u8; 16] = d.take(16)?.try_into().expect("16");
        let chunker = Chunker::from_code(d.u8()?)?;
        let chunk_size = d.u32()?;
        let segment_size = d.u32()?;
        let fanout = d.u16()?;
        let hash = d.u8()?;
        if hash != 0 {
            return Err(FormatError::invalid(
                "config",
                format!("unknown hash algorithm {hash}"),
            ));
        }
        let compression = match (d.u8()?, d.u8()? as i8) {
            (0, _) => Compression::None,
            (1, level) => Compression::Zstd {
                level: level as i32,
            },
            (c, _) => {
                return Err(FormatError::invalid(
                    "config",
                    format!("unknown compression {c}"),
                ))
            }
        };
        let pack_target = d.u32()?;
        let created_ns = d.i64()?;
        // Absent in configs written before reference summaries existed.
        let summary_bits = if d.remaining() == 0 {
            crate::summary::DEFAULT_BITS_PER_CHUNK
        } else {
            d.u8()?
        };
        d.finish()?;
        let cfg = RepoConfig {
            repo_id,
            chunker,
            chunk_size,
            segment_size,
            fanout,
            compression,
            pack_target,
            created_ns,
            summary_bits,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn new_repo_id() -> [u8; 16] {
        rand::random()
    }
}

impl Default for RepoConfig {
    /// The settings `cairn init` uses unless told otherwise (its flags' defaults are checked
    /// against these), with a zero `repo_id` and creation time: `init` sets both.
    fn default() -> Self {
        RepoConfig {
            repo_id: [0; 16],
            chunker: Chunker::Fixed,
            chunk_size: 16 * 1024,
            segment_size: 1024 * 1024,
            fanout: 256,
            compression: Compression::Zstd { level: 3 },
            pack_target: 16 * 1024 * 1024,
            created_ns: 0,
            summary_bits: 24,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> RepoConfig {
        RepoConfig {
            repo_id: [7; 16],
            chunker: Chunker::Fixed,
            chunk_size: 16384,
            segment_size: 1 << 20,
            fanout: 256,
            compression: Compression::Zstd { level: -2 },
            pack_target: 16 << 20,
            created_ns: 1_700_000_000_000_000_000,
            summary_bits: 24,
        }
    }

    #[test]
    fn round_trip() {
        let c = sample();
        assert_eq!(RepoConfig::decode(&c.encode()).unwrap(), c);
    }

    #[test]
    fn rejects_bad_parameters() {
        let mut c = sample();
        c.chunk_size = 3000;
        assert!(c.validate().is_err());
        let mut c = sample();
        c.segment_size = 8192;
        assert!(c.validate().is_err());
        let mut c = sample();
        c.chunk_size = 8 << 20;
        assert!(c.validate().is_err());
    }
}

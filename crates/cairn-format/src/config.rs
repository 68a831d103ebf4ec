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
/// The newest repository format this build reads and writes (the config's envelope version).
pub const NEWEST_FORMAT: u32 = 2;

/// Config flag bit 0: the repository is encrypted (format 2 only).
const FLAG_ENCRYPTED: u32 = 1;

/// The settings only a format 2 repository has (4 KiB dedup inside compressed chunk
/// groups).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct V2Settings {
    /// A commit's neighbouring new chunks are compressed together, in groups of up to this
    /// many plain bytes (at least one chunk each).
    pub group_size: u32,
    /// Set in an encrypted repository: [`crate::crypto::MasterKey::key_check`] of its master
    /// key, so a key slot that opens to another key (planted, or left by an interrupted
    /// `init`) is refused by name instead of failing every object as tampered.
    pub key_check: Option<[u8; 32]>,
}

impl V2Settings {
    /// Whether the repository is encrypted.
    pub fn encrypted(&self) -> bool {
        self.key_check.is_some()
    }
}

impl Default for V2Settings {
    /// Chosen by measurement (BENCHMARKS.md, *Studies behind the design*): 64 KiB groups store within 1–3% of 256 KiB
    /// ones and a cold lazy boot fetches 1.14× what 16 KiB chunks fetch, where 256 KiB
    /// groups fetch 1.51×.
    fn default() -> Self {
        V2Settings {
            group_size: 64 * 1024,
            key_check: None,
        }
    }
}

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
    /// Format 2's settings; `None` in a format 1 repository.
    pub v2: Option<V2Settings>,
}

impl RepoConfig {
    /// The repository format: 1, or 2 when the config has format 2's settings.
    pub fn format(&self) -> u32 {
        if self.v2.is_some() {
            2
        } else {
            1
        }
    }

    /// The settings `cairn init --format 2` uses unless told otherwise: 4 KiB chunks (the
    /// file systems' block size, so data moved inside a guest is found again) in 64 KiB
    /// groups.
    pub fn default_v2() -> Self {
        RepoConfig {
            chunk_size: 4 * 1024,
            v2: Some(V2Settings::default()),
            ..RepoConfig::default()
        }
    }

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
        if let Some(v2) = self.v2 {
            if !(self.chunk_size..=crate::group::MAX_GROUP_PLAIN).contains(&v2.group_size) {
                return bad(format!(
                    "group size {} must be between the chunk size ({}) and 16 MiB",
                    v2.group_size, self.chunk_size
                ));
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
        if let Some(v2) = self.v2 {
            // Flags: bit 0 marks an encrypted repository, whose key check follows.
            match v2.key_check {
                None => {
                    e.u32(v2.group_size).u32(0);
                }
                Some(check) => {
                    e.u32(v2.group_size).u32(FLAG_ENCRYPTED).bytes(&check);
                }
            }
        }
        envelope::seal_version(MAGIC, self.format(), &e.finish())
    }

    pub fn decode(data: &[u8]) -> FormatResult<Self> {
        let (format, payload) = envelope::open_version(MAGIC, data, "config", NEWEST_FORMAT)?;
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
        // Absent in format 1 configs written before reference summaries existed.
        let summary_bits = if format == 1 && d.remaining() == 0 {
            crate::summary::DEFAULT_BITS_PER_CHUNK
        } else {
            d.u8()?
        };
        let v2 = if format == 2 {
            let group_size = d.u32()?;
            let flags = d.u32()?;
            if flags & !FLAG_ENCRYPTED != 0 {
                return Err(FormatError::invalid(
                    "config",
                    format!("unknown flags {flags:#x} (written by a newer cairn?)"),
                ));
            }
            let key_check = if flags & FLAG_ENCRYPTED != 0 {
                Some(d.take(32)?.try_into().expect("32"))
            } else {
                None
            };
            Some(V2Settings {
                group_size,
                key_check,
            })
        } else {
            None
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
            v2,
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
            v2: None,
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
            v2: None,
        }
    }

    #[test]
    fn format_2_round_trips_and_is_refused_by_a_format_1_reader() {
        let c = RepoConfig {
            v2: Some(V2Settings {
                group_size: 65536,
                key_check: None,
            }),
            chunk_size: 4096,
            ..sample()
        };
        let raw = c.encode();
        assert_eq!(u32::from_le_bytes(raw[8..12].try_into().unwrap()), 2);
        assert_eq!(RepoConfig::decode(&raw).unwrap(), c);
        // What a reader that knows format 1 only says (the v1 release's check).
        let e = envelope::open(MAGIC, &raw, "config").unwrap_err();
        assert_eq!(
            e.to_string(),
            "config: format version 2 is newer than this cairn supports (1); upgrade cairn"
        );
        // Format 1 stays byte for byte what it was: no v2 fields, envelope version 1.
        let v1 = sample().encode();
        assert_eq!(u32::from_le_bytes(v1[8..12].try_into().unwrap()), 1);
        assert_eq!(v1.len(), raw.len() - 8);
    }

    #[test]
    fn format_2_refuses_bad_groups_and_unknown_flags() {
        let mut c = RepoConfig {
            v2: Some(V2Settings {
                group_size: 2048,
                key_check: None,
            }),
            chunk_size: 4096,
            ..sample()
        };
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("group size 2048"));
        c.v2 = Some(V2Settings {
            group_size: 65536,
            key_check: None,
        });
        let mut raw = c.encode();
        // Set flag bit 1 in the payload (the last 4 payload bytes) and reseal.
        let n = raw.len() - 32;
        raw[n - 4] = 2;
        let resealed = envelope::seal_version(MAGIC, 2, &raw[16..n]);
        let e = RepoConfig::decode(&resealed).unwrap_err().to_string();
        assert!(e.contains("unknown flags 0x2"), "{e}");
        // Bit 0 (encrypted) without its key check is truncated.
        raw[n - 4] = 1;
        let resealed = envelope::seal_version(MAGIC, 2, &raw[16..n]);
        assert!(RepoConfig::decode(&resealed).is_err());
    }

    #[test]
    fn an_encrypted_config_carries_its_key_check() {
        let c = RepoConfig {
            v2: Some(V2Settings {
                group_size: 65536,
                key_check: Some([7; 32]),
            }),
            chunk_size: 4096,
            ..sample()
        };
        let raw = c.encode();
        let back = RepoConfig::decode(&raw).unwrap();
        assert!(back.v2.unwrap().encrypted());
        assert_eq!(back, c);
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

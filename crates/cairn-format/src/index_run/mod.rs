//! Index runs (format v2, issues 16 and 17): where chunks and groups are, read in pieces.
//!
//! v1 readers load every index file whole (48 bytes per chunk, held in one map). A run is an
//! immutable sorted table that a reader consults without loading it. An entry is 12 bytes:
//! the first 8 bytes of an id (chunk, node or group id: the three never share a value, see
//! `group::group_id`) and the ordinal of the pack that holds it. The key is a *candidate*,
//! not a proof: the pack's trailer, read and cached per pack, lists the full ids, and readers
//! check them there, so an 8-byte collision (about one in 2^64 per lookup, or crafted) costs
//! one more trailer lookup and never a wrong answer.
//!
//! Version 3 (what cairn writes) keeps what a reader must hold to a *top level* of
//! about 60 bytes per 87,000 entries: the fence keys of the directory blocks and the
//! checksums of every piece. A lookup reads one directory block (~11 KiB: the fence keys and
//! checksums of 256 sections), one section (~4 KiB) and one block of the pack table (~4 KiB),
//! each cached; the filter is a piece of its own, held only while the reader's budget allows.
//! Versions 1 and 2 (read still) hold the whole section table and pack table in their meta,
//! which at fleet scale — hundreds of millions of entries — is more than any cache
//! (BENCHMARKS.md, *Studies behind the design*: 579 MiB of a 654 MiB peak at 1,000 VMs).
//!
//! ```text
//! offset  size  field                                    (version 3)
//! 0       8     magic "CRNIRUN\0"
//! 8       4     version (u32) = 3 (1 and 2 are read too, see `read`)
//! 12      4     flags (u32): bit 0 = sealed (every piece encrypted alone); others 0
//! 16      ...   sections, back to back: n × (key (u64) | pack ordinal (u32)), sorted by
//!               (key, pack ordinal), no entry twice
//! ...     ...   directory blocks, back to back: m × (first key (u64) | entries (u32)
//!               | BLAKE3 of the stored section (32)) for m consecutive sections
//! ...     ...   pack blocks, back to back: up to N × pack id (32), the table in byte order
//! ...     ...   filter: log2 of its bits (u8) | probes (u8) | bits (see `summary::Bloom`)
//! M       L     top level (sealed as one piece when the run is):
//!                 pack count P (u32) | packs per block N (u32, ≥ 1)
//!                 | ⌈P/N⌉ × BLAKE3 of the stored pack block (32)
//!                 | block count K (u32)
//!                 | K × (first key (u64) | sections (u32) | entries (u64)
//!                        | BLAKE3 of the stored directory block (32))
//!                 | filter's stored length (u64) | BLAKE3 of the stored filter (32)
//! M+L     52    footer: L (u32) | entry count (u64) | BLAKE3 of the L top-level bytes (32)
//!               | "CRNIREND"
//! ```
//! No offset is stored: every piece's place follows from the counts (a section is 12 bytes an
//! entry, a directory entry 44 bytes, a pack id 32, each piece + 40 when sealed), and a reader
//! refuses a top level whose pieces do not end exactly where it begins. A key's entries never
//! straddle two sections, so a lookup reads exactly one: the last whose first key is ≤ the
//! key, in the last directory block whose first key is ≤ the key.

mod read;
mod whole;
mod write;

use std::ops::Range;
use std::sync::Arc;

use crate::summary::Bloom;
use crate::Id;

pub use read::{ordinals_of, parse_footer, parse_header, parse_meta};
pub use whole::{parse_run, WholeRun};
pub use write::{
    merge_pack_keys, pack_table, write_legacy_run, write_run, write_run_with, Geometry, RunEntries,
    RunWriter,
};

pub const MAGIC: &[u8; 8] = b"CRNIRUN\0";
pub const END_MAGIC: &[u8; 8] = b"CRNIREND";
/// The version writers write. Version 2 (read still) holds the section and pack tables whole
/// in its meta; version 1 also differs in its filter, which hashes the full ids.
pub const VERSION: u32 = 3;
/// The oldest version readers accept.
pub const FIRST_VERSION: u32 = 1;
pub const HEADER_LEN: usize = 16;
pub const FOOTER_LEN: usize = 4 + 8 + 32 + 8;
pub const ENTRY_LEN: usize = 12;
/// Entries per section a writer aims at: about 4 KiB.
pub const SECTION_ENTRIES: usize = 340;
/// Sections per directory block a writer aims at: about 11 KiB, 87,000 entries.
pub const BLOCK_SECTIONS: usize = 256;
/// Pack ids per pack block a writer aims at: 4 KiB.
pub const PACKS_PER_BLOCK: u32 = 128;
/// A version 3 directory entry: first key, entries, checksum.
pub const DIRECTORY_ENTRY_LEN: usize = 8 + 4 + 32;
/// Filter geometry: 10 bits per entry before rounding up to a power of two (1–2% false
/// "maybe"s), 7 probes.
const FILTER_BITS_PER_ENTRY: u16 = 10;
const FILTER_PROBES: u8 = 7;
const FLAG_SEALED: u32 = 1;
const WHAT: &str = "index run";

/// The key of an id in a run: its first 8 bytes, little-endian.
pub fn key_of(id: &Id) -> u64 {
    id.prefix_u64()
}

/// One entry: an id's key and the ordinal of its pack in the run's pack table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Entry {
    pub key: u64,
    pub pack: u32,
}

/// Where a section is and what it holds (from a directory block, or a version 1–2 meta).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SectionRef {
    pub first_key: u64,
    pub entries: u32,
    pub offset: u64,
    pub stored_len: u32,
    pub checksum: [u8; 32],
}

impl SectionRef {
    /// The section's stored bytes in the run.
    pub fn range(&self) -> Range<u64> {
        self.offset..self.offset + u64::from(self.stored_len)
    }
}

/// The footer: where the meta is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footer {
    pub meta_len: u32,
    pub entries: u64,
    pub meta_checksum: [u8; 32],
}

/// Where a piece of a run is, and the checksum of its stored bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PieceAt {
    pub range: Range<u64>,
    pub checksum: [u8; 32],
}

/// A piece of a run: held since the meta was read (versions 1 and 2), or to be read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Piece<T> {
    Held(Arc<T>),
    At(PieceAt),
}

/// A run of consecutive sections: their fence keys and where they are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Directory {
    /// The run-wide number of its first section.
    pub first_section: u32,
    pub sections: Vec<SectionRef>,
    /// The first key of the next block: every key here is below it.
    pub end_key: Option<u64>,
}

impl Directory {
    /// The section (index in this block) whose fence keys cover `key`.
    pub fn section_of(&self, key: u64) -> Option<usize> {
        match self.sections.partition_point(|s| s.first_key <= key) {
            0 => None,
            i => Some(i - 1),
        }
    }

    /// The key every entry of section `j` is below.
    pub fn next_key(&self, j: usize) -> Option<u64> {
        self.sections
            .get(j + 1)
            .map(|s| s.first_key)
            .or(self.end_key)
    }

    /// Approximate bytes held.
    pub fn cost(&self) -> u64 {
        (self.sections.len() * std::mem::size_of::<SectionRef>()) as u64 + 32
    }
}

/// What the top level says of one directory block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockRef {
    pub first_key: u64,
    pub sections: u32,
    /// The run-wide number of its first section.
    pub first_section: u32,
    pub entries: u64,
    /// Where its first section starts.
    pub section_offset: u64,
    pub piece: Piece<Directory>,
}

/// A block of the pack table: ids in byte order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackBlock(pub Vec<Id>);

/// What a reader holds of a run: its top level (for versions 1 and 2, the whole meta).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunMeta {
    /// 1: the filter hashes full ids; 2: it hashes the 8-byte keys; 3: pieces read on demand.
    pub version: u32,
    pub sealed: bool,
    pub entries: u64,
    pub pack_count: u32,
    pub packs_per_block: u32,
    pub pack_blocks: Vec<Piece<PackBlock>>,
    pub blocks: Vec<BlockRef>,
    /// The filter, when it came with the meta (versions 1 and 2). A reader may take it out
    /// to keep within its memory budget: every id then passes, and the fence keys alone
    /// choose the section.
    pub filter: Option<Bloom>,
    /// Where the filter is (version 3), for a reader whose budget holds it.
    pub filter_at: Option<PieceAt>,
}

impl RunMeta {
    /// The directory block whose fence keys cover `id`'s key (no filter asked).
    pub fn block_of(&self, id: &Id) -> Option<usize> {
        self.block_of_key(key_of(id))
    }

    /// The directory block whose fence keys cover `key`.
    pub fn block_of_key(&self, key: u64) -> Option<usize> {
        match self.blocks.partition_point(|b| b.first_key <= key) {
            0 => None,
            i => Some(i - 1),
        }
    }

    /// Whether `filter` (this run's, perhaps held apart from the meta) lets `id` through.
    pub fn filter_passes(&self, filter: &Bloom, id: &Id) -> bool {
        filter.contains_probe(match self.version {
            1 => crate::summary::ProbeKey::of(id),
            _ => crate::summary::ProbeKey::of_key(key_of(id)),
        })
    }

    /// The pack block holding pack ordinal `ordinal`, and its place there.
    pub fn pack_place(&self, ordinal: u32) -> Option<(usize, usize)> {
        (ordinal < self.pack_count).then(|| {
            let per = self.packs_per_block;
            ((ordinal / per) as usize, (ordinal % per) as usize)
        })
    }

    /// The sections of the run.
    pub fn section_count(&self) -> u64 {
        self.blocks.iter().map(|b| u64::from(b.sections)).sum()
    }

    /// Bytes this meta holds (what a reader keeps per run, filter apart).
    pub fn cost(&self) -> u64 {
        let held_dirs: u64 = self
            .blocks
            .iter()
            .map(|b| match &b.piece {
                Piece::Held(d) => d.cost(),
                Piece::At(_) => 0,
            })
            .sum();
        let held_packs: u64 = self
            .pack_blocks
            .iter()
            .map(|p| match p {
                Piece::Held(p) => p.0.len() as u64 * 32,
                Piece::At(_) => 48,
            })
            .sum();
        (self.blocks.len() * std::mem::size_of::<BlockRef>()) as u64 + held_dirs + held_packs
    }
}

#[cfg(test)]
mod tests;

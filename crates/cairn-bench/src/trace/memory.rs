//! What a real commit process would hold and read for a simulated commit, from the counts the
//! trace makes and the sizes of cairn's own structures (`std::mem::size_of` of the types, the
//! cache limits of `CacheLimits::BUILT_IN`, the index run and pack trailer layouts). A model:
//! the trace holds no index runs and reads no trailers (see `store.rs`); the figures say what
//! the real reader would, given the same lookups.

use cairn_engine::commit::claims::CLAIM_BYTES;
use cairn_format::index_run::{
    BlockRef, SectionRef, BLOCK_SECTIONS, DIRECTORY_ENTRY_LEN, ENTRY_LEN, PACKS_PER_BLOCK,
    SECTION_ENTRIES,
};
use cairn_repo::v2::{CacheLimits, PackTrailer};

use super::commit::CommitFigures;
use super::store::{GROUP_CHUNKS, PACK_CHUNKS};

/// Bytes of a pack trailer as stored: 16 per group, 37 per chunk (`pack_v2`).
pub const TRAILER_STORED: u64 = (PACK_CHUNKS / GROUP_CHUNKS) as u64 * 16 + PACK_CHUNKS as u64 * 37;
/// Bytes a decoded trailer costs in the reader's cache.
pub const TRAILER_HELD: u64 =
    PackTrailer::held_bytes(PACK_CHUNKS as u64, (PACK_CHUNKS / GROUP_CHUNKS) as u64);
/// Bytes of an index run section as stored.
pub const SECTION_STORED: u64 = (SECTION_ENTRIES * ENTRY_LEN) as u64;
/// Bytes of a section decoded in the reader's cache (`Vec<Entry>`, 16 bytes an entry).
pub const SECTION_HELD: u64 = (SECTION_ENTRIES * 16) as u64;
/// Bytes of a version 3 directory block as stored, and decoded (`Directory`).
pub const DIRECTORY_STORED: u64 = (BLOCK_SECTIONS * DIRECTORY_ENTRY_LEN) as u64;
pub const DIRECTORY_HELD: u64 = (BLOCK_SECTIONS * std::mem::size_of::<SectionRef>()) as u64;
/// Bytes of a version 3 pack block, stored and held alike.
pub const PACK_BLOCK: u64 = PACKS_PER_BLOCK as u64 * 32;
/// What a reader holds per version 3 pack block in a run's top level (`Piece::At`).
const PACK_BLOCK_REF: u64 = 48;

/// Bytes of a `hashbrown` map (std's `HashMap`) of `entries` entries of `size` bytes:
/// buckets at 7/8 load, rounded up to a power of two, and a control byte each.
pub fn map_bytes(entries: u64, size: usize) -> u64 {
    if entries == 0 {
        return 0;
    }
    let buckets = (entries * 8).div_ceil(7).next_power_of_two().max(4);
    buckets * (size as u64 + 1)
}

/// A commit process's dedup memory and the index bytes it reads, by part.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct CommitCost {
    /// The claims (`commit::claims::Claims`: id → placement of the chunks it stores), both
    /// generations, and the filters and fences of those exact mode spilled.
    pub claims: u64,
    /// What the claims would take if every one were kept in memory. Not in the total.
    pub claims_all_kept: u64,
    /// Decoded trailers of the packs the tiers asked for, within the trailer cache.
    pub trailers: u64,
    /// What every index run's top level holds (version 3: fence keys of its directory blocks
    /// and checksums of its pieces).
    pub index_meta: u64,
    /// What version 1–2 runs held instead (every section reference and the whole pack
    /// table): a reader's whole meta then. Not in the total.
    pub index_meta_whole: u64,
    /// Run filters held, within the filter budget.
    pub filters: u64,
    /// Index run pieces cached (sections, directory blocks, pack blocks), within the
    /// section cache.
    pub sections: u64,
    /// Index bytes read: run pieces and trailers (each lookup's pieces counted as read).
    pub read_bytes: u64,
}

impl CommitCost {
    pub fn total(&self) -> u64 {
        self.claims + self.trailers + self.index_meta + self.filters + self.sections
    }

    /// The cost of commit `f` against an index of `entries` entries over `packs` packs, with
    /// the limits of index memory budget `index_memory` (the whole index as one compacted
    /// run; a sampled hook index is counted by its own entries, see `main.rs`).
    pub fn of(f: &CommitFigures, entries: u64, packs: u64, index_memory: u64) -> CommitCost {
        let limits = CacheLimits::for_index_memory(index_memory);
        let filter_budget = limits.filter_bytes;
        let claim = CLAIM_BYTES;
        let sections = entries.div_ceil(SECTION_ENTRIES as u64);
        let blocks = sections.div_ceil(BLOCK_SECTIONS as u64);
        let pack_blocks = packs.div_ceil(u64::from(PACKS_PER_BLOCK));
        let filter_bits = (entries.max(1) * 10).next_power_of_two();
        let filter_all = filter_bits / 8;
        let filters = if filter_all <= filter_budget {
            filter_all
        } else {
            0
        };
        let lookups = f.hook_lookups + f.index_lookups;
        // With the filter held a lookup reads a section only where the key may be; without
        // it, every lookup reads the section its key falls in.
        let hits = f.hook_hits + f.index;
        let section_reads = if filters > 0 { hits } else { lookups };
        CommitCost {
            claims: map_bytes(f.claims_current, claim)
                + map_bytes(f.claims_previous, claim)
                + f.claims_spilled_bytes,
            claims_all_kept: map_bytes(f.stored, claim),
            trailers: (f.packs_asked * TRAILER_HELD).min(limits.trailer_bytes),
            index_meta: blocks * std::mem::size_of::<BlockRef>() as u64
                + pack_blocks * PACK_BLOCK_REF,
            index_meta_whole: sections * std::mem::size_of::<SectionRef>() as u64 + packs * 32,
            filters,
            sections: (section_reads * (SECTION_HELD + DIRECTORY_HELD + PACK_BLOCK))
                .min(limits.section_bytes),
            read_bytes: section_reads * (SECTION_STORED + DIRECTORY_STORED + PACK_BLOCK)
                + f.trailer_fetches * TRAILER_STORED,
        }
    }
}

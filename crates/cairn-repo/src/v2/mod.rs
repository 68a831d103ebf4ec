//! Reading format 2 objects: index runs, pack trailers and chunk groups, each read
//! in pieces with ranged reads and kept in a bounded cache, so a restore or an export decodes
//! a group once however many of its slots it reads, and a lookup costs one index section and
//! one pack trailer (both cached) rather than a whole index in memory.
//!
//! ```text
//! id ──index run: filter, fence keys, one section──▶ candidate packs (8-byte keys)
//!    ──pack trailer: full ids (checked)──────────▶ group (and slot)
//!    ──group: one ranged read, opened, every chunk hashed──▶ plain bytes
//! ```
//!
//! Nothing here trusts a byte it did not check: the trailer's checksum and (sealed) tag, the
//! group id recomputed from the descriptor, every chunk against its id at open. A format 2
//! repository's `Repo` holds one, with every index run added at open.
//!
//! A group copy that fails its check is quarantined (`crate::quarantine`): lookups skip it,
//! so a commit stores its chunks again, and a read of its slots takes another copy of the
//! group or, failing that, each slot's chunk from wherever else it is stored.

mod check;
mod filters;
mod groups;
mod merge;
mod packer;
mod pieces;
mod runs;
mod tail;
mod trailers;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cairn_format::crypto::{CryptoError, MasterKey};
use cairn_format::{FormatError, Id};
use cairn_store::ObjectStore;
use quick_cache::sync::Cache;
use quick_cache::Weighter;

pub use check::{rescuable_groups, PackCheck};
pub use filters::FILTER_AFTER_ASKS;
pub use groups::{joins_read, ranged_reads, OpenedGroup};
pub use merge::MergedRun;
pub use packer::{
    pack_capacity, FinishedPack, GroupPacker, OpenPack, PackBytes, Placement, Stager,
};
pub use runs::{GroupLocation, RunSize};
pub use trailers::{PackTrailer, SlotRef};

use crate::error::RepoError;

/// Bounds of the reader's caches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheLimits {
    /// Plain bytes of opened groups kept (a restore reads a group's slots in order, an
    /// export's read-ahead a few groups apart).
    pub group_bytes: u64,
    /// Approximate bytes of decoded pack trailers kept (about 240 KiB a full pack of 4 KiB
    /// chunks). A 64 GiB image's re-commit (bounded and exact) and restore took the same time
    /// with 8 MiB as with 32, and peaked 20 MiB lower (BENCHMARKS.md, *Studies behind the design*).
    pub trailer_bytes: u64,
    /// Bytes of index run pieces kept: sections (16 bytes an entry), directory blocks and
    /// blocks of pack tables.
    pub section_bytes: u64,
    /// Bytes of index run filters held (about 1.25–2.5 bytes an entry). Past it the largest
    /// runs' filters are dropped, and a lookup asks those runs through their fence keys: one
    /// section read (cached) instead of a probe in memory. Bounded dedup asks the index a
    /// few times a changed segment, so it barely notices; exact dedup asks once a new chunk.
    pub filter_bytes: u64,
}

/// What [`CacheLimits::default`] gives, once set (the CLI's `--index-memory`).
static PROCESS_LIMITS: std::sync::OnceLock<CacheLimits> = std::sync::OnceLock::new();

impl CacheLimits {
    /// The limits every reader of this process gets by default, set once at start (later
    /// calls are ignored; `false` then).
    pub fn set_process_default(limits: CacheLimits) -> bool {
        PROCESS_LIMITS.set(limits).is_ok()
    }

    /// The built-in limits: 64 MiB of groups, 8 of trailers, 2 of sections, 32 of filters
    /// (about 20 million index entries: 75 GiB of unique 4 KiB chunks with every filter
    /// held). Equal to [`CacheLimits::for_index_memory`] of 32 MiB. A budget of 64 (64 / 32
    /// / 8) made the trace benchmark's peak commit hold 40 MiB more at the same dedup, with
    /// no time gained; 8 MiB of sections read fewer sections in the same time and peaked
    /// higher (BENCHMARKS.md, *Studies behind the design*).
    pub const BUILT_IN: CacheLimits = CacheLimits {
        group_bytes: 64 << 20,
        trailer_bytes: 8 << 20,
        section_bytes: 2 << 20,
        filter_bytes: 32 << 20,
    };

    /// The limits for an index memory budget of `bytes` (the CLI's `--index-memory`): the
    /// filters get it whole, the pack trailers a quarter of it and the index pieces a
    /// sixteenth (the built-in proportions), at least 2 MiB and 1 MiB; the cache of opened
    /// groups is data, not index, and stays. So an operator who lowers the budget lowers
    /// every index cache: the trace benchmark showed the trailers and pieces at 40 of a
    /// 90 MiB peak when only the filters followed the flag. Trailers keep a quarter: a
    /// re-commit whose parent names groups all over the repository needs its working set of
    /// them (with 4 MiB a 64 GiB re-commit read 420 trailers instead of 170, and 1,900 with
    /// 3: twice the time).
    pub fn for_index_memory(bytes: u64) -> CacheLimits {
        CacheLimits {
            filter_bytes: bytes,
            trailer_bytes: (bytes / 4).max(2 << 20),
            section_bytes: (bytes / 16).max(1 << 20),
            ..CacheLimits::BUILT_IN
        }
    }

    /// These limits for a commit process: a sixteenth of the filter budget for trailers
    /// instead of a quarter (2 MiB by default, at least 1). A commit's workers hold the
    /// trailers their latest parent leaves used themselves (`RecentPacks`, a working set), so
    /// the cache only spares re-reads outside it; at a quarter it filled with the trailers of
    /// packs a re-commit had passed, 8–10 MiB of a 64 GiB re-commit's peak. Readers without
    /// such a set — restore, export, verify — keep the quarter: a restore of a version whose
    /// segments name groups of five packs each took 22 s instead of 13.5 with 2 MiB.
    pub fn for_commit(self) -> CacheLimits {
        CacheLimits {
            trailer_bytes: (self.filter_bytes / 16).max(1 << 20),
            ..self
        }
    }
}

impl Default for CacheLimits {
    fn default() -> Self {
        *PROCESS_LIMITS.get().unwrap_or(&CacheLimits::BUILT_IN)
    }
}

/// A cache weight: each value knows what it costs.
#[derive(Clone)]
struct ByCost;

/// Values whose memory a cache bounds.
trait Cost {
    fn cost(&self) -> u64;
}

impl<K, V: Cost> Weighter<K, Arc<V>> for ByCost {
    fn weight(&self, _key: &K, value: &Arc<V>) -> u64 {
        value.cost().max(1)
    }
}

type CostCache<K, V> = Cache<K, Arc<V>, ByCost>;

fn cost_cache<K: Eq + std::hash::Hash, V: Cost>(bytes: u64, typical: u64) -> CostCache<K, V> {
    Cache::with_weighter((bytes / typical).max(16) as usize, bytes, ByCost)
}

/// Reads v2 objects of one repository (plain when `key` is `None`, sealed otherwise).
pub struct V2Reader {
    store: Arc<dyn ObjectStore>,
    key: Option<MasterKey>,
    trailers: CostCache<Id, PackTrailer>,
    /// Trailers held outside the cache, found again without a read.
    held_trailers: trailers::HeldTrailers,
    groups: CostCache<(Id, u32), OpenedGroup>,
    /// Pieces of index runs: sections, directory blocks, pack blocks.
    pieces: CostCache<(Id, pieces::PieceKey), pieces::RunPiece>,
    runs: std::sync::RwLock<Vec<Arc<runs::OpenRun>>>,
    /// [`CacheLimits::filter_bytes`].
    filter_budget: u64,
    /// [`CacheLimits::section_bytes`].
    section_budget: u64,
    fetched: FetchCounters,
    /// Group copies found damaged (by any reader of this repository, or an earlier process):
    /// never read or deduplicated against.
    quarantine: Arc<crate::quarantine::QuarantineBook>,
    /// An index run, or a piece of one, was found damaged: what only it located may be
    /// unlocatable, so nothing is taken as stored on trust (see `has_quarantined_copy`).
    index_damaged: std::sync::atomic::AtomicBool,
    /// The packs layout markers name (`crate::layout`), listed the first time a lookup meets
    /// a group stored more than once, and those this process marked since.
    layout: tokio::sync::OnceCell<std::sync::RwLock<std::collections::HashMap<Id, u64>>>,
}

impl std::fmt::Debug for V2Reader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("V2Reader")
            .field("store", &self.store.describe())
            .field("sealed", &self.key.is_some())
            .field("runs", &self.runs.read().expect("runs lock").len())
            .finish()
    }
}

/// How many objects or pieces of objects the reader fetched from the store (each cache
/// miss is one fetch: concurrent misses of one key wait for a single fetch).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Fetches {
    pub groups: u64,
    /// Stored bytes of the groups fetched.
    pub group_bytes: u64,
    pub trailers: u64,
    pub sections: u64,
}

#[derive(Debug, Default)]
struct FetchCounters {
    groups: AtomicU64,
    group_bytes: AtomicU64,
    trailers: AtomicU64,
    sections: AtomicU64,
}

impl V2Reader {
    pub(crate) fn new(
        store: Arc<dyn ObjectStore>,
        key: Option<MasterKey>,
        limits: CacheLimits,
        quarantine: Arc<crate::quarantine::QuarantineBook>,
    ) -> V2Reader {
        V2Reader {
            store,
            key,
            trailers: cost_cache(limits.trailer_bytes, 256 << 10),
            held_trailers: trailers::HeldTrailers::default(),
            groups: cost_cache(limits.group_bytes, 64 << 10),
            pieces: cost_cache(limits.section_bytes, 4 << 10),
            runs: std::sync::RwLock::new(Vec::new()),
            filter_budget: limits.filter_bytes,
            section_budget: limits.section_bytes,
            fetched: FetchCounters::default(),
            quarantine,
            index_damaged: Default::default(),
            layout: Default::default(),
        }
    }

    /// What the reader fetched from the store so far.
    pub fn fetches(&self) -> Fetches {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Fetches {
            groups: n(&self.fetched.groups),
            group_bytes: n(&self.fetched.group_bytes),
            trailers: n(&self.fetched.trailers),
            sections: n(&self.fetched.sections),
        }
    }

    fn key(&self) -> Option<&MasterKey> {
        self.key.as_ref()
    }
}

/// A v2 decoder's error as a repository error naming the object: damage is
/// [`RepoError::Corrupt`] (so `is_damage` sees it), a failed tag included.
pub(crate) fn sealed_error(key: impl Into<String>, e: CryptoError) -> RepoError {
    let source = match e {
        CryptoError::Format(f) => f,
        CryptoError::Tampered { what } => FormatError::invalid(
            what,
            "authentication failed (tampered, corrupt, or sealed with another key)",
        ),
        CryptoError::WrongPassphrase => return RepoError::internal("unsealing", e),
    };
    RepoError::corrupt(key, source)
}

#[cfg(test)]
mod tests {
    use super::CacheLimits;

    #[test]
    fn the_index_budget_scales_every_index_cache_and_its_default_is_the_built_in() {
        assert_eq!(
            CacheLimits::for_index_memory(32 << 20),
            CacheLimits::BUILT_IN
        );
        let small = CacheLimits::for_index_memory(16 << 20);
        assert_eq!(
            (small.filter_bytes, small.trailer_bytes, small.section_bytes),
            (16 << 20, 4 << 20, 1 << 20)
        );
        assert_eq!(small.group_bytes, CacheLimits::BUILT_IN.group_bytes);
        let none = CacheLimits::for_index_memory(0);
        assert_eq!(
            (none.filter_bytes, none.trailer_bytes, none.section_bytes),
            (0, 2 << 20, 1 << 20)
        );
    }

    /// A commit keeps a sixteenth of the budget for trailers (its workers hold their own
    /// working set), at least 1 MiB, and every other limit as it was.
    #[test]
    fn a_commit_keeps_fewer_trailers_and_every_other_limit() {
        for (budget, trailers) in [(32 << 20, 2 << 20), (64 << 20, 4 << 20), (8 << 20, 1 << 20)] {
            let limits = CacheLimits::for_index_memory(budget);
            assert_eq!(
                limits.for_commit(),
                CacheLimits {
                    trailer_bytes: trailers,
                    ..limits
                }
            );
        }
    }
}

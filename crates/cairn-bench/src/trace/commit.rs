//! One simulated commit: a VM's disk at a snapshot, driven through the engine's own dedup
//! tiers ([`search_similar`] with [`SimilarPacks`], after the parent's same segment) and the
//! commit's claims, as `commit/dedup` and `commit/pipeline.rs` do with real chunks.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::sync::Arc;

use cairn_engine::commit::claims::{Claimed, Claims, BOUNDED_SPILL_MEMORY};
use cairn_engine::commit::dedup::similar::{search_similar, SimilarPacks, SimilarSource};
use cairn_engine::commit::{DedupMode, DedupTally};
use cairn_format::Id;
use cairn_repo::v2::Placement;

use super::fleet::{chunk_id, origin_of, FirstSeen, Vm, SEGMENT_CHUNKS};
use super::store::{PackBuilder, Store, TracePack};

/// What one commit did.
#[derive(Debug, Default, Clone, serde::Serialize)]
pub struct CommitFigures {
    /// Slots of the disk (its virtual size in chunks).
    pub raw_chunks: u64,
    /// Slots holding data.
    pub data_chunks: u64,
    /// Segments that went through the tiers (the rest took the digest fast path).
    pub changed_segments: u64,
    /// Data chunks in those segments.
    pub changed_chunks: u64,
    pub parent: u64,
    pub similar: u64,
    pub index: u64,
    pub hook_lookups: u64,
    /// Hooks whose pack the index located.
    pub hook_hits: u64,
    /// Index lookups of exact mode's tier 3.
    pub index_lookups: u64,
    /// Chunks the commit stored once and referred to again.
    pub within_commit: u64,
    /// Chunks the commit stored.
    pub stored: u64,
    /// Chunks exact dedup would store (seen for the first time).
    pub exact_new: u64,
    /// Distinct packs whose trailers the tiers asked for.
    pub packs_asked: u64,
    /// Trailers a reader whose cache holds `trailer_slots` of them would fetch.
    pub trailer_fetches: u64,
    /// Most claims the newer and the older generation held.
    pub claims_current: u64,
    pub claims_previous: u64,
    /// Memory of the claims exact mode spilled (their runs' filters and fences), at most.
    pub claims_spilled_bytes: u64,
}

/// The similar tier's view of a simulated commit.
struct TraceSource<'a> {
    store: &'a Store,
    claims: &'a Claims,
    asked: &'a RefCell<TrailerCache>,
    /// Hooks at or above this key are not in the sampled index: not asked.
    sampled_below: u64,
    lookups: &'a Cell<u64>,
    hook_hits: &'a Cell<u64>,
    hooks: usize,
}

impl SimilarSource for TraceSource<'_> {
    type Pack = TracePack;
    type Error = Infallible;

    fn stored_by_this_commit(&self, id: &Id) -> bool {
        self.claims.contains(id)
    }

    fn hook_pack(&self, id: &Id) -> Result<Option<Arc<TracePack>>, Infallible> {
        if id.prefix_u64() >= self.sampled_below {
            return Ok(None);
        }
        self.lookups.set(self.lookups.get() + 1);
        let pack = self.store.locate(origin_of(id));
        if let Some(p) = &pack {
            self.hook_hits.set(self.hook_hits.get() + 1);
            self.asked.borrow_mut().ask(p.number);
        }
        Ok(pack)
    }

    fn good_copy(&self, _pack: &Id, _group: &Id) -> bool {
        true
    }

    fn hooks(&self) -> usize {
        self.hooks
    }
}

/// The reader's trailer cache as a least-recently-used set of packs: what it would fetch.
struct TrailerCache {
    capacity: usize,
    held: HashMap<u32, u64>,
    clock: u64,
    fetches: u64,
    distinct: HashSet<u32>,
}

impl TrailerCache {
    fn new(capacity: usize) -> TrailerCache {
        TrailerCache {
            capacity: capacity.max(1),
            held: HashMap::new(),
            clock: 0,
            fetches: 0,
            distinct: HashSet::new(),
        }
    }

    fn ask(&mut self, pack: u32) {
        self.clock += 1;
        self.distinct.insert(pack);
        if self.held.insert(pack, self.clock).is_none() {
            self.fetches += 1;
            if self.held.len() > self.capacity {
                let (&oldest, _) = self.held.iter().min_by_key(|(_, &t)| t).expect("held");
                self.held.remove(&oldest);
            }
        }
    }
}

/// How a simulated commit runs.
#[derive(Debug, Clone, Copy)]
pub struct CommitSettings {
    pub mode: DedupMode,
    /// Trailers the reader's cache holds.
    pub trailer_slots: usize,
    /// Claims a generation keeps (`None`: all), as `CommitOptions::claim_generation`: the
    /// older generation is spilled to scratch files, as cairn does; in bounded mode within
    /// `claims::BOUNDED_SPILL_MEMORY`, past which a forgotten claim costs a duplicate if the
    /// chunk comes again in the same commit.
    pub claims_generation: Option<usize>,
    /// Only keys below `u64::MAX / hook_sample` are in the index the hooks ask (a sampled
    /// hook index, as in sparse indexing); 1 asks the whole index, as cairn does today.
    pub hook_sample: u64,
    /// Hooks a segment looks up at most (cairn: `similar::HOOKS`).
    pub hooks: usize,
}

/// Commits `vm`'s disk as it is now: its parent is the snapshot before (`vm.before` holds the
/// segments changed since), none for the first. Stores what the tiers and the claims leave
/// into new packs and publishes them.
pub fn commit(
    vm: &Vm,
    first: bool,
    settings: CommitSettings,
    store: &mut Store,
    seen: &mut FirstSeen,
) -> CommitFigures {
    let CommitSettings {
        mode,
        trailer_slots,
        claims_generation,
        hook_sample,
        hooks,
    } = settings;
    let mut fig = CommitFigures {
        raw_chunks: vm.disk.len() as u64,
        ..CommitFigures::default()
    };
    let mut claims = match (mode, claims_generation) {
        (DedupMode::Exact, Some(g)) => Claims::spilling(g, None, None),
        (DedupMode::Bounded, Some(g)) => Claims::spilling(g, None, Some(BOUNDED_SPILL_MEMORY)),
        (_, None) => Claims::keeping_all(),
    };
    let mut packs = vec![PackBuilder::default()];
    let mut tally = DedupTally::default();
    let mut similar = SimilarPacks::default();
    let asked = RefCell::new(TrailerCache::new(trailer_slots));
    let hook_hits = Cell::new(0);
    let lookups = Cell::new(0);
    let sampled_below = if hook_sample > 1 {
        u64::MAX / hook_sample
    } else {
        u64::MAX
    };
    let segments = vm.disk.len().div_ceil(SEGMENT_CHUNKS);
    for seg in 0..segments {
        let start = seg * SEGMENT_CHUNKS;
        let slots = &vm.disk[start..(start + SEGMENT_CHUNKS).min(vm.disk.len())];
        let data = slots.iter().filter(|&&c| c != 0).count() as u64;
        fig.data_chunks += data;
        let parent = vm.before.get(&seg);
        if (!first && parent.is_none()) || data == 0 {
            // Unchanged since the parent (its digest matches) or all zeros.
            continue;
        }
        fig.changed_segments += 1;
        fig.changed_chunks += data;
        let ids: Vec<Option<Id>> = slots
            .iter()
            .map(|&c| (c != 0).then(|| chunk_id(c)))
            .collect();
        let mut found: Vec<Option<Placement>> = vec![None; ids.len()];
        // Tier 1: the parent's leaf of the same segment.
        if let Some(before) = parent.filter(|_| !first) {
            let near: HashSet<u64> = before.iter().copied().filter(|&c| c != 0).collect();
            for (f, &c) in found.iter_mut().zip(slots) {
                if c != 0 && near.contains(&c) {
                    *f = Some(Placement {
                        group: Id::ZERO,
                        slot: 0,
                    });
                    tally.parent += 1;
                }
            }
        }
        // Tier 2: similar packs, through the engine's own search.
        let source = TraceSource {
            store,
            claims: &claims,
            asked: &asked,
            sampled_below,
            lookups: &lookups,
            hook_hits: &hook_hits,
            hooks,
        };
        let Ok(()) = search_similar(&source, &mut similar, &ids, &mut found, &mut tally);
        // Tier 3 (exact mode) and the claims, as `GroupDedup::claim`.
        for (f, &c) in found.iter().zip(slots) {
            if c == 0 {
                continue;
            }
            if seen.first(c) {
                fig.exact_new += 1;
            }
            if f.is_some() {
                continue;
            }
            let id = chunk_id(c);
            let turns = claims.turns();
            let claimed = claims.contains(&id);
            if mode == DedupMode::Exact && !claimed {
                fig.index_lookups += 1;
                if store.locate(c).is_some() {
                    tally.index += 1;
                    continue;
                }
            }
            if claimed || matches!(claims.claim_after_miss(&id, turns), Claimed::Before(_)) {
                fig.within_commit += 1;
                continue;
            }
            let (current, previous) = claims.held();
            fig.claims_current = fig.claims_current.max(current as u64);
            fig.claims_previous = fig.claims_previous.max(previous as u64);
            fig.claims_spilled_bytes = fig.claims_spilled_bytes.max(claims.spilled().1 as u64);
            // Placed at once: one worker, its group built as the chunk is stored.
            claims.place(&[id], Id::ZERO);
            let pack = packs.last_mut().expect("a pack");
            pack.push(c);
            if pack.is_full() {
                packs.push(PackBuilder::default());
            }
            fig.stored += 1;
        }
    }
    packs.retain(|p| p.chunks > 0);
    store.publish(packs);
    fig.parent = tally.parent;
    fig.similar = tally.similar;
    fig.index = tally.index;
    // The lookups the index answered (a sampled index is not asked for keys it lacks).
    fig.hook_lookups = lookups.get();
    fig.hook_hits = hook_hits.get();
    let asked = asked.into_inner();
    fig.packs_asked = asked.distinct.len() as u64;
    fig.trailer_fetches = asked.fetches;
    fig
}

//! Where a changed segment's chunks are stored already, before this commit: the VM-centric
//! paper's tiers (`002_…` §3.1), cheapest first.
//!
//! 1. The parent's leaf of the same segment (`parent_chunks`): one leaf read, and a
//!    hash-map probe a chunk.
//! 2. Similar data (`similar`): the packs that held chunks of this worker's recent
//!    segments, then the packs of the segment's *hooks* — the few smallest keys among the
//!    chunks still not found, looked up in the index. A pack's trailer names every chunk
//!    stored beside the hook (the same commit's neighbouring segments), so data that moved,
//!    a clone's files or another image's copy of them are found with a few lookups a
//!    segment.
//! 3. Exact mode only: the index, once for each chunk still not found (`GroupDedup::claim`).
//!
//! Bounded mode stops after tier 2. A chunk the tiers miss is stored again (a duplicate that
//! costs space, never correctness), and a changed segment costs a few index lookups (four
//! for new data, at most `similar::MAX_HOOKS` while hooks keep finding packs) instead of
//! one per chunk: what the index reader must answer no longer
//! grows with the data committed. Which mode stores what is measured in
//! BENCHMARKS.md (*Dedup tiers*).
//!
//! Every chunk found here is in the new version's reference summary, which the stale-GC guard
//! checks, as the index path's are.

mod parent_chunks;
pub mod similar;

use std::sync::Arc;

use cairn_format::Id;
use cairn_repo::v2::{PackTrailer, Placement};

use super::parent::ParentLeaves;
use super::pipeline::GroupDedup;
use crate::error::{EngineError, EngineResult};
use parent_chunks::{ParentChunks, RecentPacks};
use similar::{SimilarPacks, SimilarSource};

/// How hard a commit looks for chunks stored before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DedupMode {
    /// Every tier, then the index for each chunk still not found: nothing stored twice.
    Exact,
    /// The parent's leaf and similar packs only: at most a few index lookups a segment.
    Bounded,
}

/// The environment variable that sets a process's default mode (`exact` or `bounded`).
pub const DEDUP_ENV: &str = "CAIRN_DEDUP";

impl DedupMode {
    /// `exact` or `bounded`.
    pub fn parse(s: &str) -> Option<DedupMode> {
        match s {
            "exact" => Some(DedupMode::Exact),
            "bounded" => Some(DedupMode::Bounded),
            _ => None,
        }
    }

    /// The mode [`DEDUP_ENV`] names, `Ok(None)` when it is not set, or the value it holds
    /// when that is not a mode (the CLI refuses it before doing anything).
    pub fn from_env() -> Result<Option<DedupMode>, String> {
        match std::env::var(DEDUP_ENV) {
            Ok(v) => DedupMode::parse(&v).map(Some).ok_or(v),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(v)) => Err(v.to_string_lossy().into_owned()),
        }
    }
}

impl Default for DedupMode {
    /// [`DEDUP_ENV`] when it names a mode, bounded otherwise. One setting for every commit of
    /// a process, including those that have no flag of their own (an export's COMMIT,
    /// `cairn copy`), and the way the test suite runs every test again in exact mode.
    fn default() -> Self {
        static PROCESS: std::sync::OnceLock<DedupMode> = std::sync::OnceLock::new();
        *PROCESS.get_or_init(|| match DedupMode::from_env() {
            Ok(mode) => mode.unwrap_or(DedupMode::Bounded),
            Err(v) => {
                tracing::warn!("{DEDUP_ENV}={v:?} is not exact or bounded; using bounded");
                DedupMode::Bounded
            }
        })
    }
}

/// What each tier found, in chunk occurrences (a commit's figures, summed over its workers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DedupTally {
    /// Found in the parent's leaf of the same segment.
    pub parent: u64,
    /// Found in the packs of recent segments or of the segment's hooks.
    pub similar: u64,
    /// Found by an index lookup of their own (exact mode).
    pub index: u64,
    /// Hooks looked up in the index.
    pub hook_lookups: u64,
}

impl DedupTally {
    pub fn add(&mut self, other: &DedupTally) {
        self.parent += other.parent;
        self.similar += other.similar;
        self.index += other.index;
        self.hook_lookups += other.hook_lookups;
    }
}

/// One worker's tiers: the shared claims of the commit, the parent's leaves, and the packs its
/// recent segments used.
pub(in crate::commit) struct SegmentDedup<'a> {
    shared: &'a GroupDedup<'a>,
    parent: &'a ParentLeaves,
    pub(in crate::commit) mode: DedupMode,
    similar: SimilarPacks<PackTrailer>,
    /// Where this worker found its latest parent groups.
    parent_packs: RecentPacks,
    pub(in crate::commit) tally: DedupTally,
}

impl<'a> SegmentDedup<'a> {
    pub(in crate::commit) fn new(
        shared: &'a GroupDedup<'a>,
        parent: &'a ParentLeaves,
        mode: DedupMode,
    ) -> SegmentDedup<'a> {
        SegmentDedup {
            shared,
            parent,
            mode,
            similar: SimilarPacks::default(),
            parent_packs: RecentPacks::default(),
            tally: DedupTally::default(),
        }
    }

    /// Where tiers 1 and 2 find each chunk of segment `index` (`ids`, `None` for a chunk of
    /// zeros); `None` where they do not (the caller claims it, asking the index in exact
    /// mode).
    pub(in crate::commit) fn locate(
        &mut self,
        index: u64,
        ids: &[Option<Id>],
    ) -> EngineResult<Vec<Option<Placement>>> {
        let mut found = vec![None; ids.len()];
        if ids.iter().all(Option::is_none) {
            return Ok(found);
        }
        let reader = self.shared.reader;
        let near = match self.parent.at_segment(index) {
            Some(leaf) => {
                let recent = &mut self.parent_packs;
                self.shared.ask(ParentChunks::load(reader, leaf, recent))?
            }
            None => ParentChunks::default(),
        };
        for (f, id) in found.iter_mut().zip(ids) {
            if let Some(p) = id.as_ref().and_then(|id| near.get(id)) {
                *f = Some(p);
                self.tally.parent += 1;
            }
        }
        similar::search_similar(
            &CommitPacks(self.shared),
            &mut self.similar,
            ids,
            &mut found,
            &mut self.tally,
        )?;
        Ok(found)
    }
}

/// The similar tier's view of a commit: its claims, the index and the quarantine.
struct CommitPacks<'a>(&'a GroupDedup<'a>);

impl SimilarSource for CommitPacks<'_> {
    type Pack = PackTrailer;
    type Error = EngineError;

    fn stored_by_this_commit(&self, id: &Id) -> bool {
        self.0.is_claimed(id)
    }

    fn hook_pack(&self, id: &Id) -> EngineResult<Option<Arc<PackTrailer>>> {
        self.0.ask(similar::hook_pack(self.0.reader, id))
    }

    fn good_copy(&self, pack: &Id, group: &Id) -> bool {
        !self.0.reader.is_quarantined_copy(pack, group)
    }
}

//! Index runs, read in pieces: a run's top level (fence keys of its directory blocks, the
//! checksums of its pieces) once when it is added, and its filter while the budget holds it
//! (`filters`: a large run's only once the run is asked often); then only the pieces a
//! lookup falls in (`pieces`). A lookup asks the runs newest first; an
//! entry is a candidate pack, accepted only when the pack's trailer holds the full id — so an
//! 8-byte key collision costs a trailer read, never a wrong answer.

use std::collections::HashMap;
use std::sync::Arc;

use bytes::Bytes;
use cairn_format::group::GroupChunk;
use cairn_format::index_run::{self, RunMeta, FOOTER_LEN, HEADER_LEN};
use cairn_format::summary::Bloom;
use cairn_format::{keys, FormatError, Id};

use super::groups::OpenedGroup;
use super::tail::{get_whole, HeadAndTail};
use super::trailers::{PackTrailer, SlotRef};
use super::{sealed_error, V2Reader};
use crate::error::{RepoError, RepoResult};

/// How much of a run's end the first read fetches: a version 3 top level (60 bytes a
/// directory block) and the filter before it for runs of up to ~50,000 entries; a version
/// 1–2 meta (32 bytes a pack, 52 a section, and the filter).
const TAIL_GUESS: u64 = 64 << 10;

/// A run whose meta was read and checked.
#[derive(Debug)]
pub(super) struct OpenRun {
    pub(super) id: Id,
    pub(super) key: String,
    /// The meta (version 3: the top level), its filter taken out (`filter`).
    pub(super) meta: RunMeta,
    pub(super) len: u64,
    /// The run's filter while the reader's budget holds it (`None`: dropped, every id is
    /// asked through the fence keys).
    pub(super) filter: std::sync::RwLock<Option<Bloom>>,
    /// Whether the filter is stored apart and not read yet, the run having been asked fewer
    /// than [`super::FILTER_AFTER_ASKS`] times (`asks`).
    pub(super) deferred: std::sync::atomic::AtomicBool,
    pub(super) asks: std::sync::atomic::AtomicU64,
    /// The run's sections, and how many this reader read (see `pieces::read_ahead`).
    pub(super) section_count: u64,
    pub(super) sections_read: std::sync::atomic::AtomicU64,
}

impl OpenRun {
    /// Whether the held filter lets `id` through (every id passes a run without one).
    fn filter_passes(&self, id: &Id) -> bool {
        match &*self.filter.read().expect("filter lock") {
            Some(f) => self.meta.filter_passes(f, id),
            None => true,
        }
    }

    /// Whether the held filter lets an 8-byte `key` through (a version 1 run's filter hashes
    /// full ids, so every key passes it).
    fn filter_passes_key(&self, key: u64) -> bool {
        match (
            &*self.filter.read().expect("filter lock"),
            self.meta.version,
        ) {
            (Some(f), 2..) => f.contains_probe(cairn_format::summary::ProbeKey::of_key(key)),
            _ => true,
        }
    }

    pub(super) fn is_deferred(&self) -> bool {
        self.deferred.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(super) fn filter_bytes(&self) -> u64 {
        self.filter
            .read()
            .expect("filter lock")
            .as_ref()
            .map_or(0, |f| f.byte_len() as u64)
    }
}

/// What compaction needs to know of a run: how many entries it holds and its version.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunSize {
    pub id: Id,
    pub entries: u64,
    pub version: u32,
    /// The run's stored bytes.
    pub len: u64,
}

/// Where a group is: its pack's trailer and its position there.
#[derive(Debug, Clone)]
pub struct GroupLocation {
    pub trailer: Arc<PackTrailer>,
    pub group: u32,
}

impl GroupLocation {
    /// The group's id (a hash of its slot list, as a leaf names it).
    pub fn id(&self) -> Id {
        self.trailer
            .group_id(self.group)
            .expect("a location names a group of its trailer")
    }

    /// The chunks slots `first .. first + count` hold (as this copy's descriptor lists them,
    /// stored or not); a run past the group's end is an error naming the group.
    pub fn run_chunks(&self, first: u16, count: u16) -> RepoResult<&[GroupChunk]> {
        let desc = &self.trailer.groups[self.group as usize].desc;
        let slots = usize::from(first)..usize::from(first) + usize::from(count);
        desc.chunks
            .get(slots)
            .filter(|c| !c.is_empty())
            .ok_or_else(|| {
                RepoError::corrupt(
                    format!("{} group {}", keys::pack(&self.trailer.pack), self.group),
                    FormatError::invalid(
                        "group",
                        format!(
                            "slots {first}..{} of a group of {}",
                            u32::from(first) + u32::from(count),
                            desc.chunks.len()
                        ),
                    ),
                )
            })
    }

    /// Whether this copy of the group stores every slot of `wanted` (first, count).
    pub fn stores(&self, wanted: &[(u16, u16)]) -> bool {
        let desc = &self.trailer.groups[self.group as usize].desc;
        wanted.iter().all(|&(first, count)| {
            let r = usize::from(first)..usize::from(first) + usize::from(count);
            desc.chunks
                .get(r)
                .is_some_and(|s| s.iter().all(|c| c.stored))
        })
    }

    /// Slots `first .. first + count` of `opened` (this group, opened); an error names the
    /// group.
    pub fn slots(&self, opened: &OpenedGroup, first: u16, count: u16) -> RepoResult<Bytes> {
        opened
            .slots(usize::from(first), usize::from(count))
            .map_err(|e| {
                RepoError::corrupt(
                    format!("{} group {}", keys::pack(&self.trailer.pack), self.group),
                    e,
                )
            })
    }
}

impl V2Reader {
    /// Reads and checks the meta of run `id` and adds it to the runs lookups ask (newest
    /// last: lookups ask the last added first).
    pub async fn add_run(&self, id: &Id) -> RepoResult<()> {
        if self
            .runs
            .read()
            .expect("runs lock")
            .iter()
            .any(|r| r.id == *id)
        {
            return Ok(());
        }
        let key = keys::index_run(id);
        let store = &*self.store;
        let Some(obj) =
            HeadAndTail::read(store, &key, HEADER_LEN, HEADER_LEN + FOOTER_LEN, TAIL_GUESS).await?
        else {
            // Listed, then gone: a GC superseded and deleted it (its replacement is listed
            // too, since GC writes it first).
            tracing::debug!("index run {key} vanished; skipped");
            return Ok(());
        };
        let footer_at = obj.len - FOOTER_LEN as u64;
        let footer = obj.bytes(store, &key, footer_at..obj.len).await?;
        let footer = index_run::parse_footer(&footer).map_err(|e| sealed_error(&key, e))?;
        let meta_start = footer_at
            .checked_sub(u64::from(footer.meta_len))
            .filter(|s| *s >= HEADER_LEN as u64)
            .ok_or_else(|| {
                RepoError::corrupt(
                    &key,
                    FormatError::invalid("index run", "meta longer than the run"),
                )
            })?;
        let stored_meta = obj.bytes(store, &key, meta_start..footer_at).await?;
        let mut meta = index_run::parse_meta(obj.len, &obj.head, &footer, &stored_meta, self.key())
            .map_err(|e| sealed_error(&key, e))?;
        if meta.sealed != self.key.is_some() {
            return Err(RepoError::corrupt(
                &key,
                FormatError::invalid(
                    "index run",
                    "sealed or not, unlike the repository's other objects",
                ),
            ));
        }
        let mut deferred = false;
        let filter = match (meta.filter.take(), meta.filter_at.clone()) {
            (Some(f), _) => Some(f),
            // Read with the top level already: free to open.
            (None, Some(at)) if at.range.start >= obj.tail_start => {
                if self.filter_fits(at.range.end - at.range.start) {
                    let stored = obj.bytes(store, &key, at.range).await?;
                    Some(
                        meta.open_filter(&stored, self.key())
                            .map_err(|e| sealed_error(format!("{key} filter"), e))?,
                    )
                } else {
                    None
                }
            }
            (None, Some(_)) => {
                deferred = true;
                None
            }
            (None, None) => None,
        };
        let mut runs = self.runs.write().expect("runs lock");
        runs.push(Arc::new(OpenRun {
            id: *id,
            key,
            section_count: meta.section_count(),
            meta,
            len: obj.len,
            filter: std::sync::RwLock::new(filter),
            deferred: deferred.into(),
            asks: Default::default(),
            sections_read: Default::default(),
        }));
        self.keep_filter_budget(&runs);
        Ok(())
    }

    /// Bytes of run metadata this reader holds whatever it looks up: every run's top level
    /// (for version 1–2 runs, their whole section and pack tables), filters apart.
    pub fn meta_memory(&self) -> u64 {
        let runs = self.runs.read().expect("runs lock");
        runs.iter().map(|r| r.meta.cost()).sum()
    }

    /// Adds the runs `ids` ([`Self::add_run`]); a damaged run is skipped and its error
    /// returned as a line (one that vanished since it was listed was superseded and deleted by
    /// a GC, and is skipped), an unreachable store fails the call.
    pub async fn add_runs(&self, ids: &[Id]) -> RepoResult<Vec<String>> {
        let mut damaged = Vec::new();
        for id in ids {
            match self.add_run(id).await {
                Ok(()) => {}
                Err(e) if e.is_damage() => {
                    self.note_index_damage();
                    damaged.push(e.to_string());
                }
                Err(e) => return Err(e),
            }
        }
        Ok(damaged)
    }

    /// Forgets every run not in `keep` (superseded by a GC since it was added).
    pub fn retain_runs(&self, keep: &[Id]) {
        self.runs
            .write()
            .expect("runs lock")
            .retain(|r| keep.contains(&r.id));
    }

    /// The size of every run lookups ask, oldest first.
    pub fn run_sizes(&self) -> Vec<RunSize> {
        let runs = self.runs.read().expect("runs lock");
        runs.iter()
            .map(|r| RunSize {
                id: r.id,
                entries: r.meta.entries,
                version: r.meta.version,
                len: r.len,
            })
            .collect()
    }

    /// The runs lookups ask, oldest first.
    pub fn run_ids(&self) -> Vec<Id> {
        let runs = self.runs.read().expect("runs lock");
        runs.iter().map(|r| r.id).collect()
    }

    /// Every pack an index run names (what GC and repair keep), sorted. A pack table that
    /// cannot be read fails the call: a caller that deletes what no run names must never take
    /// a damaged table for an empty one.
    pub async fn packs(&self) -> RepoResult<Vec<Id>> {
        self.collect_packs(false).await
    }

    /// Every pack the runs whose pack tables can be read name, sorted (what a verify checks:
    /// a damaged table is reported by [`Self::check_runs`]). An error of the store fails it.
    pub async fn readable_packs(&self) -> RepoResult<Vec<Id>> {
        self.collect_packs(true).await
    }

    /// Every pack an index run names, with the position of the first run (in this reader's
    /// order) that names it: packs one commit wrote share a position until a merge of runs
    /// (GC's choice among copies of a group keeps one commit's packs whole). Fails like
    /// [`Self::packs`] on a damaged pack table.
    pub async fn packs_by_run(&self) -> RepoResult<HashMap<Id, usize>> {
        let runs: Vec<Arc<OpenRun>> = self.runs.read().expect("runs lock").clone();
        let mut packs = HashMap::new();
        for (position, run) in runs.iter().enumerate() {
            for pack in self.run_packs(run).await? {
                packs.entry(pack).or_insert(position);
            }
        }
        Ok(packs)
    }

    async fn collect_packs(&self, skip_damaged: bool) -> RepoResult<Vec<Id>> {
        let runs: Vec<Arc<OpenRun>> = self.runs.read().expect("runs lock").clone();
        let mut packs = Vec::new();
        for run in &runs {
            match self.run_packs(run).await {
                Ok(table) => packs.extend(table),
                Err(e) if skip_damaged && e.is_damage() => tracing::debug!("{e}"),
                Err(e) => return Err(e),
            }
        }
        packs.sort_unstable();
        packs.dedup();
        Ok(packs)
    }

    /// Every pack a run names for the 8-byte `key` (what GC looks up for the keys of a
    /// reference summary), sorted. A version 1 run's filter hashes full ids, so it is asked
    /// through its fence keys. A piece that cannot be read fails the call.
    pub async fn packs_for_key(&self, key: u64) -> RepoResult<Vec<Id>> {
        let runs: Vec<Arc<OpenRun>> = self.runs.read().expect("runs lock").clone();
        let mut packs = Vec::new();
        for run in &runs {
            self.filter_when_asked(run).await?;
            if run.filter_passes_key(key) {
                packs.extend(self.run_candidates(run, key).await?);
            }
        }
        packs.sort_unstable();
        packs.dedup();
        Ok(packs)
    }

    /// The packs the runs name for `id` (candidates), newest run first, without repeats.
    async fn candidates(&self, id: &Id) -> RepoResult<Vec<Id>> {
        let runs: Vec<Arc<OpenRun>> = self.runs.read().expect("runs lock").clone();
        let mut packs = Vec::new();
        // A damaged section fails only the lookups no other run answers: damage in one
        // commit's run never spreads to ids that other runs locate.
        let mut damage = None;
        for run in runs.iter().rev() {
            self.filter_when_asked(run).await?;
            if !run.filter_passes(id) {
                continue;
            }
            let found = match self.run_candidates(run, index_run::key_of(id)).await {
                Ok(found) => found,
                Err(e) if e.is_damage() => {
                    self.note_index_damage();
                    damage.get_or_insert(e);
                    continue;
                }
                // Deleted since this reader added it: a GC or a compaction superseded it and
                // did not wait for this reader (an export). Forgotten; what it located is in
                // its replacement, which the caller's refresh (`Repo::refresh_index`) adds.
                Err(e) if e.is_not_found() => {
                    tracing::debug!("index run {} vanished; forgotten", run.key);
                    self.runs
                        .write()
                        .expect("runs lock")
                        .retain(|r| r.id != run.id);
                    continue;
                }
                Err(e) => return Err(e),
            };
            for pack in found {
                if !packs.contains(&pack) {
                    packs.push(pack);
                }
            }
        }
        match damage {
            Some(e) if packs.is_empty() => Err(e),
            _ => Ok(packs),
        }
    }

    /// Reads every index run this reader uses whole and checks every section (what `verify`
    /// does); returns one line per damaged run.
    pub async fn check_runs(&self) -> RepoResult<Vec<String>> {
        let runs: Vec<Id> = self.run_ids();
        let mut problems = Vec::new();
        for run in runs {
            problems.extend(self.check_run(&run).await?);
        }
        Ok(problems)
    }

    /// Reads index run `id` whole and checks it, every section included: `None` if it is
    /// intact, else one line naming it and what is wrong (missing, or damaged).
    pub async fn check_run(&self, id: &Id) -> RepoResult<Option<String>> {
        let key = keys::index_run(id);
        let Some(data) = get_whole(&*self.store, &key).await? else {
            return Ok(Some(format!("{key}: missing")));
        };
        let checked = index_run::parse_run(&data, self.key()).and_then(|run| {
            for (b, j, _) in run.sections() {
                run.open_section(&data, b, j, self.key())
                    .map_err(|e| match e {
                        cairn_format::crypto::CryptoError::Format(f) => {
                            let n = run.directories[b].first_section as usize + j;
                            FormatError::invalid("index run", format!("section {n}: {f}")).into()
                        }
                        other => other,
                    })?;
            }
            Ok(())
        });
        Ok(checked.err().map(|e| sealed_error(&key, e).to_string()))
    }

    /// The trailers of the candidate packs for `id` that can be used, in lookup order, and
    /// the first damage that made one unusable: unreadable, missing, or found missing before
    /// (quarantined whole: not asked again). An error of the store fails the call.
    async fn candidate_trailers(
        &self,
        id: &Id,
    ) -> RepoResult<(Vec<Arc<PackTrailer>>, Option<RepoError>)> {
        let mut trailers = Vec::new();
        let mut damage = None;
        for pack in self.candidates(id).await? {
            if self.is_quarantined_copy(&pack, &pack) {
                damage.get_or_insert(RepoError::PackMissing { pack, id: *id });
                continue;
            }
            match self.trailer(&pack).await {
                Ok(trailer) => trailers.push(trailer),
                Err(e) if e.is_damage() => {
                    damage.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        Ok((trailers, damage))
    }

    /// Where group `id` is stored: the first candidate pack whose trailer lists it.
    pub async fn locate_group(&self, id: &Id) -> RepoResult<GroupLocation> {
        self.locate_group_storing(id, &[]).await
    }

    /// Every copy of group `id` the runs locate, in lookup order (newest run first),
    /// quarantined copies included (their trailers still say which chunk each slot holds).
    /// A candidate pack whose trailer cannot be read (damaged, missing) is passed over; if
    /// no copy is found, that damage is the error.
    pub async fn group_copies(&self, id: &Id) -> RepoResult<Vec<GroupLocation>> {
        let mut copies = Vec::new();
        let (trailers, damage) = self.candidate_trailers(id).await?;
        for trailer in trailers {
            if let Some(group) = trailer.group(id) {
                copies.push(GroupLocation { trailer, group });
            }
        }
        match damage {
            Some(e) if copies.is_empty() => Err(e),
            _ => Ok(copies),
        }
    }

    /// The chunks slots `first .. first + count` of group `id` hold, from the descriptor of
    /// any copy (a damaged one too: every copy lists the same chunks, which the id hashes).
    pub async fn run_chunks(&self, id: &Id, first: u16, count: u16) -> RepoResult<Vec<GroupChunk>> {
        let copies = self.group_copies(id).await?;
        let any = copies.first().ok_or(RepoError::BlobMissing { id: *id })?;
        Ok(any.run_chunks(first, count)?.to_vec())
    }

    /// Where group `id` is stored with every slot of `wanted` (first, count) still in it. Two
    /// copies of a group can differ in what they store (GC rewrote one without slots no
    /// live version used, and rescued the whole group for a commit that reused one of them
    /// meanwhile): a good copy that stores them all — the one in a layout pack if there is
    /// one (`crate::layout`: where a relayout put it; of several, the latest relayout's), else
    /// the first — else the first good
    /// copy that lists the group (reading it then names the dropped slot). Quarantined copies
    /// are skipped; if only those are left, [`RepoError::Quarantined`].
    pub async fn locate_group_storing(
        &self,
        id: &Id,
        wanted: &[(u16, u16)],
    ) -> RepoResult<GroupLocation> {
        let copies = self.group_copies(id).await?;
        let good: Vec<&GroupLocation> = copies.iter().filter(|c| !self.is_quarantined(c)).collect();
        let storing: Vec<&GroupLocation> =
            good.iter().copied().filter(|c| c.stores(wanted)).collect();
        let laid_out = match storing.len() {
            0 | 1 => None,
            _ => {
                let layout = self.layout_packs().await.read().expect("layout lock");
                let mut latest: Option<(u64, &&GroupLocation)> = None;
                for c in &storing {
                    if let Some(&t) = layout.get(&c.trailer.pack) {
                        if latest.is_none_or(|(best, _)| t > best) {
                            latest = Some((t, c));
                        }
                    }
                }
                latest.map(|(_, c)| c)
            }
        };
        if let Some(loc) = laid_out.or(storing.first()).or(good.first()) {
            return Ok((*loc).clone());
        }
        Err(match copies.first() {
            Some(q) => RepoError::Quarantined {
                id: *id,
                pack: q.trailer.pack,
            },
            None => RepoError::BlobMissing { id: *id },
        })
    }

    /// Whether a copy of a group whose id has the 8-byte `key` stores every slot of `wanted`
    /// (first, count): what a commit's stale-GC guard asks for each group its reference
    /// summary lists, which names groups by key. The question is whether a GC deleted it, so
    /// a quarantined copy counts (damage is not deletion: a read heals it by chunk id, and
    /// verify reports it); packs that are gone or whose trailer cannot be read store nothing.
    pub async fn stores_group_key(&self, key: u64, wanted: &[(u16, u16)]) -> RepoResult<bool> {
        for pack in self.packs_for_key(key).await? {
            let trailer = match self.trailer(&pack).await {
                Ok(trailer) => trailer,
                Err(e) if e.is_damage() => continue,
                Err(e) => return Err(e),
            };
            for group in 0..trailer.groups.len() as u32 {
                if trailer
                    .group_id(group)
                    .is_none_or(|id| id.prefix_u64() != key)
                {
                    continue;
                }
                let loc = GroupLocation {
                    trailer: trailer.clone(),
                    group,
                };
                if loc.stores(wanted) {
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// The packs layout markers name, listed once per reader. A listing that fails costs
    /// only the preference (a warning): any good copy reads the same bytes.
    async fn layout_packs(&self) -> &std::sync::RwLock<std::collections::HashMap<Id, u64>> {
        self.layout
            .get_or_init(|| async {
                let listed = crate::layout::list_layout_markers(self.store.as_ref()).await;
                std::sync::RwLock::new(listed.map(crate::layout::latest).unwrap_or_else(|e| {
                    tracing::warn!(
                        "layout markers could not be listed ({e}); any copy of a group is read"
                    );
                    Default::default()
                }))
            })
            .await
    }

    /// Records that this process marked `pack` (a reader that listed the markers before
    /// does not list them again).
    pub(crate) fn add_layout_pack(&self, pack: Id, time: u64) {
        if let Some(layout) = self.layout.get() {
            let mut layout = layout.write().expect("layout lock");
            let t = layout.entry(pack).or_insert(time);
            *t = (*t).max(time);
        }
    }

    /// Whether this copy of a group was found damaged (by this process or an earlier one).
    pub fn is_quarantined(&self, loc: &GroupLocation) -> bool {
        self.is_quarantined_copy(&loc.trailer.pack, &loc.id())
    }

    /// Stops trusting this copy of a group: lookups skip it from now on, and a marker tells
    /// every later process (written when the repository closes). For whoever found it
    /// damaged; `false` if it was known.
    pub fn quarantine_group(&self, loc: &GroupLocation, reason: &str) -> bool {
        let offset = loc.trailer.groups[loc.group as usize].offset;
        self.quarantine_copy(&loc.trailer.pack, &loc.id(), offset, reason)
    }

    /// Where chunk or manifest node `id` is stored in a group copy that is not quarantined
    /// (for dedup and reads); [`RepoError::Quarantined`] if only damaged copies hold it.
    /// A candidate pack whose trailer cannot be read is passed over; if no good copy is
    /// found, that damage is the error.
    pub async fn locate_chunk(&self, id: &Id) -> RepoResult<(Arc<PackTrailer>, SlotRef)> {
        let mut quarantined = None;
        let (trailers, damage) = self.candidate_trailers(id).await?;
        for trailer in trailers {
            let pack = trailer.pack;
            if let Some(slot) = trailer.chunk(id) {
                let group = trailer
                    .group_id(slot.group)
                    .expect("a group of this trailer");
                if self.quarantine.contains(&pack, &group) {
                    quarantined.get_or_insert(pack);
                    continue;
                }
                return Ok((trailer, slot));
            }
        }
        Err(match (damage, quarantined) {
            (Some(e), _) => e,
            (None, Some(pack)) => RepoError::Quarantined { id: *id, pack },
            (None, None) => RepoError::BlobMissing { id: *id },
        })
    }

    /// Where chunk `id` is stored, as a leaf names it (its group's id and its slot), or
    /// `None` if no index run locates a good copy (a commit then stores it: a chunk whose
    /// only copy is damaged — quarantined, in a pack that is missing or whose trailer is
    /// unreadable, or known only to a damaged index run — is stored again, which heals every
    /// version that uses it, and never makes a new version depend on damage).
    pub async fn find_chunk(&self, id: &Id) -> RepoResult<Option<super::Placement>> {
        match self.locate_chunk(id).await {
            Ok((trailer, at)) => Ok(trailer.group_id(at.group).map(|group| super::Placement {
                group,
                slot: at.slot,
            })),
            Err(e) if e.is_damage() => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Opens the group at `loc`; a copy that fails its check is quarantined (and the error
    /// returned).
    pub async fn open_checked(&self, loc: &GroupLocation) -> RepoResult<Arc<OpenedGroup>> {
        self.open_checked_with(loc, true).await
    }

    /// [`Self::open_checked`]; `cache`: keep the opened group (else
    /// [`Self::open_group_once`]).
    async fn open_checked_with(
        &self,
        loc: &GroupLocation,
        cache: bool,
    ) -> RepoResult<Arc<OpenedGroup>> {
        let opened = match cache {
            true => self.open_group(&loc.trailer, loc.group).await,
            false => self.open_group_once(&loc.trailer, loc.group).await,
        };
        opened.inspect_err(|e| {
            if e.is_damage() {
                self.quarantine_group(loc, &e.to_string());
            }
        })
    }

    /// The plain bytes of slots `first .. first + count` of group `id` (a v2 leaf's group
    /// run), checked: from a good copy of the group that stores them, else — every copy
    /// damaged or trimmed — each slot's chunk from wherever else it is stored (the trailer of
    /// a damaged copy still says which chunk each slot holds). A copy found damaged on the
    /// way is quarantined. Fails only when some slot's data is nowhere to be read; the error
    /// then names the damage met (or the quarantined copy, or the dropped slot).
    pub async fn read_group_run(&self, id: &Id, first: u16, count: u16) -> RepoResult<Bytes> {
        let copies = self.group_copies(id).await?;
        let Some(any) = copies.first() else {
            return Err(RepoError::BlobMissing { id: *id });
        };
        let mut damage = None;
        let wanted = [(first, count)];
        for loc in copies
            .iter()
            .filter(|c| !self.is_quarantined(c) && c.stores(&wanted))
        {
            match self.open_checked(loc).await {
                Ok(opened) => return loc.slots(&opened, first, count),
                Err(e) if e.is_damage() => {
                    damage.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
        let chunks = any.run_chunks(first, count).ok();
        let mut out = Vec::new();
        let mut complete = chunks.is_some();
        for c in chunks.unwrap_or_default() {
            match self.read_chunk(&c.id).await {
                Ok(bytes) => out.extend_from_slice(&bytes),
                Err(e) if e.is_damage() => {
                    complete = false;
                    break;
                }
                Err(e) => return Err(e),
            }
        }
        if complete {
            tracing::info!(group = %id, "read slots {first}..{} chunk by chunk (no good copy of the group stores them)", u32::from(first) + u32::from(count));
            return Ok(Bytes::from(out));
        }
        if let Some(e) = damage {
            return Err(e);
        }
        // No copy failed now: a good copy that lies about its slots (reading it names the
        // dropped slot), else only quarantined copies.
        match copies.iter().find(|c| !self.is_quarantined(c)) {
            Some(loc) => {
                let opened = self.open_checked(loc).await?;
                loc.slots(&opened, first, count)
            }
            None => Err(RepoError::Quarantined {
                id: *id,
                pack: any.trailer.pack,
            }),
        }
    }

    /// The plain bytes of each of `runs` (group id, first slot, count: a leaf's group runs),
    /// as [`Self::read_group_run`] gives them, with the fewest reads: each group's good copy
    /// located once and neighbouring groups fetched together ([`Self::open_groups`]). A run
    /// whose group cannot be read that way (damaged, trimmed) takes
    /// [`Self::read_group_run`]'s fallbacks. Each run has its own result — damage in one
    /// leaves the others readable —; an error of the store fails the call.
    pub async fn read_runs(&self, runs: &[(Id, u16, u16)]) -> RepoResult<Vec<RepoResult<Bytes>>> {
        let (names, wanted) = by_group(runs);
        // The good copy of each that stores what is wanted (`None`: the slow path).
        let mut located: Vec<Option<GroupLocation>> = Vec::with_capacity(names.len());
        for (group, slots) in names.iter().zip(&wanted) {
            located.push(match self.locate_group_storing(group, slots).await {
                Ok(loc) if loc.stores(slots) => Some(loc),
                Ok(_) => None,
                Err(e) if e.is_damage() => None,
                Err(e) => return Err(e),
            });
        }
        let fast: Vec<GroupLocation> = located.iter().flatten().cloned().collect();
        let opened = match self.open_groups(&fast).await {
            Ok(opened) => Some(opened),
            // Which group failed is found again, and quarantined, on the slow path.
            Err(e) if e.is_damage() => None,
            Err(e) => return Err(e),
        };
        let mut slot_of = Vec::with_capacity(names.len());
        let mut n = 0;
        for loc in &located {
            slot_of.push(loc.as_ref().map(|_| {
                n += 1;
                n - 1
            }));
        }
        let mut out = Vec::with_capacity(runs.len());
        for &(group, first, count) in runs {
            let at = group_index(&names, &group);
            let quick = match (&located[at], slot_of[at], &opened) {
                (Some(loc), Some(j), Some(opened)) => Some(loc.slots(&opened[j], first, count)),
                _ => None,
            };
            out.push(match quick {
                Some(result) => result,
                None => match self.read_group_run(&group, first, count).await {
                    Err(e) if !e.is_damage() => return Err(e),
                    other => other,
                },
            });
        }
        Ok(out)
    }

    /// The plain bytes of each of `runs`, read like [`Self::read_runs`] but without hashing
    /// each chunk: for a caller that checks what it assembles (a restore checks each segment
    /// against its leaf's digest, one BLAKE3 pass at full SIMD width). `None` when a run
    /// cannot be read this way (no good copy stores it, a group fails to open): the caller
    /// then reads with [`Self::read_runs`], which finds and quarantines the damage; as it
    /// must when the bytes fail its check. An error of the store fails the call.
    pub async fn read_runs_unchecked(
        &self,
        runs: &[(Id, u16, u16)],
    ) -> RepoResult<Option<Vec<Bytes>>> {
        let (names, wanted) = by_group(runs);
        let mut located = Vec::with_capacity(names.len());
        for (group, slots) in names.iter().zip(&wanted) {
            match self.locate_group_storing(group, slots).await {
                Ok(loc) if loc.stores(slots) => located.push(loc),
                Ok(_) => return Ok(None),
                Err(e) if e.is_damage() => return Ok(None),
                Err(e) => return Err(e),
            }
        }
        let opened = match self.open_groups_unchecked(&located).await {
            Ok(opened) => opened,
            Err(e) if e.is_damage() => return Ok(None),
            Err(e) => return Err(e),
        };
        let mut out = Vec::with_capacity(runs.len());
        for &(group, first, count) in runs {
            let at = group_index(&names, &group);
            match located[at].slots(&opened[at], first, count) {
                Ok(bytes) => out.push(bytes),
                Err(_) => return Ok(None),
            }
        }
        Ok(Some(out))
    }

    /// Brings manifest nodes `ids` into the group cache with as few reads as possible (a
    /// restore's next leaves lie side by side in a pack). Best effort: what cannot be
    /// located or opened here is left for the read that needs it, which reports (and
    /// quarantines) the damage.
    pub async fn prefetch_nodes(&self, ids: &[Id]) {
        let mut wanted = Vec::with_capacity(ids.len());
        for id in ids {
            if let Ok((trailer, at)) = self.locate_chunk(id).await {
                wanted.push(GroupLocation {
                    trailer,
                    group: at.group,
                });
            }
        }
        let _ = self.open_groups(&wanted).await;
    }

    /// The plain bytes of chunk or manifest node `id`, checked, from a good copy; a copy
    /// found damaged is quarantined and the next one tried.
    pub async fn read_chunk(&self, id: &Id) -> RepoResult<Bytes> {
        self.read_chunk_with(id, true).await
    }

    /// [`Self::read_chunk`] for a node read once (a commit's parent leaves): its group is not
    /// kept in the cache of opened groups ([`Self::open_group_once`]).
    pub async fn read_chunk_once(&self, id: &Id) -> RepoResult<Bytes> {
        self.read_chunk_with(id, false).await
    }

    async fn read_chunk_with(&self, id: &Id, cache: bool) -> RepoResult<Bytes> {
        Ok(self.read_chunk_located(id, cache).await?.0)
    }

    /// [`Self::read_chunk_once`] that tries `held` first — trailers of packs the caller holds
    /// (a commit worker's recent packs: the parent's leaves lie in order in a few node packs)
    /// — and returns the trailer of the pack the node was read from. A node found in none of
    /// them, or in a copy found damaged there, is looked up as `read_chunk_once` does.
    pub async fn read_node_once_near<'a>(
        &self,
        id: &Id,
        held: impl IntoIterator<Item = &'a Arc<PackTrailer>>,
    ) -> RepoResult<(Bytes, Arc<PackTrailer>)> {
        let near = held.into_iter().find_map(|t| {
            let at = t.chunk(id)?;
            let loc = GroupLocation {
                trailer: t.clone(),
                group: at.group,
            };
            (!self.is_quarantined(&loc)).then_some((loc, at.slot))
        });
        if let Some((loc, slot)) = near {
            match self.open_checked_with(&loc, false).await {
                Ok(opened) => return Ok((loc.slots(&opened, slot, 1)?, loc.trailer)),
                // Quarantined now: the lookup below skips this copy.
                Err(e) if e.is_damage() => {}
                Err(e) => return Err(e),
            }
        }
        self.read_chunk_located(id, false).await
    }

    /// A chunk or node, and the trailer of the pack it was read from.
    async fn read_chunk_located(
        &self,
        id: &Id,
        cache: bool,
    ) -> RepoResult<(Bytes, Arc<PackTrailer>)> {
        let mut damage = None;
        loop {
            let (trailer, at) = match self.locate_chunk(id).await {
                Ok(found) => found,
                Err(e) => return Err(damage.unwrap_or(e)),
            };
            let loc = GroupLocation {
                trailer,
                group: at.group,
            };
            match self.open_checked_with(&loc, cache).await {
                Ok(opened) => return Ok((loc.slots(&opened, at.slot, 1)?, loc.trailer)),
                // Quarantined now: the next lookup skips this copy.
                Err(e) if e.is_damage() => {
                    damage.get_or_insert(e);
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Where `group` is in the names [`by_group`] made of the same runs.
fn group_index(names: &[Id], group: &Id) -> usize {
    names
        .iter()
        .position(|g| g == group)
        .expect("every group of the runs is named")
}

/// The groups `runs` name, each once in order of first use, with the (first, count) runs
/// wanted from each.
#[allow(clippy::type_complexity)]
fn by_group(runs: &[(Id, u16, u16)]) -> (Vec<Id>, Vec<Vec<(u16, u16)>>) {
    let mut names: Vec<Id> = Vec::new();
    let mut wanted: Vec<Vec<(u16, u16)>> = Vec::new();
    for &(group, first, count) in runs {
        let at = match names.iter().rposition(|g| *g == group) {
            Some(at) => at,
            None => {
                names.push(group);
                wanted.push(Vec::new());
                names.len() - 1
            }
        };
        wanted[at].push((first, count));
    }
    (names, wanted)
}

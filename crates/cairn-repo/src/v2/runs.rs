//! Index runs, read in pieces: a run's meta (pack table, fence keys, filter) once when it is
//! added, then only the ~4 KiB section a lookup falls in (kept in a bounded cache). A lookup
//! asks the runs newest first; an entry is a candidate pack, accepted only when the pack's
//! trailer holds the full id — so an 8-byte key collision costs a trailer read, never a
//! wrong answer. Which runs exist, and their compaction, are issue 17's.

use std::sync::Arc;

use bytes::Bytes;
use cairn_format::index_run::{self, Entry, RunMeta, FOOTER_LEN, HEADER_LEN};
use cairn_format::{keys, FormatError, Id};

use super::groups::OpenedGroup;
use super::tail::{get_exact, HeadAndTail};
use super::trailers::{PackTrailer, SlotRef};
use super::{sealed_error, Cost, V2Reader};
use crate::error::{RepoError, RepoResult};

/// How much of a run's end the first read fetches (its meta: 32 bytes a pack, 52 a section,
/// and a filter of about 10 bits an id).
const TAIL_GUESS: u64 = 64 << 10;

/// A run whose meta was read and checked.
#[derive(Debug)]
pub(super) struct OpenRun {
    id: Id,
    key: String,
    meta: RunMeta,
}

/// One section's entries, checked.
#[derive(Debug)]
pub(super) struct Section(Vec<Entry>);

impl Cost for Section {
    fn cost(&self) -> u64 {
        (self.0.len() * index_run::ENTRY_LEN) as u64
    }
}

/// Where a group is: its pack's trailer and its position there.
#[derive(Debug, Clone)]
pub struct GroupLocation {
    pub trailer: Arc<PackTrailer>,
    pub group: u32,
}

impl GroupLocation {
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
        let meta = index_run::parse_meta(obj.len, &obj.head, &footer, &stored_meta, self.key())
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
        self.runs
            .write()
            .expect("runs lock")
            .push(Arc::new(OpenRun { id: *id, key, meta }));
        Ok(())
    }

    /// Adds the runs `ids` ([`Self::add_run`]); a damaged run is skipped and its error
    /// returned as a line (one that vanished since it was listed was superseded and deleted by
    /// a GC, and is skipped), an unreachable store fails the call.
    pub async fn add_runs(&self, ids: &[Id]) -> RepoResult<Vec<String>> {
        let mut damaged = Vec::new();
        for id in ids {
            match self.add_run(id).await {
                Ok(()) => {}
                Err(e) if e.is_damage() => damaged.push(e.to_string()),
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

    /// The runs lookups ask, oldest first.
    pub fn run_ids(&self) -> Vec<Id> {
        let runs = self.runs.read().expect("runs lock");
        runs.iter().map(|r| r.id).collect()
    }

    /// Every pack an index run names (what a verify of the whole repository reads), sorted.
    pub fn packs(&self) -> Vec<Id> {
        let runs = self.runs.read().expect("runs lock");
        let mut packs: Vec<Id> = runs.iter().flat_map(|r| r.meta.packs.clone()).collect();
        packs.sort_unstable();
        packs.dedup();
        packs
    }

    /// The packs the runs name for `id` (candidates), newest run first, without repeats.
    async fn candidates(&self, id: &Id) -> RepoResult<Vec<Id>> {
        let runs: Vec<Arc<OpenRun>> = self.runs.read().expect("runs lock").clone();
        let mut packs = Vec::new();
        // A damaged section fails only the lookups no other run answers: damage in one
        // commit's run never spreads to ids that other runs locate.
        let mut damage = None;
        for run in runs.iter().rev() {
            let Some(i) = run.meta.section_for(id) else {
                continue;
            };
            let section = match self
                .sections
                .get_or_insert_async(&(run.id, i as u32), self.read_section(run, i))
                .await
            {
                Ok(section) => section,
                Err(e) if e.is_damage() => {
                    damage.get_or_insert(e);
                    continue;
                }
                Err(e) => return Err(e),
            };
            for pack in run.meta.candidates(&section.0, id) {
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
        let runs: Vec<Arc<OpenRun>> = self.runs.read().expect("runs lock").clone();
        let mut problems = Vec::new();
        for run in runs {
            let data = match self.store.get(&run.key).await {
                Ok(d) => d,
                Err(e) => {
                    let e = RepoError::from(e);
                    if !e.is_not_found() {
                        return Err(e);
                    }
                    problems.push(format!("{}: missing", run.key));
                    continue;
                }
            };
            let checked = index_run::parse_run(&data, self.key()).and_then(|meta| {
                for (i, s) in meta.sections.iter().enumerate() {
                    let r = s.range();
                    let stored = data.get(r.start as usize..r.end as usize).unwrap_or(&[]);
                    meta.open_section(i, stored, self.key())
                        .map_err(|e| match e {
                            cairn_format::crypto::CryptoError::Format(f) => {
                                FormatError::invalid("index run", format!("section {i}: {f}"))
                                    .into()
                            }
                            other => other,
                        })?;
                }
                Ok(())
            });
            if let Err(e) = checked {
                problems.push(sealed_error(&run.key, e).to_string());
            }
        }
        Ok(problems)
    }

    async fn read_section(&self, run: &OpenRun, i: usize) -> RepoResult<Arc<Section>> {
        self.fetched
            .sections
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let range = run.meta.sections[i].range();
        let stored: Bytes = get_exact(&*self.store, &run.key, range).await?;
        let entries = run
            .meta
            .open_section(i, &stored, self.key())
            .map_err(|e| sealed_error(format!("{} section {i}", run.key), e))?;
        Ok(Arc::new(Section(entries)))
    }

    /// Where group `id` is stored: the first candidate pack whose trailer lists it.
    pub async fn locate_group(&self, id: &Id) -> RepoResult<GroupLocation> {
        self.locate_group_storing(id, &[]).await
    }

    /// Where group `id` is stored with every slot of `wanted` (first, count) still in it. Two
    /// copies of a group can differ in what they store (GC rewrote one without slots no
    /// live version used, and rescued the whole group for a commit that reused one of them
    /// meanwhile): the first candidate that stores them all, else the first that lists the
    /// group (reading it then names the dropped slot).
    pub async fn locate_group_storing(
        &self,
        id: &Id,
        wanted: &[(u16, u16)],
    ) -> RepoResult<GroupLocation> {
        let mut listed = None;
        for pack in self.candidates(id).await? {
            let trailer = self.trailer(&pack).await?;
            if let Some(group) = trailer.group(id) {
                let loc = GroupLocation { trailer, group };
                if loc.stores(wanted) {
                    return Ok(loc);
                }
                listed.get_or_insert(loc);
            }
        }
        listed.ok_or(RepoError::BlobMissing { id: *id })
    }

    /// Where chunk or manifest node `id` is stored (for dedup and node reads).
    pub async fn locate_chunk(&self, id: &Id) -> RepoResult<(Arc<PackTrailer>, SlotRef)> {
        for pack in self.candidates(id).await? {
            let trailer = self.trailer(&pack).await?;
            if let Some(slot) = trailer.chunk(id) {
                return Ok((trailer, slot));
            }
        }
        Err(RepoError::BlobMissing { id: *id })
    }

    /// Where chunk `id` is stored, as a leaf names it (its group's id and its slot), or
    /// `None` if no index run locates it (a commit then stores it).
    pub async fn find_chunk(&self, id: &Id) -> RepoResult<Option<super::Placement>> {
        match self.locate_chunk(id).await {
            Ok((trailer, at)) => Ok(trailer.group_id(at.group).map(|group| super::Placement {
                group,
                slot: at.slot,
            })),
            Err(RepoError::BlobMissing { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// The plain bytes of slots `first .. first + count` of group `id` (a v2 leaf's group
    /// run), checked.
    pub async fn read_group_run(&self, id: &Id, first: u16, count: u16) -> RepoResult<Bytes> {
        let loc = self.locate_group_storing(id, &[(first, count)]).await?;
        let opened = self.open_group(&loc.trailer, loc.group).await?;
        loc.slots(&opened, first, count)
    }

    /// The plain bytes of chunk or manifest node `id`, checked.
    pub async fn read_chunk(&self, id: &Id) -> RepoResult<Bytes> {
        let (trailer, at) = self.locate_chunk(id).await?;
        let loc = GroupLocation {
            trailer,
            group: at.group,
        };
        let opened = self.open_group(&loc.trailer, loc.group).await?;
        loc.slots(&opened, at.slot, 1)
    }
}

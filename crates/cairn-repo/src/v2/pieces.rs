//! The pieces of index runs a lookup reads: a directory block, a section and a
//! block of the pack table, each fetched by a ranged read, checked, and kept in one bounded
//! cache ([`super::CacheLimits::section_bytes`]). A reader holds only each run's top level
//! (about 60 bytes per 87,000 entries), so what it keeps does not grow with the repository.
//! Version 1–2 runs hold their directory and pack table in their meta: nothing is read.

use std::sync::Arc;

use bytes::Bytes;
use cairn_format::index_run::{Directory, Entry, PackBlock, Piece};
use cairn_format::Id;

use super::runs::OpenRun;
use super::tail::get_exact;
use super::{sealed_error, Cost, V2Reader};
use crate::error::RepoResult;

/// Sections read together when a lookup misses the cache in a run read densely (about 64 KiB,
/// within one directory block): a restore or an exact commit looks up keys all over the key
/// space, so the neighbours are soon asked for.
const SECTION_READ_AHEAD: usize = 16;

/// How many sections a read of `run` takes: [`SECTION_READ_AHEAD`] once this reader has read
/// at least one in that many of the run's sections (its lookups are dense: the neighbours
/// will be asked for), else one. A bounded commit asks a large compacted run a few hooks a
/// segment, scattered over millions of sections: reading ahead there would read 16 sections
/// to use one. Nor does a run whose sections take more than half the piece cache (`budget`)
/// read ahead: its neighbours would be evicted before they are asked for (a re-commit of a
/// 256 GiB image read 225,000 times 16 sections to use one of each).
fn read_ahead(run: &OpenRun, budget: u64) -> usize {
    if run.meta.entries.saturating_mul(12) > budget / 2 {
        return 1;
    }
    let read = run
        .sections_read
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    if read.saturating_mul(SECTION_READ_AHEAD as u64) >= run.section_count {
        SECTION_READ_AHEAD
    } else {
        1
    }
}

/// Which piece of a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum PieceKey {
    /// A section, by its run-wide number.
    Section(u32),
    Directory(u32),
    Packs(u32),
}

/// A section's entries as the cache keeps them: 12 bytes an entry, as stored (a `Vec<Entry>`
/// spends 16 with its padding, and the cache would hold a quarter fewer).
#[derive(Debug)]
pub(super) struct SectionEntries {
    keys: Box<[u64]>,
    packs: Box<[u32]>,
}

impl SectionEntries {
    fn new(entries: Vec<Entry>) -> SectionEntries {
        SectionEntries {
            keys: entries.iter().map(|e| e.key).collect(),
            packs: entries.iter().map(|e| e.pack).collect(),
        }
    }

    /// The pack ordinals listed for `key`.
    fn ordinals_of(&self, key: u64) -> &[u32] {
        let start = self.keys.partition_point(|k| *k < key);
        let end = start + self.keys[start..].partition_point(|k| *k == key);
        &self.packs[start..end]
    }
}

/// A piece of a run, checked and decoded.
#[derive(Debug)]
pub(super) enum RunPiece {
    Section(Arc<SectionEntries>),
    Directory(Arc<Directory>),
    Packs(Arc<PackBlock>),
}

impl Cost for RunPiece {
    fn cost(&self) -> u64 {
        match self {
            RunPiece::Section(s) => (s.keys.len() * 12) as u64,
            RunPiece::Directory(d) => d.cost(),
            RunPiece::Packs(p) => p.0.len() as u64 * 32,
        }
    }
}

impl V2Reader {
    /// Directory block `b` of `run`: held with its meta (versions 1–2), cached, or read.
    pub(super) async fn directory(&self, run: &OpenRun, b: usize) -> RepoResult<Arc<Directory>> {
        let at = match &run.meta.blocks[b].piece {
            Piece::Held(d) => return Ok(d.clone()),
            Piece::At(at) => at.range.clone(),
        };
        let piece = self
            .cached_piece(run, PieceKey::Directory(b as u32), at, |stored| {
                let dir = run.meta.open_directory(b, stored, self.key());
                let dir =
                    dir.map_err(|e| sealed_error(format!("{} directory block {b}", run.key), e))?;
                Ok(RunPiece::Directory(Arc::new(dir)))
            })
            .await?;
        match &*piece {
            RunPiece::Directory(d) => Ok(d.clone()),
            _ => unreachable!("a directory key holds a directory"),
        }
    }

    /// The piece `which` of `run`, stored at `at`: cached, or read and decoded by `open`
    /// (concurrent misses wait for one read).
    async fn cached_piece(
        &self,
        run: &OpenRun,
        which: PieceKey,
        at: std::ops::Range<u64>,
        open: impl FnOnce(&[u8]) -> RepoResult<RunPiece>,
    ) -> RepoResult<Arc<RunPiece>> {
        self.pieces
            .get_or_insert_async(&(run.id, which), async {
                let stored = get_exact(&*self.store, &run.key, at).await?;
                Ok::<_, crate::error::RepoError>(Arc::new(open(&stored)?))
            })
            .await
    }

    /// The entries of section `j` of `dir` (a directory block of `run`), cached or read.
    pub(super) async fn section(
        &self,
        run: &OpenRun,
        dir: &Directory,
        j: usize,
    ) -> RepoResult<Arc<SectionEntries>> {
        let number = dir.first_section + j as u32;
        let piece = self
            .pieces
            .get_or_insert_async(
                &(run.id, PieceKey::Section(number)),
                self.read_section(run, dir, j),
            )
            .await?;
        match &*piece {
            RunPiece::Section(s) => Ok(s.clone()),
            _ => unreachable!("a section key holds a section"),
        }
    }

    /// Section `j` of `dir`, read with the sections after it in the same block that are not
    /// cached yet (up to [`read_ahead`] in all, contiguous in the run) in one ranged read; the
    /// others enter the cache. A neighbour that fails its check is left out, for
    /// its own lookup to report.
    async fn read_section(
        &self,
        run: &OpenRun,
        dir: &Directory,
        j: usize,
    ) -> RepoResult<Arc<RunPiece>> {
        self.fetched
            .sections
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let sections = &dir.sections;
        let cached = |k: usize| {
            self.pieces
                .contains_key(&(run.id, PieceKey::Section(dir.first_section + k as u32)))
        };
        let ahead = read_ahead(run, self.section_budget);
        let mut last = j;
        while last + 1 < sections.len() && last + 1 - j < ahead && !cached(last + 1) {
            last += 1;
        }
        let start = sections[j].range().start;
        let stored: Bytes =
            match get_exact(&*self.store, &run.key, start..sections[last].range().end).await {
                // A run cut short past section j: read section j alone.
                Err(e) if e.is_damage() && last > j => {
                    last = j;
                    get_exact(&*self.store, &run.key, sections[j].range()).await?
                }
                other => other?,
            };
        let piece = |k: usize| {
            let r = sections[k].range();
            stored.slice((r.start - start) as usize..(r.end - start) as usize)
        };
        for k in j + 1..=last {
            if let Ok(entries) = run.meta.open_section(dir, k, &piece(k), self.key()) {
                self.pieces.insert(
                    (run.id, PieceKey::Section(dir.first_section + k as u32)),
                    Arc::new(RunPiece::Section(Arc::new(SectionEntries::new(entries)))),
                );
            }
        }
        let entries = run
            .meta
            .open_section(dir, j, &piece(j), self.key())
            .map_err(|e| {
                let n = dir.first_section as usize + j;
                sealed_error(format!("{} section {n}", run.key), e)
            })?;
        Ok(Arc::new(RunPiece::Section(Arc::new(SectionEntries::new(
            entries,
        )))))
    }

    /// The id of pack `ordinal` of `run`'s pack table.
    pub(super) async fn pack_id(&self, run: &OpenRun, ordinal: u32) -> RepoResult<Id> {
        let (b, i) = run
            .meta
            .pack_place(ordinal)
            .expect("a checked section names a pack of the table");
        let block = self.pack_block(run, b).await?;
        Ok(block.0[i])
    }

    /// Block `b` of `run`'s pack table: held with its meta, cached, or read.
    pub(super) async fn pack_block(&self, run: &OpenRun, b: usize) -> RepoResult<Arc<PackBlock>> {
        let at = match &run.meta.pack_blocks[b] {
            Piece::Held(p) => return Ok(p.clone()),
            Piece::At(at) => at.range.clone(),
        };
        let piece = self
            .cached_piece(run, PieceKey::Packs(b as u32), at, |stored| {
                let block = run.meta.open_pack_block(b, stored, self.key());
                let block =
                    block.map_err(|e| sealed_error(format!("{} pack block {b}", run.key), e))?;
                Ok(RunPiece::Packs(Arc::new(block)))
            })
            .await?;
        match &*piece {
            RunPiece::Packs(p) => Ok(p.clone()),
            _ => unreachable!("a pack key holds pack ids"),
        }
    }

    /// Every pack `run` names, each block checked (what verify, GC and repair need whole).
    pub(super) async fn run_packs(&self, run: &OpenRun) -> RepoResult<Vec<Id>> {
        let mut packs = Vec::with_capacity(run.meta.pack_count as usize);
        for b in 0..run.meta.pack_blocks.len() {
            packs.extend_from_slice(&self.pack_block(run, b).await?.0);
        }
        Ok(packs)
    }

    /// The packs `run` names for `key` (candidates), reading its directory block, section and
    /// pack blocks as needed; empty when its fence keys rule it out.
    ///
    /// A directory block or section that cannot be read costs speed, not data: every pack
    /// of the run's pack table (checked on its own) is then a candidate, and the caller's
    /// check of the full id in each trailer finds the right one. Only a damaged pack table
    /// too fails the lookup.
    pub(super) async fn run_candidates(&self, run: &OpenRun, key: u64) -> RepoResult<Vec<Id>> {
        match self.run_candidates_indexed(run, key).await {
            Err(e) if e.is_damage() => match self.run_packs(run).await {
                Ok(all) => {
                    tracing::debug!("{e}; every pack of the run is a candidate");
                    Ok(all)
                }
                Err(_) => Err(e),
            },
            found => found,
        }
    }

    async fn run_candidates_indexed(&self, run: &OpenRun, key: u64) -> RepoResult<Vec<Id>> {
        let Some(b) = run.meta.block_of_key(key) else {
            return Ok(Vec::new());
        };
        let dir = self.directory(run, b).await?;
        let Some(j) = dir.section_of(key) else {
            return Ok(Vec::new());
        };
        let entries = self.section(run, &dir, j).await?;
        let mut packs = Vec::new();
        for ordinal in entries.ordinals_of(key) {
            packs.push(self.pack_id(run, *ordinal).await?);
        }
        Ok(packs)
    }
}

//! A run held whole in memory (verify, repair checks, golden vectors, fuzzing): every piece
//! but the sections opened at once, the sections on request.

use crate::crypto::{CryptoError, MasterKey};
use crate::summary::Bloom;
use crate::{FormatError, Id};

use super::read::{ordinals_of, parse_footer, parse_meta};
use super::{key_of, Directory, Entry, Piece, RunMeta, SectionRef, FOOTER_LEN, HEADER_LEN};

/// Every piece of a run but its sections, opened and checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WholeRun {
    pub meta: RunMeta,
    pub directories: Vec<Directory>,
    pub packs: Vec<Id>,
    pub filter: Bloom,
}

fn slice<'a>(run: &'a [u8], r: &std::ops::Range<u64>) -> &'a [u8] {
    usize::try_from(r.start)
        .ok()
        .zip(usize::try_from(r.end).ok())
        .and_then(|(s, e)| run.get(s..e))
        .unwrap_or(&[])
}

/// Parses a whole run: its meta, every directory block, the pack table and the filter.
pub fn parse_run(run: &[u8], key: Option<&MasterKey>) -> Result<WholeRun, CryptoError> {
    if run.len() < HEADER_LEN + FOOTER_LEN {
        return Err(FormatError::Truncated {
            what: super::WHAT,
            needed: (HEADER_LEN + FOOTER_LEN) as u64,
            available: run.len() as u64,
        }
        .into());
    }
    let footer = parse_footer(&run[run.len() - FOOTER_LEN..])?;
    let end = run.len() - FOOTER_LEN;
    let start = end
        .checked_sub(footer.meta_len as usize)
        .ok_or_else(|| FormatError::invalid(super::WHAT, "meta longer than the run"))?;
    let mut meta = parse_meta(
        run.len() as u64,
        &run[..HEADER_LEN],
        &footer,
        &run[start..end],
        key,
    )?;
    let mut directories = Vec::with_capacity(meta.blocks.len());
    for (b, block) in meta.blocks.iter().enumerate() {
        directories.push(match &block.piece {
            Piece::Held(d) => (**d).clone(),
            Piece::At(at) => meta.open_directory(b, slice(run, &at.range), key)?,
        });
    }
    let mut packs = Vec::with_capacity(meta.pack_count as usize);
    for (b, piece) in meta.pack_blocks.iter().enumerate() {
        match piece {
            Piece::Held(p) => packs.extend_from_slice(&p.0),
            Piece::At(at) => packs.extend(meta.open_pack_block(b, slice(run, &at.range), key)?.0),
        }
    }
    if packs.windows(2).any(|w| w[0] >= w[1]) {
        return Err(FormatError::invalid(super::WHAT, "pack table out of order").into());
    }
    let filter = match (meta.filter.take(), &meta.filter_at) {
        (Some(f), _) => f,
        (None, Some(at)) => meta.open_filter(slice(run, &at.range), key)?,
        (None, None) => return Err(FormatError::invalid(super::WHAT, "no filter").into()),
    };
    Ok(WholeRun {
        meta,
        directories,
        packs,
        filter,
    })
}

impl WholeRun {
    pub fn version(&self) -> u32 {
        self.meta.version
    }

    pub fn entries(&self) -> u64 {
        self.meta.entries
    }

    /// Every section, in order: (directory block, index in it, reference).
    pub fn sections(&self) -> impl Iterator<Item = (usize, usize, &SectionRef)> {
        self.directories
            .iter()
            .enumerate()
            .flat_map(|(b, d)| d.sections.iter().enumerate().map(move |(j, s)| (b, j, s)))
    }

    /// The section (directory block, index) that would hold `id`'s entries, unless the
    /// filter rules it out.
    pub fn section_for(&self, id: &Id) -> Option<(usize, usize)> {
        if !self.meta.filter_passes(&self.filter, id) {
            return None;
        }
        let b = self.meta.block_of(id)?;
        Some((b, self.directories[b].section_of(key_of(id))?))
    }

    /// Checks and decodes section `j` of block `b`, read from `run` (the run's bytes).
    pub fn open_section(
        &self,
        run: &[u8],
        b: usize,
        j: usize,
        key: Option<&MasterKey>,
    ) -> Result<Vec<Entry>, CryptoError> {
        let dir = &self.directories[b];
        let stored = dir
            .sections
            .get(j)
            .map_or(&[][..], |s| slice(run, &s.range()));
        self.meta.open_section(dir, j, stored, key)
    }

    /// Every entry of the run, each section checked.
    pub fn all_entries(
        &self,
        run: &[u8],
        key: Option<&MasterKey>,
    ) -> Result<Vec<Entry>, CryptoError> {
        let mut out = Vec::with_capacity(self.meta.entries as usize);
        for (b, j, _) in self.sections() {
            out.extend(self.open_section(run, b, j, key)?);
        }
        Ok(out)
    }

    /// The packs that may hold `id` (candidates: check the full id in the pack's trailer).
    pub fn lookup(
        &self,
        run: &[u8],
        id: &Id,
        key: Option<&MasterKey>,
    ) -> Result<Vec<Id>, CryptoError> {
        let Some((b, j)) = self.section_for(id) else {
            return Ok(Vec::new());
        };
        let entries = self.open_section(run, b, j, key)?;
        Ok(ordinals_of(&entries, key_of(id))
            .map(|o| self.packs[o as usize])
            .collect())
    }
}

//! Reading runs: the header, the footer, the meta (a version 3 top level, or a version 1–2
//! meta that holds every section reference and the pack table), and each piece on demand.
//!
//! Version 1 and 2 meta (read still; older builds wrote them):
//! ```text
//! pack count P (u32) | P × pack id (32)
//! section count S (u32) | S × (first key (u64) | entries (u32) | offset (u32)
//!   | stored length (u32) | BLAKE3 of the stored section (32))
//! filter: log2 of its bits (u8) | probes (u8) | bits
//! ```
//! Every check a reader makes: the footer's checksum covers the meta, the meta's checksums
//! cover each piece (so none can be swapped for another), pieces lie exactly where the counts
//! put them, fence keys increase, entries are in order, inside their section's key range and
//! name a pack of the table, and counts agree with the footer.

use std::sync::Arc;

use crate::codec::Decoder;
use crate::crypto::{open_if_sealed, CryptoError, Domain, MasterKey, SEAL_OVERHEAD};
use crate::summary::Bloom;
use crate::{FormatError, Id};

use super::{
    BlockRef, Directory, Entry, Footer, PackBlock, Piece, PieceAt, RunMeta, SectionRef,
    DIRECTORY_ENTRY_LEN, END_MAGIC, ENTRY_LEN, FIRST_VERSION, FLAG_SEALED, FOOTER_LEN, HEADER_LEN,
    MAGIC, VERSION, WHAT,
};

/// A version 1–2 section reference in the meta.
const LEGACY_SECTION_REF_LEN: usize = 8 + 4 + 4 + 4 + 32;

fn bad(reason: impl Into<String>) -> CryptoError {
    FormatError::invalid(WHAT, reason).into()
}

fn truncated(what: &'static str, needed: u64, available: u64) -> CryptoError {
    FormatError::Truncated {
        what,
        needed,
        available,
    }
    .into()
}

/// Parses the last [`FOOTER_LEN`] bytes of a run.
pub fn parse_footer(tail: &[u8]) -> Result<Footer, CryptoError> {
    if tail.len() != FOOTER_LEN {
        return Err(truncated(WHAT, FOOTER_LEN as u64, tail.len() as u64));
    }
    if &tail[44..52] != END_MAGIC {
        return Err(FormatError::BadMagic {
            what: "index run footer",
        }
        .into());
    }
    let mut d = Decoder::new(tail, WHAT);
    Ok(Footer {
        meta_len: d.u32()?,
        entries: d.u64()?,
        meta_checksum: d.take(32)?.try_into().expect("32 bytes"),
    })
}

/// Checks a run's header (its first [`HEADER_LEN`] bytes): its version and whether it is
/// sealed.
pub fn parse_header(head: &[u8]) -> Result<(u32, bool), CryptoError> {
    if head.len() < HEADER_LEN {
        return Err(truncated(WHAT, HEADER_LEN as u64, head.len() as u64));
    }
    if &head[..8] != MAGIC {
        return Err(FormatError::BadMagic { what: WHAT }.into());
    }
    let word = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().expect("4 bytes"));
    let version = match word(8) {
        v @ FIRST_VERSION..=VERSION => v,
        v if v > VERSION => {
            return Err(FormatError::TooNew {
                what: WHAT,
                found: v,
                supported: VERSION,
            }
            .into())
        }
        v => return Err(bad(format!("version {v}"))),
    };
    match word(12) {
        0 => Ok((version, false)),
        FLAG_SEALED => Ok((version, true)),
        f => Err(bad(format!("unknown flags {f:#x}"))),
    }
}

/// Checks `stored` against its checksum and opens it (sealed runs).
fn open_piece<'a>(
    sealed: bool,
    key: Option<&MasterKey>,
    what: &'static str,
    stored: &'a [u8],
    at: &PieceAt,
) -> Result<std::borrow::Cow<'a, [u8]>, CryptoError> {
    let want = at.range.end - at.range.start;
    if stored.len() as u64 != want {
        return Err(truncated(what, want, stored.len() as u64));
    }
    if blake3::hash(stored).as_bytes() != &at.checksum {
        return Err(FormatError::Checksum { what }.into());
    }
    open_if_sealed(sealed, key, Domain::IndexFile, what, stored)
}

/// Parses and checks the meta of a run of `run_len` bytes, given its header, footer and the
/// `footer.meta_len` bytes before the footer: for version 3 the top level (pieces are read
/// later), for versions 1 and 2 everything but the sections.
pub fn parse_meta(
    run_len: u64,
    head: &[u8],
    footer: &Footer,
    stored_meta: &[u8],
    key: Option<&MasterKey>,
) -> Result<RunMeta, CryptoError> {
    let (version, sealed) = parse_header(head)?;
    let meta_start = run_len
        .checked_sub(FOOTER_LEN as u64 + u64::from(footer.meta_len))
        .filter(|m| *m >= HEADER_LEN as u64)
        .ok_or_else(|| bad("meta longer than the run"))?;
    let at = PieceAt {
        range: meta_start..meta_start + u64::from(footer.meta_len),
        checksum: footer.meta_checksum,
    };
    let meta = open_piece(sealed, key, "index run meta", stored_meta, &at)?;
    let overhead = if sealed { SEAL_OVERHEAD as u64 } else { 0 };
    let layout = Layout {
        version,
        sealed,
        overhead,
        meta_start,
        entries: footer.entries,
    };
    match version {
        1 | 2 => layout.legacy(&meta),
        _ => layout.top_level(&meta),
    }
}

/// What the header and footer say, for parsing the meta.
struct Layout {
    version: u32,
    sealed: bool,
    overhead: u64,
    meta_start: u64,
    entries: u64,
}

impl Layout {
    /// A version 1–2 meta: the pack table and every section reference, then the filter.
    fn legacy(&self, meta: &[u8]) -> Result<RunMeta, CryptoError> {
        let mut d = Decoder::new(meta, WHAT);
        let pack_count = d.u32()?;
        if pack_count as usize > d.remaining() / 32 {
            return Err(bad(format!(
                "{pack_count} packs in a meta of {} bytes",
                meta.len()
            )));
        }
        let packs = (0..pack_count)
            .map(|_| d.id())
            .collect::<Result<Vec<_>, _>>()?;
        let section_count = d.u32()? as usize;
        if section_count > d.remaining() / LEGACY_SECTION_REF_LEN {
            return Err(bad(format!(
                "{section_count} sections in a meta of {} bytes",
                meta.len()
            )));
        }
        let mut sections: Vec<SectionRef> = Vec::with_capacity(section_count);
        let (mut next_offset, mut total) = (HEADER_LEN as u64, 0u64);
        for _ in 0..section_count {
            let s = SectionRef {
                first_key: d.u64()?,
                entries: d.u32()?,
                offset: u64::from(d.u32()?),
                stored_len: d.u32()?,
                checksum: d.take(32)?.try_into().expect("32 bytes"),
            };
            if s.entries == 0
                || s.offset != next_offset
                || u64::from(s.stored_len)
                    != u64::from(s.entries) * ENTRY_LEN as u64 + self.overhead
            {
                return Err(bad(format!(
                    "section at {} ({} entries in {} bytes) is not where or as long as it \
                     should be",
                    s.offset, s.entries, s.stored_len
                )));
            }
            if sections.last().is_some_and(|p| p.first_key >= s.first_key) {
                return Err(bad("section fence keys do not increase"));
            }
            next_offset += u64::from(s.stored_len);
            total += u64::from(s.entries);
            sections.push(s);
        }
        if next_offset != self.meta_start {
            return Err(bad("sections do not end where the meta begins"));
        }
        if total != self.entries {
            return Err(bad(format!(
                "sections hold {total} entries, the footer says {}",
                self.entries
            )));
        }
        let filter = Bloom::decode_from(&mut d, WHAT)?;
        d.finish()?;
        let blocks = match sections.first() {
            None => Vec::new(),
            Some(first) => vec![BlockRef {
                first_key: first.first_key,
                sections: section_count as u32,
                first_section: 0,
                entries: total,
                section_offset: HEADER_LEN as u64,
                piece: Piece::Held(Arc::new(Directory {
                    first_section: 0,
                    sections,
                    end_key: None,
                })),
            }],
        };
        Ok(RunMeta {
            version: self.version,
            sealed: self.sealed,
            entries: self.entries,
            pack_count,
            packs_per_block: pack_count.max(1),
            pack_blocks: if packs.is_empty() {
                Vec::new()
            } else {
                vec![Piece::Held(Arc::new(PackBlock(packs)))]
            },
            blocks,
            filter: Some(filter),
            filter_at: None,
        })
    }

    /// A version 3 top level: the places of every piece follow from the counts.
    fn top_level(&self, meta: &[u8]) -> Result<RunMeta, CryptoError> {
        let mut d = Decoder::new(meta, WHAT);
        let pack_count = d.u32()?;
        let per = d.u32()?;
        if per == 0 {
            return Err(bad("0 packs per block"));
        }
        let pack_block_count = pack_count.div_ceil(per) as usize;
        if pack_block_count > d.remaining() / 32 {
            return Err(bad(format!(
                "{pack_count} packs in a top level of {} bytes",
                meta.len()
            )));
        }
        let pack_sums = (0..pack_block_count)
            .map(|_| Ok(d.take(32)?.try_into().expect("32 bytes")))
            .collect::<Result<Vec<[u8; 32]>, CryptoError>>()?;
        let block_count = d.u32()? as usize;
        if block_count > d.remaining() / (8 + 4 + 8 + 32) {
            return Err(bad(format!(
                "{block_count} directory blocks in a top level of {} bytes",
                meta.len()
            )));
        }
        let overflow = || bad("pieces larger than any run");
        let mut blocks: Vec<BlockRef> = Vec::with_capacity(block_count);
        let (mut section_offset, mut first_section) = (HEADER_LEN as u64, 0u32);
        let mut total = 0u64;
        let mut directory = Vec::with_capacity(block_count);
        for _ in 0..block_count {
            let first_key = d.u64()?;
            let sections = d.u32()?;
            let entries = d.u64()?;
            let checksum: [u8; 32] = d.take(32)?.try_into().expect("32 bytes");
            if sections == 0 || entries < u64::from(sections) {
                return Err(bad(format!(
                    "a directory block of {sections} sections holding {entries} entries"
                )));
            }
            if blocks.last().is_some_and(|p| p.first_key >= first_key) {
                return Err(bad("directory fence keys do not increase"));
            }
            let stored = entries
                .checked_mul(ENTRY_LEN as u64)
                .and_then(|b| b.checked_add(u64::from(sections) * self.overhead))
                .ok_or_else(overflow)?;
            directory.push((
                u64::from(sections) * DIRECTORY_ENTRY_LEN as u64 + self.overhead,
                checksum,
            ));
            blocks.push(BlockRef {
                first_key,
                sections,
                first_section,
                entries,
                section_offset,
                piece: Piece::At(PieceAt {
                    range: 0..0,
                    checksum,
                }),
            });
            section_offset = section_offset.checked_add(stored).ok_or_else(overflow)?;
            first_section = first_section.checked_add(sections).ok_or_else(overflow)?;
            total = total.checked_add(entries).ok_or_else(overflow)?;
        }
        let filter_len = d.u64()?;
        let filter_sum: [u8; 32] = d.take(32)?.try_into().expect("32 bytes");
        d.finish()?;
        if total != self.entries {
            return Err(bad(format!(
                "directory blocks hold {total} entries, the footer says {}",
                self.entries
            )));
        }
        // Directory blocks follow the sections, pack blocks the directory, then the filter.
        let mut at = section_offset;
        let mut place = |len: u64| -> Result<std::ops::Range<u64>, CryptoError> {
            let end = at.checked_add(len).ok_or_else(overflow)?;
            let r = at..end;
            at = end;
            Ok(r)
        };
        for (b, (len, checksum)) in blocks.iter_mut().zip(directory) {
            b.piece = Piece::At(PieceAt {
                range: place(len)?,
                checksum,
            });
        }
        let mut pack_blocks = Vec::with_capacity(pack_block_count);
        for (i, checksum) in pack_sums.into_iter().enumerate() {
            let n = (pack_count - i as u32 * per).min(per);
            pack_blocks.push(Piece::At(PieceAt {
                range: place(u64::from(n) * 32 + self.overhead)?,
                checksum,
            }));
        }
        let filter_at = PieceAt {
            range: place(filter_len)?,
            checksum: filter_sum,
        };
        if at != self.meta_start {
            return Err(bad("the pieces do not end where the top level begins"));
        }
        Ok(RunMeta {
            version: self.version,
            sealed: self.sealed,
            entries: self.entries,
            pack_count,
            packs_per_block: per,
            pack_blocks,
            blocks,
            filter: None,
            filter_at: Some(filter_at),
        })
    }
}

impl RunMeta {
    fn piece_at<'a, T>(&self, piece: &'a Piece<T>) -> Result<&'a PieceAt, CryptoError> {
        match piece {
            Piece::At(at) => Ok(at),
            Piece::Held(_) => Err(bad("a piece held with the meta has no place to read")),
        }
    }

    /// Checks and decodes directory block `b` from its stored bytes.
    pub fn open_directory(
        &self,
        b: usize,
        stored: &[u8],
        key: Option<&MasterKey>,
    ) -> Result<Directory, CryptoError> {
        let block = self
            .blocks
            .get(b)
            .ok_or_else(|| bad(format!("no directory block {b}")))?;
        let at = self.piece_at(&block.piece)?;
        let plain = open_piece(self.sealed, key, "index run directory block", stored, at)?;
        let mut d = Decoder::new(&plain, "index run directory block");
        let end_key = self.blocks.get(b + 1).map(|n| n.first_key);
        let mut sections: Vec<SectionRef> = Vec::with_capacity(block.sections as usize);
        let (mut offset, mut total) = (block.section_offset, 0u64);
        for _ in 0..block.sections {
            let first_key = d.u64()?;
            let entries = d.u32()?;
            let checksum = d.take(32)?.try_into().expect("32 bytes");
            let in_order = match sections.last() {
                None => first_key == block.first_key,
                Some(p) => p.first_key < first_key,
            };
            if !in_order || end_key.is_some_and(|e| first_key >= e) || entries == 0 {
                return Err(bad(format!(
                    "directory block {b}: section {} out of order, out of its block or empty",
                    sections.len()
                )));
            }
            let stored_len = u64::from(entries) * ENTRY_LEN as u64 + self.overhead();
            sections.push(SectionRef {
                first_key,
                entries,
                offset,
                stored_len: u32::try_from(stored_len).map_err(|_| bad("a section past 4 GiB"))?,
                checksum,
            });
            offset += stored_len;
            total += u64::from(entries);
        }
        d.finish()?;
        if total != block.entries {
            return Err(bad(format!(
                "directory block {b} holds {total} entries, the top level says {}",
                block.entries
            )));
        }
        Ok(Directory {
            first_section: block.first_section,
            sections,
            end_key,
        })
    }

    fn overhead(&self) -> u64 {
        if self.sealed {
            SEAL_OVERHEAD as u64
        } else {
            0
        }
    }

    /// Checks and decodes pack block `b` from its stored bytes.
    pub fn open_pack_block(
        &self,
        b: usize,
        stored: &[u8],
        key: Option<&MasterKey>,
    ) -> Result<PackBlock, CryptoError> {
        let piece = self
            .pack_blocks
            .get(b)
            .ok_or_else(|| bad(format!("no pack block {b}")))?;
        let at = self.piece_at(piece)?;
        let plain = open_piece(self.sealed, key, "index run pack block", stored, at)?;
        let mut d = Decoder::new(&plain, "index run pack block");
        let mut packs: Vec<Id> = Vec::with_capacity(plain.len() / 32);
        while d.remaining() > 0 {
            let p = d.id()?;
            if packs.last().is_some_and(|l| *l >= p) {
                return Err(bad(format!("pack block {b}: ids out of order")));
            }
            packs.push(p);
        }
        Ok(PackBlock(packs))
    }

    /// Checks and decodes the filter (version 3) from its stored bytes.
    pub fn open_filter(
        &self,
        stored: &[u8],
        key: Option<&MasterKey>,
    ) -> Result<Bloom, CryptoError> {
        let at = self
            .filter_at
            .as_ref()
            .ok_or_else(|| bad("the filter came with the meta"))?;
        let plain = open_piece(self.sealed, key, "index run filter", stored, at)?;
        let mut d = Decoder::new(&plain, "index run filter");
        let filter = Bloom::decode_from(&mut d, WHAT)?;
        d.finish()?;
        Ok(filter)
    }

    /// Checks and decodes section `j` of directory `dir` from its stored bytes.
    pub fn open_section(
        &self,
        dir: &Directory,
        j: usize,
        stored: &[u8],
        key: Option<&MasterKey>,
    ) -> Result<Vec<Entry>, CryptoError> {
        let s = dir
            .sections
            .get(j)
            .ok_or_else(|| bad(format!("no section {j} in its directory block")))?;
        let at = PieceAt {
            range: s.range(),
            checksum: s.checksum,
        };
        let plain = open_piece(self.sealed, key, "index run section", stored, &at)?;
        let next = dir.next_key(j);
        let mut d = Decoder::new(&plain, "index run section");
        let mut entries = Vec::with_capacity(s.entries as usize);
        for _ in 0..s.entries {
            let e = Entry {
                key: d.u64()?,
                pack: d.u32()?,
            };
            let in_order = match entries.last() {
                None => e.key == s.first_key,
                Some(prev) => *prev < e,
            };
            if !in_order || next.is_some_and(|n| e.key >= n) || e.pack >= self.pack_count {
                return Err(bad(format!(
                    "section {}: entry {} out of order, out of its section or naming no pack",
                    dir.first_section as usize + j,
                    entries.len()
                )));
            }
            entries.push(e);
        }
        d.finish()?;
        Ok(entries)
    }
}

/// The pack ordinals `entries` (one section's) list for `key`: candidates, to be checked in
/// the packs' trailers.
pub fn ordinals_of(entries: &[Entry], key: u64) -> impl Iterator<Item = u32> + '_ {
    let start = entries.partition_point(|e| e.key < key);
    entries[start..]
        .iter()
        .take_while(move |e| e.key == key)
        .map(|e| e.pack)
}

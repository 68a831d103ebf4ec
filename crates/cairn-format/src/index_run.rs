//! Index runs (format v2, issues 16 and 17): where chunks and groups are, read in pieces.
//!
//! v1 readers load every index file whole (48 bytes per chunk, held in one map). A v2 run is
//! an immutable sorted table that a reader consults without loading it: the footer and the
//! *meta* part (pack table, fence keys, a Bloom filter) first, then only the ~4 KiB section a
//! lookup falls in — a ranged read on S3. An entry is 12 bytes: the first 8 bytes of an id
//! (chunk, node or group id: the three never share a value, see `group::group_id`) and the
//! ordinal of the pack that holds it. The key is a *candidate*, not a proof: the pack's
//! trailer, read and cached per pack, lists the full ids, and readers check them there, so an
//! 8-byte collision (about one in 2^64 per lookup, or crafted) costs one more trailer lookup
//! and never a wrong answer. With 4 KiB chunks that puts the index near 0.8% of the stored
//! bytes (BENCHMARKS §7 asked for under ~16 bytes per chunk).
//!
//! ```text
//! offset  size  field
//! 0       8     magic "CRNIRUN\0"
//! 8       4     version (u32) = 2 (1 is read too: its filter hashes the full ids)
//! 12      4     flags (u32): bit 0 = sealed (sections and meta encrypted); others 0
//! 16      ...   sections, back to back; a section = n × (key (u64) | pack ordinal (u32)),
//!               sorted by (key, pack ordinal), no entry twice; sealed: domain "index file"
//! M       L     meta, sealed as one object when the run is:
//!                 pack count P (u32) | P × pack id (32)
//!                 section count S (u32) | S × (first key (u64) | entry count (u32)
//!                   | offset (u32) | stored length (u32) | BLAKE3 of the stored section (32))
//!                 filter: log2 of its bits (u8) | probes (u8) | bits (see `summary::Bloom`),
//!                   over the distinct keys (`ProbeKey::of_key`), so a merge of runs rebuilds it
//!                   from their entries alone
//! M+L     52    footer: L (u32) | entry count (u64) | BLAKE3 of the L meta bytes (32)
//!               | "CRNIREND"
//! ```
//! A key's entries never straddle two sections, so a lookup reads exactly one: the last
//! whose first key is ≤ the key. Sections are contiguous from offset 16 to M; the meta's
//! per-section checksums (authenticated with the meta when sealed) bind each section to its
//! place, so one cannot be swapped for another.

use crate::codec::{Decoder, Encoder};
use crate::crypto::{open_if_sealed, CryptoError, Domain, MasterKey, SEAL_OVERHEAD};
use crate::summary::{Bloom, ProbeKey};
use crate::{FormatError, Id};

pub const MAGIC: &[u8; 8] = b"CRNIRUN\0";
pub const END_MAGIC: &[u8; 8] = b"CRNIREND";
/// The version writers write. Version 1 (read still) differs only in its filter, which hashes
/// the full ids — so only the pack trailers, which hold them, could rebuild it.
pub const VERSION: u32 = 2;
/// The oldest version readers accept.
pub const FIRST_VERSION: u32 = 1;
pub const HEADER_LEN: usize = 16;
pub const FOOTER_LEN: usize = 4 + 8 + 32 + 8;
pub const ENTRY_LEN: usize = 12;
/// Entries per section a writer aims at: about 4 KiB.
pub const SECTION_ENTRIES: usize = 340;
/// Filter geometry: 10 bits per entry before rounding up to a power of two (1–2% false
/// "maybe"s), 7 probes.
const FILTER_BITS_PER_ENTRY: u16 = 10;
const FILTER_PROBES: u8 = 7;
const FLAG_SEALED: u32 = 1;
const SECTION_REF_LEN: usize = 8 + 4 + 4 + 4 + 32;
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

/// Where a section is and what it holds (from the meta).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SectionRef {
    pub first_key: u64,
    pub entries: u32,
    pub offset: u32,
    pub stored_len: u32,
    pub checksum: [u8; 32],
}

impl SectionRef {
    /// The section's stored bytes in the run.
    pub fn range(&self) -> std::ops::Range<u64> {
        let start = u64::from(self.offset);
        start..start + u64::from(self.stored_len)
    }
}

/// What a reader holds of a run: everything but the sections.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunMeta {
    /// 1: the filter hashes full ids; 2: it hashes the 8-byte keys.
    pub version: u32,
    pub sealed: bool,
    pub packs: Vec<Id>,
    pub sections: Vec<SectionRef>,
    /// `None` once a reader took it out to keep within its memory budget: every id then
    /// passes, and the fence keys alone choose the section.
    pub filter: Option<Bloom>,
    pub entries: u64,
}

/// The footer: where the meta is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Footer {
    pub meta_len: u32,
    pub entries: u64,
    pub meta_checksum: [u8; 32],
}

/// Builds a run from (id, pack id) pairs: the index of one commit's packs, or a compaction.
pub fn write_run(locations: &[(Id, Id)], key: Option<&MasterKey>) -> Vec<u8> {
    write_run_with(locations, key, SECTION_ENTRIES)
}

/// [`write_run`] with a given section size (tests, golden vectors).
#[doc(hidden)]
pub fn write_run_with(
    locations: &[(Id, Id)],
    key: Option<&MasterKey>,
    section_entries: usize,
) -> Vec<u8> {
    let mut packs: Vec<Id> = locations.iter().map(|(_, p)| *p).collect();
    packs.sort_unstable();
    packs.dedup();
    let mut entries: Vec<Entry> = locations
        .iter()
        .map(|(id, p)| Entry {
            key: key_of(id),
            pack: packs.binary_search(p).expect("listed") as u32,
        })
        .collect();
    entries.sort_unstable();
    entries.dedup();
    let mut w = RunWriter::with_sections(packs, entries.len() as u64, key, section_entries);
    for e in entries {
        w.push(e);
    }
    w.finish()
}

/// Writes a version 2 run from entries given in order — the way a compaction merges runs
/// from their own sections without the ids' other 24 bytes. Entries must come sorted by
/// (key, pack ordinal); a repeat of the last entry is dropped.
pub struct RunWriter<'k> {
    key: Option<&'k MasterKey>,
    packs: Vec<Id>,
    section_entries: usize,
    filter: Bloom,
    out: Vec<u8>,
    sections: Vec<SectionRef>,
    /// Entries of the section being filled.
    pending: Vec<Entry>,
    last: Option<Entry>,
    entries: u64,
}

impl<'k> RunWriter<'k> {
    /// A writer for about `expected` entries (the filter's size) naming `packs` (sorted, no
    /// repeats: the pack ordinals of the entries index it).
    pub fn new(packs: Vec<Id>, expected: u64, key: Option<&'k MasterKey>) -> RunWriter<'k> {
        Self::with_sections(packs, expected, key, SECTION_ENTRIES)
    }

    fn with_sections(
        packs: Vec<Id>,
        expected: u64,
        key: Option<&'k MasterKey>,
        section_entries: usize,
    ) -> RunWriter<'k> {
        debug_assert!(
            packs.windows(2).all(|w| w[0] < w[1]),
            "packs sorted, no repeats"
        );
        let mut out = Vec::with_capacity(HEADER_LEN + expected as usize * ENTRY_LEN + 1024);
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        let flags = if key.is_some() { FLAG_SEALED } else { 0 };
        out.extend_from_slice(&flags.to_le_bytes());
        RunWriter {
            key,
            packs,
            section_entries: section_entries.max(1),
            filter: Bloom::with_capacity(expected, FILTER_BITS_PER_ENTRY, FILTER_PROBES),
            out,
            sections: Vec::new(),
            pending: Vec::new(),
            last: None,
            entries: 0,
        }
    }

    /// Adds `e` (after every entry pushed before it in (key, pack) order).
    pub fn push(&mut self, e: Entry) {
        assert!(
            (e.pack as usize) < self.packs.len(),
            "an entry names a pack of the table"
        );
        match self.last {
            Some(last) if last == e => return,
            Some(last) => assert!(last < e, "entries pushed in order"),
            None => {}
        }
        // Cut after `section_entries`, later while the key repeats.
        if self.pending.len() >= self.section_entries
            && self.pending.last().is_some_and(|p| p.key != e.key)
        {
            self.cut();
        }
        if self.last.is_none_or(|l| l.key != e.key) {
            self.filter.insert(ProbeKey::of_key(e.key));
        }
        self.pending.push(e);
        self.last = Some(e);
        self.entries += 1;
    }

    /// Entries pushed (repeats not counted).
    pub fn entries(&self) -> u64 {
        self.entries
    }

    fn cut(&mut self) {
        let Some(first) = self.pending.first() else {
            return;
        };
        let mut e = Encoder::with_capacity(self.pending.len() * ENTRY_LEN);
        for x in &self.pending {
            e.u64(x.key).u32(x.pack);
        }
        let plain = e.finish();
        let stored = match self.key {
            None => plain,
            Some(k) => k.seal(Domain::IndexFile, &plain),
        };
        self.sections.push(SectionRef {
            first_key: first.key,
            entries: self.pending.len() as u32,
            offset: u32::try_from(self.out.len()).expect("index run past 4 GiB"),
            stored_len: stored.len() as u32,
            checksum: *blake3::hash(&stored).as_bytes(),
        });
        self.out.extend_from_slice(&stored);
        self.pending.clear();
    }

    /// The run's bytes.
    pub fn finish(mut self) -> Vec<u8> {
        self.cut();
        let mut e = Encoder::with_capacity(
            8 + self.packs.len() * 32 + self.sections.len() * SECTION_REF_LEN,
        );
        e.u32(self.packs.len() as u32);
        for p in &self.packs {
            e.id(p);
        }
        e.u32(self.sections.len() as u32);
        for s in &self.sections {
            e.u64(s.first_key)
                .u32(s.entries)
                .u32(s.offset)
                .u32(s.stored_len)
                .bytes(&s.checksum);
        }
        self.filter.encode_into(&mut e);
        let meta = match self.key {
            None => e.finish(),
            Some(k) => k.seal(Domain::IndexFile, &e.finish()),
        };
        let mut out = self.out;
        out.extend_from_slice(&meta);
        out.extend_from_slice(&(meta.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.entries.to_le_bytes());
        out.extend_from_slice(blake3::hash(&meta).as_bytes());
        out.extend_from_slice(END_MAGIC);
        out
    }
}

fn bad(reason: impl Into<String>) -> CryptoError {
    FormatError::invalid(WHAT, reason).into()
}

/// Parses the last [`FOOTER_LEN`] bytes of a run.
pub fn parse_footer(tail: &[u8]) -> Result<Footer, CryptoError> {
    if tail.len() != FOOTER_LEN {
        return Err(FormatError::Truncated {
            what: WHAT,
            needed: FOOTER_LEN as u64,
            available: tail.len() as u64,
        }
        .into());
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
        return Err(FormatError::Truncated {
            what: WHAT,
            needed: HEADER_LEN as u64,
            available: head.len() as u64,
        }
        .into());
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

/// Parses and checks the meta of a run of `run_len` bytes, given its header, footer and the
/// `footer.meta_len` bytes before the footer.
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
    if stored_meta.len() != footer.meta_len as usize {
        return Err(FormatError::Truncated {
            what: WHAT,
            needed: footer.meta_len.into(),
            available: stored_meta.len() as u64,
        }
        .into());
    }
    if blake3::hash(stored_meta).as_bytes() != &footer.meta_checksum {
        return Err(FormatError::Checksum {
            what: "index run meta",
        }
        .into());
    }
    let meta = open_if_sealed(
        sealed,
        key,
        Domain::IndexFile,
        "index run meta",
        stored_meta,
    )?;
    let meta = &meta[..];
    let mut d = Decoder::new(meta, WHAT);
    let pack_count = d.u32()? as usize;
    if pack_count > d.remaining() / 32 {
        return Err(bad(format!(
            "{pack_count} packs in a meta of {} bytes",
            meta.len()
        )));
    }
    let packs = (0..pack_count)
        .map(|_| d.id())
        .collect::<Result<Vec<_>, _>>()?;
    let section_count = d.u32()? as usize;
    if section_count > d.remaining() / SECTION_REF_LEN {
        return Err(bad(format!(
            "{section_count} sections in a meta of {} bytes",
            meta.len()
        )));
    }
    let overhead = if sealed { SEAL_OVERHEAD as u64 } else { 0 };
    let mut sections = Vec::with_capacity(section_count);
    let (mut next_offset, mut total) = (HEADER_LEN as u64, 0u64);
    for _ in 0..section_count {
        let s = SectionRef {
            first_key: d.u64()?,
            entries: d.u32()?,
            offset: d.u32()?,
            stored_len: d.u32()?,
            checksum: d.take(32)?.try_into().expect("32 bytes"),
        };
        if s.entries == 0
            || u64::from(s.offset) != next_offset
            || u64::from(s.stored_len) != u64::from(s.entries) * ENTRY_LEN as u64 + overhead
        {
            return Err(bad(format!(
                "section at {} ({} entries in {} bytes) is not where or as long as it should be",
                s.offset, s.entries, s.stored_len
            )));
        }
        if sections
            .last()
            .is_some_and(|p: &SectionRef| p.first_key >= s.first_key)
        {
            return Err(bad("section fence keys do not increase"));
        }
        next_offset += u64::from(s.stored_len);
        total += u64::from(s.entries);
        sections.push(s);
    }
    if next_offset != meta_start {
        return Err(bad("sections do not end where the meta begins"));
    }
    if total != footer.entries {
        return Err(bad(format!(
            "sections hold {total} entries, the footer says {}",
            footer.entries
        )));
    }
    let filter = Bloom::decode_from(&mut d, WHAT)?;
    d.finish()?;
    Ok(RunMeta {
        version,
        sealed,
        packs,
        sections,
        filter: Some(filter),
        entries: footer.entries,
    })
}

/// Parses a whole run held in memory (compaction, verify, tests).
pub fn parse_run(run: &[u8], key: Option<&MasterKey>) -> Result<RunMeta, CryptoError> {
    if run.len() < HEADER_LEN + FOOTER_LEN {
        return Err(FormatError::Truncated {
            what: WHAT,
            needed: (HEADER_LEN + FOOTER_LEN) as u64,
            available: run.len() as u64,
        }
        .into());
    }
    let footer = parse_footer(&run[run.len() - FOOTER_LEN..])?;
    let end = run.len() - FOOTER_LEN;
    let start = end
        .checked_sub(footer.meta_len as usize)
        .ok_or_else(|| bad("meta longer than the run"))?;
    parse_meta(
        run.len() as u64,
        &run[..HEADER_LEN],
        &footer,
        &run[start..end],
        key,
    )
}

impl RunMeta {
    /// The section that would hold `id`'s entries, unless the filter rules it out.
    pub fn section_for(&self, id: &Id) -> Option<usize> {
        match &self.filter {
            Some(filter) if !self.filter_passes(filter, id) => None,
            _ => self.section_of(id),
        }
    }

    /// Whether `filter` (this run's, perhaps held apart from the meta) lets `id` through.
    pub fn filter_passes(&self, filter: &Bloom, id: &Id) -> bool {
        filter.contains_probe(match self.version {
            1 => ProbeKey::of(id),
            _ => ProbeKey::of_key(key_of(id)),
        })
    }

    /// The section whose fence keys cover `id`'s key (no filter asked).
    pub fn section_of(&self, id: &Id) -> Option<usize> {
        let key = key_of(id);
        match self.sections.partition_point(|s| s.first_key <= key) {
            0 => None,
            i => Some(i - 1),
        }
    }

    /// Checks and decodes section `i` from its stored bytes.
    pub fn open_section(
        &self,
        i: usize,
        stored: &[u8],
        key: Option<&MasterKey>,
    ) -> Result<Vec<Entry>, CryptoError> {
        let s = self
            .sections
            .get(i)
            .ok_or_else(|| bad(format!("no section {i}")))?;
        if stored.len() != s.stored_len as usize {
            return Err(FormatError::Truncated {
                what: "index run section",
                needed: s.stored_len.into(),
                available: stored.len() as u64,
            }
            .into());
        }
        if blake3::hash(stored).as_bytes() != &s.checksum {
            return Err(FormatError::Checksum {
                what: "index run section",
            }
            .into());
        }
        let plain = open_if_sealed(
            self.sealed,
            key,
            Domain::IndexFile,
            "index run section",
            stored,
        )?;
        let plain = &plain[..];
        let next = self.sections.get(i + 1).map(|n| n.first_key);
        let mut d = Decoder::new(plain, "index run section");
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
            if !in_order || next.is_some_and(|n| e.key >= n) || e.pack as usize >= self.packs.len()
            {
                return Err(bad(format!(
                    "section {i}: entry {} out of order, out of its section or naming no pack",
                    entries.len()
                )));
            }
            entries.push(e);
        }
        d.finish()?;
        Ok(entries)
    }

    /// The packs that may hold `id`, given its section's entries (candidates: check the full
    /// id in the pack's trailer).
    pub fn candidates<'a>(
        &'a self,
        entries: &'a [Entry],
        id: &Id,
    ) -> impl Iterator<Item = Id> + 'a {
        let key = key_of(id);
        let start = entries.partition_point(|e| e.key < key);
        entries[start..]
            .iter()
            .take_while(move |e| e.key == key)
            .map(|e| self.packs[e.pack as usize])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn locations(n: u32) -> Vec<(Id, Id)> {
        (0..n)
            .map(|i| (Id::of(&i.to_le_bytes()), Id::of(&[(i % 3) as u8])))
            .collect()
    }

    fn lookup(run: &[u8], meta: &RunMeta, id: &Id, key: Option<&MasterKey>) -> Vec<Id> {
        let Some(i) = meta.section_for(id) else {
            return Vec::new();
        };
        let r = meta.sections[i].range();
        let entries = meta
            .open_section(i, &run[r.start as usize..r.end as usize], key)
            .unwrap();
        meta.candidates(&entries, id).collect()
    }

    #[test]
    fn every_id_is_found_in_one_section_and_absent_ids_mostly_are_not() {
        for key in [None, Some(MasterKey::generate())] {
            let locs = locations(2000);
            let run = write_run_with(&locs, key.as_ref(), 100);
            let meta = parse_run(&run, key.as_ref()).unwrap();
            assert_eq!(meta.entries, 2000);
            assert_eq!(meta.packs.len(), 3);
            assert_eq!(meta.sections.len(), 20);
            for (id, pack) in &locs {
                assert_eq!(lookup(&run, &meta, id, key.as_ref()), vec![*pack]);
            }
            let absent = (2000u32..12000)
                .filter(|i| meta.section_for(&Id::of(&i.to_le_bytes())).is_some())
                .count();
            assert!(
                absent < 300,
                "{absent} of 10,000 absent ids pass the filter"
            );
            for i in 2000u32..2100 {
                assert!(lookup(&run, &meta, &Id::of(&i.to_le_bytes()), key.as_ref()).is_empty());
            }
        }
    }

    #[test]
    fn equal_keys_stay_in_one_section_and_all_come_back() {
        // One id in three packs, and ids forged to share a key: never split by a section cut.
        let same = Id::of(b"everywhere");
        let mut locs: Vec<(Id, Id)> = (0..3u8).map(|p| (same, Id::of(&[p]))).collect();
        for i in 0..10u8 {
            let mut forged = *same.as_bytes();
            forged[31] = i;
            locs.push((Id(forged), Id::of(&[9])));
        }
        locs.extend(locations(50));
        let run = write_run_with(&locs, None, 4);
        let meta = parse_run(&run, None).unwrap();
        let mut packs = lookup(&run, &meta, &same, None);
        packs.sort();
        let mut want: Vec<Id> = (0..3u8)
            .map(|p| Id::of(&[p]))
            .chain([Id::of(&[9])])
            .collect();
        want.sort();
        assert_eq!(
            packs, want,
            "three packs hold it, and the forged ids are candidates"
        );
    }

    #[test]
    fn an_empty_run_is_valid_and_finds_nothing() {
        let run = write_run(&[], None);
        let meta = parse_run(&run, None).unwrap();
        assert_eq!((meta.entries, meta.sections.len()), (0, 0));
        assert!(meta.section_for(&Id::of(b"x")).is_none());
    }

    #[test]
    fn damage_anywhere_is_refused() {
        for key in [None, Some(MasterKey::generate())] {
            let locs = locations(50);
            let run = write_run_with(&locs, key.as_ref(), 16);
            let meta = parse_run(&run, key.as_ref()).unwrap();
            for at in 0..run.len() {
                let mut bad = run.clone();
                bad[at] ^= 0x10;
                // Damage in a section shows when the section is opened, elsewhere at once.
                let refused = match parse_run(&bad, key.as_ref()) {
                    Err(_) => true,
                    Ok(m) => (0..m.sections.len()).any(|i| {
                        let r = m.sections[i].range();
                        m.open_section(i, &bad[r.start as usize..r.end as usize], key.as_ref())
                            .is_err()
                    }),
                };
                assert!(refused, "flip at {at} of {} accepted", run.len());
            }
            for n in 0..run.len() {
                assert!(
                    parse_run(&run[..n], key.as_ref()).is_err(),
                    "truncation to {n}"
                );
            }
            // A section from elsewhere in the run does not pass for another.
            let (a, b) = (meta.sections[0].range(), meta.sections[1].range());
            assert!(meta
                .open_section(0, &run[b.start as usize..b.end as usize], key.as_ref())
                .is_err());
            assert!(meta
                .open_section(1, &run[a.start as usize..a.end as usize], key.as_ref())
                .is_err());
        }
    }

    #[test]
    fn a_sealed_run_needs_its_key_and_hides_its_keys() {
        let key = MasterKey::generate();
        let locs = locations(30);
        let run = write_run(&locs, Some(&key));
        assert!(parse_run(&run, None).is_err());
        assert!(matches!(
            parse_run(&run, Some(&MasterKey::generate())),
            Err(CryptoError::Tampered { .. })
        ));
        let k = key_of(&locs[0].0).to_le_bytes();
        assert!(!run.windows(8).any(|w| w == k), "a key in clear text");
    }
}

//! Writing version 3 runs: sections as entries come, directory blocks and pack blocks after
//! them, then the filter and the top level.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::io::{self, Write};

use crate::codec::Encoder;
use crate::crypto::{Domain, MasterKey};
use crate::summary::{Bloom, ProbeKey};
use crate::Id;

use super::{
    key_of, Entry, BLOCK_SECTIONS, END_MAGIC, ENTRY_LEN, FILTER_BITS_PER_ENTRY, FILTER_PROBES,
    FLAG_SEALED, HEADER_LEN, MAGIC, PACKS_PER_BLOCK, SECTION_ENTRIES, VERSION,
};

/// How a writer cuts a run into pieces. Readers accept any geometry; tests and golden
/// vectors use small ones to have many pieces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Entries per section (a section is cut later while its last key repeats).
    pub section_entries: usize,
    /// Sections per directory block.
    pub block_sections: usize,
    /// Pack ids per pack block.
    pub packs_per_block: u32,
}

impl Default for Geometry {
    fn default() -> Self {
        Geometry {
            section_entries: SECTION_ENTRIES,
            block_sections: BLOCK_SECTIONS,
            packs_per_block: PACKS_PER_BLOCK,
        }
    }
}

/// Builds a run from (id, pack id) pairs: the index of one commit's packs, or a repair.
pub fn write_run(locations: &[(Id, Id)], key: Option<&MasterKey>) -> Vec<u8> {
    write_run_with(locations, key, Geometry::default())
}

/// [`write_run`] with a given geometry (tests, golden vectors).
pub fn write_run_with(locations: &[(Id, Id)], key: Option<&MasterKey>, g: Geometry) -> Vec<u8> {
    RunEntries::from_locations(locations).write_with(key, g)
}

/// What a run will name, gathered pack by pack at 8 bytes an id (the key the run stores)
/// instead of the 64 of an (id, pack id) pair: a commit of a 64 GiB image gathers a million
/// of them, and its peak memory was the pairs' (113 MiB of 184).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RunEntries {
    packs: Vec<(Id, Vec<u64>)>,
    entries: usize,
}

impl RunEntries {
    /// Adds the ids pack `pack` stores.
    pub fn add_pack<'a>(&mut self, pack: Id, ids: impl IntoIterator<Item = &'a Id>) {
        self.add_keys(pack, ids.into_iter().map(key_of).collect());
    }

    /// Adds the keys ([`key_of`]) of the ids pack `pack` stores.
    pub fn add_keys(&mut self, pack: Id, keys: Vec<u64>) {
        self.entries += keys.len();
        self.packs.push((pack, keys));
    }

    /// Entries from (id, pack id) pairs, in any order.
    pub fn from_locations(locations: &[(Id, Id)]) -> RunEntries {
        let mut by_pack: std::collections::BTreeMap<Id, Vec<u64>> = Default::default();
        for (id, pack) in locations {
            by_pack.entry(*pack).or_default().push(key_of(id));
        }
        RunEntries {
            entries: locations.len(),
            packs: by_pack.into_iter().collect(),
        }
    }

    /// Ids added (repeats counted).
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// The packs added (in the order they were).
    pub fn packs(&self) -> impl Iterator<Item = &Id> {
        self.packs.iter().map(|(p, _)| p)
    }

    /// Every key added, sorted, each once (what the run will locate).
    pub fn sorted_keys(&self) -> Vec<u64> {
        let mut keys: Vec<u64> = self
            .packs
            .iter()
            .flat_map(|(_, k)| k.iter().copied())
            .collect();
        keys.sort_unstable();
        keys.dedup();
        keys
    }

    /// Each addition's pack and how many ids it brought.
    pub fn counts(&self) -> impl Iterator<Item = (&Id, usize)> {
        self.packs.iter().map(|(p, keys)| (p, keys.len()))
    }

    /// The entries against pack table `table` (sorted, which holds every pack added), in
    /// order, each once.
    pub fn entries_in(self, table: &[Id]) -> Vec<Entry> {
        let mut entries: Vec<Entry> = Vec::with_capacity(self.entries);
        for (pack, keys) in self.packs {
            let pack = table.binary_search(&pack).expect("in the table") as u32;
            entries.extend(keys.into_iter().map(|key| Entry { key, pack }));
        }
        entries.sort_unstable();
        entries.dedup();
        entries
    }

    /// The pack table (sorted, no repeats) and the entries in order, each once.
    fn table_and_entries(self) -> (Vec<Id>, Vec<Entry>) {
        let table = pack_table(self.packs.iter().map(|(p, _)| *p));
        let entries = self.entries_in(&table);
        (table, entries)
    }

    /// The run's bytes.
    pub fn write(self, key: Option<&MasterKey>) -> Vec<u8> {
        self.write_with(key, Geometry::default())
    }

    /// [`Self::write`] with a given geometry. The pack table is sorted, without repeats; the
    /// entries are sorted by (key, pack ordinal), each once (the writer drops repeats).
    pub fn write_with(self, key: Option<&MasterKey>, g: Geometry) -> Vec<u8> {
        let (table, expected, entries) = self.into_sorted();
        let mut w = RunWriter::with_geometry(table, expected, key, g);
        for e in entries {
            w.push(e.expect("entries in memory"));
        }
        w.finish()
    }

    /// [`Self::write_with`] into `out` (a file, so that a commit's run is never whole in
    /// memory): the sink, and the run's id (the hash of its bytes).
    pub fn write_to<W: Write>(
        self,
        out: W,
        key: Option<&MasterKey>,
        g: Geometry,
    ) -> io::Result<(W, Id)> {
        let (table, expected, entries) = self.into_sorted();
        let mut w = RunWriter::to_writer(out, table, expected, key, g);
        for e in entries {
            w.push(e?);
        }
        w.finish_to()
    }

    /// The pack table (sorted, no repeats), the entries expected, and the entries in order
    /// (repeats included, which the writer drops), merged from each addition's keys sorted
    /// in place: [`Self::entries_in`] made a second array of them at 16 bytes an entry
    /// beside the keys' 8 (17 MiB of a 64 GiB first commit's 35 MiB heap peak, while it
    /// wrote its run).
    pub fn into_sorted(
        self,
    ) -> (
        Vec<Id>,
        u64,
        impl Iterator<Item = io::Result<Entry>> + Send + 'static,
    ) {
        let table = pack_table(self.packs.iter().map(|(p, _)| *p));
        let packs = self
            .packs
            .into_iter()
            .map(|(pack, mut keys)| {
                keys.sort_unstable();
                let pack = table.binary_search(&pack).expect("in the table") as u32;
                (pack, keys.into_iter().map(Ok))
            })
            .collect();
        (table, self.entries as u64, merge_pack_keys(packs))
    }
}

/// The pack table of a run naming `packs`: sorted, without repeats.
pub fn pack_table(packs: impl IntoIterator<Item = Id>) -> Vec<Id> {
    let mut table: Vec<Id> = packs.into_iter().collect();
    table.sort_unstable();
    table.dedup();
    table
}

/// The entries of several packs' keys, in order: `packs` are (ordinal in the run's pack
/// table, that pack's keys ascending). Keys are taken one at a time from each source, so a
/// source may read them from a file as they are needed (a commit's staged keys). The first
/// error a source gives ends the entries.
pub fn merge_pack_keys<I>(packs: Vec<(u32, I)>) -> impl Iterator<Item = io::Result<Entry>>
where
    I: Iterator<Item = io::Result<u64>>,
{
    let mut packs = packs;
    let mut failed = None;
    let mut heap = BinaryHeap::with_capacity(packs.len());
    for (i, (pack, keys)) in packs.iter_mut().enumerate() {
        match keys.next() {
            Some(Ok(key)) => heap.push(Reverse((Entry { key, pack: *pack }, i))),
            Some(Err(e)) => failed = failed.or(Some(e)),
            None => {}
        }
    }
    std::iter::from_fn(move || {
        if let Some(e) = failed.take() {
            heap.clear();
            return Some(Err(e));
        }
        let Reverse((e, i)) = heap.pop()?;
        let (pack, keys) = &mut packs[i];
        match keys.next() {
            Some(Ok(key)) => heap.push(Reverse((Entry { key, pack: *pack }, i))),
            Some(Err(err)) => failed = Some(err),
            None => {}
        }
        Some(Ok(e))
    })
}

/// What the top level will say of one directory block.
struct BlockTop {
    first_key: u64,
    sections: u32,
    entries: u64,
    checksum: [u8; 32],
}

/// Writes a version 3 run from entries given in order — the way a compaction merges runs
/// from their own sections without the ids' other 24 bytes. Entries must come sorted by
/// (key, pack ordinal); a repeat of the last entry is dropped.
///
/// The header and the sections go to `W` as they are made (a file a commit publishes as
/// it is, or memory), hashed on the way: the run's id is the hash of its bytes.
pub struct RunWriter<'k, W: Write = Vec<u8>> {
    key: Option<&'k MasterKey>,
    packs: Vec<Id>,
    geometry: Geometry,
    filter: Bloom,
    /// Header and sections, as they are made.
    out: W,
    /// The hash of what went to `out`, for a writer to a sink ([`RunWriter::to_writer`]); a
    /// run in memory is hashed where it is stored, once.
    hasher: Option<blake3::Hasher>,
    /// The first error `out` gave (then nothing more is written).
    error: Option<io::Error>,
    /// Stored directory blocks, back to back.
    directory: Vec<u8>,
    blocks: Vec<BlockTop>,
    /// The directory block being filled (plain) and what it covers.
    block: Encoder,
    block_top: Option<BlockTop>,
    /// Entries of the section being filled.
    pending: Vec<Entry>,
    last: Option<Entry>,
    entries: u64,
}

impl<'k> RunWriter<'k> {
    /// A writer for about `expected` entries (the filter's size) naming `packs` (sorted, no
    /// repeats: the pack ordinals of the entries index it).
    pub fn new(packs: Vec<Id>, expected: u64, key: Option<&'k MasterKey>) -> RunWriter<'k> {
        Self::with_geometry(packs, expected, key, Geometry::default())
    }

    /// [`Self::new`] with a given geometry.
    pub fn with_geometry(
        packs: Vec<Id>,
        expected: u64,
        key: Option<&'k MasterKey>,
        geometry: Geometry,
    ) -> RunWriter<'k> {
        let out = Vec::with_capacity(HEADER_LEN + expected as usize * ENTRY_LEN + 1024);
        RunWriter::start(out, None, packs, expected, key, geometry)
    }

    /// The run's bytes.
    pub fn finish(self) -> Vec<u8> {
        self.end().expect("writing to memory").0
    }
}

impl<'k, W: Write> RunWriter<'k, W> {
    /// [`RunWriter::with_geometry`] writing to `out`.
    pub fn to_writer(
        out: W,
        packs: Vec<Id>,
        expected: u64,
        key: Option<&'k MasterKey>,
        geometry: Geometry,
    ) -> RunWriter<'k, W> {
        let hasher = Some(blake3::Hasher::new());
        RunWriter::start(out, hasher, packs, expected, key, geometry)
    }

    fn start(
        out: W,
        hasher: Option<blake3::Hasher>,
        packs: Vec<Id>,
        expected: u64,
        key: Option<&'k MasterKey>,
        geometry: Geometry,
    ) -> RunWriter<'k, W> {
        debug_assert!(
            packs.windows(2).all(|w| w[0] < w[1]),
            "packs sorted, no repeats"
        );
        let mut w = RunWriter {
            key,
            packs,
            geometry: Geometry {
                section_entries: geometry.section_entries.max(1),
                block_sections: geometry.block_sections.max(1),
                packs_per_block: geometry.packs_per_block.max(1),
            },
            filter: Bloom::with_capacity(expected, FILTER_BITS_PER_ENTRY, FILTER_PROBES),
            out,
            hasher,
            error: None,
            directory: Vec::new(),
            blocks: Vec::new(),
            block: Encoder::new(),
            block_top: None,
            pending: Vec::new(),
            last: None,
            entries: 0,
        };
        let flags = if key.is_some() { FLAG_SEALED } else { 0 };
        w.emit(MAGIC);
        w.emit(&VERSION.to_le_bytes());
        w.emit(&flags.to_le_bytes());
        w
    }

    /// Writes `bytes` to the run (after an error, nothing: [`Self::finish_to`] returns it).
    fn emit(&mut self, bytes: &[u8]) {
        if self.error.is_none() {
            if let Some(h) = &mut self.hasher {
                h.update(bytes);
            }
            if let Err(e) = self.out.write_all(bytes) {
                self.error = Some(e);
            }
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
        if self.pending.len() >= self.geometry.section_entries
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

    fn seal(&self, plain: Vec<u8>) -> Vec<u8> {
        match self.key {
            None => plain,
            Some(k) => k.seal(Domain::IndexFile, &plain),
        }
    }

    /// Ends the section being filled: its bytes to the run, its reference to the block.
    fn cut(&mut self) {
        let Some(first) = self.pending.first() else {
            return;
        };
        let first_key = first.key;
        let mut e = Encoder::with_capacity(self.pending.len() * ENTRY_LEN);
        for x in &self.pending {
            e.u64(x.key).u32(x.pack);
        }
        let stored = self.seal(e.finish());
        let entries = self.pending.len() as u32;
        self.block
            .u64(first_key)
            .u32(entries)
            .bytes(blake3::hash(&stored).as_bytes());
        let top = self.block_top.get_or_insert(BlockTop {
            first_key,
            sections: 0,
            entries: 0,
            checksum: [0; 32],
        });
        top.sections += 1;
        top.entries += u64::from(entries);
        let block_full = top.sections as usize >= self.geometry.block_sections;
        self.emit(&stored);
        self.pending.clear();
        if block_full {
            self.end_block();
        }
    }

    /// Ends the directory block being filled.
    fn end_block(&mut self) {
        let Some(mut top) = self.block_top.take() else {
            return;
        };
        let plain = std::mem::take(&mut self.block).finish();
        let stored = self.seal(plain);
        top.checksum = *blake3::hash(&stored).as_bytes();
        self.directory.extend_from_slice(&stored);
        self.blocks.push(top);
    }

    /// Ends a run written to a sink ([`RunWriter::to_writer`]): the sink, holding every
    /// byte, and the run's id (the hash of its bytes); or the first error the sink gave.
    pub fn finish_to(self) -> io::Result<(W, Id)> {
        let (out, hasher) = self.end()?;
        let hasher = hasher.expect("a writer to a sink hashes its run");
        Ok((out, Id(*hasher.finalize().as_bytes())))
    }

    /// Ends the run: the sink, holding every byte, and the hash of them if it was kept.
    fn end(mut self) -> io::Result<(W, Option<blake3::Hasher>)> {
        self.cut();
        self.end_block();
        let directory = std::mem::take(&mut self.directory);
        self.emit(&directory);
        let per = self.geometry.packs_per_block;
        let mut top = Encoder::new();
        top.u32(self.packs.len() as u32).u32(per);
        let packs = std::mem::take(&mut self.packs);
        for block in packs.chunks(per as usize) {
            let mut e = Encoder::with_capacity(block.len() * 32);
            for p in block {
                e.id(p);
            }
            let stored = self.seal(e.finish());
            top.bytes(blake3::hash(&stored).as_bytes());
            self.emit(&stored);
        }
        top.u32(self.blocks.len() as u32);
        for b in &self.blocks {
            top.u64(b.first_key)
                .u32(b.sections)
                .u64(b.entries)
                .bytes(&b.checksum);
        }
        let mut f = Encoder::with_capacity(self.filter.byte_len() + 2);
        self.filter.encode_into(&mut f);
        let filter = self.seal(f.finish());
        top.u64(filter.len() as u64)
            .bytes(blake3::hash(&filter).as_bytes());
        self.emit(&filter);
        let top = self.seal(top.finish());
        self.emit(&top);
        self.emit(&(top.len() as u32).to_le_bytes());
        self.emit(&self.entries.to_le_bytes());
        self.emit(blake3::hash(&top).as_bytes());
        self.emit(END_MAGIC);
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        self.out.flush()?;
        Ok((self.out, self.hasher))
    }
}

/// Writes a version 2 run (what older builds wrote: the section table and pack
/// table whole in the meta), for tests of readers that must still read them.
#[doc(hidden)]
pub fn write_legacy_run(
    locations: &[(Id, Id)],
    key: Option<&MasterKey>,
    section_entries: usize,
) -> Vec<u8> {
    let seal = |plain: Vec<u8>| match key {
        None => plain,
        Some(k) => k.seal(Domain::IndexFile, &plain),
    };
    let (packs, entries) = RunEntries::from_locations(locations).table_and_entries();
    let mut filter =
        Bloom::with_capacity(entries.len() as u64, FILTER_BITS_PER_ENTRY, FILTER_PROBES);
    let mut out = Vec::new();
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&2u32.to_le_bytes());
    let flags = if key.is_some() { FLAG_SEALED } else { 0 };
    out.extend_from_slice(&flags.to_le_bytes());
    let mut refs = Encoder::new();
    let (mut at, mut count) = (0, 0u32);
    while at < entries.len() {
        let mut n = section_entries.max(1).min(entries.len() - at);
        while at + n < entries.len() && entries[at + n].key == entries[at + n - 1].key {
            n += 1;
        }
        let mut e = Encoder::new();
        for x in &entries[at..at + n] {
            e.u64(x.key).u32(x.pack);
            filter.insert(ProbeKey::of_key(x.key));
        }
        let stored = seal(e.finish());
        refs.u64(entries[at].key)
            .u32(n as u32)
            .u32(out.len() as u32)
            .u32(stored.len() as u32)
            .bytes(blake3::hash(&stored).as_bytes());
        out.extend_from_slice(&stored);
        at += n;
        count += 1;
    }
    let mut meta = Encoder::new();
    meta.u32(packs.len() as u32);
    for p in &packs {
        meta.id(p);
    }
    meta.u32(count).bytes(&refs.finish());
    filter.encode_into(&mut meta);
    let meta = seal(meta.finish());
    out.extend_from_slice(&meta);
    out.extend_from_slice(&(meta.len() as u32).to_le_bytes());
    out.extend_from_slice(&(entries.len() as u64).to_le_bytes());
    out.extend_from_slice(blake3::hash(&meta).as_bytes());
    out.extend_from_slice(END_MAGIC);
    out
}

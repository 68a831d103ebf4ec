//! A commit's claims once their generation turned over. Exact mode kept every claim of a
//! commit in memory at 41 bytes: 161 MiB for the first commit of a 64 GiB image holding
//! 4 GiB of data (BENCHMARKS.md, *Studies behind the design*), a gigabyte per 100 GiB of new data. Now a generation's
//! placed claims are written, sorted by id, into a run in an anonymous scratch file; what
//! stays in memory is one Bloom filter over every spilled claim and a fence per block of
//! each run: 2 to 3 bytes a claim (10 to 20 bits of filter, rebuilt twice as large when it
//! fills, and a 36-byte fence per 64 claims).
//!
//! Bounded mode spills too, within a memory budget: when the next spill would take the
//! filter and fences past it, the oldest runs are dropped (their claims forgotten), so it
//! finds a chunk stored again within the last 3 to 6 GiB of a commit's new data (at the
//! default 4 MiB) where it found one within the last 432–864 MiB held in memory.
//!
//! A lookup of a claim that was never spilled (nearly every one: a new chunk) costs one
//! cache line of the filter ([`BlockedBloom`]); one the filter passes reads one block of
//! each run, newest first. The trace benchmark's exact mode, which does nothing else per
//! chunk, runs 20% fewer chunks a second than with every claim in memory; a commit, which
//! hashes and compresses them, no fewer (BENCHMARKS.md, *Studies behind the design*). Runs are merged [`FAN_IN`] at a
//! time into one of the next tier, so a tier holds `FAN_IN` times the claims of the one
//! below and each claim is rewritten once a tier.
//!
//! The files are anonymous (`O_TMPFILE`; else named as the store's temporaries and unlinked
//! at once): a killed commit leaves nothing. They go beside the packs in a local repository
//! (the file system sized for the data), else in the system's temporary directory.
//!
//! A failure here never makes a wrong version: a spill that cannot be written forgets its
//! claims, and a run that cannot be read, or whose block does not match the hash kept with
//! its fence, answers nothing — the chunk is then stored again, as bounded mode stores a
//! chunk whose claim it forgot (space, never correctness). The first failure is logged.

use std::cell::Cell;
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use cairn_format::summary::ProbeKey;
use cairn_format::Id;
use cairn_repo::v2::Placement;

/// Bytes of a spilled claim: its id, its group's id, its slot (little-endian).
const ENTRY: usize = 32 + 32 + 2;
/// Claims a block (4,224 bytes): what a lookup reads after its fence.
const BLOCK: usize = 64;
/// Runs of one tier merged into one of the next.
const FAN_IN: usize = 8;
/// The filter's bits a claim when full (it is rebuilt with twice as many then): with
/// [`BlockedBloom`]'s seven probes in one cache line, about 1% false positives (a block of
/// each run read for nothing) at worst.
const FILTER_BITS: u64 = 10;

/// The spilled claims of one commit.
pub(crate) struct SpilledClaims {
    /// Where run files are made (`None`: the system's temporary directory).
    dir: Option<PathBuf>,
    /// Oldest first; tiers never increase toward the end.
    runs: Vec<Run>,
    /// Memory the filter and fences may take (`None`: no limit, exact mode).
    budget: Option<usize>,
    /// Claims spilled, claims lost to a failure, and claims dropped (with their runs) or
    /// never spilled for the budget.
    pub(crate) spilled: u64,
    pub(crate) lost: u64,
    pub(crate) dropped: u64,
    /// Claims the runs hold.
    held: u64,
    /// Every claim the runs hold (a claim lost to a damaged block when it was rebuilt may be
    /// missing: the chunk is stored again), and those of runs dropped since it was built.
    filter: BlockedBloom,
    /// Claims put in the filter since it was built (held and dropped).
    filtered: u64,
    warned: Cell<bool>,
}

impl std::fmt::Debug for SpilledClaims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpilledClaims")
            .field("runs", &self.runs.len())
            .field("spilled", &self.spilled)
            .field("lost", &self.lost)
            .finish()
    }
}

/// One sorted run.
struct Run {
    file: File,
    tier: u32,
    len: u64,
    /// Per block: its first id and the checksum of its bytes.
    fences: Vec<(Id, u32)>,
}

impl SpilledClaims {
    /// Spilled claims in files in `dir` (`None`: the system's temporary directory), their
    /// filter and fences within `budget` bytes if one is given.
    pub(crate) fn new(dir: Option<PathBuf>, budget: Option<usize>) -> SpilledClaims {
        SpilledClaims {
            dir,
            runs: Vec::new(),
            budget,
            spilled: 0,
            lost: 0,
            dropped: 0,
            held: 0,
            filter: BlockedBloom::new(0),
            filtered: 0,
            warned: Cell::new(false),
        }
    }

    /// Spills `claims` (placed claims, each id once, in any order) as a new run, then merges
    /// full tiers; within the budget, the oldest runs dropped first. Returns how many
    /// claims this forgot: lost to a failure, dropped, or not spilled.
    pub(crate) fn spill(&mut self, mut claims: Vec<(Id, Placement)>) -> u64 {
        if claims.is_empty() {
            return 0;
        }
        let n = claims.len() as u64;
        let forgotten = self.lost + self.dropped;
        if !self.make_room(n) {
            self.dropped += n;
            return self.lost + self.dropped - forgotten;
        }
        claims.sort_unstable_by(|a, b| (prefix(&a.0), &a.0).cmp(&(prefix(&b.0), &b.0)));
        let keys: Vec<ProbeKey> = claims.iter().map(|(id, _)| ProbeKey::of(id)).collect();
        match self.write_run(0, n, claims.into_iter().map(Ok)) {
            Ok(run) => {
                self.runs.push(run);
                self.spilled += n;
                self.held += n;
                self.filtered += n;
                if self.filtered > self.filter.capacity() {
                    self.rebuild_filter(0);
                } else {
                    keys.into_iter().for_each(|k| self.filter.insert(k));
                }
            }
            Err(e) => {
                self.lost += n;
                self.warn(&e);
            }
        }
        self.merge_full_tiers();
        self.lost + self.dropped - forgotten
    }

    /// Makes room for `n` more claims within the budget: when they do not fit, drops the
    /// oldest runs until the rest and the `n` fit half of it, and rebuilds the filter
    /// without the dropped claims. Each claim is so read back about once more, as the
    /// filter's doublings read it, where dropping just enough would rebuild the filter every
    /// few spills from runs holding the whole budget. False if `n` claims do not fit the
    /// budget even with no run left.
    fn make_room(&mut self, n: u64) -> bool {
        let Some(budget) = self.budget else {
            return true;
        };
        if self.memory_after(n, false) <= budget {
            return true;
        }
        while !self.runs.is_empty() && self.memory_after(n, true) > budget / 2 {
            let run = self.runs.remove(0);
            self.held -= run.len;
            self.dropped += run.len;
        }
        let fits = self.memory_after(n, true) <= budget;
        self.rebuild_filter(if fits { n } else { 0 });
        fits
    }

    /// [`SpilledClaims::memory`] once `n` more claims are spilled (before merges, which
    /// never add fences), the filter `rebuilt` for what the runs hold.
    fn memory_after(&self, n: u64, rebuilt: bool) -> usize {
        let filter = if rebuilt || self.filtered + n > self.filter.capacity() {
            BlockedBloom::byte_len_for(self.held + n)
        } else {
            self.filter.byte_len()
        };
        let fences: usize =
            self.runs.iter().map(|r| r.fences.len()).sum::<usize>() + (n as usize).div_ceil(BLOCK);
        filter + fences * std::mem::size_of::<(Id, u32)>()
    }

    /// Where the spilled claim on `id` is, if it was spilled (and can be read back).
    pub(crate) fn get(&self, id: &Id) -> Option<Placement> {
        if !self.filter.contains_probe(ProbeKey::of(id)) {
            return None;
        }
        for run in self.runs.iter().rev() {
            match run.get(id) {
                Ok(Some(p)) => return Some(p),
                Ok(None) => {}
                Err(e) => self.warn(&e),
            }
        }
        None
    }

    /// Runs held.
    #[cfg(test)]
    fn runs(&self) -> usize {
        self.runs.len()
    }

    /// Bytes of memory the filter and the runs' fences take.
    pub(crate) fn memory(&self) -> usize {
        let fences: usize = self.runs.iter().map(|r| r.fences.len()).sum();
        self.filter.byte_len() + fences * std::mem::size_of::<(Id, u32)>()
    }

    /// A filter for the claims the runs hold and `more` to come (its lines a power of two:
    /// room for up to twice as many), from every run's ids (read back in order: 66 bytes a
    /// claim, each read again about once over the commit as the filter doubles). A block
    /// that cannot be read leaves its claims out: lookups then miss them, and the chunks are
    /// stored again. The old filter goes first: the two are never held at once.
    fn rebuild_filter(&mut self, more: u64) {
        self.filter = BlockedBloom::new(0);
        let mut filter = BlockedBloom::new(self.held + more);
        for run in &self.runs {
            for b in 0..run.fences.len() {
                match run.block(b) {
                    Ok(bytes) => bytes
                        .chunks_exact(ENTRY)
                        .for_each(|e| filter.insert(ProbeKey::of(&decode(e).0))),
                    Err(e) => self.warn(&e),
                }
            }
        }
        self.filter = filter;
        self.filtered = self.held;
    }

    fn warn(&self, e: &io::Error) {
        if !self.warned.replace(true) {
            tracing::warn!(
                "claims spilled to a scratch file: {e}; chunks this commit stored and meets \
                 again may be stored twice"
            );
        }
    }

    /// While the newest [`FAN_IN`] runs share a tier, merges them into one of the next.
    fn merge_full_tiers(&mut self) {
        loop {
            let Some(tier) = self.runs.last().map(|r| r.tier) else {
                return;
            };
            let same = self
                .runs
                .iter()
                .rev()
                .take_while(|r| r.tier == tier)
                .count();
            if same < FAN_IN {
                return;
            }
            let from = self.runs.len() - same;
            let len: u64 = self.runs[from..].iter().map(|r| r.len).sum();
            let merged = {
                let entries = Merge::new(&self.runs[from..]);
                self.write_run(tier + 1, len, entries)
            };
            match merged {
                Ok(run) => {
                    self.runs.truncate(from);
                    self.runs.push(run);
                }
                // The runs stay as they are (still answered); the next spill tries again.
                Err(e) => {
                    self.warn(&e);
                    return;
                }
            }
        }
    }

    /// Writes `len` claims (ascending ids) as a run of `tier`.
    fn write_run(
        &self,
        tier: u32,
        len: u64,
        entries: impl Iterator<Item = io::Result<(Id, Placement)>>,
    ) -> io::Result<Run> {
        let file = match &self.dir {
            Some(dir) => scratch_file(dir)?,
            None => tempfile::tempfile()?,
        };
        let mut out = BufWriter::with_capacity(BLOCK * ENTRY * 16, &file);
        let mut fences = Vec::with_capacity((len as usize).div_ceil(BLOCK));
        let mut block = Vec::with_capacity(BLOCK * ENTRY);
        let mut first = Id::ZERO;
        let mut written = 0u64;
        for entry in entries {
            let (id, p) = entry?;
            if block.is_empty() {
                first = id;
            }
            block.extend_from_slice(id.as_bytes());
            block.extend_from_slice(p.group.as_bytes());
            block.extend_from_slice(&p.slot.to_le_bytes());
            written += 1;
            if block.len() == BLOCK * ENTRY {
                fences.push((first, block_hash(&block)));
                out.write_all(&block)?;
                block.clear();
            }
        }
        if !block.is_empty() {
            fences.push((first, block_hash(&block)));
            out.write_all(&block)?;
        }
        out.flush()?;
        drop(out);
        debug_assert_eq!(written, len);
        Ok(Run {
            file,
            tier,
            len: written,
            fences,
        })
    }
}

impl Run {
    /// Block `b`'s bytes, as read.
    fn read_block(&self, b: usize) -> io::Result<Vec<u8>> {
        let first = (b * BLOCK) as u64;
        let n = (self.len - first).min(BLOCK as u64) as usize;
        let mut bytes = vec![0u8; n * ENTRY];
        self.file.read_exact_at(&mut bytes, first * ENTRY as u64)?;
        Ok(bytes)
    }

    /// Whether `bytes` are block `b` as written.
    fn check(&self, b: usize, bytes: &[u8]) -> io::Result<()> {
        if block_hash(bytes) == self.fences[b].1 {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "block {b} of a run of {} claims does not match its hash",
                self.len
            ),
        ))
    }

    /// Block `b`'s bytes, checked against its hash.
    fn block(&self, b: usize) -> io::Result<Vec<u8>> {
        let bytes = self.read_block(b)?;
        self.check(b, &bytes)?;
        Ok(bytes)
    }

    /// The place of `id` in this run. The block is checked against its hash only when it
    /// holds `id`: a block read for a filter's false positive (most reads) answers nothing
    /// whatever its bytes hold, and damage there can only hide a claim, never place one.
    fn get(&self, id: &Id) -> io::Result<Option<Placement>> {
        let b = self.fences.partition_point(|(first, _)| first <= id);
        if b == 0 {
            return Ok(None);
        }
        let bytes = self.read_block(b - 1)?;
        let entries: Vec<&[u8]> = bytes.chunks_exact(ENTRY).collect();
        let Ok(i) = entries.binary_search_by(|e| e[..32].cmp(id.as_bytes())) else {
            return Ok(None);
        };
        self.check(b - 1, &bytes)?;
        Ok(Some(decode(entries[i]).1))
    }
}

/// An anonymous file in `dir`: `O_TMPFILE`, or where the file system lacks it a file named as
/// the store names its temporaries (so no listing takes it for an object, and the sweep of
/// stale temporaries removes it if this process dies before the next line) and unlinked at
/// once.
fn scratch_file(dir: &std::path::Path) -> io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let anonymous = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_TMPFILE)
        .open(dir);
    match anonymous {
        Ok(file) => Ok(file),
        Err(_) => named_scratch_file(dir),
    }
}

/// [`scratch_file`] where `O_TMPFILE` is missing.
fn named_scratch_file(dir: &std::path::Path) -> io::Result<File> {
    let path = dir.join(format!(
        "{}claims-{:016x}",
        cairn_repo::TEMP_PREFIX,
        rand::random::<u64>()
    ));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)?;
    std::fs::remove_file(&path)?;
    Ok(file)
}

fn decode(e: &[u8]) -> (Id, Placement) {
    let id = Id(e[..32].try_into().expect("32 bytes"));
    let group = Id(e[32..64].try_into().expect("32 bytes"));
    let slot = u16::from_le_bytes(e[64..66].try_into().expect("2 bytes"));
    (id, Placement { group, slot })
}

/// A Bloom filter whose probes of a key all fall in one 64-byte line: a lookup of a claim
/// that is not there (most of them: a new chunk) costs one cache miss, where a plain
/// filter's probes cost one each until the first zero bit (about two) — an exact commit asks
/// for each of its new chunks.
struct BlockedBloom {
    lines: Vec<[u64; 8]>,
}

impl BlockedBloom {
    /// Sized for `items` at [`FILTER_BITS`] each, rounded up to a power of two of lines.
    fn new(items: u64) -> BlockedBloom {
        BlockedBloom {
            lines: vec![[0; 8]; Self::lines_for(items)],
        }
    }

    fn lines_for(items: u64) -> usize {
        (items.max(1) * FILTER_BITS)
            .div_ceil(512)
            .next_power_of_two() as usize
    }

    /// [`BlockedBloom::byte_len`] of a filter made for `items`.
    fn byte_len_for(items: u64) -> usize {
        Self::lines_for(items) * 64
    }

    /// The line (from the key's first half) and seven bit positions in it (9 bits each of
    /// a mix of both halves).
    fn probes(&self, key: ProbeKey) -> (usize, impl Iterator<Item = usize>) {
        let (h1, h2) = key.halves();
        let line = (h1 as usize) & (self.lines.len() - 1);
        // Mixed with the first half: an id's second 8 bytes need not be uniform (the trace
        // benchmark's ids carry a counter there), and probes taken from them alone fell on
        // a few patterns of bits, so that most lookups read a block for nothing.
        let mixed = (h2 ^ h1.rotate_right(29)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (
            line,
            (0..7).map(move |i| ((mixed >> (1 + 9 * i)) & 511) as usize),
        )
    }

    fn insert(&mut self, key: ProbeKey) {
        let (line, bits) = self.probes(key);
        let words = &mut self.lines[line];
        for b in bits {
            words[b / 64] |= 1 << (b % 64);
        }
    }

    fn contains_probe(&self, key: ProbeKey) -> bool {
        let (line, mut bits) = self.probes(key);
        let words = &self.lines[line];
        bits.all(|b| words[b / 64] & (1 << (b % 64)) != 0)
    }

    fn byte_len(&self) -> usize {
        self.lines.len() * 64
    }

    /// Items it holds at [`FILTER_BITS`] each.
    fn capacity(&self) -> u64 {
        self.lines.len() as u64 * 512 / FILTER_BITS
    }
}

/// A block's checksum: CRC-32, against damage to a private scratch file (no one else
/// writes it), where BLAKE3 took a tenth of the trace's time (every block is checked at
/// each merge).
fn block_hash(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// An id's first 8 bytes as a number: ids ordered by it first, then by all their bytes,
/// are in ascending order, and most comparisons end at it (ids are hashes) without a
/// 32-byte `memcmp`.
fn prefix(id: &Id) -> u64 {
    u64::from_be_bytes(id.as_bytes()[..8].try_into().expect("8 bytes"))
}

/// The claims of several runs in ascending id order, each run read block by block (checked).
struct Merge<'a> {
    runs: &'a [Run],
    /// Per run: its next block's number and the entries of the current one not yet taken.
    cursors: Vec<(usize, std::vec::IntoIter<(Id, Placement)>)>,
    heap: BinaryHeap<Reverse<(u64, Id, usize)>>,
    heads: Vec<Option<Placement>>,
    failed: bool,
}

impl<'a> Merge<'a> {
    fn new(runs: &'a [Run]) -> Merge<'a> {
        let mut m = Merge {
            runs,
            cursors: (0..runs.len())
                .map(|_| (0, Vec::new().into_iter()))
                .collect(),
            heap: BinaryHeap::new(),
            heads: vec![None; runs.len()],
            failed: false,
        };
        for r in 0..runs.len() {
            if let Err(e) = m.advance(r) {
                m.failed = true;
                tracing::debug!("{e}");
            }
        }
        m
    }

    /// Puts run `r`'s next claim on the heap (reading its next block when needed).
    fn advance(&mut self, r: usize) -> io::Result<()> {
        let (next_block, entries) = &mut self.cursors[r];
        let entry = match entries.next() {
            Some(e) => Some(e),
            None if *next_block < self.runs[r].fences.len() => {
                let bytes = self.runs[r].block(*next_block)?;
                *next_block += 1;
                *entries = bytes
                    .chunks_exact(ENTRY)
                    .map(decode)
                    .collect::<Vec<_>>()
                    .into_iter();
                entries.next()
            }
            None => None,
        };
        if let Some((id, p)) = entry {
            self.heads[r] = Some(p);
            self.heap.push(Reverse((prefix(&id), id, r)));
        }
        Ok(())
    }
}

impl Iterator for Merge<'_> {
    type Item = io::Result<(Id, Placement)>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            self.failed = false;
            self.heap.clear();
            return Some(Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "a run to merge could not be read",
            )));
        }
        let Reverse((_, id, r)) = self.heap.pop()?;
        let p = self.heads[r]
            .take()
            .expect("a head for each run on the heap");
        if let Err(e) = self.advance(r) {
            self.heap.clear();
            return Some(Err(e));
        }
        Some(Ok((id, p)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u64) -> Id {
        Id::of(&n.to_le_bytes())
    }

    fn place(n: u64) -> Placement {
        Placement {
            group: Id::of(&(n / 16).to_be_bytes()),
            slot: (n % 16) as u16,
        }
    }

    fn spill(s: &mut SpilledClaims, range: std::ops::Range<u64>) {
        s.spill(range.map(|n| (id(n), place(n))).collect());
    }

    /// Every claim spilled is found at its place, through spills and merges of every tier;
    /// nothing else is found; the runs stay few.
    #[test]
    fn spilled_claims_are_found_through_merges() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = SpilledClaims::new(Some(dir.path().to_path_buf()), None);
        let per = 300u64;
        let spills = (FAN_IN * FAN_IN + 3) as u64;
        for k in 0..spills {
            spill(&mut s, k * per..(k + 1) * per);
        }
        assert_eq!(s.spilled, spills * per);
        assert_eq!(s.lost, 0);
        // 67 spills: one run of tier 2 (64), three of tier 0.
        assert_eq!(s.runs(), 4);
        assert_eq!(s.runs[0].tier, 2);
        for n in (0..spills * per).step_by(7) {
            assert_eq!(s.get(&id(n)), Some(place(n)), "claim {n}");
        }
        for n in spills * per..spills * per + 500 {
            assert_eq!(s.get(&id(n)), None);
        }
        // Under 3 bytes of memory a claim (filters and fences).
        assert!(s.memory() < 3 * (spills * per) as usize, "{}", s.memory());
        // Anonymous files: nothing in the directory.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    /// Within a budget: the filter and fences never pass it, the oldest runs are dropped
    /// (and counted) to make room, the newest claims are still found and a dropped one is
    /// never placed; a budget nothing fits spills nothing.
    #[test]
    fn a_budget_drops_the_oldest_runs() {
        let budget = 4096;
        let mut s = SpilledClaims::new(None, Some(budget));
        let (per, spills) = (100u64, 80u64);
        let mut forgotten = 0;
        for k in 0..spills {
            forgotten += s.spill(
                (k * per..(k + 1) * per)
                    .map(|n| (id(n), place(n)))
                    .collect(),
            );
            assert!(s.memory() <= budget, "{} after spill {k}", s.memory());
        }
        assert!(s.dropped > 0);
        assert_eq!(forgotten, s.dropped);
        assert!(
            s.runs.iter().any(|r| r.tier > 0),
            "runs merged within the budget"
        );
        assert_eq!(s.held + s.dropped, spills * per);
        let kept_from = spills * per - s.held;
        for n in (0..spills * per).step_by(3) {
            let expect = (n >= kept_from).then(|| place(n));
            assert_eq!(s.get(&id(n)), expect, "claim {n}");
        }
        let mut none = SpilledClaims::new(None, Some(0));
        assert_eq!(none.spill(vec![(id(1), place(1))]), 1);
        assert_eq!((none.runs(), none.dropped, none.get(&id(1))), (0, 1, None));
    }

    /// Both kinds of scratch file can be written and read back, and leave no name behind.
    #[test]
    fn scratch_files_are_anonymous() {
        let dir = tempfile::tempdir().unwrap();
        for file in [
            scratch_file(dir.path()).unwrap(),
            named_scratch_file(dir.path()).unwrap(),
        ] {
            file.write_all_at(b"claims", 3).unwrap();
            let mut back = [0u8; 6];
            file.read_exact_at(&mut back, 3).unwrap();
            assert_eq!(&back, b"claims");
        }
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }

    /// A run whose bytes changed answers nothing (the chunk is stored again), never a wrong
    /// place; the other runs still answer.
    #[test]
    fn a_damaged_block_answers_nothing() {
        let mut s = SpilledClaims::new(None, None);
        spill(&mut s, 0..200);
        spill(&mut s, 200..400);
        let victim = 5u64;
        let run = &s.runs[0];
        let b = run.fences.partition_point(|(f, _)| *f <= id(victim)) - 1;
        // Change the group id of every entry of that block.
        let at = (b * BLOCK * ENTRY) as u64;
        let n = (run.len as usize - b * BLOCK).min(BLOCK);
        for e in 0..n as u64 {
            run.file
                .write_all_at(&[0xff; 32], at + e * ENTRY as u64 + 32)
                .unwrap();
        }
        assert_eq!(s.get(&id(victim)), None);
        assert_eq!(s.get(&id(300)), Some(place(300)));
    }
}

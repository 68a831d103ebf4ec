//! Exact mode's claims once their generation turned over: placed claims written, sorted by
//! id, into runs in anonymous scratch files, with a Bloom filter and a fence per block of
//! each run in memory — 2 to 3 bytes a claim (10 bits of filter, rounded up to a power of
//! two, and a 40-byte fence per 64 claims), where a claim in a generation's map costs 41.
//! Exact mode kept every claim of a commit in memory: 161 MiB for the first commit of a
//! 64 GiB image holding 4 GiB of data (BENCHMARKS §2), a gigabyte per 100 GiB of new data.
//!
//! Runs are merged [`FAN_IN`] at a time into one of the next tier, so a lookup asks at most
//! that many runs a tier (a tier holds `FAN_IN` times the claims of the one below) and each
//! claim is rewritten once a tier.
//!
//! The files are anonymous (`O_TMPFILE`; else named as the store's temporaries and unlinked
//! at once): a killed commit leaves nothing. They go beside the packs in a local repository (the file system sized
//! for the data), else in the system's temporary directory.
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

use cairn_format::summary::{Bloom, ProbeKey};
use cairn_format::Id;
use cairn_repo::v2::Placement;

/// Bytes of a spilled claim: its id, its group's id, its slot (little-endian).
const ENTRY: usize = 32 + 32 + 2;
/// Claims a block (4,224 bytes): what a lookup reads after its fence.
const BLOCK: usize = 64;
/// Runs of one tier merged into one of the next.
pub(crate) const FAN_IN: usize = 8;
/// The filters' geometry: 10 bits and 7 probes a claim, about 1% false positives (a block
/// read for nothing).
const FILTER_BITS: u16 = 10;
const FILTER_PROBES: u8 = 7;

/// The spilled claims of one commit.
pub(crate) struct SpilledClaims {
    /// Where run files are made (`None`: the system's temporary directory).
    dir: Option<PathBuf>,
    /// Oldest first; tiers never increase toward the end.
    runs: Vec<Run>,
    /// Claims spilled, and claims lost to a failure.
    pub(crate) spilled: u64,
    pub(crate) lost: u64,
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
    filter: Bloom,
    /// Per block: its first id and the hash of its bytes.
    fences: Vec<(Id, u64)>,
}

impl SpilledClaims {
    pub(crate) fn new(dir: Option<PathBuf>) -> SpilledClaims {
        SpilledClaims {
            dir,
            runs: Vec::new(),
            spilled: 0,
            lost: 0,
            warned: Cell::new(false),
        }
    }

    /// Spills `claims` (placed claims, each id once, in any order) as a new run, then merges
    /// full tiers.
    pub(crate) fn spill(&mut self, mut claims: Vec<(Id, Placement)>) {
        if claims.is_empty() {
            return;
        }
        claims.sort_unstable_by_key(|c| c.0);
        let n = claims.len() as u64;
        match self.write_run(0, n, claims.into_iter().map(Ok)) {
            Ok(run) => {
                self.runs.push(run);
                self.spilled += n;
            }
            Err(e) => {
                self.lost += n;
                self.warn(&e);
            }
        }
        self.merge_full_tiers();
    }

    /// Where the spilled claim on `id` is, if it was spilled (and can be read back).
    pub(crate) fn get(&self, id: &Id) -> Option<Placement> {
        let probe = ProbeKey::of(id);
        for run in self.runs.iter().rev() {
            if !run.filter.contains_probe(probe) {
                continue;
            }
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

    /// Bytes of memory the runs' filters and fences take.
    pub(crate) fn memory(&self) -> usize {
        self.runs
            .iter()
            .map(|r| r.filter.byte_len() + r.fences.len() * std::mem::size_of::<(Id, u64)>())
            .sum()
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
        let mut filter = Bloom::with_capacity(len.max(1), FILTER_BITS, FILTER_PROBES);
        let mut fences = Vec::with_capacity((len as usize).div_ceil(BLOCK));
        let mut block = Vec::with_capacity(BLOCK * ENTRY);
        let mut first = Id::ZERO;
        let mut written = 0u64;
        for entry in entries {
            let (id, p) = entry?;
            if block.is_empty() {
                first = id;
            }
            filter.insert(ProbeKey::of(&id));
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
            filter,
            fences,
        })
    }
}

impl Run {
    /// Block `b`'s bytes, checked against its hash.
    fn block(&self, b: usize) -> io::Result<Vec<u8>> {
        let first = (b * BLOCK) as u64;
        let n = (self.len - first).min(BLOCK as u64) as usize;
        let mut bytes = vec![0u8; n * ENTRY];
        self.file.read_exact_at(&mut bytes, first * ENTRY as u64)?;
        if block_hash(&bytes) != self.fences[b].1 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "block {b} of a run of {} claims does not match its hash",
                    self.len
                ),
            ));
        }
        Ok(bytes)
    }

    fn get(&self, id: &Id) -> io::Result<Option<Placement>> {
        let b = self.fences.partition_point(|(first, _)| first <= id);
        if b == 0 {
            return Ok(None);
        }
        let bytes = self.block(b - 1)?;
        let entries: Vec<&[u8]> = bytes.chunks_exact(ENTRY).collect();
        Ok(entries
            .binary_search_by(|e| e[..32].cmp(id.as_bytes()))
            .ok()
            .map(|i| decode(entries[i]).1))
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
        cairn_store::TEMP_PREFIX,
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

fn block_hash(bytes: &[u8]) -> u64 {
    let h = blake3::hash(bytes);
    u64::from_le_bytes(h.as_bytes()[..8].try_into().expect("8 bytes"))
}

/// The claims of several runs in ascending id order, each run read block by block (checked).
struct Merge<'a> {
    runs: &'a [Run],
    /// Per run: its next block's number and the entries of the current one not yet taken.
    cursors: Vec<(usize, std::vec::IntoIter<(Id, Placement)>)>,
    heap: BinaryHeap<Reverse<(Id, usize)>>,
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
            self.heap.push(Reverse((id, r)));
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
        let Reverse((id, r)) = self.heap.pop()?;
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
        let mut s = SpilledClaims::new(Some(dir.path().to_path_buf()));
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
        let mut s = SpilledClaims::new(None);
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

//! Merging index runs from their own bytes: a k-way merge of their sorted sections
//! into one version 3 run, whose filter hashes the 8-byte keys and so is rebuilt from the
//! entries alone — no pack trailer is read, and memory holds one batch of sections per input
//! and the inputs' pack tables (plus the output being built). Every section is checked as it is read; a damaged input
//! fails the merge (compaction never hides damage: `verify` reports it, `repair` rebuilds the
//! run from the packs).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashSet};
use std::sync::Arc;

use cairn_format::index_run::{self, Directory, Entry, RunEntries, RunWriter};
use cairn_format::Id;

use super::runs::OpenRun;
use super::tail::get_exact;
use super::{sealed_error, V2Reader};
use crate::error::{RepoError, RepoResult};

/// Sections a merge reads from one input at a time (about 64 KiB).
const SECTIONS_PER_READ: usize = 16;

/// A merged run, ready to publish.
#[derive(Debug)]
pub struct MergedRun {
    pub bytes: Vec<u8>,
    /// Entries in the merged run (repeats across the inputs counted once).
    pub entries: u64,
    /// Stored bytes of the inputs read.
    pub bytes_read: u64,
}

/// One input's position: its entries not merged yet, of the sections read so far.
struct Cursor {
    /// `None`: the entries given with the merge (all in `batch`, remapped already).
    run: Option<Arc<OpenRun>>,
    /// The merged pack table's ordinal of each of this run's packs (monotonic: both tables
    /// are sorted, so remapped entries stay in order); `None` for a pack whose entries are
    /// dropped.
    ordinal: Vec<Option<u32>>,
    /// The directory block being read, and the next block.
    directory: Option<Arc<Directory>>,
    next_block: usize,
    next_section: usize,
    batch: std::vec::IntoIter<Entry>,
}

impl V2Reader {
    /// Merges runs `ids` (each read and checked here) into one version 3 run holding every
    /// entry of every input, and only those. An input that is missing or damaged fails the
    /// merge, naming it.
    pub async fn merge_runs(&self, ids: &[Id]) -> RepoResult<MergedRun> {
        self.merge_runs_replacing(ids, &HashSet::new(), RunEntries::default())
            .await
    }

    /// Merges runs `ids` like [`Self::merge_runs`], but without any entry that names a pack
    /// of `replaced`, and with the entries `extra` added: what a GC that read only some
    /// packs' trailers publishes — the rest of the index as it was, and for the packs it
    /// read, exactly what they hold now (kept packs, new packs).
    pub async fn merge_runs_replacing(
        &self,
        ids: &[Id],
        replaced: &HashSet<Id>,
        extra: RunEntries,
    ) -> RepoResult<MergedRun> {
        let mut inputs = Vec::with_capacity(ids.len());
        for id in ids {
            inputs.push(self.open_run(id).await?);
        }
        let mut tables = Vec::with_capacity(inputs.len());
        for run in &inputs {
            tables.push(self.run_packs(run).await?);
        }
        let mut packs: Vec<Id> = tables
            .iter()
            .flatten()
            .filter(|p| !replaced.contains(*p))
            .chain(extra.packs())
            .copied()
            .collect();
        packs.sort_unstable();
        packs.dedup();
        // The filter's size: the inputs' entries, and the given ones of packs no input names
        // (those of a replaced pack take the place of its entries in the inputs). Counting
        // both would round the filter up to twice its size.
        let named: HashSet<&Id> = tables.iter().flatten().collect();
        let expected: u64 = inputs.iter().map(|r| r.meta.entries).sum::<u64>()
            + extra
                .counts()
                .filter(|(p, _)| !named.contains(p))
                .map(|(_, n)| n as u64)
                .sum::<u64>();
        let given: Vec<Entry> = extra.entries_in(&packs);
        let mut cursors: Vec<Cursor> = inputs
            .into_iter()
            .zip(tables)
            .map(|(run, table)| Cursor {
                ordinal: table
                    .iter()
                    .map(|p| packs.binary_search(p).ok().map(|o| o as u32))
                    .collect(),
                run: Some(run),
                directory: None,
                next_block: 0,
                next_section: 0,
                batch: Vec::new().into_iter(),
            })
            .collect();
        cursors.push(Cursor {
            run: None,
            ordinal: Vec::new(),
            directory: None,
            next_block: 0,
            next_section: 0,
            batch: given.into_iter(),
        });
        let mut writer = RunWriter::new(packs, expected, self.key());
        let mut bytes_read = 0;
        // (entry, input): the smallest entry of every input that has one left.
        let mut heap = BinaryHeap::with_capacity(cursors.len());
        for (i, c) in cursors.iter_mut().enumerate() {
            if let Some(e) = self.next_entry(c, &mut bytes_read).await? {
                heap.push(Reverse((e, i)));
            }
        }
        while let Some(Reverse((e, i))) = heap.pop() {
            writer.push(e);
            if let Some(next) = self.next_entry(&mut cursors[i], &mut bytes_read).await? {
                heap.push(Reverse((next, i)));
            }
        }
        let entries = writer.entries();
        let bytes = writer.finish();
        // The merged run is read back before anyone may publish it (a bug here would lose
        // every location the inputs held once they are deleted).
        match index_run::parse_run(&bytes, self.key()) {
            Ok(run) if run.entries() == entries => {}
            other => {
                return Err(RepoError::internal(
                    "index run merge",
                    format!(
                        "the merge of {} index runs does not read back ({other:?}); nothing \
                         was published",
                        ids.len()
                    ),
                ))
            }
        }
        Ok(MergedRun {
            bytes,
            entries,
            bytes_read,
        })
    }

    /// The run `id` as this reader holds it, its meta read and checked first if it is not.
    async fn open_run(&self, id: &Id) -> RepoResult<Arc<OpenRun>> {
        self.add_run(id).await?;
        self.runs
            .read()
            .expect("runs lock")
            .iter()
            .find(|r| r.id == *id)
            .cloned()
            .ok_or_else(|| {
                RepoError::corrupt(
                    cairn_format::keys::index_run(id),
                    cairn_format::FormatError::invalid("index run", "missing"),
                )
            })
    }

    /// The cursor's next entry, remapped to the merged pack table; reads its next sections
    /// when the batch is spent.
    async fn next_entry(&self, c: &mut Cursor, bytes_read: &mut u64) -> RepoResult<Option<Entry>> {
        loop {
            let Some(run) = c.run.clone() else {
                return Ok(c.batch.next()); // the given entries, remapped already
            };
            if let Some(e) = c.batch.next() {
                match c.ordinal[e.pack as usize] {
                    Some(pack) => return Ok(Some(Entry { key: e.key, pack })),
                    None => continue, // a replaced pack's
                }
            }
            let dir = match &c.directory {
                Some(dir) if c.next_section < dir.sections.len() => dir.clone(),
                _ if c.next_block < run.meta.blocks.len() => {
                    let dir = self.directory(&run, c.next_block).await?;
                    c.directory = Some(dir.clone());
                    c.next_block += 1;
                    c.next_section = 0;
                    dir
                }
                _ => return Ok(None),
            };
            let sections = &dir.sections;
            let first = c.next_section;
            let last = (first + SECTIONS_PER_READ).min(sections.len()) - 1;
            let start = sections[first].range().start;
            let stored =
                get_exact(&*self.store, &run.key, start..sections[last].range().end).await?;
            *bytes_read += stored.len() as u64;
            let mut batch = Vec::new();
            for (j, section) in sections.iter().enumerate().take(last + 1).skip(first) {
                let r = section.range();
                let piece = &stored[(r.start - start) as usize..(r.end - start) as usize];
                let entries = run
                    .meta
                    .open_section(&dir, j, piece, self.key())
                    .map_err(|e| {
                        let n = dir.first_section as usize + j;
                        sealed_error(format!("{} section {n}", run.key), e)
                    })?;
                batch.extend(entries);
            }
            c.next_section = last + 1;
            c.batch = batch.into_iter();
        }
    }
}

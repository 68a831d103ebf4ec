//! A commit's index entries while its pipeline runs: the 8-byte key of every id it stores,
//! by pack, held until publication writes them as the commit's index run. A first commit of
//! a 64 GiB image (4 GiB of data) stores a million chunks: 8 MiB of keys that grew with the
//! data while the claims, the segments in flight and the summary were at their peak. On a
//! store that stages files (a local repository) each pack's keys wait, sorted, in a staged
//! file instead, and publication merges them from there a few thousand at a time (read back whole, they
//! were 34 MiB of a 256 GiB first commit's 75 MiB heap peak). On a store that does not stage files (S3) they stay in
//! memory. The file is never published: it goes when the last reader of it does, and a
//! commit killed meanwhile leaves a `.tmp-` file the stale-temporary sweep removes.

use std::io;
use std::sync::Arc;

use cairn_format::index_run::{merge_pack_keys, pack_table, Entry, RunEntries};
use cairn_format::Id;
use cairn_repo::StagedFile;
use cairn_repo::{Repo, RepoResult};

use crate::error::EngineResult;

/// Keys a pack's reader takes from the file at a time (4 KiB).
const KEYS_READ: usize = 512;

/// Keys added so far: in a staged file, or in memory.
pub(crate) struct PendingEntries {
    file: Option<StagedFile>,
    /// Each addition's (offset in the file, keys), in order (file only).
    spans: Vec<(u64, usize)>,
    /// Each addition's keys (no file).
    memory: Vec<Vec<u64>>,
    written: u64,
}

impl PendingEntries {
    pub(crate) fn new(file: Option<StagedFile>) -> PendingEntries {
        PendingEntries {
            file,
            spans: Vec::new(),
            memory: Vec::new(),
            written: 0,
        }
    }

    /// Holds `keys` (one pack's); returns the addition's number, which names it in
    /// [`PendingEntries::into_run`] (a pack's final id is known only once it is stored).
    pub(crate) fn add(&mut self, mut keys: Vec<u64>) -> EngineResult<usize> {
        let Some(file) = &self.file else {
            self.memory.push(keys);
            return Ok(self.memory.len() - 1);
        };
        keys.sort_unstable();
        let bytes: Vec<u8> = keys.iter().flat_map(|k| k.to_le_bytes()).collect();
        file.write_at(self.written, &bytes)
            .map_err(cairn_repo::RepoError::from)?;
        self.spans.push((self.written, keys.len()));
        self.written += bytes.len() as u64;
        Ok(self.spans.len() - 1)
    }

    /// The run of the stored `packs`: (final pack id, number of its addition).
    pub(crate) fn into_run(mut self, packs: Vec<(Id, usize)>) -> PendingRun {
        let Some(file) = self.file else {
            let mut entries = RunEntries::default();
            for (pack, i) in packs {
                entries.add_keys(pack, std::mem::take(&mut self.memory[i]));
            }
            return PendingRun::Memory(entries);
        };
        let table = pack_table(packs.iter().map(|(p, _)| *p));
        let spans = packs
            .iter()
            .map(|(pack, i)| {
                let ordinal = table.binary_search(pack).expect("in the table") as u32;
                let (at, len) = self.spans[*i];
                (ordinal, at, len)
            })
            .collect();
        PendingRun::Staged(StagedKeys {
            file: Arc::new(file),
            table,
            spans,
        })
    }
}

/// A commit's index run before publication.
pub(crate) enum PendingRun {
    /// Its entries in memory (no staged file, or nothing stored: format 1, a patch).
    Memory(RunEntries),
    /// Each pack's keys, sorted, in a staged file.
    Staged(StagedKeys),
}

impl Default for PendingRun {
    fn default() -> Self {
        PendingRun::Memory(RunEntries::default())
    }
}

impl std::fmt::Debug for PendingRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PendingRun::Memory(entries) => write!(f, "{} entries in memory", entries.len()),
            PendingRun::Staged(keys) => write!(f, "{} packs' keys staged", keys.spans.len()),
        }
    }
}

/// Each pack's keys, sorted, in a staged file.
pub(crate) struct StagedKeys {
    file: Arc<StagedFile>,
    /// The run's pack table (sorted, no repeats).
    table: Vec<Id>,
    /// Per pack stored: its ordinal in `table`, and where its keys are (offset, how many).
    spans: Vec<(u32, u64, usize)>,
}

impl PendingRun {
    pub(crate) fn is_empty(&self) -> bool {
        match self {
            PendingRun::Memory(entries) => entries.is_empty(),
            PendingRun::Staged(keys) => keys.spans.iter().all(|s| s.2 == 0),
        }
    }

    /// Writes and stores the run (see [`Repo::put_run_sorted`]): its id and bytes written.
    pub(crate) async fn put(self, repo: &Repo) -> RepoResult<(Id, u64)> {
        match self {
            PendingRun::Memory(entries) => repo.put_run_entries(entries, repo.key()).await,
            PendingRun::Staged(keys) => {
                let expected = keys.spans.iter().map(|s| s.2 as u64).sum();
                let entries = keys.entries();
                repo.put_run_sorted(keys.table, expected, entries, repo.key())
                    .await
            }
        }
    }

    /// Every key the run will hold, ascending (a key may come more than once).
    pub(crate) fn keys(&self) -> Box<dyn Iterator<Item = io::Result<u64>> + Send + '_> {
        match self {
            PendingRun::Memory(entries) => Box::new(entries.sorted_keys().into_iter().map(Ok)),
            PendingRun::Staged(keys) => Box::new(keys.entries().map(|e| e.map(|e| e.key))),
        }
    }
}

impl StagedKeys {
    /// The run's entries in order, each pack's keys read from the file as they are needed.
    fn entries(&self) -> impl Iterator<Item = io::Result<Entry>> + Send + 'static {
        let packs = self
            .spans
            .iter()
            .map(|&(ordinal, at, len)| (ordinal, SpanKeys::new(self.file.clone(), at, len)))
            .collect();
        merge_pack_keys(packs)
    }
}

/// One pack's keys, read from the staged file [`KEYS_READ`] at a time.
struct SpanKeys {
    file: Arc<StagedFile>,
    /// Where the next read starts, and the keys not read yet.
    at: u64,
    left: usize,
    read: std::vec::IntoIter<u64>,
}

impl SpanKeys {
    fn new(file: Arc<StagedFile>, at: u64, left: usize) -> SpanKeys {
        SpanKeys {
            file,
            at,
            left,
            read: Vec::new().into_iter(),
        }
    }
}

impl Iterator for SpanKeys {
    type Item = io::Result<u64>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(key) = self.read.next() {
            return Some(Ok(key));
        }
        if self.left == 0 {
            return None;
        }
        let n = self.left.min(KEYS_READ);
        let mut bytes = vec![0u8; n * 8];
        if let Err(e) = self.file.read_at(self.at, &mut bytes) {
            self.left = 0;
            return Some(Err(io::Error::other(e)));
        }
        self.at += bytes.len() as u64;
        self.left -= n;
        self.read = bytes
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect::<Vec<_>>()
            .into_iter();
        self.read.next().map(Ok)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_store::{LocalStore, ObjectStore};

    impl PendingRun {
        /// The pack table and the entries in order, as the run will hold them.
        fn table_and_entries(self) -> (Vec<Id>, Vec<Entry>) {
            match self {
                PendingRun::Memory(entries) => {
                    let (table, _, entries) = entries.into_sorted();
                    (table, entries.map(Result::unwrap).collect())
                }
                PendingRun::Staged(keys) => {
                    let entries = keys.entries().map(Result::unwrap).collect();
                    (keys.table, entries)
                }
            }
        }
    }

    /// Through a staged file or in memory, the run holds the keys each pack brought, by its
    /// final id, in order (keys added in any order, a pack's repeats kept for the writer
    /// to drop); its keys come ascending; and the file leaves nothing behind.
    #[tokio::test]
    async fn entries_come_back_by_pack_from_a_file_or_memory() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::open(dir.path()).unwrap();
        let keys = |n: u64, m: u64| {
            (0..n)
                .map(|k| ((k * m) % 5003).wrapping_mul(0x9e37_79b9_7f4a_7c15))
                .collect::<Vec<u64>>()
        };
        let (p1, p2) = (Id::of(b"p1"), Id::of(b"p2"));
        let mut expected = RunEntries::default();
        expected.add_keys(p2, keys(3, 7));
        expected.add_keys(p1, keys(2000, 13));
        let (table, want) = PendingRun::Memory(expected).table_and_entries();
        assert_eq!(want.len(), 2003);
        assert!(want.windows(2).all(|w| w[0] <= w[1]));
        for file in [store.stage("packs/").await.unwrap(), None] {
            let staged = file.is_some();
            let mut pending = PendingEntries::new(file);
            let first = pending.add(keys(2000, 13)).unwrap();
            let second = pending.add(keys(3, 7)).unwrap();
            let run = pending.into_run(vec![(p2, second), (p1, first)]);
            assert_eq!(matches!(run, PendingRun::Staged(_)), staged);
            let mut keys: Vec<u64> = run.keys().map(Result::unwrap).collect();
            assert!(keys.windows(2).all(|w| w[0] <= w[1]));
            keys.dedup();
            let mut want_keys: Vec<u64> = want.iter().map(|e| e.key).collect();
            want_keys.dedup();
            assert_eq!(keys, want_keys, "staged: {staged}");
            assert_eq!(
                run.table_and_entries(),
                (table.clone(), want.clone()),
                "staged: {staged}"
            );
        }
        let left: Vec<_> = std::fs::read_dir(dir.path().join("packs"))
            .map(|d| d.map(|e| e.unwrap().file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{left:?}");
    }

    /// A staged file cut short (damage under a running commit) ends the run's keys with an
    /// error, after only the keys read before it: never entries made up or silently fewer.
    #[tokio::test]
    async fn a_staged_file_cut_short_ends_the_keys_with_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::open(dir.path()).unwrap();
        let mut pending = PendingEntries::new(store.stage("packs/").await.unwrap());
        let first = pending
            .add((0..2000u64).map(|k| k * 7919).collect())
            .unwrap();
        let run = pending.into_run(vec![(Id::of(b"p"), first)]);
        let staged = std::fs::read_dir(dir.path().join("packs"))
            .unwrap()
            .next()
            .unwrap()
            .unwrap()
            .path();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&staged)
            .unwrap()
            .set_len(8 * 1000)
            .unwrap();
        let keys: Vec<io::Result<u64>> = run.keys().collect();
        let (ok, err): (Vec<_>, Vec<_>) = keys.iter().partition(|k| k.is_ok());
        assert_eq!((ok.len(), err.len()), (KEYS_READ, 1), "{err:?}");
        assert!(keys.last().unwrap().is_err());
        let e = keys.into_iter().last().unwrap().unwrap_err();
        assert!(
            matches!(
                cairn_repo::RepoError::from_entries(e),
                cairn_repo::RepoError::Store(_)
            ),
            "the store's own error"
        );
    }
}

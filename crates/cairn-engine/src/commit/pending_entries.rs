//! A commit's index entries while its pipeline runs: the 8-byte key of every id it stores,
//! by pack, held until publication writes them as the commit's index run. A first commit of
//! a 64 GiB image (4 GiB of data) stores a million chunks: 8 MiB of keys that grew with the
//! data while the claims, the segments in flight and the summary were at their peak. On a
//! store that stages files (a local repository) they wait in a staged file instead, read
//! back once the workers are done and their claims freed; on one that does not (S3) they
//! stay in memory. The file is never published: it goes when this value does, and a commit
//! killed meanwhile leaves a `.tmp-` file the stale-temporary sweep removes.

use cairn_format::index_run::RunEntries;
use cairn_format::Id;
use cairn_store::StagedFile;

use crate::error::EngineResult;

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
    /// [`PendingEntries::into_entries`] (a pack's final id is known only once it is stored).
    pub(crate) fn add(&mut self, keys: Vec<u64>) -> EngineResult<usize> {
        let Some(file) = &self.file else {
            self.memory.push(keys);
            return Ok(self.memory.len() - 1);
        };
        let bytes: Vec<u8> = keys.iter().flat_map(|k| k.to_le_bytes()).collect();
        file.write_at(self.written, &bytes)?;
        self.spans.push((self.written, keys.len()));
        self.written += bytes.len() as u64;
        Ok(self.spans.len() - 1)
    }

    /// The entries of the stored `packs`: (final pack id, number of its addition).
    pub(crate) fn into_entries(mut self, packs: Vec<(Id, usize)>) -> EngineResult<RunEntries> {
        let mut entries = RunEntries::default();
        for (pack, i) in packs {
            let keys = match &self.file {
                None => std::mem::take(&mut self.memory[i]),
                Some(file) => {
                    let (at, n) = self.spans[i];
                    let mut bytes = vec![0u8; n * 8];
                    file.read_at(at, &mut bytes)?;
                    bytes
                        .chunks_exact(8)
                        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
                        .collect()
                }
            };
            entries.add_keys(pack, keys);
        }
        Ok(entries)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_store::{LocalStore, ObjectStore};

    /// Through a staged file or in memory, the entries are the keys each pack brought, by
    /// its final id, in the order the packs were stored; and the file leaves nothing behind.
    #[tokio::test]
    async fn entries_come_back_by_pack_from_a_file_or_memory() {
        let dir = tempfile::tempdir().unwrap();
        let store = LocalStore::open(dir.path()).unwrap();
        let keys = |n: u64| {
            (0..n)
                .map(|k| k * 0x9e37_79b9_7f4a_7c15)
                .collect::<Vec<u64>>()
        };
        let (p1, p2) = (Id::of(b"p1"), Id::of(b"p2"));
        let mut expected = RunEntries::default();
        expected.add_keys(p2, keys(3));
        expected.add_keys(p1, keys(1000));
        for file in [store.stage("packs/").await.unwrap(), None] {
            let staged = file.is_some();
            let mut pending = PendingEntries::new(file);
            let first = pending.add(keys(1000)).unwrap();
            let second = pending.add(keys(3)).unwrap();
            let entries = pending
                .into_entries(vec![(p2, second), (p1, first)])
                .unwrap();
            assert_eq!(entries, expected, "staged: {staged}");
        }
        let left: Vec<_> = std::fs::read_dir(dir.path().join("packs"))
            .map(|d| d.map(|e| e.unwrap().file_name()).collect())
            .unwrap_or_default();
        assert!(left.is_empty(), "{left:?}");
    }
}

//! The in-memory blob index: blob id → where it is stored.
//!
//! Built at open from every index file; updated as a commit publishes its own index file.
//! Pack ids are interned so an entry costs ~20 bytes plus the 32-byte key.

use std::collections::{HashMap, HashSet};

use cairn_format::index::IndexFile;
use cairn_format::pack::{BlobEncoding, BlobEntry, BlobKind};
use cairn_format::Id;

/// Where a blob lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobLocation {
    pub pack: Id,
    pub entry: BlobEntry,
}

#[derive(Debug, Clone, Copy)]
struct Slot {
    pack: u32,
    offset: u32,
    stored_len: u32,
    raw_len: u32,
    kind: BlobKind,
    encoding: BlobEncoding,
}

#[derive(Debug, Default)]
pub struct BlobIndex {
    packs: Vec<Id>,
    pack_numbers: HashMap<Id, u32>,
    blobs: HashMap<Id, Slot>,
    /// Copies (pack, blob) left out: quarantined as damaged (see `crate::quarantine`).
    skip: HashSet<(Id, Id)>,
}

impl BlobIndex {
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty index that will leave out the copies in `skip` (quarantined ones), so that
    /// another copy of the same blob, if any file lists one, is used instead.
    pub fn without(skip: HashSet<(Id, Id)>) -> Self {
        BlobIndex {
            skip,
            ..Self::default()
        }
    }

    /// Drops `id` if its known location is `pack` (a copy just found damaged).
    pub fn forget_at(&mut self, id: &Id, pack: &Id) {
        self.skip.insert((*pack, *id));
        if let Some(slot) = self.blobs.get(id) {
            if self.packs[slot.pack as usize] == *pack {
                self.blobs.remove(id);
            }
        }
    }

    fn intern(&mut self, pack: Id) -> u32 {
        if let Some(n) = self.pack_numbers.get(&pack) {
            return *n;
        }
        let n = self.packs.len() as u32;
        self.packs.push(pack);
        self.pack_numbers.insert(pack, n);
        n
    }

    /// Adds every blob of an index file. A blob stored twice keeps its first location.
    pub fn add_file(&mut self, file: &IndexFile) {
        for p in &file.packs {
            self.add_pack(p.pack, &p.entries);
        }
    }

    pub fn add_pack(&mut self, pack: Id, entries: &[BlobEntry]) {
        let n = self.intern(pack);
        self.blobs.reserve(entries.len());
        for e in entries {
            if !self.skip.is_empty() && self.skip.contains(&(pack, e.id)) {
                continue;
            }
            self.blobs.entry(e.id).or_insert(Slot {
                pack: n,
                offset: e.offset,
                stored_len: e.stored_len,
                raw_len: e.raw_len,
                kind: e.kind,
                encoding: e.encoding,
            });
        }
    }

    pub fn contains(&self, id: &Id) -> bool {
        self.blobs.contains_key(id)
    }

    pub fn get(&self, id: &Id) -> Option<BlobLocation> {
        self.blobs.get(id).map(|s| BlobLocation {
            pack: self.packs[s.pack as usize],
            entry: BlobEntry {
                id: *id,
                kind: s.kind,
                encoding: s.encoding,
                offset: s.offset,
                stored_len: s.stored_len,
                raw_len: s.raw_len,
            },
        })
    }

    pub fn len(&self) -> usize {
        self.blobs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blobs.is_empty()
    }

    /// Count and stored bytes of the blobs of one kind (e.g. manifest nodes, for stats).
    pub fn totals(&self, kind: BlobKind) -> (u64, u64) {
        self.blobs
            .values()
            .filter(|s| s.kind == kind)
            .fold((0, 0), |(n, b), s| (n + 1, b + u64::from(s.stored_len)))
    }

    /// Whether some indexed blob lives in `pack`.
    pub fn has_pack(&self, pack: &Id) -> bool {
        self.pack_numbers.contains_key(pack)
    }

    pub fn pack_count(&self) -> usize {
        self.packs.len()
    }

    /// Every indexed blob, grouped by pack (for verify).
    pub fn by_pack(&self) -> HashMap<Id, Vec<BlobEntry>> {
        let mut out: HashMap<Id, Vec<BlobEntry>> = HashMap::new();
        for id in self.blobs.keys() {
            let loc = self.get(id).expect("present");
            out.entry(loc.pack).or_default().push(loc.entry);
        }
        for v in out.values_mut() {
            v.sort_by_key(|e| e.offset);
        }
        out
    }
}

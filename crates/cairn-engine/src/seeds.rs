//! Seeds: local images whose bytes a restore takes instead of fetching them (`restore --seed`:
//! an older restore, a golden image, another VM's disk).
//!
//! A seed is read at the offsets of the version's segments first, since a disk mostly keeps
//! its data where it was. What is not there is looked up by content in an index of every
//! seed's 4 KiB blocks (casync's seeds do the same), so data the guest's file system moved,
//! or that another VM's disk holds elsewhere, is found too. Either way a chunk is taken only
//! where the seed's bytes have the chunk's id: a seed can never put a wrong byte in the output,
//! it can only save a fetch.

use std::sync::{Arc, Mutex, OnceLock};

use cairn_format::Id;

/// The size of an indexed block: format 2's chunk.
const BLOCK: usize = 4096;
/// The most blocks the index holds (16 GiB of non-zero seed data, 64 MiB of memory); a
/// seed's blocks past it are found at their own offsets only.
pub const MAX_INDEXED_BLOCKS: usize = 4 << 20;
/// How much of a seed one read takes while indexing.
const INDEX_READ: usize = 4 << 20;

#[derive(Clone, Default)]
pub struct Seeds {
    images: Vec<Arc<dyn cairn_image::DiskImage>>,
    /// Seeds that failed a read, left out from then on.
    failed: Arc<Mutex<std::collections::HashSet<usize>>>,
    /// The blocks of every seed by content, built at first use.
    index: Arc<OnceLock<SeedIndex>>,
}

impl std::fmt::Debug for Seeds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let names: Vec<String> = self.images.iter().map(|i| i.describe()).collect();
        f.debug_struct("Seeds").field("images", &names).finish()
    }
}

impl Seeds {
    pub fn new(images: Vec<Arc<dyn cairn_image::DiskImage>>) -> Seeds {
        Seeds {
            images,
            ..Default::default()
        }
    }

    pub fn is_empty(&self) -> bool {
        self.images.is_empty()
    }

    fn usable(&self, i: usize) -> bool {
        !self.failed.lock().expect("seed list").contains(&i)
    }

    fn leave_out(&self, i: usize, e: &dyn std::fmt::Display) {
        let image = &self.images[i];
        if self.failed.lock().expect("seed list").insert(i) {
            tracing::warn!("seed {} cannot be read, left out: {e}", image.describe());
        }
    }

    /// The bytes of each usable seed at `[offset, offset + len)`, zeros past a seed's end. A
    /// seed whose read fails is left out from then on, with a warning. Blocking.
    pub fn read(&self, offset: u64, len: usize) -> Vec<Vec<u8>> {
        let mut out = Vec::with_capacity(self.images.len());
        for (i, image) in self.images.iter().enumerate() {
            if !self.usable(i) {
                continue;
            }
            let mut buf = vec![0u8; len];
            let have = image.size().saturating_sub(offset).min(len as u64) as usize;
            if have == 0 {
                continue;
            }
            match image.read_at(&mut buf[..have], offset) {
                Ok(()) => out.push(buf),
                Err(e) => self.leave_out(i, &e),
            }
        }
        out
    }

    /// Builds the index of the seeds' blocks by content (`id_of`: the repository's chunk ids),
    /// once; later calls return at once. Reads every seed whole. Blocking.
    pub fn index_with(&self, id_of: impl Fn(&[u8]) -> Id) {
        self.index.get_or_init(|| SeedIndex::build(self, id_of));
    }

    /// A 4 KiB chunk with id `id` from wherever a seed holds it, checked with `id_of`; `None`
    /// when no indexed block has that content (or the index is not built). Blocking: one
    /// 4 KiB read of a local file.
    pub fn find(&self, id: &Id, id_of: impl Fn(&[u8]) -> Id) -> Option<Vec<u8>> {
        let (seed, offset) = self.index.get()?.lookup(id)?;
        if !self.usable(seed) {
            return None;
        }
        let mut buf = vec![0u8; BLOCK];
        match self.images[seed].read_at(&mut buf, offset) {
            // The index keys on part of the id: the whole id decides.
            Ok(()) => (id_of(&buf) == *id).then_some(buf),
            Err(e) => {
                self.leave_out(seed, &e);
                None
            }
        }
    }
}

/// The non-zero 4 KiB blocks of the seeds, keyed by the first 8 bytes of their id: a key
/// shared by two contents finds one of them, and the caller's check of the whole id turns
/// the other into a fetch.
#[derive(Default)]
struct SeedIndex {
    /// (key, seed number (top 16 bits) and block number in it), sorted by key: 16 bytes a
    /// block, with no table overhead.
    blocks: Vec<(u64, u64)>,
}

impl SeedIndex {
    fn build(seeds: &Seeds, id_of: impl Fn(&[u8]) -> Id) -> SeedIndex {
        let mut index = SeedIndex::default();
        let mut buf = vec![0u8; INDEX_READ];
        'seeds: for (i, image) in seeds.images.iter().enumerate().take(1 << 16) {
            let size = image.size();
            let mut at = 0u64;
            while at + BLOCK as u64 <= size {
                let len = (size - at).min(INDEX_READ as u64) as usize / BLOCK * BLOCK;
                if let Err(e) = image.read_at(&mut buf[..len], at) {
                    seeds.leave_out(i, &e);
                    continue 'seeds;
                }
                for (n, block) in buf[..len].chunks_exact(BLOCK).enumerate() {
                    if crate::chunker::is_zero(block) {
                        continue;
                    }
                    if index.blocks.len() >= MAX_INDEXED_BLOCKS {
                        tracing::info!(
                            "seed index full ({MAX_INDEXED_BLOCKS} blocks): the rest of the \
                             seeds is used at its own offsets only"
                        );
                        break 'seeds;
                    }
                    let number = at / BLOCK as u64 + n as u64;
                    index
                        .blocks
                        .push((key(&id_of(block)), ((i as u64) << 48) | number));
                }
                at += len as u64;
            }
        }
        index.blocks.sort_unstable();
        index.blocks.dedup_by_key(|(k, _)| *k);
        index.blocks.shrink_to_fit();
        index
    }

    fn lookup(&self, id: &Id) -> Option<(usize, u64)> {
        let key = key(id);
        let at = self.blocks.binary_search_by_key(&key, |(k, _)| *k).ok()?;
        let v = self.blocks[at].1;
        Some(((v >> 48) as usize, (v & ((1 << 48) - 1)) * BLOCK as u64))
    }
}

fn key(id: &Id) -> u64 {
    let b = id.as_bytes();
    u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]])
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_image::raw::RawImage;

    fn seed(dir: &std::path::Path, name: &str, data: &[u8]) -> Arc<dyn cairn_image::DiskImage> {
        let path = dir.join(name);
        std::fs::write(&path, data).unwrap();
        Arc::new(RawImage::open(&path, Default::default()).unwrap())
    }

    fn block(fill: u8) -> Vec<u8> {
        (0..BLOCK).map(|i| fill ^ (i as u8)).collect()
    }

    #[test]
    fn a_block_is_found_at_any_offset_of_any_seed_and_only_with_its_own_content() {
        let dir = tempfile::tempdir().unwrap();
        let mut one = vec![0u8; 4 * BLOCK];
        one[2 * BLOCK..3 * BLOCK].copy_from_slice(&block(1));
        let mut two = vec![0u8; 3 * BLOCK + 100]; // a tail shorter than a block is not indexed
        two[BLOCK..2 * BLOCK].copy_from_slice(&block(2));
        let seeds = Seeds::new(vec![
            seed(dir.path(), "one", &one),
            seed(dir.path(), "two", &two),
        ]);
        let id_of = |b: &[u8]| Id::of(b);
        assert_eq!(
            seeds.find(&Id::of(&block(1)), id_of),
            None,
            "not indexed yet"
        );
        seeds.index_with(id_of);
        assert_eq!(seeds.find(&Id::of(&block(1)), id_of), Some(block(1)));
        assert_eq!(seeds.find(&Id::of(&block(2)), id_of), Some(block(2)));
        assert_eq!(seeds.find(&Id::of(&block(3)), id_of), None);
        // Zero blocks are not indexed (zeros are never fetched).
        assert_eq!(seeds.find(&Id::of(&[0u8; BLOCK]), id_of), None);
        assert_eq!(seeds.index.get().unwrap().blocks.len(), 2);

        // A seed that changed since it was indexed is checked, not trusted.
        std::fs::write(dir.path().join("one"), vec![9u8; 4 * BLOCK]).unwrap();
        assert_eq!(seeds.find(&Id::of(&block(1)), id_of), None);
        assert_eq!(seeds.find(&Id::of(&block(2)), id_of), Some(block(2)));
    }
}

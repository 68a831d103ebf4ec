//! Index runs read in pieces (version 3, issue 17): a reader holds only each run's top level;
//! a lookup reads one directory block, one section (with its read-ahead) and one pack block,
//! each once; damage in a piece fails only the lookups that need it and is reported by name;
//! version 2 runs, which older builds wrote, are read as before.

mod common;

use std::sync::Arc;

use cairn_format::config::RepoConfig;
use cairn_format::crypto::MasterKey;
use cairn_format::index_run::{self, Geometry, Piece};
use cairn_format::{keys, Id};
use cairn_repo::v2::{CacheLimits, V2Reader};
use cairn_repo::Repo;
use cairn_store::{CountingStore, LocalStore, ObjectStore};
use common::*;
use rand::SeedableRng;

/// Small pieces, so that a few packs make many: 8 entries a section, 2 sections a directory
/// block, 1 pack a pack block.
const SMALL: Geometry = Geometry {
    section_entries: 8,
    block_sections: 2,
    packs_per_block: 1,
};

/// Four packs of three groups (204 locations) in one run of the given geometry or version.
struct Pieces {
    _dir: tempfile::TempDir,
    local: Arc<dyn ObjectStore>,
    counting: Arc<CountingStore>,
    repo: Repo,
    run: Id,
    run_bytes: Vec<u8>,
    written: Vec<Written>,
}

async fn pieces(key: Option<&MasterKey>, legacy: bool) -> Pieces {
    pieces_with(key, legacy, SMALL).await
}

async fn pieces_with(key: Option<&MasterKey>, legacy: bool, geometry: Geometry) -> Pieces {
    let dir = tempfile::tempdir().unwrap();
    let local: Arc<dyn ObjectStore> = Arc::new(LocalStore::create(dir.path()).unwrap());
    let counting = Arc::new(CountingStore::new(local.clone()));
    let repo = Repo::init(counting.clone(), RepoConfig::default())
        .await
        .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let (mut all, mut written) = (Vec::new(), Vec::new());
    for _ in 0..4 {
        let (p, b, w) = pack(&mut rng, 3, key);
        local
            .put_if_absent(&keys::pack(&p), b.into())
            .await
            .unwrap();
        all.extend(locations(p, &w, key));
        written.extend(w);
    }
    let run_bytes = if legacy {
        index_run::write_legacy_run(&all, key, 8)
    } else {
        index_run::write_run_with(&all, key, geometry)
    };
    let run = Id::of(&run_bytes);
    local
        .put_if_absent(&keys::index_run(&run), run_bytes.clone().into())
        .await
        .unwrap();
    Pieces {
        _dir: dir,
        local,
        counting,
        repo,
        run,
        run_bytes,
        written,
    }
}

impl Pieces {
    async fn reader(&self, key: Option<&MasterKey>) -> V2Reader {
        let r = self.repo.v2_reader(key.cloned(), CacheLimits::default());
        r.add_run(&self.run).await.unwrap();
        r
    }

    fn chunk_ids(&self, key: Option<&MasterKey>) -> Vec<Id> {
        self.written
            .iter()
            .flat_map(|w| &w.chunks)
            .map(|c| key.map_or_else(|| Id::of(c), |k| k.id_of(c)))
            .collect()
    }

    /// Overwrites bytes `range` of the run with their complement.
    async fn damage(&self, range: std::ops::Range<u64>) {
        let mut bytes = self.run_bytes.clone();
        for b in &mut bytes[range.start as usize..range.end as usize] {
            *b ^= 0xff;
        }
        let key = keys::index_run(&self.run);
        self.local.delete(&key).await.unwrap();
        self.local.put_if_absent(&key, bytes.into()).await.unwrap();
    }
}

fn at<T>(piece: &Piece<T>) -> std::ops::Range<u64> {
    match piece {
        Piece::At(at) => at.range.clone(),
        Piece::Held(_) => panic!("a version 3 piece is read, not held"),
    }
}

#[tokio::test]
async fn every_chunk_is_found_through_the_pieces_plain_and_sealed() {
    for key in [None, Some(MasterKey::generate())] {
        let key = key.as_ref();
        let p = pieces(key, false).await;
        let whole = index_run::parse_run(&p.run_bytes, key).unwrap();
        assert!(
            whole.meta.blocks.len() >= 10,
            "{} blocks",
            whole.meta.blocks.len()
        );
        assert_eq!(whole.meta.pack_blocks.len(), 4);
        let r = p.reader(key).await;
        // Only the top level is held: 204 entries in 26 sections cost ~80 bytes a block.
        assert!(r.meta_memory() < 100 * whole.meta.blocks.len() as u64 + 256);
        for (w, id) in p
            .written
            .iter()
            .flat_map(|w| w.chunks.iter().map(move |c| (w, c)))
            .zip(p.chunk_ids(key))
        {
            let (_, c) = w;
            let placed = r.find_chunk(&id).await.unwrap().expect("found");
            let group = p.written.iter().find(|g| g.id == placed.group).unwrap();
            assert!(group.chunks[usize::from(placed.slot)] == *c);
        }
        assert_eq!(r.find_chunk(&Id::of(b"absent")).await.unwrap(), None);
        assert_eq!(r.packs().await.unwrap().len(), 4);
        assert_eq!(r.check_run(&p.run).await.unwrap(), None);
    }
}

#[tokio::test]
async fn a_lookup_reads_one_directory_block_one_section_run_and_one_pack_block_once() {
    let p = pieces(None, false).await;
    let whole = index_run::parse_run(&p.run_bytes, None).unwrap();
    let r = p.reader(None).await;
    let id = p.chunk_ids(None)[0];
    p.counting.reset();
    let (_trailer, _slot) = r.locate_chunk(&id).await.unwrap();
    let keys_read = p.counting.take_keys_read();
    let run_key = keys::index_run(&p.run);
    let run_reads = keys_read.iter().filter(|k| **k == run_key).count();
    // The directory block, the section (and its neighbours in the block), the pack block.
    assert_eq!(run_reads, 3, "{keys_read:?}");
    // Asked again: nothing read.
    p.counting.reset();
    r.locate_chunk(&id).await.unwrap();
    assert_eq!(p.counting.reads(), 0);
    // The top level alone was read at open: far less than the directory and pack table.
    let dirs: u64 = whole
        .meta
        .blocks
        .iter()
        .map(|b| at(&b.piece).end - at(&b.piece).start)
        .sum();
    assert!(r.meta_memory() < dirs * 2, "{} held", r.meta_memory());
}

#[tokio::test]
async fn damage_in_a_piece_costs_only_what_needs_it_and_is_reported() {
    for (what, pick) in [
        ("directory block", 0usize),
        ("pack block", 1),
        ("section", 2),
    ] {
        let p = pieces(None, false).await;
        let whole = index_run::parse_run(&p.run_bytes, None).unwrap();
        let ids = p.chunk_ids(None);
        // The piece that the first chunk's lookup needs.
        let b = whole.meta.block_of(&ids[0]).unwrap();
        let target = match pick {
            0 => at(&whole.meta.blocks[b].piece),
            1 => {
                let packs = whole.lookup(&p.run_bytes, &ids[0], None).unwrap();
                let ordinal = whole.packs.binary_search(&packs[0]).unwrap() as u32;
                at(&whole.meta.pack_blocks[whole.meta.pack_place(ordinal).unwrap().0])
            }
            _ => {
                let (b, j) = whole.section_for(&ids[0]).unwrap();
                whole.directories[b].sections[j].range()
            }
        };
        p.damage(target.start..target.start + 1).await;
        let r = p.reader(None).await;
        let mut found = 0;
        for id in &ids {
            found += usize::from(r.find_chunk(id).await.unwrap().is_some());
        }
        if pick == 1 {
            // A damaged pack block: the lookups that need it find nothing (a commit stores
            // those chunks again); the others are found.
            assert_eq!(r.find_chunk(&ids[0]).await.unwrap(), None, "{what}");
            assert!(
                found > ids.len() / 2 && found < ids.len(),
                "{what}: {found} of {}",
                ids.len()
            );
        } else {
            // A damaged directory block or section costs speed, not data: every pack of
            // the run's table is a candidate, and the trailers decide.
            assert_eq!(found, ids.len(), "{what}");
        }
        let line = r.check_run(&p.run).await.unwrap().expect("reported");
        assert!(line.contains(&keys::index_run(&p.run)), "{line}");
        assert!(line.contains(what), "{what}: {line}");
        if pick == 1 {
            assert!(r.packs().await.unwrap_err().is_damage());
            assert_eq!(r.readable_packs().await.unwrap().len(), 0);
        } else {
            assert_eq!(r.packs().await.unwrap().len(), 4);
        }
    }
}

#[tokio::test]
async fn version_2_runs_older_builds_wrote_are_read_as_before() {
    for key in [None, Some(MasterKey::generate())] {
        let key = key.as_ref();
        let p = pieces(key, true).await;
        let r = p.reader(key).await;
        assert_eq!(r.run_sizes()[0].version, 2);
        for id in p.chunk_ids(key) {
            assert!(r.find_chunk(&id).await.unwrap().is_some());
        }
        assert_eq!(r.packs().await.unwrap().len(), 4);
        assert_eq!(r.check_run(&p.run).await.unwrap(), None);
    }
}

#[tokio::test]
async fn sparse_lookups_read_one_section_and_dense_ones_read_ahead() {
    // About 50 sections of 4 entries in one directory block.
    let geometry = Geometry {
        section_entries: 4,
        block_sections: 64,
        packs_per_block: 1,
    };
    let p = pieces_with(None, false, geometry).await;
    let whole = index_run::parse_run(&p.run_bytes, None).unwrap();
    let sections = whole.sections().count();
    assert!((40..64).contains(&sections), "{sections} sections");
    let ids = p.chunk_ids(None);
    let section_of = |id: &Id| whole.section_for(id).unwrap().1;
    // Two ids in neighbouring sections: the first read does not bring the second's section.
    let first = ids[0];
    let next = *ids
        .iter()
        .find(|id| section_of(id) == section_of(&first) + 1)
        .expect("an id in the next section");
    let r = p.reader(None).await;
    r.locate_chunk(&first).await.unwrap();
    r.locate_chunk(&next).await.unwrap();
    assert_eq!(
        r.fetches().sections,
        2,
        "no read-ahead while lookups are sparse"
    );
    // Once one section in 16 was read, reads take 16: asked in key order, every id costs
    // about one read per 16 sections.
    let mut sorted = ids.clone();
    sorted.sort_by_key(index_run::key_of);
    for id in &sorted {
        r.locate_chunk(id).await.unwrap();
    }
    let reads = r.fetches().sections;
    let most = sections.div_ceil(16) + sections / 16 + 2;
    assert!(reads <= most as u64, "{reads} section reads for {sections}");
}

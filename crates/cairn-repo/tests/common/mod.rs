//! What the v2 reader tests share: packs of real chunk groups, their locations, and a
//! repository over a directory store to publish them in.

#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;

use cairn_format::config::{Compression, RepoConfig};
use cairn_format::crypto::MasterKey;
use cairn_format::group::{group_id, GroupBuilder};
use cairn_format::index_run;
use cairn_format::pack::BlobKind;
use cairn_format::pack_v2::PackWriter;
use cairn_format::{keys, Id};
use cairn_repo::v2::{CacheLimits, V2Reader};
use cairn_repo::Repo;
use cairn_store::{LocalStore, ObjectStore};
use rand::Rng;

pub const CHUNK: usize = 4096;
pub const GROUP: usize = 64 << 10;

/// A group as written: its id, descriptor and its chunks' plain bytes.
pub struct Written {
    pub id: Id,
    pub chunks: Vec<Vec<u8>>,
}

/// A pack of `groups` groups of 16 chunks (half of them compressible) and what it holds.
pub fn pack(
    rng: &mut rand::rngs::StdRng,
    groups: usize,
    key: Option<&MasterKey>,
) -> (Id, Vec<u8>, Vec<Written>) {
    let mut w = PackWriter::new(key);
    let mut written = Vec::new();
    for g in 0..groups {
        let mut b = GroupBuilder::new(GROUP);
        let mut chunks = Vec::new();
        for _ in 0..GROUP / CHUNK {
            let mut c = vec![0u8; CHUNK];
            if g % 2 == 0 {
                rng.fill(&mut c[..]);
            } else {
                c[..64].fill(rng.gen());
            }
            let id = key.map_or_else(|| Id::of(&c), |k| k.id_of(&c));
            b.push(id, &c);
            chunks.push(c);
        }
        let group = b.finish(Compression::Zstd { level: 3 }, key);
        written.push(Written {
            id: group_id(&group.desc.chunks, key),
            chunks,
        });
        w.push(BlobKind::Data, group);
    }
    let (id, bytes, _) = w.finish();
    (id, bytes, written)
}

/// Every chunk and group id of `written` located in `pack`.
pub fn locations(pack: Id, written: &[Written], key: Option<&MasterKey>) -> Vec<(Id, Id)> {
    let mut out = Vec::new();
    for g in written {
        out.push((g.id, pack));
        for c in &g.chunks {
            out.push((key.map_or_else(|| Id::of(c), |k| k.id_of(c)), pack));
        }
    }
    out
}

pub struct Fixture {
    pub _dir: tempfile::TempDir,
    pub root: std::path::PathBuf,
    pub store: Arc<LocalStore>,
    pub repo: Repo,
}

pub async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("repo");
    let store = Arc::new(LocalStore::create(&root).unwrap());
    let repo = Repo::init(store.clone(), RepoConfig::default())
        .await
        .unwrap();
    Fixture {
        _dir: dir,
        root,
        store,
        repo,
    }
}

impl Fixture {
    pub async fn put(&self, key: &str, bytes: Vec<u8>) {
        self.store.put_if_absent(key, bytes.into()).await.unwrap();
    }

    /// Stores a pack and an index run of `locations`; returns the run's id.
    pub async fn publish(
        &self,
        packs: &[(Id, Vec<u8>)],
        locations: &[(Id, Id)],
        key: Option<&MasterKey>,
    ) -> Id {
        for (id, bytes) in packs {
            self.put(&keys::pack(id), bytes.clone()).await;
        }
        let run = index_run::write_run(locations, key);
        let id = Id::of(&run);
        self.put(&keys::index_run(&id), run).await;
        id
    }

    pub fn reader(&self, key: Option<MasterKey>) -> V2Reader {
        self.repo.v2_reader(key, CacheLimits::default())
    }

    pub fn object(&self, key: &str) -> std::path::PathBuf {
        self.root.join(key)
    }
}

pub fn flip(path: &Path, at: u64) {
    cairn_testkit::flip_file_byte(path, at as usize, 0x40);
}

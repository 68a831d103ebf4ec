//! Opening, creating and reading a repository; publishing packs and index files.

use std::ops::Range;
use std::sync::{Arc, RwLock, RwLockReadGuard};

use bytes::Bytes;
use cairn_format::config::{self, RepoConfig};
use cairn_format::index::{self, IndexFile};
use cairn_format::pack::{self, BlobEntry};
use cairn_format::Id;
use cairn_store::{ObjectStore, PutOutcome, StoreError};
use tokio::task::JoinSet;

use crate::blob_index::{BlobIndex, BlobLocation};
use crate::error::{RepoError, RepoResult};

pub const PACKS_PREFIX: &str = "packs/";

/// Key of a pack: `packs/<first two hex digits>/<id>` (fan-out keeps directories small).
pub fn pack_key(id: &Id) -> String {
    let hex = id.to_hex();
    format!("{PACKS_PREFIX}{}/{hex}", &hex[..2])
}

/// An open repository.
#[derive(Debug)]
pub struct Repo {
    store: Arc<dyn ObjectStore>,
    config: RepoConfig,
    index: RwLock<BlobIndex>,
    /// Index files that could not be read at open (reported by verify; their blobs count as
    /// missing, so a later commit stores them again).
    index_errors: Vec<String>,
}

impl Repo {
    /// Creates a new repository in `store`. Fails if one exists there already.
    pub async fn init(store: Arc<dyn ObjectStore>, config: RepoConfig) -> RepoResult<Repo> {
        config
            .validate()
            .map_err(|e| RepoError::Invalid(e.to_string()))?;
        match store
            .put_if_absent(config::KEY, Bytes::from(config.encode()))
            .await?
        {
            PutOutcome::Created => {}
            PutOutcome::AlreadyExists => {
                return Err(RepoError::AlreadyExists {
                    location: store.describe(),
                })
            }
        }
        Ok(Repo {
            store,
            config,
            index: RwLock::new(BlobIndex::new()),
            index_errors: Vec::new(),
        })
    }

    /// Opens an existing repository and loads its blob index.
    pub async fn open(store: Arc<dyn ObjectStore>) -> RepoResult<Repo> {
        let raw = match store.get(config::KEY).await {
            Ok(raw) => raw,
            Err(StoreError::NotFound { .. }) => {
                return Err(RepoError::NotARepository {
                    location: store.describe(),
                })
            }
            Err(e) => return Err(e.into()),
        };
        let config = RepoConfig::decode(&raw)
            .map_err(|e| RepoError::corrupt(format!("{}/{}", store.describe(), config::KEY), e))?;
        let mut repo = Repo {
            store,
            config,
            index: RwLock::new(BlobIndex::new()),
            index_errors: Vec::new(),
        };
        repo.load_index().await?;
        Ok(repo)
    }

    /// Reads every index file (in parallel) into the in-memory blob index.
    async fn load_index(&mut self) -> RepoResult<()> {
        let files = self.store.list(index::PREFIX).await?;
        let mut tasks = JoinSet::new();
        let mut pending = files.into_iter();
        let mut index = BlobIndex::new();
        loop {
            while tasks.len() < 16 {
                let Some(meta) = pending.next() else { break };
                let store = self.store.clone();
                tasks.spawn(async move {
                    let raw = store.get(&meta.key).await?;
                    Ok::<_, RepoError>(
                        IndexFile::decode(&raw).map_err(|e| RepoError::corrupt(meta.key, e)),
                    )
                });
            }
            match tasks.join_next().await {
                None => break,
                Some(res) => {
                    match res.map_err(|e| RepoError::Invalid(format!("index loader: {e}")))?? {
                        Ok(file) => index.add_file(&file),
                        Err(damaged) => {
                            tracing::warn!("{damaged}");
                            self.index_errors.push(damaged.to_string());
                        }
                    }
                }
            }
        }
        *self.index.write().expect("index lock") = index;
        Ok(())
    }

    /// Index files that were damaged at open, one line each.
    pub fn index_errors(&self) -> Vec<String> {
        self.index_errors.clone()
    }

    pub fn config(&self) -> &RepoConfig {
        &self.config
    }

    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// Where the repository lives, for messages.
    pub fn describe(&self) -> String {
        self.store.describe()
    }

    /// Read access to the blob index (hold it briefly: commits add to it).
    pub fn index(&self) -> RwLockReadGuard<'_, BlobIndex> {
        self.index.read().expect("index lock")
    }

    pub fn has_blob(&self, id: &Id) -> bool {
        self.index().contains(id)
    }

    pub fn locate(&self, id: &Id) -> RepoResult<BlobLocation> {
        self.index()
            .get(id)
            .ok_or(RepoError::BlobMissing { id: *id })
    }

    /// Bytes `range` of a pack.
    pub async fn read_pack_range(&self, pack: &Id, range: Range<u64>) -> RepoResult<Bytes> {
        Ok(self.store.get_range(&pack_key(pack), range).await?)
    }

    /// Decodes a blob's stored bytes and checks them against its id.
    pub fn decode_blob(loc: &BlobLocation, stored: &[u8]) -> RepoResult<Vec<u8>> {
        pack::decode_blob(&loc.entry, stored).map_err(|source| RepoError::BadBlob {
            id: loc.entry.id,
            pack: loc.pack,
            offset: loc.entry.offset,
            source,
        })
    }

    /// Reads one blob, verified.
    pub async fn read_blob(&self, id: &Id) -> RepoResult<Vec<u8>> {
        let loc = self.locate(id)?;
        let stored = match self.read_pack_range(&loc.pack, loc.entry.range()).await {
            Ok(b) => b,
            Err(RepoError::Store(StoreError::NotFound { .. })) => {
                return Err(RepoError::PackMissing {
                    pack: loc.pack,
                    id: *id,
                })
            }
            Err(RepoError::Store(e @ StoreError::RangeOutOfBounds { .. })) => {
                return Err(RepoError::BadBlob {
                    id: *id,
                    pack: loc.pack,
                    offset: loc.entry.offset,
                    source: cairn_format::FormatError::invalid(
                        "blob",
                        format!("pack truncated ({e})"),
                    ),
                })
            }
            Err(e) => return Err(e),
        };
        Self::decode_blob(&loc, &stored)
    }

    /// Stores a finished pack. Returns the bytes written (0 if an identical pack existed).
    pub async fn put_pack(&self, id: &Id, bytes: Bytes) -> RepoResult<u64> {
        let len = bytes.len() as u64;
        Ok(
            match self.store.put_if_absent(&pack_key(id), bytes).await? {
                PutOutcome::Created => len,
                PutOutcome::AlreadyExists => 0,
            },
        )
    }

    /// Publishes an index file for packs that are already durable, and makes their blobs
    /// visible to this process. Returns the bytes written.
    pub async fn put_index(&self, packs: Vec<(Id, Vec<BlobEntry>)>) -> RepoResult<u64> {
        if packs.is_empty() {
            return Ok(0);
        }
        let file = IndexFile {
            packs: packs
                .into_iter()
                .map(|(pack, entries)| index::PackIndex { pack, entries })
                .collect(),
        };
        let raw = file.encode();
        let id = Id::of(&raw);
        let len = raw.len() as u64;
        let written = match self
            .store
            .put_if_absent(&index::key(&id), Bytes::from(raw))
            .await?
        {
            PutOutcome::Created => len,
            PutOutcome::AlreadyExists => 0,
        };
        self.index.write().expect("index lock").add_file(&file);
        Ok(written)
    }
}

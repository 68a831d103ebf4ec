//! Whole-repository listings, for the commands that look at everything the store holds
//! (`stats`, `verify`, `repair`, GC) rather than at one version.

use bytes::Bytes;
use cairn_format::index::IndexFile;
use cairn_format::marker::Session;
use cairn_format::{keys, Id};
use cairn_store::{StoreError, StoreHints};

use crate::error::RepoResult;
use crate::repository::Repo;

/// Where a repository's bytes are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoredSpace {
    pub packs: u64,
    pub pack_bytes: u64,
    /// Everything else: index files, version records, summaries, markers, config.
    pub metadata_bytes: u64,
}

impl Repo {
    /// Every object in the store, summed up by kind.
    pub async fn stored_space(&self) -> RepoResult<StoredSpace> {
        let mut s = StoredSpace::default();
        for meta in self.store().list("").await? {
            if keys::pack_id(&meta.key).is_some() {
                s.packs += 1;
                s.pack_bytes += meta.size;
            } else {
                s.metadata_bytes += meta.size;
            }
        }
        Ok(s)
    }

    /// Every object under `prefix`, by key, with its bytes (one deleted between the listing
    /// and the read is left out).
    pub(crate) async fn read_listed(&self, prefix: &str) -> RepoResult<Vec<(String, Bytes)>> {
        let mut out = Vec::new();
        for meta in self.store().list(prefix).await? {
            match self.store().get(&meta.key).await {
                Ok(raw) => out.push((meta.key, raw)),
                Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(out)
    }

    /// Every version record in the store: its id, or (`Err`) the key of an object under
    /// `versions/` that does not name one.
    pub async fn version_record_ids(&self) -> RepoResult<Vec<Result<Id, String>>> {
        Ok(self
            .store()
            .list_keys(keys::VERSIONS)
            .await?
            .into_iter()
            .map(|key| keys::id_after(keys::VERSIONS, &key).ok_or(key))
            .collect())
    }

    /// Every index file in the store that decodes, and (key, error) of those that do not.
    pub async fn index_files_checked(
        &self,
    ) -> RepoResult<(Vec<(Id, IndexFile)>, Vec<(String, String)>)> {
        let (mut good, mut damaged) = (Vec::new(), Vec::new());
        for meta in self.store().list(keys::INDEX).await? {
            let Some(id) = keys::id_after(keys::INDEX, &meta.key) else {
                continue;
            };
            let raw = match self.store().get(&meta.key).await {
                Ok(raw) => raw,
                Err(StoreError::NotFound { .. }) => continue,
                Err(e) => return Err(e.into()),
            };
            match IndexFile::decode(&raw) {
                Ok(file) => good.push((id, file)),
                Err(e) => damaged.push((meta.key, e.to_string())),
            }
        }
        Ok((good, damaged))
    }

    /// A whole pack as stored (unverified: callers check each blob). A missing pack is an
    /// error for which [`RepoError::is_not_found`](crate::RepoError::is_not_found) holds.
    pub async fn read_whole_pack(&self, pack: &Id) -> RepoResult<Bytes> {
        Ok(self.store().get(&keys::pack(pack)).await?)
    }

    /// Every session in the store, with its key (`None`: a session ref that does not decode).
    pub async fn sessions(&self) -> RepoResult<Vec<(String, Option<Session>)>> {
        crate::session::list_sessions(self.store().as_ref()).await
    }

    /// How the store likes to be used (request sizes, parallelism).
    pub fn store_hints(&self) -> StoreHints {
        self.store().hints()
    }
}

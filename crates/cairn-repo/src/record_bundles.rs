//! GC's version record bundles (`gc/records/<content id>`; see `cairn_format::record_bundle`):
//! only GC writes them, under its lock; only GC reads them.

use bytes::Bytes;
use cairn_format::keys;
use cairn_format::record_bundle::RecordBundle;
use cairn_format::Id;

use crate::error::{RepoError, RepoResult};
use crate::repository::Repo;

impl Repo {
    /// Stores a bundle under its content id. Returns the key and the bytes written. (Not
    /// sealed again: each record in it is stored as under `versions/`, sealed there.)
    pub async fn put_record_bundle(&self, bundle: &RecordBundle) -> RepoResult<(String, u64)> {
        let raw = bundle.encode();
        let key = keys::record_bundle(&Id::of(&raw));
        let len = raw.len() as u64;
        self.store().put_if_absent(&key, Bytes::from(raw)).await?;
        Ok((key, len))
    }

    /// Every bundle, by key, with its stored size; a damaged one is an error in its place (GC
    /// reads the records from their own keys instead, and replaces it).
    pub async fn record_bundles(&self) -> RepoResult<Vec<(String, RepoResult<RecordBundle>, u64)>> {
        let listed = self.read_listed(keys::RECORD_BUNDLES).await?;
        Ok(listed
            .into_iter()
            .map(|(key, raw)| {
                let len = raw.len() as u64;
                let bundle = RecordBundle::decode(&raw).map_err(|e| RepoError::corrupt(&key, e));
                (key, bundle, len)
            })
            .collect())
    }

    pub async fn delete_record_bundle(&self, key: &str) -> RepoResult<()> {
        Ok(self.store().delete(key).await?)
    }
}

//! Reference summaries of manifest trees (`summaries/<root>`) and the freed markers of fast
//! deletion (`gc/freed/<version>`); see `cairn_format::summary` and `cairn_engine::gc`.

use cairn_format::id_hash::IdSet;
use cairn_format::keys;

use bytes::Bytes;
use cairn_format::crypto::Domain;
use cairn_format::group_summary::GroupSummary;
use cairn_format::marker::{encode_freed, GcLeftover};
use cairn_format::merged_summary::MergedSummary;
use cairn_format::summary::Summary;
use cairn_format::Id;
use cairn_store::StoreError;

use crate::error::{RepoError, RepoResult};
use crate::repository::Repo;
use crate::session::now_ns;

impl Repo {
    /// Stores the summary of the tree rooted at `root` (idempotent: equal trees have equal
    /// summaries). Returns the bytes written.
    pub async fn put_summary(&self, root: &Id, summary: &Summary) -> RepoResult<u64> {
        let raw = summary.encode();
        let len = raw.len() as u64;
        self.store()
            .put_if_absent(&keys::summary(root), Bytes::from(raw))
            .await?;
        Ok(len)
    }

    /// The summary of `root`: `Ok(None)` if there is none, an error naming the object if it is
    /// damaged (callers fall back to walking the tree).
    pub async fn load_summary(&self, root: &Id) -> RepoResult<Option<(Summary, u64)>> {
        let key = keys::summary(root);
        match self.store().get(&key).await {
            Ok(raw) => Summary::decode(&raw)
                .map(|s| Some((s, raw.len() as u64)))
                .map_err(|e| RepoError::corrupt(key, e)),
            Err(StoreError::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Stores the format 2 summary of the tree rooted at `root` (sealed in an encrypted
    /// repository; put-if-absent like [`Repo::put_summary`]). Returns the bytes written.
    pub async fn put_group_summary(&self, root: &Id, summary: &GroupSummary) -> RepoResult<u64> {
        let raw = self.seal(Domain::Summary, summary.encode());
        let len = raw.len() as u64;
        self.store()
            .put_if_absent(&keys::summary(root), Bytes::from(raw))
            .await?;
        Ok(len)
    }

    /// The format 2 summary of `root` and its stored size: `Ok(None)` if there is none, an
    /// error naming the object if it is damaged (callers rebuild it from the tree).
    pub async fn load_group_summary(&self, root: &Id) -> RepoResult<Option<(GroupSummary, u64)>> {
        let key = keys::summary(root);
        let raw = match self.store().get(&key).await {
            Ok(raw) => raw,
            Err(StoreError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let len = raw.len() as u64;
        let plain = self.open_sealed(Domain::Summary, "summary", &key, raw)?;
        GroupSummary::decode(&plain)
            .map(|s| Some((s, len)))
            .map_err(|e| RepoError::corrupt(key, e))
    }

    /// Roots that have a stored summary.
    pub async fn summary_roots(&self) -> RepoResult<Vec<(Id, u64)>> {
        parse_listing(self, keys::SUMMARIES).await
    }

    pub async fn delete_summary(&self, root: &Id) -> RepoResult<()> {
        Ok(self.store().delete(&keys::summary(root)).await?)
    }

    /// Stores a merged summary (sealed like a summary) under its content id. Returns the key
    /// and the bytes written.
    pub async fn put_merged_summary(&self, merged: &MergedSummary) -> RepoResult<(String, u64)> {
        let raw = self.seal(Domain::Summary, merged.encode());
        let key = keys::merged_summary(&Id::of(&raw));
        let len = raw.len() as u64;
        self.store().put_if_absent(&key, Bytes::from(raw)).await?;
        Ok((key, len))
    }

    /// Every merged summary, by key, with its stored size; a damaged one is an error in its
    /// place (GC drops it and builds the merge again from the trees' summaries).
    pub async fn merged_summaries(
        &self,
    ) -> RepoResult<Vec<(String, RepoResult<MergedSummary>, u64)>> {
        let listed = self.read_listed(keys::MERGED_SUMMARIES).await?;
        Ok(listed
            .into_iter()
            .map(|(key, raw)| {
                let len = raw.len() as u64;
                let merged = self
                    .open_sealed(Domain::Summary, "merged summary", &key, raw)
                    .and_then(|plain| {
                        MergedSummary::decode(&plain).map_err(|e| RepoError::corrupt(&key, e))
                    });
                (key, merged, len)
            })
            .collect())
    }

    pub async fn delete_merged_summary(&self, key: &str) -> RepoResult<()> {
        Ok(self.store().delete(key).await?)
    }

    /// Deletes every merged summary (listed, not read). Returns how many.
    pub async fn delete_merged_summaries(&self) -> RepoResult<u64> {
        let listed = self.store().list(keys::MERGED_SUMMARIES).await?;
        for meta in &listed {
            self.store().delete(&meta.key).await?;
        }
        Ok(listed.len() as u64)
    }

    /// Records that the space of deleted version `version` has been given back.
    pub async fn mark_freed(&self, version: &Id) -> RepoResult<()> {
        self.store()
            .put_if_absent(
                &keys::freed(version),
                Bytes::from(encode_freed(version, now_ns())),
            )
            .await?;
        Ok(())
    }

    /// Records the dead blobs a fast deletion left in packs it did not repack, for the next
    /// one to judge again. Returns the object's key.
    pub async fn put_gc_leftover(&self, leftover: &GcLeftover) -> RepoResult<String> {
        let raw = leftover.encode();
        let key = keys::leftover(&Id::of(&raw));
        self.store().put_if_absent(&key, Bytes::from(raw)).await?;
        Ok(key)
    }

    /// Every leftover list, by key (a damaged one is skipped with a warning: it is advisory).
    pub async fn gc_leftovers(&self) -> RepoResult<Vec<(String, GcLeftover)>> {
        let mut out = Vec::new();
        for meta in self.store().list(keys::LEFTOVERS).await? {
            match self.store().get(&meta.key).await {
                Ok(raw) => match GcLeftover::decode(&raw) {
                    Ok(l) => out.push((meta.key, l)),
                    Err(e) => {
                        tracing::warn!("{}: {e}", meta.key);
                        out.push((meta.key, GcLeftover::default()));
                    }
                },
                Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(out)
    }

    /// Deletes a leftover list (its blobs were judged again, or swept by the exact pass).
    pub async fn delete_gc_leftover(&self, key: &str) -> RepoResult<()> {
        Ok(self.store().delete(key).await?)
    }

    /// Deleted versions whose space some GC has already given back.
    pub async fn freed_versions(&self) -> RepoResult<IdSet> {
        Ok(parse_listing(self, keys::FREED)
            .await?
            .into_iter()
            .map(|(id, _)| id)
            .collect())
    }
}

/// Lists `prefix`, whose keys end in an id; returns (id, object size).
async fn parse_listing(repo: &Repo, prefix: &str) -> RepoResult<Vec<(Id, u64)>> {
    let mut out = Vec::new();
    for meta in repo.store().list(prefix).await? {
        let id = meta.key[prefix.len()..]
            .parse::<Id>()
            .map_err(|e| RepoError::corrupt(meta.key.clone(), e))?;
        out.push((id, meta.size));
    }
    Ok(out)
}

//! Reference summaries of manifest trees (`summaries/<root>`) and the freed markers of fast
//! deletion (`gc/freed/<version>`); see `cairn_format::summary` and `cairn_engine::gc`.

use cairn_format::id_hash::IdSet;
use cairn_format::keys;

use bytes::Bytes;
use cairn_format::crypto::Domain;
use cairn_format::group_summary::{delta_pays, GroupSummary, Resolved, StoredSummary};
use cairn_format::marker::{encode_freed, GcLeftover};
use cairn_format::merged_summary::MergedSummary;
use cairn_format::summary::Summary;
use cairn_format::FormatError;
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
    /// repository; put-if-absent like [`Repo::put_summary`]): as a delta from `base`, the
    /// resolved summary of another tree, when its chain allows and the delta pays
    /// (`cairn_format::group_summary::delta_pays`), whole otherwise. Returns the bytes written.
    pub async fn put_group_summary(
        &self,
        root: &Id,
        summary: &GroupSummary,
        base: Option<&Resolved>,
    ) -> RepoResult<u64> {
        let delta = base
            .and_then(|b| b.next_delta(summary))
            .filter(|d| delta_pays(d.len(), summary));
        let plain = delta.unwrap_or_else(|| summary.encode());
        let raw = self.seal(Domain::Summary, plain);
        let len = raw.len() as u64;
        self.store()
            .put_if_absent(&keys::summary(root), Bytes::from(raw))
            .await?;
        Ok(len)
    }

    /// The format 2 summary of `root` and the bytes read for it: `Ok(None)` if there is none,
    /// an error naming the object if it or a summary its chain names is damaged or missing
    /// (callers rebuild it from the tree).
    pub async fn load_group_summary(&self, root: &Id) -> RepoResult<Option<(GroupSummary, u64)>> {
        Ok(self
            .resolve_group_summary(root)
            .await?
            .map(|(r, len)| (r.summary, len)))
    }

    /// The format 2 summary of `root` resolved from its chain (what the next tree's delta
    /// is taken against), and the bytes read: the object, then every summary its chain
    /// names, fetched at once.
    pub async fn resolve_group_summary(&self, root: &Id) -> RepoResult<Option<(Resolved, u64)>> {
        let Some((stored, mut read)) = self.stored_summary(root).await? else {
            return Ok(None);
        };
        let delta = match stored {
            StoredSummary::Full(summary) => {
                return Ok(Some((Resolved::full(*root, summary), read)))
            }
            StoredSummary::Delta(delta) => delta,
        };
        let key = keys::summary(root);
        let broken = |reason: String| {
            RepoError::corrupt(key.clone(), FormatError::invalid("summary delta", reason))
        };
        let members =
            futures_util::future::try_join_all(delta.chain.iter().map(|member| async move {
                self.stored_summary(member).await.map(|s| (member, s))
            }))
            .await?;
        let mut full = None;
        let mut deltas = Vec::with_capacity(members.len().saturating_sub(1));
        for (i, (member, stored)) in members.into_iter().enumerate() {
            let Some((stored, len)) = stored else {
                return Err(broken(format!(
                    "its chain names {}, which is missing",
                    keys::summary(member)
                )));
            };
            read += len;
            match (i, stored) {
                (0, StoredSummary::Full(s)) => full = Some(s),
                (0, StoredSummary::Delta(_)) => {
                    return Err(broken("its chain starts with a delta".into()))
                }
                (_, StoredSummary::Delta(d)) => deltas.push(d),
                (_, StoredSummary::Full(_)) => {
                    return Err(broken(format!(
                        "its chain names {} as a delta; it is whole",
                        keys::summary(member)
                    )))
                }
            }
        }
        let full = full.ok_or_else(|| broken("an empty chain".into()))?;
        let resolved = Resolved::from_chain(*root, &delta, full, &deltas)
            .map_err(|e| RepoError::corrupt(key.clone(), e))?;
        Ok(Some((resolved, read)))
    }

    /// The summary object of `root` as stored (whole or a delta) and its size.
    async fn stored_summary(&self, root: &Id) -> RepoResult<Option<(StoredSummary, u64)>> {
        let key = keys::summary(root);
        let raw = match self.store().get(&key).await {
            Ok(raw) => raw,
            Err(StoreError::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        let len = raw.len() as u64;
        let plain = self.open_sealed(Domain::Summary, "summary", &key, raw)?;
        StoredSummary::decode(&plain)
            .map(|s| Some((s, len)))
            .map_err(|e| RepoError::corrupt(key, e))
    }

    /// The roots of the summaries the stored summary of `root` is resolved through (none for
    /// a whole one, or when there is no summary). A damaged object is an error.
    pub async fn summary_chain(&self, root: &Id) -> RepoResult<Vec<Id>> {
        Ok(match self.stored_summary(root).await? {
            Some((StoredSummary::Delta(d), _)) => d.chain,
            _ => Vec::new(),
        })
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

//! Tags, deletion markers and whole-image removal.

use cairn_format::id_hash::IdSet;
use cairn_format::keys;

use bytes::Bytes;
use cairn_format::marker::encode_deleted;
use cairn_format::refs::{self, validate_tag_name};
use cairn_format::Id;
use cairn_store::{CasOutcome, PutOutcome};

use crate::error::{RepoError, RepoResult};
use crate::repository::Repo;
use crate::session::now_ns;
use crate::versions::Damaged;

impl Repo {
    /// The version a tag names, if the tag exists.
    pub async fn tag(&self, image: &str, tag: &str) -> RepoResult<Option<Id>> {
        validate_tag_name(tag).map_err(|e| RepoError::BadInput(e.to_string()))?;
        let key = keys::tag(image, tag);
        match self.store().read_ref(&key).await? {
            None => Ok(None),
            Some(state) => {
                Ok(Some(refs::decode(&state.data).map_err(|e| {
                    RepoError::corrupt(format!("refs/{key}"), e)
                })?))
            }
        }
    }

    /// Creates a tag; fails if it exists already (tags never move silently).
    pub async fn create_tag(&self, image: &str, tag: &str, version: &Id) -> RepoResult<()> {
        validate_tag_name(tag).map_err(|e| RepoError::BadInput(e.to_string()))?;
        self.create_tag_at(&keys::tag(image, tag), version, || {
            format!("tag {tag:?} of image {image:?} already exists (delete it first)")
        })
        .await
    }

    /// Deletes a tag; fails if it does not exist.
    pub async fn delete_tag(&self, image: &str, tag: &str) -> RepoResult<()> {
        validate_tag_name(tag).map_err(|e| RepoError::BadInput(e.to_string()))?;
        self.delete_tag_at(&keys::tag(image, tag), || {
            format!("image {image:?} has no tag {tag:?}")
        })
        .await
    }

    /// Every tag of `image` as (name, version), sorted by name.
    pub async fn tags(&self, image: &str) -> RepoResult<Vec<(String, Id)>> {
        self.tags_under(&keys::tags_of(image)).await
    }

    /// Creates the tag ref `key` from "absent"; `exists` says why when it is there already.
    pub(crate) async fn create_tag_at(
        &self,
        key: &str,
        version: &Id,
        exists: impl FnOnce() -> String,
    ) -> RepoResult<()> {
        let outcome = self
            .store()
            .cas_ref(key, None, Some(Bytes::from(refs::encode(version))))
            .await?;
        match outcome {
            CasOutcome::Swapped { .. } => Ok(()),
            CasOutcome::Conflict { .. } => Err(RepoError::Exists(exists())),
        }
    }

    /// Deletes the tag ref `key`; `missing` says why when it is not there.
    pub(crate) async fn delete_tag_at(
        &self,
        key: &str,
        missing: impl FnOnce() -> String,
    ) -> RepoResult<()> {
        let Some(state) = self.store().read_ref(key).await? else {
            return Err(RepoError::NotFound(missing()));
        };
        self.store()
            .cas_ref(key, Some(&state.version), None)
            .await?;
        Ok(())
    }

    /// Every tag ref under `prefix` as (tag name, version), sorted by name.
    pub(crate) async fn tags_under(&self, prefix: &str) -> RepoResult<Vec<(String, Id)>> {
        let mut out = Vec::new();
        for key in self.store().list_refs(prefix).await? {
            let name = keys::tag_from_key(&key);
            if let Some(state) = self.store().read_ref(&key).await? {
                let id = refs::decode(&state.data)
                    .map_err(|e| RepoError::corrupt(format!("refs/{key}"), e))?;
                out.push((name, id));
            }
        }
        Ok(out)
    }

    /// Every tag in the repository as (ref key, version): GC roots. Fails on a damaged tag;
    /// [`Repo::all_tag_targets_checked`] reports it instead.
    pub async fn all_tag_targets(&self) -> RepoResult<Vec<(String, Id)>> {
        let (tags, damaged) = self.all_tag_targets_checked().await?;
        match damaged.into_iter().next() {
            Some(d) => Err(RepoError::IndexDamaged(d.to_string())),
            None => Ok(tags),
        }
    }

    /// Every readable tag as (ref key, version), and the tags that cannot be read.
    pub async fn all_tag_targets_checked(&self) -> RepoResult<(Vec<(String, Id)>, Vec<Damaged>)> {
        let mut out = Vec::new();
        let mut damaged = Vec::new();
        for key in self.store().list_refs(keys::TAGS).await? {
            if let Some(state) = self.store().read_ref(&key).await? {
                match refs::decode(&state.data) {
                    Ok(id) => out.push((key, id)),
                    Err(e) => damaged.push(Damaged {
                        key: format!("refs/{key}"),
                        problem: e.to_string(),
                    }),
                }
            }
        }
        Ok((out, damaged))
    }

    /// Marks a version deleted. Idempotent.
    pub async fn mark_deleted(&self, version: &Id) -> RepoResult<()> {
        // Only its key is ever read (a listing); sealed so its time says nothing either.
        let data = Bytes::from(self.seal(
            cairn_format::crypto::Domain::Marker,
            encode_deleted(version, now_ns()),
        ));
        match self
            .store()
            .put_if_absent(&keys::deleted(version), data)
            .await?
        {
            PutOutcome::Created | PutOutcome::AlreadyExists => Ok(()),
        }
    }

    /// Every version marked deleted. The marker's key names the version, so one listing
    /// answers this without reading each marker.
    pub async fn deleted_versions(&self) -> RepoResult<IdSet> {
        let mut out = IdSet::default();
        for meta in self.store().list(keys::DELETED).await? {
            let id = meta.key[keys::DELETED.len()..]
                .parse::<Id>()
                .map_err(|e| RepoError::corrupt(meta.key.clone(), e))?;
            out.insert(id);
        }
        Ok(out)
    }

    /// Removes an image's head ref and all its tags: the image disappears; its data is
    /// reclaimed by GC unless other images (clones) still use it.
    pub async fn remove_image(&self, image: &str) -> RepoResult<()> {
        for (tag, _) in self.tags(image).await? {
            self.delete_tag(image, &tag).await?;
        }
        let key = keys::head(image);
        let Some(state) = self.store().read_ref(&key).await? else {
            return Err(RepoError::NoSuchImage(image.to_string()));
        };
        match self
            .store()
            .cas_ref(&key, Some(&state.version), None)
            .await?
        {
            CasOutcome::Swapped { .. } => Ok(()),
            CasOutcome::Conflict { .. } => Err(RepoError::Conflict(format!(
                "image {image:?} changed while it was being removed; try again"
            ))),
        }
    }
}

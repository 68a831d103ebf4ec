//! Version records and image heads.

use bytes::Bytes;
use cairn_format::crypto::Domain;
use cairn_format::keys;
use cairn_format::name::unescape;
use cairn_format::refs;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_store::{CasOutcome, PutOutcome, RefVersion, StoreError};

use crate::error::{RepoError, RepoResult};
use crate::repository::Repo;

/// A metadata object that cannot be read: which, and why. Damage of this kind is reported
/// (by `verify`, `log`, `images`), never allowed to block work on the rest of the repository.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damaged {
    /// The object or ref key (`versions/<id>`, `refs/heads/<image>`).
    pub key: String,
    pub problem: String,
}

impl std::fmt::Display for Damaged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.key, self.problem)
    }
}

/// An image's head as read, with the token needed to swap it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadState {
    pub version: Id,
    pub token: RefVersion,
}

impl Repo {
    /// The newest version of `image`, if it has any.
    pub async fn head(&self, image: &str) -> RepoResult<Option<HeadState>> {
        self.head_at(&keys::head(image)).await
    }

    /// Moves `image`'s head to `new` if it still is `expected` (`None`: the image must not
    /// exist yet). Returns false if someone else moved it first.
    pub async fn swap_head(
        &self,
        image: &str,
        expected: Option<&HeadState>,
        new: &Id,
    ) -> RepoResult<bool> {
        self.swap_head_at(&keys::head(image), expected, new).await
    }

    /// The version the head ref `key` names, with its token, if the ref exists.
    pub(crate) async fn head_at(&self, key: &str) -> RepoResult<Option<HeadState>> {
        let Some(state) = self.store().read_ref(key).await? else {
            return Ok(None);
        };
        let version =
            refs::decode(&state.data).map_err(|e| RepoError::corrupt(format!("refs/{key}"), e))?;
        Ok(Some(HeadState {
            version,
            token: state.version,
        }))
    }

    /// Swaps the head ref `key` from `expected` to `new`; false when it moved meanwhile.
    pub(crate) async fn swap_head_at(
        &self,
        key: &str,
        expected: Option<&HeadState>,
        new: &Id,
    ) -> RepoResult<bool> {
        let outcome = self
            .store()
            .cas_ref(
                key,
                expected.map(|h| &h.token),
                Some(Bytes::from(refs::encode(new))),
            )
            .await?;
        Ok(matches!(outcome, CasOutcome::Swapped { .. }))
    }

    /// Points `image`'s head at `new` whatever it holds now, even bytes that do not decode
    /// (`cairn repair` rebuilding a damaged head). Returns false if it changed meanwhile.
    pub async fn overwrite_head(&self, image: &str, new: &Id) -> RepoResult<bool> {
        let key = keys::head(image);
        let token = self.store().read_ref(&key).await?.map(|s| s.version);
        let outcome = self
            .store()
            .cas_ref(&key, token.as_ref(), Some(Bytes::from(refs::encode(new))))
            .await?;
        Ok(matches!(outcome, CasOutcome::Swapped { .. }))
    }

    /// Every image that has a head, sorted. A head whose key is not a valid image name is
    /// skipped (and logged); [`Repo::images_checked`] reports it.
    pub async fn images(&self) -> RepoResult<Vec<String>> {
        let (images, damaged) = self.images_checked().await?;
        for d in damaged {
            tracing::warn!("{d}");
        }
        Ok(images)
    }

    /// Every image that has a head, sorted, and the head keys that name no valid image.
    pub async fn images_checked(&self) -> RepoResult<(Vec<String>, Vec<Damaged>)> {
        let keys = self.store().list_refs(keys::HEADS).await?;
        let mut out = Vec::with_capacity(keys.len());
        let mut damaged = Vec::new();
        for k in keys {
            let seg = &k[keys::HEADS.len()..];
            match unescape(seg) {
                Ok(name) => out.push(name),
                Err(e) => damaged.push(Damaged {
                    key: format!("refs/{k}"),
                    problem: e.to_string(),
                }),
            }
        }
        out.sort();
        Ok((out, damaged))
    }

    /// Reads and checks a version record.
    pub async fn load_version(&self, id: &Id) -> RepoResult<VersionRecord> {
        let stored = self.load_version_stored(id).await?;
        self.open_version(id, &stored)
    }

    /// A version record's bytes as stored (checked by [`Repo::open_version`]).
    pub async fn load_version_stored(&self, id: &Id) -> RepoResult<Bytes> {
        match self.store().get(&keys::version(id)).await {
            Ok(raw) => Ok(raw),
            Err(StoreError::NotFound { .. }) => Err(RepoError::VersionMissing { id: *id }),
            Err(e) => Err(e.into()),
        }
    }

    /// Checks a version record's stored bytes against its id (wherever they were read:
    /// its own key or a GC's record bundle) and decodes it.
    pub fn open_version(&self, id: &Id, stored: &Bytes) -> RepoResult<VersionRecord> {
        if Id::of(stored) != *id {
            return Err(RepoError::corrupt(
                keys::version(id),
                cairn_format::FormatError::Checksum {
                    what: "version record",
                },
            ));
        }
        // The key is formatted for errors only: GC opens a thousand records in a walk.
        let raw = match self.key() {
            None => stored.clone(),
            Some(_) => self.open_sealed(
                Domain::VersionRecord,
                "version record",
                &keys::version(id),
                stored.clone(),
            )?,
        };
        VersionRecord::decode(&raw).map_err(|e| RepoError::corrupt(keys::version(id), e))
    }

    /// Stores a version record (sealed in an encrypted repository; its id is the hash of
    /// the stored bytes either way); returns its id and the bytes written.
    pub async fn put_version(&self, record: &VersionRecord) -> RepoResult<(Id, u64)> {
        let raw = self.seal(Domain::VersionRecord, record.encode());
        let id = Id::of(&raw);
        let len = raw.len() as u64;
        let written = match self
            .store()
            .put_if_absent(&keys::version(&id), Bytes::from(raw))
            .await?
        {
            PutOutcome::Created => len,
            PutOutcome::AlreadyExists => 0,
        };
        Ok((id, written))
    }

    /// Deletes a version record this process wrote but never published (its ref swap failed).
    /// Best effort: a record left behind is garbage for the exact GC pass.
    pub async fn delete_unpublished_version(&self, id: &Id) {
        if let Err(e) = self.store().delete(&keys::version(id)).await {
            tracing::debug!(%id, "could not delete an unpublished version record: {e}");
        }
    }

    /// Ids of every stored version record whose hex id starts with `prefix`.
    pub async fn versions_with_prefix(&self, prefix: &str) -> RepoResult<Vec<Id>> {
        let prefix = prefix.to_ascii_lowercase();
        let listed = self
            .store()
            .list(&format!("{}{prefix}", keys::VERSIONS))
            .await?;
        Ok(listed
            .iter()
            .filter_map(|m| m.key[keys::VERSIONS.len()..].parse().ok())
            .collect())
    }
}

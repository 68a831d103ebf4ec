//! Setting damaged metadata aside (`cairn repair`): an object or ref that cannot be read is
//! moved under `damaged/` — its bytes kept for whoever wants to study them — so that it no
//! longer stands in the way (GC refuses to act on an unreadable index file; a corrupt head
//! hides its image's history). A version record that is lost (missing, or set aside) gets a
//! `damaged/versions/<id>` object either way, which tells history walks that the break in the
//! chain is known, so it is not reported as new damage again.

use bytes::Bytes;
use cairn_format::keys;
use cairn_format::Id;
use cairn_store::{CasOutcome, PutOutcome, StoreError};

use crate::error::RepoResult;
use crate::repository::Repo;

/// Where set-aside objects and refs go: `damaged/<original key>`, refs as
/// `damaged/refs/<ref key>`.
impl Repo {
    /// Moves object `key` to `damaged/<key>` (copy, then delete). Returns false if it was gone.
    /// Bytes set aside earlier under that name with other content (the same object damaged
    /// twice) are kept: these go to `damaged/<key>.1`, `.2`, … instead.
    pub async fn set_aside_object(&self, key: &str) -> RepoResult<bool> {
        let raw = match self.store().get(key).await {
            Ok(raw) => raw,
            Err(StoreError::NotFound { .. }) => return Ok(false),
            Err(e) => return Err(e.into()),
        };
        let base = keys::set_aside_object(key);
        for n in 0u32.. {
            let target = match n {
                0 => base.clone(),
                n => format!("{base}.{n}"),
            };
            match self.store().put_if_absent(&target, raw.clone()).await? {
                PutOutcome::Created => break,
                PutOutcome::AlreadyExists => {
                    if self.store().get(&target).await? == raw {
                        break; // a set-aside killed before its delete, done again
                    }
                }
            }
        }
        self.store().delete(key).await?;
        Ok(true)
    }

    /// Moves ref `key` to the object `damaged/refs/<key>` and deletes the ref, unless it
    /// changed meanwhile. Returns whether it was removed.
    pub async fn set_aside_ref(&self, key: &str) -> RepoResult<bool> {
        let Some(state) = self.store().read_ref(key).await? else {
            return Ok(false);
        };
        self.store()
            .put_if_absent(&keys::set_aside_ref(key), state.data.clone())
            .await?;
        Ok(matches!(
            self.store()
                .cas_ref(key, Some(&state.version), None)
                .await?,
            CasOutcome::Swapped { .. }
        ))
    }

    /// Records that version `id` is lost and known to be (see the module docs).
    pub async fn acknowledge_lost_version(&self, id: &Id) -> RepoResult<()> {
        let key = keys::set_aside_object(&keys::version(id));
        if self.store().head(&key).await?.is_none() {
            self.store()
                .put_if_absent(
                    &key,
                    Bytes::from_static(b"lost: recorded by cairn repair\n"),
                )
                .await?;
        }
        Ok(())
    }

    /// Whether version `id` is known lost (set aside or acknowledged by `cairn repair`).
    pub async fn is_known_lost_version(&self, id: &Id) -> RepoResult<bool> {
        let key = keys::set_aside_object(&keys::version(id));
        Ok(self.store().head(&key).await?.is_some())
    }
}

//! Boot profiles attached to images: the ref `profiles/<escaped image>` holds the JSON an
//! export recorded (`cairn_format::boot_profile`), replaced whole by the next recording. The
//! repository only stores the bytes; `cairn-export` says what they mean.

use bytes::Bytes;
use cairn_format::name::unescape;
use cairn_format::{boot_profile, keys};
use cairn_store::CasOutcome;

use crate::error::{RepoError, RepoResult};
use crate::repository::Repo;

/// Attempts at replacing a profile that others keep replacing (the last writer wins).
const ATTEMPTS: usize = 8;

impl Repo {
    /// The boot profile stored for `image` (its JSON), if any. Damage is an error naming the
    /// ref; the caller decides whether that matters (an export warns and goes on).
    pub async fn boot_profile(&self, image: &str) -> RepoResult<Option<Vec<u8>>> {
        let key = keys::boot_profile(image);
        let Some(state) = self.store().read_ref(&key).await? else {
            return Ok(None);
        };
        boot_profile::decode(&state.data, self.key())
            .map(Some)
            .map_err(|e| crate::v2::sealed_error(format!("refs/{key}"), e))
    }

    /// Stores `json` as `image`'s boot profile, replacing the one stored (sealed in an
    /// encrypted repository).
    pub async fn put_boot_profile(&self, image: &str, json: &[u8]) -> RepoResult<()> {
        let key = keys::boot_profile(image);
        let stored = Bytes::from(boot_profile::encode(json, self.key()));
        for _ in 0..ATTEMPTS {
            let token = self.store().read_ref(&key).await?.map(|s| s.version);
            let outcome = self
                .store()
                .cas_ref(&key, token.as_ref(), Some(stored.clone()))
                .await?;
            if matches!(outcome, CasOutcome::Swapped { .. }) {
                return Ok(());
            }
        }
        Err(RepoError::internal(
            "storing a boot profile",
            format!("refs/{key} kept changing"),
        ))
    }

    /// Removes `image`'s boot profile; false when it had none.
    pub async fn remove_boot_profile(&self, image: &str) -> RepoResult<bool> {
        let key = keys::boot_profile(image);
        for _ in 0..ATTEMPTS {
            let Some(state) = self.store().read_ref(&key).await? else {
                return Ok(false);
            };
            let outcome = self
                .store()
                .cas_ref(&key, Some(&state.version), None)
                .await?;
            if matches!(outcome, CasOutcome::Swapped { .. }) {
                return Ok(true);
            }
        }
        Err(RepoError::internal(
            "removing a boot profile",
            format!("refs/{key} kept changing"),
        ))
    }

    /// The images that have a boot profile, sorted (a key that names no valid image is
    /// skipped).
    pub async fn boot_profile_images(&self) -> RepoResult<Vec<String>> {
        let mut images: Vec<String> = self
            .store()
            .list_refs(keys::PROFILES)
            .await?
            .iter()
            .filter_map(|k| unescape(&k[keys::PROFILES.len()..]).ok())
            .collect();
        images.sort();
        Ok(images)
    }
}

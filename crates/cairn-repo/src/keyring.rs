//! Key slots of an encrypted repository (format v2): each slot is the master key wrapped under
//! one passphrase (Argon2id, `cairn_format::crypto::KeySlot`), stored as `keys/<id>` where the
//! id is the hash of the slot's bytes. Opening tries every slot; the master key a slot gives
//! must match the config's key check, so a slot planted in the bucket or left by an
//! interrupted `init` opens nothing. The last slot cannot be removed.
//!
//! Passphrases reach this module only through [`Passphrase`] (never argv, never a log line);
//! the CLI's sources are `CAIRN_PASSWORD`, `--password-file`, `--password-command` and a
//! terminal prompt.

use bytes::Bytes;
use cairn_format::config::RepoConfig;
use cairn_format::crypto::{CryptoError, Domain, KdfParams, KeySlot, MasterKey};
use cairn_format::{keys, Id};
use cairn_store::{ObjectStore, PutOutcome};
use zeroize::Zeroizing;

use crate::error::{RepoError, RepoResult};
use crate::repository::Repo;

/// Where a passphrase comes from; asked only when the repository is encrypted.
pub trait Passphrase: Send + Sync {
    fn get(&self) -> RepoResult<Zeroizing<Vec<u8>>>;
}

/// A passphrase already in memory (tests, and the CLI once it has read one).
pub struct GivenPassphrase(pub Zeroizing<Vec<u8>>);

impl Passphrase for GivenPassphrase {
    fn get(&self) -> RepoResult<Zeroizing<Vec<u8>>> {
        Ok(self.0.clone())
    }
}

/// One key slot, as `cairn key list` shows it.
#[derive(Debug, Clone)]
pub struct SlotInfo {
    pub id: Id,
    pub kdf: KdfParams,
    /// The slot that opened this repository in this process.
    pub current: bool,
}

/// The key of an unlocked repository and the slot that opened it.
#[derive(Debug, Clone)]
pub(crate) struct Unlocked {
    pub key: MasterKey,
    pub slot: Id,
}

/// Every key slot stored, checked against its id; damaged slots are skipped (with a warning:
/// another slot may still open the repository) and listed by key.
async fn read_slots(store: &dyn ObjectStore) -> RepoResult<Vec<(Id, KeySlot)>> {
    Ok(read_slots_checked(store).await?.0)
}

async fn read_slots_checked(
    store: &dyn ObjectStore,
) -> RepoResult<(Vec<(Id, KeySlot)>, Vec<String>)> {
    let mut damaged = Vec::new();
    let mut out = Vec::new();
    for meta in store.list(keys::KEY_SLOTS).await? {
        let Some(id) = keys::id_after(keys::KEY_SLOTS, &meta.key) else {
            continue;
        };
        let raw = store.get(&meta.key).await?;
        if Id::of(&raw) != id {
            tracing::warn!(
                "{}: damaged key slot (its bytes do not match its id)",
                meta.key
            );
            damaged.push(meta.key);
            continue;
        }
        match KeySlot::decode(&raw) {
            Ok(slot) => out.push((id, slot)),
            Err(e) => {
                tracing::warn!("{}: damaged key slot: {e}", meta.key);
                damaged.push(meta.key);
            }
        }
    }
    Ok((out, damaged))
}

/// Opens the master key of an encrypted repository with `passphrase`.
pub(crate) async fn unlock(
    store: &dyn ObjectStore,
    config: &RepoConfig,
    passphrase: &dyn Passphrase,
) -> RepoResult<Unlocked> {
    let check = config
        .v2
        .and_then(|v| v.key_check)
        .ok_or_else(|| RepoError::BadInput("unlock of a plain repository".into()))?;
    let (slots, damaged) = read_slots_checked(store).await?;
    if slots.is_empty() {
        let why = match damaged.as_slice() {
            [] => "an encrypted repository without any key slot (init interrupted?)".to_string(),
            keys => format!("every key slot is damaged ({})", keys.join(", ")),
        };
        return Err(RepoError::corrupt(
            format!("{}/{}", store.describe(), keys::KEY_SLOTS),
            cairn_format::FormatError::invalid("key slots", why),
        ));
    }
    let count = slots.len();
    let pass = passphrase.get()?;
    let found = tokio::task::spawn_blocking(move || {
        for (id, slot) in slots {
            match slot.open(&pass) {
                Ok(key) if key.key_check() == check => return Ok(Some(Unlocked { key, slot: id })),
                Ok(_) => tracing::warn!(
                    "key slot {id} opens with this passphrase but holds another repository's key"
                ),
                Err(CryptoError::WrongPassphrase) => {}
                Err(e) => tracing::warn!("key slot {id}: {e}"),
            }
        }
        Ok::<_, RepoError>(None)
    })
    .await
    .map_err(|e| RepoError::internal("key derivation", e))??;
    found.ok_or_else(|| RepoError::WrongPassphrase {
        location: store.describe(),
        slots: count,
    })
}

/// Wraps `key` under `passphrase` in a new slot and stores it; returns the slot's id.
pub(crate) async fn store_slot(
    store: &dyn ObjectStore,
    key: &MasterKey,
    passphrase: Zeroizing<Vec<u8>>,
    kdf: KdfParams,
) -> RepoResult<Id> {
    let key = key.clone();
    let slot = tokio::task::spawn_blocking(move || KeySlot::create(&key, &passphrase, kdf))
        .await
        .map_err(|e| RepoError::internal("key derivation", e))?
        .map_err(|e| RepoError::internal("key slot", e))?;
    let raw = slot.encode();
    let id = Id::of(&raw);
    match store
        .put_if_absent(&keys::key_slot(&id), Bytes::from(raw))
        .await?
    {
        PutOutcome::Created | PutOutcome::AlreadyExists => Ok(id),
    }
}

impl Repo {
    /// The master key of an encrypted repository (`None` when plain).
    pub fn key(&self) -> Option<&MasterKey> {
        self.unlocked().map(|u| &u.key)
    }

    /// The id of `data` in this repository: keyed BLAKE3 when encrypted, BLAKE3 otherwise.
    pub fn id_of(&self, data: &[u8]) -> Id {
        match self.key() {
            Some(k) => k.id_of(data),
            None => Id::of(data),
        }
    }

    /// `plain` as stored: sealed as `domain` in an encrypted repository, unchanged otherwise.
    pub(crate) fn seal(&self, domain: Domain, plain: Vec<u8>) -> Vec<u8> {
        match self.key() {
            Some(k) => k.seal(domain, &plain),
            None => plain,
        }
    }

    /// The plain bytes of an object stored by [`Repo::seal`] under `key` (named in errors).
    pub(crate) fn open_sealed(
        &self,
        domain: Domain,
        what: &'static str,
        key: &str,
        stored: Bytes,
    ) -> RepoResult<Bytes> {
        match self.key() {
            Some(k) => k
                .open(domain, what, &stored)
                .map(Bytes::from)
                .map_err(|e| crate::v2::sealed_error(key, e)),
            None => Ok(stored),
        }
    }

    /// The key slots, for `cairn key list`.
    pub async fn key_slots(&self) -> RepoResult<Vec<SlotInfo>> {
        self.require_encrypted("key list")?;
        let current = self.unlocked().map(|u| u.slot);
        Ok(read_slots(self.store().as_ref())
            .await?
            .into_iter()
            .map(|(id, slot)| SlotInfo {
                id,
                kdf: slot.kdf,
                current: Some(id) == current,
            })
            .collect())
    }

    /// Adds a slot that opens this repository with `passphrase`; returns its id.
    pub async fn add_key_slot(
        &self,
        passphrase: Zeroizing<Vec<u8>>,
        kdf: KdfParams,
    ) -> RepoResult<Id> {
        self.require_encrypted("key add")?;
        let key = self.key().expect("encrypted");
        store_slot(self.store().as_ref(), key, passphrase, kdf).await
    }

    /// Removes key slot `id`; refuses to remove the last one (the repository would be lost).
    pub async fn remove_key_slot(&self, id: &Id) -> RepoResult<()> {
        self.require_encrypted("key remove")?;
        let slots = read_slots(self.store().as_ref()).await?;
        if !slots.iter().any(|(s, _)| s == id) {
            return Err(RepoError::NotFound(format!("no key slot {id}")));
        }
        if slots.len() == 1 {
            return Err(RepoError::Refused(format!(
                "key slot {id} is the last one: removing it would lose the repository \
                 (add another first: `cairn key add`)"
            )));
        }
        self.store().delete(&keys::key_slot(id)).await?;
        Ok(())
    }

    /// Key slots exist only in encrypted repositories.
    fn require_encrypted(&self, what: &str) -> RepoResult<()> {
        if self.key().is_none() {
            return Err(RepoError::BadInput(format!(
                "{what}: {} is not encrypted (key slots exist only in repositories made with \
                 `cairn init --encrypt`)",
                self.describe()
            )));
        }
        Ok(())
    }
}

/// Finds a slot id by its full hex id or a unique prefix of it.
pub fn match_slot(slots: &[SlotInfo], prefix: &str) -> RepoResult<Id> {
    let prefix = prefix.to_ascii_lowercase();
    let matches: Vec<&SlotInfo> = slots
        .iter()
        .filter(|s| s.id.to_hex().starts_with(&prefix))
        .collect();
    match matches.as_slice() {
        [one] => Ok(one.id),
        [] => Err(RepoError::NotFound(format!("no key slot {prefix}"))),
        _ => Err(RepoError::BadInput(format!(
            "key slot prefix {prefix} is ambiguous ({} slots)",
            matches.len()
        ))),
    }
}

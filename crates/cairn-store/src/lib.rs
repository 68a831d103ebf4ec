//! The object-store layer: the only place cairn touches storage.
//!
//! A repository is a set of *immutable* objects (packs, indexes, version records, the config),
//! written once and never changed, plus a few *mutable refs* (an image's head, its tags) that
//! change only by compare-and-swap. That split is what lets one format run on a local
//! directory, on S3-compatible clusters (conditional PUT, ranged GET) and in memory for tests.
//!
//! The trait is deliberately narrow. Everything richer (caching, retries, prefixes, limits)
//! belongs in wrappers around it, not in it.
//!
//! Keys are `/`-separated paths of `[A-Za-z0-9._%-]` segments; see [`validate_key`].

mod counting;
mod error;
mod failing;
mod key;
mod local;
mod memory;
mod staged;

pub mod conformance;

use std::fmt::Debug;
use std::ops::Range;
use std::time::SystemTime;

use async_trait::async_trait;
use bytes::Bytes;

pub use counting::CountingStore;
pub use error::{StoreError, StoreResult};
pub use failing::FailingStore;
pub use key::{
    validate_key, validate_object_key, validate_prefix, validate_ref_key, REFS_SEGMENT, TEMP_PREFIX,
};
pub use local::{LocalStore, RESERVE_NAME};
pub use memory::MemoryStore;
pub use staged::StagedFile;

/// What `put_if_absent` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutOutcome {
    /// The object did not exist and is now durably stored.
    Created,
    /// An object with that key already existed; it was left untouched.
    AlreadyExists,
}

/// One entry of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectMeta {
    /// Full key, including the listed prefix.
    pub key: String,
    /// Size in bytes.
    pub size: u64,
}

/// An opaque token naming one state of a ref, used for compare-and-swap.
///
/// On a local directory it is a hash of the ref's content; on S3 it will be the ETag.
/// Callers must treat it as opaque and only hand it back to [`ObjectStore::cas_ref`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RefVersion(pub String);

/// The current state of a ref.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefState {
    pub data: Bytes,
    pub version: RefVersion,
}

/// What `cas_ref` did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CasOutcome {
    /// The ref now holds the new value (or was deleted); `version` is its new token
    /// (`None` after a delete).
    Swapped { version: Option<RefVersion> },
    /// The ref did not match `expected`; nothing changed. `current` is what it holds now.
    Conflict { current: Option<RefState> },
}

/// Access-pattern hints of a store: what one request costs compared with the bytes it moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StoreHints {
    /// Unneeded bytes worth reading to save one request (blobs closer than this in a pack are
    /// fetched in one ranged read).
    pub read_gap: u64,
    /// Large uploads (packs) worth running at once.
    pub uploads: usize,
}

impl StoreHints {
    /// A local disk: seeks are cheap, and a few writers already saturate it.
    pub const LOCAL: StoreHints = StoreHints {
        read_gap: 256 << 10,
        uploads: 3,
    };
    /// A store across a network: every request costs a round trip, so read past gaps and keep
    /// more uploads in flight.
    pub const REMOTE: StoreHints = StoreHints {
        read_gap: 2 << 20,
        uploads: 8,
    };
}

/// A store of immutable objects and compare-and-swap refs.
///
/// Contract (checked by [`conformance::run_all`] for every implementation):
/// - `put_if_absent` is atomic and durable when it returns `Created`: readers see either no
///   object or the whole object, never a prefix, even after a crash.
/// - `get`/`get_range` return exactly the stored bytes; a range that reaches past the end of
///   the object is an error ([`StoreError::RangeOutOfBounds`]), never a short read.
/// - `list` returns every object whose key starts with `prefix`, sorted by key; refs are not
///   objects and do not appear in listings of object prefixes (they live under their own keys).
///   `list_keys` returns the same keys.
/// - `delete` is idempotent.
/// - `cas_ref` swaps only if the ref's current version equals `expected` (`None` = the ref
///   must not exist); `new = None` deletes the ref.
#[async_trait]
pub trait ObjectStore: Send + Sync + Debug {
    /// Human-readable location (a path or URL) for error messages. Never contains secrets.
    fn describe(&self) -> String;

    /// How the store likes to be used; readers and writers size their requests by it.
    fn hints(&self) -> StoreHints {
        StoreHints::LOCAL
    }

    /// Store `data` under `key` unless an object with that key exists.
    async fn put_if_absent(&self, key: &str, data: Bytes) -> StoreResult<PutOutcome>;

    /// A fresh file in which to write an object that will go under `prefix`, if the store
    /// can publish a file without copying it ([`publish_staged`](Self::publish_staged));
    /// `None` (the default): build the object in memory and `put_if_absent` it.
    async fn stage(&self, prefix: &str) -> StoreResult<Option<StagedFile>> {
        validate_prefix(prefix)?;
        Ok(None)
    }

    /// `put_if_absent` of a staged file's content (written in full; made durable here). On
    /// `Created` the file is the object and never changes again; on `AlreadyExists` it is
    /// left as it was. The default copies it (a wrapper's inner store may have staged it).
    async fn publish_staged(&self, key: &str, staged: &mut StagedFile) -> StoreResult<PutOutcome> {
        let data = staged.read_all()?;
        let outcome = self.put_if_absent(key, Bytes::from(data)).await?;
        if outcome == PutOutcome::Created {
            staged.set_published();
        }
        Ok(outcome)
    }

    /// The whole object.
    async fn get(&self, key: &str) -> StoreResult<Bytes>;

    /// Bytes `range` of the object.
    async fn get_range(&self, key: &str, range: Range<u64>) -> StoreResult<Bytes>;

    /// The object's size, or `None` if it does not exist.
    async fn head(&self, key: &str) -> StoreResult<Option<u64>>;

    /// Every object whose key starts with `prefix`, sorted by key.
    async fn list(&self, prefix: &str) -> StoreResult<Vec<ObjectMeta>>;

    /// The keys `list` returns, without sizes: a local directory then stats no file (a
    /// listing an object store returns has the sizes anyway).
    async fn list_keys(&self, prefix: &str) -> StoreResult<Vec<String>> {
        Ok(self
            .list(prefix)
            .await?
            .into_iter()
            .map(|m| m.key)
            .collect())
    }

    /// Remove an object; succeeds if it does not exist.
    async fn delete(&self, key: &str) -> StoreResult<()>;

    /// The current state of a ref, or `None` if it does not exist.
    async fn read_ref(&self, key: &str) -> StoreResult<Option<RefState>>;

    /// Every ref whose key starts with `prefix`, sorted by key.
    async fn list_refs(&self, prefix: &str) -> StoreResult<Vec<String>>;

    /// Compare-and-swap a ref: see the trait documentation.
    async fn cas_ref(
        &self,
        key: &str,
        expected: Option<&RefVersion>,
        new: Option<Bytes>,
    ) -> StoreResult<CasOutcome>;

    /// Physically removes what deleted refs under `prefix` left behind, if the store keeps
    /// anything (S3 keeps a tombstone per deleted ref); returns how many were removed. Only for
    /// prefixes whose keys are never used again (session refs): on a reused key, removing a
    /// tombstone could race with a re-creation of the ref.
    async fn forget_deleted_refs(&self, prefix: &str) -> StoreResult<usize> {
        validate_prefix(prefix)?;
        Ok(0)
    }

    /// Removes what interrupted writes left behind (the local store's temporary files) that
    /// was last modified before `before` — a time before which every writer that is still
    /// alive started. Returns how many were removed and their bytes. Stores that write
    /// atomically without temporaries (S3) have nothing to remove.
    async fn remove_stale_temporaries(&self, before: SystemTime) -> StoreResult<(u64, u64)> {
        let _ = before;
        Ok((0, 0))
    }

    /// Checks, quickly, that the store can be reached and used at all (a remote endpoint
    /// answers, the credentials are accepted, the bucket exists), before a command starts
    /// work whose requests would each retry for minutes. Local stores have nothing to check.
    async fn check_reachable(&self) -> StoreResult<()> {
        Ok(())
    }

    /// After space was freed: reallocates a space reserve that a write on a full disk
    /// released (local stores; see `LocalStore::for_deletion`). Returns whether it did.
    async fn replenish_reserve(&self) -> StoreResult<bool> {
        Ok(false)
    }
}

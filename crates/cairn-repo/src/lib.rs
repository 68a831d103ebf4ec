//! The repository layer: a cairn repository on top of an [`ObjectStore`].
//!
//! It knows the object layout (config, packs, index files, version records, refs) and gives
//! the engine verified reads and ordered, atomic publication:
//! packs → index file → version record → ref (compare-and-swap). Nothing is visible to a
//! reader before everything it refers to is durable, so a crash at any point leaves only
//! unreferenced garbage.
//!
//! [`ObjectStore`]: cairn_store::ObjectStore
#![forbid(unsafe_code)]

mod blob_index;
mod blob_reads;
mod content_cache;
mod error;
mod gc_protocol;
mod history;
mod keyring;
mod layout;
mod listings;
mod profiles;
mod quarantine;
mod record_bundles;
mod repository;
pub mod session;
mod set_aside;
mod summaries;
pub mod tree_walk;
pub mod v2;
mod versions;
mod vms;

pub use blob_index::{BlobIndex, BlobLocation};
/// A scratch file in the store's staging area, and the prefix of every temporary file a
/// local store keeps: the store's own types, named here so that layers above cairn-repo
/// depend on it alone.
pub use cairn_store::{StagedFile, TEMP_PREFIX};
pub use content_cache::{user_cache_dir, ContentCache};
pub use error::{RepoError, RepoResult};
pub use gc_protocol::{GcLock, GcLockAttempt, PublishedPlan};
pub use keyring::{match_slot, GivenPassphrase, Passphrase, SlotInfo};
pub use listings::StoredSpace;
pub use repository::Repo;
pub use session::SessionKind;
pub use versions::{Damaged, HeadState};

//! Lazy deployment: serve any stored version over NBD at once, fetching its data on demand.
//!
//! - [`cache`]: the host-wide, content-addressed chunk cache (LRU, size limit)
//! - [`base`]: a stored version read lazily (leaves and chunks on first use, read-ahead)
//! - [`export`]: the NBD backend: base + the writable overlay (cairn-overlay), block status,
//!   COMMIT of the overlay as a new version
//! - [`stats`]: per-export counters
//! - [`control`]: the control socket (status, COMMIT, overlay snapshots) of a running export

pub mod base;
pub mod cache;
pub mod control;
pub mod export;
pub mod stats;

pub use base::Base;
pub use cache::ChunkCache;
pub use export::VersionExport;
pub use stats::ExportStats;

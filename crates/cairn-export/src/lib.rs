//! Lazy deployment: serve any stored version over NBD at once, fetching its data on demand.
//!
//! - the host-wide chunk cache is a [`ContentCache`] (cairn-repo): content-addressed, LRU
//! - [`base`]: a stored version read lazily (leaves and chunks on first use, read-ahead)
//! - [`export`]: the NBD backend: base + the writable overlay (cairn-overlay), block status,
//!   COMMIT of the overlay as a new version
//! - [`stats`]: per-export counters
//! - [`error`]: typed errors, carried inside the `io::Error`s the NBD server sees
//! - [`control`]: the control socket (status, COMMIT, overlay snapshots) of a running export
//! - [`lifecycle`]: the private run directory, state files, claiming names and sockets
//! - [`notify`]: systemd readiness notification (`sd_notify`)
//! - [`policy`]: who may connect to a writable export, the read-ahead default

pub mod base;
pub mod control;
pub mod error;
pub mod export;
pub mod lifecycle;
pub mod notify;
pub mod policy;
pub mod profile;
mod segment_map;
pub mod stats;

pub use base::Base;
pub use cairn_repo::ContentCache;
pub use error::{ExportError, ExportResult};
pub use export::VersionExport;
pub use stats::ExportStats;

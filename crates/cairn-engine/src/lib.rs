//! The versioning engine of cairn: everything between a disk image and the repository.
//!
//! - [`source`]: where data comes from (disk images: raw files and devices, qcow2 chains,
//!   NBD exports; streams), read politely
//! - [`chunker`]: segments → chunks (fixed or FastCDC, restarting at segment boundaries)
//! - [`commit`]: the parallel commit pipeline and ordered publication; under it
//!   [`commit::patch`] (a base version plus changed blocks: a writable export's overlay),
//!   [`commit::incremental`] (only what a qcow2 overlay or a dirty bitmap says changed) and
//!   [`commit::plan`] (which of these a source gets)
//! - [`tree`]: building and walking manifest trees (versioned segment trees)
//! - [`restore`]: parallel, out-of-order, sparse restore
//! - [`segment`]: one segment of a version, read through its leaf (either format)
//! - [`diff`]: which byte ranges differ between two versions, reading only changed subtrees
//! - [`verify`]: re-read everything, name the damaged versions
//! - [`gc`]: garbage collection, safe with concurrent commits
//! - [`interrupt`]: SIGINT/SIGTERM end long work at its next safe point
//! - [`resolve`]: `IMAGE[@REF]` and history
//! - [`live`]: which versions are alive (GC roots, retention)
//! - [`clone`]: a new image from an existing version, in O(1)
//! - [`copy`]: versions from one repository into another, sending only what changed
//! - [`remove`]: removing versions and images
//! - [`repair`]: rebuild heads, index and summaries; store lost blobs again from a source
//! - [`retention`]: keep-last/hourly/daily/weekly/monthly policies and prune
//! - [`stats`]: repository-wide figures
//! - [`progress`]: live counters of verify and GC for a progress display

pub mod chunker;
pub mod clone;
pub mod commit;
pub mod copy;
pub mod diff;
mod error;
pub mod file_lock;
pub mod gc;
pub mod interrupt;
pub mod live;
pub mod progress;
pub mod relayout;
pub mod remove;
pub mod repair;
pub mod resolve;
pub mod restore;
pub mod retention;
pub mod seeds;
pub mod segment;
pub mod source;
pub mod stats;
pub mod tree;
pub mod verify;
pub mod vm;

pub use error::{EngineError, EngineResult};

//! The versioning engine of cairn: everything between a disk image and the repository.
//!
//! - [`source`]: where data comes from (sparse-aware files, block devices, streams)
//! - [`chunker`]: segments → chunks (fixed or FastCDC, restarting at segment boundaries)
//! - [`commit`]: the parallel commit pipeline and ordered publication
//! - [`tree`]: building and walking manifest trees (versioned segment trees)
//! - [`restore`]: parallel, out-of-order, sparse restore
//! - [`verify`]: re-read everything, name the damaged versions
//! - [`resolve`]: `IMAGE[@REF]` and history
//! - [`stats`]: repository-wide figures

pub mod chunker;
pub mod commit;
mod error;
pub mod resolve;
pub mod restore;
pub mod source;
pub mod stats;
pub mod tree;
pub mod verify;

pub use error::{EngineError, EngineResult};

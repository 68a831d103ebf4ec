//! The byte-level repository format of cairn, version 1 (see `docs/FORMAT.md`).
//!
//! This crate only turns structures into bytes and back; it does no I/O. Every decoder treats
//! its input as untrusted: lengths are bounds-checked, magics and versions are checked, and
//! every structure carries a checksum (BLAKE3) that is verified before anything is parsed.
//! All integers are little-endian.
#![forbid(unsafe_code)]

pub mod boot_profile;
pub mod codec;
pub mod config;
pub mod crypto;
pub mod envelope;
mod error;
pub mod group;
pub mod group_frame;
pub mod group_summary;
pub mod id;
pub mod id_hash;
pub mod index;
pub mod index_run;
pub mod keys;
pub mod leaf_v2;
pub mod marker;
pub mod memstate;
pub mod merged_summary;
pub mod name;
pub mod node;
pub mod pack;
pub mod pack_v2;
pub mod record_bundle;
pub mod refs;
pub mod slots;
pub mod summary;
pub mod version;
pub mod vm;

pub use error::{FormatError, FormatResult};
pub use id::Id;

/// The repository format version this build writes and the newest it can read.
pub const FORMAT_VERSION: u32 = 1;

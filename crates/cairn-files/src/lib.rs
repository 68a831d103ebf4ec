//! cairn versions as files.
//!
//! - [`mount`](mod@mount): `cairn mount` — a read-only FUSE file system with a directory per
//!   image and a file per version (`@N.raw`, `@TAG.raw`, `latest.raw`), read lazily through an
//!   export's reader and the host-wide chunk cache ([`fuse_fs`], names in [`namespace`]).
//! - [`guest`]: `cairn ls|cat IMAGE@V:/path` — one file or directory inside the guest's file
//!   system of a version, read without a mount and without restoring the image.

pub mod error;
pub mod fuse_fs;
pub mod guest;
pub mod mount;
pub mod namespace;

pub use error::{FilesError, FilesResult};
pub use fuse_fs::Shared;
pub use mount::{check_mount_point, mount, unmount, Mounted, UnmountError};

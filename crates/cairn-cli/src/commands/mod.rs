//! One file per command.

pub mod clone;
pub mod commit;
pub mod copy;
pub mod diff;
pub mod docs;
pub mod export;
pub mod exports;
pub mod gc;
pub mod guest;
pub mod images;
pub mod index;
pub mod init;
pub mod key;
pub mod log;
pub mod mount;
pub mod profile;
pub mod prune;
pub mod relayout;
pub mod repair;
pub mod restore;
pub mod rm;
pub mod show;
pub mod stats;
pub mod tag;
pub mod verify;
pub mod vm;

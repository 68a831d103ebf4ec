//! One file per command.

pub mod commit;
pub mod images;
pub mod init;
pub mod log;
pub mod restore;
pub mod show;
pub mod stats;
pub mod verify;

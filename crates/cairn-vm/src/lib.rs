//! Whole VMs: consistent, incremental backups of running QEMU VMs through QMP and the guest
//! agent. The repository side of a VM version (its record, head, history) is in
//! `cairn_engine::vm`; this crate is the QEMU side.

pub mod agent;
pub mod backup;
pub mod block;
pub mod config;
mod error;
pub mod instant;
pub mod qmp;

pub use error::{VmError, VmResult};

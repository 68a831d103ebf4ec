//! Whole VMs: consistent, incremental backups of running VMs, through QEMU's QMP socket and
//! its guest agent, or through libvirt; instant recovery from lazy exports. The repository
//! side of a VM version (record, head, history) is `cairn_engine::vm`; this crate is the
//! hypervisor side.

pub mod agent;
pub mod backup;
pub mod block;
pub mod config;
mod error;
pub mod hypervisor;
pub mod instant;
pub mod libvirt;
pub mod memory;
pub mod migration;
pub mod qemu;
pub mod qmp;

pub use error::{VmError, VmResult};

//! What a VM backup needs from the hypervisor side, whichever drives the VM: QEMU over its
//! QMP socket ([`crate::qemu`]) or libvirt ([`crate::libvirt`]). The repository side — plans,
//! commits, publication, discarding what a failed backup committed — is the same for both
//! ([`crate::backup`]).

use std::time::Duration;

use cairn_format::vm::ConfigKind;

use crate::error::VmResult;

/// Prefix of every checkpoint (dirty bitmap, libvirt checkpoint) a backup creates.
pub const CHECKPOINT_PREFIX: &str = "cairn-cp-";

/// One disk of the VM as the hypervisor reports it.
#[derive(Debug, Clone)]
pub struct DiskInfo {
    /// Its name in the VM (drive id, or libvirt target such as `vda`): its image is `VM/NAME`.
    pub name: String,
    /// What it was read from (QEMU node, libvirt source file), recorded for the operator.
    pub node: String,
    /// The image format (`qcow2` keeps checkpoints across restarts; others do not).
    pub format: String,
    pub size: u64,
    /// The checkpoints this disk can report changes since (consistent ones only).
    pub checkpoints: Vec<String>,
}

/// How the backup reads one disk after the point in time.
#[derive(Debug, Clone)]
pub struct Reader {
    /// The NBD URL of the point-in-time view.
    pub url: String,
    /// The dirty bitmap the export carries (incremental reads only).
    pub bitmap: Option<String>,
}

/// Whether the guest's file systems were frozen, as the hypervisor side managed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frozen {
    /// No guest agent was configured.
    NoAgent,
    Yes,
    /// The agent did not answer in time (the backup goes on crash-consistent).
    NoAnswer,
}

/// The hypervisor side of a backup, in the order the backup calls it.
#[allow(async_fn_in_trait)] // used generically within this crate only
pub trait Hypervisor {
    /// "the QEMU behind /run/vm.qmp", "libvirt domain web01": for messages.
    fn describe(&self) -> String;
    /// Identifies the VM process on this host, so that two backups of it never overlap.
    fn lock_key(&self) -> String;
    /// Refuses a VM that is not running or paused.
    async fn check_running(&mut self) -> VmResult<()>;
    /// Removes what a killed backup left (jobs, exports, scratch images) and thaws a guest
    /// it left frozen; one line per thing removed.
    async fn clean_stale(&mut self) -> Vec<String>;
    /// The VM's writable disks; `say` hears of checkpoints that had to be dropped.
    async fn disks(&mut self, say: &(dyn Fn(String) + Send + Sync)) -> VmResult<Vec<DiskInfo>>;
    /// Work before the point in time that must not lengthen the freeze (scratch nodes).
    async fn prepare(&mut self, disks: &[DiskInfo]) -> VmResult<()>;
    /// Asks the guest agent to freeze the file systems, bounded by `timeout`; with a line
    /// for the operator when it could not.
    async fn freeze(&mut self, timeout: Duration) -> (Frozen, Option<String>);
    async fn thaw(&mut self, timeout: Duration);
    /// One point in time across `disks`, starting checkpoint `checkpoint`; `since[i]` is the
    /// checkpoint disk `i` is read incrementally from (`None`: read whole).
    async fn point_in_time(
        &mut self,
        disks: &[DiskInfo],
        since: &[Option<String>],
        checkpoint: &str,
    ) -> VmResult<()>;
    /// Saves the guest's memory and device state ([`crate::memory`]) and leaves the guest
    /// paused at that instant, its disks ready for the point in time.
    async fn save_memory(&mut self) -> VmResult<crate::memory::Saved>;
    /// Lets a guest [`Hypervisor::save_memory`] paused run again (after a failure too).
    async fn resume(&mut self);
    /// The point-in-time view of each disk, exported over NBD.
    async fn expose(
        &mut self,
        disks: &[DiskInfo],
        since: &[Option<String>],
    ) -> VmResult<Vec<Reader>>;
    /// Ends the backup job and removes its exports and scratch images, whatever happened.
    async fn teardown(&mut self);
    /// Once the VM version naming `keep` is published: drops the older checkpoints.
    async fn drop_checkpoints(&mut self, disks: &[DiskInfo], keep: &str) -> VmResult<()>;
    /// The VM's configuration, to record.
    async fn config(&mut self) -> (ConfigKind, String);
}

//! Layout facts of qcow2 shared by the reader and the writer (QEMU's
//! `docs/interop/qcow2.txt`), and the limits QEMU itself enforces.

/// Smallest and largest cluster sizes (as `cluster_bits`): 512 B and 2 MiB.
pub(crate) const MIN_CLUSTER_BITS: u32 = 9;
pub(crate) const MAX_CLUSTER_BITS: u32 = 21;
/// QEMU refuses active L1 tables larger than this (`QCOW_MAX_L1_SIZE`); so do we, before
/// allocating or writing one.
pub(crate) const MAX_L1_BYTES: u64 = 32 << 20;
/// …and refcount tables larger than this (`QCOW_MAX_REFTABLE_SIZE`).
pub(crate) const MAX_REFTABLE_BYTES: u64 = 8 << 20;
/// L1 and standard L2 entries: bits 9-55 hold a host offset.
pub(crate) const ENTRY_OFFSET_MASK: u64 = 0x00ff_ffff_ffff_fe00;
/// Host offsets must stay below bit 56.
pub(crate) const MAX_HOST_OFFSET: u64 = 1 << 56;
/// L1/L2 flag: the cluster's refcount is exactly 1 (writable in place).
pub(crate) const COPIED: u64 = 1 << 63;

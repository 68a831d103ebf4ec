//! The compact qcow2 writer. (Skeleton: API fixed, implementation pending.)

use std::fs::File;
use std::path::Path;

use crate::error::ImageResult;

/// Writes a qcow2 v3 image whose never-written clusters stay unallocated.
/// `write_at` may be called from several threads, at any offsets, in any order.
pub struct Qcow2Writer {}

impl Qcow2Writer {
    /// Starts an image of `size` guest bytes in `file` (empty, opened read+write), with
    /// clusters of `1 << cluster_bits` bytes. `path` is for messages.
    pub fn create(_file: File, _path: &Path, _size: u64, _cluster_bits: u32) -> ImageResult<Self> {
        todo!()
    }
    /// Writes guest bytes at `offset`. Clusters touched for the first time are allocated;
    /// a full-cluster write of zeros to an unallocated cluster allocates nothing.
    pub fn write_at(&self, _data: &[u8], _offset: u64) -> ImageResult<()> {
        todo!()
    }
    /// Writes the metadata (L2 tables, L1 table, refcounts, header), syncs, and returns the
    /// file.
    pub fn finish(self) -> ImageResult<File> {
        todo!()
    }
}

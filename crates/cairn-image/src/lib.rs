//! Disk image containers: what a commit reads from and a restore writes to, besides raw bytes.
//!
//! A [`DiskImage`] is a guest-visible disk of `size()` bytes with an allocation map: which
//! ranges hold data, which read as zeros, and — for layered formats — which layer of a
//! backing chain defines each range. The commit engine reads only the `Data` runs (and, for
//! an overlay committed on top of a known parent, only the runs its top layers define).
//!
//! - [`qcow2`]: a careful reader of qcow2 v2/v3 (compressed clusters, zero clusters, backing
//!   chains of qcow2 and raw files) and a compact writer.
//! - [`raw`]: raw files (sparse-aware) and block devices, with polite or direct reads.
//! - [`detect`]: which container a file is (`--format auto`).
//! - [`pagecache`]: reading without evicting the host's page cache.

pub mod contract;
pub mod detect;
pub mod error;
pub mod pagecache;
pub mod qcow2;
pub mod raw;

pub use detect::{detect_format, ImageFormat};
pub use error::{ImageError, ImageResult};
pub use raw::{RawImage, RawOptions};

/// How a guest range is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Allocation {
    /// Holds data (which may still happen to be zeros); must be read.
    Data,
    /// Defined to read as zeros (a qcow2 zero cluster, a hole the source reports as zero).
    Zero,
    /// Not defined by any layer: reads as zeros.
    Unallocated,
}

/// One run of an allocation map: `[start, start + len)` has allocation `alloc`, defined by the
/// layer at `depth` of the chain (0 = the image itself, 1 = its backing file, …).
/// `Unallocated` runs have `depth` = the chain's length (no layer defines them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MapRun {
    pub start: u64,
    pub len: u64,
    pub alloc: Allocation,
    pub depth: usize,
}

impl MapRun {
    pub fn end(&self) -> u64 {
        self.start + self.len
    }
}

/// One file of a backing chain, for messages, `--json` and overlay commits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer {
    pub path: std::path::PathBuf,
    pub format: ImageFormat,
    /// Virtual size of this layer.
    pub size: u64,
}

/// A readable disk image: a guest-visible size, an allocation map, and positional reads.
/// Implementations are safe to read from several threads at once.
pub trait DiskImage: Send + Sync {
    /// What the image is, for messages (a path, an NBD URL).
    fn describe(&self) -> String;
    /// Guest-visible size in bytes (as found when the image was opened).
    fn size(&self) -> u64;
    /// The size the image has now, where it can change under a reader (a raw file someone
    /// resized); `None` where it cannot be known cheaply. Lets a commit notice a source that
    /// changed size while it was read.
    fn size_now(&self) -> Option<u64> {
        None
    }
    /// The allocation map: sorted, non-overlapping runs covering exactly `[0, size())`, with
    /// adjacent runs of equal `(alloc, depth)` merged.
    fn map(&self) -> ImageResult<Vec<MapRun>>;
    /// Fills `buf` with the guest bytes at `offset` (`offset + buf.len() <= size()`).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> ImageResult<()>;
    /// The chain, top first (a single entry for a flat image).
    fn layers(&self) -> Vec<Layer>;
}

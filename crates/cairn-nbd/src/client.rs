//! A blocking NBD client: reads a disk that any NBD server exports (qemu-nbd,
//! qemu-storage-daemon, nbdkit, cairn's own export) as a [`DiskImage`].
//! (Skeleton: API fixed, implementation pending.)

use cairn_image::{DiskImage, ImageResult, Layer, MapRun};

/// A connected NBD export.
pub struct NbdImage {}

impl NbdImage {
    /// Connects to `url` (`nbd://HOST[:PORT][/EXPORT]` or `nbd+unix:///EXPORT?socket=PATH`).
    /// With `dirty_bitmap`, also negotiates the `qemu:dirty-bitmap:NAME` meta context.
    pub fn connect(_url: &str, _dirty_bitmap: Option<&str>) -> ImageResult<NbdImage> {
        todo!()
    }
    /// The extents the dirty bitmap marks dirty, as sorted, merged `(start, end)` pairs.
    pub fn dirty_extents(&self) -> ImageResult<Vec<(u64, u64)>> {
        todo!()
    }
}

impl DiskImage for NbdImage {
    fn describe(&self) -> String {
        todo!()
    }
    fn size(&self) -> u64 {
        todo!()
    }
    fn map(&self) -> ImageResult<Vec<MapRun>> {
        todo!()
    }
    fn read_at(&self, _buf: &mut [u8], _offset: u64) -> ImageResult<()> {
        todo!()
    }
    fn layers(&self) -> Vec<Layer> {
        todo!()
    }
}

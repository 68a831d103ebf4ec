//! The qcow2 reader. (Skeleton: API fixed, implementation pending.)

use std::path::Path;

use crate::error::ImageResult;
use crate::{DiskImage, Layer, MapRun};

/// How to open an image.
#[derive(Debug, Clone, Default)]
pub struct OpenOptions {
    /// After reading data clusters from a file, tell the kernel they are not needed again
    /// (`posix_fadvise(DONTNEED)`), so a scan does not evict the host's page cache.
    pub drop_cache: bool,
}

/// An open qcow2 image with its whole backing chain.
pub struct Qcow2Image {}

impl Qcow2Image {
    /// Opens `path` and its backing chain (qcow2 or raw backing files; relative backing
    /// names resolve against the directory of the image naming them).
    pub fn open(_path: &Path, _options: OpenOptions) -> ImageResult<Qcow2Image> {
        todo!()
    }
    /// Parses only the bytes of one image file with no backing chain (for the fuzz target).
    pub fn parse_bytes(_bytes: &[u8]) -> ImageResult<()> {
        todo!()
    }
}

impl DiskImage for Qcow2Image {
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

//! Where a commit reads from: a disk image (raw file or block device, qcow2 with its backing
//! chain, an NBD export — anything implementing [`cairn_image::DiskImage`]) or a stream.
//!
//! Images are read from their allocation maps: only `Data` runs are read, so work is
//! proportional to data, not to the disk's size. A segment that lies entirely outside data
//! runs is not produced at all (it is zeros in the manifest).
//!
//! - `image`: segments from a [`DiskImage`](cairn_image::DiskImage)'s data runs
//! - `stream`: segments from stdin or a pipe, every byte in order
//! - `polite`: read-rate limiting for scans of a live host
//! - `open`: opening a local path with format detection and read policy

mod image;
mod open;
mod polite;
mod stream;

pub use cairn_image::raw::data_extents;
pub use image::ImageSource;
pub use open::{open_image, open_path, ReadPolicy, SourceFormat};
pub use polite::RateLimited;
pub use stream::{InterruptibleStdin, StreamSource};

use crate::error::EngineResult;

/// One segment read from a source. `data.len()` is the segment's logical length (the last
/// segment may be short); bytes in holes are zero.
pub struct Segment {
    pub index: u64,
    pub data: Vec<u8>,
}

/// A source of image data, read segment by segment, in increasing order.
pub trait Source: Send {
    /// What the source is, for messages.
    fn describe(&self) -> String;
    /// Logical size if known before reading (files, devices), for progress.
    fn size_hint(&self) -> Option<u64>;
    /// Bytes that will actually be read (allocated extents), for progress.
    fn data_hint(&self) -> Option<u64>;
    /// The next segment holding data, or `None` at the end. `buf` is a recycled buffer.
    fn next_segment(&mut self, segment_size: u32, buf: Vec<u8>) -> EngineResult<Option<Segment>>;
    /// The logical size, valid once `next_segment` returned `None`.
    fn final_size(&self) -> u64;
    /// The source's size now, where it can change while it is read (a raw file); `None` if
    /// unknown. A commit whose source changed size publishes nothing.
    fn size_now(&self) -> Option<u64> {
        None
    }
}

//! Segments from a disk image's data runs.

use std::sync::Arc;

use cairn_image::{Allocation, DiskImage};

use super::{Segment, Source};
use crate::error::EngineResult;

/// Reads the `Data` runs of an image's allocation map (at any depth of a backing chain),
/// segment by segment; `Zero` and `Unallocated` runs are never read.
pub struct ImageSource {
    image: Arc<dyn DiskImage>,
    size: u64,
    /// Data runs as (start, end), sorted.
    extents: Vec<(u64, u64)>,
    /// First extent that may still overlap unread segments.
    next_extent: usize,
    /// First segment not yet produced.
    next_seg: u64,
}

impl ImageSource {
    /// Maps the image (cheap: metadata only) and prepares to read its data.
    pub fn new(image: Arc<dyn DiskImage>) -> EngineResult<ImageSource> {
        let size = image.size();
        let extents = image
            .map()?
            .into_iter()
            .filter(|r| r.alloc == Allocation::Data)
            .map(|r| (r.start, r.end()))
            .collect();
        Ok(ImageSource {
            image,
            size,
            extents,
            next_extent: 0,
            next_seg: 0,
        })
    }
}

impl Source for ImageSource {
    fn describe(&self) -> String {
        self.image.describe()
    }
    fn size_hint(&self) -> Option<u64> {
        Some(self.size)
    }
    fn data_hint(&self) -> Option<u64> {
        Some(self.extents.iter().map(|(s, e)| e - s).sum())
    }
    fn final_size(&self) -> u64 {
        self.size
    }
    fn size_now(&self) -> Option<u64> {
        self.image.size_now()
    }

    fn next_segment(
        &mut self,
        segment_size: u32,
        mut buf: Vec<u8>,
    ) -> EngineResult<Option<Segment>> {
        let seg_size = segment_size as u64;
        // Skip extents that end before the next unread segment.
        while self.next_extent < self.extents.len()
            && self.extents[self.next_extent].1 <= self.next_seg * seg_size
        {
            self.next_extent += 1;
        }
        let Some(&(ext_start, _)) = self.extents.get(self.next_extent) else {
            return Ok(None);
        };
        let seg = (ext_start / seg_size).max(self.next_seg);
        let start = seg * seg_size;
        let end = (start + seg_size).min(self.size);
        buf.clear();
        buf.resize((end - start) as usize, 0);
        // Read every extent part that overlaps this segment; the rest stays zero.
        for &(es, ee) in &self.extents[self.next_extent..] {
            if es >= end {
                break;
            }
            let (rs, re) = (es.max(start), ee.min(end));
            if rs < re {
                let dst = &mut buf[(rs - start) as usize..(re - start) as usize];
                self.image.read_at(dst, rs)?;
            }
        }
        self.next_seg = seg + 1;
        Ok(Some(Segment {
            index: seg,
            data: buf,
        }))
    }
}

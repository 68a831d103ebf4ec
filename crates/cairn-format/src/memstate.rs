//! Memory state images: how a VM's RAM and device state (QEMU's migration stream) is laid out
//! as an ordinary image, `VM/.memory`, so that it is chunked, deduplicated against the VM's
//! earlier states and verified like any disk, and zero pages cost nothing (they are holes).
//!
//! ```text
//! 0                 header: an envelope "CRNMEM\0\0" (layout below), then zeros
//! 2 MiB × k         each RAM block's bytes, page for page, at its 2 MiB-aligned offset
//! tail offset       the stream's bytes after its RAM section (device state, end, description)
//! ```
//!
//! Header payload:
//!
//! ```text
//! page size (u32) | section footers (u8: 0 no, 1 yes)
//! prefix (u32 len + bytes): the stream's bytes before its RAM section (magic, version,
//!                           configuration)
//! RAM section id (u32) | instance id (u32) | version id (u32)
//! blocks (u16 n) | n × [ id (u8 len + bytes) | used length (u64) | offset (u64) ]
//! tail offset (u64) | tail length (u64)
//! ```
//!
//! The RAM blocks keep the order of the stream's memory-size record; their offsets are
//! 2 MiB-aligned, increasing and non-overlapping, and the tail follows the last of them.

use crate::codec::{Decoder, Encoder};
use crate::envelope;
use crate::{FormatError, FormatResult};

pub const MAGIC: &[u8; 8] = b"CRNMEM\0\0";
const WHAT: &str = "memory state header";
/// Alignment of each region of the image (and the room the header has).
pub const REGION_ALIGN: u64 = 2 << 20;
/// The image name component that holds a VM's memory state (`VM/.memory`); disk names never
/// begin with a dot.
pub const MEMORY_IMAGE: &str = ".memory";
/// Most RAM blocks one stream may name (a PC has about ten).
pub const MAX_BLOCKS: usize = 1024;
/// Largest prefix and tail kept (device state is kilobytes; guest RAM is in the blocks).
pub const MAX_PREFIX: usize = 1 << 20;
pub const MAX_TAIL: u64 = 256 << 20;

/// One RAM block of the guest (QEMU's `RAMBlock`: "pc.ram", "/rom@etc/acpi/tables", ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RamBlock {
    pub id: String,
    pub length: u64,
    /// Where the block's bytes begin in the image.
    pub offset: u64,
}

/// Where everything of one memory state lies in its image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryLayout {
    pub page_size: u32,
    /// Whether the stream ends each section with a footer.
    pub footers: bool,
    pub prefix: Vec<u8>,
    pub section_id: u32,
    pub instance_id: u32,
    pub version_id: u32,
    pub blocks: Vec<RamBlock>,
    pub tail_offset: u64,
    pub tail_len: u64,
}

fn align(v: u64, to: u64) -> u64 {
    v.div_ceil(to) * to
}

impl MemoryLayout {
    /// A layout for blocks of these `(id, length)`, in order; the tail offset follows them.
    pub fn plan(
        page_size: u32,
        prefix: Vec<u8>,
        section: (u32, u32, u32),
        blocks: &[(String, u64)],
    ) -> MemoryLayout {
        let mut at = REGION_ALIGN;
        let blocks = blocks
            .iter()
            .map(|(id, length)| {
                let b = RamBlock {
                    id: id.clone(),
                    length: *length,
                    offset: at,
                };
                at = align(at + length, REGION_ALIGN);
                b
            })
            .collect();
        MemoryLayout {
            page_size,
            footers: false,
            prefix,
            section_id: section.0,
            instance_id: section.1,
            version_id: section.2,
            blocks,
            tail_offset: at,
            tail_len: 0,
        }
    }

    /// The image's size: the tail's end, rounded up to the page size.
    pub fn image_size(&self) -> u64 {
        align(self.tail_offset + self.tail_len, self.page_size as u64)
    }

    /// The RAM's total size, as the stream's memory-size record states it.
    pub fn ram_bytes(&self) -> u64 {
        self.blocks.iter().map(|b| b.length).sum()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::with_capacity(64 + self.prefix.len() + 64 * self.blocks.len());
        e.u32(self.page_size)
            .u8(self.footers as u8)
            .u32(self.prefix.len() as u32)
            .bytes(&self.prefix)
            .u32(self.section_id)
            .u32(self.instance_id)
            .u32(self.version_id)
            .u16(self.blocks.len() as u16);
        for b in &self.blocks {
            e.u8(b.id.len() as u8)
                .bytes(b.id.as_bytes())
                .u64(b.length)
                .u64(b.offset);
        }
        e.u64(self.tail_offset).u64(self.tail_len);
        let out = envelope::seal(MAGIC, &e.finish());
        assert!(
            out.len() as u64 <= REGION_ALIGN,
            "memory state header too large"
        );
        out
    }

    /// Reads the header from the first bytes of the image (at least the envelope; trailing
    /// bytes are the padding and are ignored).
    pub fn decode(head: &[u8]) -> FormatResult<MemoryLayout> {
        if head.len() < envelope::HEADER_LEN {
            return Err(FormatError::Truncated {
                what: WHAT,
                needed: envelope::HEADER_LEN as u64,
                available: head.len() as u64,
            });
        }
        let len = u32::from_le_bytes(head[12..16].try_into().expect("4")) as usize;
        let total = (envelope::HEADER_LEN + len + envelope::CHECKSUM_LEN).min(head.len());
        let payload = envelope::open(MAGIC, &head[..total], WHAT)?;
        let mut d = Decoder::new(payload, WHAT);
        let page_size = d.u32()?;
        if !page_size.is_power_of_two() || !(512..=65536).contains(&page_size) {
            return Err(FormatError::invalid(WHAT, format!("page size {page_size}")));
        }
        let footers = match d.u8()? {
            0 => false,
            1 => true,
            f => return Err(FormatError::invalid(WHAT, format!("footers {f}"))),
        };
        let n = d.u32()? as usize;
        if n > MAX_PREFIX {
            return Err(FormatError::invalid(WHAT, format!("prefix of {n} bytes")));
        }
        let prefix = d.take(n)?.to_vec();
        let (section_id, instance_id, version_id) = (d.u32()?, d.u32()?, d.u32()?);
        let n = d.u16()? as usize;
        if n == 0 || n > MAX_BLOCKS {
            return Err(FormatError::invalid(WHAT, format!("{n} RAM blocks")));
        }
        let mut blocks: Vec<RamBlock> = Vec::with_capacity(n);
        let mut end = REGION_ALIGN;
        for _ in 0..n {
            let idlen = d.u8()? as usize;
            let id = String::from_utf8(d.take(idlen)?.to_vec())
                .map_err(|_| FormatError::invalid(WHAT, "a RAM block id that is not UTF-8"))?;
            let (length, offset) = (d.u64()?, d.u64()?);
            if id.is_empty()
                || offset % REGION_ALIGN != 0
                || offset < end
                || length % page_size as u64 != 0
                || offset.checked_add(length).is_none()
            {
                return Err(FormatError::invalid(
                    WHAT,
                    format!("RAM block {id:?} of {length} bytes at {offset}"),
                ));
            }
            end = offset + length;
            blocks.push(RamBlock { id, length, offset });
        }
        let (tail_offset, tail_len) = (d.u64()?, d.u64()?);
        d.finish()?;
        if tail_offset < end || tail_len > MAX_TAIL || tail_offset.checked_add(tail_len).is_none() {
            return Err(FormatError::invalid(
                WHAT,
                format!("tail of {tail_len} bytes at {tail_offset}"),
            ));
        }
        Ok(MemoryLayout {
            page_size,
            footers,
            prefix,
            section_id,
            instance_id,
            version_id,
            blocks,
            tail_offset,
            tail_len,
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample() -> MemoryLayout {
        let mut l = MemoryLayout::plan(
            4096,
            b"QEVM\0\0\0\x03\x07".to_vec(),
            (2, 0, 4),
            &[("pc.ram".into(), 128 << 20), ("pc.bios".into(), 256 << 10)],
        );
        l.footers = true;
        l.tail_len = 12345;
        l
    }

    #[test]
    fn round_trip_and_layout() {
        let l = sample();
        assert_eq!(l.blocks[0].offset, 2 << 20);
        assert_eq!(l.blocks[1].offset, 130 << 20);
        assert_eq!(l.tail_offset, 132 << 20);
        assert_eq!(l.image_size(), (132 << 20) + 16384);
        let mut head = l.encode();
        head.resize(REGION_ALIGN as usize, 0);
        assert_eq!(MemoryLayout::decode(&head).unwrap(), l);
    }

    #[test]
    fn damage_is_refused() {
        let good = sample().encode();
        for cut in [0, 10, good.len() - 1] {
            assert!(MemoryLayout::decode(&good[..cut]).is_err(), "cut {cut}");
        }
        let mut flipped = good.clone();
        flipped[30] ^= 1;
        assert!(MemoryLayout::decode(&flipped).is_err());
        let mut overlapping = sample();
        overlapping.blocks[1].offset = overlapping.blocks[0].offset;
        assert!(MemoryLayout::decode(&overlapping.encode()).is_err());
    }
}

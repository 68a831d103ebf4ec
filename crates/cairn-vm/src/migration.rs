//! QEMU's migration stream, to and from a memory state image ([`cairn_format::memstate`]).
//!
//! [`receive`] reads the stream a `migrate` sends and lays its RAM pages out page for page in
//! an image file (zero pages stay holes; a page sent twice keeps its last copy), keeping the
//! bytes before the RAM section (header, configuration) and after it (device state) verbatim.
//! [`emit`] writes a stream an incoming QEMU loads: the same prefix, one RAM section holding
//! every page once, and the same device state.
//!
//! Only what a plain migration sends is understood: the RAM section with pages whole or zero.
//! Compression, XBZRLE, multifd, postcopy and block migration each get one clear error.
//! The stream's layout (QEMU's `migration/savevm.c` and `migration/ram.c`): big-endian
//! integers; sections `START id idstr instance version` / `PART id` / `END id`, each RAM
//! section a run of `be64 offset|flags` records ended by EOS, optionally followed by a
//! footer `0x7e id`.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::fs::FileExt;

use cairn_format::memstate::{MemoryLayout, MAX_PREFIX, MAX_TAIL};

const FILE_MAGIC: u32 = 0x5145_564d; // "QEVM"
const FILE_VERSION: u32 = 3;

const SECTION_EOF: u8 = 0x00;
const SECTION_START: u8 = 0x01;
const SECTION_PART: u8 = 0x02;
const SECTION_END: u8 = 0x03;
const SECTION_FULL: u8 = 0x04;
const SUBSECTION: u8 = 0x05;
const CONFIGURATION: u8 = 0x07;
const SECTION_FOOTER: u8 = 0x7e;

const FLAG_ZERO: u64 = 0x02;
const FLAG_MEM_SIZE: u64 = 0x04;
const FLAG_PAGE: u64 = 0x08;
const FLAG_EOS: u64 = 0x10;
const FLAG_CONTINUE: u64 = 0x20;

/// Largest guest RAM taken (4 TiB; its page bitmap alone is then 128 MiB).
const MAX_RAM: u64 = 4 << 40;

/// The page size when the stream does not state one (x86's, and most targets').
const DEFAULT_PAGE_BITS: u32 = 12;

/// Why a stream could not be read.
#[derive(Debug)]
pub enum StreamError {
    Io(io::Error),
    /// The bytes are not a stream cairn understands (what, and at which byte).
    Bad(String),
}

impl std::fmt::Display for StreamError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StreamError::Io(e) => write!(f, "{e}"),
            StreamError::Bad(s) => write!(f, "{s}"),
        }
    }
}

impl From<io::Error> for StreamError {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::UnexpectedEof => StreamError::Bad("the stream ends early".into()),
            _ => StreamError::Io(e),
        }
    }
}

type StreamResult<T> = Result<T, StreamError>;

/// What [`receive`] read.
#[derive(Debug, Clone)]
pub struct Received {
    pub layout: MemoryLayout,
    /// Bytes of the stream.
    pub stream_bytes: u64,
    /// Pages holding data (not zero) in the image.
    pub data_pages: u64,
}

/// A reader that counts and, while asked, keeps what it reads.
struct Input<R> {
    inner: R,
    read: u64,
    kept: Option<Vec<u8>>,
}

impl<R: Read> Input<R> {
    fn bytes<const N: usize>(&mut self) -> StreamResult<[u8; N]> {
        let mut b = [0u8; N];
        self.fill(&mut b)?;
        Ok(b)
    }
    fn fill(&mut self, buf: &mut [u8]) -> StreamResult<()> {
        self.inner.read_exact(buf)?;
        self.read += buf.len() as u64;
        if let Some(kept) = self.kept.as_mut() {
            kept.extend_from_slice(buf);
            if kept.len() > MAX_PREFIX {
                return Err(StreamError::Bad(
                    "no RAM section in the stream's first MiB".into(),
                ));
            }
        }
        Ok(())
    }
    fn u8(&mut self) -> StreamResult<u8> {
        Ok(self.bytes::<1>()?[0])
    }
    fn be32(&mut self) -> StreamResult<u32> {
        Ok(u32::from_be_bytes(self.bytes()?))
    }
    fn be64(&mut self) -> StreamResult<u64> {
        Ok(u64::from_be_bytes(self.bytes()?))
    }
    /// A string with a u8 length (QEMU's idstr).
    fn idstr(&mut self) -> StreamResult<String> {
        let n = self.u8()? as usize;
        let mut b = vec![0u8; n];
        self.fill(&mut b)?;
        String::from_utf8(b).map_err(|_| self.bad("a name that is not UTF-8"))
    }
    fn bad(&self, what: &str) -> StreamError {
        StreamError::Bad(format!("{what} (at byte {})", self.read))
    }
}

/// The RAM blocks as the image holds them, with the pages written so far.
struct Ram<'f> {
    file: &'f File,
    layout: MemoryLayout,
    /// Per block, a bit per page: set while the image's page holds data (is not a hole).
    written: Vec<Vec<u64>>,
    /// The block the last page record named (a CONTINUE record reuses it).
    last: Option<usize>,
    page: Vec<u8>,
}

impl Ram<'_> {
    fn page_size(&self) -> u64 {
        self.layout.page_size as u64
    }

    /// Reads one page record's block and offset, checked.
    fn target<R: Read>(
        &mut self,
        input: &mut Input<R>,
        offset: u64,
        flags: u64,
    ) -> StreamResult<(usize, u64)> {
        let block = if flags & FLAG_CONTINUE != 0 {
            self.last
                .ok_or_else(|| input.bad("a page that continues no block"))?
        } else {
            let id = input.idstr()?;
            self.layout
                .blocks
                .iter()
                .position(|b| b.id == id)
                .ok_or_else(|| input.bad(&format!("a page of unknown RAM block {id:?}")))?
        };
        self.last = Some(block);
        if offset >= self.layout.blocks[block].length {
            return Err(input.bad(&format!(
                "a page at {offset} past the end of RAM block {:?}",
                self.layout.blocks[block].id
            )));
        }
        Ok((block, offset / self.page_size()))
    }

    /// Writes the page buffer as page `page` of `block`; a zero page clears what an earlier
    /// copy left, and otherwise stays a hole.
    fn put(&mut self, block: usize, page: u64) -> StreamResult<()> {
        let (word, bit) = ((page / 64) as usize, 1u64 << (page % 64));
        let had_data = self.written[block][word] & bit != 0;
        let zero = self.page.iter().all(|&b| b == 0);
        if zero && !had_data {
            return Ok(());
        }
        match zero {
            true => self.written[block][word] &= !bit,
            false => self.written[block][word] |= bit,
        }
        let at = self.layout.blocks[block].offset + page * self.page_size();
        self.file.write_all_at(&self.page, at)?;
        Ok(())
    }

    /// One RAM section's records, up to its end-of-section record.
    fn section<R: Read>(&mut self, input: &mut Input<R>) -> StreamResult<()> {
        loop {
            let header = input.be64()?;
            let flags = header & (self.page_size() - 1);
            let offset = header & !(self.page_size() - 1);
            if flags & FLAG_EOS != 0 {
                return Ok(());
            }
            match flags & !FLAG_CONTINUE {
                FLAG_PAGE => {
                    let (block, page) = self.target(input, offset, flags)?;
                    let mut buf = std::mem::take(&mut self.page);
                    input.fill(&mut buf)?;
                    self.page = buf;
                    self.put(block, page)?;
                }
                FLAG_ZERO => {
                    let (block, page) = self.target(input, offset, flags)?;
                    let fill = input.u8()?;
                    self.page.fill(fill);
                    self.put(block, page)?;
                }
                FLAG_MEM_SIZE => return Err(input.bad("a second memory-size record")),
                other => {
                    return Err(input.bad(&format!(
                        "RAM record flags {other:#x}: cairn reads pages sent whole or as zero; \
                         turn off the xbzrle, compress, multifd and postcopy-ram migration \
                         capabilities"
                    )))
                }
            }
        }
    }
}

/// Reads the configuration section (after its type byte): the machine name and the
/// subsections QEMU may add. Returns the page size.
fn configuration<R: Read>(input: &mut Input<R>) -> StreamResult<u32> {
    let len = input.be32()? as usize;
    if len > 256 {
        return Err(input.bad("a machine name longer than 256 bytes"));
    }
    let mut name = vec![0u8; len];
    input.fill(&mut name)?;
    let mut page_bits = DEFAULT_PAGE_BITS;
    // Subsections follow while the next byte says so; the first other byte opens a section.
    loop {
        let next = input.u8()?;
        if next != SUBSECTION {
            return match next {
                SECTION_START => Ok(1 << page_bits),
                _ => Err(input.bad(&format!("section type {next:#x} after the configuration"))),
            };
        }
        let id = input.idstr()?;
        let _version = input.be32()?;
        match id.as_str() {
            "configuration/target-page-bits" => {
                page_bits = input.be32()?;
                if !(9..=16).contains(&page_bits) {
                    return Err(input.bad(&format!("target page bits {page_bits}")));
                }
            }
            "configuration/capabilities" => {
                let n = input.be32()?;
                for _ in 0..n.min(256) {
                    input.idstr()?;
                }
            }
            "configuration/uuid" => {
                input.bytes::<16>()?;
            }
            other => return Err(input.bad(&format!("configuration subsection {other:?}"))),
        }
    }
}

/// Reads a whole migration stream from `stream` into image file `file` (sized and written
/// here) and returns where everything lies.
pub fn receive(stream: impl Read, file: &File) -> StreamResult<Received> {
    let mut input = Input {
        inner: io::BufReader::with_capacity(1 << 20, stream),
        read: 0,
        kept: Some(Vec::new()),
    };
    if input.be32()? != FILE_MAGIC {
        return Err(StreamError::Bad(
            "not a QEMU migration stream (no QEVM magic)".into(),
        ));
    }
    let version = input.be32()?;
    if version != FILE_VERSION {
        return Err(input.bad(&format!("migration stream version {version}")));
    }
    let page_size = match input.u8()? {
        CONFIGURATION => configuration(&mut input)?,
        SECTION_START => 1 << DEFAULT_PAGE_BITS,
        t => return Err(input.bad(&format!("section type {t:#x} where a section starts"))),
    };
    // The START byte just read belongs to the RAM section, not to the verbatim prefix.
    let mut prefix = input.kept.take().expect("kept");
    prefix.pop();
    let section_id = input.be32()?;
    let idstr = input.idstr()?;
    if idstr != "ram" {
        return Err(input.bad(&format!(
            "the stream's first section is {idstr:?}, not RAM: cairn saves RAM and device \
             state only (turn off block and dirty-bitmap migration)"
        )));
    }
    let (instance_id, version_id) = (input.be32()?, input.be32()?);
    let header = input.be64()?;
    if header & (page_size as u64 - 1) != FLAG_MEM_SIZE {
        return Err(input.bad("the RAM section does not begin with its memory size"));
    }
    let total = header & !(page_size as u64 - 1);
    if total > MAX_RAM {
        return Err(input.bad(&format!("a memory size of {total} bytes")));
    }
    let mut blocks = Vec::new();
    let mut sum = 0u64;
    while sum < total && blocks.len() < cairn_format::memstate::MAX_BLOCKS {
        let id = input.idstr()?;
        let length = input.be64()?;
        if id.is_empty() || length % page_size as u64 != 0 || length > total - sum {
            return Err(input.bad(&format!(
                "RAM block {id:?} of {length} bytes does not fit the memory size {total} \
                 (postcopy-ram or x-ignore-shared on?)"
            )));
        }
        sum += length;
        blocks.push((id, length));
    }
    if sum != total {
        return Err(input.bad(&format!("RAM blocks of {sum} bytes, memory size {total}")));
    }
    let layout = MemoryLayout::plan(
        page_size,
        prefix,
        (section_id, instance_id, version_id),
        &blocks,
    );
    file.set_len(layout.tail_offset)?;
    let written = layout
        .blocks
        .iter()
        .map(|b| vec![0u64; (b.length / page_size as u64).div_ceil(64) as usize])
        .collect();
    let mut ram = Ram {
        file,
        layout,
        written,
        last: None,
        page: vec![0u8; page_size as usize],
    };
    ram.section(&mut input)?;
    // Sections of RAM until the first that is not: from there on all is device state.
    let mut tail = Vec::new();
    loop {
        let kind = input.u8()?;
        if kind == SECTION_FOOTER {
            let id = input.be32()?;
            if id != section_id {
                return Err(input.bad(&format!(
                    "a footer of section {id} after section {section_id}"
                )));
            }
            ram.layout.footers = true;
            continue;
        }
        if kind == SECTION_FULL || kind == SECTION_EOF {
            // Device state, whose layout only QEMU knows: kept as it is. The stream is whole
            // when QEMU says the migration completed.
            tail.push(kind);
            break;
        }
        if kind != SECTION_PART && kind != SECTION_END {
            return Err(input.bad(&format!("section type {kind:#x} after RAM")));
        }
        let id = input.be32()?;
        if id != section_id {
            return Err(input.bad(&format!(
                "section {id} is iterated beside RAM: cairn saves RAM and device state only \
                 (turn off block and dirty-bitmap migration)"
            )));
        }
        ram.section(&mut input)?;
    }
    let stream_head = input.read - 1;
    (&mut input.inner)
        .take(MAX_TAIL + 1)
        .read_to_end(&mut tail)?;
    if tail.len() as u64 > MAX_TAIL {
        return Err(StreamError::Bad(format!(
            "more than {} MiB of device state",
            MAX_TAIL >> 20
        )));
    }
    let mut layout = ram.layout;
    layout.tail_len = tail.len() as u64;
    file.write_all_at(&tail, layout.tail_offset)?;
    file.set_len(layout.image_size())?;
    file.write_all_at(&layout.encode(), 0)?;
    let data_pages = ram
        .written
        .iter()
        .flatten()
        .map(|w| w.count_ones() as u64)
        .sum();
    Ok(Received {
        stream_bytes: stream_head + tail.len() as u64,
        data_pages,
        layout,
    })
}

/// Reads the layout from the head of image `file`.
pub fn layout_of(file: &File) -> StreamResult<MemoryLayout> {
    let mut head = vec![0u8; cairn_format::memstate::REGION_ALIGN as usize];
    let n = read_up_to(file, &mut head, 0)?;
    MemoryLayout::decode(&head[..n])
        .map_err(|e| StreamError::Bad(format!("not a memory state image: {e}")))
}

fn read_up_to(file: &File, buf: &mut [u8], at: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], at + done as u64)? {
            0 => break,
            n => done += n,
        }
    }
    Ok(done)
}

/// Writes the migration stream of memory state image `file` to `out`: what an incoming QEMU
/// (`-incoming`) loads to resume the guest. Returns the stream's length.
pub fn emit(file: &File, out: impl Write) -> StreamResult<u64> {
    let layout = layout_of(file)?;
    let size = file.metadata()?.len();
    if size < layout.tail_offset + layout.tail_len {
        return Err(StreamError::Bad(format!(
            "memory state image of {size} bytes, its layout needs {}",
            layout.tail_offset + layout.tail_len
        )));
    }
    let mut out = CountingWriter {
        inner: io::BufWriter::with_capacity(1 << 20, out),
        written: 0,
    };
    let footer = |out: &mut CountingWriter<_>| -> io::Result<()> {
        if layout.footers {
            out.write_all(&[SECTION_FOOTER])?;
            out.write_all(&layout.section_id.to_be_bytes())?;
        }
        Ok(())
    };
    out.write_all(&layout.prefix)?;
    out.write_all(&[SECTION_START])?;
    out.write_all(&layout.section_id.to_be_bytes())?;
    out.write_all(&[3])?;
    out.write_all(b"ram")?;
    out.write_all(&layout.instance_id.to_be_bytes())?;
    out.write_all(&layout.version_id.to_be_bytes())?;
    out.write_all(&(layout.ram_bytes() | FLAG_MEM_SIZE).to_be_bytes())?;
    for b in &layout.blocks {
        out.write_all(&[b.id.len() as u8])?;
        out.write_all(b.id.as_bytes())?;
        out.write_all(&b.length.to_be_bytes())?;
    }
    out.write_all(&FLAG_EOS.to_be_bytes())?;
    footer(&mut out)?;
    out.write_all(&[SECTION_PART])?;
    out.write_all(&layout.section_id.to_be_bytes())?;
    let page = layout.page_size as usize;
    let mut buf = vec![0u8; 1 << 20];
    for b in &layout.blocks {
        let mut done = 0u64;
        while done < b.length {
            let n = (b.length - done).min(buf.len() as u64) as usize;
            file.read_exact_at(&mut buf[..n], b.offset + done)?;
            for (i, data) in buf[..n].chunks(page).enumerate() {
                let at = done + (i * page) as u64;
                let zero = data.iter().all(|&x| x == 0);
                let mut header = at | if zero { FLAG_ZERO } else { FLAG_PAGE };
                if at != 0 {
                    header |= FLAG_CONTINUE;
                }
                out.write_all(&header.to_be_bytes())?;
                if at == 0 {
                    out.write_all(&[b.id.len() as u8])?;
                    out.write_all(b.id.as_bytes())?;
                }
                match zero {
                    true => out.write_all(&[0])?,
                    false => out.write_all(data)?,
                }
            }
            done += n as u64;
        }
    }
    out.write_all(&FLAG_EOS.to_be_bytes())?;
    footer(&mut out)?;
    out.write_all(&[SECTION_END])?;
    out.write_all(&layout.section_id.to_be_bytes())?;
    out.write_all(&FLAG_EOS.to_be_bytes())?;
    footer(&mut out)?;
    let mut tail = vec![0u8; layout.tail_len as usize];
    file.read_exact_at(&mut tail, layout.tail_offset)?;
    out.write_all(&tail)?;
    out.flush()?;
    Ok(out.written)
}

struct CountingWriter<W: Write> {
    inner: W,
    written: u64,
}

impl<W: Write> Write for CountingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small stream as QEMU sends one: configuration, RAM in START/PART/END sections with
    /// footers (a page sent twice, zero pages, a page of a second block), device state.
    fn stream() -> Vec<u8> {
        let mut s = Vec::new();
        s.extend_from_slice(&FILE_MAGIC.to_be_bytes());
        s.extend_from_slice(&FILE_VERSION.to_be_bytes());
        s.push(CONFIGURATION);
        s.extend_from_slice(&10u32.to_be_bytes());
        s.extend_from_slice(b"pc-q35-7.2");
        let footer = |s: &mut Vec<u8>| {
            s.push(SECTION_FOOTER);
            s.extend_from_slice(&2u32.to_be_bytes());
        };
        s.push(SECTION_START);
        s.extend_from_slice(&2u32.to_be_bytes());
        s.extend_from_slice(b"\x03ram");
        s.extend_from_slice(&0u32.to_be_bytes());
        s.extend_from_slice(&4u32.to_be_bytes());
        s.extend_from_slice(&(((16u64 << 12) + (2 << 12)) | FLAG_MEM_SIZE).to_be_bytes());
        s.extend_from_slice(b"\x06pc.ram");
        s.extend_from_slice(&(16u64 << 12).to_be_bytes());
        s.extend_from_slice(b"\x07pc.bios");
        s.extend_from_slice(&(2u64 << 12).to_be_bytes());
        s.extend_from_slice(&FLAG_EOS.to_be_bytes());
        footer(&mut s);
        let page = |s: &mut Vec<u8>, block: Option<&[u8]>, at: u64, fill: Option<u8>| {
            let flag = if fill.is_some() { FLAG_PAGE } else { FLAG_ZERO };
            let cont = if block.is_some() { 0 } else { FLAG_CONTINUE };
            s.extend_from_slice(&((at << 12) | flag | cont).to_be_bytes());
            if let Some(b) = block {
                s.push(b.len() as u8);
                s.extend_from_slice(b);
            }
            match fill {
                Some(f) => s.extend_from_slice(&[f; 4096]),
                None => s.push(0),
            }
        };
        s.push(SECTION_PART);
        s.extend_from_slice(&2u32.to_be_bytes());
        page(&mut s, Some(b"pc.ram"), 0, Some(0xaa));
        page(&mut s, None, 1, None);
        page(&mut s, None, 5, Some(0x11));
        page(&mut s, Some(b"pc.bios"), 1, Some(0xbb));
        s.extend_from_slice(&FLAG_EOS.to_be_bytes());
        footer(&mut s);
        s.push(SECTION_END);
        s.extend_from_slice(&2u32.to_be_bytes());
        page(&mut s, Some(b"pc.ram"), 5, Some(0x22)); // sent again: the last copy counts
        page(&mut s, None, 0, None); // and zeroed since
        s.extend_from_slice(&FLAG_EOS.to_be_bytes());
        footer(&mut s);
        s.extend_from_slice(b"\x04device state\x00");
        s
    }

    fn received(s: &[u8]) -> (tempfile::NamedTempFile, StreamResult<Received>) {
        let f = tempfile::NamedTempFile::new().unwrap();
        let r = receive(s, f.as_file());
        (f, r)
    }

    #[test]
    fn receive_lays_pages_out_and_emit_loads_the_same() {
        let (f, r) = received(&stream());
        let r = r.unwrap();
        let l = &r.layout;
        assert!(l.footers);
        assert_eq!(l.blocks.len(), 2);
        assert_eq!(
            r.data_pages, 2,
            "ram page 5 and bios page 1 (ram page 0 was zeroed again)"
        );
        let at = |block: usize, page: u64| {
            let mut b = [0u8; 4096];
            f.as_file()
                .read_exact_at(&mut b, l.blocks[block].offset + page * 4096)
                .unwrap();
            b
        };
        assert_eq!(at(0, 0), [0; 4096]);
        assert_eq!(at(0, 5), [0x22; 4096]);
        assert_eq!(at(1, 1), [0xbb; 4096]);
        assert_eq!(r.stream_bytes, stream().len() as u64);
        // The stream written back is one pass with the final pages, and reads back the same.
        let mut again = Vec::new();
        let n = emit(f.as_file(), &mut again).unwrap();
        assert_eq!(n, again.len() as u64);
        let (g, r2) = received(&again);
        let r2 = r2.unwrap();
        assert_eq!(r2.layout, r.layout);
        let (mut a, mut b) = (Vec::new(), Vec::new());
        f.as_file().read_to_end(&mut a).unwrap();
        g.as_file().read_to_end(&mut b).unwrap();
        assert_eq!(a.len() as u64, l.image_size());
        assert!(a == b, "the image of the emitted stream equals the first");
    }

    #[test]
    fn every_truncation_is_an_error() {
        let s = stream();
        // Up to the device state (whose end only QEMU knows: it says when a migration
        // completed), every cut is found.
        let device_state = s.len() - b"\x04device state\x00".len();
        for cut in 0..=device_state {
            let (_, r) = received(&s[..cut]);
            assert!(r.is_err(), "cut at {cut} was accepted");
        }
    }

    /// Random damage (flipped, dropped and inserted bytes) gives an error or a stream, never
    /// a panic; what is accepted is laid out within its image.
    #[test]
    fn damaged_streams_never_panic() {
        use rand::{Rng, SeedableRng};
        let good = stream();
        let mut rng = rand::rngs::StdRng::seed_from_u64(55);
        for _ in 0..3000 {
            let mut s = good.clone();
            for _ in 0..rng.gen_range(1..4) {
                let at = rng.gen_range(0..s.len());
                match rng.gen_range(0..3) {
                    0 => s[at] ^= 1 << rng.gen_range(0..8),
                    1 => drop(s.remove(at)),
                    _ => s.insert(at, rng.gen()),
                }
            }
            let (f, r) = received(&s);
            if let Ok(r) = r {
                assert_eq!(f.as_file().metadata().unwrap().len(), r.layout.image_size());
            }
        }
    }

    #[test]
    fn unsupported_streams_say_why() {
        let mut s = stream();
        let part = s
            .windows(5)
            .position(|w| w == [SECTION_PART, 0, 0, 0, 2])
            .unwrap();
        s[part + 5 + 7] |= 0x40; // XBZRLE
        let (_, r) = received(&s);
        assert!(r.unwrap_err().to_string().contains("xbzrle"));
        let (_, r) = received(b"NOPE....");
        assert!(r.unwrap_err().to_string().contains("QEVM"));
    }
}

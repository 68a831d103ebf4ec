//! Packs of format 2: chunk groups back to back, each behind a frame (pack
//! version 3), and a trailer that describes every group and every chunk in it.
//!
//! ```text
//! offset   size   field
//! 0        8      magic "CRNPACK\0"
//! 8        4      pack version (u32) = 3 (2: older builds, no frames; read still)
//! 12       4      salt (random u32, as in v1: two writes never share a pack id)
//! 16       4      flags (u32): bit 0 = sealed (groups and trailer encrypted); others 0
//! 20       ...    per group: its frame (version 3, see `group_frame`), then the stored group
//! T        L      trailer, sealed as domain "pack trailer" when the pack is:
//!                   group count G (u32) | chunk count C (u32)
//!                   G × (offset (u32) | stored length (u32) | plain length (u32)
//!                        | kind (u8: 0 data, 1 node) | encoding (u8: 0 raw, 1 zstd)
//!                        | chunk count (u16))
//!                   C × (chunk id (32) | plain length (u32) | flags (u8): bit 0 = stored),
//!                       group by group, slot by slot
//! T+L      48     footer: G (u32) | L (u32) | BLAKE3 of the L trailer bytes (32) | "CRNPKEND"
//! ```
//! A group's offset is that of its stored bytes (past its frame). Readers use the trailer;
//! the frames are read only when it is lost (`group_frame::salvage`). A manifest node is a
//! group of one chunk of kind "node". The pack id is the BLAKE3 of the whole pack. A v1
//! reader refuses a v2 pack as "newer than this cairn supports".

use std::io::{self, Write};

use crate::codec::{Decoder, Encoder};
use crate::crypto::{open_if_sealed, CryptoError, Domain, MasterKey};
use crate::group::{Group, GroupChunk, GroupDesc, MAX_GROUP_PLAIN};
use crate::group_frame;
use crate::pack::{BlobEncoding, BlobKind, END_MAGIC, FOOTER_LEN, MAGIC};
use crate::{FormatError, Id};

/// The pack version this build writes (with group frames).
pub const VERSION: u32 = 3;
/// The oldest pack version a format 2 reader accepts (no frames: its trailer is its only
/// table of contents).
pub const OLDEST_VERSION: u32 = 2;
pub const HEADER_LEN: usize = 20;
const FLAG_SEALED: u32 = 1;
const GROUP_ENTRY_LEN: usize = 16;
const CHUNK_ENTRY_LEN: usize = 37;
/// Chunk entry flag: the group still stores the slot's bytes (see `GroupChunk::stored`).
const SLOT_STORED: u8 = 1;

/// A group in a pack: where it is and what it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackGroup {
    pub offset: u32,
    pub kind: BlobKind,
    pub desc: GroupDesc,
}

impl PackGroup {
    /// The group's stored bytes in the pack.
    pub fn range(&self) -> std::ops::Range<u64> {
        let start = u64::from(self.offset);
        start..start + u64::from(self.desc.stored_len)
    }
}

/// Builds a v2 pack from finished groups (all sealed, or none), into memory (`Vec<u8>`, the
/// default) or into any writer — a file staged for publication, so that a pack being filled
/// costs no memory. The pack id (the BLAKE3 of every byte) is hashed as the bytes go out.
pub struct PackWriter<W = Vec<u8>> {
    out: W,
    len: usize,
    hash: blake3::Hasher,
    groups: Vec<PackGroup>,
    /// The repository's key when the pack is sealed (frames and trailer are sealed as they
    /// are written).
    key: Option<MasterKey>,
}

impl PackWriter<Vec<u8>> {
    pub fn new(key: Option<&MasterKey>) -> PackWriter {
        Self::with_salt(key, rand::random())
    }

    /// [`PackWriter::new`] with room for `bytes` of groups and trailer reserved at once: a
    /// pack that grows by doubling holds up to twice its size while it is filled and
    /// uploaded, and copies itself on the way.
    pub fn with_capacity(key: Option<&MasterKey>, bytes: usize) -> PackWriter {
        let mut w = Self::new(key);
        w.out.reserve_exact(bytes.saturating_sub(w.out.len()));
        w
    }

    /// [`PackWriter::new`] with a given salt: only for golden vectors.
    #[doc(hidden)]
    pub fn with_salt(key: Option<&MasterKey>, salt: u32) -> PackWriter {
        PackWriter::start(Vec::with_capacity(1 << 20), key, salt).expect("memory")
    }

    /// Appends a finished group (one that stores at least one chunk).
    pub fn push(&mut self, kind: BlobKind, group: Group) {
        self.try_push(kind, group)
            .expect("writes to memory never fail");
    }

    /// Closes the pack: its id, bytes and groups.
    pub fn finish(self) -> (Id, Vec<u8>, Vec<PackGroup>) {
        self.try_finish().expect("writes to memory never fail")
    }
}

impl<W: Write> PackWriter<W> {
    /// A pack written to `out`, which must be empty: its header goes out at once.
    pub fn to_writer(out: W, key: Option<&MasterKey>) -> io::Result<PackWriter<W>> {
        Self::start(out, key, rand::random())
    }

    fn start(out: W, key: Option<&MasterKey>, salt: u32) -> io::Result<PackWriter<W>> {
        let mut w = PackWriter {
            out,
            len: 0,
            hash: blake3::Hasher::new(),
            groups: Vec::new(),
            key: key.cloned(),
        };
        let flags = if key.is_some() { FLAG_SEALED } else { 0 };
        w.write(MAGIC)?;
        w.write(&VERSION.to_le_bytes())?;
        w.write(&salt.to_le_bytes())?;
        w.write(&flags.to_le_bytes())?;
        Ok(w)
    }

    fn write(&mut self, bytes: &[u8]) -> io::Result<()> {
        self.out.write_all(bytes)?;
        self.hash.update(bytes);
        self.len += bytes.len();
        Ok(())
    }

    /// Bytes of groups so far (the trailer comes on top).
    pub fn len(&self) -> usize {
        self.len
    }

    /// Where the bytes go.
    pub fn writer(&self) -> &W {
        &self.out
    }

    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Appends a finished group (one that stores at least one chunk).
    pub fn try_push(&mut self, kind: BlobKind, group: Group) -> io::Result<()> {
        assert!(
            group.desc.chunks.iter().any(|c| c.stored),
            "a group that stores no chunk is dropped, not written"
        );
        assert_eq!(
            group.desc.sealed,
            self.key.is_some(),
            "a pack's groups are all sealed or none"
        );
        assert!(
            group.desc.chunks.len() <= u16::MAX as usize,
            "too many chunks in a group"
        );
        let frame = group_frame::encode(kind, &group.desc, self.key.as_ref());
        self.write(&frame)?;
        let offset = u32::try_from(self.len).expect("pack grew past 4 GiB");
        self.write(&group.stored)?;
        self.groups.push(PackGroup {
            offset,
            kind,
            desc: group.desc,
        });
        Ok(())
    }

    /// Closes the pack: its id, its writer (flushed) and its groups.
    pub fn try_finish(mut self) -> io::Result<(Id, W, Vec<PackGroup>)> {
        let chunks: usize = self.groups.iter().map(|g| g.desc.chunks.len()).sum();
        let mut e = Encoder::with_capacity(
            8 + self.groups.len() * GROUP_ENTRY_LEN + chunks * CHUNK_ENTRY_LEN,
        );
        e.u32(self.groups.len() as u32).u32(chunks as u32);
        for g in &self.groups {
            e.u32(g.offset)
                .u32(g.desc.stored_len)
                .u32(g.desc.plain_len)
                .u8(g.kind.code())
                .u8(g.desc.encoding.code())
                .u16(g.desc.chunks.len() as u16);
        }
        for c in self.groups.iter().flat_map(|g| &g.desc.chunks) {
            e.id(&c.id)
                .u32(c.len)
                .u8(if c.stored { SLOT_STORED } else { 0 });
        }
        let plain = e.finish();
        let trailer = match &self.key {
            None => plain,
            Some(key) => key.seal(Domain::PackTrailer, &plain),
        };
        let mut footer = Vec::with_capacity(trailer.len() + FOOTER_LEN);
        footer.extend_from_slice(&trailer);
        footer.extend_from_slice(&(self.groups.len() as u32).to_le_bytes());
        footer.extend_from_slice(&(trailer.len() as u32).to_le_bytes());
        footer.extend_from_slice(blake3::hash(&trailer).as_bytes());
        footer.extend_from_slice(END_MAGIC);
        self.write(&footer)?;
        self.out.flush()?;
        let id = Id(*self.hash.finalize().as_bytes());
        Ok((id, self.out, self.groups))
    }
}

/// A v2 pack's footer: where its trailer is and what it hashes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackFooter {
    pub group_count: u32,
    pub trailer_len: u32,
    pub checksum: [u8; 32],
}

impl PackFooter {
    /// Where the stored trailer lies in a pack of `pack_len` bytes (checked: it must leave
    /// room for the header).
    pub fn trailer_range(&self, pack_len: u64) -> Result<std::ops::Range<u64>, FormatError> {
        let end = pack_len
            .checked_sub(FOOTER_LEN as u64)
            .ok_or(FormatError::Truncated {
                what: "pack",
                needed: (HEADER_LEN + FOOTER_LEN) as u64,
                available: pack_len,
            })?;
        end.checked_sub(u64::from(self.trailer_len))
            .filter(|s| *s >= HEADER_LEN as u64)
            .map(|start| start..end)
            .ok_or_else(|| FormatError::invalid("pack", "trailer longer than the pack"))
    }
}

/// Parses a v2 pack's first [`HEADER_LEN`] bytes: whether the pack is sealed.
pub fn parse_header(head: &[u8]) -> Result<bool, FormatError> {
    parse_header_version(head).map(|(_, sealed)| sealed)
}

/// Parses a v2 pack's first [`HEADER_LEN`] bytes: its pack version and whether it is sealed.
pub fn parse_header_version(head: &[u8]) -> Result<(u32, bool), FormatError> {
    if head.len() < HEADER_LEN {
        return Err(FormatError::Truncated {
            what: "pack",
            needed: HEADER_LEN as u64,
            available: head.len() as u64,
        });
    }
    if &head[..8] != MAGIC {
        return Err(FormatError::BadMagic { what: "pack" });
    }
    let word = |at: usize| u32::from_le_bytes(head[at..at + 4].try_into().expect("4 bytes"));
    let version = word(8);
    match version {
        OLDEST_VERSION..=VERSION => {}
        v if v > VERSION => {
            return Err(FormatError::TooNew {
                what: "pack",
                found: v,
                supported: VERSION,
            })
        }
        v => {
            return Err(FormatError::invalid(
                "pack",
                format!("format version {v} is not a v2 pack"),
            ))
        }
    }
    let flags = word(16);
    if flags & !FLAG_SEALED != 0 {
        return Err(FormatError::invalid(
            "pack",
            format!("unknown flags {flags:#x}"),
        ));
    }
    Ok((version, flags & FLAG_SEALED != 0))
}

/// Parses a v2 pack's last [`FOOTER_LEN`] bytes.
pub fn parse_footer(tail: &[u8]) -> Result<PackFooter, FormatError> {
    let Some(footer) = tail.len().checked_sub(FOOTER_LEN).map(|at| &tail[at..]) else {
        return Err(FormatError::Truncated {
            what: "pack footer",
            needed: FOOTER_LEN as u64,
            available: tail.len() as u64,
        });
    };
    if &footer[40..48] != END_MAGIC {
        return Err(FormatError::BadMagic {
            what: "pack footer",
        });
    }
    Ok(PackFooter {
        group_count: u32::from_le_bytes(footer[0..4].try_into().expect("4 bytes")),
        trailer_len: u32::from_le_bytes(footer[4..8].try_into().expect("4 bytes")),
        checksum: footer[8..40].try_into().expect("32 bytes"),
    })
}

/// Parses and checks a v2 pack's header and trailer (opening the trailer if the pack is
/// sealed) and returns its groups. Group bytes are not decoded here (see `group::open_group`).
pub fn parse_pack(pack: &[u8], key: Option<&MasterKey>) -> Result<Vec<PackGroup>, CryptoError> {
    if pack.len() < HEADER_LEN + FOOTER_LEN {
        return Err(FormatError::Truncated {
            what: "pack",
            needed: (HEADER_LEN + FOOTER_LEN) as u64,
            available: pack.len() as u64,
        }
        .into());
    }
    let sealed = parse_header(pack)?;
    let footer = parse_footer(pack)?;
    let range = footer.trailer_range(pack.len() as u64)?;
    let stored = &pack[range.start as usize..range.end as usize];
    parse_trailer(stored, &footer, sealed, range.start, key)
}

/// Checks and parses a pack's stored trailer (the bytes [`PackFooter::trailer_range`] names),
/// opening it if the pack is sealed. `data_end` is where the trailer starts: no group may
/// reach past it.
pub fn parse_trailer(
    stored_trailer: &[u8],
    footer: &PackFooter,
    sealed: bool,
    data_end: u64,
    key: Option<&MasterKey>,
) -> Result<Vec<PackGroup>, CryptoError> {
    let bad = |reason: String| CryptoError::from(FormatError::invalid("pack", reason));
    if stored_trailer.len() != footer.trailer_len as usize {
        return Err(bad(format!(
            "trailer of {} bytes where the footer says {}",
            stored_trailer.len(),
            footer.trailer_len
        )));
    }
    if blake3::hash(stored_trailer).as_bytes() != &footer.checksum {
        return Err(FormatError::Checksum {
            what: "pack trailer",
        }
        .into());
    }
    let group_count = footer.group_count;
    let trailer = open_if_sealed(
        sealed,
        key,
        Domain::PackTrailer,
        "pack trailer",
        stored_trailer,
    )?;
    let trailer = &trailer[..];

    let mut d = Decoder::new(trailer, "pack trailer");
    let (groups_listed, chunk_count) = (d.u32()?, d.u32()? as usize);
    if groups_listed != group_count {
        return Err(bad(format!(
            "footer says {group_count} groups, trailer {groups_listed}"
        )));
    }
    // Every count is bounded by the bytes that must follow it before anything is allocated.
    let needed =
        group_count as u64 * GROUP_ENTRY_LEN as u64 + chunk_count as u64 * CHUNK_ENTRY_LEN as u64;
    if needed != d.remaining() as u64 {
        return Err(bad(format!(
            "{group_count} groups and {chunk_count} chunks do not fill a trailer of {} bytes",
            trailer.len()
        )));
    }
    let mut heads = Vec::with_capacity(group_count as usize);
    let mut end_of_last = HEADER_LEN as u64;
    for _ in 0..group_count {
        let (offset, stored_len, plain_len) = (d.u32()?, d.u32()?, d.u32()?);
        let kind = BlobKind::from_code(d.u8()?, "pack trailer")?;
        let encoding = BlobEncoding::from_code(d.u8()?, "pack trailer")?;
        let count = d.u16()? as usize;
        let start = u64::from(offset);
        if start < end_of_last || start + u64::from(stored_len) > data_end {
            return Err(bad(format!(
                "group at {offset} overlaps another or lies outside the data area"
            )));
        }
        if plain_len > MAX_GROUP_PLAIN {
            return Err(bad(format!(
                "group at {offset} claims {plain_len} plain bytes"
            )));
        }
        end_of_last = start + u64::from(stored_len);
        heads.push((offset, stored_len, plain_len, kind, encoding, count));
    }
    if heads.iter().map(|h| h.5).sum::<usize>() != chunk_count {
        return Err(bad(
            "group chunk counts do not add up to the chunk count".into()
        ));
    }
    let mut groups = Vec::with_capacity(heads.len());
    for (offset, stored_len, plain_len, kind, encoding, count) in heads {
        let mut chunks = Vec::with_capacity(count);
        for _ in 0..count {
            let (id, len, flags) = (d.id()?, d.u32()?, d.u8()?);
            if flags & !SLOT_STORED != 0 {
                return Err(bad(format!(
                    "group at {offset}: unknown slot flags {flags:#x}"
                )));
            }
            chunks.push(GroupChunk {
                id,
                len,
                stored: flags & SLOT_STORED != 0,
            });
        }
        let desc = GroupDesc {
            encoding,
            sealed,
            stored_len,
            plain_len,
            chunks,
        };
        if !desc.chunks.iter().any(|c| c.stored) {
            return Err(bad(format!("group at {offset} stores no chunk")));
        }
        let listed = desc.stored_chunk_bytes();
        if listed != u64::from(plain_len) {
            return Err(bad(format!(
                "group at {offset}: stored chunks of {listed} bytes in {plain_len}"
            )));
        }
        groups.push(PackGroup { offset, kind, desc });
    }
    d.finish()?;
    Ok(groups)
}

/// Recovers the groups of a pack whose trailer or footer is damaged or cut off, from their
/// frames (version 3; a version 2 pack has none, its trailer was its only table of
/// contents). `id_of` is the repository's chunk id: every stored chunk's id is recomputed.
/// The header's version and flags are outside every checksum, so they are not trusted here:
/// frames are sought when one reads at the first group's place or the header says version 3,
/// and sealed or not follows `key` (the repository's).
pub fn salvage_pack(
    pack: &[u8],
    key: Option<&MasterKey>,
    id_of: impl Fn(&[u8]) -> Id,
) -> Result<group_frame::Salvage, FormatError> {
    if pack.len() < HEADER_LEN {
        return Err(FormatError::Truncated {
            what: "pack",
            needed: HEADER_LEN as u64,
            available: pack.len() as u64,
        });
    }
    let says_3 = matches!(parse_header_version(pack), Ok((3, _)));
    if !says_3 && group_frame::read(pack, HEADER_LEN, key).is_none() {
        let found = u32::from_le_bytes(pack[8..12].try_into().expect("4 bytes"));
        return Err(FormatError::invalid(
            "pack",
            format!("pack version {found} and no group frame where the first group starts: no frames to recover groups from"),
        ));
    }
    Ok(group_frame::salvage(pack, HEADER_LEN, key, id_of))
}

/// Checks that every group of a version 3 pack has the frame its trailer (`groups`) implies:
/// a damaged frame loses nothing while the trailer is intact, but it is the group's only way
/// back if the trailer is lost later, so `verify` reports it. Version 2 packs pass.
pub fn check_frames(
    pack: &[u8],
    groups: &[PackGroup],
    key: Option<&MasterKey>,
) -> Result<(), String> {
    if !matches!(parse_header_version(pack), Ok((3.., _))) {
        return Ok(());
    }
    let mut at = HEADER_LEN;
    for (i, g) in groups.iter().enumerate() {
        let bad = || format!("group {i} (at byte {}): its frame is damaged", g.offset);
        let frame = group_frame::read(pack, at, key).ok_or_else(bad)?;
        let same_slots =
            frame.desc.chunks.len() == g.desc.chunks.len()
                && frame.desc.chunks.iter().zip(&g.desc.chunks).all(|(f, t)| {
                    f.len == t.len && f.stored == t.stored && (f.stored || f.id == t.id)
                });
        let agrees = frame.group_at as u64 == u64::from(g.offset)
            && frame.kind == g.kind
            && frame.desc.encoding == g.desc.encoding
            && frame.desc.stored_len == g.desc.stored_len
            && frame.desc.plain_len == g.desc.plain_len
            && same_slots;
        if !agrees {
            return Err(bad());
        }
        at = g.range().end as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Compression;
    use crate::group::{chunk, open_group, GroupBuilder};

    fn group(parts: &[&[u8]], key: Option<&MasterKey>) -> Group {
        let mut b = GroupBuilder::new(64 << 10);
        for p in parts {
            let id = key.map_or_else(|| Id::of(p), |k| k.id_of(p));
            b.push(id, p);
        }
        b.finish(Compression::Zstd { level: 3 }, key)
    }

    fn build(key: Option<&MasterKey>) -> (Id, Vec<u8>, Vec<PackGroup>) {
        let mut w = PackWriter::new(key);
        w.push(
            BlobKind::Data,
            group(&[b"alpha", &[1; 5000], b"gamma"], key),
        );
        w.push(BlobKind::Node, group(&[b"a manifest node"], key));
        w.finish()
    }

    #[test]
    fn a_pack_round_trips_plain_and_sealed() {
        for key in [None, Some(MasterKey::generate())] {
            let (id, bytes, groups) = build(key.as_ref());
            assert_eq!(id, Id::of(&bytes));
            let parsed = parse_pack(&bytes, key.as_ref()).unwrap();
            assert_eq!(parsed, groups);
            assert_eq!(parsed[1].kind, BlobKind::Node);
            let g = &parsed[0];
            let stored = &bytes[g.range().start as usize..g.range().end as usize];
            let plain = open_group(&g.desc, stored, key.as_ref()).unwrap();
            let id_of = |d: &[u8]| key.as_ref().map_or_else(|| Id::of(d), |k| k.id_of(d));
            assert_eq!(chunk(&g.desc, &plain, 2, id_of).unwrap(), b"gamma");
            // A v1 reader refuses a v2 pack by its version.
            let v1 = crate::pack::parse_pack(&bytes).unwrap_err();
            assert!(matches!(v1, FormatError::TooNew { found: 3, .. }), "{v1}");
            check_frames(&bytes, &parsed, key.as_ref()).unwrap();
        }
    }

    #[test]
    fn every_flip_of_a_trailer_or_footer_byte_and_every_truncation_is_refused() {
        for key in [None, Some(MasterKey::generate())] {
            let (_, bytes, groups) = build(key.as_ref());
            let data_end = groups.last().unwrap().range().end as usize;
            for at in (0..HEADER_LEN).chain(data_end..bytes.len()) {
                for bit in [0, 3, 7] {
                    let mut bad = bytes.clone();
                    bad[at] ^= 1 << bit;
                    // The salt is free: it only makes the pack id unique. A version of 3
                    // flipped to 2 reads as what it is without its frames (the pack id, the
                    // hash of every byte, still tells the damage).
                    if (12..16).contains(&at) || (at == 8 && bad[8] == 2) {
                        continue;
                    }
                    assert!(
                        parse_pack(&bad, key.as_ref()).is_err(),
                        "flip of bit {bit} at {at} accepted"
                    );
                }
            }
            for n in 0..bytes.len() {
                assert!(
                    parse_pack(&bytes[..n], key.as_ref()).is_err(),
                    "truncation to {n}"
                );
            }
        }
    }

    #[test]
    fn a_group_rewritten_by_gc_keeps_its_dropped_slots_listed() {
        let full = group(&[b"alpha", &[1; 5000], b"gamma"], None);
        let kept = GroupBuilder::repack(&full.desc, &full_plain(&full), |slot| slot == 2)
            .finish(Compression::Zstd { level: 3 }, None);
        let mut w = PackWriter::new(None);
        w.push(BlobKind::Data, kept);
        let (_, bytes, groups) = w.finish();
        let parsed = parse_pack(&bytes, None).unwrap();
        assert_eq!(parsed, groups);
        let stored: Vec<bool> = parsed[0].desc.chunks.iter().map(|c| c.stored).collect();
        assert_eq!(stored, [false, false, true]);
        assert_eq!(
            crate::group::group_id(&parsed[0].desc.chunks, None),
            crate::group::group_id(&full.desc.chunks, None)
        );
        let g = &parsed[0];
        let plain = open_group(
            &g.desc,
            &bytes[g.range().start as usize..g.range().end as usize],
            None,
        )
        .unwrap();
        assert_eq!(chunk(&g.desc, &plain, 2, Id::of).unwrap(), b"gamma");
        assert!(chunk(&g.desc, &plain, 0, Id::of).is_err());

        // A trailer whose group stores nothing, or with unknown slot flags, is refused (the
        // trailer is rewritten and its checksum recomputed, so only the parser can object).
        let flags_at: Vec<usize> = (0..3)
            .map(|i| bytes.len() - 48 - 3 * 37 + i * 37 + 36)
            .collect();
        for (at, value, why) in [
            (flags_at[2], 0u8, "stores no chunk"),
            (flags_at[0], 2, "slot flags"),
        ] {
            let mut bad = bytes.clone();
            bad[at] = value;
            let trailer_len =
                u32::from_le_bytes(bad[bad.len() - 44..bad.len() - 40].try_into().unwrap())
                    as usize;
            let end = bad.len() - 48;
            let sum = blake3::hash(&bad[end - trailer_len..end]);
            bad[end + 8..end + 40].copy_from_slice(sum.as_bytes());
            let err = parse_pack(&bad, None).unwrap_err().to_string();
            assert!(err.contains(why), "{err}");
        }
    }

    fn full_plain(g: &Group) -> Vec<u8> {
        open_group(&g.desc, &g.stored, None).unwrap()
    }

    #[test]
    fn a_sealed_pack_needs_its_key() {
        let key = MasterKey::generate();
        let (_, bytes, _) = build(Some(&key));
        assert!(parse_pack(&bytes, None).is_err());
        assert!(matches!(
            parse_pack(&bytes, Some(&MasterKey::generate())),
            Err(CryptoError::Tampered { .. })
        ));
    }

    #[test]
    fn a_pack_whose_trailer_or_footer_is_lost_gives_its_groups_back_from_their_frames() {
        for key in [None, Some(MasterKey::generate())] {
            let key = key.as_ref();
            let id_of = |d: &[u8]| key.map_or_else(|| Id::of(d), |k| k.id_of(d));
            let (_, bytes, groups) = build(key);
            let data_end = groups.last().unwrap().range().end as usize;
            let mut damaged: Vec<Vec<u8>> = (data_end..bytes.len())
                .step_by(7)
                .map(|at| {
                    let mut bad = bytes.clone();
                    bad[at] ^= 0x40;
                    bad
                })
                .collect();
            damaged.push(bytes[..data_end].to_vec()); // trailer and footer cut off
            damaged.push(bytes[..bytes.len() - 5].to_vec());
            for bad in damaged {
                assert!(parse_pack(&bad, key).is_err());
                let s = salvage_pack(&bad, key, id_of).unwrap();
                let got: Vec<(BlobKind, &GroupDesc, u64)> = s
                    .groups
                    .iter()
                    .map(|g| (g.kind, &g.group.desc, g.offset))
                    .collect();
                let want: Vec<(BlobKind, &GroupDesc, u64)> = groups
                    .iter()
                    .map(|g| (g.kind, &g.desc, u64::from(g.offset)))
                    .collect();
                assert_eq!(got, want);
                for (g, p) in s.groups.iter().zip(&groups) {
                    assert_eq!(
                        g.group.stored,
                        bytes[p.range().start as usize..p.range().end as usize]
                    );
                }
            }
            // A damaged frame is reported while the trailer still reads.
            let mut bad = bytes.clone();
            bad[HEADER_LEN + 3] ^= 1;
            let parsed = parse_pack(&bad, key).unwrap();
            let err = check_frames(&bad, &parsed, key).unwrap_err();
            assert!(err.contains("group 0") && err.contains("frame"), "{err}");
        }
    }

    #[test]
    fn a_damaged_header_does_not_stop_a_salvage() {
        for key in [None, Some(MasterKey::generate())] {
            let key = key.as_ref();
            let id_of = |d: &[u8]| key.map_or_else(|| Id::of(d), |k| k.id_of(d));
            let (_, bytes, groups) = build(key);
            let data_end = groups.last().unwrap().range().end as usize;
            // Version 3 read as 2, flags and magic flipped: the frames still give the groups.
            for (at, to) in [(8, 2u8), (8, 7), (16, 2), (0, b'X')] {
                let mut bad = bytes[..data_end].to_vec();
                bad[at] = to;
                let s = salvage_pack(&bad, key, id_of).unwrap();
                assert_eq!(s.groups.len(), groups.len(), "byte {at} = {to}");
            }
        }
        // A pack of version 2 has no frames: nothing is sought.
        let (_, bytes, _) = build(None);
        let mut v2 = bytes[..HEADER_LEN].to_vec();
        v2[8] = 2;
        v2.extend_from_slice(&[0x5a; 4000]);
        let err = salvage_pack(&v2, None, Id::of).unwrap_err().to_string();
        assert!(err.contains("no frames to recover groups from"), "{err}");
    }
}

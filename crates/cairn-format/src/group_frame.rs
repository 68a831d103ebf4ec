//! Group frames (pack version 3): a short header in front of every group in a pack, so that a
//! pack whose trailer or footer is lost can still be read group by group (`salvage`).
//!
//! The trailer is the pack's table of contents; before version 3 it was the only record of
//! where each group lies and which chunks it holds, and one damaged byte in it lost the whole
//! pack. A frame repeats what a reader cannot recompute from the group's own bytes — kind,
//! encoding, lengths, and each slot's length (and the id of a slot GC dropped) — and the ids
//! of stored chunks are hashed again from the bytes, so the group's id is recomputed, not
//! trusted. Leaves name groups by that id: a group salvaged with wrong bytes gets another id
//! and is used by no version (lost, never wrong).
//!
//! ```text
//! frame  = fixed part, stored | [slot list, stored]   (then the stored group)
//! fixed  = kind (u8) | encoding (u8) | stored length (u32) | plain length (u32)
//!          | slots n (u16, >= 1) | form (u8) | length (u32) | last length (u32)
//!          | slot list length (u32)                                        = 25 bytes
//!   form 1 (uniform): every slot stored; slots 0..n-1 of `length`, the last of `last length`
//!          (n = 1: both equal); no slot list (its length 0)
//!   form 0 (listed): `length` and `last length` 0; the slot list holds
//!          n × (length (u32) | flags (u8): bit 0 stored | [chunk id (32) if not stored])
//! stored = plain pack:  bytes | first 8 bytes of BLAKE3(bytes)
//!          sealed pack: sealed as domain 10 (group frame), fixed part and list apart
//! ```
//! A frame costs 33 bytes (plain) or 65 (sealed) for a group of equal chunks — 0.13% and
//! 0.26% of the su-* images' stored bytes (BENCHMARKS.md, *Lost or damaged objects*) — where a second copy of the
//! trailer would cost 37 bytes a chunk (~1%). With
//! no fixed position and no magic, the fixed part of a sealed pack's frame is found again
//! after damage by trying to open it at each byte (a pass over the pack, only in `salvage`).

use crate::codec::{Decoder, Encoder};
use crate::crypto::{Domain, MasterKey, SEAL_OVERHEAD};
use crate::group::{open_group, Group, GroupChunk, GroupDesc, MAX_GROUP_PLAIN};
use crate::pack::{BlobEncoding, BlobKind};
use crate::{FormatError, Id};

const FIXED_LEN: usize = 25;
const CHECK_LEN: usize = 8;
const FORM_LISTED: u8 = 0;
const FORM_UNIFORM: u8 = 1;
const SLOT_STORED: u8 = 1;
/// The longest slot list a frame may carry: 65,535 dropped slots.
const MAX_LIST: u32 = u16::MAX as u32 * (5 + 32);

/// The stored frame of `desc`'s group (of `kind`), sealed under `key` when the pack is.
pub fn encode(kind: BlobKind, desc: &GroupDesc, key: Option<&MasterKey>) -> Vec<u8> {
    let n = desc.chunks.len();
    assert!(
        (1..=u16::MAX as usize).contains(&n),
        "a group has 1 to 65,535 slots"
    );
    let last = desc.chunks[n - 1].len;
    let uniform = desc.chunks.iter().all(|c| c.stored)
        && desc.chunks[..n - 1]
            .iter()
            .all(|c| c.len == desc.chunks[0].len);
    let mut list = Encoder::with_capacity(if uniform { 0 } else { n * 5 });
    if !uniform {
        for c in &desc.chunks {
            list.u32(c.len).u8(if c.stored { SLOT_STORED } else { 0 });
            if !c.stored {
                list.id(&c.id);
            }
        }
    }
    let list = list.finish();
    let (form, length, last) = match uniform {
        true if n == 1 => (FORM_UNIFORM, last, last),
        true => (FORM_UNIFORM, desc.chunks[0].len, last),
        false => (FORM_LISTED, 0, 0),
    };
    let mut fixed = Encoder::with_capacity(FIXED_LEN);
    fixed
        .u8(kind.code())
        .u8(desc.encoding.code())
        .u32(desc.stored_len)
        .u32(desc.plain_len)
        .u16(n as u16)
        .u8(form)
        .u32(length)
        .u32(last)
        .u32(list.len() as u32);
    let mut out = store(&fixed.finish(), key);
    if !list.is_empty() {
        out.extend_from_slice(&store(&list, key));
    }
    out
}

fn store(plain: &[u8], key: Option<&MasterKey>) -> Vec<u8> {
    match key {
        Some(key) => key.seal(Domain::GroupFrame, plain),
        None => {
            let mut out = Vec::with_capacity(plain.len() + CHECK_LEN);
            out.extend_from_slice(plain);
            out.extend_from_slice(&blake3::hash(plain).as_bytes()[..CHECK_LEN]);
            out
        }
    }
}

/// The plain bytes of a stored piece of `len` plain bytes at the start of `at`, and its
/// stored length; `None` if they do not check or open.
fn open(at: &[u8], len: usize, key: Option<&MasterKey>) -> Option<(Vec<u8>, usize)> {
    match key {
        Some(key) => {
            let stored = at.get(..len + SEAL_OVERHEAD)?;
            let plain = key.open(Domain::GroupFrame, "group frame", stored).ok()?;
            (plain.len() == len).then_some((plain, stored.len()))
        }
        None => {
            let (plain, check) = (at.get(..len)?, at.get(len..len + CHECK_LEN)?);
            (blake3::hash(plain).as_bytes()[..CHECK_LEN] == *check)
                .then(|| (plain.to_vec(), len + CHECK_LEN))
        }
    }
}

/// A frame read back: the group's kind and descriptor — with the ids of its stored slots
/// still unknown (zero) — and where its stored bytes lie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: BlobKind,
    pub desc: GroupDesc,
    /// Offset of the stored group (just past the frame) in the bytes read.
    pub group_at: usize,
}

/// Reads the frame at `at` of `pack` (a pack's bytes, sealed when `key` is given); `None` if
/// none checks there. The descriptor's bounds are checked as a trailer's are.
pub fn read(pack: &[u8], at: usize, key: Option<&MasterKey>) -> Option<Frame> {
    let (fixed, fixed_len) = open(pack.get(at..)?, FIXED_LEN, key)?;
    let parsed = (|| -> Result<_, FormatError> {
        let mut d = Decoder::new(&fixed, "group frame");
        let kind = BlobKind::from_code(d.u8()?, "group frame")?;
        let encoding = BlobEncoding::from_code(d.u8()?, "group frame")?;
        let (stored_len, plain_len, n) = (d.u32()?, d.u32()?, d.u16()?);
        let (form, length, last, list_len) = (d.u8()?, d.u32()?, d.u32()?, d.u32()?);
        d.finish()?;
        Ok((
            kind, encoding, stored_len, plain_len, n, form, length, last, list_len,
        ))
    })();
    let (kind, encoding, stored_len, plain_len, n, form, length, last, list_len) = parsed.ok()?;
    if n == 0 || plain_len > MAX_GROUP_PLAIN {
        return None;
    }
    let mut end = at + fixed_len;
    let chunks = match form {
        FORM_UNIFORM if list_len == 0 && (n > 1 || length == last) => {
            let mut chunks = vec![GroupChunk::new(Id([0; 32]), length); n as usize];
            chunks[n as usize - 1].len = last;
            chunks
        }
        FORM_LISTED if length == 0 && last == 0 && (1..=MAX_LIST).contains(&list_len) => {
            let (list, list_stored) = open(pack.get(end..)?, list_len as usize, key)?;
            end += list_stored;
            listed_slots(&list, n).ok()?
        }
        _ => return None,
    };
    let desc = GroupDesc {
        encoding,
        sealed: key.is_some(),
        stored_len,
        plain_len,
        chunks,
    };
    let fits = (end as u64)
        .checked_add(u64::from(stored_len))
        .is_some_and(|e| e <= pack.len() as u64);
    let adds_up = desc.stored_chunk_bytes() == u64::from(plain_len);
    (fits && adds_up && desc.chunks.iter().any(|c| c.stored)).then_some(Frame {
        kind,
        desc,
        group_at: end,
    })
}

fn listed_slots(list: &[u8], n: u16) -> Result<Vec<GroupChunk>, FormatError> {
    let mut d = Decoder::new(list, "group frame");
    let mut chunks = Vec::with_capacity(n as usize);
    for _ in 0..n {
        let (len, flags) = (d.u32()?, d.u8()?);
        let chunk = match flags {
            SLOT_STORED => GroupChunk::new(Id([0; 32]), len),
            0 => GroupChunk {
                id: d.id()?,
                len,
                stored: false,
            },
            _ => return Err(FormatError::invalid("group frame", "unknown slot flags")),
        };
        chunks.push(chunk);
    }
    d.finish()?;
    Ok(chunks)
}

/// A group recovered from its frame: bytes as stored, descriptor with every id recomputed.
#[derive(Debug, Clone)]
pub struct SalvagedGroup {
    pub kind: BlobKind,
    pub group: Group,
    /// Where its stored bytes began in the damaged pack.
    pub offset: u64,
}

/// What [`salvage`] found in a pack.
#[derive(Debug, Default)]
pub struct Salvage {
    pub groups: Vec<SalvagedGroup>,
    /// Groups whose frame read but whose bytes do not decode.
    pub damaged: Vec<(u64, String)>,
    /// Bytes searched for a frame (damaged frames, the trailer, and the inside of groups
    /// whose frame was found only by searching and is not followed by another).
    pub unaccounted: u64,
}

/// Recovers the groups of a version 3 pack from their frames alone, without its trailer or
/// footer (which may be damaged or cut off): each frame is read, its group decoded and every
/// stored chunk hashed with `id_of` (the repository's chunk id), so a group comes back under
/// its own id or not at all. After a frame that does not check, the next is searched byte by
/// byte. A frame met by searching might be bytes inside a raw group that only look like one
/// (a disk that holds a cairn repository): its group is taken (its ids are its own, so at
/// worst it is a group no version uses), but its span is skipped only when another frame,
/// or the end, follows it; otherwise the search goes on inside it. `start` is where the
/// first frame is (past the pack header).
pub fn salvage(
    pack: &[u8],
    start: usize,
    key: Option<&MasterKey>,
    id_of: impl Fn(&[u8]) -> Id,
) -> Salvage {
    let mut out = Salvage::default();
    let mut at = start;
    // Whether `at` is where the previous frame said the next one is.
    let mut chained = true;
    while at < pack.len() {
        let Some(frame) = read(pack, at, key) else {
            out.unaccounted += 1;
            chained = false;
            at += 1;
            continue;
        };
        let end = frame.group_at + frame.desc.stored_len as usize;
        let trusted = chained || end == pack.len() || read(pack, end, key).is_some();
        let stored = &pack[frame.group_at..end];
        let offset = frame.group_at as u64;
        match open_group(&frame.desc, stored, key) {
            Ok(plain) => {
                let mut desc = frame.desc;
                for slot in 0..desc.chunks.len() {
                    if let Some(range) = desc.chunk_range(slot) {
                        desc.chunks[slot].id = id_of(&plain[range]);
                    }
                }
                out.groups.push(SalvagedGroup {
                    kind: frame.kind,
                    group: Group {
                        stored: stored.to_vec(),
                        desc,
                    },
                    offset,
                });
            }
            Err(e) => out.damaged.push((offset, e.to_string())),
        }
        if trusted {
            at = end;
            chained = true;
        } else {
            out.unaccounted += 1;
            at += 1;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Compression;
    use crate::group::{group_id, GroupBuilder};

    fn id_for(key: Option<&MasterKey>) -> impl Fn(&[u8]) -> Id + '_ {
        move |d: &[u8]| key.map_or_else(|| Id::of(d), |k| k.id_of(d))
    }

    fn group(parts: &[&[u8]], key: Option<&MasterKey>) -> Group {
        let mut b = GroupBuilder::new(64 << 10);
        for p in parts {
            b.push(id_for(key)(p), p);
        }
        b.finish(Compression::Zstd { level: 3 }, key)
    }

    #[test]
    fn frames_round_trip_uniform_listed_and_dropped_slots() {
        for key in [None, Some(MasterKey::generate())] {
            let key = key.as_ref();
            let uniform = group(&[&[1; 4096], &[2; 4096], &[3; 100]], key);
            let listed = group(&[&[1; 10], &[2; 4096], &[3; 100]], key);
            let single = group(&[b"a manifest node"], key);
            let full = group(&[b"alpha", &[7; 5000], b"gamma"], key);
            let plain = open_group(&full.desc, &full.stored, key).unwrap();
            let dropped = GroupBuilder::repack(&full.desc, &plain, |slot| slot == 1)
                .finish(Compression::Zstd { level: 3 }, key);
            for (g, kind, len) in [
                (&uniform, BlobKind::Data, 25),
                (&listed, BlobKind::Data, 25 + 15),
                (&single, BlobKind::Node, 25),
                (&dropped, BlobKind::Data, 25 + 15 + 64),
            ] {
                let overhead = match key {
                    Some(_) => SEAL_OVERHEAD * if len > 25 { 2 } else { 1 },
                    None => CHECK_LEN * if len > 25 { 2 } else { 1 },
                };
                let frame = encode(kind, &g.desc, key);
                assert_eq!(frame.len(), len + overhead);
                let mut bytes = frame.clone();
                bytes.extend_from_slice(&g.stored);
                let read = read(&bytes, 0, key).unwrap();
                assert_eq!((read.kind, read.group_at), (kind, frame.len()));
                let s = salvage(&bytes, 0, key, id_for(key));
                assert_eq!(s.groups.len(), 1);
                assert_eq!(s.groups[0].group.desc, g.desc, "ids recomputed");
                assert_eq!(s.groups[0].group.stored, g.stored);
                assert_eq!(
                    group_id(&s.groups[0].group.desc.chunks, key),
                    group_id(&g.desc.chunks, key)
                );
            }
        }
    }

    #[test]
    fn every_flip_in_a_frame_is_refused_and_the_next_frame_is_found_again() {
        for key in [None, Some(MasterKey::generate())] {
            let key = key.as_ref();
            let a = group(&[&[1; 10], &[2; 4096]], key);
            let b = group(&[&[5; 4096], &[6; 4096]], key);
            let fa = encode(BlobKind::Data, &a.desc, key);
            let mut bytes = fa.clone();
            bytes.extend_from_slice(&a.stored);
            let b_at = bytes.len();
            bytes.extend_from_slice(&encode(BlobKind::Data, &b.desc, key));
            bytes.extend_from_slice(&b.stored);
            for at in 0..fa.len() {
                let mut bad = bytes.clone();
                bad[at] ^= 0x10;
                assert!(read(&bad, 0, key).is_none(), "flip at {at} accepted");
                let s = salvage(&bad, 0, key, id_for(key));
                assert_eq!(s.groups.len(), 1, "flip at {at}: b found again");
                assert_eq!(s.groups[0].group.desc, b.desc);
                assert_eq!(s.unaccounted, b_at as u64);
            }
            // A flip in a's bytes loses a alone.
            let mut bad = bytes.clone();
            bad[fa.len() + 3] ^= 1;
            let s = salvage(&bad, 0, key, id_for(key));
            let ids: Vec<Id> = s
                .groups
                .iter()
                .map(|g| group_id(&g.group.desc.chunks, key))
                .collect();
            assert!(!ids.contains(&group_id(&a.desc.chunks, key)));
            assert!(ids.contains(&group_id(&b.desc.chunks, key)));
            // Cut anywhere: what lies whole before the cut comes back.
            for cut in 0..bytes.len() {
                let s = salvage(&bytes[..cut], 0, key, id_for(key));
                let whole =
                    usize::from(cut >= fa.len() + a.stored.len()) + usize::from(cut == bytes.len());
                assert_eq!(s.groups.len(), whole, "cut at {cut}");
            }
        }
    }

    /// A raw group may hold bytes that look like a frame (a disk holding a cairn repository).
    /// Met by searching, such a frame's span is not trusted: the real frame it covers is still
    /// found.
    #[test]
    fn a_frame_inside_a_raw_group_does_not_hide_the_real_ones() {
        let b = group(&[&[9; 4096], &[8; 4096]], None);
        let frame_b = encode(BlobKind::Data, &b.desc, None);
        let mut noise: Vec<u8> = (0..3000u32)
            .flat_map(|i| Id::of(&i.to_le_bytes()).0)
            .collect();
        noise.truncate(60_000);
        // Group a: raw noise with a fake frame at 1000 claiming a raw group that runs past
        // b's frame and ends inside b's bytes.
        let a_len = noise.len();
        let fake_at_in_a = 1000;
        let a_frame_len = encode(BlobKind::Data, &group(&[&noise], None).desc, None).len();
        let fake_frame_len = 33;
        let fake_group_at = a_frame_len + fake_at_in_a + fake_frame_len;
        let b_stored_at = a_frame_len + a_len + frame_b.len();
        let fake_len = (b_stored_at + 10 - fake_group_at) as u32;
        let fake = GroupDesc {
            encoding: BlobEncoding::Raw,
            sealed: false,
            stored_len: fake_len,
            plain_len: fake_len,
            chunks: vec![GroupChunk::new(Id([0; 32]), fake_len)],
        };
        let fake_frame = encode(BlobKind::Data, &fake, None);
        assert_eq!(fake_frame.len(), fake_frame_len);
        noise[fake_at_in_a..fake_at_in_a + fake_frame_len].copy_from_slice(&fake_frame);
        let a = group(&[&noise], None);
        assert_eq!(
            a.desc.encoding,
            BlobEncoding::Raw,
            "noise does not compress"
        );
        let mut bytes = encode(BlobKind::Data, &a.desc, None);
        assert_eq!(bytes.len(), a_frame_len);
        bytes.extend_from_slice(&a.stored);
        bytes.extend_from_slice(&frame_b);
        bytes.extend_from_slice(&b.stored);
        bytes[3] ^= 1; // a's frame damaged: the search starts
        let s = salvage(&bytes, 0, None, Id::of);
        let ids: Vec<Id> = s
            .groups
            .iter()
            .map(|g| group_id(&g.group.desc.chunks, None))
            .collect();
        assert!(ids.contains(&group_id(&b.desc.chunks, None)), "b found");
        assert_eq!(s.groups.len(), 2, "the fake group and b");
    }
}

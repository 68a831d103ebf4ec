//! Chunk groups (format 2): the unit of compression and encryption. Dedup decides
//! per chunk (4 KiB, the file system's block); a commit's neighbouring new chunks are stored
//! together as one group — one zstd frame (or raw), sealed in an encrypted repository — so
//! that compression sees more than one block (the VM-centric paper's compressed chunk groups).
//!
//! ```text
//! plain group  = chunk 0 | chunk 1 | … | chunk n-1        (plain bytes, back to back)
//! stored group = raw plain group, or one zstd frame of it  (when that saves ≥ 1/32)
//!                then, encrypted: nonce (24) | ciphertext | tag (16), domain "group"
//! ```
//! A group's descriptor ([`GroupDesc`]: encoding, sealing, lengths, and every chunk's id and
//! length in order) lives in the pack trailer and the index; a chunk's offset in the plain
//! group is the sum of the lengths before it. Reading a chunk decodes its whole group (readers
//! keep a small cache of decoded groups) and checks the chunk against its id.

use crate::config::Compression;
use crate::crypto::{open_if_sealed, CryptoError, Domain, MasterKey, NONCE_LEN, SEAL_OVERHEAD};
use crate::pack::{encode_blob, zstd_decompress, BlobEncoding};
use crate::{FormatError, Id};

/// The largest plain group a reader accepts (a writer's limit is far below: 64 KiB by
/// default), so that a forged descriptor cannot make a reader allocate without bound.
pub const MAX_GROUP_PLAIN: u32 = 16 << 20;

/// One slot of a group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupChunk {
    pub id: Id,
    pub len: u32,
    /// False once GC has rewritten the group without this chunk (no live version refers to
    /// it): the slot keeps its place, its id and its length — leaves name slots, and the group
    /// id hashes every slot — but its bytes are gone from the plain group.
    pub stored: bool,
}

impl GroupChunk {
    /// A chunk whose bytes the group holds.
    pub fn new(id: Id, len: u32) -> GroupChunk {
        GroupChunk {
            id,
            len,
            stored: true,
        }
    }
}

/// What a reader needs to decode a group and find its chunks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupDesc {
    pub encoding: BlobEncoding,
    /// Sealed under the repository's data key (an encrypted repository).
    pub sealed: bool,
    pub stored_len: u32,
    pub plain_len: u32,
    pub chunks: Vec<GroupChunk>,
}

impl GroupDesc {
    /// The byte range of chunk `slot` in the plain group (none if the group has no such
    /// slot or no longer stores it).
    pub fn chunk_range(&self, slot: usize) -> Option<std::ops::Range<usize>> {
        let this = self.chunks.get(slot).filter(|c| c.stored)?;
        let start: usize = self.chunks[..slot]
            .iter()
            .filter(|c| c.stored)
            .map(|c| c.len as usize)
            .sum();
        Some(start..start + this.len as usize)
    }

    /// The plain bytes of the chunks the group stores: what `plain_len` must be.
    pub fn stored_chunk_bytes(&self) -> u64 {
        self.chunks
            .iter()
            .filter(|c| c.stored)
            .map(|c| u64::from(c.len))
            .sum()
    }
}

/// A group as stored, and its descriptor.
#[derive(Debug, Clone)]
pub struct Group {
    pub stored: Vec<u8>,
    pub desc: GroupDesc,
}

/// Collects a commit's new chunks, in the order met, into one group.
#[derive(Debug)]
pub struct GroupBuilder {
    limit: usize,
    plain: Vec<u8>,
    chunks: Vec<GroupChunk>,
}

impl GroupBuilder {
    /// A builder of groups of at most `limit` plain bytes (a single larger chunk still makes
    /// a group of its own).
    pub fn new(limit: usize) -> GroupBuilder {
        GroupBuilder {
            limit,
            plain: Vec::with_capacity(limit),
            chunks: Vec::new(),
        }
    }

    /// Whether `len` more bytes would overflow a group that already holds something: then
    /// finish this one first.
    pub fn is_full_for(&self, len: usize) -> bool {
        !self.chunks.is_empty() && self.plain.len() + len > self.limit
    }

    pub fn push(&mut self, id: Id, data: &[u8]) {
        self.plain.extend_from_slice(data);
        self.chunks.push(GroupChunk::new(id, data.len() as u32));
    }

    /// The builder of `desc`'s group rewritten by GC: every slot stays listed (with its id and
    /// length, so the group id does not change), but only the stored slots `keep` accepts
    /// keep their bytes. `plain` is the decoded group. The caller drops a group that keeps no
    /// slot instead of rewriting it.
    pub fn repack(desc: &GroupDesc, plain: &[u8], keep: impl Fn(usize) -> bool) -> GroupBuilder {
        Self::rebuild(desc, |slot| {
            desc.chunk_range(slot)
                .filter(|r| keep(slot) && r.end <= plain.len())
                .map(|r| &plain[r])
        })
    }

    /// The builder of `desc`'s group with the bytes `bytes` gives each slot (`None`: not
    /// stored): every slot stays listed with its id and length, so the group keeps its id —
    /// how GC rebuilds a group whose only copy is damaged from other copies of its chunks.
    /// The caller checks the bytes against the slots' ids.
    pub fn rebuild<'a>(
        desc: &GroupDesc,
        mut bytes: impl FnMut(usize) -> Option<&'a [u8]>,
    ) -> GroupBuilder {
        let mut b = GroupBuilder::new(desc.plain_len as usize);
        for (slot, c) in desc.chunks.iter().enumerate() {
            match bytes(slot).filter(|d| d.len() == c.len as usize) {
                Some(data) => b.push(c.id, data),
                None => b.chunks.push(GroupChunk {
                    stored: false,
                    ..*c
                }),
            }
        }
        b
    }

    pub fn is_empty(&self) -> bool {
        self.chunks.is_empty()
    }

    /// Compresses (when that pays) and, with a key, seals the group.
    pub fn finish(self, compression: Compression, key: Option<&MasterKey>) -> Group {
        self.finish_inner(compression, key.map(|k| (k, None)))
    }

    /// [`GroupBuilder::finish`] with a given nonce: only for golden vectors.
    #[doc(hidden)]
    pub fn finish_with_nonce(
        self,
        compression: Compression,
        key: &MasterKey,
        nonce: &[u8; NONCE_LEN],
    ) -> Group {
        self.finish_inner(compression, Some((key, Some(nonce))))
    }

    fn finish_inner(
        self,
        compression: Compression,
        key: Option<(&MasterKey, Option<&[u8; NONCE_LEN]>)>,
    ) -> Group {
        let (encoded, encoding) = encode_blob(&self.plain, compression);
        let stored = match key {
            None => encoded,
            Some((key, None)) => key.seal(Domain::Group, &encoded),
            Some((key, Some(nonce))) => key.seal_with_nonce(Domain::Group, nonce, &encoded),
        };
        Group {
            desc: GroupDesc {
                encoding,
                sealed: key.is_some(),
                stored_len: stored.len() as u32,
                plain_len: self.plain.len() as u32,
                chunks: self.chunks,
            },
            stored,
        }
    }
}

/// The BLAKE3 key-derivation context of group ids.
pub const GROUP_ID_CONTEXT: &str = "cairn 2026-11-25 v2 group id";

/// A group's id: what v2 leaves name (`leaf_v2`). It hashes the group's chunk list — every
/// chunk's id (32) and plain length (u32), in slot order — not its stored bytes, so it does
/// not change when the group is compressed, sealed or moved to another pack, and it commits
/// to the data through the chunk ids (a reader checks it against the descriptor it finds).
/// Plain repositories hash in BLAKE3's key-derivation mode with [`GROUP_ID_CONTEXT`], so a
/// group id is never the id of some chunk whose bytes happen to equal a chunk list; encrypted
/// ones use keyed BLAKE3 under a key derived from the id key with the same context.
pub fn group_id(chunks: &[GroupChunk], key: Option<&MasterKey>) -> Id {
    let mut h = match key {
        None => blake3::Hasher::new_derive_key(GROUP_ID_CONTEXT),
        Some(key) => blake3::Hasher::new_keyed(&key.group_id_key()),
    };
    for c in chunks {
        h.update(c.id.as_bytes());
        h.update(&c.len.to_le_bytes());
    }
    Id(*h.finalize().as_bytes())
}

/// Decodes a stored group to its plain bytes (opening it first if sealed). Checks lengths,
/// not chunk ids: see [`chunk`].
pub fn open_group(
    desc: &GroupDesc,
    stored: &[u8],
    key: Option<&MasterKey>,
) -> Result<Vec<u8>, CryptoError> {
    if stored.len() != desc.stored_len as usize {
        return Err(FormatError::Truncated {
            what: "group",
            needed: desc.stored_len.into(),
            available: stored.len() as u64,
        }
        .into());
    }
    let listed = desc.stored_chunk_bytes();
    if desc.plain_len > MAX_GROUP_PLAIN || listed != u64::from(desc.plain_len) {
        return Err(FormatError::invalid(
            "group",
            format!(
                "descriptor lists {listed} bytes of chunks in a group of {} (limit {MAX_GROUP_PLAIN})",
                desc.plain_len
            ),
        )
        .into());
    }
    let encoded = open_if_sealed(desc.sealed, key, Domain::Group, "group", stored)?;
    let plain = match desc.encoding {
        BlobEncoding::Raw => encoded.into_owned(),
        BlobEncoding::Zstd => zstd_decompress(&encoded, desc.plain_len as usize)
            .map_err(|e| FormatError::invalid("group", format!("zstd: {e} (corrupt)")))?,
    };
    if plain.len() != desc.plain_len as usize {
        return Err(FormatError::invalid(
            "group",
            format!(
                "decodes to {} bytes, expected {}",
                plain.len(),
                desc.plain_len
            ),
        )
        .into());
    }
    Ok(plain)
}

/// Chunk `slot` of a decoded group, checked against its id (`id_of`: BLAKE3, or the keyed
/// BLAKE3 of an encrypted repository).
pub fn chunk<'a>(
    desc: &GroupDesc,
    plain: &'a [u8],
    slot: usize,
    id_of: impl Fn(&[u8]) -> Id,
) -> Result<&'a [u8], FormatError> {
    let range = match desc.chunks.get(slot) {
        None => return Err(FormatError::invalid("group", format!("no slot {slot}"))),
        Some(c) if !c.stored => {
            return Err(FormatError::invalid(
                "group",
                format!("slot {slot} is no longer stored (GC dropped it)"),
            ))
        }
        Some(_) => desc
            .chunk_range(slot)
            .filter(|r| r.end <= plain.len())
            .ok_or_else(|| {
                FormatError::invalid("group", format!("slot {slot} lies past the group"))
            })?,
    };
    let data = &plain[range];
    if id_of(data) != desc.chunks[slot].id {
        return Err(FormatError::Checksum { what: "chunk" });
    }
    Ok(data)
}

/// Bytes a sealed group adds to its encoded size.
pub const SEALED_GROUP_OVERHEAD: usize = SEAL_OVERHEAD;

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_testkit::noise;

    fn chunks() -> Vec<Vec<u8>> {
        vec![b"text ".repeat(800), noise(4096, 1), vec![7u8; 1000]]
    }

    fn build(limit: usize, key: Option<&MasterKey>) -> Group {
        let mut b = GroupBuilder::new(limit);
        for c in chunks() {
            assert!(!b.is_full_for(c.len()));
            b.push(Id::of(&c), &c);
        }
        b.finish(Compression::Zstd { level: 3 }, key)
    }

    #[test]
    fn a_group_round_trips_plain_and_sealed_and_each_chunk_checks_its_id() {
        for key in [None, Some(MasterKey::generate())] {
            let g = build(64 << 10, key.as_ref());
            assert_eq!(g.desc.sealed, key.is_some());
            assert_eq!(g.desc.encoding, BlobEncoding::Zstd);
            assert_eq!(g.desc.plain_len, 4000 + 4096 + 1000);
            let plain = open_group(&g.desc, &g.stored, key.as_ref()).unwrap();
            for (slot, want) in chunks().iter().enumerate() {
                assert_eq!(chunk(&g.desc, &plain, slot, Id::of).unwrap(), &want[..]);
            }
            assert!(chunk(&g.desc, &plain, 3, Id::of).is_err());
            let mut wrong = g.desc.clone();
            wrong.chunks[1].id = Id::of(b"other");
            assert_eq!(
                chunk(&wrong, &plain, 1, Id::of),
                Err(FormatError::Checksum { what: "chunk" })
            );
        }
    }

    #[test]
    fn group_ids_name_the_chunk_list_and_depend_on_the_repository() {
        let g = build(64 << 10, None);
        let id = group_id(&g.desc.chunks, None);
        assert_eq!(id, group_id(&build(64 << 10, None).desc.chunks, None));
        // Not the hash of anything a chunk could hold, and not the sealed group's id either.
        let mut list = Vec::new();
        for c in &g.desc.chunks {
            list.extend_from_slice(c.id.as_bytes());
            list.extend_from_slice(&c.len.to_le_bytes());
        }
        assert_ne!(id, Id::of(&list));
        let (k1, k2) = (MasterKey::generate(), MasterKey::generate());
        let keyed = group_id(&g.desc.chunks, Some(&k1));
        assert_ne!(keyed, id);
        assert_ne!(keyed, group_id(&g.desc.chunks, Some(&k2)));
        assert_ne!(keyed, k1.id_of(&list));
        // Every slot's id and length counts, and so does their order.
        let mut other = g.desc.chunks.clone();
        other[2].len -= 1;
        assert_ne!(group_id(&other, None), id);
        other = g.desc.chunks.clone();
        other.swap(0, 1);
        assert_ne!(group_id(&other, None), id);
    }

    #[test]
    fn a_repacked_group_keeps_its_slots_and_id_and_stores_only_what_is_kept() {
        for key in [None, Some(MasterKey::generate())] {
            let g = build(64 << 10, key.as_ref());
            let plain = open_group(&g.desc, &g.stored, key.as_ref()).unwrap();
            let kept = GroupBuilder::repack(&g.desc, &plain, |slot| slot != 1)
                .finish(Compression::Zstd { level: 3 }, key.as_ref());
            assert_eq!(kept.desc.chunks.len(), 3);
            assert!(!kept.desc.chunks[1].stored);
            assert_eq!(kept.desc.plain_len, 4000 + 1000);
            assert_eq!(
                group_id(&kept.desc.chunks, key.as_ref()),
                group_id(&g.desc.chunks, key.as_ref())
            );
            let id_of = Id::of; // `build` names chunks by their plain ids
            let again = open_group(&kept.desc, &kept.stored, key.as_ref()).unwrap();
            let want = chunks();
            assert_eq!(chunk(&kept.desc, &again, 0, id_of).unwrap(), &want[0][..]);
            assert_eq!(chunk(&kept.desc, &again, 2, id_of).unwrap(), &want[2][..]);
            let gone = chunk(&kept.desc, &again, 1, id_of).unwrap_err().to_string();
            assert!(gone.contains("slot 1 is no longer stored"), "{gone}");
            // A second repack keeps what the first dropped dropped.
            let twice = GroupBuilder::repack(&kept.desc, &again, |slot| slot == 0)
                .finish(Compression::Zstd { level: 3 }, key.as_ref());
            let stored: Vec<bool> = twice.desc.chunks.iter().map(|c| c.stored).collect();
            assert_eq!(stored, [true, false, false]);
            assert_eq!(twice.desc.plain_len, 4000);
        }
    }

    #[test]
    fn a_full_group_says_so_and_a_big_chunk_still_fits_an_empty_one() {
        let mut b = GroupBuilder::new(8192);
        assert!(!b.is_full_for(100_000), "an empty group takes any chunk");
        b.push(Id::of(b"a"), &[1; 4096]);
        assert!(!b.is_full_for(4096));
        b.push(Id::of(b"b"), &[2; 4096]);
        assert!(b.is_full_for(1));
    }

    #[test]
    fn damaged_groups_and_forged_descriptors_are_refused() {
        let key = MasterKey::generate();
        let g = build(64 << 10, Some(&key));
        let mut flipped = g.stored.clone();
        flipped[30] ^= 1;
        assert!(matches!(
            open_group(&g.desc, &flipped, Some(&key)),
            Err(CryptoError::Tampered { what: "group" })
        ));
        assert!(
            open_group(&g.desc, &g.stored, None).is_err(),
            "sealed, no key"
        );
        assert!(
            open_group(&g.desc, &g.stored[1..], Some(&key)).is_err(),
            "short"
        );
        let mut forged = g.desc.clone();
        forged.plain_len = MAX_GROUP_PLAIN + 1;
        assert!(open_group(&forged, &g.stored, Some(&key)).is_err());
        let mut forged = g.desc.clone();
        forged.chunks.pop();
        assert!(
            open_group(&forged, &g.stored, Some(&key)).is_err(),
            "lengths disagree"
        );

        let plain = build(64 << 10, None);
        let mut flipped = plain.stored.clone();
        let last = flipped.len() - 1;
        flipped[last] ^= 0xff;
        assert!(open_group(&plain.desc, &flipped, None).is_err());
    }

    #[test]
    fn incompressible_groups_are_stored_raw() {
        let noise = noise(8192, 2);
        let mut b = GroupBuilder::new(64 << 10);
        b.push(Id::of(&noise), &noise);
        let g = b.finish(Compression::Zstd { level: 3 }, None);
        assert_eq!(g.desc.encoding, BlobEncoding::Raw);
        assert_eq!(g.stored, noise);
    }
}

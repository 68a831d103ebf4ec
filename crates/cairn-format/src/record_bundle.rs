//! Version record bundles (`gc/records/<id>`): the stored bytes of every version record the
//! last GC reached from the refs, in one object. GC walks every image's history twice (before
//! and after it waits for older sessions); with a bundle it reads one object and only the
//! records committed since, instead of one object per version.
//!
//! A bundle adds no trust: each record is kept exactly as stored under `versions/<id>` (sealed
//! there in an encrypted repository, so sealed here too) and its id is not stored but
//! recomputed, `BLAKE3(bytes)`, so a record taken from a bundle is checked exactly as one read
//! from its own key. Records are immutable (content-addressed), so a bundle never goes stale;
//! at worst it holds records no ref reaches any more, which the reader ignores.
//!
//! ```text
//! envelope "CRNRECS\0", version 1
//! payload  = record count R (u32)
//!          | R × (length L (u32, 1 ..= 16 MiB) | L bytes: the record as stored)
//! ```
//! Records are in strictly ascending order of their ids (so one set of records has one
//! encoding, and one content id).

use std::collections::BTreeMap;

use crate::codec::{Decoder, Encoder};
use crate::{envelope, FormatError, FormatResult, Id};

const MAGIC: &[u8; 8] = b"CRNRECS\0";
const WHAT: &str = "version record bundle";
/// Larger than any record cairn writes (a record is a few hundred bytes plus its message).
const MAX_RECORD: u32 = 16 << 20;

/// Stored version records by id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecordBundle {
    pub records: BTreeMap<Id, Vec<u8>>,
}

impl RecordBundle {
    /// Adds a record as stored; its id is the hash of the bytes.
    pub fn insert(&mut self, stored: Vec<u8>) -> Id {
        let id = Id::of(&stored);
        self.records.insert(id, stored);
        id
    }

    pub fn encode(&self) -> Vec<u8> {
        let bytes: usize = self.records.values().map(|r| 4 + r.len()).sum();
        let mut e = Encoder::with_capacity(4 + bytes);
        e.u32(u32::try_from(self.records.len()).expect("records fit u32"));
        for record in self.records.values() {
            e.u32(u32::try_from(record.len()).expect("a record under 4 GiB"));
            e.bytes(record);
        }
        envelope::seal(MAGIC, &e.finish())
    }

    pub fn decode(data: &[u8]) -> FormatResult<RecordBundle> {
        let mut d = Decoder::new(envelope::open(MAGIC, data, WHAT)?, WHAT);
        let count = d.u32()?;
        let mut records = BTreeMap::new();
        let mut last: Option<Id> = None;
        for _ in 0..count {
            let len = d.u32()?;
            if len == 0 || len > MAX_RECORD {
                return Err(invalid(format!("a record of {len} bytes")));
            }
            let stored = d.take(len as usize)?;
            let id = Id::of(stored);
            if last.is_some_and(|l| l >= id) {
                return Err(invalid("record ids not strictly ascending"));
            }
            last = Some(id);
            records.insert(id, stored.to_vec());
        }
        d.finish()?;
        Ok(RecordBundle { records })
    }
}

fn invalid(why: impl Into<String>) -> FormatError {
    FormatError::invalid(WHAT, why.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bundle(n: u8) -> RecordBundle {
        let mut b = RecordBundle::default();
        for i in 0..n {
            b.insert(vec![i; 1 + i as usize]);
        }
        b
    }

    #[test]
    fn round_trips_and_one_set_has_one_encoding() {
        let b = bundle(5);
        let raw = b.encode();
        assert_eq!(RecordBundle::decode(&raw).unwrap(), b);
        let mut reversed = RecordBundle::default();
        for stored in b.records.values().rev() {
            reversed.insert(stored.clone());
        }
        assert_eq!(reversed.encode(), raw);
        assert_eq!(
            RecordBundle::decode(&RecordBundle::default().encode()).unwrap(),
            RecordBundle::default()
        );
    }

    #[test]
    fn ids_are_recomputed_from_the_bytes() {
        let b = bundle(3);
        for (id, stored) in &b.records {
            assert_eq!(*id, Id::of(stored));
        }
    }

    #[test]
    fn rejects_out_of_order_empty_and_truncated_records() {
        let b = bundle(3);
        let ordered: Vec<&Vec<u8>> = b.records.values().collect();
        let payload = |records: &[&[u8]], count: u32| {
            let mut e = Encoder::new();
            e.u32(count);
            for r in records {
                e.u32(r.len() as u32).bytes(r);
            }
            envelope::seal(MAGIC, &e.finish())
        };
        let swapped = payload(&[ordered[1], ordered[0]], 2);
        let err = RecordBundle::decode(&swapped).unwrap_err().to_string();
        assert!(err.contains("not strictly ascending"), "{err}");
        let dup = payload(&[ordered[0], ordered[0]], 2);
        assert!(RecordBundle::decode(&dup).is_err());
        let empty = payload(&[&[]], 1);
        let err = RecordBundle::decode(&empty).unwrap_err().to_string();
        assert!(err.contains("a record of 0 bytes"), "{err}");
        let short = payload(&[ordered[0]], 2);
        assert!(RecordBundle::decode(&short).is_err());
        let mut flipped = b.encode();
        let at = flipped.len() / 2;
        flipped[at] ^= 1;
        assert!(RecordBundle::decode(&flipped).is_err());
    }
}

//! Reference summaries of format 2 (`summaries/<root id>`, like format 1's): which manifest
//! nodes and which slots of which chunk groups a tree uses, so that GC can tell what the live
//! versions use by reading one small object per live tree instead of walking the trees.
//!
//! Format 1's summaries are Bloom filters of chunk ids. A format 2 leaf names runs of group
//! slots, and about 16–64 chunks share a group, so a table keyed by group is smaller than a
//! filter of chunks and answers per slot: GC can rewrite a group without its dead slots on the
//! strength of summaries alone. Ids are keyed by their first 8 bytes (as in index runs): two
//! ids that share a key only make GC keep something dead (a leak `gc --repair` removes),
//! never delete something live.
//!
//! ```text
//! envelope "CRNSUM2\0" (sealed as a summary in an encrypted repository)
//! payload  = stale slots (u64)
//!          | node count N (u32) | N × node key (u64)                   ascending, distinct
//!          | group count G (u32) | G × (group key (u64) | slot set)     ascending, distinct
//! slot set = bytes B (u16, 1 ..= 8192) | B bytes (bit s % 8 of byte s / 8: slot s), last ≠ 0
//! ```
//! `stale slots` counts slots the table may list without the tree using them: a patch adds
//! its new runs to the base's table without removing the ones it replaced (another leaf may
//! still use them), and rebuilds the table when the count grows past a fraction of it.

use std::collections::{BTreeMap, BTreeSet};

use crate::codec::{Decoder, Encoder};
use crate::slots::SlotSet;
use crate::{envelope, FormatError, FormatResult, Id};

const MAGIC: &[u8; 8] = b"CRNSUM2\0";
const WHAT: &str = "group summary";

/// The key of an id in a summary: its first 8 bytes, little-endian.
pub fn key_of(id: &Id) -> u64 {
    id.prefix_u64()
}

/// What one tree (or, merged, several) uses.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GroupSummary {
    /// Slots listed that the tree may not use any more (see the module doc).
    pub stale_slots: u64,
    pub nodes: BTreeSet<u64>,
    pub groups: BTreeMap<u64, SlotSet>,
}

impl GroupSummary {
    pub fn add_node(&mut self, id: &Id) {
        self.nodes.insert(key_of(id));
    }

    /// Adds slots `first .. first + count` of group `group`.
    pub fn add_run(&mut self, group: &Id, first: u16, count: u16) {
        if count > 0 {
            self.groups
                .entry(key_of(group))
                .or_default()
                .insert_run(first, count);
        }
    }

    /// Adds everything `other` lists (the union of two trees' use).
    pub fn merge(&mut self, other: &GroupSummary) {
        self.stale_slots += other.stale_slots;
        self.nodes.extend(other.nodes.iter().copied());
        for (key, slots) in &other.groups {
            self.groups.entry(*key).or_default().union_with(slots);
        }
    }

    /// Whether node `id` may be used (false: certainly not).
    pub fn has_node(&self, id: &Id) -> bool {
        self.nodes.contains(&key_of(id))
    }

    /// The slots of group `id` that may be used (`None`: certainly none).
    pub fn slots(&self, group: &Id) -> Option<&SlotSet> {
        self.groups.get(&key_of(group))
    }

    /// Slots listed, over every group.
    pub fn slot_count(&self) -> u64 {
        self.groups.values().map(SlotSet::len).sum()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::with_capacity(20 + self.nodes.len() * 8 + self.groups.len() * 12);
        e.u64(self.stale_slots);
        e.u32(u32::try_from(self.nodes.len()).expect("nodes fit u32"));
        for k in &self.nodes {
            e.u64(*k);
        }
        let groups: Vec<_> = self.groups.iter().filter(|(_, s)| !s.is_empty()).collect();
        e.u32(u32::try_from(groups.len()).expect("groups fit u32"));
        for (k, slots) in groups {
            e.u64(*k);
            slots.encode_into(&mut e);
        }
        envelope::seal(MAGIC, &e.finish())
    }

    pub fn decode(data: &[u8]) -> FormatResult<GroupSummary> {
        let mut d = Decoder::new(envelope::open(MAGIC, data, WHAT)?, WHAT);
        let mut s = GroupSummary {
            stale_slots: d.u64()?,
            ..Default::default()
        };
        let n = d.u32()?;
        let mut last = None;
        for _ in 0..n {
            let k = d.u64()?;
            ascending(&mut last, k, "node")?;
            s.nodes.insert(k);
        }
        let g = d.u32()?;
        let mut last = None;
        for _ in 0..g {
            let k = d.u64()?;
            ascending(&mut last, k, "group")?;
            s.groups.insert(k, SlotSet::decode_from(&mut d, WHAT)?);
        }
        d.finish()?;
        Ok(s)
    }
}

fn ascending(last: &mut Option<u64>, k: u64, what: &str) -> FormatResult<()> {
    if last.is_some_and(|l| l >= k) {
        return Err(FormatError::invalid(
            WHAT,
            format!("{what} keys not strictly ascending"),
        ));
    }
    *last = Some(k);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_merge_and_canonical_order() {
        let (g1, g2) = (Id::of(b"g1"), Id::of(b"g2"));
        let mut a = GroupSummary::default();
        a.add_node(&Id::of(b"n1"));
        a.add_run(&g1, 0, 3);
        a.add_run(&g2, 10, 1);
        a.add_run(&g2, 0, 0);
        let mut b = GroupSummary {
            stale_slots: 2,
            ..Default::default()
        };
        b.add_node(&Id::of(b"n2"));
        b.add_run(&g1, 5, 1);
        a.merge(&b);
        assert_eq!(a.slot_count(), 5);
        assert_eq!(a.stale_slots, 2);
        assert!(a.has_node(&Id::of(b"n2")) && !a.has_node(&Id::of(b"n3")));
        assert_eq!(a.slots(&g1).unwrap().runs(), vec![(0, 3), (5, 1)]);
        assert!(a.slots(&Id::of(b"g3")).is_none());
        let raw = a.encode();
        assert_eq!(GroupSummary::decode(&raw).unwrap(), a);

        // Keys out of order are refused (the checksum recomputed: the order is the check).
        let mut payload = envelope::open(MAGIC, &raw, WHAT).unwrap().to_vec();
        let (k1, k2) = (12..20, 20..28); // the two node keys
        let first = payload[k1.clone()].to_vec();
        let second = payload[k2.clone()].to_vec();
        payload[k1].copy_from_slice(&second);
        payload[k2].copy_from_slice(&first);
        let err = GroupSummary::decode(&envelope::seal(MAGIC, &payload)).unwrap_err();
        assert!(err.to_string().contains("not strictly ascending"), "{err}");
    }
}

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
//! envelope "CRNSUM2\0", version 1 or 2 (sealed as a summary in an encrypted repository)
//! payload  = stale slots (u64)
//!          | node count N (u32) | N × node key (u64)                   ascending, distinct
//!          | group count G (u32) | G × (group key (u64) | slot set)     ascending, distinct
//!          [version 2: | repeat count R (u32)
//!                      | R × (group key (u64) | slot (u16) | repeats (u32 ≥ 1))
//!                                    ascending by (key, slot), distinct, each slot listed]
//! slot set = bytes B (u16, 1 ..= 8192) | B bytes (bit s % 8 of byte s / 8: slot s), last ≠ 0
//! ```
//! Version 2 is *counted*: a slot's references in the tree are 1 + its repeats (a reference
//! per leaf occurrence per run naming it), and `stale slots` is 0. So a commit that reuses a
//! base's leaves unread can take the base's counts, subtract the leaves it dropped and add
//! the ones it built, and stay exact without reading the leaves it kept. Version 1 (written
//! before 2026-11-26) carries no counts: `stale slots` counts slots the table may list
//! without the tree using them (a superset, kept by writers of that time within a bound).

use std::collections::{BTreeMap, BTreeSet};

use crate::codec::{Decoder, Encoder};
use crate::slots::SlotSet;
use crate::{envelope, FormatError, FormatResult, Id};

const MAGIC: &[u8; 8] = b"CRNSUM2\0";
const WHAT: &str = "group summary";
/// The envelope version of a counted summary.
const COUNTED: u32 = 2;

/// The key of an id in a summary: its first 8 bytes, little-endian.
pub fn key_of(id: &Id) -> u64 {
    id.prefix_u64()
}

/// What one tree (or, merged, several) uses.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GroupSummary {
    /// Slots listed that the tree may not use any more (see the module doc; 0 if counted).
    pub stale_slots: u64,
    pub nodes: BTreeSet<u64>,
    pub groups: BTreeMap<u64, SlotSet>,
    /// References to a listed slot beyond the first, by (group key, slot), when the summary
    /// is counted (`None`: a version 1 summary, or a union of trees). A count that reaches
    /// `u32::MAX` sticks there: the slot stays listed (a leak, never a loss).
    pub repeats: Option<BTreeMap<(u64, u16), u32>>,
}

/// A counted summary was asked to remove a reference it does not hold: it does not describe
/// the tree it was given for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NotReferenced {
    pub group: u64,
    pub slot: u16,
}

impl std::fmt::Display for NotReferenced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "slot {} of group key {:016x} is not referenced by the summary",
            self.slot, self.group
        )
    }
}

impl GroupSummary {
    /// An empty counted summary (a commit's: each leaf occurrence adds its runs).
    pub fn counted() -> GroupSummary {
        GroupSummary {
            repeats: Some(BTreeMap::new()),
            ..GroupSummary::default()
        }
    }

    /// Whether the summary counts references (and so is exact: see the module doc).
    pub fn is_counted(&self) -> bool {
        self.repeats.is_some() && self.stale_slots == 0
    }

    pub fn add_node(&mut self, id: &Id) {
        self.nodes.insert(key_of(id));
    }

    /// Adds a reference to slots `first .. first + count` of group `group` (one leaf
    /// occurrence's run).
    pub fn add_run(&mut self, group: &Id, first: u16, count: u16) {
        if count == 0 {
            return;
        }
        let key = key_of(group);
        let set = self.groups.entry(key).or_default();
        match &mut self.repeats {
            None => set.insert_run(first, count),
            Some(repeats) => {
                let end = usize::from(first) + usize::from(count);
                for slot in (usize::from(first)..end).map(|s| s as u16) {
                    if !set.insert(slot) {
                        let n = repeats.entry((key, slot)).or_default();
                        *n = n.saturating_add(1);
                    }
                }
            }
        }
    }

    /// Removes a reference to slots `first .. first + count` of group `group` from a
    /// counted summary (a leaf occurrence the tree dropped). On an error the summary is
    /// partly changed: the caller drops it.
    pub fn remove_run(&mut self, group: &Id, first: u16, count: u16) -> Result<(), NotReferenced> {
        if count == 0 {
            return Ok(());
        }
        let key = key_of(group);
        let repeats = self
            .repeats
            .as_mut()
            .expect("remove_run on a counted summary");
        let Some(set) = self.groups.get_mut(&key) else {
            return Err(NotReferenced {
                group: key,
                slot: first,
            });
        };
        let end = usize::from(first) + usize::from(count);
        for slot in (usize::from(first)..end).map(|s| s as u16) {
            match repeats.get_mut(&(key, slot)) {
                Some(n) if *n == u32::MAX => {}
                Some(n) if *n > 1 => *n -= 1,
                Some(_) => {
                    repeats.remove(&(key, slot));
                }
                None if set.remove(slot) => {}
                None => return Err(NotReferenced { group: key, slot }),
            }
        }
        if set.is_empty() {
            self.groups.remove(&key);
        }
        Ok(())
    }

    /// Adds everything `other` lists (the union of two trees' use). The result is counted
    /// only if both are, with the references of both.
    pub fn merge(&mut self, other: &GroupSummary) {
        self.stale_slots += other.stale_slots;
        self.nodes.extend(other.nodes.iter().copied());
        let counts = match (&mut self.repeats, &other.repeats) {
            (Some(mine), Some(theirs)) => Some((mine, theirs)),
            _ => None,
        };
        match counts {
            Some((mine, theirs)) => {
                for (key, slots) in &other.groups {
                    let set = self.groups.entry(*key).or_default();
                    // A slot both list gains the other's first reference as a repeat.
                    for slot in set.intersection(slots) {
                        let n = mine.entry((*key, slot)).or_default();
                        *n = n.saturating_add(1);
                    }
                    set.union_with(slots);
                }
                for (at, n) in theirs {
                    let mine = mine.entry(*at).or_default();
                    *mine = mine.saturating_add(*n);
                }
            }
            None => {
                self.repeats = None;
                for (key, slots) in &other.groups {
                    self.groups.entry(*key).or_default().union_with(slots);
                }
            }
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
        let repeats = self.repeats.as_ref().map_or(0, BTreeMap::len);
        let mut e = Encoder::with_capacity(
            24 + self.nodes.len() * 8 + self.groups.len() * 12 + repeats * 14,
        );
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
        let Some(repeats) = &self.repeats else {
            return envelope::seal(MAGIC, &e.finish());
        };
        debug_assert_eq!(self.stale_slots, 0, "a counted summary is exact");
        e.u32(u32::try_from(repeats.len()).expect("repeats fit u32"));
        for ((key, slot), n) in repeats {
            e.u64(*key);
            e.u16(*slot);
            e.u32(*n);
        }
        envelope::seal_version(MAGIC, COUNTED, &e.finish())
    }

    pub fn decode(data: &[u8]) -> FormatResult<GroupSummary> {
        let (version, payload) = envelope::open_version(MAGIC, data, WHAT, COUNTED)?;
        let mut d = Decoder::new(payload, WHAT);
        let mut s = GroupSummary {
            stale_slots: d.u64()?,
            ..Default::default()
        };
        // Lists are checked ascending and gathered, then built into maps in bulk (one pass,
        // where an insert each walked the tree from its root).
        let n = d.u32()?;
        let mut last = None;
        let mut nodes = Vec::with_capacity(n.min(1 << 20) as usize);
        for _ in 0..n {
            let k = d.u64()?;
            ascending(&mut last, k, "node")?;
            nodes.push(k);
        }
        s.nodes = nodes.into_iter().collect();
        let g = d.u32()?;
        let mut last = None;
        let mut groups = Vec::with_capacity(g.min(1 << 20) as usize);
        for _ in 0..g {
            let k = d.u64()?;
            ascending(&mut last, k, "group")?;
            groups.push((k, SlotSet::decode_from(&mut d, WHAT)?));
        }
        s.groups = groups.into_iter().collect();
        if version == COUNTED {
            if s.stale_slots != 0 {
                return Err(FormatError::invalid(
                    WHAT,
                    "a counted summary with stale slots",
                ));
            }
            let mut repeats = Vec::new();
            let mut last = None;
            for _ in 0..d.u32()? {
                let at = (d.u64()?, d.u16()?);
                let n = d.u32()?;
                if last.is_some_and(|l| l >= at) {
                    return Err(FormatError::invalid(WHAT, "repeats not strictly ascending"));
                }
                last = Some(at);
                if n == 0 {
                    return Err(FormatError::invalid(WHAT, "0 repeats listed"));
                }
                if !s
                    .groups
                    .get(&at.0)
                    .is_some_and(|g| g.contains(usize::from(at.1)))
                {
                    return Err(FormatError::invalid(
                        WHAT,
                        format!("repeats of slot {} of an unlisted group key or slot", at.1),
                    ));
                }
                repeats.push((at, n));
            }
            s.repeats = Some(repeats.into_iter().collect());
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

    /// A leaf for the tests below: its group runs, by group name.
    type Leaf = Vec<(u8, u16, u16)>;

    fn counted_of<'a>(leaves: impl IntoIterator<Item = &'a Leaf>) -> GroupSummary {
        let mut s = GroupSummary::counted();
        for leaf in leaves {
            for &(g, first, count) in leaf {
                s.add_run(&Id::of(&[g]), first, count);
            }
        }
        s
    }

    #[test]
    fn counted_round_trip_and_references() {
        let g = Id::of(&[1]);
        let mut s = GroupSummary::counted();
        s.add_node(&Id::of(b"n"));
        s.add_run(&g, 0, 4);
        s.add_run(&g, 2, 4);
        s.add_run(&g, 3, 1);
        assert_eq!(s.slots(&g).unwrap().runs(), vec![(0, 6)]);
        let repeats = s.repeats.clone().unwrap();
        assert_eq!(
            repeats.into_iter().collect::<Vec<_>>(),
            vec![((key_of(&g), 2), 1), ((key_of(&g), 3), 2)]
        );
        let raw = s.encode();
        assert_eq!(u32::from_le_bytes(raw[8..12].try_into().unwrap()), COUNTED);
        assert_eq!(GroupSummary::decode(&raw).unwrap(), s);

        // Removing the references one by one empties the table; one more is refused.
        s.remove_run(&g, 2, 4).unwrap();
        s.remove_run(&g, 3, 1).unwrap();
        assert_eq!(s.slots(&g).unwrap().runs(), vec![(0, 4)]);
        s.remove_run(&g, 0, 4).unwrap();
        assert!(s.slots(&g).is_none() && s.repeats.as_ref().unwrap().is_empty());
        assert_eq!(
            s.remove_run(&g, 1, 1),
            Err(NotReferenced {
                group: key_of(&g),
                slot: 1
            })
        );
    }

    #[test]
    fn counted_decoding_refuses_what_a_writer_never_makes() {
        let g = Id::of(&[1]);
        let mut s = GroupSummary::counted();
        s.add_run(&g, 0, 2);
        s.add_run(&g, 1, 1);
        let payload = envelope::open_version(MAGIC, &s.encode(), WHAT, COUNTED)
            .unwrap()
            .1
            .to_vec();
        let reseal = |p: &[u8]| envelope::seal_version(MAGIC, COUNTED, p);
        let refused = |p: &[u8], what: &str| {
            let err = GroupSummary::decode(&reseal(p)).unwrap_err().to_string();
            assert!(err.contains(what), "{err}");
        };
        // stale 8 | nodes 4 | groups 4 + 8 + 2 + 1 | repeats 4 + (8 + 2 + 4)
        let (slot, count) = (payload.len() - 6, payload.len() - 4);
        let mut p = payload.clone();
        p[..8].copy_from_slice(&1u64.to_le_bytes());
        refused(&p, "stale slots");
        let mut p = payload.clone();
        p[count..].copy_from_slice(&0u32.to_le_bytes());
        refused(&p, "0 repeats");
        let mut p = payload.clone();
        p[slot..count].copy_from_slice(&5u16.to_le_bytes());
        refused(&p, "unlisted group key or slot");
        // Two entries for one slot.
        let mut p = payload.clone();
        let entry = p[p.len() - 14..].to_vec();
        p.extend_from_slice(&entry);
        let at = p.len() - 32;
        p[at..at + 4].copy_from_slice(&2u32.to_le_bytes());
        refused(&p, "not strictly ascending");
        // A version 1 summary of the same table is read uncounted.
        let v1 = envelope::seal(MAGIC, &payload[..payload.len() - 18]);
        let back = GroupSummary::decode(&v1).unwrap();
        assert!(!back.is_counted() && back.groups == s.groups);
    }

    proptest::proptest! {
        /// A base tree's counted summary, minus the leaf occurrences a new tree drops, plus
        /// the ones it adds, is exactly the new tree's counted summary — the algebra a
        /// commit uses to summarize leaves it reuses without reading them.
        #[test]
        fn counted_summaries_subtract_and_add_exactly(
            leaves in proptest::collection::vec(
                proptest::collection::vec((0u8..4, 0u16..80, 1u16..20), 1..4), 1..8),
            base in proptest::collection::vec(0usize..8, 0..12),
            new in proptest::collection::vec(0usize..8, 0..12),
        ) {
            let leaf = |i: &usize| &leaves[i % leaves.len()];
            let mut s = counted_of(base.iter().map(leaf));
            // Multiset differences of the occurrences, by leaf.
            let mut n_base = [0i32; 8];
            let mut n_new = [0i32; 8];
            for i in &base { n_base[i % leaves.len()] += 1; }
            for i in &new { n_new[i % leaves.len()] += 1; }
            for (i, (b, n)) in n_base.iter().zip(&n_new).enumerate().take(leaves.len()) {
                for _ in 0..(b - n).max(0) {
                    for &(g, first, count) in &leaves[i] {
                        s.remove_run(&Id::of(&[g]), first, count).unwrap();
                    }
                }
            }
            // The added occurrences arrive as another counted summary, merged in.
            let mut added = GroupSummary::counted();
            for (i, (b, n)) in n_base.iter().zip(&n_new).enumerate().take(leaves.len()) {
                for _ in 0..(n - b).max(0) {
                    for &(g, first, count) in &leaves[i] {
                        added.add_run(&Id::of(&[g]), first, count);
                    }
                }
            }
            s.merge(&added);
            let exact = counted_of(new.iter().map(leaf));
            proptest::prop_assert_eq!(&s, &exact);
            proptest::prop_assert_eq!(GroupSummary::decode(&s.encode()).unwrap(), exact);
        }
    }
}

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
//! the ones it built, and stay exact without reading the leaves it kept. Version 1 (older builds
//! wrote it) carries no counts: `stale slots` counts slots the table may list
//! without the tree using them (a superset, kept by writers of that time within a bound).

use std::borrow::Cow;

use crate::codec::{Decoder, Encoder};
use crate::slots::SlotSet;
use crate::{envelope, FormatError, FormatResult, Id};

mod builder;
mod delta;
mod table;
pub use builder::SummaryBuilder;
pub use delta::{
    base_position, chain_positions, delta_pays, Before, GroupState, Resolved, SummaryDelta,
    MAX_POSITION,
};
use table::GroupTable;

const MAGIC: &[u8; 8] = b"CRNSUM2\0";
const WHAT: &str = "group summary";
/// The envelope version of a counted summary.
const COUNTED: u32 = 2;

/// The key of an id in a summary: its first 8 bytes, little-endian.
pub fn key_of(id: &Id) -> u64 {
    id.prefix_u64()
}

/// References to a listed slot beyond the first: ((group key, slot), repeats ≥ 1).
pub type Repeat = ((u64, u16), u32);

/// What one tree (or, merged, several) uses, held flat: sorted arrays of keys, and a slot
/// set per group inline beside its key (16 bytes a group, `table.rs`; maps of trees took about 90), for a commit holds summaries as large as its image: its
/// own, and at the end its parent's. Built with a [`SummaryBuilder`], which merges changes
/// in sorted batches.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct GroupSummary {
    /// Slots listed that the tree may not use any more (see the module doc; 0 if counted).
    pub stale_slots: u64,
    /// Node keys, ascending, distinct.
    nodes: Vec<u64>,
    /// Group keys, ascending, distinct, each with a non-empty slot set.
    groups: GroupTable,
    /// Ascending by (group key, slot), each of a listed slot, when the summary is counted
    /// (`None`: a version 1 summary, or a union of trees). A count that reaches `u32::MAX`
    /// sticks there: the slot stays listed (a leak, never a loss).
    repeats: Option<Vec<Repeat>>,
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
    /// An empty counted summary.
    pub fn counted() -> GroupSummary {
        GroupSummary {
            repeats: Some(Vec::new()),
            ..GroupSummary::default()
        }
    }

    /// An uncounted summary of these lists (ascending, distinct keys; non-empty sets).
    pub(crate) fn uncounted(nodes: Vec<u64>, groups: Vec<(u64, SlotSet)>) -> GroupSummary {
        debug_assert!(nodes.windows(2).all(|w| w[0] < w[1]));
        debug_assert!(groups.windows(2).all(|w| w[0].0 < w[1].0));
        debug_assert!(groups.iter().all(|(_, s)| !s.is_empty()));
        GroupSummary {
            stale_slots: 0,
            nodes,
            groups: GroupTable::from_sorted(groups),
            repeats: None,
        }
    }

    /// Whether the summary counts references (and so is exact: see the module doc).
    pub fn is_counted(&self) -> bool {
        self.repeats.is_some() && self.stale_slots == 0
    }

    /// Drops the counts: what the tree uses stays listed, not how often (a version 1
    /// summary's form).
    pub fn forget_counts(&mut self) {
        self.repeats = None;
    }

    /// Forgets the nodes (a base's summary whose leaf references a new tree takes over).
    pub fn clear_nodes(&mut self) {
        self.nodes = Vec::new();
    }

    /// The node keys, ascending.
    pub fn nodes(&self) -> &[u64] {
        &self.nodes
    }

    /// The groups listed by key, ascending, with the slots used of each.
    pub fn groups(&self) -> impl ExactSizeIterator<Item = (u64, Cow<'_, SlotSet>)> + '_ {
        self.groups.iter()
    }

    /// The repeats, ascending (`None`: not counted).
    pub fn repeats(&self) -> Option<&[Repeat]> {
        self.repeats.as_deref()
    }

    /// Whether node `id` may be used (false: certainly not).
    pub fn has_node(&self, id: &Id) -> bool {
        self.has_node_key(key_of(id))
    }

    pub fn has_node_key(&self, key: u64) -> bool {
        self.nodes.binary_search(&key).is_ok()
    }

    /// The slots of group `id` that may be used (`None`: certainly none).
    pub fn slots(&self, group: &Id) -> Option<Cow<'_, SlotSet>> {
        self.slots_of_key(key_of(group))
    }

    pub fn slots_of_key(&self, key: u64) -> Option<Cow<'_, SlotSet>> {
        self.groups.get(key)
    }

    /// Slots listed, over every group.
    pub fn slot_count(&self) -> u64 {
        self.groups.slot_count()
    }

    /// Adds everything `other` lists (the union of two trees' use), in one pass over both.
    /// The result is counted only if both are, with the references of both.
    pub fn merge(&mut self, other: &GroupSummary) {
        self.stale_slots += other.stale_slots;
        self.nodes = union_sorted(std::mem::take(&mut self.nodes), &other.nodes);
        let counted = self.repeats.is_some() && other.repeats.is_some();
        let mine_repeats = self.repeats.take().unwrap_or_default();
        let theirs_repeats = other.repeats.as_deref().unwrap_or_default();
        let (mut at_mine, mut at_theirs) = (0, 0);
        let mut groups = GroupTable::with_capacity(self.groups.len().max(other.groups.len()));
        let mut repeats = Vec::new();
        let mut theirs = other.groups.iter().peekable();
        let mine_groups = std::mem::take(&mut self.groups);
        for (key, set) in mine_groups.iter() {
            let mut set = set.into_owned();
            while let Some((k, s)) = theirs.next_if(|(k, _)| *k < key) {
                groups.push(k, s.into_owned());
                if counted {
                    repeats.extend_from_slice(of_key(theirs_repeats, &mut at_theirs, k));
                }
            }
            let mine = of_key(&mine_repeats, &mut at_mine, key);
            match theirs.next_if(|(k, _)| *k == key) {
                None if counted => repeats.extend_from_slice(mine),
                None => {}
                Some((_, other_set)) => {
                    if counted {
                        // A slot both list gains the other's first reference as a repeat.
                        let mut extra: Vec<(u16, u32)> =
                            mine.iter().map(|r| (r.0 .1, r.1)).collect();
                        let their = of_key(theirs_repeats, &mut at_theirs, key);
                        extra.extend(their.iter().map(|r| (r.0 .1, r.1)));
                        extra.extend(set.intersection(&other_set).map(|s| (s, 1)));
                        extra.sort_unstable_by_key(|e| e.0);
                        for run in extra.chunk_by(|a, b| a.0 == b.0) {
                            let n = run.iter().fold(0u32, |n, e| n.saturating_add(e.1));
                            repeats.push(((key, run[0].0), n));
                        }
                    }
                    set.union_with(&other_set);
                }
            }
            groups.push(key, set);
        }
        for (k, s) in theirs {
            groups.push(k, s.into_owned());
            if counted {
                repeats.extend_from_slice(of_key(theirs_repeats, &mut at_theirs, k));
            }
        }
        self.groups = groups;
        self.repeats = counted.then_some(repeats);
    }

    pub fn encode(&self) -> Vec<u8> {
        let repeats = self.repeats.as_ref().map_or(0, Vec::len);
        let mut e = Encoder::with_capacity(
            24 + self.nodes.len() * 8 + self.groups.len() * 12 + repeats * 14,
        );
        e.u64(self.stale_slots);
        e.u32(u32::try_from(self.nodes.len()).expect("nodes fit u32"));
        for k in &self.nodes {
            e.u64(*k);
        }
        e.u32(u32::try_from(self.groups.len()).expect("groups fit u32"));
        for (k, slots) in self.groups.iter() {
            e.u64(k);
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
        let n = d.u32()?;
        let mut last = None;
        s.nodes.reserve(n.min(1 << 20) as usize);
        for _ in 0..n {
            let k = d.u64()?;
            ascending(&mut last, k, "node")?;
            s.nodes.push(k);
        }
        let g = d.u32()?;
        let mut last = None;
        s.groups.reserve(g.min(1 << 20) as usize);
        for _ in 0..g {
            let k = d.u64()?;
            ascending(&mut last, k, "group")?;
            s.groups.push(k, SlotSet::decode_from(&mut d, WHAT)?);
        }
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
                    .slots_of_key(at.0)
                    .is_some_and(|g| g.contains(usize::from(at.1)))
                {
                    return Err(FormatError::invalid(
                        WHAT,
                        format!("repeats of slot {} of an unlisted group key or slot", at.1),
                    ));
                }
                repeats.push((at, n));
            }
            s.repeats = Some(repeats);
        }
        d.finish()?;
        Ok(s)
    }
}

/// A reference summary as stored under `summaries/<root>`: whole, or as a delta from the
/// summary of another tree (`delta.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredSummary {
    Full(GroupSummary),
    Delta(SummaryDelta),
}

impl StoredSummary {
    /// Decodes either form, told apart by the envelope's magic.
    pub fn decode(data: &[u8]) -> FormatResult<StoredSummary> {
        if data.starts_with(delta::DELTA_MAGIC) {
            SummaryDelta::decode(data).map(StoredSummary::Delta)
        } else {
            GroupSummary::decode(data).map(StoredSummary::Full)
        }
    }
}

/// The repeats of group `key` in `repeats` (ascending), from `at` on; `at` moves past them.
/// Keys are asked in ascending order.
fn of_key<'a>(repeats: &'a [Repeat], at: &mut usize, key: u64) -> &'a [Repeat] {
    while repeats.get(*at).is_some_and(|r| r.0 .0 < key) {
        *at += 1;
    }
    let start = *at;
    while repeats.get(*at).is_some_and(|r| r.0 .0 == key) {
        *at += 1;
    }
    &repeats[start..*at]
}

/// The union of two ascending lists of distinct keys.
fn union_sorted(mine: Vec<u64>, theirs: &[u64]) -> Vec<u64> {
    if theirs.is_empty() {
        return mine;
    }
    let mut out = Vec::with_capacity(mine.len() + theirs.len());
    let mut theirs = theirs.iter().copied().peekable();
    for k in mine {
        while let Some(t) = theirs.next_if(|t| *t < k) {
            out.push(t);
        }
        theirs.next_if_eq(&k);
        out.push(k);
    }
    out.extend(theirs);
    out
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
    use std::collections::{BTreeMap, BTreeSet};

    use super::*;

    fn built(b: SummaryBuilder) -> GroupSummary {
        b.finish().expect("only adds")
    }

    #[test]
    fn round_trip_merge_and_canonical_order() {
        let (g1, g2) = (Id::of(b"g1"), Id::of(b"g2"));
        let mut a = SummaryBuilder::uncounted();
        a.add_node(&Id::of(b"n1"));
        a.add_run(&g1, 0, 3);
        a.add_run(&g2, 10, 1);
        a.add_run(&g2, 0, 0);
        let mut a = built(a);
        let mut b = SummaryBuilder::from(GroupSummary {
            stale_slots: 2,
            ..Default::default()
        });
        b.add_node(&Id::of(b"n2"));
        b.add_run(&g1, 5, 1);
        a.merge(&built(b));
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
        let mut s = SummaryBuilder::counted();
        for leaf in leaves {
            for &(g, first, count) in leaf {
                s.add_run(&Id::of(&[g]), first, count);
            }
        }
        built(s)
    }

    #[test]
    fn counted_round_trip_and_references() {
        let g = Id::of(&[1]);
        let mut s = SummaryBuilder::counted();
        s.add_node(&Id::of(b"n"));
        s.add_run(&g, 0, 4);
        s.add_run(&g, 2, 4);
        s.add_run(&g, 3, 1);
        let s = built(s);
        assert_eq!(s.slots(&g).unwrap().runs(), vec![(0, 6)]);
        assert_eq!(
            s.repeats().unwrap(),
            [((key_of(&g), 2), 1), ((key_of(&g), 3), 2)]
        );
        let raw = s.encode();
        assert_eq!(u32::from_le_bytes(raw[8..12].try_into().unwrap()), COUNTED);
        assert_eq!(GroupSummary::decode(&raw).unwrap(), s);

        // Removing the references one by one empties the table; one more is refused.
        let mut b = SummaryBuilder::from(s);
        b.remove_run(&g, 2, 4);
        b.remove_run(&g, 3, 1);
        let s = b.finish().unwrap();
        assert_eq!(s.slots(&g).unwrap().runs(), vec![(0, 4)]);
        let mut b = SummaryBuilder::from(s);
        b.remove_run(&g, 0, 4);
        let s = b.finish().unwrap();
        assert!(s.slots(&g).is_none() && s.repeats().unwrap().is_empty());
        let mut b = SummaryBuilder::from(s);
        b.remove_run(&g, 1, 1);
        assert_eq!(
            b.finish(),
            Err(NotReferenced {
                group: key_of(&g),
                slot: 1
            })
        );
    }

    #[test]
    fn counted_decoding_refuses_what_a_writer_never_makes() {
        let g = Id::of(&[1]);
        let mut s = SummaryBuilder::counted();
        s.add_run(&g, 0, 2);
        s.add_run(&g, 1, 1);
        let s = built(s);
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

    /// The summary as maps, changed one reference at a time: what the flat summary and its
    /// batched builder must equal.
    #[derive(Debug, Default, Clone, PartialEq)]
    struct Model {
        nodes: BTreeSet<u64>,
        groups: BTreeMap<u64, BTreeSet<u16>>,
        repeats: BTreeMap<(u64, u16), u32>,
    }

    impl Model {
        fn add(&mut self, key: u64, first: u16, count: u16) {
            for slot in first..first + count {
                if !self.groups.entry(key).or_default().insert(slot) {
                    let n = self.repeats.entry((key, slot)).or_default();
                    *n = n.saturating_add(1);
                }
            }
        }

        fn remove(&mut self, key: u64, first: u16, count: u16) -> Result<(), NotReferenced> {
            for slot in first..first + count {
                match self.repeats.get_mut(&(key, slot)) {
                    Some(n) if *n > 1 => *n -= 1,
                    Some(_) => {
                        self.repeats.remove(&(key, slot));
                    }
                    None if self.groups.get_mut(&key).is_some_and(|s| s.remove(&slot)) => {
                        if self.groups[&key].is_empty() {
                            self.groups.remove(&key);
                        }
                    }
                    None => return Err(NotReferenced { group: key, slot }),
                }
            }
            Ok(())
        }

        fn matches(&self, s: &GroupSummary) -> bool {
            let groups: BTreeMap<u64, BTreeSet<u16>> = s
                .groups()
                .map(|(k, set)| (k, set.iter().collect()))
                .collect();
            let repeats: BTreeMap<(u64, u16), u32> = s.repeats().unwrap().iter().copied().collect();
            s.nodes().iter().copied().collect::<BTreeSet<_>>() == self.nodes
                && groups == self.groups
                && repeats == self.repeats
        }
    }

    /// (remove?, group 0..6, first, count) or a node (group ≥ 6).
    type Change = (bool, u8, u16, u16);

    fn changes() -> impl proptest::strategy::Strategy<Value = Vec<Change>> {
        proptest::collection::vec((proptest::bool::ANY, 0u8..8, 0u16..100, 0u16..40), 0..60)
    }

    proptest::proptest! {
        /// Changes gathered in batches of any size give what applying each at once gives:
        /// the same slots, repeats and nodes, or a refused reference.
        #[test]
        fn batched_changes_equal_changes_one_at_a_time(
            base in changes(), more in changes(), batch in 1usize..8,
        ) {
            let mut model = Model::default();
            let mut b = SummaryBuilder::counted();
            b.min_batch = batch;
            for &(_, g, first, count) in &base {
                if g >= 6 {
                    model.nodes.insert(key_of(&Id::of(&[g, first as u8])));
                    b.add_node(&Id::of(&[g, first as u8]));
                } else {
                    model.add(key_of(&Id::of(&[g])), first, count);
                    b.add_run(&Id::of(&[g]), first, count);
                }
            }
            let s = b.finish().unwrap();
            proptest::prop_assert!(model.matches(&s));
            proptest::prop_assert_eq!(GroupSummary::decode(&s.encode()).unwrap(), s.clone());

            let mut b = SummaryBuilder::from(s);
            b.min_batch = batch;
            let mut expected = Ok(());
            for &(remove, g, first, count) in &more {
                let key = key_of(&Id::of(&[g % 6]));
                match remove {
                    true => {
                        if expected.is_ok() {
                            expected = model.remove(key, first, count);
                        }
                        b.remove_run(&Id::of(&[g % 6]), first, count);
                    }
                    false => {
                        if expected.is_ok() {
                            model.add(key, first, count);
                        }
                        b.add_run(&Id::of(&[g % 6]), first, count);
                    }
                }
            }
            match (b.finish(), expected) {
                (Ok(s), Ok(())) => proptest::prop_assert!(model.matches(&s)),
                // Which refused reference is named depends on the batches (one batch's
                // changes apply by group key).
                (Err(_), Err(_)) => {}
                (got, want) => proptest::prop_assert!(false, "{got:?} vs {want:?}"),
            }
        }

        /// Merging two counted summaries adds their references: the same as one summary of
        /// both trees' runs.
        #[test]
        fn a_merge_adds_references(a in changes(), b in changes()) {
            let adds = |changes: &[Change], into: &mut SummaryBuilder| {
                for &(_, g, first, count) in changes {
                    into.add_run(&Id::of(&[g]), first, count);
                }
            };
            let (mut sa, mut sb, mut both) =
                (SummaryBuilder::counted(), SummaryBuilder::counted(), SummaryBuilder::counted());
            adds(&a, &mut sa);
            adds(&b, &mut sb);
            adds(&a, &mut both);
            adds(&b, &mut both);
            let mut merged = built(sa);
            merged.merge(&built(sb));
            proptest::prop_assert_eq!(merged, built(both));
        }

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
            let mut s = SummaryBuilder::from(counted_of(base.iter().map(leaf)));
            // Multiset differences of the occurrences, by leaf.
            let mut n_base = [0i32; 8];
            let mut n_new = [0i32; 8];
            for i in &base { n_base[i % leaves.len()] += 1; }
            for i in &new { n_new[i % leaves.len()] += 1; }
            for (i, (b, n)) in n_base.iter().zip(&n_new).enumerate().take(leaves.len()) {
                for _ in 0..(b - n).max(0) {
                    for &(g, first, count) in &leaves[i] {
                        s.remove_run(&Id::of(&[g]), first, count);
                    }
                }
            }
            let mut s = s.finish().unwrap();
            // The added occurrences arrive as another counted summary, merged in.
            let mut added = SummaryBuilder::counted();
            for (i, (b, n)) in n_base.iter().zip(&n_new).enumerate().take(leaves.len()) {
                for _ in 0..(n - b).max(0) {
                    for &(g, first, count) in &leaves[i] {
                        added.add_run(&Id::of(&[g]), first, count);
                    }
                }
            }
            s.merge(&built(added));
            let exact = counted_of(new.iter().map(leaf));
            proptest::prop_assert_eq!(&s, &exact);
            proptest::prop_assert_eq!(GroupSummary::decode(&s.encode()).unwrap(), exact);
        }
    }
}

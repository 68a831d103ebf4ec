//! Merged reference summaries of format 2 (`gc/merged/<id>`): for one image, how many of a
//! set of trees use each manifest node key and each slot of each group key. Fast deletion
//! reads one per image instead of one reference summary (`group_summary`) per live tree: a
//! tree no longer live is subtracted (its own summary read), a tree committed since is added,
//! and the result is written back for the next GC.
//!
//! The counts are of *trees*, not of references inside a tree: a tree's summary lists a node
//! key or a slot once, and adding the tree adds one to each. Each tree is listed with the
//! content id of the summary that was added, and a tree is only subtracted with a summary of
//! the same id: the counts then stay exactly those of the trees listed, so a slot whose count
//! reaches 0 is used by none of them (a summary that was rebuilt or replaced since makes GC
//! build the merge again from the trees' summaries instead).
//!
//! ```text
//! envelope "CRNMSUM\0", version 1 or 2 (sealed as a summary in an encrypted repository)
//! payload  = image (str16)
//!          | tree count T (u32) | T × (root id (32) | summary id (32)        ascending roots
//!                                        [version 2: | n (u8, 0 ..= 20) | n × root key (u64)])
//!          | node count N (u32) | N × (node key (u64) | trees (u32, 1 ..= T))  ascending keys
//!          | group count G (u32) | G × (group key (u64) | slot set | common (u32, 1 ..= T)
//!                                    | exceptions E (u16)
//!                                    | E × (slot (u16) | trees (u32, 1 ..= T, ≠ common)))
//! ```
//! A chain names, by key (`group_summary::key_of`), the summaries a counted tree's summary,
//! stored as a delta, is resolved through (`group_summary::delta`): GC keeps those even when
//! their own trees are gone (two roots with one key only keep a summary longer).
//! Version 1 (written before deltas) has no chains: every summary it counts was whole.
//! Group keys ascend; a group's listed slots are used by `common` trees each except the
//! exceptions, which name listed slots in ascending order. The slot set is `group_summary`'s.

use std::collections::{BTreeMap, BTreeSet};

use crate::codec::{Decoder, Encoder};
use crate::group_summary::{key_of, GroupSummary};
use crate::slots::SlotSet;
use crate::{envelope, FormatError, FormatResult, Id};

const MAGIC: &[u8; 8] = b"CRNMSUM\0";
/// The envelope version with chains.
const WITH_CHAINS: u32 = 2;
/// The longest chain a delta can have (`group_summary::MAX_POSITION` is 2^20).
const MAX_CHAIN: usize = 20;
const WHAT: &str = "merged summary";

/// The content id of a tree's summary, as a merge records it: the id of its canonical
/// encoding (so the same summary read from a plain or a sealed object has one id).
pub fn summary_id(summary: &GroupSummary) -> Id {
    Id::of(&summary.encode())
}

/// How many trees use each listed slot of one group.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SlotCounts {
    slots: SlotSet,
    /// The count of every listed slot not in `exceptions`.
    common: u32,
    /// (slot, count), ascending, each slot listed, no count equal to `common`.
    exceptions: Vec<(u16, u32)>,
}

impl SlotCounts {
    /// Every listed slot with its count, ascending.
    fn dense(&self) -> Vec<(u16, u32)> {
        let mut exceptions = self.exceptions.iter().peekable();
        self.slots
            .iter()
            .map(|s| match exceptions.next_if(|(e, _)| *e == s) {
                Some(&(_, n)) => (s, n),
                None => (s, self.common),
            })
            .collect()
    }

    /// The canonical form of `dense` (slots ascending, counts ≥ 1): the most frequent count
    /// is the common one (the smaller on a tie). `None` when no slot is left.
    fn from_dense(dense: &[(u16, u32)]) -> Option<SlotCounts> {
        let mut frequency: BTreeMap<u32, usize> = BTreeMap::new();
        for (_, n) in dense {
            *frequency.entry(*n).or_default() += 1;
        }
        let common = frequency
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))
            .map(|(n, _)| *n)?;
        let mut slots = SlotSet::default();
        for (s, _) in dense {
            slots.insert(*s);
        }
        Some(SlotCounts {
            slots,
            common,
            exceptions: dense
                .iter()
                .filter(|(_, n)| *n != common)
                .copied()
                .collect(),
        })
    }

    /// One more tree uses `used`.
    fn add(&mut self, used: &SlotSet) {
        if self.exceptions.is_empty() && self.slots == *used {
            self.common = self.common.saturating_add(1);
            return;
        }
        let mut counts: BTreeMap<u16, u32> = self.dense().into_iter().collect();
        for s in used.iter() {
            let n = counts.entry(s).or_default();
            *n = n.saturating_add(1);
        }
        let dense: Vec<_> = counts.into_iter().collect();
        *self = SlotCounts::from_dense(&dense).expect("a slot was added");
    }

    /// One tree that used `used` no longer counts; `Err(slot)` if a slot it names has no
    /// count (the caller drops the merge). `Ok(false)` when no slot is left.
    fn remove(&mut self, used: &SlotSet) -> Result<bool, u16> {
        if self.exceptions.is_empty() && self.slots == *used {
            self.common -= 1;
            return Ok(self.common > 0);
        }
        let mut counts: BTreeMap<u16, u32> = self.dense().into_iter().collect();
        for s in used.iter() {
            match counts.get_mut(&s) {
                Some(1) => {
                    counts.remove(&s);
                }
                Some(n) => *n -= 1,
                None => return Err(s),
            }
        }
        let dense: Vec<_> = counts.into_iter().collect();
        match SlotCounts::from_dense(&dense) {
            Some(c) => {
                *self = c;
                Ok(true)
            }
            None => Ok(false),
        }
    }
}

/// A tree could not be subtracted from a merge: the merge does not describe it as given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotMerged(pub String);

impl std::fmt::Display for NotMerged {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a set of trees of one image use, counted per tree. Held as sorted arrays (about
/// 60 bytes a group, where maps took twice that and a GC at 1,000 versions spent more time
/// building, walking and dropping them than on anything else it did with a merge).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct MergedSummary {
    pub image: String,
    /// (root id, the id of the summary added for it ([`summary_id`])), ascending roots.
    trees: Vec<(Id, Id)>,
    /// The chain (root keys) of each counted tree whose summary is stored as a delta.
    chains: BTreeMap<Id, Vec<u64>>,
    /// (node key, trees), ascending keys.
    nodes: Vec<(u64, u32)>,
    /// (group key, slot counts), ascending keys.
    groups: Vec<(u64, SlotCounts)>,
}

impl MergedSummary {
    pub fn new(image: &str) -> MergedSummary {
        MergedSummary {
            image: image.to_string(),
            ..MergedSummary::default()
        }
    }

    /// The roots of the trees counted, ascending.
    pub fn trees(&self) -> impl Iterator<Item = &Id> {
        self.trees.iter().map(|(root, _)| root)
    }

    pub fn covers(&self, root: &Id) -> bool {
        self.tree_at(root).is_ok()
    }

    fn tree_at(&self, root: &Id) -> Result<usize, usize> {
        self.trees.binary_search_by_key(root, |(r, _)| *r)
    }

    pub fn tree_count(&self) -> usize {
        self.trees.len()
    }

    /// Counts the tree rooted at `root`, whose summary is `summary`; false (and nothing
    /// changes) if it is counted already. Keys already counted are found by binary search
    /// from the last one found (both lists ascend) and counted in place; new keys are merged
    /// in with one pass at the end.
    pub fn add_tree(&mut self, root: &Id, summary: &GroupSummary, chain: &[Id]) -> bool {
        let at = match self.tree_at(root) {
            Ok(_) => return false,
            Err(at) => at,
        };
        self.trees.insert(at, (*root, summary_id(summary)));
        if !chain.is_empty() {
            self.chains
                .insert(*root, chain.iter().map(key_of).collect());
        }
        let mut fresh = Vec::new();
        let mut from = 0;
        for &key in summary.nodes() {
            match find_from(&self.nodes, &mut from, key) {
                Some(i) => self.nodes[i].1 = self.nodes[i].1.saturating_add(1),
                None => fresh.push((key, 1)),
            }
        }
        merge_in(&mut self.nodes, fresh);
        let mut fresh = Vec::new();
        let mut from = 0;
        for (key, used) in summary.groups() {
            match find_from(&self.groups, &mut from, key) {
                Some(i) => self.groups[i].1.add(&used),
                None => fresh.push((
                    key,
                    SlotCounts {
                        slots: used.into_owned(),
                        common: 1,
                        exceptions: Vec::new(),
                    },
                )),
            }
        }
        merge_in(&mut self.groups, fresh);
        true
    }

    /// Stops counting the tree rooted at `root`, given the same summary [`add_tree`] was
    /// given for it (checked by its id). On an error the merge is partly changed: the caller
    /// drops it.
    ///
    /// [`add_tree`]: MergedSummary::add_tree
    pub fn remove_tree(&mut self, root: &Id, summary: &GroupSummary) -> Result<(), NotMerged> {
        match self.tree_at(root) {
            Err(_) => return Err(NotMerged(format!("tree {root} is not counted"))),
            Ok(at) if self.trees[at].1 != summary_id(summary) => {
                return Err(NotMerged(format!(
                    "the summary of tree {root} is not the one counted"
                )))
            }
            Ok(at) => {
                self.trees.remove(at);
                self.chains.remove(root);
            }
        }
        // A count that reaches 0 is left at 0 and swept in one pass at the end.
        let (mut from, mut emptied) = (0, false);
        for &key in summary.nodes() {
            let Some(i) = find_from(&self.nodes, &mut from, key) else {
                return Err(NotMerged(format!("node key {key:016x} is not counted")));
            };
            self.nodes[i].1 -= 1;
            emptied |= self.nodes[i].1 == 0;
        }
        if emptied {
            self.nodes.retain(|(_, n)| *n > 0);
        }
        let (mut from, mut emptied) = (0, false);
        for (key, used) in summary.groups() {
            let Some(i) = find_from(&self.groups, &mut from, key) else {
                return Err(NotMerged(format!("group key {key:016x} is not counted")));
            };
            match self.groups[i].1.remove(&used) {
                Ok(true) => {}
                Ok(false) => {
                    self.groups[i].1.common = 0;
                    emptied = true;
                }
                Err(slot) => {
                    return Err(NotMerged(format!(
                        "slot {slot} of group key {key:016x} is not counted"
                    )))
                }
            }
        }
        if emptied {
            self.groups.retain(|(_, c)| c.common > 0);
        }
        Ok(())
    }

    /// The keys of the roots the counted trees' summaries are resolved through.
    pub fn chain_keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.chains.values().flatten().copied()
    }

    /// Whether a counted tree uses the node of key `key` (`group_summary::key_of`).
    pub fn has_node_key(&self, key: u64) -> bool {
        self.nodes.binary_search_by_key(&key, |(k, _)| *k).is_ok()
    }

    /// The slots of the group of key `key` that counted trees use (`None`: none).
    pub fn slots_of_key(&self, key: u64) -> Option<&SlotSet> {
        let at = self.groups.binary_search_by_key(&key, |(k, _)| *k).ok()?;
        Some(&self.groups[at].1.slots)
    }

    /// The node keys counted, ascending.
    pub fn node_keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.nodes.iter().map(|(k, _)| *k)
    }

    /// The group keys counted, ascending.
    pub fn group_keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.groups.iter().map(|(k, _)| *k)
    }

    /// Adds what the counted trees use to `union` (node keys and slots, without counts).
    pub fn union_into(&self, union: &mut GroupSummary) {
        union.merge(&GroupSummary::uncounted(
            self.node_keys().collect(),
            self.groups
                .iter()
                .map(|(k, c)| (*k, c.slots.clone()))
                .collect(),
        ));
    }

    /// What the trees of every merge in `merges` use, in one union (node keys and slots,
    /// without counts): every entry gathered, sorted once and folded by key, where merging
    /// the merges one by one into a union cost a pass over the whole union each.
    pub fn union_of<'a>(merges: impl IntoIterator<Item = &'a MergedSummary>) -> GroupSummary {
        let (mut nodes, mut groups): (Vec<u64>, Vec<(u64, &SlotSet)>) = (Vec::new(), Vec::new());
        for m in merges {
            nodes.extend(m.node_keys());
            groups.extend(m.groups.iter().map(|(k, c)| (*k, &c.slots)));
        }
        nodes.sort_unstable();
        nodes.dedup();
        groups.sort_by_key(|(k, _)| *k);
        let mut union: Vec<(u64, SlotSet)> = Vec::with_capacity(groups.len());
        for (key, slots) in groups {
            match union.last_mut() {
                Some((k, set)) if *k == key => set.union_with(slots),
                _ => union.push((key, slots.clone())),
            }
        }
        GroupSummary::uncounted(nodes, union)
    }

    /// Node keys and group slots counted (for reports).
    pub fn entries(&self) -> (usize, u64) {
        (
            self.nodes.len(),
            self.groups.iter().map(|(_, c)| c.slots.len()).sum(),
        )
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::with_capacity(
            16 + self.trees.len() * 64 + self.nodes.len() * 12 + self.groups.len() * 24,
        );
        e.str16(&self.image);
        e.u32(u32::try_from(self.trees.len()).expect("trees fit u32"));
        for (root, summary) in &self.trees {
            e.id(root).id(summary);
            let chain = self.chains.get(root).map_or(&[][..], Vec::as_slice);
            e.u8(u8::try_from(chain.len()).expect("a chain of at most 20"));
            for key in chain {
                e.u64(*key);
            }
        }
        e.u32(u32::try_from(self.nodes.len()).expect("nodes fit u32"));
        for (key, n) in &self.nodes {
            e.u64(*key).u32(*n);
        }
        e.u32(u32::try_from(self.groups.len()).expect("groups fit u32"));
        for (key, counts) in &self.groups {
            e.u64(*key);
            counts.slots.encode_into(&mut e);
            e.u32(counts.common);
            e.u16(u16::try_from(counts.exceptions.len()).expect("slots fit u16"));
            for (slot, n) in &counts.exceptions {
                e.u16(*slot).u32(*n);
            }
        }
        envelope::seal_version(MAGIC, WITH_CHAINS, &e.finish())
    }

    /// Decodes a merge, checking that its lists ascend.
    pub fn decode(data: &[u8]) -> FormatResult<MergedSummary> {
        let (version, payload) = envelope::open_version(MAGIC, data, WHAT, WITH_CHAINS)?;
        let mut d = Decoder::new(payload, WHAT);
        let mut m = MergedSummary::new(&d.str16()?);
        let trees = d.u32()?;
        let mut last = None;
        let mut roots = Vec::with_capacity(trees.min(1 << 16) as usize);
        for _ in 0..trees {
            let (root, summary) = (d.id()?, d.id()?);
            if last.is_some_and(|l| l >= root) {
                return Err(invalid("tree roots not strictly ascending"));
            }
            last = Some(root);
            roots.push((root, summary));
            if version == WITH_CHAINS {
                let n = usize::from(d.u8()?);
                if n > MAX_CHAIN {
                    return Err(invalid(format!("a chain of {n} summaries")));
                }
                let chain = (0..n)
                    .map(|_| d.u64())
                    .collect::<FormatResult<Vec<u64>>>()?;
                if n > 0 {
                    m.chains.insert(root, chain);
                }
            }
        }
        m.trees = roots;
        let in_range = |n: u32, what: &str| {
            if n == 0 || n > trees {
                Err(invalid(format!("{what} counted by {n} of {trees} trees")))
            } else {
                Ok(n)
            }
        };
        let mut last = None;
        let mut nodes = Vec::new();
        for _ in 0..d.u32()? {
            let key = d.u64()?;
            if last.is_some_and(|l| l >= key) {
                return Err(invalid("node keys not strictly ascending"));
            }
            last = Some(key);
            nodes.push((key, in_range(d.u32()?, "a node key")?));
        }
        m.nodes = nodes;
        let mut last = None;
        let mut groups = Vec::new();
        for _ in 0..d.u32()? {
            let key = d.u64()?;
            if last.is_some_and(|l| l >= key) {
                return Err(invalid("group keys not strictly ascending"));
            }
            last = Some(key);
            let slots = SlotSet::decode_from(&mut d, WHAT)?;
            let common = in_range(d.u32()?, "a group")?;
            let mut exceptions = Vec::new();
            let mut last_slot = None;
            for _ in 0..d.u16()? {
                let (slot, n) = (d.u16()?, in_range(d.u32()?, "a slot")?);
                if last_slot.is_some_and(|l| l >= slot) {
                    return Err(invalid("exception slots not strictly ascending"));
                }
                last_slot = Some(slot);
                if !slots.contains(usize::from(slot)) || n == common {
                    return Err(invalid(format!(
                        "exception for slot {slot}: not listed, or equal to the common count"
                    )));
                }
                exceptions.push((slot, n));
            }
            groups.push((
                key,
                SlotCounts {
                    slots,
                    common,
                    exceptions,
                },
            ));
        }
        m.groups = groups;
        d.finish()?;
        Ok(m)
    }
}

/// The index of `key` in `list` (ascending keys), searched from `*from` on; moves `*from`
/// past it, or to where it would be, so ascending keys are found in one sweep.
fn find_from<T>(list: &[(u64, T)], from: &mut usize, key: u64) -> Option<usize> {
    match list[*from..].binary_search_by_key(&key, |(k, _)| *k) {
        Ok(i) => {
            let at = *from + i;
            *from = at + 1;
            Some(at)
        }
        Err(i) => {
            *from += i;
            None
        }
    }
}

/// Merges `fresh` (ascending keys, none of them in `list`) into `list`, in one pass.
fn merge_in<T>(list: &mut Vec<(u64, T)>, fresh: Vec<(u64, T)>) {
    if fresh.is_empty() {
        return;
    }
    let old = std::mem::take(list);
    list.reserve_exact(old.len() + fresh.len());
    let (mut a, mut b) = (old.into_iter().peekable(), fresh.into_iter().peekable());
    loop {
        let take_a = match (a.peek(), b.peek()) {
            (Some(x), Some(y)) => x.0 < y.0,
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => break,
        };
        list.push(if take_a { a.next() } else { b.next() }.expect("peeked"));
    }
}

fn invalid(why: impl Into<String>) -> FormatError {
    FormatError::invalid(WHAT, why.into())
}

/// Roots in `merge` but not in `live` (trees to subtract), and in `live` but not in `merge`
/// (trees to add).
pub fn tree_changes(merge: &MergedSummary, live: &BTreeSet<Id>) -> (Vec<Id>, Vec<Id>) {
    let gone = merge
        .trees()
        .filter(|r| !live.contains(*r))
        .copied()
        .collect();
    let new = live.iter().filter(|r| !merge.covers(r)).copied().collect();
    (gone, new)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group_summary::SummaryBuilder;

    /// A tree's summary from (node, [(group, first, count)]) names.
    fn tree(nodes: &[u8], runs: &[(u8, u16, u16)]) -> GroupSummary {
        let mut s = SummaryBuilder::counted();
        for n in nodes {
            s.add_node(&Id::of(&[b'n', *n]));
        }
        for &(g, first, count) in runs {
            s.add_run(&Id::of(&[b'g', g]), first, count);
        }
        s.finish().expect("only adds")
    }

    fn union_of<'a>(trees: impl IntoIterator<Item = &'a GroupSummary>) -> GroupSummary {
        let mut u = GroupSummary::default();
        for t in trees {
            u.merge(t);
        }
        u
    }

    fn merged_union(m: &MergedSummary) -> GroupSummary {
        let mut u = GroupSummary::default();
        m.union_into(&mut u);
        u
    }

    /// The union of several merges, gathered and sorted once, is the union of every tree
    /// they count.
    #[test]
    fn the_union_of_merges_is_the_union_of_their_trees() {
        let trees = [
            tree(&[1, 2], &[(1, 0, 16), (2, 0, 4)]),
            tree(&[2, 3], &[(1, 60, 8), (2, 2, 4), (3, 0, 1)]),
            tree(&[3], &[(1, 4, 2), (4, 70, 1)]),
            tree(&[], &[]),
        ];
        let merges: Vec<MergedSummary> = trees
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let mut m = MergedSummary::new(&format!("vm{i}"));
                m.add_tree(&Id::of(&[b'r', i as u8]), t, &[]);
                m
            })
            .collect();
        let mut uncounted = union_of(&trees);
        uncounted.forget_counts();
        assert_eq!(MergedSummary::union_of(&merges), uncounted);
        assert_eq!(MergedSummary::union_of([]), GroupSummary::default());
    }

    #[test]
    fn subtracting_a_tree_leaves_exactly_what_the_others_use() {
        let a = tree(&[1, 2], &[(1, 0, 16), (2, 0, 4)]);
        let b = tree(&[2, 3], &[(1, 0, 8), (2, 2, 4), (3, 0, 1)]);
        let c = tree(&[3], &[(1, 4, 2), (3, 0, 1)]);
        let roots: Vec<Id> = (0..3u8).map(|i| Id::of(&[b'r', i])).collect();
        let mut m = MergedSummary::new("vm");
        for (root, t) in roots.iter().zip([&a, &b, &c]) {
            assert!(m.add_tree(root, t, &[]));
        }
        assert!(!m.add_tree(&roots[0], &a, &[]), "a tree is counted once");
        assert_eq!(merged_union(&m), union_of([&a, &b, &c]));

        m.remove_tree(&roots[1], &b).unwrap();
        assert_eq!(merged_union(&m), union_of([&a, &c]));
        // Slot 8..16 of group 1 was a's alone and stays; slot 5 of group 2 was b's alone.
        let g2 = m.slots_of_key(key(2)).unwrap().iter().collect::<Vec<_>>();
        assert_eq!(g2, vec![0, 1, 2, 3]);

        // The result is the merge built from the remaining trees, byte for byte.
        let mut again = MergedSummary::new("vm");
        again.add_tree(&roots[0], &a, &[]);
        again.add_tree(&roots[2], &c, &[]);
        assert_eq!(m, again);
        assert_eq!(m.encode(), again.encode());

        m.remove_tree(&roots[0], &a).unwrap();
        m.remove_tree(&roots[2], &c).unwrap();
        assert_eq!(m, MergedSummary::new("vm"));
    }

    fn key(g: u8) -> u64 {
        crate::group_summary::key_of(&Id::of(&[b'g', g]))
    }

    #[test]
    fn a_tree_is_subtracted_only_with_the_summary_that_was_added() {
        let a = tree(&[1], &[(1, 0, 4)]);
        let b = tree(&[1], &[(1, 0, 2)]);
        let (ra, rb) = (Id::of(b"ra"), Id::of(b"rb"));
        let mut m = MergedSummary::new("vm");
        m.add_tree(&ra, &a, &[]);
        m.add_tree(&rb, &b, &[]);
        // a's summary replaced by a superset would take b's slots with it: refused.
        let bigger = tree(&[1, 2], &[(1, 0, 4)]);
        let err = m.clone().remove_tree(&ra, &bigger).unwrap_err();
        assert!(err.0.contains("not the one counted"), "{err}");
        let err = m.clone().remove_tree(&Id::of(b"rc"), &a).unwrap_err();
        assert!(err.0.contains("is not counted"), "{err}");
        m.remove_tree(&ra, &a).unwrap();
        assert_eq!(merged_union(&m), union_of([&b]));
    }

    /// Random histories: a merge kept up by adding and subtracting trees equals the merge
    /// built from the trees left, and its encoding round-trips.
    #[test]
    fn kept_up_merges_equal_rebuilt_ones() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut m = MergedSummary::new("image");
        let mut live: BTreeMap<Id, GroupSummary> = BTreeMap::new();
        for step in 0..300u32 {
            if live.len() > 3 && next(3) == 0 {
                let victim = *live.keys().nth(next(live.len() as u64) as usize).unwrap();
                let s = live.remove(&victim).unwrap();
                m.remove_tree(&victim, &s).unwrap();
            } else {
                let mut runs = Vec::new();
                for _ in 0..1 + next(6) {
                    runs.push((next(8) as u8, next(60) as u16, 1 + next(8) as u16));
                }
                let nodes: Vec<u8> = (0..next(4)).map(|_| next(16) as u8).collect();
                let s = tree(&nodes, &runs);
                let root = Id::of(&step.to_le_bytes());
                m.add_tree(&root, &s, &[]);
                live.insert(root, s);
            }
            let mut rebuilt = MergedSummary::new("image");
            for (root, s) in &live {
                rebuilt.add_tree(root, s, &[]);
            }
            assert_eq!(m, rebuilt, "step {step}");
            assert_eq!(MergedSummary::decode(&m.encode()).unwrap(), m);
            // Every count is the number of live trees that use the key or slot.
            let mut nodes: BTreeMap<u64, u32> = BTreeMap::new();
            let mut slots: BTreeMap<(u64, u16), u32> = BTreeMap::new();
            for s in live.values() {
                for key in s.nodes() {
                    *nodes.entry(*key).or_default() += 1;
                }
                for (key, used) in s.groups() {
                    for slot in used.iter() {
                        *slots.entry((key, slot)).or_default() += 1;
                    }
                }
            }
            assert_eq!(
                m.nodes,
                nodes.into_iter().collect::<Vec<_>>(),
                "step {step}"
            );
            let counted: Vec<((u64, u16), u32)> = m
                .groups
                .iter()
                .flat_map(|(key, c)| c.dense().into_iter().map(|(s, n)| ((*key, s), n)))
                .collect();
            assert_eq!(
                counted,
                slots.into_iter().collect::<Vec<_>>(),
                "step {step}"
            );
        }
    }

    #[test]
    fn decoding_refuses_damage_and_impossible_counts() {
        let mut m = MergedSummary::new("vm");
        m.add_tree(&Id::of(b"r1"), &tree(&[1], &[(1, 0, 4)]), &[]);
        m.add_tree(&Id::of(b"r2"), &tree(&[], &[(1, 2, 4)]), &[]);
        let raw = m.encode();
        assert_eq!(MergedSummary::decode(&raw).unwrap(), m);
        for i in 0..raw.len() {
            let mut bad = raw.clone();
            bad[i] ^= 0x10;
            assert!(MergedSummary::decode(&bad).is_err(), "flip at {i}");
        }
        assert!(MergedSummary::decode(&raw[..raw.len() - 1]).is_err());

        // Payloads with a valid checksum but impossible content.
        let (_, payload) = envelope::open_version(MAGIC, &raw, WHAT, WITH_CHAINS).unwrap();
        let payload = payload.to_vec();
        let reseal =
            |p: &[u8]| MergedSummary::decode(&envelope::seal_version(MAGIC, WITH_CHAINS, p));
        // image "vm" (2 + 2) | trees 2 (4) | 2 × (64 + 1) | nodes 1 (4) | key (8) | count at 150
        let count_at = 4 + 4 + 130 + 4 + 8;
        let mut bad = payload.clone();
        bad[count_at..count_at + 4].copy_from_slice(&3u32.to_le_bytes());
        let err = reseal(&bad).unwrap_err();
        assert!(err.to_string().contains("counted by 3 of 2 trees"), "{err}");
        bad[count_at..count_at + 4].copy_from_slice(&0u32.to_le_bytes());
        assert!(reseal(&bad).is_err());

        // A chain of more than 20 summaries is refused.
        let mut bad = payload.clone();
        bad[4 + 4 + 64] = 21;
        let err = reseal(&bad).unwrap_err();
        assert!(err.to_string().contains("a chain of 21"), "{err}");
    }
}

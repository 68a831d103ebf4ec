//! A reference summary stored as a delta (`CRNSUMD\0`), so that a commit's metadata is
//! proportional to what it changed, not to the image's size.
//!
//! The summaries of an image's successive trees form a *chain*: position 0 is a full
//! summary, and the summary at position `p ≥ 1` is stored as the changes from the summary at
//! position `p − lowbit(p)` (its *base*; `lowbit` is `p`'s lowest set bit). Resolving any
//! summary reads at most `popcount(p)` other objects (the full one and the bases on the way),
//! all named in the delta itself so that they can be fetched at once, and the delta at `p`
//! holds the changes of `lowbit(p)` commits: over many commits, a commit writes about
//! `log2(p) / 2` commits' worth of changes (the binary-lifting layout of skip lists).
//!
//! ```text
//! envelope "CRNSUMD\0", version 1 (sealed as a summary in an encrypted repository)
//! payload  = position p (u32, >= 1)
//!          | chain: popcount(p) × root id (32)       the full summary's tree first, the
//!                                                    base's last
//!          | removed node count (u32) | keys (u64)    ascending; listed by the base
//!          | added node count (u32) | keys (u64)      ascending; not listed by the base
//!          | group count G (u32) | G × change        ascending by group key
//! change   = group key (u64) | 0 (u8)                 the base lists it; the result does not
//!          | group key (u64) | 1 (u8) | slot set | repeat count R (u16)
//!                            | R × (slot (u16) | repeats (u32, >= 1))   ascending slots,
//!                                                    each in the slot set
//! ```
//! A change of kind 1 gives the group's whole state in the result (its slots and their
//! repeats, as a counted summary holds them). Both the base and the result are counted.

use std::collections::HashMap;

use super::table::GroupTable;
use super::{GroupSummary, Repeat};
use crate::codec::{Decoder, Encoder};
use crate::slots::SlotSet;
use crate::{envelope, FormatError, FormatResult, Id};

pub const DELTA_MAGIC: &[u8; 8] = b"CRNSUMD\0";
const WHAT: &str = "summary delta";

/// Positions a chain may reach; past it, the next summary is full (`popcount` stays ≤ 20).
pub const MAX_POSITION: u32 = 1 << 20;

/// One group's state in a counted summary: its slots and their repeats (ascending slots).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupState {
    pub slots: SlotSet,
    pub repeats: Vec<(u16, u32)>,
}

/// A summary stored as the changes from its base (module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SummaryDelta {
    pub position: u32,
    /// Roots of the summaries resolution reads, position 0 first, the base last.
    pub chain: Vec<Id>,
    removed_nodes: Vec<u64>,
    added_nodes: Vec<u64>,
    /// Ascending keys; `None`: the group is no longer listed.
    groups: Vec<(u64, Option<GroupState>)>,
}

/// What the summaries past a position changed, before they changed it: how to turn the
/// resolved summary back into the one at that position, key by key (filled by
/// [`GroupSummary::apply`]).
#[derive(Debug, Default, Clone)]
pub struct Before {
    /// Node key → whether the earlier summary listed it.
    nodes: HashMap<u64, bool>,
    /// Group key → its state in the earlier summary.
    groups: HashMap<u64, Option<GroupState>>,
}

impl Before {
    pub fn len(&self) -> usize {
        self.nodes.len() + self.groups.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The lowest set bit of `p` (p ≥ 1).
fn lowbit(p: u32) -> u32 {
    p & p.wrapping_neg()
}

/// The position of the base of the summary at position `p ≥ 1`.
pub fn base_position(p: u32) -> u32 {
    p - lowbit(p)
}

/// The positions of the chain of the summary at `p ≥ 1`: 0 first, its base last
/// (`popcount(p)` of them).
pub fn chain_positions(p: u32) -> Vec<u32> {
    let mut at = base_position(p);
    let mut out = vec![at];
    while at != 0 {
        at = base_position(at);
        out.push(at);
    }
    out.reverse();
    out
}

impl SummaryDelta {
    /// The delta at `position` over `chain` that turns `base` into `new`, where `base` is the
    /// summary `parent` was before the changes `since` records (`since` lists every key that
    /// differs between them). Both summaries are counted.
    pub fn between(
        position: u32,
        chain: Vec<Id>,
        since: &Before,
        parent: &GroupSummary,
        new: &GroupSummary,
    ) -> SummaryDelta {
        debug_assert!(parent.is_counted() && new.is_counted());
        debug_assert_eq!(chain.len(), position.count_ones() as usize);
        // Node keys that may differ: those parent and new disagree on, and those `since`
        // names.
        let mut keys: Vec<u64> = symmetric_difference(&parent.nodes, &new.nodes);
        keys.extend(since.nodes.keys());
        keys.sort_unstable();
        keys.dedup();
        let (mut removed_nodes, mut added_nodes) = (Vec::new(), Vec::new());
        for k in keys {
            let was = since
                .nodes
                .get(&k)
                .copied()
                .unwrap_or_else(|| parent.has_node_key(k));
            match (was, new.has_node_key(k)) {
                (true, false) => removed_nodes.push(k),
                (false, true) => added_nodes.push(k),
                _ => {}
            }
        }
        let mut keys = changed_groups(parent, new);
        keys.extend(since.groups.keys());
        keys.sort_unstable();
        keys.dedup();
        let mut groups = Vec::new();
        for k in keys {
            let was = match since.groups.get(&k) {
                Some(state) => state.clone(),
                None => parent.group_state(k),
            };
            let now = new.group_state(k);
            if was != now {
                groups.push((k, now));
            }
        }
        SummaryDelta {
            position,
            chain,
            removed_nodes,
            added_nodes,
            groups,
        }
    }

    /// Keys the delta changes (nodes and groups).
    pub fn changes(&self) -> usize {
        self.removed_nodes.len() + self.added_nodes.len() + self.groups.len()
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::with_capacity(
            16 + self.chain.len() * 32 + self.changes() * 16 + self.groups.len() * 8,
        );
        e.u32(self.position);
        for root in &self.chain {
            e.id(root);
        }
        for keys in [&self.removed_nodes, &self.added_nodes] {
            e.u32(u32::try_from(keys.len()).expect("nodes fit u32"));
            for k in keys {
                e.u64(*k);
            }
        }
        e.u32(u32::try_from(self.groups.len()).expect("groups fit u32"));
        for (key, state) in &self.groups {
            e.u64(*key);
            let Some(state) = state else {
                e.u8(0);
                continue;
            };
            e.u8(1);
            state.slots.encode_into(&mut e);
            e.u16(u16::try_from(state.repeats.len()).expect("slots fit u16"));
            for (slot, n) in &state.repeats {
                e.u16(*slot).u32(*n);
            }
        }
        envelope::seal(DELTA_MAGIC, &e.finish())
    }

    /// Decodes a delta, refusing anything a writer never makes (keys out of order, a chain
    /// of the wrong length, repeats of 0 or of unlisted slots).
    pub fn decode(data: &[u8]) -> FormatResult<SummaryDelta> {
        let mut d = Decoder::new(envelope::open(DELTA_MAGIC, data, WHAT)?, WHAT);
        let position = d.u32()?;
        if position == 0 || position > MAX_POSITION {
            return Err(invalid(format!("position {position}")));
        }
        let chain = (0..position.count_ones())
            .map(|_| d.id())
            .collect::<FormatResult<Vec<Id>>>()?;
        let mut nodes = [Vec::new(), Vec::new()];
        for list in &mut nodes {
            let mut last = None;
            for _ in 0..d.u32()? {
                let k = d.u64()?;
                ascending(&mut last, k, "node keys")?;
                list.push(k);
            }
        }
        let [removed_nodes, added_nodes] = nodes;
        let mut groups = Vec::new();
        let mut last = None;
        for _ in 0..d.u32()? {
            let key = d.u64()?;
            ascending(&mut last, key, "group keys")?;
            let state = match d.u8()? {
                0 => None,
                1 => {
                    let slots = SlotSet::decode_from(&mut d, WHAT)?;
                    let mut repeats = Vec::new();
                    let mut last_slot = None;
                    for _ in 0..d.u16()? {
                        let (slot, n) = (d.u16()?, d.u32()?);
                        ascending(&mut last_slot, u64::from(slot), "repeat slots")?;
                        if n == 0 || !slots.contains(usize::from(slot)) {
                            return Err(invalid(format!(
                                "{n} repeats of slot {slot}: zero, or of an unlisted slot"
                            )));
                        }
                        repeats.push((slot, n));
                    }
                    Some(GroupState { slots, repeats })
                }
                kind => return Err(invalid(format!("group change of kind {kind}"))),
            };
            groups.push((key, state));
        }
        d.finish()?;
        Ok(SummaryDelta {
            position,
            chain,
            removed_nodes,
            added_nodes,
            groups,
        })
    }
}

/// A summary resolved from its chain, with what the next summary's delta needs.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub summary: GroupSummary,
    pub position: u32,
    /// The chain's roots with the resolved tree's own last.
    pub chain: Vec<Id>,
    /// What changed since the base position of the next summary (`position + 1`).
    pub since: Before,
}

impl Resolved {
    /// A summary stored whole: position 0 of a chain.
    pub fn full(root: Id, summary: GroupSummary) -> Resolved {
        Resolved {
            summary,
            position: 0,
            chain: vec![root],
            since: Before::default(),
        }
    }

    /// Resolves `target` (the delta stored for `root`) from its chain: `full`, the summary
    /// of `target.chain[0]`, and `members`, the deltas stored for `target.chain[1..]`. Each
    /// member must sit at its position with the chain's prefix as its own chain: anything
    /// else means an object does not belong where the chain names it.
    pub fn from_chain(
        root: Id,
        target: &SummaryDelta,
        full: GroupSummary,
        members: &[SummaryDelta],
    ) -> FormatResult<Resolved> {
        let positions = chain_positions(target.position);
        if members.len() + 1 != positions.len() {
            return Err(invalid(format!(
                "a chain of {} summaries for position {}",
                members.len() + 1,
                target.position
            )));
        }
        let record_after = base_position(target.position.saturating_add(1).min(MAX_POSITION));
        let (mut summary, mut since) = (full, Before::default());
        for (i, member) in members.iter().enumerate() {
            if member.position != positions[i + 1] || member.chain[..] != target.chain[..=i] {
                return Err(invalid(format!(
                    "the summary named at position {} of the chain is not part of it",
                    positions[i + 1]
                )));
            }
        }
        for delta in members.iter().chain([target]) {
            let record = (delta.position > record_after).then_some(&mut since);
            summary.apply(delta, record)?;
        }
        let mut chain = target.chain.clone();
        chain.push(root);
        Ok(Resolved {
            summary,
            position: target.position,
            chain,
            since,
        })
    }

    /// The delta to store for `new`, the summary of the next tree, as an encoded object:
    /// `None` when a full summary must be stored (the chain is at its end, or a summary is
    /// not counted). See [`delta_pays`] for whether a delta is worth it.
    pub fn next_delta(&self, new: &GroupSummary) -> Option<Vec<u8>> {
        let p = self
            .position
            .checked_add(1)
            .filter(|p| *p <= MAX_POSITION)?;
        if !self.summary.is_counted() || !new.is_counted() {
            return None;
        }
        let base = base_position(p);
        let mut positions = match self.position {
            0 => Vec::new(),
            q => chain_positions(q),
        };
        positions.push(self.position);
        let at = positions.iter().position(|q| *q == base)?;
        let chain = self.chain[..=at].to_vec();
        Some(SummaryDelta::between(p, chain, &self.since, &self.summary, new).encode())
    }
}

/// Whether storing a delta of `delta_len` bytes for `new` pays: at most a quarter of the
/// full summary's bytes. A larger one means the chain has gathered many changes, and a full
/// summary starts a new chain (whose next deltas are small again).
pub fn delta_pays(delta_len: usize, new: &GroupSummary) -> bool {
    delta_len as u64 * 4 <= new.encoded_len()
}

impl GroupSummary {
    /// Group `key`'s slots and repeats (`None`: not listed).
    pub fn group_state(&self, key: u64) -> Option<GroupState> {
        let slots = self.groups.get(key)?.into_owned();
        let repeats = self.repeats.as_deref().unwrap_or_default();
        let from = repeats.partition_point(|r| r.0 .0 < key);
        let to = repeats.partition_point(|r| r.0 .0 <= key);
        let repeats = repeats[from..to].iter().map(|r| (r.0 .1, r.1)).collect();
        Some(GroupState { slots, repeats })
    }

    /// Applies `delta` to this summary (its base, counted), recording in `before` (when
    /// given) the state each key had before its first change. An error means the delta does
    /// not fit this summary (it removes what is not listed, or adds what is): the summary is
    /// then left unchanged.
    pub fn apply(&mut self, delta: &SummaryDelta, before: Option<&mut Before>) -> FormatResult<()> {
        if !self.is_counted() {
            return Err(invalid("a delta over an uncounted summary"));
        }
        for k in &delta.removed_nodes {
            if !self.has_node_key(*k) {
                return Err(invalid(format!("removes node key {k:016x}, not listed")));
            }
        }
        for k in &delta.added_nodes {
            if self.has_node_key(*k) {
                return Err(invalid(format!("adds node key {k:016x}, already listed")));
            }
        }
        for (k, state) in &delta.groups {
            if state.is_none() && self.groups.get(*k).is_none() {
                return Err(invalid(format!("removes group key {k:016x}, not listed")));
            }
        }
        if let Some(before) = before {
            for k in delta.removed_nodes.iter().chain(&delta.added_nodes) {
                let was = self.has_node_key(*k);
                before.nodes.entry(*k).or_insert(was);
            }
            for (k, _) in &delta.groups {
                if !before.groups.contains_key(k) {
                    before.groups.insert(*k, self.group_state(*k));
                }
            }
        }
        let mut nodes: Vec<u64> = std::mem::take(&mut self.nodes);
        nodes.retain(|k| delta.removed_nodes.binary_search(k).is_err());
        nodes.extend_from_slice(&delta.added_nodes);
        nodes.sort_unstable();
        self.nodes = nodes;
        self.apply_groups(&delta.groups);
        Ok(())
    }

    /// Rebuilds the group table and the repeats with `changes` (ascending keys) in one pass.
    fn apply_groups(&mut self, changes: &[(u64, Option<GroupState>)]) {
        let old = std::mem::take(&mut self.groups);
        let old_repeats = self.repeats.take().unwrap_or_default();
        let mut groups = GroupTable::with_capacity(old.len() + changes.len());
        let mut repeats: Vec<Repeat> = Vec::with_capacity(old_repeats.len());
        let mut at_repeat = 0;
        let mut change = changes.iter().peekable();
        let put = |groups: &mut GroupTable, repeats: &mut Vec<Repeat>, key, state: &GroupState| {
            groups.push(key, state.slots.clone());
            repeats.extend(state.repeats.iter().map(|&(s, n)| ((key, s), n)));
        };
        for (key, set) in old.iter() {
            while let Some((k, state)) = change.next_if(|(k, _)| *k < key) {
                if let Some(state) = state {
                    put(&mut groups, &mut repeats, *k, state);
                }
            }
            let own = super::of_key(&old_repeats, &mut at_repeat, key);
            match change.next_if(|(k, _)| *k == key) {
                Some((_, Some(state))) => put(&mut groups, &mut repeats, key, state),
                Some((_, None)) => {}
                None => {
                    groups.push(key, set.into_owned());
                    repeats.extend_from_slice(own);
                }
            }
        }
        for (k, state) in change {
            if let Some(state) = state {
                put(&mut groups, &mut repeats, *k, state);
            }
        }
        self.groups = groups;
        self.repeats = Some(repeats);
    }

    /// The bytes of this summary's encoding, without encoding it.
    pub fn encoded_len(&self) -> u64 {
        let sets: u64 = self.groups.iter().map(|(_, s)| 2 + s.encoded_bytes()).sum();
        let repeats = self.repeats.as_ref().map_or(0, |r| 4 + r.len() as u64 * 14);
        (envelope::HEADER_LEN + envelope::CHECKSUM_LEN) as u64
            + 16
            + self.nodes.len() as u64 * 8
            + self.groups.len() as u64 * 8
            + sets
            + repeats
    }
}

/// Keys in exactly one of two ascending lists.
fn symmetric_difference(a: &[u64], b: &[u64]) -> Vec<u64> {
    let mut out = Vec::new();
    let mut b = b.iter().copied().peekable();
    for &x in a {
        while let Some(y) = b.next_if(|y| *y < x) {
            out.push(y);
        }
        if b.next_if_eq(&x).is_none() {
            out.push(x);
        }
    }
    out.extend(b);
    out
}

/// Group keys whose state differs between two counted summaries, in one pass over both.
fn changed_groups(a: &GroupSummary, b: &GroupSummary) -> Vec<u64> {
    let (ra, rb) = (
        a.repeats().unwrap_or_default(),
        b.repeats().unwrap_or_default(),
    );
    let (mut at_a, mut at_b) = (0, 0);
    let mut out = Vec::new();
    let mut theirs = b.groups.iter().peekable();
    for (key, set) in a.groups.iter() {
        while let Some((k, _)) = theirs.next_if(|(k, _)| *k < key) {
            out.push(k);
        }
        let mine = super::of_key(ra, &mut at_a, key);
        match theirs.next_if(|(k, _)| *k == key) {
            Some((_, other)) => {
                let their = super::of_key(rb, &mut at_b, key);
                if set != other || mine != their {
                    out.push(key);
                }
            }
            None => out.push(key),
        }
    }
    out.extend(theirs.map(|(k, _)| k));
    out
}

fn ascending(last: &mut Option<u64>, k: u64, what: &str) -> FormatResult<()> {
    if last.is_some_and(|l| l >= k) {
        return Err(invalid(format!("{what} not strictly ascending")));
    }
    *last = Some(k);
    Ok(())
}

fn invalid(reason: impl Into<String>) -> FormatError {
    FormatError::invalid(WHAT, reason)
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;
    use crate::group_summary::{StoredSummary, SummaryBuilder};

    /// Resolves `root` from `store` as a reader does: the object, then its chain.
    fn resolve(store: &HashMap<Id, Vec<u8>>, root: Id) -> FormatResult<Resolved> {
        match StoredSummary::decode(&store[&root])? {
            StoredSummary::Full(s) => Ok(Resolved::full(root, s)),
            StoredSummary::Delta(d) => {
                let StoredSummary::Full(full) = StoredSummary::decode(&store[&d.chain[0]])? else {
                    return Err(invalid("chain starts with a delta"));
                };
                let members = d.chain[1..]
                    .iter()
                    .map(|r| SummaryDelta::decode(&store[r]))
                    .collect::<FormatResult<Vec<_>>>()?;
                Resolved::from_chain(root, &d, full, &members)
            }
        }
    }

    /// A counted summary of leaves picked from a pool (a leaf: nodes and group runs).
    fn summary_of(pool: &[Vec<(u8, u16, u16)>], picks: &[usize]) -> GroupSummary {
        let mut b = SummaryBuilder::counted();
        for &i in picks {
            let leaf = &pool[i % pool.len()];
            b.add_node_key(1000 + (i % pool.len()) as u64);
            for &(g, first, count) in leaf {
                b.add_run(&Id::of(&[g]), first, count);
            }
        }
        b.finish().expect("adds only")
    }

    #[test]
    fn chain_positions_follow_the_lowest_bit() {
        assert_eq!(chain_positions(1), vec![0]);
        assert_eq!(chain_positions(6), vec![0, 4]);
        assert_eq!(chain_positions(7), vec![0, 4, 6]);
        assert_eq!(chain_positions(8), vec![0]);
        for p in 1..300u32 {
            assert_eq!(chain_positions(p).len(), p.count_ones() as usize);
        }
    }

    /// Leaves (group runs by group name) that summaries pick from.
    fn leaf_pool() -> impl proptest::strategy::Strategy<Value = Vec<Vec<(u8, u16, u16)>>> {
        proptest::collection::vec(
            proptest::collection::vec((0u8..12, 0u16..90, 1u16..30), 1..4),
            1..10,
        )
    }

    /// The leaves of one tree, as indexes into the pool.
    fn picks() -> impl proptest::strategy::Strategy<Value = Vec<usize>> {
        proptest::collection::vec(0usize..10, 0..10)
    }

    proptest::proptest! {
        /// A run of versions stored as the writer stores them (a delta whenever the chain
        /// allows) resolves, each from scratch, to exactly the summary committed.
        #[test]
        fn every_version_resolves_to_its_summary(
            pool in leaf_pool(),
            versions in proptest::collection::vec(picks(), 1..40),
        ) {
            let mut store = HashMap::new();
            let mut last: Option<Resolved> = None;
            for (i, picks) in versions.iter().enumerate() {
                let root = Id::of(&(i as u64).to_le_bytes());
                let s = summary_of(&pool, picks);
                proptest::prop_assert_eq!(s.encoded_len(), s.encode().len() as u64);
                let raw = match last.as_ref().and_then(|r| r.next_delta(&s)) {
                    Some(delta) => delta,
                    None => s.encode(),
                };
                store.insert(root, raw);
                let r = resolve(&store, root).unwrap();
                proptest::prop_assert_eq!(&r.summary, &s);
                proptest::prop_assert_eq!(r.position as usize, i);
                last = Some(r);
            }
        }

        /// A delta applied to a summary that is not its base is refused or gives another
        /// summary; it never panics.
        #[test]
        fn a_delta_over_the_wrong_base_is_refused_or_differs(
            pool in leaf_pool(),
            a in picks(), b in picks(), c in picks(),
        ) {
            let (sa, sb, sc) = (summary_of(&pool, &a), summary_of(&pool, &b), summary_of(&pool, &c));
            let raw = Resolved::full(Id::of(b"a"), sa.clone()).next_delta(&sb).unwrap();
            let delta = SummaryDelta::decode(&raw).unwrap();
            let mut on_a = sa.clone();
            on_a.apply(&delta, None).unwrap();
            proptest::prop_assert_eq!(&on_a, &sb);
            let mut on_c = sc.clone();
            if on_c.apply(&delta, None).is_err() {
                proptest::prop_assert_eq!(&on_c, &sc);
            }
        }
    }

    #[test]
    fn decoding_refuses_what_a_writer_never_makes() {
        let pool = vec![vec![(1, 0, 4)], vec![(2, 70, 3), (1, 8, 2)]];
        let (a, b) = (summary_of(&pool, &[0]), summary_of(&pool, &[1, 1]));
        let raw = Resolved::full(Id::of(b"a"), a).next_delta(&b).unwrap();
        let delta = SummaryDelta::decode(&raw).unwrap();
        assert_eq!(delta.position, 1);
        let payload = envelope::open(DELTA_MAGIC, &raw, WHAT).unwrap().to_vec();
        let refused = |p: &[u8], says: &str| {
            let err = SummaryDelta::decode(&envelope::seal(DELTA_MAGIC, p)).unwrap_err();
            assert!(err.to_string().contains(says), "{err} lacks {says}");
        };
        let mut p = payload.clone();
        p[..4].copy_from_slice(&0u32.to_le_bytes());
        refused(&p, "position 0");
        let mut p = payload.clone();
        p[..4].copy_from_slice(&3u32.to_le_bytes()); // two chain roots needed, one given
        assert!(SummaryDelta::decode(&envelope::seal(DELTA_MAGIC, &p)).is_err());
        // The first group change's kind (after position, chain, node lists and the count).
        let at = 4 + 32 + 4 + 4 + 8 * 2 + 4 + 8;
        let mut p = payload.clone();
        p[at] = 7;
        refused(&p, "kind 7");
    }
}

//! What fast deletion asks of the live versions — is this node used, which slots of this
//! group — answered from the merged summaries of their images (`group_summaries`) without
//! first copying them into one union. A GC after `rm` at 1,000 versions spent a third of
//! its "live summaries" step building that union (a `SlotSet` allocated and merged per
//! group) to ask it about the few packs the deleted versions' data is in (BENCHMARKS.md, *Version history and GC*,
//! "Where GC's time goes"). Past [`MAX_ASKED`] images a question would ask too many merges,
//! so their union is built, in one gathering sorted once (`MergedSummary::union_of`).

use std::borrow::Cow;

use cairn_format::group_summary::{key_of, GroupSummary};
use cairn_format::merged_summary::MergedSummary;
use cairn_format::slots::SlotSet;
use cairn_format::Id;

use super::liveness::Liveness;

/// Images whose merges are asked one by one; more are merged into one union first.
const MAX_ASKED: usize = 8;

/// What the live trees use.
pub(super) enum LiveSet {
    /// The merges of every image with live trees, asked in turn.
    Merges(Vec<MergedSummary>),
    /// Their union, for many images.
    Union(GroupSummary),
}

impl LiveSet {
    pub(super) fn new(merges: Vec<MergedSummary>) -> LiveSet {
        if merges.len() <= MAX_ASKED {
            return LiveSet::Merges(merges);
        }
        LiveSet::Union(MergedSummary::union_of(&merges))
    }

    pub(super) fn has_node_key(&self, key: u64) -> bool {
        match self {
            LiveSet::Merges(merges) => merges.iter().any(|m| m.has_node_key(key)),
            LiveSet::Union(u) => u.has_node_key(key),
        }
    }

    /// The used slots of the group of key `key`: borrowed when one image uses the group,
    /// the union of the images' slots when several do. `None`: no live tree uses it.
    pub(super) fn slots_of_key(&self, key: u64) -> Option<Cow<'_, SlotSet>> {
        match self {
            LiveSet::Merges(merges) => {
                let mut found = merges.iter().filter_map(|m| m.slots_of_key(key));
                let first = found.next()?;
                match found.next() {
                    None => Some(Cow::Borrowed(first)),
                    Some(second) => {
                        let mut union = first.clone();
                        union.union_with(second);
                        found.for_each(|more| union.union_with(more));
                        Some(Cow::Owned(union))
                    }
                }
            }
            LiveSet::Union(u) => u.slots_of_key(key),
        }
    }

    /// Distinct node and group keys used (the report's `live_blobs`).
    pub(super) fn blobs(&self) -> u64 {
        match self {
            LiveSet::Merges(merges) if merges.len() == 1 => {
                let (nodes, groups) = (merges[0].node_keys(), merges[0].group_keys());
                (nodes.count() + groups.count()) as u64
            }
            LiveSet::Merges(merges) => {
                let distinct = |keys: &mut Vec<u64>| {
                    keys.sort_unstable();
                    keys.dedup();
                    keys.len() as u64
                };
                let mut nodes: Vec<u64> = merges.iter().flat_map(|m| m.node_keys()).collect();
                let mut groups: Vec<u64> = merges.iter().flat_map(|m| m.group_keys()).collect();
                distinct(&mut nodes) + distinct(&mut groups)
            }
            LiveSet::Union(u) => (u.nodes().len() + u.groups().len()) as u64,
        }
    }
}

impl Liveness for LiveSet {
    fn node_used(&self, id: &Id) -> bool {
        self.has_node_key(key_of(id))
    }
    fn used_slots(&self, group: &Id) -> Option<Cow<'_, SlotSet>> {
        self.slots_of_key(key_of(group))
    }
}

#[cfg(test)]
mod tests {
    use cairn_format::group_summary::SummaryBuilder;

    use super::*;

    /// A tree's summary: nodes by key, and (group key, first slot, count) runs.
    fn tree(nodes: &[u64], runs: &[(u64, u16, u16)]) -> GroupSummary {
        let mut s = SummaryBuilder::counted();
        for n in nodes {
            s.add_node_key(*n);
        }
        for (g, first, count) in runs {
            s.add_run_of_key(*g, *first, *count);
        }
        s.finish().expect("only adds")
    }

    fn merge(image: &str, trees: &[GroupSummary]) -> MergedSummary {
        let mut m = MergedSummary::new(image);
        for (i, t) in trees.iter().enumerate() {
            assert!(m.add_tree(&Id::of(format!("{image}/{i}").as_bytes()), t, &[]));
        }
        m
    }

    /// The merges asked one by one answer every question as their union does, for any
    /// number of images (past `MAX_ASKED` the union itself answers).
    #[test]
    fn asking_the_merges_answers_as_their_union() {
        for images in [1, 2, 3, MAX_ASKED, MAX_ASKED + 1] {
            let merges: Vec<MergedSummary> = (0..images as u64)
                .map(|i| {
                    merge(
                        &format!("vm{i}"),
                        &[
                            tree(&[i, 100], &[(i % 3, 0, 2), (50, i as u16, 1)]),
                            tree(&[200 + i], &[(i % 3, 4, 1), (60 + i, 0, 3)]),
                        ],
                    )
                })
                .collect();
            let mut union = GroupSummary::default();
            merges.iter().for_each(|m| m.union_into(&mut union));
            let set = LiveSet::new(merges);
            assert_eq!(matches!(set, LiveSet::Union(_)), images > MAX_ASKED);
            for key in 0..300u64 {
                assert_eq!(set.has_node_key(key), union.has_node_key(key), "{key}");
                assert_eq!(
                    set.slots_of_key(key).as_deref(),
                    union.slots_of_key(key).as_deref(),
                    "{images} images, group {key}"
                );
            }
            assert_eq!(
                set.blobs(),
                (union.nodes().len() + union.groups().len()) as u64
            );
        }
    }
}

//! The slot sets of a summary's groups, 16 bytes a group: a group's key and one word of its
//! slots 0..=62 inline. A group of the default 64 KiB has 16 slots, so nearly every set fits;
//! a set with a slot beyond 62 is *wide*: its word is a marker and the set lies in a second
//! table, ascending by key like the first. A commit holds a summary as large as its image
//! (its own, and at the end its parent's), where a key beside a [`SlotSet`] took 32 bytes.

use std::borrow::Cow;

use crate::slots::{SlotSet, LOW_WORD_UNUSED};

/// The word of an entry whose set is in the wide table (no inline set has this bit).
const WIDE: u64 = LOW_WORD_UNUSED;

#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(super) struct GroupTable {
    /// Ascending, distinct keys, each with its set's slots 0..=62 (never 0) or [`WIDE`].
    entries: Vec<(u64, u64)>,
    /// The sets of the [`WIDE`] entries, ascending by key.
    wide: Vec<(u64, SlotSet)>,
}

impl GroupTable {
    pub(super) fn with_capacity(groups: usize) -> GroupTable {
        GroupTable {
            entries: Vec::with_capacity(groups),
            wide: Vec::new(),
        }
    }

    /// The table of `groups` (ascending, distinct keys; non-empty sets).
    pub(super) fn from_sorted(groups: Vec<(u64, SlotSet)>) -> GroupTable {
        let mut table = GroupTable::with_capacity(groups.len());
        for (key, set) in groups {
            table.push(key, set);
        }
        table
    }

    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }

    pub(super) fn reserve(&mut self, groups: usize) {
        self.entries.reserve(groups);
    }

    /// Appends group `key` (above every key held) with its non-empty `set`.
    pub(super) fn push(&mut self, key: u64, set: SlotSet) {
        debug_assert!(self.entries.last().is_none_or(|(k, _)| *k < key));
        debug_assert!(!set.is_empty());
        let word = pack(key, set, &mut self.wide);
        self.entries.push((key, word));
    }

    /// The groups by key, ascending, with their sets.
    pub(super) fn iter(&self) -> impl ExactSizeIterator<Item = (u64, Cow<'_, SlotSet>)> + '_ {
        self.entries
            .iter()
            .map(|&(key, word)| (key, unpack(&self.wide, key, word)))
    }

    pub(super) fn get(&self, key: u64) -> Option<Cow<'_, SlotSet>> {
        let at = self.entries.binary_search_by_key(&key, |e| e.0).ok()?;
        Some(unpack(&self.wide, key, self.entries[at].1))
    }

    pub(super) fn slot_count(&self) -> u64 {
        let inline = self.entries.iter().filter(|e| e.1 != WIDE);
        let inline: u64 = inline.map(|e| u64::from(e.1.count_ones())).sum();
        inline + self.wide.iter().map(|(_, s)| s.len()).sum::<u64>()
    }

    /// For a merge in place ([`super::SummaryBuilder`]): the entries, which it may reorder,
    /// grow and shrink, and an [`Edit`] that takes sets out and puts them back. Ends with
    /// [`Edit::finish`].
    pub(super) fn edit(&mut self) -> (&mut Vec<(u64, u64)>, Edit<'_>) {
        let edit = Edit {
            wide: &mut self.wide,
            new_wide: Vec::new(),
        };
        (&mut self.entries, edit)
    }
}

/// Sets taken out of a [`GroupTable`]'s entries and put back while they are edited.
pub(super) struct Edit<'a> {
    wide: &'a mut Vec<(u64, SlotSet)>,
    /// Wide sets put back, in any order.
    new_wide: Vec<(u64, SlotSet)>,
}

impl Edit<'_> {
    /// The set of `entry`, taken out (a wide one leaves an empty place, dropped by
    /// [`Edit::finish`]).
    pub(super) fn take(&mut self, (key, word): (u64, u64)) -> SlotSet {
        if word != WIDE {
            return SlotSet::from_low_word(word);
        }
        let at = self.wide.binary_search_by_key(&key, |w| w.0);
        std::mem::take(&mut self.wide[at.expect("a wide entry has its set")].1)
    }

    /// The word an entry of group `key` holds for its non-empty `set`.
    pub(super) fn put(&mut self, key: u64, set: SlotSet) -> u64 {
        pack(key, set, &mut self.new_wide)
    }

    /// The wide table without the sets taken out, with those put back.
    pub(super) fn finish(self) {
        self.wide.retain(|(_, s)| !s.is_empty());
        if !self.new_wide.is_empty() {
            self.wide.extend(self.new_wide);
            self.wide.sort_unstable_by_key(|w| w.0);
        }
    }
}

/// The word for `set`: inline, or [`WIDE`] with the set added to `wide`.
fn pack(key: u64, set: SlotSet, wide: &mut Vec<(u64, SlotSet)>) -> u64 {
    match set.as_low_word() {
        Some(word) => word,
        None => {
            wide.push((key, set));
            WIDE
        }
    }
}

fn unpack(wide: &[(u64, SlotSet)], key: u64, word: u64) -> Cow<'_, SlotSet> {
    if word != WIDE {
        return Cow::Owned(SlotSet::from_low_word(word));
    }
    let at = wide.binary_search_by_key(&key, |w| w.0);
    Cow::Borrowed(&wide[at.expect("a wide entry has its set")].1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(slots: &[u16]) -> SlotSet {
        let mut s = SlotSet::default();
        for &slot in slots {
            s.insert(slot);
        }
        s
    }

    #[test]
    fn sets_up_to_slot_62_are_inline_and_wider_ones_kept_aside() {
        assert_eq!(std::mem::size_of::<(u64, u64)>(), 16);
        let sets = [set(&[0, 62]), set(&[63]), set(&[1, 200]), set(&[5])];
        let table = GroupTable::from_sorted((0u64..).zip(sets.iter().cloned()).collect());
        assert_eq!(table.wide.len(), 2, "slots 63 and 200 need the wide table");
        let back: Vec<SlotSet> = table.iter().map(|(_, s)| s.into_owned()).collect();
        assert_eq!(back, sets);
        assert_eq!(table.get(2).as_deref(), Some(&sets[2]));
        assert_eq!(table.get(4), None);
        assert_eq!(table.slot_count(), 6);
    }

    #[test]
    fn an_edit_moves_sets_between_inline_and_wide() {
        let mut table = GroupTable::from_sorted(vec![(1, set(&[100])), (2, set(&[3]))]);
        let (entries, mut edit) = table.edit();
        let (e0, e1) = (entries[0], entries[1]);
        let mut narrow = edit.take(e0);
        narrow.remove(100);
        narrow.insert(7);
        let mut wide = edit.take(e1);
        wide.insert(64);
        entries[0].1 = edit.put(1, narrow);
        entries[1].1 = edit.put(2, wide);
        edit.finish();
        let expected = GroupTable::from_sorted(vec![(1, set(&[7])), (2, set(&[3, 64]))]);
        assert_eq!(table, expected, "canonical: equal tables compare equal");
    }
}

//! A set of slot numbers of one chunk group (a bit per slot): what a tree, a summary or a GC
//! mark says is used of a group.

use smallvec::{smallvec, SmallVec};

use crate::codec::{Decoder, Encoder};
use crate::{FormatError, FormatResult};

/// Slots are u16, so an encoded set has at most 8,192 bytes.
pub const MAX_BYTES: usize = (u16::MAX as usize + 1) / 8;

/// The bit of a low word that no slot uses (slot 63's): a summary marks wide sets with it.
pub(crate) const LOW_WORD_UNUSED: u64 = 1 << 63;

/// A set of slots. Its encoding is canonical: no trailing zero word, never empty.
///
/// The first word is held inline: most groups have at most 64 slots, and a summary holds a
/// set per group it lists, so a set costs 24 bytes and no allocation of its own (a `Vec`
/// cost the same 24 plus a 32-byte heap block).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SlotSet(SmallVec<[u64; 1]>);

impl SlotSet {
    /// The set of the slots of `word`'s bits 0..=62 (a summary's inline form).
    pub(crate) fn from_low_word(word: u64) -> SlotSet {
        debug_assert_eq!(word & LOW_WORD_UNUSED, 0);
        match word {
            0 => SlotSet::default(),
            w => SlotSet(smallvec![w]),
        }
    }

    /// The set as one word of slots 0..=62, if it has no other slot.
    pub(crate) fn as_low_word(&self) -> Option<u64> {
        match self.0.as_slice() {
            [] => Some(0),
            [w] if w & LOW_WORD_UNUSED == 0 => Some(*w),
            _ => None,
        }
    }

    /// Adds slots `first .. first + count`.
    pub fn insert_run(&mut self, first: u16, count: u16) {
        let end = usize::from(first) + usize::from(count);
        if end > 0 && self.0.len() <= (end - 1) / 64 {
            self.0.resize((end - 1) / 64 + 1, 0);
        }
        for slot in usize::from(first)..end {
            self.0[slot / 64] |= 1 << (slot % 64);
        }
    }

    /// Adds slot `slot`; false if it was already in the set.
    pub fn insert(&mut self, slot: u16) -> bool {
        let slot = usize::from(slot);
        if self.0.len() <= slot / 64 {
            self.0.resize(slot / 64 + 1, 0);
        }
        let (word, bit) = (&mut self.0[slot / 64], 1u64 << (slot % 64));
        let added = *word & bit == 0;
        *word |= bit;
        added
    }

    /// Removes slot `slot`; false if it was not in the set. Trailing zero words go, so equal
    /// sets compare equal.
    pub fn remove(&mut self, slot: u16) -> bool {
        let slot = usize::from(slot);
        let Some(word) = self.0.get_mut(slot / 64) else {
            return false;
        };
        let bit = 1u64 << (slot % 64);
        let present = *word & bit != 0;
        *word &= !bit;
        while self.0.last() == Some(&0) {
            self.0.pop();
        }
        present
    }

    /// The slots in the set, ascending.
    pub fn iter(&self) -> impl Iterator<Item = u16> + '_ {
        self.0
            .iter()
            .enumerate()
            .flat_map(|(i, &w)| set_bits(w).map(move |b| (i * 64 + b) as u16))
    }

    /// The slots in both sets, ascending.
    pub fn intersection<'a>(&'a self, other: &'a SlotSet) -> impl Iterator<Item = u16> + 'a {
        self.0
            .iter()
            .zip(&other.0)
            .enumerate()
            .flat_map(|(i, (a, b))| set_bits(a & b).map(move |bit| (i * 64 + bit) as u16))
    }

    pub fn contains(&self, slot: usize) -> bool {
        self.0
            .get(slot / 64)
            .is_some_and(|w| w & (1 << (slot % 64)) != 0)
    }

    /// Whether every slot of `first .. first + count` is in the set.
    pub fn contains_run(&self, first: u16, count: u16) -> bool {
        (usize::from(first)..usize::from(first) + usize::from(count)).all(|s| self.contains(s))
    }

    pub fn is_empty(&self) -> bool {
        self.0.iter().all(|w| *w == 0)
    }

    /// How many slots are in the set.
    pub fn len(&self) -> u64 {
        self.0.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// Adds every slot of `other`.
    pub fn union_with(&mut self, other: &SlotSet) {
        if self.0.len() < other.0.len() {
            self.0.resize(other.0.len(), 0);
        }
        for (a, b) in self.0.iter_mut().zip(&other.0) {
            *a |= b;
        }
    }

    /// The runs of consecutive slots in the set, as (first, count).
    pub fn runs(&self) -> Vec<(u16, u16)> {
        let mut out: Vec<(u16, u16)> = Vec::new();
        for slot in (0..self.0.len() * 64).filter(|s| self.contains(*s)) {
            match out.last_mut() {
                Some((first, count)) if usize::from(*first) + usize::from(*count) == slot => {
                    *count += 1
                }
                _ => out.push((slot as u16, 1)),
            }
        }
        out
    }

    /// `bytes B (u16, 1 ..= 8192) | B bytes`, bit s % 8 of byte s / 8 = slot s, without
    /// trailing zero bytes (a group of 16 slots costs 2 bytes, not a word).
    /// The bytes of the set's encoding after its length (the last non-zero byte's end).
    pub(crate) fn encoded_bytes(&self) -> u64 {
        let Some(last) = self.0.iter().rposition(|w| *w != 0) else {
            return 0;
        };
        last as u64 * 8 + u64::from(8 - self.0[last].leading_zeros() / 8)
    }

    pub(crate) fn encode_into(&self, e: &mut Encoder) {
        let bytes: Vec<u8> = self.0.iter().flat_map(|w| w.to_le_bytes()).collect();
        let used = bytes.iter().rposition(|b| *b != 0).map_or(0, |i| i + 1);
        debug_assert!(used > 0, "an empty slot set is not encoded");
        e.u16(used as u16);
        e.bytes(&bytes[..used]);
    }

    pub(crate) fn decode_from(d: &mut Decoder<'_>, what: &'static str) -> FormatResult<SlotSet> {
        let len = usize::from(d.u16()?);
        if len == 0 || len > MAX_BYTES {
            return Err(FormatError::invalid(
                what,
                format!("slot set of {len} bytes"),
            ));
        }
        let raw = d.take(len)?;
        if raw.last() == Some(&0) {
            return Err(FormatError::invalid(what, "slot set ends in a zero byte"));
        }
        let words = raw
            .chunks(8)
            .map(|c| {
                let mut w = [0u8; 8];
                w[..c.len()].copy_from_slice(c);
                u64::from_le_bytes(w)
            })
            .collect();
        Ok(SlotSet(words))
    }
}

/// The set bits of `w`, ascending.
fn set_bits(mut w: u64) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        (w != 0).then(|| {
            let b = w.trailing_zeros() as usize;
            w &= w - 1;
            b
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_union_and_bounds() {
        let mut a = SlotSet::default();
        assert!(a.is_empty());
        a.insert_run(0, 3);
        a.insert_run(70, 2);
        assert_eq!(a.runs(), vec![(0, 3), (70, 2)]);
        assert!(a.contains_run(0, 3) && !a.contains_run(2, 2));
        let mut b = SlotSet::default();
        b.insert_run(3, 1);
        b.insert_run(u16::MAX, 1);
        a.union_with(&b);
        assert_eq!(a.runs(), vec![(0, 4), (70, 2), (u16::MAX, 1)]);
        assert_eq!(a.len(), 7);
        let mut e = Encoder::new();
        a.encode_into(&mut e);
        let raw = e.finish();
        assert_eq!(raw.len(), 2 + MAX_BYTES);
        let back = SlotSet::decode_from(&mut Decoder::new(&raw, "t"), "t").unwrap();
        assert_eq!(back, a);
        a.insert_run(0, 0);
        assert_eq!(a.len(), 7);
        assert_eq!(
            a.iter().collect::<Vec<_>>(),
            vec![0, 1, 2, 3, 70, 71, u16::MAX]
        );
        assert_eq!(a.intersection(&b).collect::<Vec<_>>(), vec![3, u16::MAX]);
    }

    #[test]
    fn a_set_of_one_word_is_held_inline() {
        assert_eq!(std::mem::size_of::<SlotSet>(), 24);
        let mut a = SlotSet::default();
        a.insert_run(0, 64);
        assert!(!a.0.spilled());
        a.insert(64);
        assert!(a.0.spilled() && a.len() == 65);
    }

    #[test]
    fn insert_and_remove_keep_the_set_canonical() {
        let mut a = SlotSet::default();
        assert!(a.insert(200) && !a.insert(200) && a.insert(3));
        assert!(a.remove(200) && !a.remove(200) && !a.remove(9_000));
        let mut b = SlotSet::default();
        b.insert_run(3, 1);
        assert_eq!(a, b, "no trailing zero word after a removal");
        assert!(a.remove(3));
        assert_eq!(a, SlotSet::default());
        assert!(a.is_empty());
    }
}

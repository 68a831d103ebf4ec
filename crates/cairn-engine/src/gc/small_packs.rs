//! Small packs, merged: which packs `gc --repack-small` rewrites into full ones.

use std::collections::{HashMap, HashSet};

use cairn_format::Id;

/// Small packs worth merging however few bytes they hold: what they cost is a trailer read
/// each (a file open, or a ranged GET on S3), not their bytes.
const ENOUGH_SMALL_PACKS: usize = 32;

/// The packs `gc --repack-small` merges into full ones: those below a quarter of the pack
/// target that the index names, smallest first, at most four pack targets' worth a GC — and
/// none unless together they fill half a pack (the pack they become is then not small
/// itself) or number at least [`ENOUGH_SMALL_PACKS`]. Merging tiny packs into one still small
/// rewrites its bytes again at a later merge: at most a quarter of a pack each time, against
/// 32 trailer reads saved.
/// A commit of a few changed blocks writes a pack of its own; after many such commits a
/// tree's leaves name groups in as many packs, and a commit, a restore or an export reads a
/// trailer for each (756 for a commit after 1,000 such versions, against 18 after 10;
/// BENCHMARKS.md, *Studies behind the design*). `restic prune --repack-small` answers the same growth.
pub(super) fn small_packs(
    sizes: &HashMap<Id, u64>,
    named: &HashMap<Id, usize>,
    target: u64,
) -> HashSet<Id> {
    let mut small: Vec<(u64, Id)> = sizes
        .iter()
        .filter(|(pack, size)| named.contains_key(*pack) && **size < target / 4)
        .map(|(pack, size)| (*size, *pack))
        .collect();
    small.sort_unstable();
    let mut total = 0;
    let mut chosen = HashSet::new();
    for (size, pack) in small {
        if total + size > 4 * target {
            break;
        }
        total += size;
        chosen.insert(pack);
    }
    if total < target / 2 && chosen.len() < ENOUGH_SMALL_PACKS {
        chosen.clear();
    }
    chosen
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u32) -> Id {
        Id::of(&n.to_le_bytes())
    }

    #[test]
    fn small_packs_are_merged_once_they_fill_half_a_pack_or_are_many() {
        let target = 1000;
        let sizes = |list: &[(u32, u64)]| -> HashMap<Id, u64> {
            list.iter().map(|&(n, size)| (id(n), size)).collect()
        };
        let all = |n: u32| -> HashMap<Id, usize> { (0..n).map(|n| (id(n), 0)).collect() };
        // Three packs of 100 bytes: neither half a pack nor many.
        let few = sizes(&[(0, 100), (1, 100), (2, 100), (3, 900)]);
        assert!(small_packs(&few, &all(4), target).is_empty());
        // Two more: half a pack, and the large one and an unnamed one left out.
        let mut half = few.clone();
        half.extend(sizes(&[(4, 100), (5, 100), (6, 200)]));
        let chosen = small_packs(&half, &all(6), target);
        assert_eq!(chosen, [0, 1, 2, 4, 5].map(id).into_iter().collect());
        // 32 packs of 1 byte: many.
        let tiny = sizes(&(0..32).map(|n| (n, 1)).collect::<Vec<_>>());
        assert_eq!(small_packs(&tiny, &all(32), target).len(), 32);
        assert!(small_packs(&tiny, &all(31), target).is_empty());
        // At most four pack targets' worth, smallest first.
        let plenty = sizes(&(0..30).map(|n| (n, 200 + u64::from(n))).collect::<Vec<_>>());
        let chosen = small_packs(&plenty, &all(30), target);
        assert_eq!(chosen, (0..19).map(id).collect());
    }
}

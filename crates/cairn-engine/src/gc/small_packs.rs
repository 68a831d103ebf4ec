//! Small packs, merged: which packs `gc --repack-small` rewrites into full ones.

use std::collections::{HashMap, HashSet};

use cairn_format::Id;

/// The packs `gc --repack-small` merges into full ones: those below a quarter of the pack
/// target that the index names, smallest first, at most four pack targets' worth a GC — and
/// none unless together they fill half a pack, so the pack they become is not small itself.
/// A commit of a few changed blocks writes a pack of its own; after many such commits a
/// tree's leaves name groups in as many packs, and a commit, a restore or an export reads a
/// trailer for each (756 for a commit after 1,000 such versions, against 18 after 10;
/// BENCHMARKS §2). `restic prune --repack-small` answers the same growth.
pub(super) fn small_packs(
    sizes: &HashMap<Id, u64>,
    named: &HashSet<Id>,
    target: u64,
) -> HashSet<Id> {
    let mut small: Vec<(u64, Id)> = sizes
        .iter()
        .filter(|(pack, size)| named.contains(*pack) && **size < target / 4)
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
    if total < target / 2 {
        chosen.clear();
    }
    chosen
}

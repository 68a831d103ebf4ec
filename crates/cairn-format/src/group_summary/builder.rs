//! Building a [`GroupSummary`] from changes as a commit meets them: gathered, sorted in
//! batches, and merged in place.

use super::{key_of, union_sorted, GroupSummary, NotReferenced, Repeat};
use crate::slots::SlotSet;
use crate::Id;

/// Changes a [`SummaryBuilder`] gathers before it merges them in, at least: 128 KiB of runs.
/// A merge moves the summary's entries once (16 bytes each), so below 65,536 entries a
/// change costs at most 128 bytes moved (at 2^16 the waiting runs were 1 MiB, a third of a
/// 64 GiB re-commit's summary).
const BATCH: usize = 1 << 13;

/// The changes waiting are at most the summary's entries divided by this.
const WAITING_SHARE: usize = 8;

/// One change to a summary's references: a leaf occurrence's run added or removed.
#[derive(Debug, Clone, Copy)]
struct RunChange {
    key: u64,
    first: u16,
    count: u16,
    remove: bool,
}

/// Builds a [`GroupSummary`]: nodes and runs are gathered as they come (a commit meets its
/// groups in image order, their keys at random) and merged into the flat summary in sorted
/// batches, each one pass over it. Changes to one group apply in the order they were made,
/// so the result is that of applying each at once.
#[derive(Debug)]
pub struct SummaryBuilder {
    summary: GroupSummary,
    nodes: Vec<u64>,
    runs: Vec<RunChange>,
    /// A reference removed that was not there (the first met): the summary does not
    /// describe the tree it was given for ([`SummaryBuilder::finish`] returns it).
    failed: Option<NotReferenced>,
    /// Changes gathered at least before a merge ([`BATCH`]; smaller in tests).
    pub(super) min_batch: usize,
}

impl From<GroupSummary> for SummaryBuilder {
    /// Changes to `summary`.
    fn from(summary: GroupSummary) -> SummaryBuilder {
        SummaryBuilder {
            summary,
            nodes: Vec::new(),
            runs: Vec::new(),
            failed: None,
            min_batch: BATCH,
        }
    }
}

impl SummaryBuilder {
    /// An empty counted summary (a commit's: each leaf occurrence adds its runs).
    pub fn counted() -> SummaryBuilder {
        GroupSummary::counted().into()
    }

    /// An empty summary without counts (a union of trees).
    pub fn uncounted() -> SummaryBuilder {
        GroupSummary::default().into()
    }

    pub fn add_node(&mut self, id: &Id) {
        self.add_node_key(key_of(id));
    }

    /// [`Self::add_node`] by the node's key.
    pub fn add_node_key(&mut self, key: u64) {
        self.nodes.push(key);
        self.settle_if_due();
    }

    /// Adds a reference to slots `first .. first + count` of group `group` (one leaf
    /// occurrence's run).
    pub fn add_run(&mut self, group: &Id, first: u16, count: u16) {
        self.add_run_of_key(key_of(group), first, count);
    }

    /// [`Self::add_run`] by the group's key.
    pub fn add_run_of_key(&mut self, key: u64, first: u16, count: u16) {
        self.change(key, first, count, false);
    }

    /// Removes a reference to slots `first .. first + count` of group `group` from a
    /// counted summary (a leaf occurrence the tree dropped). A reference that is not there
    /// makes [`SummaryBuilder::finish`] fail.
    pub fn remove_run(&mut self, group: &Id, first: u16, count: u16) {
        assert!(
            self.summary.repeats.is_some(),
            "remove_run on a counted summary"
        );
        self.change(key_of(group), first, count, true);
    }

    /// The summary, or a reference removed that it did not hold.
    pub fn finish(mut self) -> Result<GroupSummary, NotReferenced> {
        self.settle();
        match self.failed {
            Some(e) => Err(e),
            None => Ok(self.summary),
        }
    }

    fn change(&mut self, key: u64, first: u16, count: u16, remove: bool) {
        if count == 0 {
            return;
        }
        self.runs.push(RunChange {
            key,
            first,
            count,
            remove,
        });
        self.settle_if_due();
    }

    /// Merges the changes once they are an eighth of the summary's entries (or [`BATCH`]):
    /// each merge is one pass, so a change costs about eight entries moved (128 bytes), and
    /// the changes waiting (16 bytes each, as an entry) stay near an eighth of its bytes.
    /// Waiting until they were as many as its entries cost 4.2 MiB of a 256 GiB re-commit's
    /// 70 MiB heap peak, beside the summary's 7.5.
    fn settle_if_due(&mut self) {
        let held = self.summary.nodes.len() + self.summary.groups.len();
        if self.nodes.len() + self.runs.len() >= (held / WAITING_SHARE).max(self.min_batch) {
            self.settle();
        }
    }

    fn settle(&mut self) {
        if !self.nodes.is_empty() {
            let mut nodes = std::mem::take(&mut self.nodes);
            nodes.sort_unstable();
            nodes.dedup();
            self.summary.nodes = union_sorted(std::mem::take(&mut self.summary.nodes), &nodes);
        }
        if self.runs.is_empty() {
            return;
        }
        let mut runs = std::mem::take(&mut self.runs);
        // Stable: one group's changes keep their order.
        runs.sort_by_key(|r| r.key);
        let s = &mut self.summary;
        let counted = s.repeats.is_some();
        // The groups are merged in place, from the back: the array grows by one placeholder
        // a changed key, and old entries move toward the end as the changes pass them. A
        // merge into a second array held both (64 bytes a group at the peak, 17 MiB of a
        // 256 GiB first commit's builder). Invariant: the gap between the old entries not
        // yet passed (`..read`) and those written (`write..`) is at least the changed keys
        // still to come, so a write never lands on an old entry not yet read.
        let changed = runs.chunk_by(|a, b| a.key == b.key).count();
        let old_repeats = s.repeats.take().unwrap_or_default();
        let mut new_counts: Vec<(u64, Vec<(u16, u32)>)> = Vec::new();
        let (groups, mut sets) = s.groups.edit();
        let mut read = groups.len();
        // Exactly: a doubled array would be up to twice the summary (a large one is moved
        // by remapping its pages, not copied).
        groups.reserve_exact(changed);
        groups.resize(read + changed, (0, 0));
        let mut write = groups.len();
        let mut at = old_repeats.len();
        for changes in runs.chunk_by(|a, b| a.key == b.key).rev() {
            let key = changes[0].key;
            while read > 0 && groups[read - 1].0 > key {
                read -= 1;
                write -= 1;
                groups.swap(read, write);
            }
            let (mut set, mut counts) = match read > 0 && groups[read - 1].0 == key {
                true => {
                    read -= 1;
                    let set = sets.take(groups[read]);
                    let counts = of_key_back(&old_repeats, &mut at, key);
                    (set, counts.iter().map(|r| (r.0 .1, r.1)).collect())
                }
                false => (SlotSet::default(), Vec::new()),
            };
            if self.failed.is_none() {
                if let Err(e) = apply(key, changes, counted, &mut set, &mut counts) {
                    self.failed = Some(e);
                }
            }
            if !set.is_empty() {
                write -= 1;
                groups[write] = (key, sets.put(key, set));
                if !counts.is_empty() {
                    new_counts.push((key, counts));
                }
            }
        }
        groups.drain(read..write);
        sets.finish();
        if counted {
            s.repeats = Some(merge_repeats(&old_repeats, &runs, new_counts));
        }
        runs.clear();
        self.runs = runs;
    }
}

/// The repeats of group `key` in `repeats` (ascending), just before `end`; `end` moves
/// before them. Keys are asked in descending order.
fn of_key_back<'a>(repeats: &'a [Repeat], end: &mut usize, key: u64) -> &'a [Repeat] {
    while *end > 0 && repeats[*end - 1].0 .0 > key {
        *end -= 1;
    }
    let stop = *end;
    while *end > 0 && repeats[*end - 1].0 .0 == key {
        *end -= 1;
    }
    &repeats[*end..stop]
}

/// A counted summary's repeats after a batch: the old ones of every group the batch did not
/// change, and `new_counts` (descending by key, as the merge made them) of those it did.
fn merge_repeats(
    old: &[Repeat],
    runs: &[RunChange],
    mut new_counts: Vec<(u64, Vec<(u16, u32)>)>,
) -> Vec<Repeat> {
    new_counts.reverse();
    let mut out = Vec::with_capacity(old.len());
    let mut changed = runs.iter().map(|r| r.key).peekable();
    let mut new = new_counts.into_iter().peekable();
    for &r in old {
        let key = r.0 .0;
        while let Some((k, counts)) = new.next_if(|(k, _)| *k < key) {
            out.extend(counts.into_iter().map(|(slot, n)| ((k, slot), n)));
        }
        while changed.next_if(|k| *k < key).is_some() {}
        if changed.peek() != Some(&key) {
            out.push(r);
        }
    }
    for (k, counts) in new {
        out.extend(counts.into_iter().map(|(slot, n)| ((k, slot), n)));
    }
    out
}

/// Applies one group's `changes` in order to its slot set and its repeats (`counts`: (slot,
/// repeats), ascending).
fn apply(
    key: u64,
    changes: &[RunChange],
    counted: bool,
    set: &mut SlotSet,
    counts: &mut Vec<(u16, u32)>,
) -> Result<(), NotReferenced> {
    for c in changes {
        let slots =
            (usize::from(c.first)..usize::from(c.first) + usize::from(c.count)).map(|s| s as u16);
        match (c.remove, counted) {
            (false, false) => set.insert_run(c.first, c.count),
            (false, true) => {
                for slot in slots {
                    if !set.insert(slot) {
                        match counts.binary_search_by_key(&slot, |e| e.0) {
                            Ok(i) => counts[i].1 = counts[i].1.saturating_add(1),
                            Err(i) => counts.insert(i, (slot, 1)),
                        }
                    }
                }
            }
            (true, _) => {
                for slot in slots {
                    match counts.binary_search_by_key(&slot, |e| e.0) {
                        Ok(i) if counts[i].1 == u32::MAX => {}
                        Ok(i) if counts[i].1 > 1 => counts[i].1 -= 1,
                        Ok(i) => {
                            counts.remove(i);
                        }
                        Err(_) if set.remove(slot) => {}
                        Err(_) => return Err(NotReferenced { group: key, slot }),
                    }
                }
            }
        }
    }
    Ok(())
}

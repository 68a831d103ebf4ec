//! The chunks a commit stores itself, and where each went once its group is built: how a
//! commit's workers dedup among themselves before anything is published.
//!
//! A claim costs about 41 bytes while it is in memory (id, group number and slot, a control
//! byte, at the map's load; the group's id is in a table per generation). Kept for a whole
//! commit they would be 160 MiB for a VM's first commit with 14 GiB of new data, the largest
//! part of a commit's memory (BENCHMARKS.md, *Studies behind the design*). Both modes keep two
//! *generations* of at most `generation` claims each; when the newer fills, the older
//! one's placed claims are spilled to sorted runs in scratch files (`spilled_claims`, 2 to 3
//! bytes a claim in memory) and still found. Exact mode spills every generation; bounded
//! mode within a memory budget ([`BOUNDED_SPILL_MEMORY`]), past which it forgets its oldest
//! runs: a chunk that comes again after that is stored twice, as bounded dedup's other
//! misses are (space, never correctness).
//!
//! A generation's claims fit a map of 2^15 buckets, so its map never doubles past that. The
//! maps are not made at that size up front: a small commit's claims would then touch pages
//! it does not need.
//!
//! Two kinds of claims are never forgotten: one not placed yet (its worker is still building
//! the group), and one another worker waits for (it saw the claim unplaced and asks for the
//! placement once its own segment is done). So every wait ends.
//!
//! Public so that the trace benchmark (`cairn-trace`) runs this type, not a copy of it.

use std::path::PathBuf;

use cairn_format::id_hash::IdMap;
use cairn_format::Id;
use cairn_repo::v2::Placement;

use super::spilled_claims::SpilledClaims;

/// Claims a generation holds by default: 108 MiB of 4 KiB chunks, which with the claims a
/// turn carries over (those in flight) stay within a map of 2^15 buckets at its 7/8 load:
/// 1.3 MiB ([`CLAIM_BYTES`] + 1 a bucket), 2.6 MiB for the two generations. Smaller
/// generations spill more often for little less memory (2^14 buckets: 1 MiB less at 64
/// GiB); generations of 2^17 buckets held 10 MiB.
pub const CLAIM_GENERATION: usize = (1 << 15) / 8 * 7 - 1024;

/// Memory bounded mode's spilled claims may take by default (their filter and fences): up
/// to about 1.7 million claims, and at least half as many once its oldest are dropped (3 to
/// 6 GiB of a commit's new data).
pub const BOUNDED_SPILL_MEMORY: usize = 4 << 20;

/// A claim's bytes in its generation's map (its id, group number and slot), without the map's
/// control byte.
pub const CLAIM_BYTES: usize = std::mem::size_of::<(Id, Held)>();

/// What a claim found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claimed {
    /// Claimed before by this commit: placed, or not yet (`None`).
    Before(Option<Placement>),
    /// New: the caller stores it.
    New,
}

/// Where a claimed chunk is, as a generation holds it: its group by number in the
/// generation's table of groups, and its slot; [`Held::UNPLACED`] before its group is
/// built. 8 bytes, where a [`Placement`] (the group's full id) made a claim 73 bytes at the
/// map's load instead of 41.
///
/// Public only in size ([`CLAIM_BYTES`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Held {
    group: u32,
    slot: u16,
}

impl Held {
    const UNPLACED: Held = Held {
        group: u32::MAX,
        slot: 0,
    };
}

/// One generation of claims, and the groups its placed claims are in.
#[derive(Debug, Default)]
struct Generation {
    claims: IdMap<Held>,
    groups: Vec<Id>,
}

impl Generation {
    fn get(&self, id: &Id) -> Option<Option<Placement>> {
        self.claims.get(id).map(|h| self.placement(*h))
    }

    fn placement(&self, h: Held) -> Option<Placement> {
        (h != Held::UNPLACED).then(|| Placement {
            group: self.groups[h.group as usize],
            slot: h.slot,
        })
    }

    /// The number of `group` in the table (a group is placed once, so it is appended; the
    /// last one is looked at for a claim re-filed with its neighbours).
    fn group_number(&mut self, group: Id) -> u32 {
        if self.groups.last() != Some(&group) {
            self.groups.push(group);
        }
        u32::try_from(self.groups.len() - 1).expect("fewer than 2^32 groups a generation")
    }

    fn insert(&mut self, id: Id, p: Option<Placement>) {
        let held = match p {
            Some(p) => Held {
                group: self.group_number(p.group),
                slot: p.slot,
            },
            None => Held::UNPLACED,
        };
        self.claims.insert(id, held);
    }
}

/// A commit's claims (see the module's doc).
#[derive(Debug, Default)]
pub struct Claims {
    current: Generation,
    previous: Generation,
    /// Claims other workers wait for, with how many wait.
    waited: IdMap<u32>,
    /// Claims a generation holds before the older one turns over; `None` keeps all.
    generation: Option<usize>,
    /// Where a turned-over generation's claims go (with `generation`).
    spill: Option<SpilledClaims>,
    /// Generations turned so far.
    turns: u64,
    /// Claims forgotten so far.
    pub forgotten: u64,
}

impl Claims {
    /// Every claim kept in memory (the trace benchmark's `--keep-all-claims`).
    pub fn keeping_all() -> Claims {
        Claims::default()
    }

    /// Generations of `generation` claims, the older spilled to scratch files in `dir`
    /// (`None`: the system's temporary directory) when the newer fills; their filter and
    /// fences within `budget` bytes (bounded mode: the oldest runs are forgotten to stay
    /// within it), or without limit (`None`: exact mode).
    pub fn spilling(generation: usize, dir: Option<PathBuf>, budget: Option<usize>) -> Claims {
        Claims {
            generation: Some(generation.max(1)),
            spill: Some(SpilledClaims::new(dir, budget)),
            ..Claims::default()
        }
    }

    /// Where the claim on `id` stands, if this commit claimed it and has not forgotten it.
    pub fn get(&self, id: &Id) -> Option<Option<Placement>> {
        self.current
            .get(id)
            .or_else(|| self.previous.get(id))
            .or_else(|| Some(Some(self.spill.as_ref()?.get(id)?)))
    }

    /// Claims spilled to scratch files, and the memory their filter and fences take.
    pub fn spilled(&self) -> (u64, usize) {
        self.spill
            .as_ref()
            .map_or((0, 0), |s| (s.spilled, s.memory()))
    }

    /// Claims held by the newer and the older generation (the trace benchmark's memory
    /// figure).
    pub fn held(&self) -> (usize, usize) {
        (self.current.claims.len(), self.previous.claims.len())
    }

    pub fn contains(&self, id: &Id) -> bool {
        self.current.claims.contains_key(id)
            || self.previous.claims.contains_key(id)
            || self.spill.as_ref().is_some_and(|s| s.get(id).is_some())
    }

    /// Where the claim on `id` stands, as [`Claims::get`]; a claim not placed yet is kept
    /// for the caller until it calls [`Claims::done_waiting`].
    pub fn find(&mut self, id: &Id) -> Option<Option<Placement>> {
        let p = self.get(id)?;
        if p.is_none() {
            self.wait_for(id);
        }
        Some(p)
    }

    /// Claims `id` for the caller unless this commit claimed it already (then as
    /// [`Claims::find`]).
    pub fn claim(&mut self, id: &Id) -> Claimed {
        if let Some(p) = self.find(id) {
            return Claimed::Before(p);
        }
        self.claim_new(id)
    }

    /// Generations turned so far: the spilled claims change only when this does.
    pub fn turns(&self) -> u64 {
        self.turns
    }

    /// [`Claims::claim`] for a caller that found no claim on `id` when [`Claims::turns`]
    /// was `turns` (and has since asked the index): the spilled runs are asked again only
    /// if a generation turned meanwhile, since until then they hold nothing newer. Each new
    /// chunk of an exact commit so asks them once, not twice.
    pub fn claim_after_miss(&mut self, id: &Id, turns: u64) -> Claimed {
        if turns != self.turns {
            return self.claim(id);
        }
        match self.current.get(id).or_else(|| self.previous.get(id)) {
            Some(p) => {
                if p.is_none() {
                    self.wait_for(id);
                }
                Claimed::Before(p)
            }
            None => self.claim_new(id),
        }
    }

    fn claim_new(&mut self, id: &Id) -> Claimed {
        self.current.claims.insert(*id, Held::UNPLACED);
        self.turn();
        Claimed::New
    }

    /// Records that `ids` are slots 0.. of group `group`.
    pub fn place(&mut self, ids: &[Id], group: Id) {
        let number = self.current.group_number(group);
        for (slot, id) in ids.iter().enumerate() {
            let held = Held {
                group: number,
                slot: slot as u16,
            };
            // Usually claimed in this generation: one probe. A claim carried over a turn
            // moves to the current generation.
            match self.current.claims.get_mut(id) {
                Some(at) => *at = held,
                None => {
                    self.previous.claims.remove(id);
                    self.current.claims.insert(*id, held);
                }
            }
        }
        self.turn();
    }

    /// Keeps the claim on `id` until [`Claims::done_waiting`]: a worker will ask for its
    /// placement.
    fn wait_for(&mut self, id: &Id) {
        *self.waited.entry(*id).or_default() += 1;
    }

    pub fn done_waiting(&mut self, id: &Id) {
        if let Some(n) = self.waited.get_mut(id) {
            *n -= 1;
            if *n == 0 {
                self.waited.remove(id);
            }
        }
    }

    /// Starts a new generation once the current one is full, forgetting (or spilling) the
    /// previous one's claims except those not placed or waited for (filed again in the
    /// generation that becomes the previous one, with their groups).
    fn turn(&mut self) {
        let Some(generation) = self.generation else {
            return;
        };
        if self.current.claims.len() < generation {
            return;
        }
        self.turns += 1;
        let older = std::mem::replace(&mut self.previous, std::mem::take(&mut self.current));
        let mut spilled = Vec::new();
        for (id, held) in &older.claims {
            match older.placement(*held) {
                Some(p) if !self.waited.contains_key(id) => spilled.push((*id, p)),
                placement => self.previous.insert(*id, placement),
            }
        }
        drop(older);
        if let Some(spill) = self.spill.as_mut() {
            self.forgotten += spill.spill(spilled);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u64) -> Id {
        let mut b = [0u8; 32];
        b[..8].copy_from_slice(&n.to_le_bytes());
        Id(b)
    }

    fn placed(claims: &mut Claims, n: u64) {
        assert_eq!(claims.claim(&id(n)), Claimed::New);
        claims.place(&[id(n)], id(1000 + n));
    }

    #[test]
    fn a_claim_is_its_id_and_eight_bytes() {
        assert_eq!(CLAIM_BYTES, 40);
    }

    #[test]
    fn exact_mode_keeps_every_claim() {
        let mut c = Claims::keeping_all();
        for n in 0..100 {
            placed(&mut c, n);
        }
        assert!((0..100).all(|n| c.contains(&id(n))));
        assert_eq!(c.forgotten, 0);
    }

    /// Exact mode with generations of 4 claims (spilled at every turn, the runs merged tier
    /// by tier): random claims, placements and waits, checked after each step against a
    /// model that keeps every claim in a map. Nothing is forgotten and every claim is where
    /// the model says.
    #[test]
    fn exact_mode_spills_and_still_finds_every_claim() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let dir = tempfile::tempdir().unwrap();
        let mut c = Claims::spilling(4, Some(dir.path().to_path_buf()), None);
        let mut model: std::collections::HashMap<Id, Option<Placement>> = Default::default();
        let (mut unplaced, mut waiting): (Vec<Id>, Vec<Id>) = (Vec::new(), Vec::new());
        for step in 0..4000u64 {
            match next(10) {
                0..=5 => {
                    let x = id(next(3000));
                    // Half the time as a worker claims in exact mode: a miss, then (while it
                    // asks the index) other workers' new claims, which may turn generations.
                    let got = if c.get(&x).is_some() || next(2) == 0 {
                        c.claim(&x)
                    } else {
                        let turns = c.turns();
                        // Sometimes another worker claims and places x meanwhile, and enough
                        // claims follow for x to be spilled: it must still be found.
                        let raced = next(3) == 0;
                        if raced {
                            assert_eq!(c.claim(&x), Claimed::New);
                            let group = id(2 << 40 | step);
                            c.place(&[x], group);
                            model.insert(x, Some(Placement { group, slot: 0 }));
                        }
                        for j in 0..if raced { 12 } else { next(6) } {
                            let other = id(1 << 32 | step << 4 | j);
                            assert_eq!(c.claim(&other), Claimed::New);
                            if raced {
                                c.place(&[other], other);
                                model.insert(
                                    other,
                                    Some(Placement {
                                        group: other,
                                        slot: 0,
                                    }),
                                );
                            } else {
                                model.insert(other, None);
                                unplaced.push(other);
                            }
                        }
                        c.claim_after_miss(&x, turns)
                    };
                    match (got, model.get(&x)) {
                        (Claimed::New, None) => {
                            model.insert(x, None);
                            unplaced.push(x);
                        }
                        (Claimed::Before(p), Some(m)) => {
                            assert_eq!(p, *m, "step {step}");
                            if p.is_none() {
                                waiting.push(x);
                            }
                        }
                        (got, m) => panic!("step {step}: {got:?} where the model has {m:?}"),
                    }
                }
                6..=8 if !unplaced.is_empty() => {
                    let n = (1 + next(4) as usize).min(unplaced.len());
                    let ids: Vec<Id> = unplaced.drain(..n).collect();
                    let group = id(1 << 40 | step);
                    c.place(&ids, group);
                    for (slot, x) in ids.iter().enumerate() {
                        let slot = slot as u16;
                        model.insert(*x, Some(Placement { group, slot }));
                    }
                }
                _ if !waiting.is_empty() => {
                    let x = waiting.swap_remove(next(waiting.len() as u64) as usize);
                    c.done_waiting(&x);
                }
                _ => {}
            }
            if step % 97 == 0 {
                for (x, p) in &model {
                    assert_eq!(c.get(x), Some(*p), "step {step}");
                }
            }
        }
        assert_eq!(c.forgotten, 0);
        let (spilled, memory) = c.spilled();
        assert!(spilled > 1000, "{spilled}");
        assert!(memory > 0);
        // Only the generations' claims and what is unplaced or waited for stay in memory.
        assert!(
            c.current.claims.len() + c.previous.claims.len() <= 8 + unplaced.len() + waiting.len()
        );
    }

    #[test]
    fn bounded_mode_forgets_the_older_generation_but_not_what_is_unplaced_or_waited_for() {
        // No memory for spilled claims: each turn forgets the older generation's.
        let mut c = Claims::spilling(4, None, Some(0));
        // 0: claimed, not placed; 1: placed, waited for; 2, 3: placed.
        assert_eq!(c.claim(&id(0)), Claimed::New);
        placed(&mut c, 1);
        c.wait_for(&id(1));
        placed(&mut c, 2);
        placed(&mut c, 3);
        // The first generation is full: it became the previous one, nothing forgotten yet.
        assert!((0..4).all(|n| c.contains(&id(n))));
        for n in 4..20 {
            placed(&mut c, n);
        }
        // Later turns forgot 2 and 3 (placed, not waited for) but kept 0 (unplaced) and 1
        // (waited for); the newest claims are held.
        assert!(c.forgotten >= 2);
        assert_eq!(c.get(&id(0)), Some(None));
        assert_eq!(
            c.get(&id(1)),
            Some(Some(Placement {
                group: id(1001),
                slot: 0
            }))
        );
        assert!(!c.contains(&id(2)) && !c.contains(&id(3)));
        assert!((17..20).all(|n| c.contains(&id(n))));
        // Never more than two generations and the kept claims.
        assert!(c.current.claims.len() + c.previous.claims.len() <= 2 * 4 + 2);
        // Claimed again once forgotten: new (the caller stores it a second time).
        assert_eq!(c.claim(&id(2)), Claimed::New);
        // Placing the unplaced claim records its place (once, in either generation).
        c.place(&[id(0)], id(2000));
        assert_eq!(
            c.get(&id(0)),
            Some(Some(Placement {
                group: id(2000),
                slot: 0
            }))
        );
        assert!(!(c.current.claims.contains_key(&id(0)) && c.previous.claims.contains_key(&id(0))));
        c.done_waiting(&id(1));
        assert!(c.waited.is_empty());
    }
}

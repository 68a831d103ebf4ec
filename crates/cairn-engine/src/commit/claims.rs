//! The chunks a commit stores itself, and where each went once its group is built: how a
//! commit's workers dedup among themselves before anything is published.
//!
//! Exact mode keeps every claim for the whole commit. It costs about 41 bytes a new chunk
//! (id, group number and slot, a control byte, at the map's load; the group's id is in a
//! table per generation): 160 MiB for a VM's first commit with 14 GiB of new data, the
//! largest part of a commit's memory (BENCHMARKS §2, "Trace benchmark"; 73 bytes a chunk,
//! 290 MiB, with the group's id in every claim before 2026-11-29). Bounded mode keeps two
//! *generations* of at most `generation` claims each and forgets the older one when the
//! newer fills: a chunk that comes again within the last
//! `generation` claims (432 MiB of new data by default) is found; one that comes again later
//! is stored twice, as bounded dedup's other misses are (space, never correctness). A
//! generation's claims fit a map of 2^17 buckets, so its map never doubles past that (the
//! generation of 2^17 claims before 2026-11-29 did: 45 MiB of a 64 GiB first commit's 72 MiB
//! heap peak). The maps are not made at that size up front: a small commit's claims would
//! then touch pages all over 9 MiB (a 1 GiB image's first commit: 30 → 37 MiB).
//!
//! Two kinds of claims are never forgotten: one not placed yet (its worker is still building
//! the group), and one another worker waits for (it saw the claim unplaced and asks for the
//! placement once its own segment is done). So every wait ends.
//!
//! Public so that the trace benchmark (`cairn-trace`) runs this type, not a copy of it.

use cairn_format::id_hash::IdMap;
use cairn_format::Id;
use cairn_repo::v2::Placement;

/// Claims a bounded commit keeps in a generation by default: 432 MiB of 4 KiB chunks, which
/// with the claims a turn carries over (those in flight) stay within a map of 2^17 buckets
/// at its 7/8 load: 5 MiB ([`CLAIM_BYTES`] + 1 a bucket), 10 MiB for the two generations.
/// (2^17 claims, the default until 2026-11-29, needed maps of 2^18 buckets of 73 bytes:
/// 38 MiB, 45 while growing.)
pub const BOUNDED_GENERATION: usize = (1 << 17) / 8 * 7 - 4096;

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
    /// Claims a generation holds before the older one is forgotten; `None` keeps all.
    generation: Option<usize>,
    /// Claims forgotten so far.
    pub forgotten: u64,
}

impl Claims {
    pub fn new(generation: Option<usize>) -> Claims {
        Claims {
            generation: generation.map(|g| g.max(1)),
            ..Claims::default()
        }
    }

    /// Where the claim on `id` stands, if this commit claimed it and has not forgotten it.
    pub fn get(&self, id: &Id) -> Option<Option<Placement>> {
        self.current.get(id).or_else(|| self.previous.get(id))
    }

    /// Claims held by the newer and the older generation (the trace benchmark's memory
    /// figure).
    pub fn held(&self) -> (usize, usize) {
        (self.current.claims.len(), self.previous.claims.len())
    }

    pub fn contains(&self, id: &Id) -> bool {
        self.current.claims.contains_key(id) || self.previous.claims.contains_key(id)
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

    /// Starts a new generation once the current one is full, forgetting the previous one's
    /// claims except those not placed or waited for (filed again in the generation that
    /// becomes the previous one, with their groups).
    fn turn(&mut self) {
        let Some(generation) = self.generation else {
            return;
        };
        if self.current.claims.len() < generation {
            return;
        }
        let older = std::mem::replace(&mut self.previous, std::mem::take(&mut self.current));
        for (id, held) in &older.claims {
            if *held == Held::UNPLACED || self.waited.contains_key(id) {
                self.previous.insert(*id, older.placement(*held));
            } else {
                self.forgotten += 1;
            }
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
        let mut c = Claims::new(None);
        for n in 0..100 {
            placed(&mut c, n);
        }
        assert!((0..100).all(|n| c.contains(&id(n))));
        assert_eq!(c.forgotten, 0);
    }

    #[test]
    fn bounded_mode_forgets_the_older_generation_but_not_what_is_unplaced_or_waited_for() {
        let mut c = Claims::new(Some(4));
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

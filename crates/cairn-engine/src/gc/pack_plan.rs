//! What becomes of every pack a GC run judges: kept, deleted, or rewritten with its live
//! groups only (a group whose dead slots are worth it rewritten without them).

use std::collections::{HashMap, HashSet};

use cairn_format::group::{Group, GroupBuilder};
use cairn_format::id_hash::IdMap;
use cairn_format::pack::BlobKind;
use cairn_format::pack_v2::PackGroup;
use cairn_format::slots::SlotSet;
use cairn_format::Id;
use cairn_repo::v2::{OpenedGroup, PackTrailer};
use cairn_repo::{Repo, RepoError};

use super::liveness::{Liveness, Snapshot};
use super::rebuild::Damaged;
use crate::error::{EngineError, EngineResult};

/// A group copied into a new pack is rewritten without its dead slots when they hold at
/// least this fraction of its stored plain bytes (below it, copying the stored bytes as they
/// are costs no compression and keeps almost the same space).
const TRIM_FRACTION: f64 = 0.125;

/// What becomes of every pack, from the marks.
pub(super) struct PackPlan {
    /// Per pack, the groups whose copy there is the one kept (live, storing every live slot).
    pub(super) canonical_in: HashMap<Id, Vec<u32>>,
    /// Per pack, the stored bytes of what is live in its canonical groups.
    pub(super) live_bytes: HashMap<Id, u64>,
    /// Dead groups and nodes of the packs that go.
    pub(super) dead: HashSet<Id>,
    pub(super) to_delete: Vec<Id>,
    pub(super) to_repack: Vec<Id>,
    pub(super) kept: Vec<Id>,
}

impl PackPlan {
    pub(super) fn new(
        snapshot: &Snapshot,
        marks: &(dyn Liveness + Sync),
        damaged: &Damaged,
        threshold: f64,
        small: &HashSet<Id>,
    ) -> PackPlan {
        // One copy of each live group or node is kept: one that stores every live slot,
        // else (damage elsewhere) one that stores some — never less than there is. Among
        // copies alike, one a relayout wrote (`Snapshot::layout`; of several, the latest
        // relayout's: the copy readers read), else the one in the pack of the earliest run (`Snapshot::named`): copies
        // that commits running at once each stored are then kept in one commit's packs,
        // which stay whole, and the others' packs lose them all. (pack, group, live
        // fraction, complete), by id; a quarantined copy is no copy (`rebuild.rs` deals with
        // those).
        let groups: usize = snapshot.trailers.values().map(|t| t.groups.len()).sum();
        let mut kept_copy: IdMap<(Id, u32, f64, bool)> =
            IdMap::with_capacity_and_hasher(groups, Default::default());
        let mut dead_in: HashMap<Id, Vec<Id>> = HashMap::new();
        for (pack, trailer) in &snapshot.trailers {
            for (g, group) in trailer.groups.iter().enumerate() {
                let g = g as u32;
                let gid = trailer.group_id(g).expect("a group of this trailer");
                let (id, live) = match group.kind {
                    BlobKind::Node => {
                        let id = group.desc.chunks[0].id;
                        (id, marks.node_used(&id).then_some((1.0, true)))
                    }
                    BlobKind::Data => {
                        (gid, live_fraction(group, marks.used_slots(&gid).as_deref()))
                    }
                };
                match live {
                    Some(_) if snapshot.reader.is_quarantined_copy(pack, &gid) => {}
                    Some((fraction, complete)) => {
                        let copy = (*pack, g, fraction, complete);
                        kept_copy
                            .entry(id)
                            .and_modify(|k| {
                                let run = |pack: &Id| snapshot.named.get(pack).copied();
                                // Layout copies first, the latest first (the one
                                // readers take); then the others, earliest run first.
                                let rank = |pack: &Id| match snapshot.layout.get(pack) {
                                    Some(&t) => (0, u64::MAX - t, 0),
                                    None => (1, 0, run(pack).unwrap_or(usize::MAX)),
                                };
                                let better = rank(pack) < rank(&k.0);
                                if (!k.3 && complete) || (k.3 == complete && better) {
                                    *k = copy;
                                }
                            })
                            .or_insert(copy);
                    }
                    None => dead_in.entry(*pack).or_default().push(id),
                }
            }
        }
        let mut canonical_in: HashMap<Id, Vec<u32>> = HashMap::new();
        let mut live_bytes: HashMap<Id, u64> = HashMap::new();
        for &(pack, g, fraction, _) in kept_copy.values() {
            canonical_in.entry(pack).or_default().push(g);
            let stored = snapshot.trailers[&pack].groups[g as usize].desc.stored_len;
            *live_bytes.entry(pack).or_default() += (f64::from(stored) * fraction).ceil() as u64;
        }
        for groups in canonical_in.values_mut() {
            groups.sort_unstable();
        }
        let (mut to_delete, mut to_repack, mut kept) = (Vec::new(), Vec::new(), Vec::new());
        let mut dead = HashSet::new();
        for (pack, trailer) in &snapshot.trailers {
            let payload: u64 = trailer
                .groups
                .iter()
                .map(|g| u64::from(g.desc.stored_len))
                .sum();
            let live = live_bytes.get(pack).copied().unwrap_or(0);
            // A pack holding a damaged copy is rewritten without it (so the repository
            // verifies clean again), unless that copy is all there is of something live.
            if damaged.pinned.contains(pack) {
                kept.push(*pack);
                continue;
            } else if !canonical_in.contains_key(pack) {
                to_delete.push(*pack);
            } else if damaged.holding.contains(pack)
                || small.contains(pack)
                || (live as f64) < threshold * payload.max(1) as f64
            {
                to_repack.push(*pack);
            } else {
                kept.push(*pack);
                continue;
            }
            dead.extend(dead_in.remove(pack).unwrap_or_default());
        }
        PackPlan {
            canonical_in,
            live_bytes,
            dead,
            to_delete,
            to_repack,
            kept,
        }
    }
}

/// The fraction of a data group's stored plain bytes that live slots hold, and whether this
/// copy stores every live slot (`None`: it stores no live slot).
fn live_fraction(group: &PackGroup, live: Option<&SlotSet>) -> Option<(f64, bool)> {
    let live = live?;
    let mut live_plain = 0u64;
    let mut complete = true;
    for (slot, c) in group.desc.chunks.iter().enumerate() {
        if live.contains(slot) {
            match c.stored {
                true => live_plain += u64::from(c.len),
                false => complete = false,
            }
        }
    }
    (live_plain > 0).then(|| {
        let fraction = live_plain as f64 / f64::from(group.desc.plain_len.max(1));
        (fraction, complete)
    })
}

/// Group `g` of `trailer`, read from its pack's bytes `data` and checked (never launder a
/// damaged group into a new pack), as it will be stored again: its stored bytes as they are,
/// or — when `live` slots leave at least [`TRIM_FRACTION`] dead — rewritten without the dead
/// ones; a data group compressed again at `recompress` when given (cold recompression).
pub(super) fn copy_group(
    repo: &Repo,
    trailer: &PackTrailer,
    g: u32,
    data: &[u8],
    live: Option<&SlotSet>,
    recompress: Option<i32>,
) -> EngineResult<Group> {
    let group = &trailer.groups[g as usize];
    let r = group.range();
    let where_ = || {
        format!(
            "{} group {g} (at byte {})",
            cairn_format::keys::pack(&trailer.pack),
            group.offset
        )
    };
    let stored = data.get(r.start as usize..r.end as usize).ok_or_else(|| {
        EngineError::Gc(format!(
            "{}: beyond the end of the pack; nothing was deleted",
            where_()
        ))
    })?;
    // Never launder damage into a new pack: the copy is quarantined and the GC starts over
    // without it (`gc::gc` runs once more on `BadBlob`).
    let opened = OpenedGroup::open(&group.desc, stored, repo.key()).map_err(|e| {
        let gid = trailer.group_id(g).expect("a group of this trailer");
        let reason = format!("{} is damaged: {e}", where_());
        if let Some(reader) = repo.v2() {
            reader.quarantine_copy(&trailer.pack, &gid, group.offset, &reason);
        }
        EngineError::Repo(RepoError::BadBlob {
            id: gid,
            pack: trailer.pack,
            offset: group.offset,
            source: cairn_format::FormatError::invalid("group", e.to_string()),
        })
    })?;
    if let Some(level) = recompress.filter(|_| group.kind == BlobKind::Data) {
        let again = super::recompress::recompressed(repo, trailer, g, opened.plain(), live, level);
        // Never store more than there was (an incompressible group stays as it is).
        if again.stored.len() < stored.len() {
            return Ok(again);
        }
    }
    let verbatim = || Group {
        stored: stored.to_vec(),
        desc: group.desc.clone(),
    };
    let Some(live) = live else {
        return Ok(verbatim());
    };
    let dead_plain: u64 = group
        .desc
        .chunks
        .iter()
        .enumerate()
        .filter(|(slot, c)| c.stored && !live.contains(*slot))
        .map(|(_, c)| u64::from(c.len))
        .sum();
    if (dead_plain as f64) < TRIM_FRACTION * f64::from(group.desc.plain_len.max(1)) {
        return Ok(verbatim());
    }
    Ok(
        GroupBuilder::repack(&group.desc, opened.plain(), |slot| live.contains(slot))
            .finish(repo.config().compression, repo.key()),
    )
}

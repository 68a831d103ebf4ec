//! The re-check after a GC run's wait: what commits published meanwhile reuse of what the
//! plan deletes is copied into rescue packs first.

use std::collections::BTreeMap;

use cairn_format::Id;
use cairn_repo::v2::V2Reader;
use cairn_repo::{Repo, RepoError};

use super::liveness::{Liveness, Marks, Snapshot};
use super::pack_plan::copy_group;
use super::repacker::Repacker;
use super::GcReport;
use crate::error::EngineResult;

/// Step 5: every node and group slot that versions published during the wait use (`used`)
/// and that the index as it is now (`now`: without the superseded runs) does not locate — a
/// dead group or node, or a slot a rewritten group dropped — is copied from the snapshot's
/// copy into a rescue pack, named by a rescue run (returned, with the packs written and their
/// sizes): a node whole, a group with the slots `live_use` or `used` names (the others dropped when they are worth it, as a
/// repack drops them).
///
/// Commits that saw the plan store their own copies of what it deletes and keep publishing
/// while the rescue reads, so before a pack's groups are copied the index is looked at again
/// and what it now locates is not copied (asked only once, before the reads, such a copy and
/// the rescue's were both kept: duplicates for `gc --repair`).
pub(super) async fn rescue(
    repo: &Repo,
    snapshot: &Snapshot,
    now: &V2Reader,
    used: &Marks,
    live_use: &(dyn Liveness + Send + Sync),
    report: &mut GcReport,
) -> EngineResult<Option<(Id, Vec<(Id, u64)>)>> {
    // (pack, group) of the snapshot's copy -> what newcomers need from it.
    let mut wanted: BTreeMap<(Id, u32), Vec<Need>> = BTreeMap::new();
    for node in &used.nodes {
        let need = Need::Node(*node);
        if !need.missing_in(now).await? {
            continue;
        }
        if let Ok((trailer, at)) = snapshot.reader.locate_chunk(node).await {
            wanted
                .entry((trailer.pack, at.group))
                .or_default()
                .push(need);
        }
    }
    for (group, slots) in &used.slots {
        let runs = slots.runs();
        if !slots_missing(now, group, &runs).await? {
            continue;
        }
        if let Ok(loc) = snapshot.reader.locate_group_storing(group, &runs).await {
            if loc.stores(&runs) {
                let copy = (loc.trailer.pack, loc.group);
                wanted
                    .entry(copy)
                    .or_default()
                    .push(Need::Slots(*group, runs));
            }
        }
    }
    if wanted.is_empty() {
        return Ok(None);
    }
    let mut writer = Repacker::new(repo);
    let packs: Vec<Id> = wanted.keys().map(|(pack, _)| *pack).collect();
    let mut last_read = None;
    for pack in packs {
        if last_read == Some(pack) {
            continue;
        }
        last_read = Some(pack);
        let bytes = repo.read_whole_pack(&pack).await?;
        // Copies published while this pack was read make the rescue's own unneeded. A view
        // that cannot be read now only costs duplicates: the copies are made as planned.
        let fresh = repo.v2_view().await.ok().map(|(reader, _)| reader);
        let trailer = &snapshot.trailers[&pack];
        for ((_, g), needs) in wanted.range((pack, 0)..=(pack, u32::MAX)) {
            if let Some(fresh) = &fresh {
                let mut still = false;
                for need in needs {
                    still |= need.missing_in(fresh).await?;
                }
                if !still {
                    continue;
                }
            }
            report.rescued_blobs += 1;
            // What the versions live at the decision use, and what the newcomers use:
            // nothing else can reach this copy (later sessions saw the plan), so the slots
            // neither uses are dropped as a repack drops them, rather than kept for
            // `gc --repair`.
            let mut live = live_use.live_slots(trailer, *g);
            if let Some(slots) = live.as_mut() {
                let gid = trailer.group_id(*g).expect("a group of this trailer");
                if let Some(newer) = used.used_slots(&gid) {
                    slots.union_with(&newer);
                }
            }
            let group = copy_group(repo, trailer, *g, &bytes, live.as_ref(), None)?;
            report.repacked_bytes += u64::from(group.desc.stored_len);
            writer
                .push(trailer.groups[*g as usize].kind, group, live.as_ref())
                .await?;
        }
    }
    let locations = writer.finish().await?;
    if report.rescued_blobs == 0 {
        return Ok(None);
    }
    tracing::info!(
        groups = report.rescued_blobs,
        "rescued groups and nodes used by concurrent commits"
    );
    report.packs_written += writer.written.len() as u64;
    let run = repo.put_run_entries(locations, repo.key()).await?.0;
    Ok(Some((run, writer.written)))
}

/// What a version published during a GC's wait needs from a copy the plan deletes.
pub(super) enum Need {
    Node(Id),
    /// A group's slots, as runs (first, count).
    Slots(Id, Vec<(u16, u16)>),
}

impl Need {
    /// True if `view` locates no copy that serves it.
    pub(super) async fn missing_in(&self, view: &V2Reader) -> EngineResult<bool> {
        match self {
            Need::Node(id) => Ok(view.find_chunk(id).await?.is_none()),
            Need::Slots(group, runs) => slots_missing(view, group, runs).await,
        }
    }
}

/// True if `view` locates no copy of group `group` storing slots `runs`.
async fn slots_missing(view: &V2Reader, group: &Id, runs: &[(u16, u16)]) -> EngineResult<bool> {
    match view.locate_group_storing(group, runs).await {
        Ok(loc) => Ok(!loc.stores(runs)),
        Err(RepoError::BlobMissing { .. }) => Ok(true),
        Err(e) => Err(e.into()),
    }
}

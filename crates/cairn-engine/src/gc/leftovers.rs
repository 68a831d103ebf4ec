//! What killed processes leave outside the data GC plans: the local store's temporary files
//! (a writer killed between writing a temporary and linking it into place), partial files of
//! killed restores on this host, version records of commits that never published them, and
//! boot profiles of images that are gone.
//!
//! None of this needs the plan-and-wait protocol: a leftover is recognised by its age against
//! the start of every session that is still alive. A writer that is alive started after
//! `before` (the oldest live session's start, minus the clock-skew margin), so everything it
//! writes is newer than that; anything older belongs to a process that is gone.

use std::time::{Duration, UNIX_EPOCH};

use cairn_format::Id;
use cairn_repo::session::{liveness, now_ns, Liveness};
use cairn_repo::Repo;

use super::{GcOptions, GcReport, CLOCK_SKEW_MARGIN};
use crate::error::EngineResult;
use crate::live::LiveVersions;

/// The time (ns since the epoch) before which no live session started, minus the margin.
pub(super) async fn oldest_live_start(repo: &Repo, options: &GcOptions) -> EngineResult<i64> {
    let now = now_ns();
    let mut oldest = now;
    for (_, session) in repo.sessions().await? {
        let Some(s) = session else { continue };
        if liveness(&s, now, options.stale_after) == Liveness::Alive {
            oldest = oldest.min(s.started_ns);
        }
    }
    Ok(oldest - CLOCK_SKEW_MARGIN.as_nanos() as i64)
}

/// Removes stale temporary files of the store and stale partial files of restores on this
/// host, counting them in `report`.
pub(super) async fn remove_stale_files(
    repo: &Repo,
    options: &GcOptions,
    report: &mut GcReport,
) -> EngineResult<()> {
    let before_ns = oldest_live_start(repo, options).await?;
    let before = UNIX_EPOCH + Duration::from_nanos(before_ns.max(0) as u64);
    let (n, bytes) = repo.remove_stale_temporaries(before).await?;
    report.temporaries_removed += n;
    report.temporary_bytes_removed += bytes;
    for (path, size) in crate::restore::partial::remove_stale() {
        tracing::info!(path = %path.display(), "removed the partial file of a killed restore");
        report.partial_files_removed += 1;
        report.partial_bytes_removed += size;
    }
    remove_orphan_profiles(repo, report).await
}

/// Removes the boot profiles of images that have no head (`rm IMAGE` removes its profile
/// itself; a crash between the two, or an export that recorded while the image was removed,
/// leaves one). A profile is only a hint, so no session protocol guards it.
async fn remove_orphan_profiles(repo: &Repo, report: &mut GcReport) -> EngineResult<()> {
    let images: std::collections::HashSet<String> = repo.images().await?.into_iter().collect();
    for image in repo.boot_profile_images().await? {
        if !images.contains(&image) && repo.remove_boot_profile(&image).await? {
            tracing::info!(image, "removed the boot profile of an image that is gone");
            report.profiles_removed += 1;
        }
    }
    Ok(())
}

/// Deletes the version records of commits that never published them (`live.unpublished`:
/// they lost their ref race and died, or were killed between writing the record and swapping
/// the ref) once they are older than the oldest live session (a commit that is still running
/// wrote its record after its session started, so it is younger). Records no ref reaches
/// that were published (`live.strays`) are never deleted here.
pub(super) async fn remove_orphan_records(
    repo: &Repo,
    live: &LiveVersions,
    options: &GcOptions,
    report: &mut GcReport,
) -> EngineResult<()> {
    let before_ns = oldest_live_start(repo, options).await?;
    for (id, record) in &live.unpublished {
        if record.time_ns < before_ns {
            repo.delete_orphan_version(id).await?;
            report.orphan_records_removed += 1;
        }
    }
    Ok(())
}

/// Deletes the quarantine markers of copies whose pack no longer exists (deleted or repacked
/// by this or an earlier GC), and the layout markers of such packs: a marker only matters
/// while its copy is there. `packs` are packs
/// known to exist; any other marker's pack is asked for (it may be one another session wrote
/// during this GC, whose copy a reader quarantined meanwhile).
///
/// A marker of a whole pack found missing (`pack` = `blob`) is evidence that what it held is
/// lost, not that a GC deleted it: it stays (so that commits keep checking what they reuse)
/// unless `nothing_lost` — the exact pass found every group a live version uses in a pack
/// that exists.
pub(super) async fn remove_stale_markers(
    repo: &Repo,
    packs: &std::collections::HashMap<Id, u64>,
    nothing_lost: bool,
) -> EngineResult<()> {
    for (pack, blob) in repo.quarantine_markers().await? {
        if blob == pack && !nothing_lost {
            continue;
        }
        if !packs.contains_key(&pack) && !repo.pack_exists(&pack).await? {
            repo.delete_quarantine_marker(&pack, &blob).await?;
        }
    }
    // Layout markers the same way: a relayout stores its pack before marking it.
    for (pack, time) in repo.layout_markers().await? {
        if !packs.contains_key(&pack) && !repo.pack_exists(&pack).await? {
            repo.delete_layout_marker(&pack, time).await?;
        }
    }
    Ok(())
}

//! Removing versions and images (`cairn rm`).
//!
//! Removing a version writes a deletion marker: the version can no longer be named or
//! restored, `history` skips it, and its record stays as a link in its image's parent chain.
//! Removing an image drops its head, its tags and its boot profile. Neither frees space by itself: data that no
//! live version uses any more is reclaimed by `cairn gc`. Data a clone still uses stays.

use std::collections::HashSet;

use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::Repo;

use crate::error::{EngineError, EngineResult};
use crate::resolve::{history, resolve, VersionSpec};
use crate::retention::tag_name;

/// Marks the versions `specs` name deleted. Everything is checked first: if any spec does
/// not resolve, or names a tagged version, nothing is changed. Returns the removed versions
/// (each once, in the order given).
pub async fn remove_versions(
    repo: &Repo,
    specs: &[VersionSpec],
) -> EngineResult<Vec<(Id, VersionRecord)>> {
    let mut targets: Vec<(Id, VersionRecord)> = Vec::with_capacity(specs.len());
    let mut seen = HashSet::new();
    for spec in specs {
        let (id, record) = resolve(repo, spec).await?;
        if seen.insert(id) {
            targets.push((id, record));
        }
    }
    refuse_tagged(repo, &targets).await?;
    for (id, record) in &targets {
        repo.mark_deleted(id).await?;
        tracing::info!(image = %record.image, seq = record.seq, %id, "removed version");
    }
    Ok(targets)
}

/// Refuses (changing nothing) if a tag names one of `targets`, or a live VM version binds
/// one as its disk.
async fn refuse_tagged(repo: &Repo, targets: &[(Id, VersionRecord)]) -> EngineResult<()> {
    let images: Vec<&str> = targets.iter().map(|(_, r)| r.image.as_str()).collect();
    let bound = crate::vm::bound_versions(repo, &images).await?;
    for (id, record) in targets {
        if let Some(vm_version) = bound.get(id) {
            return Err(EngineError::BoundToVm {
                version: format!("{}@{}", record.image, record.seq),
                vm_version: vm_version.clone(),
            });
        }
    }
    let (tags, _damaged) = repo.all_tag_targets_checked().await?;
    for (id, record) in targets {
        if let Some((key, _)) = tags.iter().find(|(_, t)| t == id) {
            return Err(EngineError::Tagged {
                image: record.image.clone(),
                version: format!("{}@{}", record.image, record.seq),
                tag: tag_name(key),
            });
        }
    }
    Ok(())
}

/// What removing a whole image took away.
#[derive(Debug, Clone)]
pub struct RemovedImage {
    pub image: String,
    /// The image's live versions at the time, newest first.
    pub versions: Vec<(Id, VersionRecord)>,
}

/// The versions removing `image` would take away, newest first; an error if it cannot be
/// removed: it does not exist, or a tag names one of its versions (tags protect versions from
/// `rm IMAGE` as from `rm IMAGE@N`). Changes nothing.
pub async fn image_removal(repo: &Repo, image: &str) -> EngineResult<Vec<(Id, VersionRecord)>> {
    let versions = history(repo, image).await?; // also: the image must exist
    refuse_tagged(repo, &versions).await?;
    Ok(versions)
}

/// Removes `image`: its head and every version ([`image_removal`] says what, or why not).
pub async fn remove_image(repo: &Repo, image: &str) -> EngineResult<RemovedImage> {
    let versions = image_removal(repo, image).await?;
    // Its versions are marked deleted first, then its refs go: a crash in between leaves an
    // image whose versions are all deleted (`rm IMAGE` again finishes), never published
    // records that no ref reaches, which GC must keep (`live::Stray`: it cannot tell them
    // from an image whose head was lost).
    for (id, _) in &versions {
        repo.mark_deleted(id).await?;
    }
    repo.remove_image(image).await?;
    // Its boot profile goes with it (GC removes one a crash left here).
    repo.remove_boot_profile(image).await?;
    tracing::info!(image, versions = versions.len(), "removed image");
    Ok(RemovedImage {
        image: image.to_string(),
        versions,
    })
}

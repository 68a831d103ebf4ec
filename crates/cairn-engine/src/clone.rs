//! CLONE (BlobSeer): a new image whose first version is an existing version.
//!
//! A clone is one new version record pointing at the source's manifest root, with the source
//! version as its parent. Nothing else is written — no data, no manifest node, no index file —
//! so cloning costs the same for a 4 KiB image and a 4 TiB one. The two images then evolve
//! independently and share every unchanged subtree by id.

use cairn_format::name::validate_image_name;
use cairn_format::refs;
use cairn_format::version::{CommitStats, VersionRecord};
use cairn_format::Id;
use cairn_repo::Repo;

use crate::error::{EngineError, EngineResult};
use crate::resolve::{resolve, VersionSpec};

/// Clones the version `source` names into a new image `new_image` (which must not exist).
/// `message` defaults to `clone of IMAGE@N`. Returns the new image's first version.
pub async fn clone_version(
    repo: &Repo,
    source: &VersionSpec,
    new_image: &str,
    message: Option<String>,
) -> EngineResult<(Id, VersionRecord)> {
    validate_image_name(new_image)?;
    let (source_id, src) = resolve(repo, source).await?;
    // A cheap early refusal; the compare-and-swap below is what actually decides.
    if repo.head(new_image).await?.is_some() {
        return Err(already_exists(new_image));
    }
    let time_ns = cairn_repo::session::now_ns();
    let mut record = VersionRecord {
        image: new_image.to_string(),
        seq: 1,
        parent: Some(source_id),
        time_ns,
        logical_size: src.logical_size,
        root: src.root,
        height: src.height,
        segment_size: src.segment_size,
        fanout: src.fanout,
        stats: CommitStats {
            data_bytes: src.stats.data_bytes,
            chunks: src.stats.chunks,
            new_chunks: 0,
            new_chunk_bytes: 0,
            stored_bytes: 0,
        },
        message: message.unwrap_or_else(|| format!("clone of {}@{}", src.image, src.seq)),
    };
    // As in commit: the record's length does not depend on the figure, so it counts itself
    // and the ref.
    record.stats.stored_bytes = record.encode().len() as u64 + refs::encode(&Id::ZERO).len() as u64;
    let (id, _) = repo.put_version(&record).await?;
    if !repo.swap_head(new_image, None, &id).await? {
        // Someone created the image meanwhile; the record just written stays unreferenced
        // (GC removes it).
        return Err(already_exists(new_image));
    }
    tracing::info!(image = new_image, source = %source_id, %id, "cloned");
    Ok((id, record))
}

fn already_exists(image: &str) -> EngineError {
    EngineError::Exists(format!("image {image:?} already exists"))
}

//! Repository-wide figures.

use std::collections::{BTreeSet, HashSet};

use cairn_format::pack::BlobKind;
use cairn_repo::Repo;

use crate::error::EngineResult;
use crate::live::live_versions;

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RepoStats {
    /// Images with at least one live version.
    pub images: u64,
    /// Live versions (reachable from a head or tag, not deleted).
    pub versions: u64,
    /// Logical size summed over every live version.
    pub logical_bytes: u64,
    /// Non-zero logical bytes summed over every live version.
    pub data_bytes: u64,
    /// Every byte the repository occupies in its store.
    pub stored_bytes: u64,
    pub packs: u64,
    pub pack_bytes: u64,
    pub metadata_bytes: u64,
    /// Distinct blobs (chunks and manifest nodes) indexed.
    pub blobs: u64,
    /// Manifest tree nodes indexed, and their stored (compressed) bytes inside the packs:
    /// the part of `pack_bytes` that is metadata rather than disk data.
    pub tree_nodes: u64,
    pub tree_bytes: u64,
}

pub async fn repo_stats(repo: &Repo) -> EngineResult<RepoStats> {
    let mut s = RepoStats::default();
    let space = repo.stored_space().await?;
    s.packs = space.packs;
    s.pack_bytes = space.pack_bytes;
    s.metadata_bytes = space.metadata_bytes;
    s.stored_bytes = space.pack_bytes + space.metadata_bytes;
    let live = live_versions(repo).await?;
    let mut images = BTreeSet::new();
    for record in live.live.values() {
        s.versions += 1;
        s.logical_bytes += record.logical_size;
        s.data_bytes += record.stats.data_bytes;
        images.insert(record.image.clone());
    }
    s.images = images.len() as u64;
    match repo.v2() {
        None => {
            s.blobs = repo.index().len() as u64;
            (s.tree_nodes, s.tree_bytes) = repo.index().totals(BlobKind::Node);
        }
        // Format 2: from the trailers of the packs the index runs name (each read once).
        Some(v2) => {
            let mut blobs = HashSet::new();
            for pack in v2.packs().await? {
                let trailer = v2.trailer(&pack).await?;
                for g in &trailer.groups {
                    let stored = g.desc.chunks.iter().filter(|c| c.stored);
                    blobs.extend(stored.map(|c| c.id));
                    if g.kind == BlobKind::Node {
                        s.tree_nodes += 1;
                        s.tree_bytes += u64::from(g.desc.stored_len);
                    }
                }
            }
            s.blobs = blobs.len() as u64;
        }
    }
    Ok(s)
}

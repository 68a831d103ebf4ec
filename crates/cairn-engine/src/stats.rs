//! Repository-wide figures, and where one version's data lies in the packs.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use cairn_format::leaf_v2::RunExtent;
use cairn_format::pack::BlobKind;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::Repo;

use crate::error::{EngineError, EngineResult};
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

/// Where one version's data lies in the packs: what a restore of it reads (CloudVS's
/// fragmentation, §3.3). Groups near each other in one pack are read at once; a version whose
/// chunks were stored by many commits takes many reads, each a seek on a disk or a request
/// on S3.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VersionLayout {
    /// Non-zero bytes the version's leaves name (segments that repeat counted each time).
    pub data_bytes: u64,
    /// Distinct groups the leaves name, and their stored bytes.
    pub groups: u64,
    pub group_bytes: u64,
    /// Packs those groups lie in.
    pub packs: u64,
    /// Ranged reads of the packs a restore makes for them (groups of one pack near each
    /// other share one: `cairn_repo::v2::ranged_reads`).
    pub reads: u64,
}

impl VersionLayout {
    /// Reads per GiB of data restored (0 for a version without data).
    pub fn reads_per_gib(&self) -> f64 {
        match self.data_bytes {
            0 => 0.0,
            n => self.reads as f64 / (n as f64 / f64::from(1u32 << 30)),
        }
    }
}

/// The layout of `record`'s data: every leaf read once, every group located as a restore
/// locates it (the copy storing the slots the version uses). Format 2 only.
pub async fn version_layout(
    repo: &Arc<Repo>,
    record: &VersionRecord,
) -> EngineResult<VersionLayout> {
    let Some(v2) = repo.v2() else {
        return Err(EngineError::BadInput(
            "where a version's data lies is reported for format 2 repositories only".into(),
        ));
    };
    let mut layout = VersionLayout::default();
    let mut leaves: HashMap<Id, u64> = HashMap::new();
    for leaf in crate::tree::leaf_map(repo, record).await?.into_values() {
        *leaves.entry(leaf).or_default() += 1;
    }
    let mut wanted: BTreeMap<Id, Vec<(u16, u16)>> = BTreeMap::new();
    for (id, times) in &leaves {
        crate::interrupt::check()?;
        let leaf = crate::commit::base_summary::read_leaf(repo, id).await?;
        let data: u64 = leaf
            .extents()
            .iter()
            .filter(|e| matches!(e, RunExtent::Run { .. }))
            .map(|e| u64::from(e.len()))
            .sum();
        layout.data_bytes += data * times;
        for (group, first, count) in leaf.group_runs() {
            wanted.entry(group).or_default().push((first, count));
        }
    }
    let mut spans: Vec<(Id, std::ops::Range<u64>)> = Vec::with_capacity(wanted.len());
    for (group, runs) in &wanted {
        crate::interrupt::check()?;
        let loc = v2.locate_group_storing(group, runs).await?;
        let range = loc.trailer.groups[loc.group as usize].range();
        layout.group_bytes += range.end - range.start;
        spans.push((loc.trailer.pack, range));
    }
    spans.sort_unstable_by_key(|(pack, range)| (*pack, range.start));
    layout.groups = spans.len() as u64;
    layout.reads = cairn_repo::v2::ranged_reads(&spans);
    let packs: HashSet<Id> = spans.iter().map(|(pack, _)| *pack).collect();
    layout.packs = packs.len() as u64;
    Ok(layout)
}

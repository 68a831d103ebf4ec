//! Repository-wide figures, and where one version's data lies in the packs.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;

use cairn_format::leaf_v2::RunExtent;
use cairn_format::pack::BlobKind;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::v2::GroupLocation;
use cairn_repo::Repo;

use crate::error::{EngineError, EngineResult};
use crate::live::live_versions;
use crate::restore::LEAVES_PER_READ;

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
/// fragmentation, §3.3). A restore reads its leaves in batches (`restore::window`), each
/// batch's groups in as few ranged reads as their places allow (groups of one pack near each
/// other share one); a version whose chunks were stored by many commits takes many reads,
/// each a seek on a disk or a request on S3.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VersionLayout {
    /// Non-zero bytes the version's leaves name (segments that repeat counted each time).
    pub data_bytes: u64,
    /// Distinct groups the leaves name, and their stored bytes.
    pub groups: u64,
    pub group_bytes: u64,
    /// Packs those groups lie in.
    pub packs: u64,
    /// Ranged reads of the packs a restore makes for them, batch by batch
    /// (`cairn_repo::v2::ranged_reads` over each batch's groups).
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

/// One batch of leaves a restore reads together: its groups, each once, in the order the
/// leaves name them, located as a restore locates them (the copy storing the slots used),
/// and the ranged reads they take.
pub(crate) struct ReadBatch {
    pub(crate) groups: Vec<GroupLocation>,
    pub(crate) reads: u64,
    /// The reads the same groups would take stored side by side, in order (more than one
    /// when they exceed what one read may span).
    pub(crate) fewest_reads: u64,
}

/// What [`ReadBatch::fewest_reads`] leaves between groups stored side by side: their frames
/// (33 bytes and more, with a slot list up to 37 bytes a slot), generously, so that groups
/// already side by side never count as scattered.
const FRAME_ALLOWANCE: u64 = 4096;

/// The batches a restore of `record` reads (format 2 only), and the non-zero bytes its
/// leaves name.
pub(crate) async fn read_batches(
    repo: &Arc<Repo>,
    record: &VersionRecord,
) -> EngineResult<(Vec<ReadBatch>, u64)> {
    let Some(v2) = repo.v2() else {
        return Err(EngineError::BadInput(
            "where a version's data lies is reported for format 2 repositories only".into(),
        ));
    };
    let leaves: Vec<Id> = crate::tree::leaf_map(repo, record)
        .await?
        .into_values()
        .collect();
    // Per distinct leaf: its data bytes and its group runs (group, first, count) in order.
    type LeafRuns = (u64, Vec<(Id, u16, u16)>);
    let mut read: HashMap<Id, LeafRuns> = HashMap::new();
    let mut data_bytes = 0;
    let mut batches = Vec::with_capacity(leaves.len().div_ceil(LEAVES_PER_READ));
    for batch in leaves.chunks(LEAVES_PER_READ) {
        let mut runs: HashMap<Id, Vec<(u16, u16)>> = HashMap::new();
        let mut order = Vec::new();
        for id in batch {
            crate::interrupt::check()?;
            if !read.contains_key(id) {
                let leaf = crate::commit::base_summary::read_leaf(repo, id).await?;
                let data: u64 = leaf
                    .extents()
                    .iter()
                    .filter(|e| matches!(e, RunExtent::Run { .. }))
                    .map(|e| u64::from(e.len()))
                    .sum();
                read.insert(*id, (data, leaf.group_runs().collect()));
            }
            let (data, leaf_runs) = &read[id];
            data_bytes += data;
            for &(group, first, count) in leaf_runs {
                let entry = runs.entry(group).or_default();
                if entry.is_empty() {
                    order.push(group);
                }
                entry.push((first, count));
            }
        }
        let mut groups = Vec::with_capacity(order.len());
        for group in &order {
            groups.push(v2.locate_group_storing(group, &runs[group]).await?);
        }
        let mut spans: Vec<(Id, std::ops::Range<u64>)> = groups
            .iter()
            .map(|g| (g.trailer.pack, g.trailer.groups[g.group as usize].range()))
            .collect();
        spans.sort_unstable_by_key(|(pack, range)| (*pack, range.start));
        let reads = cairn_repo::v2::ranged_reads(&spans);
        let mut end = 0;
        let side_by_side: Vec<(Id, std::ops::Range<u64>)> = spans
            .iter()
            .map(|(_, range)| {
                let start = end;
                end += range.end - range.start;
                let spanned = (Id::ZERO, start..end);
                end += FRAME_ALLOWANCE;
                spanned
            })
            .collect();
        let fewest_reads = cairn_repo::v2::ranged_reads(&side_by_side);
        batches.push(ReadBatch {
            groups,
            reads,
            fewest_reads,
        });
    }
    Ok((batches, data_bytes))
}

/// The layout of `record`'s data: every leaf read once, every group located as a restore
/// locates it, its reads counted batch by batch as a restore makes them. Format 2 only.
pub async fn version_layout(
    repo: &Arc<Repo>,
    record: &VersionRecord,
) -> EngineResult<VersionLayout> {
    let (batches, data_bytes) = read_batches(repo, record).await?;
    Ok(layout_of(&batches, data_bytes))
}

/// The figures of a version read in `batches`.
pub(crate) fn layout_of(batches: &[ReadBatch], data_bytes: u64) -> VersionLayout {
    let mut layout = VersionLayout {
        data_bytes,
        ..Default::default()
    };
    let mut groups: HashSet<(Id, u32)> = HashSet::new();
    let mut packs: HashSet<Id> = HashSet::new();
    for batch in batches {
        layout.reads += batch.reads;
        for g in &batch.groups {
            if groups.insert((g.trailer.pack, g.group)) {
                layout.group_bytes += g.trailer.groups[g.group as usize].range().end
                    - g.trailer.groups[g.group as usize].range().start;
                packs.insert(g.trailer.pack);
            }
        }
    }
    layout.groups = groups.len() as u64;
    layout.packs = packs.len() as u64;
    layout
}

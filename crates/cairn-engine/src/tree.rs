//! Building and reading manifest trees (see `cairn_format::node` for the shape).

use std::collections::BTreeMap;
use std::sync::Arc;

use cairn_format::leaf_v2::LeafDigest;
use cairn_format::node::{tree_height, Interior, Leaf};
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::tree_walk::{decode_interior, decode_leaf};
use cairn_repo::Repo;
use tokio::task::JoinSet;

use crate::error::{EngineError, EngineResult};

/// Number of segments of an image of `size` bytes.
pub fn segment_count(size: u64, segment_size: u32) -> u64 {
    size.div_ceil(segment_size as u64)
}

/// A leaf of a tree's segment map: its id and, where known, the digest and figures its
/// level-1 node carries for it (format 2; `cairn_format::node`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeLeaf {
    pub id: Id,
    pub digest: Option<LeafDigest>,
}

impl From<Id> for TreeLeaf {
    fn from(id: Id) -> Self {
        TreeLeaf { id, digest: None }
    }
}

/// Builds the interior levels over `leaves` (segment index → leaf; absent = all zeros)
/// bottom-up. Every new node is handed to `emit` (id, encoded bytes); nodes equal to ones in
/// an earlier version get the same id, so the caller's dedup skips them — that is how a new
/// version rewrites only the path from changed leaves to the root. A level-1 node carries its
/// leaves' digests where they are known.
/// Returns the root id (`None` if there are no leaves) and the height.
pub fn build_tree(
    leaves: &BTreeMap<u64, TreeLeaf>,
    segments: u64,
    fanout: u16,
    id_of: impl Fn(&[u8]) -> Id,
    mut emit: impl FnMut(Id, Vec<u8>),
) -> (Option<Id>, u8) {
    let height = tree_height(segments, fanout);
    let f = fanout as u64;
    let mut level_nodes: BTreeMap<u64, TreeLeaf> = leaves.clone();
    for level in 1..=height {
        let mut parents: BTreeMap<u64, Interior> = BTreeMap::new();
        for (&index, child) in &level_nodes {
            let node = parents
                .entry(index / f)
                .or_insert_with(|| Interior::new(level, Vec::new()));
            node.children.push(((index % f) as u16, child.id));
            if level == 1 {
                node.leaf_digests.push(child.digest);
            }
        }
        level_nodes = parents
            .into_iter()
            .map(|(index, node)| {
                let bytes = node.encode();
                let id = id_of(&bytes);
                emit(id, bytes);
                (index, TreeLeaf::from(id))
            })
            .collect();
    }
    debug_assert!(level_nodes.len() <= 1);
    (level_nodes.into_values().next().map(|n| n.id), height)
}

/// Reads node `id` and decodes it as an interior node at `level`.
pub async fn read_interior(repo: &Repo, id: &Id, level: u8) -> EngineResult<Interior> {
    let raw = repo.read_blob(id).await?;
    Ok(decode_interior(id, level, &raw)?)
}

/// Reads node `id` and decodes it as a leaf.
pub async fn read_leaf(repo: &Repo, id: &Id) -> EngineResult<Leaf> {
    let raw = repo.read_blob(id).await?;
    Ok(decode_leaf(id, &raw)?)
}

/// Segments a walk could not read: `(first segment, segments, why)`.
pub type SkippedSegments = Vec<(u64, u64, String)>;

/// Whether an error of reading a manifest node means the node is damaged or missing.
fn node_damaged(e: &EngineError) -> bool {
    e.is_damage()
}

/// Manifest node reads in flight while loading a tree's leaf map or leaves.
pub(crate) const NODE_READS_IN_FLIGHT: usize = 32;

/// The segment → leaf map of a version, read from its interior nodes only (level by level,
/// several reads in flight).
pub async fn leaf_map(repo: &Arc<Repo>, record: &VersionRecord) -> EngineResult<BTreeMap<u64, Id>> {
    Ok(ids_only(read_leaf_map(repo, record, None).await?))
}

/// Like [`leaf_map`], with the leaf digests the level-1 nodes carry (what a commit on top of
/// the version needs to build its own level-1 nodes and to find reusable leaves).
pub async fn leaf_refs(
    repo: &Arc<Repo>,
    record: &VersionRecord,
) -> EngineResult<BTreeMap<u64, TreeLeaf>> {
    read_leaf_map(repo, record, None).await
}

/// Like [`leaf_map`], but an interior node that is damaged or missing does not end the walk:
/// the segments it covers are added to `skipped` (for `restore --allow-damage`).
pub async fn readable_leaf_map(
    repo: &Arc<Repo>,
    record: &VersionRecord,
    skipped: &mut SkippedSegments,
) -> EngineResult<BTreeMap<u64, Id>> {
    Ok(ids_only(read_leaf_map(repo, record, Some(skipped)).await?))
}

fn ids_only(map: BTreeMap<u64, TreeLeaf>) -> BTreeMap<u64, Id> {
    map.into_iter().map(|(seg, leaf)| (seg, leaf.id)).collect()
}

async fn read_leaf_map(
    repo: &Arc<Repo>,
    record: &VersionRecord,
    mut skipped: Option<&mut SkippedSegments>,
) -> EngineResult<BTreeMap<u64, TreeLeaf>> {
    let Some(root) = record.root else {
        return Ok(BTreeMap::new());
    };
    let f = record.fanout as u64;
    let mut frontier: Vec<(u64, TreeLeaf)> = vec![(0, TreeLeaf::from(root))];
    for level in (1..=record.height).rev() {
        let mut next = Vec::new();
        for batch in frontier.chunks(NODE_READS_IN_FLIGHT) {
            let mut set = JoinSet::new();
            for &(index, node) in batch {
                let repo = repo.clone();
                set.spawn(async move { (index, read_interior(&repo, &node.id, level).await) });
            }
            while let Some(r) = set.join_next().await {
                let (index, node) = r.map_err(|e| EngineError::internal("node reader", e))?;
                let node = match (node, skipped.as_deref_mut()) {
                    (Ok(node), _) => node,
                    (Err(e), Some(skipped)) if node_damaged(&e) => {
                        // The node `index` at `level` covers f^level segments from
                        // index · f^level (its children are index · f + slot, one level down).
                        let span = f.saturating_pow(u32::from(level));
                        skipped.push((index.saturating_mul(span), span, e.to_string()));
                        continue;
                    }
                    (Err(e), _) => return Err(e),
                };
                next.extend(node.children.iter().enumerate().map(|(i, &(slot, id))| {
                    let digest = node.leaf_digest(i);
                    (index * f + slot as u64, TreeLeaf { id, digest })
                }));
            }
        }
        frontier = next;
    }
    if let Some(skipped) = skipped {
        skipped.sort_by_key(|s| s.0);
    }
    Ok(frontier.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_paths_to_changed_leaves_are_new() {
        let fanout = 4;
        let leaves: BTreeMap<u64, TreeLeaf> = (0..40u64)
            .map(|s| (s, TreeLeaf::from(Id::of(&s.to_le_bytes()))))
            .collect();
        let mut first = Vec::new();
        let (root1, h) = build_tree(&leaves, 64, fanout, Id::of, |id, _| first.push(id));
        assert_eq!(h, 3);
        let mut changed = leaves.clone();
        changed.insert(17, TreeLeaf::from(Id::of(b"new")));
        let mut second = Vec::new();
        let (root2, _) = build_tree(&changed, 64, fanout, Id::of, |id, _| second.push(id));
        assert_ne!(root1, root2);
        let new: Vec<_> = second.iter().filter(|id| !first.contains(id)).collect();
        assert_eq!(new.len(), 3, "one node per level on the path to the root");
        let (empty, _) = build_tree(&BTreeMap::new(), 64, fanout, Id::of, |_, _| {
            panic!("no nodes")
        });
        assert!(empty.is_none());
    }
}

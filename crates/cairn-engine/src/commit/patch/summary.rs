//! The reference summary of a patched tree: reused from the base when its filters keep their
//! geometry, otherwise rebuilt.

use std::collections::BTreeMap;
use std::sync::Arc;

use cairn_format::node::Extent;
use cairn_format::summary::{probes_for, Bloom, ProbeKey, Summary, BITS_PER_NODE, NODE_PROBES};
use cairn_format::Id;
use cairn_repo::Repo;
use tokio::task::JoinSet;

use super::rebuild::{Keys, SegmentTask};
use crate::error::{EngineError, EngineResult};
use crate::tree::NODE_READS_IN_FLIGHT;
use crate::tree::{read_leaf, TreeLeaf};

/// The reference summary of the new tree. It must contain every chunk and node of the tree
/// (GC's fast deletion trusts it); a superset is safe.
///
/// When every leaf was rebuilt, it is built from the keys at hand. Otherwise the base's
/// summary is reused if its filters have the geometry `Summary::build` would choose for the
/// new tree (the count of distinct chunks is bracketed between "the base's minus the chunks
/// the rebuilt leaves dropped" and "the base's plus the ones they gained"; both ends must
/// agree; the base's count is exact when its summary was built by `commit`): the
/// new chunks and nodes are OR-ed into it, and stale ids of replaced chunks and nodes only add
/// false positives. Otherwise it is rebuilt by reading every leaf of the new tree (metadata).
pub(super) async fn summarize(
    repo: &Arc<Repo>,
    base_root: Option<Id>,
    leaves: &BTreeMap<u64, TreeLeaf>,
    tasks: &[SegmentTask],
    keys: &Keys,
    untouched_leaves: usize,
) -> EngineResult<Summary> {
    let bits = repo.config().summary_bits;
    let mut nodes: Vec<ProbeKey> = leaves.values().map(|l| ProbeKey::of(&l.id)).collect();
    nodes.extend(&keys.interior);
    nodes.sort_unstable();
    nodes.dedup();
    if untouched_leaves == 0 {
        return Ok(Summary::build(keys.chunks.clone(), nodes, bits));
    }
    let mut new_chunks = keys.chunks.clone();
    new_chunks.sort_unstable();
    new_chunks.dedup();
    let mut old_chunks = keys.old_chunks.clone();
    old_chunks.sort_unstable();
    old_chunks.dedup();
    // With U the untouched leaves' chunks, T and T' the rebuilt leaves' before and after:
    // |U ∪ T| - |T \ T'| <= |U ∪ T'| <= |U ∪ T| + |T' \ T|.
    let removed = old_chunks
        .iter()
        .filter(|k| new_chunks.binary_search(k).is_err())
        .count() as u64;
    let added = new_chunks
        .iter()
        .filter(|k| old_chunks.binary_search(k).is_err())
        .count() as u64;

    if let Some(root) = base_root {
        match repo.load_summary(&root).await {
            Ok(Some((mut summary, _))) => {
                let low = summary.chunk_items.saturating_sub(removed);
                let high = summary.chunk_items + added;
                let chunk_geometry =
                    |n| Bloom::with_capacity(n, bits as u16, probes_for(bits)).geometry();
                let node_geometry =
                    Bloom::with_capacity(nodes.len() as u64, BITS_PER_NODE, NODE_PROBES).geometry();
                let g = chunk_geometry(low);
                if g == chunk_geometry(high)
                    && g == summary.chunks.geometry()
                    && node_geometry == summary.nodes.geometry()
                {
                    for k in &new_chunks {
                        summary.chunks.insert(*k);
                    }
                    for k in &nodes {
                        summary.nodes.insert(*k);
                    }
                    // An estimate of the distinct chunks (for sizing and the leak estimate).
                    summary.chunk_items = (summary.chunk_items + added).saturating_sub(removed);
                    summary.node_items = nodes.len() as u64;
                    return Ok(summary);
                }
            }
            Ok(None) => tracing::debug!(%root, "base has no reference summary; rebuilding"),
            Err(e) => tracing::warn!(%root, "{e}; rebuilding the reference summary"),
        }
    }

    // Rebuild: the chunks of every leaf kept from the base (the rebuilt ones are in `keys`).
    let kept: Vec<Id> = leaves
        .iter()
        .filter(|(seg, _)| tasks.binary_search_by_key(seg, |t| &t.segment).is_err())
        .map(|(_, leaf)| leaf.id)
        .collect();
    let mut chunks = new_chunks;
    for batch in kept.chunks(NODE_READS_IN_FLIGHT) {
        let mut set = JoinSet::new();
        for &id in batch {
            let repo = repo.clone();
            set.spawn(async move { read_leaf(&repo, &id).await });
        }
        while let Some(r) = set.join_next().await {
            let leaf = r.map_err(|e| EngineError::internal("leaf reader", e))??;
            chunks.extend(leaf.extents.iter().filter_map(|e| match e {
                Extent::Chunk { id, .. } => Some(ProbeKey::of(id)),
                Extent::Zero { .. } => None,
            }));
        }
    }
    Ok(Summary::build(chunks, nodes, bits))
}

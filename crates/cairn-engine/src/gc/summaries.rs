//! Reference summaries on the GC side: loading (or rebuilding) the summaries of live trees and
//! merging them per image into the filters fast deletion asks "could this blob be live?".

use std::collections::HashMap;

use cairn_format::node::Leaf;
use cairn_format::summary::{ProbeKey, Summary};
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::{BlobIndex, Repo};

use cairn_repo::tree_walk::{walk_tree, NodeAt, TreeVisitor};

use super::{unreadable_live_tree, SnapshotReader};
use crate::error::{EngineError, EngineResult};

/// Whether a summary is expected to exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SummaryCheck {
    /// Load it; rebuild it if it is missing or damaged.
    Load,
    /// Known to be missing: rebuild it.
    Missing,
}

pub(crate) struct Ensured {
    pub summary: Summary,
    /// Bytes of summary and manifest read.
    pub read: u64,
    /// Bytes of summary written (when it had to be rebuilt).
    pub written: u64,
}

/// The summary of `record`'s tree, rebuilt from the manifest (and stored) when it is missing or
/// damaged. A manifest node that cannot be read is an error: the caller must not delete
/// anything on the strength of an incomplete summary.
pub(crate) async fn ensure_summary(
    repo: &Repo,
    index: &BlobIndex,
    record: &VersionRecord,
    check: SummaryCheck,
    store_rebuilt: bool,
) -> EngineResult<Ensured> {
    let root = record
        .root
        .expect("only versions with a tree have summaries");
    let mut damaged = false;
    if check == SummaryCheck::Load {
        match repo.load_summary(&root).await {
            Ok(Some((summary, read))) => {
                return Ok(Ensured {
                    summary,
                    read,
                    written: 0,
                })
            }
            Ok(None) => tracing::warn!(%root, "no reference summary; rebuilding it"),
            Err(e) => {
                tracing::warn!(%root, "{e}; rebuilding the reference summary");
                damaged = true;
            }
        }
    }
    let mut read = 0;
    let summary = summarize_tree(repo, index, record, &mut read).await?;
    let written = if store_rebuilt {
        if damaged {
            repo.delete_summary(&root).await?; // objects are put-if-absent
        }
        repo.put_summary(&root, &summary).await?
    } else {
        0
    };
    Ok(Ensured {
        summary,
        read,
        written,
    })
}

/// Builds the summary of a tree by reading every node of it.
pub(super) async fn summarize_tree(
    repo: &Repo,
    index: &BlobIndex,
    record: &VersionRecord,
    bytes_read: &mut u64,
) -> EngineResult<Summary> {
    let mut keys = SummaryKeys::default();
    if let Some(root) = record.root {
        let mut reader = SnapshotReader {
            repo,
            index,
            bytes_read,
        };
        walk_tree(&mut reader, root, record.height, record.fanout, &mut keys)
            .await
            .map_err(|e| unreadable_live_tree(record, e))?;
    }
    let SummaryKeys { chunks, nodes } = keys;
    Ok(Summary::build(chunks, nodes, repo.config().summary_bits))
}

/// The probe keys of every node and chunk of a tree.
#[derive(Default)]
struct SummaryKeys {
    chunks: Vec<ProbeKey>,
    nodes: Vec<ProbeKey>,
}

impl TreeVisitor<EngineError> for SummaryKeys {
    fn enter(&mut self, at: &NodeAt) -> bool {
        self.nodes.push(ProbeKey::of(&at.id));
        true
    }

    fn leaf(&mut self, _: &NodeAt, leaf: Leaf) -> EngineResult<()> {
        self.chunks
            .extend(leaf.chunk_ids().map(|id| ProbeKey::of(&id)));
        Ok(())
    }
}

/// The summaries of the live trees, OR-merged per image and geometry (the paper merges the
/// vectors of one VM's live snapshots). Asking every group keeps false positives additive in
/// the number of images instead of saturating one filter with the whole repository.
#[derive(Default)]
pub(super) struct LiveFilters {
    groups: HashMap<GroupKey, Summary>,
}

/// Image, chunk filter geometry, node filter geometry: summaries that can be OR-merged.
type GroupKey = (String, (u8, u8), (u8, u8));

impl LiveFilters {
    pub fn add(&mut self, image: &str, summary: Summary) {
        let key = (
            image.to_string(),
            summary.chunks.geometry(),
            summary.nodes.geometry(),
        );
        match self.groups.get_mut(&key) {
            None => {
                self.groups.insert(key, summary);
            }
            Some(merged) => {
                merged
                    .chunks
                    .union_with(&summary.chunks)
                    .expect("same geometry by key");
                merged
                    .nodes
                    .union_with(&summary.nodes)
                    .expect("same geometry by key");
                merged.chunk_items += summary.chunk_items;
                merged.node_items += summary.node_items;
            }
        }
    }

    /// False: no live tree refers to this chunk, for certain.
    pub fn maybe_chunk(&self, id: &Id) -> bool {
        self.groups.values().any(|s| s.chunks.contains(id))
    }

    /// False: no live tree contains this manifest node, for certain.
    pub fn maybe_node(&self, id: &Id) -> bool {
        self.groups.values().any(|s| s.nodes.contains(id))
    }

    /// The chance that a dead chunk is judged live: the paper's equation (1) for each merged
    /// filter, with the fraction of bits set standing in for its exponent (exact for a filter
    /// of distinct items), combined over the groups.
    pub fn chunk_false_positive_rate(&self) -> f64 {
        1.0 - self
            .groups
            .values()
            .map(|s| 1.0 - s.chunks.fill().powi(s.chunks.geometry().1 as i32))
            .product::<f64>()
    }
}

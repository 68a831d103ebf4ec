//! The parent fast path of a format 2 commit (CloudVS's comparison with the previous
//! version, done by content): every leaf of the image's newest version, by the digest of its
//! segment's bytes (`cairn_format::leaf_v2`). A worker hashes each segment of the source
//! whole — one BLAKE3 pass at full SIMD width — and a segment whose digest is here reuses
//! that leaf: no 4 KiB chunking, no per-chunk hashing, no index lookup. Re-commits of a
//! disk that changed a little cost a read and one hash of it.
//!
//! The digests come from the parent's level-1 nodes, which carry their leaves' digests and
//! figures (`cairn_format::node`), so loading the parent reads its interior nodes and its
//! reference summary — a few objects — not every leaf (which opened a pack per commit that
//! ever changed one: 1,047 pack files for a re-commit after 300 versions). A reused leaf
//! stays unread; what it uses reaches the new tree's summary through the parent's counted
//! summary (`base_summary`). Leaves whose level-1 node carries no digest (older commits
//! wrote none) are read.
//!
//! A reused leaf is trusted only as far as the repository still holds what it names. Unread
//! leaves are reused only when no copy of anything is quarantined; otherwise every leaf is
//! read, and each group run must have a good copy storing its
//! slots, else the segment takes the ordinary path, which stores again what is damaged —
//! damage never spreads to a new version through the fast path.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use cairn_format::group_summary::{GroupSummary, Resolved};
use cairn_format::leaf_v2::{LeafDigest, RunLeaf};
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::Repo;
use tokio::task::JoinSet;

use super::base_summary::load_base_summary;
use crate::error::{EngineError, EngineResult};
use crate::tree::{leaf_refs, TreeLeaf, NODE_READS_IN_FLIGHT};

/// A leaf of the parent that the fast path can reuse.
#[derive(Debug)]
pub(crate) struct ParentLeaf {
    pub id: Id,
    pub digest: LeafDigest,
    /// The decoded leaf, when it was read (otherwise its level-1 node's digest is all that is
    /// known, and the parent's summary stands for what it uses). Boxed: most leaves are
    /// reused unread, and an inline leaf made every entry 56 bytes larger.
    pub leaf: Option<Box<RunLeaf>>,
}

/// The parent's leaves that carry a segment digest, by digest.
///
/// Both tables are sorted arrays, searched by halves: they are held through the whole
/// commit and grow with the image (a leaf per segment), and hash maps at their load took
/// twice the bytes — 1.4 MiB of a 64 GiB image's re-commit, where the arrays take 0.5.
#[derive(Debug, Default)]
pub(crate) struct ParentLeaves {
    /// Sorted by segment digest, one leaf per digest.
    by_digest: Vec<ParentLeaf>,
    /// The parent's leaf of each segment, sorted by segment, for chunk-level dedup of a
    /// changed segment (`parent_chunks`) and for the new tree's summary (`base_summary`).
    by_segment: Vec<(u64, Id)>,
    /// The parent's root, when it has a readable reference summary: it stands for what leaves
    /// reused unread use, and the new summary is stored as a delta from it. Checked when the commit starts, read again when the pipeline is done
    /// rather than held through it (2 MiB of a 64 GiB image's re-commit peak, 8 at 256 GiB).
    summary_root: Option<Id>,
}

impl ParentLeaves {
    /// The leaves of `parent` (a version of a format 2 repository with the segment size
    /// of this commit). A parent whose tree cannot be read gives none (the commit then takes
    /// the ordinary path everywhere); an error of the store fails the call.
    pub(crate) async fn load(repo: &Arc<Repo>, parent: &VersionRecord) -> EngineResult<Self> {
        if parent.segment_size != repo.config().segment_size || repo.v2().is_none() {
            return Ok(Self::default());
        }
        let leaves = match leaf_refs(repo, parent).await {
            Ok(leaves) => leaves,
            Err(e) if e.is_damage() => {
                tracing::info!("no parent fast path: {e}");
                return Ok(Self::default());
            }
            Err(e) => return Err(e),
        };
        let has_summary = load_base_summary(repo, parent.root)
            .await
            .is_some_and(|s| !lists_quarantined(repo, &s.summary));
        let mut by_digest = Vec::with_capacity(leaves.len());
        let mut ids = HashSet::with_capacity(leaves.len());
        let mut unread = Vec::new();
        let by_segment = leaves.iter().map(|(s, l)| (*s, l.id)).collect();
        for leaf in leaves.into_values() {
            if !ids.insert(leaf.id) {
                continue;
            }
            match leaf.digest {
                Some(digest) if has_summary && reusable_unread(repo, &leaf.id).await? => {
                    by_digest.push(ParentLeaf {
                        id: leaf.id,
                        digest,
                        leaf: None,
                    });
                }
                _ => unread.push(leaf.id),
            }
        }
        let read = read_leaves(repo, unread).await?;
        tracing::debug!(
            leaves = ids.len(),
            read = read.len(),
            "parent leaves loaded"
        );
        for (id, leaf) in read {
            if let Some(digest) = leaf.leaf_digest() {
                let leaf = Some(Box::new(leaf));
                by_digest.push(ParentLeaf { id, digest, leaf });
            }
        }
        let by_digest = one_per_digest(by_digest);
        Ok(ParentLeaves {
            by_digest,
            by_segment,
            summary_root: parent.root.filter(|_| has_summary),
        })
    }

    /// Only the base's leaf of each segment, for a patch: the segments it sends all changed,
    /// so no whole leaf is reused, but their chunks are mostly the base's.
    pub(crate) fn by_segment_only(leaves: &BTreeMap<u64, TreeLeaf>) -> Self {
        ParentLeaves {
            by_segment: leaves.iter().map(|(s, l)| (*s, l.id)).collect(),
            ..ParentLeaves::default()
        }
    }

    /// The parent's leaf of segment `index`, if it had one (not all zeros).
    pub(crate) fn at_segment(&self, index: u64) -> Option<&Id> {
        let at = self.by_segment.binary_search_by_key(&index, |s| s.0).ok()?;
        Some(&self.by_segment[at].1)
    }

    /// The leaf of a segment whose bytes have `digest`.
    pub(crate) fn get(&self, digest: &Id) -> Option<&ParentLeaf> {
        let at = self
            .by_digest
            .binary_search_by(|l| l.digest.digest.cmp(digest))
            .ok()?;
        Some(&self.by_digest[at])
    }

    /// How many leaves the fast path can reuse.
    pub(crate) fn len(&self) -> usize {
        self.by_digest.len()
    }

    /// The parent's leaf occurrences: a leaf per segment that has one.
    pub(crate) fn occurrences(&self) -> Vec<Id> {
        self.by_segment.iter().map(|s| s.1).collect()
    }

    /// The parent's reference summary, read again: the new tree's summary is stored as a
    /// delta from it, and it stands for what leaves reused unread use. `None` when it cannot
    /// be read now or lists a copy quarantined since: the reused leaves are then read
    /// instead (`base_summary::complete_summary`) and the new summary is stored whole.
    pub(crate) async fn summary(&self, repo: &Repo) -> Option<Resolved> {
        load_base_summary(repo, self.summary_root)
            .await
            .filter(|s| !lists_quarantined(repo, &s.summary))
    }
}

/// `leaves` sorted by digest, one per digest: of leaves with the same bytes, the one listed
/// last (a leaf read is listed after those reused unread, and carries its runs).
fn one_per_digest(mut leaves: Vec<ParentLeaf>) -> Vec<ParentLeaf> {
    leaves.reverse();
    // Stable, so the first of equal digests is the one listed last.
    leaves.sort_by_key(|l| l.digest.digest);
    leaves.dedup_by(|later, first| later.digest.digest == first.digest.digest);
    leaves.shrink_to_fit();
    leaves
}

/// Whether the parent's leaf `id` may be reused without reading it: always, unless a GC plan
/// was pending when this session opened — that GC does not wait for this session, and a leaf
/// of the parent that it found dead (reused from a version it deletes) is rescued only after
/// its wait, so this session's index may not hold it. Then the leaf must be located here;
/// otherwise it is read like any other, and a leaf that cannot be read is not reused (its
/// segment is committed as new). A GC planned later waits for this session.
async fn reusable_unread(repo: &Repo, id: &Id) -> EngineResult<bool> {
    Ok(match repo.v2() {
        Some(v2) if repo.saw_any_plan() => v2.find_chunk(id).await?.is_some(),
        _ => true,
    })
}

/// Whether `summary` may list a group or node with a quarantined copy (the parent's leaves
/// are then read, so each reused run is checked for a good copy). Any quarantined copy
/// counts: a whole pack quarantined (missing, or its trailer unreadable) may have held
/// anything, and a damaged node group is quarantined under its group id, which no summary
/// lists; so does an index run found damaged (it may have been the only one to locate what
/// a leaf names). Damage is rare and its markers go with the next `gc --repair`; reading the
/// leaves meanwhile costs a commit a read of its parent's leaves, never a wrong version.
fn lists_quarantined(repo: &Repo, _summary: &GroupSummary) -> bool {
    !repo.quarantined().is_empty() || repo.v2().is_some_and(|r| r.index_damaged())
}

/// Reads and decodes leaves, several at a time; one that cannot be read or decoded is left
/// out (its segment is committed as new); an error of the store fails the call.
async fn read_leaves(repo: &Arc<Repo>, ids: Vec<Id>) -> EngineResult<Vec<(Id, RunLeaf)>> {
    let mut out = Vec::with_capacity(ids.len());
    let mut pending = ids.into_iter();
    let mut tasks = JoinSet::new();
    loop {
        while tasks.len() < NODE_READS_IN_FLIGHT {
            let Some(id) = pending.next() else { break };
            let repo = repo.clone();
            tasks.spawn(async move { (id, repo.read_blob(&id).await) });
        }
        let Some(done) = tasks.join_next().await else {
            break;
        };
        let (id, raw) = done.map_err(|e| EngineError::internal("leaf reader", e))?;
        match raw.map(|raw| RunLeaf::decode(&raw)) {
            Ok(Ok(leaf)) => out.push((id, leaf)),
            Ok(Err(_)) => {}
            Err(e) if e.is_damage() => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(id: u8, digest: u8, read: bool) -> ParentLeaf {
        ParentLeaf {
            id: Id([id; 32]),
            digest: LeafDigest {
                digest: Id([digest; 32]),
                chunks: 1,
                data_bytes: 4096,
            },
            leaf: read.then(|| Box::new(RunLeaf::default())),
        }
    }

    #[test]
    fn leaves_are_found_by_digest_and_segment_and_a_read_leaf_wins_a_shared_digest() {
        // Listed as `load` lists them: those reused unread, then those read.
        let listed = vec![
            leaf(1, 9, false),
            leaf(2, 3, false),
            leaf(3, 6, false),
            leaf(4, 3, true),
        ];
        let leaves = ParentLeaves {
            by_digest: one_per_digest(listed),
            by_segment: vec![(0, Id([1; 32])), (7, Id([4; 32]))],
            summary_root: None,
        };
        assert_eq!(leaves.len(), 3);
        let shared = leaves.get(&Id([3; 32])).expect("digest 3");
        assert_eq!(shared.id, Id([4; 32]));
        assert!(shared.leaf.is_some());
        assert_eq!(leaves.get(&Id([9; 32])).map(|l| l.id), Some(Id([1; 32])));
        assert!(leaves.get(&Id([5; 32])).is_none());
        assert_eq!(leaves.at_segment(7), Some(&Id([4; 32])));
        assert_eq!(leaves.at_segment(3), None);
        assert_eq!(leaves.occurrences().len(), 2);
    }
}

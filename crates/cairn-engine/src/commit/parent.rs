//! The parent fast path of a format 2 commit (CloudVS's comparison with the previous
//! version, done by content): every leaf of the image's newest version, by the digest of its
//! segment's bytes (`cairn_format::leaf_v2`). A worker hashes each segment of the source
//! whole — one BLAKE3 pass at full SIMD width — and a segment whose digest is here reuses
//! that leaf: no 4 KiB chunking, no per-chunk hashing, no index lookup. Re-commits of a
//! disk that changed a little cost a read and one hash of it.
//!
//! A reused leaf is trusted only as far as the repository still holds what it names: every
//! group run must have a good (not quarantined) copy storing its slots, else the segment takes
//! the ordinary path, which stores again what is damaged — damage never spreads to a new
//! version through the fast path.

use std::collections::HashMap;
use std::sync::Arc;

use cairn_format::leaf_v2::RunLeaf;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::Repo;
use tokio::task::JoinSet;

use crate::error::{EngineError, EngineResult};
use crate::tree::{leaf_map, NODE_READS_IN_FLIGHT};

/// The parent's leaves that carry a segment digest, by digest.
#[derive(Debug, Default)]
pub(crate) struct ParentLeaves {
    by_digest: HashMap<Id, (Id, RunLeaf)>,
}

impl ParentLeaves {
    /// The leaves of `parent` (a version of a format 2 repository with the segment size
    /// of this commit). A parent whose tree cannot be read gives none (the commit then takes
    /// the ordinary path everywhere); an error of the store fails the call.
    pub(crate) async fn load(repo: &Arc<Repo>, parent: &VersionRecord) -> EngineResult<Self> {
        if parent.segment_size != repo.config().segment_size || repo.v2().is_none() {
            return Ok(Self::default());
        }
        let leaves = match leaf_map(repo, parent).await {
            Ok(leaves) => leaves,
            Err(e) if e.is_damage() => {
                tracing::info!("no parent fast path: {e}");
                return Ok(Self::default());
            }
            Err(e) => return Err(e),
        };
        let mut by_digest = HashMap::with_capacity(leaves.len());
        let mut pending = leaves.into_values();
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
            let leaf = match raw.map(|raw| RunLeaf::decode(&raw)) {
                Ok(Ok(leaf)) => leaf,
                // A leaf that cannot be read is not reused; its segment is committed as new.
                Ok(Err(_)) => continue,
                Err(e) if e.is_damage() => continue,
                Err(e) => return Err(e.into()),
            };
            if let Some(digest) = leaf.digest() {
                by_digest.insert(digest, (id, leaf));
            }
        }
        Ok(ParentLeaves { by_digest })
    }

    /// The leaf (id, decoded) of a segment whose bytes have `digest`.
    pub(crate) fn get(&self, digest: &Id) -> Option<&(Id, RunLeaf)> {
        self.by_digest.get(digest)
    }

    /// How many leaves the fast path can reuse.
    pub(crate) fn len(&self) -> usize {
        self.by_digest.len()
    }
}

//! COMMIT: turn a source into a new version.
//!
//! The pipeline keeps every core busy on one image with bounded memory:
//!
//! ```text
//!  reader ──segments──▶ workers (×N) ──groups──▶ packer ──packs──▶ uploads (bounded)
//!  (sparse-aware)       chunk, zero-detect,       data groups and    put_if_absent
//!                       BLAKE3, dedup tiers,      nodes apart
//!                       zstd per group
//!                            │
//!                            └──leaves──▶ collector ──▶ tree ──▶ index run ──▶ summary ──▶ version ──▶ ref
//! ```
//! Channels are bounded, so a slow stage stalls the ones before it (back-pressure) and memory
//! stays at a few segments per worker plus the packs in flight. Publication is ordered —
//! packs, then the index run and the tree's reference summary, then the version record, then
//! the ref by compare-and-swap — so a crash or error at any point leaves only unreferenced
//! objects behind, never a version that points at missing data.
//!
//! The pieces, one per file:
//! - `reader`: the source's segments, in order, into the pipeline;
//! - `pipeline`: the workers (chunking, zero detection, BLAKE3, dedup through `dedup/`'s
//!   tiers and this commit's `claims`, chunks compressed in groups) and the collector;
//! - `packing`: packs uploaded with a bound on how many are in flight;
//! - `publish`: the ordered publication and the stale-GC guard before it;
//! - `parent`: the parent fast path (the newest version's leaves by segment digest, from its
//!   level-1 nodes);
//! - `base_summary`: a tree's reference summary when leaves of a base were reused unread
//!   (the parent's, or a patch's untouched ones).
//!
//! Commits made some other way reuse them: [`patch`] (a base version plus changed blocks, the
//! writable export's COMMIT), [`incremental`] (a qcow2 overlay's clusters or an NBD dirty
//! bitmap, on top of [`patch`]) and [`plan`] (which of these a source gets).

pub(crate) mod base_summary;
pub mod claims;
pub mod dedup;
pub mod incremental;
pub(crate) mod packing;
pub(crate) mod parent;
pub mod patch;
pub(crate) mod pending_entries;
pub(crate) mod pipeline;
pub mod plan;
pub(crate) mod publish;
pub(crate) mod reader;
pub(crate) mod spilled_claims;

pub(crate) use pipeline::run_pipeline;
pub(crate) use pipeline::PipelineOutput;
pub(crate) use publish::publish;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use cairn_format::name::validate_image_name;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::Repo;
pub use dedup::{DedupMode, DedupTally, DEDUP_ENV};
use tokio::runtime::Handle;

use crate::error::{EngineError, EngineResult};
use crate::source::Source;
use parent::ParentLeaves;

/// Live counters of a running commit, for progress display.
#[derive(Debug, Default)]
pub struct CommitProgress {
    /// Bytes the source will read, when known in advance.
    pub total: AtomicU64,
    /// Bytes read from the source so far.
    pub read: AtomicU64,
    /// Plain bytes of chunks that were new to the repository.
    pub new_bytes: AtomicU64,
    /// Bytes written to the store so far.
    pub stored: AtomicU64,
}

#[derive(Debug, Clone, Default)]
pub struct CommitOptions {
    pub message: String,
    /// Hashing/compression threads; 0 = one per core.
    pub workers: usize,
    /// Packs uploading at once (default: the store's hint).
    pub uploads: Option<usize>,
    pub progress: Option<Arc<CommitProgress>>,
    /// How hard format 2 looks for chunks stored before (exact: every one).
    pub dedup: DedupMode,
    /// Claims of this commit's own new chunks a generation holds in memory (0: the default,
    /// [`claims::CLAIM_GENERATION`]). When the newer generation fills, the older one is
    /// spilled to scratch files and still found.
    pub claim_generation: usize,
    /// Memory bounded mode's spilled claims may take (`None`: the default,
    /// [`claims::BOUNDED_SPILL_MEMORY`]); past it the oldest are forgotten (a chunk that
    /// comes again after them may be stored twice). Exact mode has no limit.
    pub claim_spill_memory: Option<usize>,
}

impl CommitOptions {
    /// This commit's claims, spilled into files in the directory `scratch` names (`None`:
    /// the system's temporary directory).
    pub(crate) fn claims(
        &self,
        scratch: impl FnOnce() -> EngineResult<Option<std::path::PathBuf>>,
    ) -> EngineResult<claims::Claims> {
        let generation = match self.claim_generation {
            0 => claims::CLAIM_GENERATION,
            n => n,
        };
        let budget = match self.dedup {
            DedupMode::Exact => None,
            DedupMode::Bounded => Some(
                self.claim_spill_memory
                    .unwrap_or(claims::BOUNDED_SPILL_MEMORY),
            ),
        };
        Ok(claims::Claims::spilling(generation, scratch()?, budget))
    }
}

/// The published version.
#[derive(Debug, Clone)]
pub struct CommitResult {
    pub id: Id,
    pub record: VersionRecord,
    /// Format 2: segments whose leaf in the image's previous version was reused as it is,
    /// their bytes hashed once and not chunked (the parent fast path).
    pub reused_segments: u64,
    /// Format 2: what each dedup tier found in changed segments (`dedup.parent`: in the
    /// previous version's leaf of the same segment, without an index lookup).
    pub dedup: DedupTally,
}

/// Commits `source` as a new version of `image`.
pub async fn commit(
    repo: Arc<Repo>,
    image: &str,
    source: Box<dyn Source>,
    options: CommitOptions,
) -> EngineResult<CommitResult> {
    validate_image_name(image)?;
    EngineError::ensure_writable(&repo, "commit")?;
    let time_ns = cairn_repo::session::now_ns();
    let progress = options.progress.clone().unwrap_or_default();
    if let Some(n) = source.data_hint() {
        progress.total.store(n, Ordering::Relaxed);
    }
    let handle = Handle::current();
    // The newest version's leaves, for the parent fast path.
    let parent = match repo.head(image).await? {
        Some(head) => ParentLeaves::load(&repo, &repo.load_version(&head.version).await?).await?,
        None => ParentLeaves::default(),
    };
    tracing::debug!(leaves = parent.len(), "parent fast path");
    let (mut out, parent) = {
        let repo = repo.clone();
        let options = options.clone();
        let progress = progress.clone();
        tokio::task::spawn_blocking(move || {
            pipeline::run_pipeline(repo, handle, source, &options, &progress, &parent)
                .map(|out| (out, parent))
        })
        .await
        .map_err(|e| EngineError::internal("pipeline thread", e))??
    };
    // Leaves of the parent reused unread: what they use comes from the parent's summary.
    if let Some(summary) = out.group_summary.as_mut() {
        let base = parent.summary(&repo).await;
        let base_leaves = parent.occurrences();
        base_summary::complete_summary(
            &repo,
            base.as_ref(),
            &out.unread_leaves,
            &base_leaves,
            summary,
        )
        .await?;
        out.summary_base = base;
    }

    publish(
        &repo,
        image,
        out,
        time_ns,
        &options.message,
        None,
        &progress,
    )
    .await
}

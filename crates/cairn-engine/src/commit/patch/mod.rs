//! COMMIT of a patch: a new version made of a base version plus a set of changed fixed-size
//! blocks (BlobSeer's COMMIT with shadowing; the writable NBD export commits its overlay this
//! way).
//!
//! Only what changed is read and stored:
//! - the base's segment → leaf map comes from its interior nodes alone (no leaf, no chunk);
//! - a segment without changed blocks keeps its leaf id, unread;
//! - a touched segment is materialized from its base leaf's group runs, the changed blocks
//!   laid over it, and run through the commit pipeline (`rebuild`), which dedups it per chunk
//!   so the base's unchanged chunks are found, not stored;
//! - the tree is rebuilt with [`build_tree`](crate::tree::build_tree) over the full map, so
//!   every unchanged interior node gets its old id (content addressing) and only the paths to
//!   changed leaves are new.
//!
//! The leaves produced are exactly the ones `commit` would produce for the same content, so
//! a patched version shares its nodes with a full commit of the same image bytes.
//! Publication is shared with `commit`: packs → index run → reference summary → version →
//! head.

use std::collections::BTreeMap;
use std::io;
use std::sync::Arc;

use cairn_format::config::RepoConfig;
use cairn_format::name::validate_image_name;
use cairn_format::version::{CommitStats, VersionRecord};
use cairn_format::Id;
use cairn_repo::Repo;
use tokio::runtime::{Handle, RuntimeFlavor};

use crate::commit::base_summary::{complete_summary, load_base_summary};
use crate::commit::{publish, CommitProgress, CommitResult};
use crate::error::{EngineError, EngineResult};
use crate::tree::{leaf_refs, TreeLeaf};

mod rebuild;
use rebuild::{Context, SegmentTask};

/// Changed blocks to commit on top of a base. Block `i` covers bytes
/// `[i*block_size, (i+1)*block_size) ∩ [0, new_size)`.
pub trait PatchSource: Send + Sync {
    /// Bytes per block; any size works. Every touched segment is materialized from its base
    /// (`rebuild`): format 2 leaves name group runs and carry the segment's digest, so a
    /// changed block is not spliced in without its neighbours' bytes.
    fn block_size(&self) -> u32;
    /// Indexes of the changed blocks (sorted and deduplicated by the caller or not: they are
    /// sorted and deduplicated here).
    fn changed_blocks(&self) -> Vec<u64>;
    /// The full new contents of a changed block: `block_size` bytes, or fewer for the last
    /// block of the image.
    fn read_block(&self, index: u64) -> io::Result<Vec<u8>>;
}

#[derive(Debug, Clone, Default)]
pub struct PatchOptions {
    pub message: String,
    /// The base's segment → leaf map, when the caller has already loaded it (an incremental
    /// commit needs it first to drop zero writes over absent segments): saves walking the
    /// base's interior nodes a second time. Must be `leaf_refs` of the base passed along.
    pub base_leaves: Option<BTreeMap<u64, TreeLeaf>>,
    /// The version's time (ns since the epoch); `None`: now. `cairn copy` keeps the source
    /// version's.
    pub time_ns: Option<i64>,
    /// How hard format 2 looks for the touched segments' chunks stored before.
    pub dedup: crate::commit::DedupMode,
}

/// The version a patch applies to: its size, its segment → leaf map (interior nodes only)
/// and its figures; an empty base for a new image.
struct PatchBase {
    origin: Option<Id>,
    size: u64,
    leaves: BTreeMap<u64, TreeLeaf>,
    stats: CommitStats,
    root: Option<Id>,
}

impl PatchBase {
    async fn open(
        repo: &Arc<Repo>,
        config: &RepoConfig,
        base: Option<&(Id, VersionRecord)>,
        new_size: u64,
        options: &mut PatchOptions,
    ) -> EngineResult<PatchBase> {
        let Some((id, record)) = base else {
            return Ok(PatchBase {
                origin: None,
                size: new_size,
                leaves: BTreeMap::new(),
                stats: CommitStats::default(),
                root: None,
            });
        };
        if record.root.is_some()
            && (record.segment_size != config.segment_size || record.fanout != config.fanout)
        {
            return Err(EngineError::BadInput(format!(
                "cannot patch {}@{}: its tree geometry (segment size {}, fanout {}) is not the \
                 repository's (segment size {}, fanout {})",
                record.image,
                record.seq,
                record.segment_size,
                record.fanout,
                config.segment_size,
                config.fanout
            )));
        }
        if new_size < record.logical_size {
            return Err(EngineError::BadInput(format!(
                "cannot patch {}@{} to {new_size} bytes: it has {} bytes and shrinking is not \
                 supported",
                record.image, record.seq, record.logical_size
            )));
        }
        let leaves = match options.base_leaves.take() {
            Some(leaves) => leaves,
            None => leaf_refs(repo, record).await?,
        };
        Ok(PatchBase {
            origin: Some(*id),
            size: record.logical_size,
            leaves,
            stats: record.stats,
            root: record.root,
        })
    }
}

/// The segments to rebuild and the changed blocks of each (sorted, deduplicated), plus the
/// changed blocks themselves: every segment a changed block touches, the base's partial last
/// segment of a grown image, and every base leaf this session may not reuse (a pending GC is
/// deleting it).
async fn segment_tasks(
    repo: &Repo,
    patch: &dyn PatchSource,
    new_size: u64,
    segment_size: u64,
    base_size: u64,
    leaves: &BTreeMap<u64, TreeLeaf>,
) -> EngineResult<(Vec<SegmentTask>, Vec<u64>)> {
    let block_size = patch.block_size() as u64;
    let mut blocks = patch.changed_blocks();
    blocks.sort_unstable();
    blocks.dedup();
    let block_count = new_size.div_ceil(block_size);
    if let Some(&last) = blocks.last() {
        if last >= block_count {
            return Err(EngineError::BadInput(format!(
                "patch block {last} is past the end of the image ({new_size} bytes, {block_count} \
                 blocks of {block_size})"
            )));
        }
    }
    let mut touched: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
    for &b in &blocks {
        let start = b * block_size;
        let end = (start + block_size).min(new_size);
        for seg in start / segment_size..=(end - 1) / segment_size {
            touched.entry(seg).or_default().push(b);
        }
    }
    // A grown image: the base's last segment, if partial, gets longer (its last chunk too).
    if new_size > base_size && !base_size.is_multiple_of(segment_size) {
        let seg = base_size / segment_size;
        if leaves.contains_key(&seg) {
            touched.entry(seg).or_default();
        }
    }
    // A base leaf this session may not reuse (a pending GC is deleting it) is rewritten, and
    // its chunks are checked the same way. (Format 2: a leaf the index runs this session
    // reads do not locate; checked only when a plan was pending at open — a GC planned later
    // waits for this session and rescues what it reuses.)
    for (&seg, leaf) in leaves.iter() {
        let reusable = match repo.v2() {
            Some(v2) if repo.saw_any_plan() => v2.find_chunk(&leaf.id).await?.is_some(),
            _ => true,
        };
        if !reusable {
            touched.entry(seg).or_default();
        }
    }
    let tasks = touched
        .into_iter()
        .map(|(segment, blocks)| SegmentTask {
            segment,
            base_leaf: leaves.get(&segment).map(|leaf| leaf.id),
            blocks,
        })
        .collect();
    Ok((tasks, blocks))
}

/// Publishes a new version of `image` whose contents are `base` (`None` = all zeros) with the
/// changed blocks of `patch` applied, of size `new_size` (≥ the base's size: an image may
/// grow, the new bytes are zeros unless patched; shrinking is refused).
///
/// The parent is the current head of `image` (re-parenting on a lost race, like `commit`);
/// when `image` has no head yet, the parent is the base version and the seq 1, like a clone,
/// so the new image's history starts at the base.
///
/// Stats: `data_bytes` and `chunks` are the base's figures adjusted by the touched segments
/// (exact when the base's are); `new_chunks`, `new_chunk_bytes` and `stored_bytes` are exact
/// for this commit.
///
/// Needs a multi-threaded tokio runtime (hashing, compression and `read_block` run on
/// blocking threads borrowing `patch`). A `read_block` error fails the commit and publishes
/// nothing.
pub async fn commit_patch(
    repo: Arc<Repo>,
    image: &str,
    base: Option<(Id, VersionRecord)>,
    new_size: u64,
    patch: &dyn PatchSource,
    mut options: PatchOptions,
) -> EngineResult<CommitResult> {
    validate_image_name(image)?;
    EngineError::ensure_writable(&repo, "commit")?;
    let time_ns = options.time_ns.unwrap_or_else(cairn_repo::session::now_ns);
    let handle = Handle::current();
    if handle.runtime_flavor() != RuntimeFlavor::MultiThread {
        return Err(EngineError::internal(
            "commit_patch",
            "needs a multi-threaded tokio runtime",
        ));
    }
    let config = repo.config().clone();
    let block_size = patch.block_size() as u64;
    if block_size == 0 {
        return Err(EngineError::BadInput("patch block size is 0".into()));
    }
    let segment_size = config.segment_size as u64;

    let PatchBase {
        origin,
        size: base_size,
        leaves,
        stats: base_stats,
        root: base_root,
    } = PatchBase::open(&repo, &config, base.as_ref(), new_size, &mut options).await?;
    let (tasks, blocks) =
        segment_tasks(&repo, patch, new_size, segment_size, base_size, &leaves).await?;
    let ctx = Context {
        repo: &repo,
        handle: handle.clone(),
        config: &config,
        patch,
        block_size,
        new_size,
        dedup: options.dedup,
    };
    let old = rebuild::old_stats(&repo, &tasks).await?;
    // Leaves kept as they are: referred to without being stored, nor read.
    let untouched: Vec<Id> = untouched_leaves(&leaves, &tasks).collect();
    let base_leaves: Vec<Id> = leaves.values().map(|l| l.id).collect();
    let mut out = tokio::task::block_in_place(|| rebuild::run(&ctx, &tasks, leaves))?;
    if let Some(summary) = out.group_summary.as_mut() {
        let base = load_base_summary(&repo, base_root).await;
        complete_summary(&repo, base.as_ref(), &untouched, &base_leaves, summary).await?;
        out.summary_base = base;
    }
    out.reused.extend(untouched.iter().copied());
    out.unread_leaves.extend(untouched);
    out.stats = patched_stats(&base_stats, &out.stats, &old);
    tracing::debug!(
        image,
        segments = tasks.len(),
        blocks = blocks.len(),
        new_chunks = out.stats.new_chunks,
        "patch built"
    );
    publish(
        &repo,
        image,
        out,
        time_ns,
        &options.message,
        origin,
        &CommitProgress::default(),
    )
    .await
}

/// A patched version's figures: the base's data and chunk counts with the rebuilt segments'
/// (`new`) in place of what their base leaves held (`old`); what is new is `new`'s alone.
fn patched_stats(base: &CommitStats, new: &CommitStats, old: &CommitStats) -> CommitStats {
    CommitStats {
        data_bytes: (base.data_bytes + new.data_bytes).saturating_sub(old.data_bytes),
        chunks: (base.chunks + new.chunks).saturating_sub(old.chunks),
        new_chunks: new.new_chunks,
        new_chunk_bytes: new.new_chunk_bytes,
        stored_bytes: 0,
    }
}

/// The leaves of segments no task rebuilds (`tasks` sorted by segment): kept as they are,
/// referred to without being stored.
fn untouched_leaves<'a>(
    leaves: &'a BTreeMap<u64, TreeLeaf>,
    tasks: &'a [SegmentTask],
) -> impl Iterator<Item = Id> + 'a {
    leaves
        .iter()
        .filter(|(seg, _)| tasks.binary_search_by_key(seg, |t| &t.segment).is_err())
        .map(|(_, leaf)| leaf.id)
}

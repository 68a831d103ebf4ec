//! Garbage collection: give back the space of deleted versions without ever deleting a blob
//! that a live version — or a commit running concurrently — refers to.
//!
//! Two ways to decide what is dead, one protocol to delete it (`collect` runs it):
//!
//! - **Fast deletion** (`cairn gc`, also run by `rm` and `prune`): the VM-centric paper's
//!   reference-summary deletion. Every live tree's reference summary lists exactly the group
//!   slots and manifest nodes it uses (`group_summaries`: one merged summary per image), so
//!   no tree is walked: the packs the deleted versions' dead data lies in (`affected`) are
//!   judged against the summaries, and the index runs of untouched packs are not rewritten.
//!   Groups that commits running at once each stored are kept once (`affected`).
//! - **Exact repair** (`cairn gc --repair`): mark from every live tree (`liveness`), sweep
//!   everything unmarked (leaks, crashed commits' packs), consolidate the index runs, and
//!   rebuild damaged groups from good copies (`rebuild`).
//!
//! The deletion protocol both share (argued in docs/ARCHITECTURE.md, "GC safety"):
//!
//! 1. **Lock** `gc/lock` (one GC at a time; a lock whose session is dead is taken over).
//! 2. **Decide** from the live versions as read from the refs (refs first, then the index), and
//!    write new packs (repacked live groups, `pack_plan`) and the index run naming them first.
//! 3. **Plan**: publish the dead packs and the index runs they supersede under `gc/plans/`.
//! 4. **Wait** for every live session that started before the plan was published (plus a clock
//!    skew margin). Sessions that start later see the plan: they register before reading plans,
//!    never deduplicate against its dead data and do not load the superseded index runs.
//! 5. **Re-check** the versions published since step 2: a commit that was running may have
//!    published a version that reuses a dead group slot or node. Those are *rescued*
//!    (`rescue`): copied into rescue packs that a rescue run names.
//! 6. **Sweep**: delete the superseded index runs, then the dead and repacked packs; record
//!    `gc/last`; delete the plan; release the lock.
//!
//! A crash at any step leaves a consistent repository: before the sweep only additions were
//! made (duplicates), and every sweep step deletes only what the index runs written in step 2
//! and the rescue run no longer need.

mod affected;
mod collect;
pub mod compact;
mod group_summaries;
mod leftovers;
mod live_set;
mod liveness;
mod pack_plan;
mod phase;
mod rebuild;
mod recompress;
mod records;
pub(crate) mod repacker;
mod rescue;
mod small_packs;
mod summary_bases;

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_format::marker::GcPlan;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::session::{describe, liveness, now_ns, Liveness};
use cairn_repo::{GcLock, GcLockAttempt, PublishedPlan, Repo, RepoError, SessionKind};

use crate::error::{EngineError, EngineResult};
use crate::progress::{self, Unit, WorkProgress};

/// How a GC decides what is dead.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum GcMode {
    /// Free the unique blobs of newly deleted versions, judged by reference summaries.
    #[default]
    Fast,
    /// Mark from every live version and sweep everything else (removes fast deletion's leak).
    Repair,
}

impl GcMode {
    pub fn name(self) -> &'static str {
        match self {
            GcMode::Fast => "fast",
            GcMode::Repair => "repair",
        }
    }
}

/// Called while GC waits for older sessions, with one line per session it waits for.
pub type WaitNotice = Arc<dyn Fn(&[String]) + Send + Sync>;

#[derive(Clone)]
pub struct GcOptions {
    pub mode: GcMode,
    /// Report what would be done; change nothing.
    pub dry_run: bool,
    /// Packs whose live fraction (by bytes) is below this are repacked.
    pub repack_threshold: f64,
    /// Merge packs below a quarter of the pack target into full ones (a few pack
    /// targets' worth a GC, once they fill half a pack), live or not.
    pub repack_small: bool,
    /// A session whose heartbeat is older than this belongs to a dead process.
    pub stale_after: Duration,
    /// How long to wait for older sessions before giving up (nothing is deleted then).
    pub wait_limit: Duration,
    /// Poll interval while waiting.
    pub poll: Duration,
    /// Told what GC waits for, about every [`WAIT_NOTICE_EVERY`] while it waits.
    pub on_wait: Option<WaitNotice>,
    /// Counters for a progress display (each step: summaries, deleted trees or marking,
    /// repacking, waiting, deleting).
    pub progress: Option<Arc<WorkProgress>>,
    /// Cold recompression (exact pass only): every data group GC copies is compressed again
    /// at this zstd level (same id: every slot stays listed), and every kept data pack whose
    /// groups would shrink at it is copied too (`recompress.rs`).
    pub recompress: Option<i32>,
}

/// How often a waiting GC says what it waits for.
pub const WAIT_NOTICE_EVERY: Duration = Duration::from_secs(5);

impl std::fmt::Debug for GcOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GcOptions")
            .field("mode", &self.mode)
            .field("dry_run", &self.dry_run)
            .field("recompress", &self.recompress)
            .field("repack_threshold", &self.repack_threshold)
            .field("repack_small", &self.repack_small)
            .field("stale_after", &self.stale_after)
            .field("wait_limit", &self.wait_limit)
            .field("poll", &self.poll)
            .finish_non_exhaustive()
    }
}

impl Default for GcOptions {
    fn default() -> Self {
        GcOptions {
            mode: GcMode::Fast,
            dry_run: false,
            repack_threshold: 0.97,
            repack_small: false,
            stale_after: Duration::from_secs(600),
            wait_limit: Duration::from_secs(3600),
            poll: Duration::from_millis(200),
            on_wait: None,
            progress: None,
            recompress: None,
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct GcReport {
    pub mode: GcMode,
    pub dry_run: bool,
    pub live_versions: u64,
    /// Deleted versions this GC gave the space of back (fast: the newly deleted ones).
    pub freed_versions: u64,
    /// Bytes of reference summaries read (fast) or written (repair).
    pub summary_bytes: u64,
    /// Fast deletion: summary objects read (one merged summary per image, plus
    /// the summaries of trees deleted or committed since the last GC).
    pub summaries_read: u64,
    /// Version records read from their own keys (the rest came from the record
    /// bundle the last GC wrote), and the bundle's bytes.
    pub records_read: u64,
    pub record_bundle_bytes: u64,
    pub live_blobs: u64,
    pub dead_blobs: u64,
    pub packs_deleted: u64,
    pub packs_repacked: u64,
    /// Of `packs_repacked`, the packs copied only to compress their groups again.
    pub packs_recompressed: u64,
    pub packs_written: u64,
    pub orphan_packs_deleted: u64,
    /// Packs no index run named that hold data of live versions (their run was lost):
    /// indexed again, never deleted.
    pub orphan_packs_reindexed: u64,
    /// Packs no index run named whose trailer could not be read: kept (nothing proves
    /// them dead).
    pub orphan_packs_kept: u64,
    /// Index runs this GC replaced by its consolidated one.
    pub index_runs_replaced: u64,
    /// Pack trailers read (fast deletion reads only the packs the deleted versions'
    /// dead data is in; the exact pass reads every one).
    pub trailers_read: u64,
    /// Fast deletion: bytes of index runs read to rewrite them without the
    /// trailers of packs it did not read.
    pub index_read_bytes: u64,
    pub rescued_blobs: u64,
    /// `repack_small`: small packs chosen to be merged into full ones (counted in
    /// `packs_repacked` too, or `packs_deleted` when nothing in them was live).
    pub small_packs: u64,
    /// Fast deletion: groups and manifest nodes that trees committed since the last GC use
    /// and that more than one pack stores (commits that ran at once each stored them), and
    /// the packs their copies are in. One copy is kept; the packs of the others are repacked
    /// or deleted.
    pub duplicate_blobs: u64,
    pub duplicate_packs: u64,
    /// Live groups whose only copies were damaged, rebuilt from good copies of
    /// their chunks stored elsewhere.
    pub groups_rebuilt: u64,
    /// Bytes of packs and index runs before and after. The packs after are
    /// those listed before, minus those this GC deleted, plus those it wrote (one walk of the
    /// store's pack directories, not two): packs other sessions wrote meanwhile count in
    /// neither figure, so their difference is what this GC gave back.
    pub before_bytes: u64,
    pub after_bytes: u64,
    /// Bytes copied while repacking.
    pub repacked_bytes: u64,
    /// Manifest node bytes read while marking.
    pub metadata_read_bytes: u64,
    /// Temporary files of killed writers removed from the store, and their bytes.
    pub temporaries_removed: u64,
    pub temporary_bytes_removed: u64,
    /// Partial files of killed restores removed on this host, and their bytes.
    pub partial_files_removed: u64,
    pub partial_bytes_removed: u64,
    /// Exact pass: version records of commits that never published them, removed.
    pub orphan_records_removed: u64,
    /// Boot profiles of images that are gone, removed.
    pub profiles_removed: u64,
    pub waited_s: f64,
    pub duration_s: f64,
    /// Wall seconds of each step, in the order they first ran (`phase.rs`).
    pub phases: Vec<(&'static str, f64)>,
}

impl GcReport {
    pub fn reclaimed(&self) -> u64 {
        self.before_bytes.saturating_sub(self.after_bytes)
    }
}

/// Runs one garbage collection on an open repository (opened for this purpose: its session
/// is the GC's own and is not waited for).
/// Whether some version is marked deleted and no GC has given its space back yet: what
/// fast deletion would act on. Two listings; no record is read.
pub async fn has_unfreed_deletions(repo: &Repo) -> EngineResult<bool> {
    let freed = repo.freed_versions().await?;
    Ok(repo
        .deleted_versions()
        .await?
        .iter()
        .any(|id| !freed.contains(id)))
}

pub async fn gc(repo: &Arc<Repo>, options: &GcOptions) -> EngineResult<GcReport> {
    EngineError::ensure_writable(repo, "gc")?;
    if options.recompress.is_some() && (options.mode != GcMode::Repair || repo.v2().is_none()) {
        return Err(EngineError::BadInput(
            "recompression runs with the exact pass (--repair) of a format 2 repository".into(),
        ));
    }
    let started = Instant::now();
    let mut clock = phase::PhaseClock::start();
    let lock = if options.dry_run {
        None
    } else {
        Some(acquire_lock(repo, options).await?)
    };
    let mut lock_phase = GcReport::default();
    clock.lap("lock", &mut lock_phase);
    let result = async {
        let run = |options: GcOptions| async move { collect::run(repo, &options).await };
        let mut report = match run(options.clone()).await {
            // A blob found damaged while repacking was quarantined and nothing was deleted:
            // run once more, now leaving that copy where it is.
            Err(EngineError::Repo(e @ RepoError::BadBlob { .. })) if !options.dry_run => {
                tracing::warn!("gc: {e}; the copy is quarantined, collecting again without it");
                repo.discard_unindexed_packs().await;
                run(options.clone()).await?
            }
            // No room to write repacked packs: free what can be freed without repacking
            // (whole dead packs); the next gc repacks.
            Err(EngineError::Repo(e)) if e.is_disk_full() && !options.dry_run => {
                tracing::warn!("gc: the disk is full; deleting dead packs without repacking");
                repo.discard_unindexed_packs().await;
                repo.withdraw_all_gc_plans().await;
                run(GcOptions {
                    repack_threshold: 0.0,
                    ..options.clone()
                })
                .await?
            }
            other => other?,
        };
        let mut clock = phase::PhaseClock::start();
        if !options.dry_run {
            leftovers::remove_stale_files(repo, options, &mut report).await?;
            clock.lap("stale files", &mut report);
            repo.replenish_reserve().await;
            clock.lap("reserve", &mut report);
        }
        Ok::<_, EngineError>(report)
    }
    .await;
    let mut unlocking = phase::PhaseClock::start();
    if let Some(lock) = lock {
        if result.is_err() {
            repo.withdraw_all_gc_plans().await;
        }
        repo.release_gc_lock(lock).await;
    }
    let mut report = result?;
    report.phases.splice(0..0, lock_phase.phases);
    unlocking.lap("unlock", &mut report);
    report.mode = options.mode;
    report.dry_run = options.dry_run;
    report.duration_s = started.elapsed().as_secs_f64();
    Ok(report)
}

async fn acquire_lock(repo: &Repo, options: &GcOptions) -> EngineResult<GcLock> {
    let started = Instant::now();
    loop {
        match repo.take_gc_lock(options.stale_after).await? {
            // A commit merging index runs holds the lock for a moment (`compact::after_commit`):
            // wait for it rather than fail a scheduled gc. (Another gc's lock fails at once, as
            // ever: that gc may be waiting for this process's session.)
            GcLockAttempt::HeldBy(holder)
                if holder.starts_with(SessionKind::Commit.name())
                    && started.elapsed() < LOCK_WAIT =>
            {
                tracing::debug!("the gc lock is held by {holder}; waiting");
                crate::interrupt::check()?;
                tokio::time::sleep(options.poll).await;
            }
            attempt => return lock_taken(attempt),
        }
    }
}

/// How long GC and compaction wait for a commit's hold on the GC lock before they give up.
const LOCK_WAIT: Duration = Duration::from_secs(30);

/// The lock of an attempt, or the error that says why there is none.
fn lock_taken(attempt: GcLockAttempt) -> EngineResult<GcLock> {
    match attempt {
        GcLockAttempt::Taken(lock) => Ok(lock),
        GcLockAttempt::HeldBy(holder) => Err(EngineError::Gc(format!(
            "another gc is running: {holder}; try again when it has finished"
        ))),
        GcLockAttempt::NoSession => Err(EngineError::Gc(
            "it needs a session of its own (the repository refuses writes?)".into(),
        )),
        GcLockAttempt::Contended => Err(EngineError::Gc(
            "could not take the gc lock (it keeps changing)".into(),
        )),
    }
}

/// Sessions that started up to this long after a plan was published are waited for too, in
/// case the clocks of the hosts sharing a repository disagree.
pub const CLOCK_SKEW_MARGIN: Duration = Duration::from_secs(1);

/// How many sessions other than this process's own are alive and of a kind GC waits for.
async fn others_alive(repo: &Repo, stale_after: Duration) -> EngineResult<usize> {
    let me = repo.session_key();
    let now = now_ns();
    Ok(repo
        .sessions()
        .await?
        .into_iter()
        .filter(|(key, s)| {
            s.as_ref().is_some_and(|s| {
                Some(key) != me.as_ref()
                    && SessionKind::gc_waits_for(&s.kind)
                    && liveness(s, now, stale_after) == Liveness::Alive
            })
        })
        .count())
}

async fn wait_for_sessions(repo: &Repo, cutoff_ns: i64, options: &GcOptions) -> EngineResult<()> {
    let me = repo.session_key();
    let started = Instant::now();
    progress::start(
        &options.progress,
        "waiting for older sessions",
        Unit::Items,
        0,
    );
    let mut noticed: Option<Instant> = None;
    loop {
        let now = now_ns();
        let pending: Vec<String> = repo
            .sessions()
            .await?
            .into_iter()
            .filter_map(|(key, s)| {
                let s = s?;
                let waited = Some(&key) != me.as_ref()
                    && s.started_ns <= cutoff_ns
                    && SessionKind::gc_waits_for(&s.kind)
                    && liveness(&s, now, options.stale_after) == Liveness::Alive;
                waited.then(|| describe(&key, &s, now))
            })
            .collect();
        if pending.is_empty() {
            return Ok(());
        }
        crate::interrupt::check()?;
        if let Some(notice) = &options.on_wait {
            if noticed.is_none_or(|t| t.elapsed() >= WAIT_NOTICE_EVERY) {
                notice(&pending);
                noticed = Some(Instant::now());
            }
        }
        if started.elapsed() > options.wait_limit {
            return Err(EngineError::Gc(format!(
                "waited {:.0} s for {} older session(s) to finish ({}); nothing was deleted",
                started.elapsed().as_secs_f64(),
                pending.len(),
                pending.join(", ")
            )));
        }
        tracing::debug!(?pending, "gc waiting for sessions");
        tokio::time::sleep(options.poll).await;
    }
}

/// Why GC cannot read the tree of a live version: it acts only on a complete view.
fn unreadable_live_tree(record: &VersionRecord, e: EngineError) -> EngineError {
    if matches!(e, EngineError::Interrupted { .. }) {
        return e;
    }
    // A node no run names: most often its run was lost, and the pack is still there.
    let unindexed = matches!(e, EngineError::Repo(RepoError::BlobMissing { .. }));
    EngineError::Gc(format!(
        "cannot read the manifest of live version {}@{}: {e}; nothing was deleted ({}restore \
         what can be restored with `cairn restore --allow-damage`, store it again with `cairn \
         repair --from IMAGE_FILE`, or remove the version with `cairn rm`)",
        record.image,
        record.seq,
        if unindexed {
            "run `cairn repair` first: it indexes again the packs whose index run was lost; \
             then "
        } else {
            ""
        }
    ))
}

/// A published plan and the session cutoff that goes with it.
struct Published {
    plan: PublishedPlan,
    cutoff_ns: i64,
}

/// Steps 3 and 4: publish `plan`, take the cutoff after it is visible, and wait for the
/// sessions that may not have seen it. On failure the plan is withdrawn (nothing was deleted).
async fn publish_and_wait(
    repo: &Repo,
    plan: &GcPlan,
    options: &GcOptions,
    report: &mut GcReport,
) -> EngineResult<Published> {
    crate::interrupt::check()?;
    let published = repo.publish_gc_plan(plan).await?;
    // Sessions register before they read plans, so one that started after the plan became
    // visible has seen it. The cutoff is taken *after* publication (not at the plan's
    // creation: a session registering in between would read the plans before ours is there),
    // plus a margin for clock skew between hosts.
    let cutoff_ns = now_ns() + CLOCK_SKEW_MARGIN.as_nanos() as i64;
    let wait_started = Instant::now();
    if let Err(e) = wait_for_sessions(repo, cutoff_ns, options).await {
        repo.withdraw_gc_plan(&published).await;
        return Err(e);
    }
    report.waited_s = wait_started.elapsed().as_secs_f64();
    Ok(Published {
        plan: published,
        cutoff_ns,
    })
}

/// Step 6 (deletions): the superseded index files first — their replacements are written —
/// then the doomed packs.
async fn sweep(
    repo: &Repo,
    superseded: &[Id],
    written_index: &HashSet<Id>,
    doomed_packs: &[Id],
) -> EngineResult<()> {
    let superseded: Vec<Id> = superseded
        .iter()
        .filter(|id| !written_index.contains(id))
        .copied()
        .collect();
    Ok(repo.sweep(&superseded, doomed_packs).await?)
}

/// Step 6 (bookkeeping): record `gc/last`, remove our plan and any a dead GC left (we hold
/// the lock, so no other GC runs), and clear sessions of dead processes.
async fn finish(repo: &Repo, published: &Published, options: &GcOptions) -> EngineResult<()> {
    Ok(repo
        .complete_gc(&published.plan, published.cutoff_ns, options.stale_after)
        .await?)
}

/// Bytes of packs and index files, and each pack's size.
async fn stored_bytes(
    repo: &Repo,
    listed_before: Option<&HashMap<Id, u64>>,
) -> EngineResult<(u64, HashMap<Id, u64>)> {
    // At the end of a GC only the packs not listed at its start are asked for their size.
    let pack_sizes = match listed_before {
        Some(before) => repo.pack_sizes_since(before).await?,
        None => repo.pack_sizes().await?,
    };
    let index_bytes = repo.index_file_bytes().await?;
    Ok((pack_sizes.values().sum::<u64>() + index_bytes, pack_sizes))
}

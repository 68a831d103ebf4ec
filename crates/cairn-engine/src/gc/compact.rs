//! Compaction of the index runs (`cairn index compact`): every commit adds a
//! run, and every lookup asks each run's filter, so runs are merged in tiers — a repository
//! of N commits keeps O(log N) of them — from their own bytes (`V2Reader::merge_runs`: no
//! pack trailer is read, nothing but sections and metas).
//!
//! Tiers: a run of fewer than [`TIER_BASE`] entries is tier 0, and each tier above holds runs
//! [`FAN_IN`] times larger. When a tier holds [`FAN_IN`] runs they are merged into one (which
//! lands a tier up, where it may fill that tier in turn). `--all` merges every run into one
//! (and rewrites a lone version 1 run as version 2).
//!
//! Publication is GC's protocol without dead blobs (`gc/mod.rs`): under the GC lock (so no GC
//! deletes a pack that a merged run names), merged runs are written first, then a plan that
//! supersedes their inputs (processes opening from then on skip those), a wait for older
//! sessions, and the deletion of the inputs. A kill at any point leaves the old runs, or the
//! old and the new (the same locations twice, which lookups merge), or the new alone: never
//! a location lost.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use cairn_format::marker::GcPlan;
use cairn_format::Id;
use cairn_repo::session::now_ns;
use cairn_repo::v2::RunSize;
use cairn_repo::{Repo, RepoError};

use cairn_repo::GcLockAttempt;

use super::{acquire_lock, others_alive, publish_and_wait, GcOptions, GcReport};
use crate::error::{EngineError, EngineResult};
use crate::progress::{self, Unit};

/// Runs a tier holds before they are merged into one.
pub const FAN_IN: usize = 8;
/// Entries below which a run is tier 0 (about one commit of 32 MiB of new 4 KiB chunks).
pub const TIER_BASE: u64 = 8192;

/// What a compaction is asked to do.
#[derive(Debug, Clone, Default)]
pub struct CompactOptions {
    /// Merge every run into one, not just the full tiers.
    pub all: bool,
    /// Merge no tier above this one (a commit's own compaction stays small); `None`: any.
    pub max_tier: Option<u32>,
    /// Waiting, staleness, progress and dry run, as for GC.
    pub gc: GcOptions,
}

/// What a compaction did (or, dry, would do).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CompactReport {
    pub dry_run: bool,
    pub runs_before: u64,
    pub runs_after: u64,
    /// Merges performed (each writes one run).
    pub merges: u64,
    /// Runs merged away (inputs of the merges that were not themselves written by it).
    pub runs_merged: u64,
    /// Entries in every run before and after (a location held by two runs counts twice
    /// before, once after they merge).
    pub entries_before: u64,
    pub entries_after: u64,
    /// Stored bytes of the runs before and after.
    pub before_bytes: u64,
    pub after_bytes: u64,
    /// Bytes of runs read and written by the merges.
    pub read_bytes: u64,
    pub written_bytes: u64,
    pub waited_s: f64,
    pub duration_s: f64,
}

/// The tier of a run of `entries` entries.
pub fn tier(entries: u64) -> u32 {
    let mut t = 0;
    let mut bound = TIER_BASE;
    while entries >= bound {
        t += 1;
        match bound.checked_mul(FAN_IN as u64) {
            Some(b) => bound = b,
            None => break,
        }
    }
    t
}

/// The next runs to merge (oldest first), if any: every run of the lowest tier that holds
/// [`FAN_IN`] runs; with `all`, every run (or a lone run of an older version).
pub fn next_merge(runs: &[RunSize], all: bool) -> Option<Vec<Id>> {
    if all {
        return match runs {
            [] => None,
            [one] if one.version == cairn_format::index_run::VERSION => None,
            _ => Some(runs.iter().map(|r| r.id).collect()),
        };
    }
    let mut tiers: Vec<u32> = runs.iter().map(|r| tier(r.entries)).collect();
    tiers.sort_unstable();
    tiers.dedup();
    tiers.into_iter().find_map(|t| {
        let members: Vec<Id> = runs
            .iter()
            .filter(|r| tier(r.entries) == t)
            .map(|r| r.id)
            .collect();
        (members.len() >= FAN_IN).then_some(members)
    })
}

/// Compacts the index runs of a repository opened for it (its session is not waited
/// for).
pub async fn compact(repo: &Arc<Repo>, options: &CompactOptions) -> EngineResult<CompactReport> {
    EngineError::ensure_writable(repo, "index compact")?;
    let started = Instant::now();
    let dry_run = options.gc.dry_run;
    let lock = if dry_run {
        None
    } else {
        Some(acquire_lock(repo, &options.gc).await?)
    };
    let result = run(repo, options).await;
    if let Some(lock) = lock {
        if result.is_err() {
            repo.withdraw_all_gc_plans().await;
        }
        repo.release_gc_lock(lock).await;
    }
    let mut report = result?;
    report.dry_run = dry_run;
    report.duration_s = started.elapsed().as_secs_f64();
    Ok(report)
}

/// Merges full tiers right after a commit, when that costs the commit no wait (the
/// runs of many commits otherwise pile up until someone runs `cairn index compact`, and every
/// lookup asks each of them — a commit after 1,000 versions took twice as long with 1,000 runs
/// as with one). Only if a tier is full in this session's view, no other session GC waits for
/// is alive, and the GC lock is free at once; otherwise, or on any error, nothing changes (the
/// runs wait for a later commit or `cairn index compact`) and the commit stands either way.
pub async fn after_commit(repo: &Arc<Repo>) -> Option<CompactReport> {
    let reader = repo.v2()?;
    next_merge(&reader.run_sizes(), false)?;
    let options = CompactOptions {
        all: false,
        // Tiers 0 and 1: at most 8 × 65,536 entries (6 MiB of runs) read by a commit.
        max_tier: Some(1),
        gc: GcOptions {
            // Only a session that opened in the moment between the check below and the plan
            // can hold it up; a gc that opened then waits for our lock, so give up soon (the
            // plan is withdrawn, the merged run stays beside its inputs, and a later
            // compaction merges it again, byte for byte).
            wait_limit: std::time::Duration::from_secs(3),
            ..GcOptions::default()
        },
    };
    let started = Instant::now();
    let skip = |why: &str| {
        tracing::debug!("index runs left for a later compaction: {why}");
        None
    };
    match others_alive(repo, options.gc.stale_after).await {
        Ok(0) => {}
        Ok(n) => return skip(&format!("{n} other session(s) alive")),
        Err(e) => return skip(&e.to_string()),
    }
    let lock = match repo.take_gc_lock(options.gc.stale_after).await {
        Ok(GcLockAttempt::Taken(lock)) => lock,
        Ok(_) => return skip("the gc lock is taken"),
        Err(e) => return skip(&e.to_string()),
    };
    let result = run(repo, &options).await;
    if result.is_err() {
        repo.withdraw_all_gc_plans().await;
    }
    repo.release_gc_lock(lock).await;
    match result {
        // This session's view still held runs a compaction since merged away.
        Ok(report) if report.merges == 0 => None,
        Ok(mut report) => {
            report.duration_s = started.elapsed().as_secs_f64();
            tracing::info!(
                merges = report.merges,
                runs_before = report.runs_before,
                runs_after = report.runs_after,
                "index runs merged after the commit"
            );
            Some(report)
        }
        Err(e) => {
            tracing::warn!(
                "merging index runs after the commit failed: {e}; the commit stands, and \
                 `cairn index compact` merges them later"
            );
            None
        }
    }
}

async fn run(repo: &Repo, options: &CompactOptions) -> EngineResult<CompactReport> {
    let dry_run = options.gc.dry_run;
    if !dry_run {
        // We hold the lock: every plan left is a dead GC's or compaction's. Removing them is
        // safe (GC's argument: a sweep deletes every run a plan supersedes before any pack)
        // and shows every run again, so none is merged that a plan would hide.
        repo.remove_stale_gc_plans().await?;
    }
    let (reader, _) = repo.v2_view_all().await.map_err(|e| match e {
        RepoError::IndexDamaged(damaged) => EngineError::Gc(format!(
            "{damaged}; compaction merges only an intact index: run `cairn repair`, which \
             rebuilds it from the packs; nothing was changed"
        )),
        e => e.into(),
    })?;
    let mut runs = reader.run_sizes();
    let mut report = CompactReport {
        runs_before: runs.len() as u64,
        entries_before: runs.iter().map(|r| r.entries).sum(),
        before_bytes: runs.iter().map(|r| r.len).sum(),
        ..Default::default()
    };
    let original: HashSet<Id> = runs.iter().map(|r| r.id).collect();
    let mut written: HashSet<Id> = HashSet::new();
    let mut superseded: Vec<Id> = Vec::new();
    let to_read: u64 = report.before_bytes;
    progress::start(
        &options.gc.progress,
        "merging index runs",
        Unit::Bytes,
        to_read,
    );
    while let Some(inputs) = next_merge(&runs, options.all).filter(|inputs| {
        let tier_of = |id: &Id| runs.iter().find(|r| r.id == *id).map(|r| tier(r.entries));
        options
            .max_tier
            .is_none_or(|max| tier_of(&inputs[0]).is_some_and(|t| t <= max))
    }) {
        crate::interrupt::check()?;
        let merged = if dry_run {
            // What the merge would hold, at most: the sum of its inputs.
            let entries = runs
                .iter()
                .filter(|r| inputs.contains(&r.id))
                .map(|r| r.entries)
                .sum();
            RunSize {
                id: Id::of(
                    &inputs
                        .iter()
                        .flat_map(|i| *i.as_bytes())
                        .collect::<Vec<u8>>(),
                ),
                entries,
                version: cairn_format::index_run::VERSION,
                len: 0,
            }
        } else {
            let merged = reader.merge_runs(&inputs).await?;
            report.read_bytes += merged.bytes_read;
            progress::add(&options.gc.progress, merged.bytes_read);
            let len = merged.bytes.len() as u64;
            let entries = merged.entries;
            let (id, new_bytes) = repo.put_run_bytes(merged.bytes).await?;
            reader.add_run(&id).await?;
            report.written_bytes += new_bytes;
            written.insert(id);
            RunSize {
                id,
                entries,
                version: cairn_format::index_run::VERSION,
                len,
            }
        };
        report.merges += 1;
        superseded.extend(inputs.iter().filter(|i| original.contains(*i)));
        runs.retain(|r| !inputs.contains(&r.id));
        runs.push(merged);
    }
    // A merge may rewrite a run byte for byte (a dead compaction's output, merged again from
    // the same inputs): never supersede a run this compaction wrote.
    superseded.retain(|id| !written.contains(id));
    report.runs_merged = superseded.len() as u64;
    report.runs_after = runs.len() as u64;
    report.entries_after = runs.iter().map(|r| r.entries).sum();
    report.after_bytes = runs.iter().map(|r| r.len).sum();
    if dry_run || superseded.is_empty() {
        return Ok(report);
    }
    let plan = GcPlan {
        created_ns: now_ns(),
        dead_blobs: Vec::new(),
        superseded_index: superseded.clone(),
    };
    let mut waited = GcReport::default();
    let published = publish_and_wait(repo, &plan, &options.gc, &mut waited).await?;
    report.waited_s = waited.waited_s;
    progress::start(&options.gc.progress, "deleting merged runs", Unit::Items, 0);
    repo.sweep(&superseded, &[]).await?;
    repo.withdraw_gc_plan(&published.plan).await;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(n: u8, entries: u64) -> RunSize {
        RunSize {
            id: Id::of(&[n]),
            entries,
            version: cairn_format::index_run::VERSION,
            len: entries * 12,
        }
    }

    #[test]
    fn tiers_grow_by_the_fan_in() {
        assert_eq!(tier(0), 0);
        assert_eq!(tier(TIER_BASE - 1), 0);
        assert_eq!(tier(TIER_BASE), 1);
        assert_eq!(tier(TIER_BASE * FAN_IN as u64 - 1), 1);
        assert_eq!(tier(TIER_BASE * FAN_IN as u64), 2);
        // 8192 · 8^16 = 2^61 is the last bound below 2^64.
        assert_eq!(tier(1 << 61), 17);
        assert_eq!(tier(u64::MAX), 17);
    }

    #[test]
    fn a_tier_is_merged_when_it_holds_fan_in_runs() {
        let small: Vec<RunSize> = (0..FAN_IN as u8 - 1).map(|i| run(i, 100)).collect();
        assert_eq!(next_merge(&small, false), None);
        let mut full = small.clone();
        full.push(run(99, 200));
        full.push(run(100, TIER_BASE * 3));
        let merge = next_merge(&full, false).expect("tier 0 is full");
        assert_eq!(merge.len(), FAN_IN);
        assert!(!merge.contains(&Id::of(&[100])), "a bigger run stays");
        // --all merges everything; a lone current run needs nothing, a lone old one does.
        assert_eq!(next_merge(&full, true).unwrap().len(), FAN_IN + 1);
        assert_eq!(next_merge(&[run(1, 5)], true), None);
        let old = RunSize {
            version: 1,
            ..run(1, 5)
        };
        assert_eq!(next_merge(&[old], true), Some(vec![old.id]));
    }

    /// N commits of one run each leave O(log N) runs: at most FAN_IN - 1 per tier.
    #[test]
    fn tiered_merges_keep_few_runs() {
        let mut runs: Vec<RunSize> = Vec::new();
        let mut next = 0u32;
        for _ in 0..10_000 {
            next += 1;
            runs.push(RunSize {
                id: Id::of(&next.to_le_bytes()),
                entries: 1000,
                version: 2,
                len: 0,
            });
            while let Some(inputs) = next_merge(&runs, false) {
                let entries = runs
                    .iter()
                    .filter(|r| inputs.contains(&r.id))
                    .map(|r| r.entries)
                    .sum();
                runs.retain(|r| !inputs.contains(&r.id));
                next += 1;
                runs.push(RunSize {
                    id: Id::of(&next.to_le_bytes()),
                    entries,
                    version: 2,
                    len: 0,
                });
            }
        }
        // 10,000,000 entries: tiers 0..=4, at most 7 runs each.
        assert!(runs.len() <= 5 * (FAN_IN - 1), "{} runs", runs.len());
        assert_eq!(runs.iter().map(|r| r.entries).sum::<u64>(), 10_000_000);
    }
}

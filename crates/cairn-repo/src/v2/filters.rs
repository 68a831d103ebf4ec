//! Run filters within the reader's budget (`CacheLimits::filter_bytes`): which runs hold
//! one, a large run's read only once it is asked often (`FILTER_AFTER_ASKS`), and the
//! largest dropped when the budget is exceeded.

use std::sync::Arc;

use super::runs::OpenRun;
use super::{sealed_error, V2Reader};
use crate::error::RepoResult;

/// Lookups a run answers through its fence keys before its filter is read, when the filter
/// did not come with the run's first read (runs of more than ~50,000 entries). A lookup there
/// reads a directory block and a section (~15 KB, cached); a filter is ~2 bytes an entry (2
/// MiB for a million). An export serving its first reads, a `show`, a `restore` of a few
/// versions ask a run a handful of times and never pay for its filter (the export of a 64 GiB
/// image read a 2 MiB filter before its first read); a commit asks thousands of times and
/// reads it at once.
pub const FILTER_AFTER_ASKS: u64 = 64;

impl V2Reader {
    /// Whether a filter of `bytes` is worth reading: it fits the budget beside those held, or
    /// it is smaller than the largest held (which [`Self::keep_filter_budget`] then drops).
    pub(super) fn filter_fits(&self, bytes: u64) -> bool {
        let runs = self.runs.read().expect("runs lock");
        let held: Vec<u64> = runs.iter().map(|r| r.filter_bytes()).collect();
        let total: u64 = held.iter().sum();
        bytes <= self.filter_budget
            && (total + bytes <= self.filter_budget || held.iter().any(|h| *h > bytes))
    }

    /// Drops the largest filters held until the rest fit the budget: a run without one
    /// costs a section read a lookup whatever its size, so the filters of small runs (the
    /// newest, asked first) are the ones worth their bytes.
    pub(super) fn keep_filter_budget(&self, runs: &[Arc<OpenRun>]) {
        let mut held: Vec<(u64, &Arc<OpenRun>)> = runs
            .iter()
            .map(|r| (r.filter_bytes(), r))
            .filter(|(b, _)| *b > 0)
            .collect();
        let mut total: u64 = held.iter().map(|(b, _)| b).sum();
        held.sort_by_key(|(b, _)| std::cmp::Reverse(*b));
        for (bytes, run) in held {
            if total <= self.filter_budget {
                break;
            }
            *run.filter.write().expect("filter lock") = None;
            total -= bytes;
            tracing::debug!(run = %run.key, bytes, "index run filter dropped (over budget)");
        }
    }

    /// Counts a lookup of `run` and, at its [`FILTER_AFTER_ASKS`]th while its filter is
    /// deferred, reads the filter if the budget has room (else the run stays asked through
    /// its fence keys, as a run whose filter was dropped). A filter that cannot be read is
    /// left out and the lookup goes on; an error of the store fails it, and a later lookup
    /// tries again.
    pub(super) async fn filter_when_asked(&self, run: &OpenRun) -> RepoResult<()> {
        use std::sync::atomic::Ordering::Relaxed;
        if !run.is_deferred() || run.asks.fetch_add(1, Relaxed) + 1 != FILTER_AFTER_ASKS {
            return Ok(());
        }
        run.deferred.store(false, Relaxed);
        let at = run.meta.filter_at.as_ref().expect("deferred for it");
        if !self.filter_fits(at.range.end - at.range.start) {
            return Ok(());
        }
        let stored = match super::tail::get_exact(&*self.store, &run.key, at.range.clone()).await {
            Ok(stored) => stored,
            Err(e) if e.is_damage() || e.is_not_found() => {
                tracing::debug!("{e}");
                return Ok(());
            }
            Err(e) => {
                run.asks.store(0, Relaxed);
                run.deferred.store(true, Relaxed);
                return Err(e);
            }
        };
        match run.meta.open_filter(&stored, self.key()) {
            Ok(filter) => {
                *run.filter.write().expect("filter lock") = Some(filter);
                let runs = self.runs.read().expect("runs lock").clone();
                self.keep_filter_budget(&runs);
            }
            Err(e) => tracing::debug!("{}", sealed_error(format!("{} filter", run.key), e)),
        }
        Ok(())
    }

    /// Reads the filters of version 3 runs asked without one that fit the budget now (a GC or
    /// a compaction removed runs since they were added: `Repo::refresh_index` calls it),
    /// smallest first; a deferred filter waits for its run's asks. A filter that cannot be
    /// read is left out: its run is still asked through its fence keys. (A version 1–2 run's
    /// filter came with its meta and is not read again.)
    pub async fn refill_filters(&self) -> RepoResult<usize> {
        let mut wanting: Vec<(u64, Arc<OpenRun>)> = {
            let runs = self.runs.read().expect("runs lock");
            runs.iter()
                .filter(|r| r.filter_bytes() == 0 && !r.is_deferred())
                .filter_map(|r| {
                    let at = r.meta.filter_at.as_ref()?;
                    Some((at.range.end - at.range.start, r.clone()))
                })
                .collect()
        };
        wanting.sort_by_key(|(bytes, _)| *bytes);
        let mut read = 0;
        for (bytes, run) in wanting {
            let (held, _) = self.filter_memory();
            if held + bytes > self.filter_budget {
                break;
            }
            let at = run.meta.filter_at.as_ref().expect("chosen for it");
            let filter =
                match super::tail::get_exact(&*self.store, &run.key, at.range.clone()).await {
                    Ok(stored) => run.meta.open_filter(&stored, self.key()),
                    Err(e) if e.is_damage() || e.is_not_found() => {
                        tracing::debug!("{e}");
                        continue;
                    }
                    Err(e) => return Err(e),
                };
            match filter {
                Ok(f) => {
                    *run.filter.write().expect("filter lock") = Some(f);
                    read += 1;
                }
                Err(e) => tracing::debug!("{}", sealed_error(format!("{} filter", run.key), e)),
            }
        }
        Ok(read)
    }

    /// Bytes of run filters held (within [`super::CacheLimits::filter_bytes`]) and how many
    /// runs are asked without one.
    pub fn filter_memory(&self) -> (u64, usize) {
        let runs = self.runs.read().expect("runs lock");
        let held: Vec<u64> = runs.iter().map(|r| r.filter_bytes()).collect();
        (held.iter().sum(), held.iter().filter(|b| **b == 0).count())
    }
}

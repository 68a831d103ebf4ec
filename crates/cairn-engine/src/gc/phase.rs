//! Wall time per GC step, so that where a GC spends its time is measured rather than guessed
//! (GC must not grow with history). Each step's time goes to the report
//! (`gc --json`: `phases_s`) and to a `debug` event (`CAIRN_LOG=cairn_engine=debug`).
//!
//! A clock rather than `tracing` spans: a step is a stretch of one async function, often
//! with early returns, and a span entered across an `.await` would be misattributed.

use std::time::Instant;

use super::GcReport;

/// Times consecutive steps: each [`PhaseClock::lap`] ends the step that began at the last.
pub(super) struct PhaseClock {
    since: Instant,
}

impl PhaseClock {
    pub(super) fn start() -> PhaseClock {
        PhaseClock {
            since: Instant::now(),
        }
    }

    /// Ends step `name` (what ran since the last lap): its seconds are added to the report.
    pub(super) fn lap(&mut self, name: &'static str, report: &mut GcReport) {
        let now = Instant::now();
        let seconds = now.duration_since(self.since).as_secs_f64();
        self.since = now;
        tracing::debug!(phase = name, ms = seconds * 1e3, "gc step done");
        match report.phases.iter_mut().find(|(n, _)| *n == name) {
            Some((_, total)) => *total += seconds,
            None => report.phases.push((name, seconds)),
        }
    }
}

//! Live counters of long work that is not a commit or a restore (verify, GC, and the GC that
//! `rm` and `prune` run), for a progress display: the step under way and how far it is.
//!
//! The engine only stores numbers; the CLI reads them from another thread (relaxed atomics:
//! a display may be a tick behind, never wrong for long) and draws a bar with an ETA.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// What a step counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Unit {
    /// Bytes (read, checked, rewritten).
    #[default]
    Bytes,
    /// Whole things: versions, packs, objects.
    Items,
}

/// The step under way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Step {
    /// What the step does, in a few words ("reading packs").
    pub name: &'static str,
    pub unit: Unit,
    /// Bumped at every new step, so a reader notices a step that has the same name.
    pub number: u64,
}

/// A step and how far it got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepRecord {
    pub step: Step,
    pub done: u64,
    pub total: u64,
}

#[derive(Debug, Default)]
pub struct WorkProgress {
    step: Mutex<Step>,
    /// The steps before the current one (a handful per run), for tests and summaries.
    finished: Mutex<Vec<StepRecord>>,
    /// Units of the current step done, and in all (0: not known).
    done: AtomicU64,
    total: AtomicU64,
}

impl WorkProgress {
    /// Starts a new step of `total` units (0 if unknown); `done` starts at 0.
    pub fn start(&self, name: &'static str, unit: Unit, total: u64) {
        let mut step = self.step.lock().expect("progress lock");
        if step.number > 0 {
            self.finished
                .lock()
                .expect("progress lock")
                .push(self.record(*step));
        }
        self.done.store(0, Ordering::Relaxed);
        self.total.store(total, Ordering::Relaxed);
        *step = Step {
            name,
            unit,
            number: step.number + 1,
        };
    }

    /// `n` more units of the current step are done.
    pub fn add(&self, n: u64) {
        self.done.fetch_add(n, Ordering::Relaxed);
    }

    /// Every step so far, the current one last.
    pub fn steps(&self) -> Vec<StepRecord> {
        let step = self.step.lock().expect("progress lock");
        let mut all = self.finished.lock().expect("progress lock").clone();
        if step.number > 0 {
            all.push(self.record(*step));
        }
        all
    }

    fn record(&self, step: Step) -> StepRecord {
        StepRecord {
            step,
            done: self.done(),
            total: self.total(),
        }
    }

    pub fn step(&self) -> Step {
        *self.step.lock().expect("progress lock")
    }

    pub fn done(&self) -> u64 {
        self.done.load(Ordering::Relaxed)
    }

    pub fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }
}

/// Starts a step on an optional progress (the engine's callers pass `None` when nobody
/// watches).
pub(crate) fn start(
    p: &Option<std::sync::Arc<WorkProgress>>,
    name: &'static str,
    unit: Unit,
    total: u64,
) {
    if let Some(p) = p {
        p.start(name, unit, total);
    }
}

/// Adds to an optional progress.
pub(crate) fn add(p: &Option<std::sync::Arc<WorkProgress>>, n: u64) {
    if let Some(p) = p {
        p.add(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_step_resets_the_counts_and_is_told_apart_from_the_last() {
        let p = WorkProgress::default();
        p.start("reading packs", Unit::Bytes, 100);
        p.add(40);
        p.add(2);
        assert_eq!((p.done(), p.total()), (42, 100));
        let first = p.step();
        p.start("reading packs", Unit::Bytes, 0);
        assert_eq!((p.done(), p.total()), (0, 0));
        assert_eq!(p.step().name, first.name);
        assert_ne!(p.step(), first);
        p.start("deleting", Unit::Items, 3);
        assert_eq!(p.step().unit, Unit::Items);
        let steps: Vec<(&str, u64, u64)> = p
            .steps()
            .iter()
            .map(|r| (r.step.name, r.done, r.total))
            .collect();
        assert_eq!(
            steps,
            [
                ("reading packs", 42, 100),
                ("reading packs", 0, 0),
                ("deleting", 0, 3)
            ]
        );
    }
}

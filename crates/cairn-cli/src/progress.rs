//! Progress bars on stderr, fed from the engine's atomic counters by a ticker thread.
//! Shown only on a terminal and never with --json or --quiet: commit and restore count
//! bytes; verify and GC (also run by `rm` and `prune`) show one bar per step.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use cairn_engine::progress::{Step, Unit, WorkProgress};
use indicatif::{ProgressBar, ProgressStyle};

pub struct Ticker {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Ticker {
    /// Starts a bar if stderr is a terminal and `enabled`. `position` and `total` are read
    /// every 100 ms; `extra` renders the bar's message.
    pub fn start(
        enabled: bool,
        total: Arc<AtomicU64>,
        position: impl Fn() -> u64 + Send + 'static,
        extra: impl Fn() -> String + Send + 'static,
    ) -> Ticker {
        Self::spawn(enabled, move |shown| {
            let bar = shown.get_or_insert_with(|| new_bar(TRANSFER_BAR, 0, ""));
            bar.set_length(total.load(Ordering::Relaxed));
            bar.set_position(position());
            bar.set_message(extra());
        })
    }

    /// A bar for verify and GC: a new bar for each step of `progress`, named after it, in
    /// bytes or items, with an ETA once the step's total is known (a spinner until then).
    pub fn work(enabled: bool, progress: Arc<WorkProgress>) -> Ticker {
        let mut step_shown: Option<Step> = None;
        Self::spawn(enabled, move |shown| {
            let step = progress.step();
            if step.number == 0 {
                return; // nothing started yet: draw nothing
            }
            let (total, done) = (progress.total(), progress.done());
            let template = match (total, step.unit) {
                (0, _) => SPINNER,
                (_, Unit::Bytes) => BYTES_BAR,
                (_, Unit::Items) => ITEMS_BAR,
            };
            let same_step = step_shown == Some(step);
            match shown {
                Some(bar) if same_step && (total == 0 || bar.length() == Some(total)) => {}
                Some(bar) if same_step => {
                    // The total became known or changed: same bar, new style (keeps the ETA).
                    bar.set_length(total);
                    bar.set_style(ProgressStyle::with_template(template).expect("template"));
                }
                _ => {
                    // A new step: a fresh bar (its rate and ETA start again).
                    if let Some(old) = shown.take() {
                        old.finish_and_clear();
                    }
                    *shown = Some(new_bar(template, total, step.name));
                    step_shown = Some(step);
                }
            }
            if let Some(bar) = shown {
                bar.set_position(done);
            }
        })
    }

    /// Counters for verify or GC and the bar that shows them; no counters (the engine skips
    /// counting) when no bar will be shown.
    pub fn for_work(enabled: bool) -> (Option<Arc<WorkProgress>>, Ticker) {
        if !enabled || !std::io::stderr().is_terminal() {
            return (None, Self::spawn(false, |_| {}));
        }
        let progress = Arc::new(WorkProgress::default());
        (Some(progress.clone()), Self::work(true, progress))
    }

    /// Runs `tick` every 100 ms on a thread of its own until the ticker is dropped; `tick`
    /// creates and updates the bar shown (none until it does), which is cleared at the end.
    fn spawn(
        enabled: bool,
        mut tick: impl FnMut(&mut Option<ProgressBar>) + Send + 'static,
    ) -> Ticker {
        let stop = Arc::new(AtomicBool::new(false));
        if !enabled || !std::io::stderr().is_terminal() {
            return Ticker { stop, thread: None };
        }
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut shown = None;
            while !s.load(Ordering::Relaxed) {
                tick(&mut shown);
                std::thread::sleep(Duration::from_millis(100));
            }
            if let Some(bar) = shown {
                bar.finish_and_clear();
            }
        });
        Ticker {
            stop,
            thread: Some(thread),
        }
    }
}

/// A bar configured before it is first drawn (the builder methods do not draw).
fn new_bar(template: &str, total: u64, name: &'static str) -> ProgressBar {
    ProgressBar::new(total)
        .with_style(ProgressStyle::with_template(template).expect("template"))
        .with_prefix(name)
}

/// Commit and restore: bytes, rate, ETA and a message.
const TRANSFER_BAR: &str = "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {msg}";
/// A step of verify or GC, named by the prefix.
const BYTES_BAR: &str = "{spinner} {prefix} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta}";
const ITEMS_BAR: &str = "{spinner} {prefix} [{elapsed_precise}] {wide_bar} {pos}/{len} ETA {eta}";
const SPINNER: &str = "{spinner} {prefix} [{elapsed_precise}]";

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

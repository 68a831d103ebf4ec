//! Progress bars on stderr, fed from the engine's atomic counters by a ticker thread.
//! Shown only on a terminal and never with --json or --quiet.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

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
        let stop = Arc::new(AtomicBool::new(false));
        if !enabled || !std::io::stderr().is_terminal() {
            return Ticker { stop, thread: None };
        }
        let bar = ProgressBar::new(total.load(Ordering::Relaxed));
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {bytes_per_sec} ETA {eta} {msg}",
            )
            .expect("template"),
        );
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            while !s.load(Ordering::Relaxed) {
                bar.set_length(total.load(Ordering::Relaxed));
                bar.set_position(position());
                bar.set_message(extra());
                std::thread::sleep(Duration::from_millis(100));
            }
            bar.finish_and_clear();
        });
        Ticker {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

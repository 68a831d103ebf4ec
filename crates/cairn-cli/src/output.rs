//! Printing: human text or JSON, human-friendly sizes and times.
//!
//! Everything a command prints for the user goes through `outln!` (or
//! [`print_json`]): a closed pipe (`cairn log IMAGE | head -1`) then ends nothing — later
//! output is dropped, the command finishes its work (and its cleanup) and exits 0, as
//! command-line tools do. Any other failure to write standard output (a full disk behind a
//! redirection) is remembered and turns a successful command into an error at the end
//! ([`finish`]), so output is never lost silently.

use std::io::{ErrorKind, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use cairn_format::version::VersionRecord;
use cairn_format::Id;
use serde_json::{json, Value};

/// `1536` → `1.5 KiB`.
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Bytes per second as `123.4 MiB/s`.
pub fn rate(n: u64, d: Duration) -> String {
    let s = d.as_secs_f64().max(1e-9);
    format!("{}/s", bytes((n as f64 / s) as u64))
}

/// RFC 3339 UTC time from nanoseconds since the epoch.
pub fn time(ns: i64) -> String {
    let secs = ns.div_euclid(1_000_000_000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// The JSON form of a version, the same object wherever a version is printed (commit, log,
/// show, images, clone, rm); `tags` are the tags naming it.
pub fn version_json(id: &Id, r: &VersionRecord, tags: &[String]) -> Value {
    json!({
        "id": id.to_hex(),
        "image": r.image,
        "seq": r.seq,
        "parent": r.parent.map(|p| p.to_hex()),
        "time": time(r.time_ns),
        "time_ns": r.time_ns,
        "message": r.message,
        "logical_bytes": r.logical_size,
        "data_bytes": r.stats.data_bytes,
        "stored_bytes": r.stats.stored_bytes,
        "chunks": r.stats.chunks,
        "new_chunks": r.stats.new_chunks,
        "new_chunk_bytes": r.stats.new_chunk_bytes,
        "root": r.root.map(|p| p.to_hex()),
        "tree_height": r.height,
        "segment_size": r.segment_size,
        "tags": tags,
    })
}

/// `println!` for what a command prints: see the module's documentation.
macro_rules! outln {
    () => {
        $crate::output::write_stdout(format_args!("\n"))
    };
    ($($arg:tt)*) => {
        $crate::output::write_stdout(format_args!("{}\n", format_args!($($arg)*)))
    };
}

/// Standard output was found closed: what follows is dropped.
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);
/// The first failure to write standard output other than a closed pipe.
static STDOUT_FAILED: Mutex<Option<String>> = Mutex::new(None);

/// Writes to standard output (flushed, so a closed pipe is seen at once).
pub fn write_stdout(args: std::fmt::Arguments<'_>) {
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut out = std::io::stdout().lock();
    if let Err(e) = out.write_fmt(args).and_then(|()| out.flush()) {
        STDOUT_CLOSED.store(true, Ordering::Relaxed);
        if e.kind() != ErrorKind::BrokenPipe {
            let mut failed = STDOUT_FAILED.lock().unwrap_or_else(|p| p.into_inner());
            failed.get_or_insert_with(|| e.to_string());
        }
    }
}

/// The error to report if standard output could not be written (other than a closed pipe).
pub fn finish() -> anyhow::Result<()> {
    let failed = STDOUT_FAILED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    match failed {
        Some(e) => anyhow::bail!("cannot write to standard output: {e}"),
        None => Ok(()),
    }
}

/// Prints JSON on stdout (pretty, one value).
pub fn print_json(v: &Value) {
    let text = serde_json::to_string_pretty(v).expect("JSON");
    outln!("{text}");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(bytes(1536), "1.5 KiB");
        assert_eq!(bytes(10), "10 B");
        assert_eq!(time(0), "1970-01-01T00:00:00Z");
        assert_eq!(time(1_763_769_600_000_000_000), "2025-11-22T00:00:00Z");
    }
}

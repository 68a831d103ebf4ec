//! Interruption: a SIGINT or SIGTERM asks long work to stop at its next safe point.
//!
//! The binary records the signal with [`request`]; loops that may run for long (reading a
//! commit's source, writing a restore, reading packs in verify, a GC before it deletes
//! anything and while it waits) call [`check`], which turns the request into
//! [`EngineError::Interrupted`]. The error then takes the normal failure path: a commit's
//! unpublished packs are deleted, a restore's temporary file is removed, a GC withdraws its
//! plan and releases its lock, the session is closed. A GC that has started deleting
//! finishes its sweep first (it is short and leaves the repository tidier than stopping).

use std::sync::atomic::{AtomicI32, Ordering};

use crate::error::{EngineError, EngineResult};

static SIGNAL: AtomicI32 = AtomicI32::new(0);

/// Records that signal `signal` (e.g. `libc::SIGINT`) asked this process to stop.
pub fn request(signal: i32) {
    SIGNAL.store(signal, Ordering::SeqCst);
}

/// The signal that asked this process to stop, if one did.
pub fn requested() -> Option<i32> {
    match SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        s => Some(s),
    }
}

/// Fails with [`EngineError::Interrupted`] once a stop was requested.
pub fn check() -> EngineResult<()> {
    match requested() {
        None => Ok(()),
        Some(signal) => Err(EngineError::Interrupted {
            signal: signal_name(signal),
        }),
    }
}

/// `SIGINT`, `SIGTERM`, … for messages.
pub fn signal_name(signal: i32) -> &'static str {
    match signal {
        libc::SIGINT => "SIGINT",
        libc::SIGTERM => "SIGTERM",
        libc::SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}

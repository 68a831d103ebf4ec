//! Sessions: every process working on a repository announces itself with a ref
//! `sessions/<random id>` holding its start time and a heartbeat, refreshed while it runs.
//!
//! This is half of the GC safety protocol (see docs/ARCHITECTURE.md): a session is registered
//! *before* the process reads GC plans and loads the index. A GC publishes its plan and then
//! waits for every session that existed at that moment; any session registered later is
//! guaranteed to see the plan and to avoid the blobs it names.
//!
//! A session is dead when its process is: on the host that runs it, that is known at once
//! (the session records the boot, PID namespace, pid and start time of its process — see
//! [`ProcessTag`]); from any other host, when its heartbeat is older than the staleness limit.

use cairn_format::keys;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use cairn_format::marker::{ProcessTag, Session};
use cairn_store::{CasOutcome, ObjectStore};
use tokio::task::JoinHandle;

use crate::error::RepoResult;

/// This process's tag (`None` where `/proc` does not tell: then only heartbeats count).
pub fn current_process() -> Option<&'static ProcessTag> {
    static TAG: OnceLock<Option<ProcessTag>> = OnceLock::new();
    TAG.get_or_init(|| {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
        let pid_namespace = pid_namespace("/proc/self/ns/pid")?;
        let (start_ticks, _) = proc_stat(std::process::id())?;
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_default();
        Some(ProcessTag {
            boot_id: boot_id.trim().to_string(),
            pid_namespace,
            start_ticks,
            host,
        })
    })
    .as_ref()
}

/// The inode of a namespace link such as `/proc/self/ns/pid` (`pid:[4026531836]`).
fn pid_namespace(link: &str) -> Option<u64> {
    let target = std::fs::read_link(link).ok()?;
    let t = target.to_str()?;
    t.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
}

/// Start time (clock ticks since boot) and state letter of process `pid`, from
/// `/proc/<pid>/stat`; `None` if there is no such process.
fn proc_stat(pid: u32) -> Option<(u64, char)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) is in parentheses and may contain anything: parse after it.
    let rest = &stat[stat.rfind(')')? + 2..];
    let mut fields = rest.split(' ');
    let state = fields.next()?.chars().next()?;
    // `rest` starts at field 3 (state); the start time is field 22.
    let start = fields.nth(22 - 4)?.parse().ok()?;
    Some((start, state))
}

/// Whether process `pid` that started at `start_ticks` (see [`ProcessTag`]) still runs on
/// this host. A zombie counts as gone; so does a pid now used by a later process.
pub fn process_alive(pid: u32, start_ticks: u64) -> bool {
    matches!(proc_stat(pid), Some((start, state)) if start == start_ticks && !matches!(state, 'Z' | 'X'))
}

/// What a session is for. Stored in the session marker as its [`SessionKind::name`]; a kind
/// this build does not know (written by a newer one) is treated as a writer GC waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SessionKind {
    Init,
    /// A library user's generic session ([`crate::Repo::open`]).
    Open,
    Read,
    Restore,
    Verify,
    /// A lazy export; its COMMITs open [`SessionKind::Commit`] sessions of their own.
    Export,
    /// Ref edits: tag, rm, prune, clone.
    Edit,
    Commit,
    Repair,
    Gc,
}

impl SessionKind {
    pub const ALL: [SessionKind; 10] = [
        SessionKind::Init,
        SessionKind::Open,
        SessionKind::Read,
        SessionKind::Restore,
        SessionKind::Verify,
        SessionKind::Export,
        SessionKind::Edit,
        SessionKind::Commit,
        SessionKind::Repair,
        SessionKind::Gc,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SessionKind::Init => "init",
            SessionKind::Open => "open",
            SessionKind::Read => "read",
            SessionKind::Restore => "restore",
            SessionKind::Verify => "verify",
            SessionKind::Export => "export",
            SessionKind::Edit => "edit",
            SessionKind::Commit => "commit",
            SessionKind::Repair => "repair",
            SessionKind::Gc => "gc",
        }
    }

    pub fn parse(name: &str) -> Option<SessionKind> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Only reads: may work without a session when none can be registered (a read-only
    /// store). A GC may then remove a pack under it, which fails the read cleanly, never
    /// silently. Writers may not: their safety against GC rests on the session.
    pub fn only_reads(self) -> bool {
        matches!(
            self,
            SessionKind::Read | SessionKind::Restore | SessionKind::Verify | SessionKind::Export
        )
    }

    /// Whether a GC waits for a session of kind `name` (as stored) before deleting. Exports
    /// live for days and only read live versions: a repacked blob they then miss is found
    /// again by re-reading the index (`Repo::refresh_index`), and a version deleted while
    /// exported fails its reads with an error, never wrong data.
    pub fn gc_waits_for(name: &str) -> bool {
        Self::parse(name) != Some(SessionKind::Export)
    }
}

impl std::fmt::Display for SessionKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Whether a session's process may still be working.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Liveness {
    Alive,
    /// Dead for certain (its process is gone) or presumed dead (no heartbeat for too long);
    /// the text says which, for messages.
    Dead(String),
}

/// Judges `session` as seen at `now_ns`: dead if its heartbeat is older than `stale_after`,
/// or if it ran on this host (same boot and PID namespace) and no process with its pid and
/// start time exists (a zombie counts as gone).
pub fn liveness(session: &Session, now_ns: i64, stale_after: Duration) -> Liveness {
    let age_ns = now_ns.saturating_sub(session.heartbeat_ns);
    if age_ns >= stale_after.as_nanos() as i64 {
        return Liveness::Dead(format!("no heartbeat for {:.0} s", age_ns as f64 / 1e9));
    }
    let (Some(tag), Some(me)) = (&session.process, current_process()) else {
        return Liveness::Alive;
    };
    if tag.boot_id != me.boot_id || tag.pid_namespace != me.pid_namespace {
        return Liveness::Alive; // another host or container: only its heartbeat tells
    }
    match proc_stat(session.pid) {
        None => Liveness::Dead(format!("process {} has exited", session.pid)),
        Some((_, 'Z' | 'X')) => Liveness::Dead(format!("process {} has exited", session.pid)),
        Some((start, _)) if start != tag.start_ticks => Liveness::Dead(format!(
            "process {} has exited (the pid now belongs to another process)",
            session.pid
        )),
        Some(_) => Liveness::Alive,
    }
}

/// A session as a person reads it: its kind, process and age.
pub fn describe(key: &str, session: &Session, now_ns: i64) -> String {
    let host = session
        .process
        .as_ref()
        .map(|p| format!(" on {}", p.host))
        .unwrap_or_default();
    format!(
        "{} (pid {}{host}, started {:.0} s ago, session {})",
        session.kind,
        session.pid,
        now_ns.saturating_sub(session.started_ns) as f64 / 1e9,
        key.strip_prefix(keys::SESSIONS).unwrap_or(key)
    )
}

/// How often a live session refreshes its heartbeat.
pub const HEARTBEAT: Duration = Duration::from_secs(10);

/// How long heartbeats must keep failing before the failure is logged as a warning.
const HEARTBEAT_WARN_AFTER: Duration = Duration::from_secs(60);

pub fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// A registered session; closes (removes its ref) on [`SessionHandle::close`]. If the process
/// dies, the ref stays and goes stale.
#[derive(Debug)]
pub(crate) struct SessionHandle {
    pub key: String,
    pub started_ns: i64,
    heartbeat: Option<JoinHandle<()>>,
    store: Arc<dyn ObjectStore>,
}

impl SessionHandle {
    pub async fn register(
        store: Arc<dyn ObjectStore>,
        kind: SessionKind,
    ) -> RepoResult<SessionHandle> {
        let id: [u8; 16] = rand::random();
        let key = keys::session(&id);
        let started_ns = now_ns();
        let session = Session {
            started_ns,
            heartbeat_ns: started_ns,
            pid: std::process::id(),
            kind: kind.name().to_string(),
            process: current_process().cloned(),
        };
        let mut version = match store
            .cas_ref(&key, None, Some(Bytes::from(session.encode())))
            .await?
        {
            CasOutcome::Swapped { version } => version,
            CasOutcome::Conflict { .. } => None, // 128 random bits collided: run without heartbeat
        };
        let heartbeat = {
            let store = store.clone();
            let key = key.clone();
            tokio::spawn(async move {
                let mut session = session;
                let mut failing_since: Option<std::time::Instant> = None;
                loop {
                    tokio::time::sleep(HEARTBEAT).await;
                    session.heartbeat_ns = now_ns();
                    match store
                        .cas_ref(&key, version.as_ref(), Some(Bytes::from(session.encode())))
                        .await
                    {
                        Ok(CasOutcome::Swapped { version: v }) => {
                            version = v;
                            failing_since = None;
                        }
                        Ok(CasOutcome::Conflict { .. }) => return,
                        Err(e) => {
                            // A missed beat or two is harmless (sessions go stale after
                            // minutes) and, when the store is failing, the command's own
                            // error says so: only a lasting failure is worth a warning.
                            let since = *failing_since.get_or_insert_with(std::time::Instant::now);
                            if since.elapsed() >= HEARTBEAT_WARN_AFTER {
                                tracing::warn!(
                                    "session heartbeat {key} failing for {} s: {e}",
                                    since.elapsed().as_secs()
                                );
                            } else {
                                tracing::debug!("session heartbeat {key}: {e}");
                            }
                        }
                    }
                }
            })
        };
        Ok(SessionHandle {
            key,
            started_ns,
            heartbeat: Some(heartbeat),
            store,
        })
    }

    /// Stops the heartbeat and removes the session's ref.
    pub async fn close(mut self) -> RepoResult<()> {
        if let Some(h) = self.heartbeat.take() {
            h.abort();
        }
        if let Some(state) = self.store.read_ref(&self.key).await? {
            self.store
                .cas_ref(&self.key, Some(&state.version), None)
                .await?;
        }
        // Session keys are random and never reused, so what the deletion left (a tombstone on
        // S3) can go; the key is a whole segment, so the prefix matches only this session.
        self.store.forget_deleted_refs(&self.key).await?;
        Ok(())
    }
}

impl Drop for SessionHandle {
    /// A session dropped without `close` (an error path, a panic) is removed in the background
    /// if a runtime is still there; otherwise it goes stale like a dead process's.
    fn drop(&mut self) {
        let Some(h) = self.heartbeat.take() else {
            return; // closed properly
        };
        h.abort();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (store, key) = (self.store.clone(), self.key.clone());
            rt.spawn(async move {
                if let Ok(Some(state)) = store.read_ref(&key).await {
                    let _ = store.cas_ref(&key, Some(&state.version), None).await;
                    let _ = store.forget_deleted_refs(&key).await;
                }
            });
        }
    }
}

/// Every session in the store, with its key.
pub(crate) async fn list_sessions(
    store: &dyn ObjectStore,
) -> RepoResult<Vec<(String, Option<Session>)>> {
    let mut out = Vec::new();
    for key in store.list_refs(keys::SESSIONS).await? {
        let session = match store.read_ref(&key).await? {
            Some(state) => Session::decode(&state.data).ok(),
            None => continue, // closed meanwhile
        };
        out.push((key, session));
    }
    Ok(out)
}

//! Sessions: every process working on a repository announces itself with a ref
//! `sessions/<random id>` holding its start time and a heartbeat, refreshed while it runs.
//!
//! This is half of the GC safety protocol (see docs/ARCHITECTURE.md): a session is registered
//! *before* the process reads GC plans and loads the index. A GC publishes its plan and then
//! waits for every session that existed at that moment; any session registered later is
//! guaranteed to see the plan and to avoid the blobs it names. A session whose heartbeat is
//! older than the staleness limit belongs to a dead process and is not waited for.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use cairn_format::marker::{Session, SESSIONS_PREFIX};
use cairn_store::{CasOutcome, ObjectStore};
use tokio::task::JoinHandle;

use crate::error::RepoResult;

/// How often a live session refreshes its heartbeat.
pub const HEARTBEAT: Duration = Duration::from_secs(10);

pub fn now_ns() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as i64)
        .unwrap_or(0)
}

/// A registered session; closes (removes its ref) on [`SessionHandle::close`]. If the process
/// dies, the ref stays and goes stale.
#[derive(Debug)]
pub struct SessionHandle {
    pub key: String,
    pub started_ns: i64,
    heartbeat: Option<JoinHandle<()>>,
    store: Arc<dyn ObjectStore>,
}

impl SessionHandle {
    pub async fn register(store: Arc<dyn ObjectStore>, kind: &str) -> RepoResult<SessionHandle> {
        let id: [u8; 16] = rand::random();
        let key = format!("{SESSIONS_PREFIX}{}", hex::encode(id));
        let started_ns = now_ns();
        let session = Session {
            started_ns,
            heartbeat_ns: started_ns,
            pid: std::process::id(),
            kind: kind.to_string(),
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
                loop {
                    tokio::time::sleep(HEARTBEAT).await;
                    session.heartbeat_ns = now_ns();
                    match store
                        .cas_ref(&key, version.as_ref(), Some(Bytes::from(session.encode())))
                        .await
                    {
                        Ok(CasOutcome::Swapped { version: v }) => version = v,
                        Ok(CasOutcome::Conflict { .. }) => return,
                        Err(e) => tracing::warn!("session heartbeat {key}: {e}"),
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
pub async fn list_sessions(store: &dyn ObjectStore) -> RepoResult<Vec<(String, Option<Session>)>> {
    let mut out = Vec::new();
    for key in store.list_refs(SESSIONS_PREFIX).await? {
        let session = match store.read_ref(&key).await? {
            Some(state) => Session::decode(&state.data).ok(),
            None => continue, // closed meanwhile
        };
        out.push((key, session));
    }
    Ok(out)
}

//! The repository side of the GC protocol (docs/ARCHITECTURE.md, "GC safety"): the lock, the
//! plans, the record of the last completed GC, and the deletions of a sweep, each in the order
//! the protocol requires. The engine decides *what* is dead; this module owns *how* that
//! decision is published and carried out in the store.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use cairn_format::marker::{
    decode_gc_last, decode_gc_lock, encode_gc_last, encode_gc_lock, GcPlan, Session,
};
use cairn_format::{keys, Id};
use cairn_store::{CasOutcome, RefVersion, StoreError};

use crate::error::{RepoError, RepoResult};
use crate::repository::Repo;
use crate::session::{describe, liveness, now_ns, Liveness};

/// The GC lock, held by this process until [`Repo::release_gc_lock`] (or until its session
/// dies, when the next GC takes the lock over).
#[derive(Debug)]
#[must_use = "a GC lock must be released"]
pub struct GcLock {
    version: RefVersion,
}

/// What an attempt to take the GC lock found.
#[derive(Debug)]
pub enum GcLockAttempt {
    Taken(GcLock),
    /// Another GC holds the lock and its session is alive (described for messages).
    HeldBy(String),
    /// This process has no session (a read-only store): it cannot hold the lock.
    NoSession,
    /// The lock kept changing hands while we tried.
    Contended,
}

/// A GC plan this process published; withdraw it or complete the GC with it.
#[derive(Debug, Clone)]
pub struct PublishedPlan {
    pub id: Id,
}

impl Repo {
    /// Takes the GC lock, taking it over from a GC whose session is dead (judged with
    /// `stale_after`, see [`liveness`]).
    pub async fn take_gc_lock(&self, stale_after: Duration) -> RepoResult<GcLockAttempt> {
        let Some(me) = self.session_key() else {
            return Ok(GcLockAttempt::NoSession);
        };
        let data = Bytes::from(encode_gc_lock(&me));
        let store = self.store();
        for _ in 0..5 {
            match store
                .cas_ref(keys::GC_LOCK, None, Some(data.clone()))
                .await?
            {
                CasOutcome::Swapped { version: Some(v) } => {
                    return Ok(GcLockAttempt::Taken(GcLock { version: v }))
                }
                CasOutcome::Swapped { version: None } => return Ok(GcLockAttempt::Contended),
                CasOutcome::Conflict { current: None } => continue,
                CasOutcome::Conflict {
                    current: Some(current),
                } => {
                    // A lock that does not decode names no session that could be waited
                    // for: damaged bookkeeping, taken over like a dead GC's (never blocking
                    // every later GC). A GC still running under it finds its lock gone when
                    // it releases it; its plan-and-wait protocol keeps its own deletions safe.
                    match decode_gc_lock(&current.data) {
                        Ok(holder) if holder.starts_with(keys::SESSIONS) => {
                            if let Some(alive) = self.live_session(&holder, stale_after).await? {
                                return Ok(GcLockAttempt::HeldBy(alive));
                            }
                            tracing::info!("taking over the gc lock of dead session {holder}");
                        }
                        other => tracing::warn!(
                            "refs/{}: the gc lock cannot be read ({}); taking it over",
                            keys::GC_LOCK,
                            match other {
                                Err(e) => e.to_string(),
                                Ok(holder) => format!("{holder:?} is no session"),
                            }
                        ),
                    }
                    // The holder died: take the lock over.
                    if let CasOutcome::Swapped { version: Some(v) } = store
                        .cas_ref(keys::GC_LOCK, Some(&current.version), Some(data.clone()))
                        .await?
                    {
                        return Ok(GcLockAttempt::Taken(GcLock { version: v }));
                    }
                }
            }
        }
        Ok(GcLockAttempt::Contended)
    }

    /// Releases the lock if it is still ours. A failure leaves a lock that dies with our
    /// session, so it is only logged.
    pub async fn release_gc_lock(&self, lock: GcLock) {
        if let Err(e) = self
            .store()
            .cas_ref(keys::GC_LOCK, Some(&lock.version), None)
            .await
        {
            tracing::debug!("could not release the gc lock: {e}");
        }
    }

    /// The session `key` described, if it is alive.
    async fn live_session(&self, key: &str, stale_after: Duration) -> RepoResult<Option<String>> {
        let Some(state) = self.store().read_ref(key).await? else {
            return Ok(None);
        };
        let Ok(s) = Session::decode(&state.data) else {
            return Ok(None);
        };
        let now = now_ns();
        Ok(match liveness(&s, now, stale_after) {
            Liveness::Alive => Some(describe(key, &s, now)),
            Liveness::Dead(_) => None,
        })
    }

    /// Step 3: publishes `plan`. Sessions registered after this returns see it.
    pub async fn publish_gc_plan(&self, plan: &GcPlan) -> RepoResult<PublishedPlan> {
        let raw = plan.encode();
        let id = Id::of(&raw);
        self.store()
            .put_if_absent(&keys::plan(&id), Bytes::from(raw))
            .await?;
        Ok(PublishedPlan { id })
    }

    /// Withdraws a plan whose GC deletes nothing after all (best effort: a plan left behind
    /// only makes readers skip index files that still exist, until the next GC removes it).
    pub async fn withdraw_gc_plan(&self, plan: &PublishedPlan) {
        if let Err(e) = self.store().delete(&keys::plan(&plan.id)).await {
            tracing::debug!("could not withdraw gc plan {}: {e}", plan.id);
        }
    }

    /// Withdraws every published plan, after a failed GC that holds the lock (so every plan
    /// is its own or a dead GC's). Safe at any step: a sweep deletes index files before the
    /// packs they name, so a pack it did not reach is still indexed (live for every reader) or
    /// named by no index at all (reused by no one).
    pub async fn withdraw_all_gc_plans(&self) {
        if let Ok(plans) = self.store().list(keys::PLANS).await {
            for meta in plans {
                let _ = self.store().delete(&meta.key).await;
            }
        }
    }

    /// Removes the plans of dead GCs (the caller holds the lock, so every pending plan is
    /// one), failing if one cannot be removed. Safe: a plan's sweep deletes every index file
    /// it supersedes before any pack, so while one of them is left no pack it named is gone,
    /// and once all are gone the plan hides nothing. Needed on format 2, where GC's index
    /// run can be byte-identical to one a dead GC's plan supersedes (same live data, same
    /// run): that plan would hide the new run from every reader.
    /// A plan that cannot be read (bytes that do not decode or do not match its key) is set
    /// aside under `damaged/` rather than deleted: it is evidence, and no reader heeds it.
    pub async fn remove_stale_gc_plans(&self) -> RepoResult<usize> {
        let plans = self.store().list(keys::PLANS).await?;
        for meta in &plans {
            match self.store().get(&meta.key).await {
                Ok(raw) if self.plan_problem(&meta.key, &raw).is_some() => {
                    self.set_aside_object(&meta.key).await?;
                }
                Ok(_) => self.store().delete(&meta.key).await?,
                Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(plans.len())
    }

    /// Step 6 (deletions, in this order): the superseded index files — their replacements are
    /// written — then the packs they named.
    /// (Format 2: the superseded index runs.)
    pub async fn sweep(&self, index_files: &[Id], packs: &[Id]) -> RepoResult<()> {
        for id in index_files {
            let key = match self.v2() {
                Some(_) => keys::index_run(id),
                None => keys::index_file(id),
            };
            self.store().delete(&key).await?;
        }
        for pack in packs {
            self.store().delete(&keys::pack(pack)).await?;
        }
        Ok(())
    }

    /// Step 6 (bookkeeping): records `gc/last` (session cutoff `cutoff_ns`, plan `plan`),
    /// removes every plan (we hold the lock, so the others are dead GCs'), and clears the
    /// sessions of dead processes.
    pub async fn complete_gc(
        &self,
        plan: &PublishedPlan,
        cutoff_ns: i64,
        stale_after: Duration,
    ) -> RepoResult<()> {
        let store = self.store();
        let data = Bytes::from(encode_gc_last(cutoff_ns, &plan.id));
        loop {
            let current = store.read_ref(keys::GC_LAST).await?;
            let expected = current.as_ref().map(|c| c.version.clone());
            if let CasOutcome::Swapped { .. } = store
                .cas_ref(keys::GC_LAST, expected.as_ref(), Some(data.clone()))
                .await?
            {
                break;
            }
        }
        store.delete(&keys::plan(&plan.id)).await?;
        for meta in store.list(keys::PLANS).await? {
            store.delete(&meta.key).await?;
        }
        self.remove_dead_sessions(stale_after).await
    }

    /// `gc/last`: the session cutoff of the newest GC whose sweep ran (sessions that started
    /// before it were waited for, unless judged dead) and its plan id.
    pub async fn last_gc(&self) -> RepoResult<Option<(i64, Id)>> {
        match self.store().read_ref(keys::GC_LAST).await? {
            None => Ok(None),
            Some(state) => {
                Ok(Some(decode_gc_last(&state.data).map_err(|e| {
                    RepoError::corrupt(format!("refs/{}", keys::GC_LAST), e)
                })?))
            }
        }
    }

    async fn remove_dead_sessions(&self, stale_after: Duration) -> RepoResult<()> {
        let store = self.store();
        let now = now_ns();
        for (key, session) in self.sessions().await? {
            if session.is_none_or(|s| liveness(&s, now, stale_after) != Liveness::Alive) {
                if let Some(state) = store.read_ref(&key).await? {
                    let _ = store.cas_ref(&key, Some(&state.version), None).await;
                }
            }
        }
        // Session keys are never reused: the tombstones of every closed or removed session go.
        store.forget_deleted_refs(keys::SESSIONS).await?;
        Ok(())
    }

    /// Every pack in the store and its size.
    pub async fn pack_sizes(&self) -> RepoResult<HashMap<Id, u64>> {
        Ok(self
            .store()
            .list(keys::PACKS)
            .await?
            .into_iter()
            .filter_map(|m| Some((keys::pack_id(&m.key)?, m.size)))
            .collect())
    }

    /// The size of every pack, as [`Repo::pack_sizes`], given those of an earlier listing
    /// (`known`): the packs are listed without sizes and only those not in `known` are asked
    /// for theirs (a local directory then stats the packs written since, not every pack).
    pub async fn pack_sizes_since(&self, known: &HashMap<Id, u64>) -> RepoResult<HashMap<Id, u64>> {
        let mut out = HashMap::new();
        for key in self.store().list_keys(keys::PACKS).await? {
            let Some(id) = keys::pack_id(&key) else {
                continue;
            };
            let size = match known.get(&id) {
                Some(size) => *size,
                None => match self.store().head(&key).await? {
                    Some(size) => size,
                    None => continue, // deleted since it was listed
                },
            };
            out.insert(id, size);
        }
        Ok(out)
    }

    /// Whether the store holds the pack `pack` (one stat or HEAD).
    pub async fn pack_exists(&self, pack: &Id) -> RepoResult<bool> {
        Ok(self.store().head(&keys::pack(pack)).await?.is_some())
    }

    /// Bytes of every index file (format 2: index run) in the store.
    pub async fn index_file_bytes(&self) -> RepoResult<u64> {
        let prefix = match self.v2() {
            Some(_) => keys::INDEX_RUNS,
            None => keys::INDEX,
        };
        Ok(self
            .store()
            .list(prefix)
            .await?
            .iter()
            .map(|m| m.size)
            .sum())
    }

    /// Deletes a pack no index file names (an orphan left by a killed writer, judged so after
    /// the GC waited for every session that could still index it).
    pub async fn delete_orphan_pack(&self, pack: &Id) -> RepoResult<()> {
        Ok(self.store().delete(&keys::pack(pack)).await?)
    }

    /// Deletes a version record no ref or history reaches (judged by the exact GC).
    pub async fn delete_orphan_version(&self, id: &Id) -> RepoResult<()> {
        Ok(self.store().delete(&keys::version(id)).await?)
    }

    /// Removes the store's temporary files last written before `before` (see
    /// `ObjectStore::remove_stale_temporaries`): how many, and their bytes.
    pub async fn remove_stale_temporaries(&self, before: SystemTime) -> RepoResult<(u64, u64)> {
        Ok(self.store().remove_stale_temporaries(before).await?)
    }

    /// After space was freed: reallocates the local store's space reserve, if a write on a
    /// full disk released it.
    pub async fn replenish_reserve(&self) {
        match self.store().replenish_reserve().await {
            Ok(_) => {}
            Err(StoreError::Full { .. }) => tracing::debug!("space reserve not reallocated yet"),
            Err(e) => tracing::debug!("space reserve not reallocated: {e}"),
        }
    }
}

//! Opening, creating and reading a repository; publishing packs and index files.

use cairn_format::keys;
use std::collections::HashSet;
use std::ops::Range;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use bytes::Bytes;
use cairn_format::config::RepoConfig;
use cairn_format::index::{self, IndexFile};
use cairn_format::marker::GcPlan;
use cairn_format::pack::{self, BlobEntry, BlobKind};
use cairn_format::Id;
use cairn_store::{ObjectStore, PutOutcome, StagedFile, StoreError};
use tokio::task::JoinSet;

use crate::blob_index::{BlobIndex, BlobLocation};
use crate::content_cache::ContentCache;
use crate::error::{RepoError, RepoResult};
use crate::session::{SessionHandle, SessionKind};
use crate::v2::PackBytes;

/// An open repository.
///
/// Opening registers a session (see [`crate::session`]) and reads the pending GC plans
/// *before* loading the index, so that either a running GC waits for this process or this
/// process sees the GC's plan and stays away from the blobs it is deleting.
#[derive(Debug)]
pub struct Repo {
    store: Arc<dyn ObjectStore>,
    config: RepoConfig,
    index: RwLock<BlobIndex>,
    /// Index files that could not be read at open (reported by verify; their blobs count as
    /// missing, so a later commit stores them again).
    index_errors: Vec<String>,
    /// The GC plans pending when this repository was opened (by id).
    plans_seen: HashSet<Id>,
    /// A GC plan that could not be read was skipped (see `gc_plans_with_ids`).
    damaged_plan_seen: std::sync::atomic::AtomicBool,
    session: Mutex<Option<SessionHandle>>,
    session_started_ns: i64,
    /// Local copies of index files and manifest nodes (for remote stores): both are immutable
    /// and content-addressed, so a cached copy that matches its id is always right. Listings
    /// still come from the store, which alone says what exists.
    meta_cache: Option<Arc<ContentCache>>,
    /// Packs this process stored that no index file names yet: garbage if it fails before
    /// publishing them (see [`Repo::discard_unindexed_packs`]).
    unindexed: Mutex<HashSet<Id>>,
    /// Blob (format 1) and group (format 2) copies known to be damaged: left out of the
    /// index and of every reader's lookups (`quarantine`), shared with the format 2 readers.
    quarantine: Arc<crate::quarantine::QuarantineBook>,
    /// Format 2: where chunks, nodes and groups are (index runs, pack trailers, groups, read
    /// in pieces); `None` in a format 1 repository, whose index is `index`.
    v2: Option<Arc<crate::v2::V2Reader>>,
    /// An encrypted repository's master key and the slot that opened it.
    unlocked: Option<crate::keyring::Unlocked>,
}

impl Repo {
    /// Creates a new repository in `store`. Fails if one exists there already.
    pub async fn init(store: Arc<dyn ObjectStore>, config: RepoConfig) -> RepoResult<Repo> {
        config
            .validate()
            .map_err(|e| RepoError::BadInput(e.to_string()))?;
        put_config(store.as_ref(), &config).await?;
        Self::with_session(store, config, SessionKind::Init, None, None).await
    }

    /// Creates a new encrypted repository (format 2) in `store`: a fresh master key, the
    /// config with its key check, then one key slot opened by `passphrase`. Fails if a
    /// repository exists there already (nothing is then written).
    pub async fn init_encrypted(
        store: Arc<dyn ObjectStore>,
        mut config: RepoConfig,
        passphrase: zeroize::Zeroizing<Vec<u8>>,
        kdf: cairn_format::crypto::KdfParams,
    ) -> RepoResult<Repo> {
        let key = cairn_format::crypto::MasterKey::generate();
        let v2 = config
            .v2
            .as_mut()
            .ok_or_else(|| RepoError::BadInput("encryption needs format 2".into()))?;
        v2.key_check = Some(key.key_check());
        config
            .validate()
            .map_err(|e| RepoError::BadInput(e.to_string()))?;
        // The config first: it is what makes the location a repository, and `put_if_absent`
        // is what refuses an existing one. A slot that fails to store takes the config back
        // out (this process created it), so no repository is left that nothing opens.
        put_config(store.as_ref(), &config).await?;
        let kdf_key = key.clone();
        let slot = match crate::keyring::store_slot(store.as_ref(), &kdf_key, passphrase, kdf).await
        {
            Ok(slot) => slot,
            Err(e) => {
                if let Err(d) = store.delete(keys::CONFIG).await {
                    tracing::warn!("could not take back the config of a failed init: {d}");
                }
                return Err(e);
            }
        };
        let unlocked = crate::keyring::Unlocked { key, slot };
        Self::with_session(store, config, SessionKind::Init, None, Some(unlocked)).await
    }

    /// Opens an existing repository and loads its blob index.
    pub async fn open(store: Arc<dyn ObjectStore>) -> RepoResult<Repo> {
        Self::open_as(store, SessionKind::Open).await
    }

    /// Opens an existing repository; `kind` names the session (commit, restore, gc, ...).
    pub async fn open_as(store: Arc<dyn ObjectStore>, kind: SessionKind) -> RepoResult<Repo> {
        Self::open_cached(store, kind, None, None).await
    }

    /// Like [`Repo::open_as`], keeping index files and manifest nodes in `meta_cache` (worth
    /// it when the store is remote: reopening then downloads only what is new).
    /// `passphrase` is asked only if the repository is encrypted (which without one fails
    /// with [`RepoError::Locked`]).
    pub async fn open_cached(
        store: Arc<dyn ObjectStore>,
        kind: SessionKind,
        meta_cache: Option<Arc<ContentCache>>,
        passphrase: Option<&dyn crate::keyring::Passphrase>,
    ) -> RepoResult<Repo> {
        store.check_reachable().await?;
        let raw = match store.get(keys::CONFIG).await {
            Ok(raw) => raw,
            Err(StoreError::NotFound { .. }) => {
                return Err(RepoError::NotARepository {
                    location: store.describe(),
                })
            }
            Err(e) => return Err(e.into()),
        };
        let config = RepoConfig::decode(&raw)
            .map_err(|e| RepoError::corrupt(format!("{}/{}", store.describe(), keys::CONFIG), e))?;
        let unlocked = match (config.v2.is_some_and(|v| v.encrypted()), passphrase) {
            (false, _) => None,
            (true, None) => {
                return Err(RepoError::Locked {
                    location: store.describe(),
                })
            }
            (true, Some(p)) => Some(crate::keyring::unlock(store.as_ref(), &config, p).await?),
        };
        if unlocked.is_none() && !kind.only_reads() {
            refuse_downgrade(store.as_ref()).await?;
        }
        Self::with_session(store, config, kind, meta_cache, unlocked).await
    }

    async fn with_session(
        store: Arc<dyn ObjectStore>,
        config: RepoConfig,
        kind: SessionKind,
        meta_cache: Option<Arc<ContentCache>>,
        unlocked: Option<crate::keyring::Unlocked>,
    ) -> RepoResult<Repo> {
        // Order matters: session first, then plans, then the index.
        let session = match SessionHandle::register(store.clone(), kind).await {
            Ok(s) => Some(s),
            // Readers may work without a session (a read-only repository): a GC may then
            // remove a pack under them, which fails the read cleanly, never silently.
            // Writers may not: their safety against GC rests on the session.
            Err(e) if kind.only_reads() => {
                tracing::warn!("working without a session (read-only?): {e}");
                None
            }
            Err(e) => return Err(e),
        };
        let mut repo = Repo {
            store,
            config,
            index: RwLock::new(BlobIndex::new()),
            index_errors: Vec::new(),
            plans_seen: HashSet::new(),
            damaged_plan_seen: Default::default(),
            session_started_ns: session
                .as_ref()
                .map_or_else(crate::session::now_ns, |s| s.started_ns),
            session: Mutex::new(session),
            meta_cache,
            unindexed: Mutex::new(HashSet::new()),
            quarantine: Arc::default(),
            v2: None,
            unlocked,
        };
        let mut superseded = HashSet::new();
        for (id, plan) in repo.gc_plans_with_ids().await? {
            repo.plans_seen.insert(id);
            superseded.extend(plan.superseded_index);
        }
        // Copies found damaged by earlier processes: never read or deduplicated against.
        repo.quarantine.load(&repo.quarantine_markers().await?);
        if repo.config.v2.is_some() {
            let reader = repo.v2_reader(repo.key().cloned(), crate::v2::CacheLimits::default());
            // A damaged run is a finding (verify reports it; the versions whose groups only
            // it locates fail to restore, each naming what is missing), never a repository
            // that cannot be opened; an unreachable store still fails the open.
            let errors = reader
                .add_runs(&repo.index_run_ids(&superseded).await?)
                .await?;
            repo.index_errors.extend(errors);
            repo.v2 = Some(Arc::new(reader));
            return Ok(repo);
        }
        repo.load_index(&superseded).await?;
        Ok(repo)
    }

    pub(crate) fn quarantine_book(&self) -> &Arc<crate::quarantine::QuarantineBook> {
        &self.quarantine
    }

    pub(crate) fn index_mut(&self) -> std::sync::RwLockWriteGuard<'_, BlobIndex> {
        self.index.write().expect("index lock")
    }

    /// Ends this process's session (removes its ref), after writing the quarantine markers of
    /// damage found meanwhile. Call when done; a process that dies leaves a session that goes
    /// stale.
    pub async fn close(&self) -> RepoResult<()> {
        if let Err(e) = self.flush_quarantine().await {
            tracing::warn!("could not record damaged blobs: {e}");
        }
        let session = self.session.lock().expect("session lock").take();
        match session {
            Some(s) => s.close().await,
            None => Ok(()),
        }
    }

    /// The same repository opened again with a session of its own (of `kind`), sharing this
    /// one's store and metadata cache: for work that must be covered by GC plans published
    /// after this process opened (an export's COMMIT).
    pub async fn reopen(&self, kind: SessionKind) -> RepoResult<Repo> {
        // The same key: an encrypted repository is not unlocked twice.
        Self::with_session(
            self.store.clone(),
            self.config.clone(),
            kind,
            self.meta_cache.clone(),
            self.unlocked.clone(),
        )
        .await
    }

    /// The key of this process's session ref, if it is registered.
    pub fn session_key(&self) -> Option<String> {
        self.session
            .lock()
            .expect("session lock")
            .as_ref()
            .map(|s| s.key.clone())
    }

    /// Every index file in the store, decoded, ignoring GC plans (for GC, which must see
    /// everything). Fails on a damaged index file: GC must never act on a partial view. A file
    /// that vanishes between the listing and the read was superseded by a GC that wrote its
    /// replacement before publishing its plan, so the listing already holds the replacement.
    pub async fn load_all_index_files(&self) -> RepoResult<Vec<(Id, IndexFile)>> {
        self.load_index_files_except(&HashSet::new()).await
    }

    /// As [`Repo::load_all_index_files`], skipping the files named in `known` (read before):
    /// what a GC needs to see what was published since it last looked.
    pub async fn load_index_files_except(
        &self,
        known: &HashSet<Id>,
    ) -> RepoResult<Vec<(Id, IndexFile)>> {
        let mut out = Vec::new();
        for meta in self.store.list(keys::INDEX).await? {
            let Ok(id) = meta.key[keys::INDEX.len()..].parse::<Id>() else {
                continue;
            };
            if known.contains(&id) {
                continue;
            }
            let raw = match self.store.get(&meta.key).await {
                Ok(raw) => raw,
                Err(StoreError::NotFound { .. }) => continue,
                Err(e) => return Err(e.into()),
            };
            let file =
                IndexFile::decode(&raw).map_err(|e| RepoError::corrupt(meta.key.clone(), e))?;
            out.push((id, file));
        }
        Ok(out)
    }

    /// Every blob indexed right now, in any index file.
    pub async fn indexed_blobs_now(&self) -> RepoResult<HashSet<Id>> {
        let mut out = HashSet::new();
        for (_, file) in self.load_all_index_files().await? {
            for p in &file.packs {
                out.extend(p.entries.iter().map(|e| e.id));
            }
        }
        Ok(out)
    }

    /// When this process's session started (ns since the epoch).
    pub fn session_started_ns(&self) -> i64 {
        self.session_started_ns
    }

    /// The GC plans pending in the store.
    pub async fn gc_plans(&self) -> RepoResult<Vec<GcPlan>> {
        Ok(self
            .gc_plans_with_ids()
            .await?
            .into_iter()
            .map(|(_, p)| p)
            .collect())
    }

    /// The GC plans pending in the store, with their ids (the BLAKE3 in their key).
    pub async fn gc_plans_with_ids(&self) -> RepoResult<Vec<(Id, GcPlan)>> {
        let mut plans = Vec::new();
        for meta in self.store.list(keys::PLANS).await? {
            let raw = match self.store.get(&meta.key).await {
                Ok(raw) => raw,
                Err(StoreError::NotFound { .. }) => continue, // finished meanwhile
                Err(e) => return Err(e.into()),
            };
            // Damaged GC bookkeeping never blocks: a plan that cannot be read is skipped
            // (readers then also read the runs it would supersede — duplicates, harmless —
            // and a commit that reuses a blob it dooms is caught by the commit's own check
            // before it publishes); `verify` reports it, the next GC sets it aside.
            if let Some(problem) = self.plan_problem(&meta.key, &raw) {
                tracing::warn!("{problem}; ignored");
                self.damaged_plan_seen
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                continue;
            }
            let plan = GcPlan::decode(&raw).expect("checked by plan_problem");
            plans.push((Id::of(&raw), plan));
        }
        Ok(plans)
    }

    /// Why the GC plan stored under `key` as `raw` cannot be trusted, if it cannot: its
    /// bytes do not hash to the id its key names, or do not decode.
    pub fn plan_problem(&self, key: &str, raw: &[u8]) -> Option<String> {
        if keys::id_after(keys::PLANS, key) != Some(Id::of(raw)) {
            return Some(format!(
                "{key}: damaged gc plan (its bytes do not match its name)"
            ));
        }
        GcPlan::decode(raw)
            .err()
            .map(|e| format!("{key}: damaged gc plan ({e})"))
    }

    /// Problems of GC bookkeeping that the repository works around (plans that cannot be
    /// read, a lock that does not decode): `verify` reports them, the next GC sets them
    /// aside or takes the lock over.
    pub async fn gc_bookkeeping_problems(&self) -> RepoResult<Vec<String>> {
        let mut out = Vec::new();
        for meta in self.store.list(keys::PLANS).await? {
            match self.store.get(&meta.key).await {
                Ok(raw) => out.extend(self.plan_problem(&meta.key, &raw)),
                Err(StoreError::NotFound { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if let Some(lock) = self.store.read_ref(keys::GC_LOCK).await? {
            if let Err(e) = cairn_format::marker::decode_gc_lock(&lock.data) {
                out.push(format!(
                    "refs/{}: the gc lock cannot be read ({e}); the next gc takes it over",
                    keys::GC_LOCK
                ));
            }
        }
        Ok(out)
    }

    /// Whether a GC plan that could not be read was skipped: what it dooms is unknown, so a
    /// commit checks every blob it reuses before it publishes (`commit/publish.rs`).
    pub fn saw_damaged_plan(&self) -> bool {
        self.damaged_plan_seen
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether any GC plan was pending when this process opened the repository.
    pub fn saw_any_plan(&self) -> bool {
        !self.plans_seen.is_empty()
    }

    /// Whether this process saw GC plan `id` pending when it opened the repository.
    pub fn saw_plan(&self, id: &Id) -> bool {
        self.plans_seen.contains(id)
    }

    /// Reads every index file (in parallel) into the in-memory blob index.
    async fn load_index(&mut self, superseded: &HashSet<Id>) -> RepoResult<()> {
        let (index, errors) = self.read_index(superseded).await?;
        self.index_errors.extend(errors);
        *self.index.write().expect("index lock") = index;
        Ok(())
    }

    /// Re-reads the index as a newly opened process would (skipping the index files that
    /// pending GC plans supersede). For long-lived readers such as exports: a GC that moved
    /// blobs (repacking) leaves them reading packs that no longer exist until they refresh.
    pub async fn refresh_index(&self) -> RepoResult<()> {
        let mut superseded = HashSet::new();
        for plan in self.gc_plans().await? {
            superseded.extend(plan.superseded_index);
        }
        if let Some(v2) = &self.v2 {
            let runs = self.index_run_ids(&superseded).await?;
            v2.retain_runs(&runs);
            v2.add_runs(&runs).await?;
            v2.refill_filters().await?;
            return Ok(());
        }
        let (index, _) = self.read_index(&superseded).await?;
        *self.index.write().expect("index lock") = index;
        Ok(())
    }

    /// A new blob index read from the store now, as a newly opened process would see it (for
    /// work that must not hold this process's index lock across reads).
    pub async fn fresh_index(&self) -> RepoResult<BlobIndex> {
        let mut superseded = HashSet::new();
        for plan in self.gc_plans().await? {
            superseded.extend(plan.superseded_index);
        }
        Ok(self.read_index(&superseded).await?.0)
    }

    /// The index runs in the store (format 2) except `superseded`, in listing order.
    pub async fn index_run_ids(&self, superseded: &HashSet<Id>) -> RepoResult<Vec<Id>> {
        Ok(self
            .store
            .list(keys::INDEX_RUNS)
            .await?
            .iter()
            .filter_map(|m| keys::id_after(keys::INDEX_RUNS, &m.key))
            .filter(|id| !superseded.contains(id))
            .collect())
    }

    /// A reader of format 2 objects that sees the index as a process opening the repository
    /// now would (every run except those pending GC plans supersede), and those runs; a
    /// damaged run fails it (GC and the stale-GC guard act only on a complete view).
    pub async fn v2_view(&self) -> RepoResult<(crate::v2::V2Reader, Vec<Id>)> {
        let mut superseded = HashSet::new();
        for plan in self.gc_plans().await? {
            superseded.extend(plan.superseded_index);
        }
        let runs = self.index_run_ids(&superseded).await?;
        let reader = self.v2_reader(self.key().cloned(), crate::v2::CacheLimits::default());
        if let Some(damaged) = reader.add_runs(&runs).await?.into_iter().next() {
            return Err(RepoError::IndexDamaged(damaged));
        }
        Ok((reader, runs))
    }

    /// A reader of every index run in the store now — those that pending GC plans supersede
    /// included, since their packs still exist until the sweep (and a pending GC rescues what
    /// the sessions it waits for use) — and those runs; a damaged run fails it.
    pub async fn v2_view_all(&self) -> RepoResult<(crate::v2::V2Reader, Vec<Id>)> {
        let runs = self.index_run_ids(&HashSet::new()).await?;
        let reader = self.v2_reader(self.key().cloned(), crate::v2::CacheLimits::default());
        if let Some(damaged) = reader.add_runs(&runs).await?.into_iter().next() {
            return Err(RepoError::IndexDamaged(damaged));
        }
        Ok((reader, runs))
    }

    /// Every index file except `superseded`, and the damaged ones' errors.
    async fn read_index(&self, superseded: &HashSet<Id>) -> RepoResult<(BlobIndex, Vec<String>)> {
        let mut errors = Vec::new();
        let files: Vec<_> = self
            .store
            .list(keys::INDEX)
            .await?
            .into_iter()
            .filter(|m| {
                m.key[keys::INDEX.len()..]
                    .parse::<Id>()
                    .map_or(true, |id| !superseded.contains(&id))
            })
            .collect();
        let mut tasks = JoinSet::new();
        let mut pending = files.into_iter();
        let mut index = BlobIndex::without(self.quarantined());
        loop {
            while tasks.len() < 16 {
                let Some(meta) = pending.next() else { break };
                let store = self.store.clone();
                let cache = self.meta_cache.clone();
                tasks.spawn(async move {
                    // A GC deletes only index files it has replaced (its consolidated index
                    // was written first, so this listing has it): one gone since is skipped.
                    let raw = match fetch_index_file(&store, cache.as_deref(), &meta.key).await {
                        Ok(raw) => raw,
                        Err(StoreError::NotFound { .. }) => return Ok(None),
                        Err(e) => return Err(RepoError::from(e)),
                    };
                    Ok::<_, RepoError>(Some(
                        IndexFile::decode(&raw).map_err(|e| RepoError::corrupt(meta.key, e)),
                    ))
                });
            }
            match tasks.join_next().await {
                None => break,
                Some(res) => match res.map_err(|e| RepoError::internal("index loader", e))?? {
                    None => {}
                    Some(Ok(file)) => index.add_file(&file),
                    Some(Err(damaged)) => {
                        tracing::warn!("{damaged}");
                        errors.push(damaged.to_string());
                    }
                },
            }
        }
        Ok((index, errors))
    }

    /// Index files that were damaged at open, one line each.
    pub fn index_errors(&self) -> Vec<String> {
        self.index_errors.clone()
    }

    /// The metadata cache this repository was opened with, if any.
    pub fn meta_cache(&self) -> Option<&Arc<ContentCache>> {
        self.meta_cache.as_ref()
    }

    pub fn config(&self) -> &RepoConfig {
        &self.config
    }

    /// The store under this repository. Only this crate touches it: every key, ref and
    /// protocol step is a typed method of [`Repo`], so the engine, the export and the CLI
    /// cannot write to the store past the repository's rules.
    pub(crate) fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// Where the repository lives, for messages.
    pub fn describe(&self) -> String {
        self.store.describe()
    }

    /// Read access to the blob index (hold it briefly: commits add to it).
    pub fn index(&self) -> RwLockReadGuard<'_, BlobIndex> {
        self.index.read().expect("index lock")
    }

    /// Whether a commit may deduplicate against `id`: this process's index holds a copy.
    ///
    /// A pending GC plan needs no check here: a session that saw the plan skipped the index
    /// files it supersedes, and their replacements name no pack the GC deletes, so every copy
    /// this index holds survives the GC. (Refusing every copy of a blob the plan names dead —
    /// as this once did — made commits store second copies of blobs that still had a
    /// surviving copy in a pack the GC kept: duplicates that only `gc --repair` removed,
    /// several percent of a repository under commits running during prunes.)
    pub fn has_blob(&self, id: &Id) -> bool {
        self.index().contains(id)
    }

    pub fn locate(&self, id: &Id) -> RepoResult<BlobLocation> {
        if let Some(loc) = self.index().get(id) {
            return Ok(loc);
        }
        Err(match self.quarantined_copy(id) {
            Some(pack) => RepoError::Quarantined { id: *id, pack },
            None => RepoError::BlobMissing { id: *id },
        })
    }

    /// Bytes `range` of a pack.
    pub async fn read_pack_range(&self, pack: &Id, range: Range<u64>) -> RepoResult<Bytes> {
        Ok(self.store.get_range(&keys::pack(pack), range).await?)
    }

    /// Decodes a blob's stored bytes and checks them against its id.
    pub fn decode_blob(loc: &BlobLocation, stored: &[u8]) -> RepoResult<Vec<u8>> {
        pack::decode_blob(&loc.entry, stored).map_err(|source| RepoError::BadBlob {
            id: loc.entry.id,
            pack: loc.pack,
            offset: loc.entry.offset,
            source,
        })
    }

    /// A reader of this repository's format v2 objects (index runs, v2 packs, groups), with
    /// caches bounded by `limits`; `key` opens them in an encrypted repository.
    pub fn v2_reader(
        &self,
        key: Option<cairn_format::crypto::MasterKey>,
        limits: crate::v2::CacheLimits,
    ) -> crate::v2::V2Reader {
        crate::v2::V2Reader::new(self.store.clone(), key, limits, self.quarantine.clone())
    }

    pub(crate) fn unlocked(&self) -> Option<&crate::keyring::Unlocked> {
        self.unlocked.as_ref()
    }

    /// The reader of a format 2 repository's objects (`None` in format 1).
    pub fn v2(&self) -> Option<&Arc<crate::v2::V2Reader>> {
        self.v2.as_ref()
    }

    /// [`Self::read_blob`] for a manifest node this process reads once (a commit's parent
    /// leaves): in a format 2 repository its group is not kept in the reader's cache of
    /// opened groups, which would otherwise grow with the image
    /// ([`crate::v2::V2Reader::read_chunk_once`]).
    pub async fn read_node_once(&self, id: &Id) -> RepoResult<Vec<u8>> {
        match &self.v2 {
            Some(v2) => Ok(v2.read_chunk_once(id).await?.to_vec()),
            None => self.read_blob(id).await,
        }
    }

    /// Reads one blob, verified (manifest nodes through the metadata cache, if any). In a
    /// format 2 repository, a chunk or manifest node found through the index runs.
    pub async fn read_blob(&self, id: &Id) -> RepoResult<Vec<u8>> {
        if let Some(v2) = &self.v2 {
            return Ok(v2.read_chunk(id).await?.to_vec());
        }
        let loc = self.locate(id)?;
        let cache = self
            .meta_cache
            .as_deref()
            .filter(|_| loc.entry.kind == BlobKind::Node);
        if let Some(plain) = cache.and_then(|c| c.get(id)) {
            return Ok(plain);
        }
        let plain = self.fetch_blob(&loc).await?;
        if let Some(cache) = cache {
            if let Err(e) = cache.put(id, &plain) {
                tracing::debug!("metadata cache: {e}");
            }
        }
        Ok(plain)
    }

    /// Reads one blob from its pack, verified (a damaged copy is quarantined).
    async fn fetch_blob(&self, loc: &BlobLocation) -> RepoResult<Vec<u8>> {
        let stored = self
            .read_pack_range(&loc.pack, loc.entry.range())
            .await
            .map_err(|e| self.quarantine_if_damaged(blob_read_error(e, loc), loc))?;
        self.check_blob(loc, &stored)
    }

    /// Stores a finished pack under a key no other pack has. Returns the pack's final id (the
    /// pack is re-salted if its key was taken: see `cairn_format::pack::resalt`) and the
    /// bytes written.
    pub async fn put_pack(&self, id: &Id, bytes: impl Into<PackBytes>) -> RepoResult<(Id, u64)> {
        let (id, len) = match bytes.into() {
            PackBytes::Memory(bytes) => self.put_pack_bytes(*id, bytes).await?,
            PackBytes::Staged(mut staged) => self.publish_pack(*id, &mut staged).await?,
        };
        self.unindexed.lock().expect("unindexed lock").insert(id);
        Ok((id, len))
    }

    /// A file to write a pack into, which [`Repo::put_pack`] publishes without copying it, if
    /// the store has such files (a local repository).
    pub async fn stage_pack(&self) -> RepoResult<Option<StagedFile>> {
        Ok(self.store.stage(keys::PACKS).await?)
    }

    /// A scratch file for a commit's own use, never published (its pending index entries),
    /// if the store has staged files: beside the packs, so a process killed meanwhile
    /// leaves a `.tmp-` file the stale-temporary sweep removes.
    pub async fn stage_scratch(&self) -> RepoResult<Option<StagedFile>> {
        self.stage_pack().await
    }

    async fn put_pack_bytes(&self, mut id: Id, bytes: Vec<u8>) -> RepoResult<(Id, u64)> {
        // Shared, not copied: a pack is megabytes, and a copy per upload cost a commit of new
        // data ~6% of its CPU in page faults and memcpy. Only a taken key (rare) copies it.
        let mut bytes = Bytes::from(bytes);
        loop {
            let len = bytes.len() as u64;
            match self
                .store
                .put_if_absent(&keys::pack(&id), bytes.clone())
                .await?
            {
                PutOutcome::Created => return Ok((id, len)),
                PutOutcome::AlreadyExists => {
                    tracing::debug!(%id, "pack key taken; re-salting");
                    let mut owned = bytes.to_vec();
                    id = pack::resalt(&mut owned);
                    bytes = Bytes::from(owned);
                }
            }
        }
    }

    async fn publish_pack(&self, mut id: Id, staged: &mut StagedFile) -> RepoResult<(Id, u64)> {
        loop {
            match self.store.publish_staged(&keys::pack(&id), staged).await? {
                PutOutcome::Created => return Ok((id, staged.len()?)),
                PutOutcome::AlreadyExists => {
                    tracing::debug!(%id, "pack key taken; re-salting");
                    id = resalt_staged(staged)?;
                }
            }
        }
    }

    /// Publishes an index file for packs that are already durable, and makes their blobs
    /// visible to this process. Returns the bytes written.
    pub async fn put_index(&self, packs: Vec<(Id, Vec<BlobEntry>)>) -> RepoResult<u64> {
        if packs.is_empty() {
            return Ok(0);
        }
        let file = IndexFile {
            packs: packs
                .into_iter()
                .map(|(pack, entries)| index::PackIndex { pack, entries })
                .collect(),
        };
        let (_, written) = self.put_index_file(&file).await?;
        self.index.write().expect("index lock").add_file(&file);
        Ok(written)
    }

    /// Stores an index file (without adding it to this process's view: GC writes index files
    /// for the next readers). Returns its id and the bytes written (0 if it existed).
    pub async fn put_index_file(&self, file: &IndexFile) -> RepoResult<(Id, u64)> {
        let raw = Bytes::from(file.encode());
        let id = Id::of(&raw);
        let len = raw.len() as u64;
        let written = match self
            .store
            .put_if_absent(&keys::index_file(&id), raw.clone())
            .await?
        {
            PutOutcome::Created => len,
            PutOutcome::AlreadyExists => 0,
        };
        if let Some(cache) = &self.meta_cache {
            if let Err(e) = cache.put(&id, &raw) {
                tracing::debug!("metadata cache: {e}");
            }
        }
        let mut unindexed = self.unindexed.lock().expect("unindexed lock");
        for p in &file.packs {
            unindexed.remove(&p.pack);
        }
        Ok((id, written))
    }

    /// Publishes an index run (format v2) naming where `locations` (id, pack) are, for packs
    /// that are already durable ([`Repo::put_pack`]). Returns its id and the bytes written (0
    /// if the same run existed).
    pub async fn put_index_run(
        &self,
        locations: &[(Id, Id)],
        key: Option<&cairn_format::crypto::MasterKey>,
    ) -> RepoResult<(Id, u64)> {
        let entries = cairn_format::index_run::RunEntries::from_locations(locations);
        self.put_run_entries(entries, key).await
    }

    /// [`Repo::put_index_run`] of entries gathered pack by pack (a commit's: 8 bytes an id).
    pub async fn put_run_entries(
        &self,
        entries: cairn_format::index_run::RunEntries,
        key: Option<&cairn_format::crypto::MasterKey>,
    ) -> RepoResult<(Id, u64)> {
        let (table, expected, entries) = entries.into_sorted();
        self.put_run_sorted(table, expected, entries, key).await
    }

    /// Stores the run of pack table `table` (sorted, without repeats) holding `expected`
    /// entries, which come in order (as [`cairn_format::index_run::merge_pack_keys`] gives
    /// them: from memory, or read from a file as they are needed). On a store with staged
    /// files the run is written into one and published as it is, so it is never whole in
    /// memory (a 64 GiB first commit's run is 12 MiB). A source's error stops the run:
    /// nothing is published.
    pub async fn put_run_sorted(
        &self,
        table: Vec<Id>,
        expected: u64,
        entries: impl Iterator<Item = std::io::Result<cairn_format::index_run::Entry>> + Send + 'static,
        key: Option<&cairn_format::crypto::MasterKey>,
    ) -> RepoResult<(Id, u64)> {
        use cairn_format::index_run::{Geometry, RunWriter};
        let reading = RepoError::from_entries;
        let Some(mut staged) = self.store.stage(keys::INDEX_RUNS).await? else {
            let mut w = RunWriter::with_geometry(table.clone(), expected, key, Geometry::default());
            for e in entries {
                w.push(e.map_err(reading)?);
            }
            return self.put_run_naming(w.finish(), &table).await;
        };
        let (key, packs) = (key.cloned(), table.clone());
        let (mut staged, id) = tokio::task::spawn_blocking(move || {
            let errors = staged.errors();
            let out = std::io::BufWriter::with_capacity(256 << 10, &mut staged);
            let mut w =
                RunWriter::to_writer(out, packs, expected, key.as_ref(), Geometry::default());
            for e in entries {
                w.push(e.map_err(reading)?);
            }
            let (_, id) = w.finish_to().map_err(|e| errors("write", e))?;
            Ok::<_, RepoError>((staged, id))
        })
        .await
        .map_err(|e| RepoError::internal("writing an index run", e))??;
        let written = match self
            .store
            .publish_staged(&keys::index_run(&id), &mut staged)
            .await?
        {
            PutOutcome::Created => staged.len()?,
            PutOutcome::AlreadyExists => 0,
        };
        self.run_stored(&id, &table).await?;
        Ok((id, written))
    }

    /// Stores run bytes that name `packs` (among others): those packs are indexed from now on
    /// (a failed operation no longer discards them), and this process's own later reads (a
    /// second commit, a restore) see the run too.
    pub async fn put_run_naming(
        &self,
        raw: Vec<u8>,
        packs: impl IntoIterator<Item = &Id>,
    ) -> RepoResult<(Id, u64)> {
        let (id, written) = self.put_run_bytes(raw).await?;
        self.run_stored(&id, packs).await?;
        Ok((id, written))
    }

    /// Run `id`, naming `packs`, is stored: they are indexed, and this process reads it.
    async fn run_stored(&self, id: &Id, packs: impl IntoIterator<Item = &Id>) -> RepoResult<()> {
        {
            let mut unindexed = self.unindexed.lock().expect("unindexed lock");
            for pack in packs {
                unindexed.remove(pack);
            }
        }
        if let Some(v2) = &self.v2 {
            v2.add_run(id).await?;
        }
        Ok(())
    }

    /// Stores an index run's bytes under their id (a merge of runs: compaction). Returns its
    /// id and the bytes written (0 if the same run existed).
    pub async fn put_run_bytes(&self, raw: Vec<u8>) -> RepoResult<(Id, u64)> {
        let raw = Bytes::from(raw);
        let id = Id::of(&raw);
        let len = raw.len() as u64;
        let written = match self.store.put_if_absent(&keys::index_run(&id), raw).await? {
            PutOutcome::Created => len,
            PutOutcome::AlreadyExists => 0,
        };
        Ok((id, written))
    }

    /// Deletes the packs this process stored but never indexed: what a failed commit (or GC)
    /// leaves behind. Safe because nothing can refer to a blob before its index file exists,
    /// and only this process knows these packs. Best effort: returns how many were deleted.
    pub async fn discard_unindexed_packs(&self) -> usize {
        let packs: Vec<Id> = self
            .unindexed
            .lock()
            .expect("unindexed lock")
            .drain()
            .collect();
        let mut deleted = 0;
        for pack in packs {
            match self.store.delete(&keys::pack(&pack)).await {
                Ok(()) => deleted += 1,
                Err(e) => tracing::debug!("deleting unindexed pack {pack}: {e}"),
            }
        }
        deleted
    }
}

/// What a failed read of a blob's pack means for that blob: a missing pack, or a truncated one
/// (the blob is damaged); other errors pass through.
pub(crate) fn blob_read_error(e: RepoError, loc: &BlobLocation) -> RepoError {
    match e {
        RepoError::Store(StoreError::NotFound { .. }) => RepoError::PackMissing {
            pack: loc.pack,
            id: loc.entry.id,
        },
        RepoError::Store(e @ StoreError::RangeOutOfBounds { .. }) => RepoError::BadBlob {
            id: loc.entry.id,
            pack: loc.pack,
            offset: loc.entry.offset,
            source: cairn_format::FormatError::invalid("blob", format!("pack truncated ({e})")),
        },
        e => e,
    }
}

/// An index file's bytes: from the metadata cache if it holds an intact copy (its name is the
/// BLAKE3 of its bytes), else from the store (and then cached).
async fn fetch_index_file(
    store: &Arc<dyn ObjectStore>,
    cache: Option<&ContentCache>,
    key: &str,
) -> Result<Bytes, StoreError> {
    let id = key
        .strip_prefix(keys::INDEX)
        .and_then(|name| name.parse::<Id>().ok());
    let cache = cache.zip(id);
    if let Some(raw) = cache.and_then(|(c, id)| c.get(&id)) {
        return Ok(Bytes::from(raw));
    }
    let raw = store.get(key).await?;
    if let Some((c, id)) = cache {
        // Only a file whose bytes match its name is cached; a damaged one is reported by the
        // decoder as usual.
        if Id::of(&raw) == id {
            if let Err(e) = c.put(&id, &raw) {
                tracing::debug!("metadata cache: {e}");
            }
        }
    }
    Ok(raw)
}

/// Stores a new repository's config once the store answers; refuses a location that holds a
/// repository already (`put_if_absent`: nothing is overwritten).
async fn put_config(store: &dyn ObjectStore, config: &RepoConfig) -> RepoResult<()> {
    store.check_reachable().await?;
    match store
        .put_if_absent(keys::CONFIG, Bytes::from(config.encode()))
        .await?
    {
        PutOutcome::Created => Ok(()),
        PutOutcome::AlreadyExists => Err(RepoError::AlreadyExists {
            location: store.describe(),
        }),
    }
}

/// A writer refuses a repository whose config says plain but which holds key slots: the
/// config of an encrypted repository was replaced (a downgrade), and writing would store
/// plain objects next to sealed ones. One listing, for writers only (readers of sealed
/// objects through a plain config fail on every object anyway, writing nothing).
async fn refuse_downgrade(store: &dyn ObjectStore) -> RepoResult<()> {
    if store.list(keys::KEY_SLOTS).await?.is_empty() {
        return Ok(());
    }
    Err(RepoError::Downgraded {
        location: store.describe(),
    })
}

/// [`pack::resalt`] of a staged pack: a new salt, and the id of the whole file read again.
fn resalt_staged(staged: &StagedFile) -> RepoResult<Id> {
    let mut head = [0u8; 16];
    staged.read_at(0, &mut head)?;
    pack::resalt(&mut head);
    staged.write_at(12, &head[12..16])?;
    let (len, mut at) = (staged.len()?, 0u64);
    let mut hash = blake3::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    while at < len {
        let n = (len - at).min(buf.len() as u64) as usize;
        staged.read_at(at, &mut buf[..n])?;
        hash.update(&buf[..n]);
        at += n as u64;
    }
    Ok(Id(*hash.finalize().as_bytes()))
}

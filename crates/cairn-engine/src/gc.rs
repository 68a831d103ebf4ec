//! Garbage collection: give back the space of deleted versions without ever deleting a blob
//! that a live version — or a commit running concurrently — refers to.
//!
//! The protocol (argued in docs/ARCHITECTURE.md, "GC safety"):
//!
//! 1. **Lock** `gc/lock` (one GC at a time; a lock whose session is dead is taken over).
//! 2. **Mark** from every live version (heads, tags and their parent chains, minus deleted
//!    versions), reading only manifest nodes, using *every* index file. A node that cannot be
//!    read aborts the GC: nothing is deleted on an uncertain live set.
//! 3. **Plan**: dead blobs = indexed but not marked. Packs with no live blob are deleted; packs
//!    whose live fraction is below the threshold are repacked (live blobs copied as stored,
//!    without recompression). New packs and one consolidated index file (every live blob, at
//!    its surviving location) are written first; then the plan (dead blobs + the index files
//!    it supersedes) is published under `gc/plans/`.
//! 4. **Wait** for every live session that started before the plan was published (plus a clock
//!    skew margin). Sessions that start later see the plan: they register before reading plans,
//!    never deduplicate against its dead blobs and do not load the superseded index files.
//! 5. **Re-mark** from the heads and tags as they are now: a commit that was running during
//!    the mark may have published a version that reuses a dead blob. Such blobs are *rescued*:
//!    their packs are kept and a rescue index file lists them.
//! 6. **Sweep**: delete the superseded index files, then the dead and repacked packs (minus
//!    rescued ones) and orphan packs (written by crashed commits, unindexed before and after
//!    the wait); record `gc/last`; delete the plan; release the lock.
//!
//! A crash at any step leaves a consistent repository: before the sweep only additions were
//! made (duplicates), and every sweep step deletes only what the consolidated and rescue index
//! files no longer need.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use cairn_format::index::{self, IndexFile, PackIndex};
use cairn_format::marker::{
    decode_gc_lock, encode_gc_last, encode_gc_lock, GcPlan, GC_LAST_REF, GC_LOCK_REF, PLANS_PREFIX,
};
use cairn_format::node::{Extent, Interior, Leaf};
use cairn_format::pack::{self, BlobEntry, BlobKind, PackBuilder};
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::session::{list_sessions, now_ns};
use cairn_repo::{pack_key, BlobIndex, BlobLocation, Repo, RepoError, PACKS_PREFIX};
use cairn_store::{CasOutcome, ObjectStore};

use crate::error::{EngineError, EngineResult};
use crate::live::live_versions;

#[derive(Debug, Clone)]
pub struct GcOptions {
    /// Report what would be done; change nothing.
    pub dry_run: bool,
    /// Packs whose live fraction (by bytes) is below this are repacked.
    pub repack_threshold: f64,
    /// A session whose heartbeat is older than this belongs to a dead process.
    pub stale_after: Duration,
    /// How long to wait for older sessions before giving up (nothing is deleted then).
    pub wait_limit: Duration,
    /// Poll interval while waiting.
    pub poll: Duration,
}

impl Default for GcOptions {
    fn default() -> Self {
        GcOptions {
            dry_run: false,
            repack_threshold: 0.97,
            stale_after: Duration::from_secs(600),
            wait_limit: Duration::from_secs(3600),
            poll: Duration::from_millis(200),
        }
    }
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct GcReport {
    pub dry_run: bool,
    pub live_versions: u64,
    pub live_blobs: u64,
    pub dead_blobs: u64,
    pub packs_deleted: u64,
    pub packs_repacked: u64,
    pub packs_written: u64,
    pub orphan_packs_deleted: u64,
    pub index_files_replaced: u64,
    pub rescued_blobs: u64,
    /// Bytes of packs and index files before and after.
    pub bytes_before: u64,
    pub bytes_after: u64,
    /// Bytes copied while repacking.
    pub bytes_repacked: u64,
    /// Manifest node bytes read while marking.
    pub metadata_bytes_read: u64,
    pub waited_s: f64,
    pub duration_s: f64,
}

impl GcReport {
    pub fn reclaimed(&self) -> u64 {
        self.bytes_before.saturating_sub(self.bytes_after)
    }
}

/// Runs one garbage collection on an open repository (opened for this purpose: its session
/// is the GC's own and is not waited for).
pub async fn gc(repo: &Arc<Repo>, options: &GcOptions) -> EngineResult<GcReport> {
    let started = Instant::now();
    let lock = if options.dry_run {
        None
    } else {
        Some(acquire_lock(repo, options).await?)
    };
    let result = run(repo, options).await;
    if let Some(version) = lock {
        // Release only if still ours; a failure here leaves a lock that dies with our session.
        let _ = repo
            .store()
            .cas_ref(GC_LOCK_REF, Some(&version), None)
            .await;
    }
    let mut report = result?;
    report.duration_s = started.elapsed().as_secs_f64();
    Ok(report)
}

async fn acquire_lock(repo: &Repo, options: &GcOptions) -> EngineResult<cairn_store::RefVersion> {
    let me = repo
        .session_key()
        .ok_or_else(|| EngineError::Pipeline("gc needs an open session".into()))?;
    let data = Bytes::from(encode_gc_lock(&me));
    let store = repo.store();
    for _ in 0..5 {
        match store.cas_ref(GC_LOCK_REF, None, Some(data.clone())).await? {
            CasOutcome::Swapped { version } => return version.ok_or_else(lock_lost),
            CasOutcome::Conflict { current: None } => continue,
            CasOutcome::Conflict {
                current: Some(current),
            } => {
                let holder = decode_gc_lock(&current.data).unwrap_or_default();
                if session_alive(store.as_ref(), &holder, options).await? {
                    return Err(EngineError::Pipeline(format!(
                        "another gc is running (session {holder}); try again when it has finished"
                    )));
                }
                // The holder died: take the lock over.
                if let CasOutcome::Swapped { version } = store
                    .cas_ref(GC_LOCK_REF, Some(&current.version), Some(data.clone()))
                    .await?
                {
                    tracing::warn!("took over the gc lock of dead session {holder}");
                    return version.ok_or_else(lock_lost);
                }
            }
        }
    }
    Err(lock_lost())
}

fn lock_lost() -> EngineError {
    EngineError::Pipeline("could not take the gc lock (it keeps changing)".into())
}

async fn session_alive(
    store: &dyn ObjectStore,
    key: &str,
    options: &GcOptions,
) -> EngineResult<bool> {
    let Some(state) = store.read_ref(key).await? else {
        return Ok(false);
    };
    let Ok(s) = cairn_format::marker::Session::decode(&state.data) else {
        return Ok(false);
    };
    Ok(now_ns() - s.heartbeat_ns < options.stale_after.as_nanos() as i64)
}

/// Everything GC learned from the index files it read (the snapshot S0).
struct Snapshot {
    files: Vec<(Id, IndexFile)>,
    index: BlobIndex,
}

impl Snapshot {
    async fn load(repo: &Repo) -> EngineResult<Snapshot> {
        let files = repo.load_all_index_files().await?;
        let mut index = BlobIndex::new();
        for (_, f) in &files {
            index.add_file(f);
        }
        Ok(Snapshot { files, index })
    }
}

async fn run(repo: &Arc<Repo>, options: &GcOptions) -> EngineResult<GcReport> {
    let mut report = GcReport {
        dry_run: options.dry_run,
        ..Default::default()
    };
    let store = repo.store().clone();

    // 2. Mark. Refs are read before the index snapshot: a version's blobs are indexed before
    // its ref points at it, so the snapshot holds everything the marked versions use.
    let live = live_versions(repo).await?;
    let snapshot = Snapshot::load(repo).await?;
    let mut marker = Marker::default();
    for (id, record) in &live.live {
        marker
            .mark_version(repo, &snapshot.index, id, record)
            .await?;
    }
    report.live_versions = live.live.len() as u64;
    report.live_blobs = marker.live.len() as u64;

    // 3. Plan: which copy of each live blob survives, and what happens to each pack.
    let pack_sizes: HashMap<Id, u64> = store
        .list(PACKS_PREFIX)
        .await?
        .into_iter()
        .filter_map(|m| {
            m.key
                .rsplit('/')
                .next()?
                .parse()
                .ok()
                .map(|id: Id| (id, m.size))
        })
        .collect();
    let index_bytes: u64 = store
        .list(index::PREFIX)
        .await?
        .iter()
        .map(|m| m.size)
        .sum();
    report.bytes_before = pack_sizes.values().sum::<u64>() + index_bytes;

    let mut canonical: HashMap<Id, (Id, BlobEntry)> = HashMap::new();
    let mut dead: HashSet<Id> = HashSet::new();
    let mut live_bytes: HashMap<Id, u64> = HashMap::new();
    // Entries each pack's index lists, to tell blob bytes from header and trailer overhead.
    let mut indexed_entries: HashMap<Id, u64> = HashMap::new();
    let mut indexed_packs: HashSet<Id> = HashSet::new();
    for (_, file) in &snapshot.files {
        for p in &file.packs {
            indexed_packs.insert(p.pack);
            if !pack_sizes.contains_key(&p.pack) {
                continue; // missing pack: verify's business; its blobs have no copy here
            }
            *indexed_entries.entry(p.pack).or_default() += p.entries.len() as u64;
            for e in &p.entries {
                if !marker.live.contains(&e.id) {
                    dead.insert(e.id);
                } else if let std::collections::hash_map::Entry::Vacant(slot) =
                    canonical.entry(e.id)
                {
                    slot.insert((p.pack, *e));
                    *live_bytes.entry(p.pack).or_default() += e.stored_len as u64;
                }
            }
        }
    }
    report.dead_blobs = dead.len() as u64;
    let mut to_delete = Vec::new();
    let mut to_repack = Vec::new();
    let mut kept = Vec::new();
    for pack in &indexed_packs {
        let Some(&size) = pack_sizes.get(pack) else {
            continue;
        };
        let lb = live_bytes.get(pack).copied().unwrap_or(0);
        // Bytes that can hold blobs: the pack minus its header, trailer and footer (entries
        // dropped from the index by an earlier GC count as garbage, which they are).
        let overhead = (pack::HEADER_LEN + pack::FOOTER_LEN) as u64
            + pack::ENTRY_LEN as u64 * indexed_entries.get(pack).copied().unwrap_or(0);
        let payload = size.saturating_sub(overhead).max(1);
        if lb == 0 {
            to_delete.push(*pack);
        } else if (lb as f64) < options.repack_threshold * payload as f64 {
            to_repack.push(*pack);
        } else {
            kept.push(*pack);
        }
    }
    let orphans: Vec<Id> = pack_sizes
        .keys()
        .filter(|p| !indexed_packs.contains(p))
        .copied()
        .collect();
    report.packs_deleted = to_delete.len() as u64;
    report.packs_repacked = to_repack.len() as u64;
    report.index_files_replaced = snapshot.files.len() as u64;
    report.metadata_bytes_read = marker.bytes_read;
    if options.dry_run {
        report.bytes_after = report.bytes_before
            - to_delete.iter().map(|p| pack_sizes[p]).sum::<u64>()
            - to_repack
                .iter()
                .map(|p| pack_sizes[p] - live_bytes[p])
                .sum::<u64>();
        return Ok(report);
    }
    let nothing_to_do =
        to_delete.is_empty() && to_repack.is_empty() && orphans.is_empty() && dead.is_empty();
    if nothing_to_do && snapshot.files.len() <= 1 {
        report.bytes_after = report.bytes_before;
        return Ok(report);
    }

    // Write repacked packs, then the consolidated index (kept packs' live entries + new packs).
    let mut by_pack: HashMap<Id, Vec<BlobEntry>> = HashMap::new();
    for (pack, entry) in canonical.values() {
        by_pack.entry(*pack).or_default().push(*entry);
    }
    let mut consolidated: Vec<PackIndex> = kept
        .iter()
        .filter_map(|p| {
            by_pack.get(p).map(|e| PackIndex {
                pack: *p,
                entries: sorted(e),
            })
        })
        .collect();
    let mut repacker = Repacker::new(repo.config().pack_target as usize);
    for pack in &to_repack {
        let data = store.get(&pack_key(pack)).await?;
        for e in sorted(&by_pack[pack]) {
            let r = e.range();
            let stored = &data[r.start as usize..r.end as usize];
            // Verify before copying: never launder a corrupt blob into a new pack.
            Repo::decode_blob(
                &BlobLocation {
                    pack: *pack,
                    entry: e,
                },
                stored,
            )?;
            report.bytes_repacked += stored.len() as u64;
            if let Some(done) = repacker.push(&e, stored) {
                consolidated.push(write_pack(repo, done).await?);
            }
        }
    }
    for done in repacker.finish() {
        consolidated.push(write_pack(repo, done).await?);
    }
    report.packs_written =
        (consolidated.len() - kept.iter().filter(|p| by_pack.contains_key(p)).count()) as u64;
    // An index file GC writes may be byte-identical to one it read: never supersede those.
    let mut written_index = HashSet::new();
    written_index.insert(put_index(repo, consolidated).await?);
    let superseded: Vec<Id> = snapshot
        .files
        .iter()
        .map(|(id, _)| *id)
        .filter(|id| !written_index.contains(id))
        .collect();

    let plan = GcPlan {
        created_ns: now_ns(),
        dead_blobs: dead.iter().copied().collect(),
        superseded_index: superseded.clone(),
    };
    let plan_raw = plan.encode();
    let plan_id = Id::of(&plan_raw);
    let plan_key = format!("{PLANS_PREFIX}{plan_id}");
    store
        .put_if_absent(&plan_key, Bytes::from(plan_raw))
        .await?;
    // Sessions register before they read plans, so one that started after the plan became
    // visible has seen it. The cutoff is taken *after* publication (not at the plan's
    // creation: a session registering in between would read the plans before ours is there),
    // plus a margin for clock skew between hosts.
    let cutoff_ns = now_ns() + CLOCK_SKEW_MARGIN.as_nanos() as i64;

    // 4. Wait for the sessions that may not have seen the plan.
    let wait_started = Instant::now();
    if let Err(e) = wait_for_sessions(repo, cutoff_ns, options).await {
        let _ = store.delete(&plan_key).await;
        return Err(e);
    }
    report.waited_s = wait_started.elapsed().as_secs_f64();

    // 5. Re-mark from the refs as they are now; rescue dead blobs that new versions use.
    // Refs first, then the index (as in the first mark): every version read is fully indexed.
    let live_now = live_versions(repo).await?;
    let now_index = Snapshot::load(repo).await?;
    for (id, record) in &live_now.live {
        if !live.live.contains_key(id) {
            marker
                .mark_version(repo, &now_index.index, id, record)
                .await?;
        }
    }
    let mut rescued_packs: HashSet<Id> = HashSet::new();
    let mut rescue: HashMap<Id, Vec<BlobEntry>> = HashMap::new();
    for id in dead.iter().filter(|id| marker.live.contains(id)) {
        if let Some(loc) = snapshot.index.get(id) {
            rescued_packs.insert(loc.pack);
            rescue.entry(loc.pack).or_default().push(loc.entry);
        }
    }
    report.rescued_blobs = rescue.values().map(|v| v.len() as u64).sum();
    if !rescue.is_empty() {
        tracing::info!(
            blobs = report.rescued_blobs,
            "rescued blobs used by concurrent commits"
        );
        let rescue_index = put_index(
            repo,
            rescue
                .into_iter()
                .map(|(pack, entries)| PackIndex {
                    pack,
                    entries: sorted(&entries),
                })
                .collect(),
        )
        .await?;
        written_index.insert(rescue_index);
    }

    // 6. Sweep.
    for id in superseded.iter().filter(|id| !written_index.contains(id)) {
        store.delete(&index::key(id)).await?;
    }
    for pack in to_delete.iter().chain(&to_repack) {
        if !rescued_packs.contains(pack) {
            store.delete(&pack_key(pack)).await?;
        }
    }
    let indexed_now: HashSet<Id> = repo
        .load_all_index_files()
        .await?
        .iter()
        .flat_map(|(_, f)| f.packs.iter().map(|p| p.pack))
        .collect();
    for pack in &orphans {
        if !indexed_now.contains(pack) {
            store.delete(&pack_key(pack)).await?;
            report.orphan_packs_deleted += 1;
        }
    }
    set_gc_last(store.as_ref(), cutoff_ns, &plan_id).await?;
    // Our plan, and any plan left by a GC that died (we hold the lock, so no other GC runs).
    for meta in store.list(PLANS_PREFIX).await? {
        store.delete(&meta.key).await?;
    }
    remove_stale_sessions(store.as_ref(), options).await?;

    let packs_after: u64 = store.list(PACKS_PREFIX).await?.iter().map(|m| m.size).sum();
    let index_after: u64 = store
        .list(index::PREFIX)
        .await?
        .iter()
        .map(|m| m.size)
        .sum();
    report.bytes_after = packs_after + index_after;
    Ok(report)
}

fn sorted(entries: &[BlobEntry]) -> Vec<BlobEntry> {
    let mut v = entries.to_vec();
    v.sort_by_key(|e| e.offset);
    v
}

/// Collects the blobs reachable from versions, reading each manifest node once.
#[derive(Default)]
struct Marker {
    live: HashSet<Id>,
    bytes_read: u64,
}

impl Marker {
    async fn mark_version(
        &mut self,
        repo: &Repo,
        index: &BlobIndex,
        id: &Id,
        record: &VersionRecord,
    ) -> EngineResult<()> {
        let Some(root) = record.root else {
            return Ok(());
        };
        let mut stack = vec![(root, record.height)];
        while let Some((node, level)) = stack.pop() {
            if !self.live.insert(node) {
                continue; // subtree already marked
            }
            let raw = self.read(repo, index, &node).await.map_err(|e| {
                EngineError::Pipeline(format!(
                    "gc: cannot read manifest of live version {}@{} ({}): {e}; nothing was deleted",
                    record.image,
                    record.seq,
                    id.short()
                ))
            })?;
            if level == 0 {
                let leaf = Leaf::decode(&raw).map_err(|e| bad_node(&node, e))?;
                for e in leaf.extents {
                    if let Extent::Chunk { id, .. } = e {
                        self.live.insert(id);
                    }
                }
            } else {
                let n = Interior::decode(&raw).map_err(|e| bad_node(&node, e))?;
                stack.extend(n.children.into_iter().map(|(_, c)| (c, level - 1)));
            }
        }
        Ok(())
    }

    async fn read(&mut self, repo: &Repo, index: &BlobIndex, id: &Id) -> EngineResult<Vec<u8>> {
        let loc = index.get(id).ok_or(RepoError::BlobMissing { id: *id })?;
        let stored = repo.read_pack_range(&loc.pack, loc.entry.range()).await?;
        self.bytes_read += stored.len() as u64;
        Ok(Repo::decode_blob(&loc, &stored)?)
    }
}

fn bad_node(id: &Id, e: cairn_format::FormatError) -> EngineError {
    EngineError::Pipeline(format!("gc: manifest node {id}: {e}; nothing was deleted"))
}

/// Copies live blobs into new packs, keeping data and nodes apart.
struct Repacker {
    target: usize,
    data: PackBuilder,
    nodes: PackBuilder,
}

impl Repacker {
    fn new(target: usize) -> Self {
        Repacker {
            target,
            data: PackBuilder::new(),
            nodes: PackBuilder::new(),
        }
    }

    fn push(&mut self, e: &BlobEntry, stored: &[u8]) -> Option<PackBuilder> {
        let b = match e.kind {
            BlobKind::Data => &mut self.data,
            BlobKind::Node => &mut self.nodes,
        };
        b.push(e.id, e.kind, e.encoding, stored, e.raw_len);
        (b.len() >= self.target).then(|| std::mem::take(b))
    }

    fn finish(self) -> Vec<PackBuilder> {
        [self.data, self.nodes]
            .into_iter()
            .filter(|b| !b.is_empty())
            .collect()
    }
}

async fn write_pack(repo: &Repo, builder: PackBuilder) -> EngineResult<PackIndex> {
    let (id, bytes, entries) = builder.finish();
    let (pack, _) = repo.put_pack(&id, bytes).await?;
    Ok(PackIndex { pack, entries })
}

async fn put_index(repo: &Repo, packs: Vec<PackIndex>) -> EngineResult<Id> {
    let raw = IndexFile { packs }.encode();
    let id = Id::of(&raw);
    repo.store()
        .put_if_absent(&index::key(&id), Bytes::from(raw))
        .await?;
    Ok(id)
}

/// Sessions that started up to this long after a plan was published are waited for too, in
/// case the clocks of the hosts sharing a repository disagree.
pub const CLOCK_SKEW_MARGIN: Duration = Duration::from_secs(1);

async fn wait_for_sessions(repo: &Repo, cutoff_ns: i64, options: &GcOptions) -> EngineResult<()> {
    let me = repo.session_key();
    let started = Instant::now();
    loop {
        let stale_ns = options.stale_after.as_nanos() as i64;
        let now = now_ns();
        let pending: Vec<String> = list_sessions(repo.store().as_ref())
            .await?
            .into_iter()
            .filter(|(key, s)| {
                Some(key) != me.as_ref()
                    && s.as_ref().is_some_and(|s| {
                        s.started_ns <= cutoff_ns && now - s.heartbeat_ns < stale_ns
                    })
            })
            .map(|(key, s)| format!("{key} ({})", s.map(|s| s.kind).unwrap_or_default()))
            .collect();
        if pending.is_empty() {
            return Ok(());
        }
        if started.elapsed() > options.wait_limit {
            return Err(EngineError::Pipeline(format!(
                "gc: waited {:.0} s for {} older session(s) to finish ({}); nothing was deleted",
                started.elapsed().as_secs_f64(),
                pending.len(),
                pending.join(", ")
            )));
        }
        tracing::debug!(?pending, "gc waiting for sessions");
        tokio::time::sleep(options.poll).await;
    }
}

async fn set_gc_last(store: &dyn ObjectStore, cutoff_ns: i64, plan: &Id) -> EngineResult<()> {
    let data = Bytes::from(encode_gc_last(cutoff_ns, plan));
    loop {
        let current = store.read_ref(GC_LAST_REF).await?;
        let expected = current.as_ref().map(|c| c.version.clone());
        if let CasOutcome::Swapped { .. } = store
            .cas_ref(GC_LAST_REF, expected.as_ref(), Some(data.clone()))
            .await?
        {
            return Ok(());
        }
    }
}

async fn remove_stale_sessions(store: &dyn ObjectStore, options: &GcOptions) -> EngineResult<()> {
    let stale_ns = options.stale_after.as_nanos() as i64;
    let now = now_ns();
    for (key, session) in list_sessions(store).await? {
        if session.is_none_or(|s| now - s.heartbeat_ns >= stale_ns) {
            if let Some(state) = store.read_ref(&key).await? {
                let _ = store.cas_ref(&key, Some(&state.version), None).await;
            }
        }
    }
    Ok(())
}

/// Reads `gc/last`: the session cutoff of the newest GC whose sweep ran (sessions that started
/// before it were waited for, unless judged dead) and its plan id.
pub async fn last_gc(store: &dyn ObjectStore) -> EngineResult<Option<(i64, Id)>> {
    match store.read_ref(GC_LAST_REF).await? {
        None => Ok(None),
        Some(state) => Ok(Some(
            cairn_format::marker::decode_gc_last(&state.data)
                .map_err(|e| RepoError::corrupt(format!("refs/{GC_LAST_REF}"), e))?,
        )),
    }
}

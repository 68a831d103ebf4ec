//! Verify: re-read everything and say exactly what is damaged and which versions it affects.
//!
//! 1. Every indexed pack is read in full: its id must match its content, its trailer must
//!    parse, and every blob the index places in it must decode and hash to its id.
//! 2. Every version record is read and checked; every head must name a readable version.
//! 3. Every live version's manifest tree is walked (each node once, memoised) and every
//!    chunk reference is checked against the set of good blobs.
//!
//! The result lists each problem once, with what and where, plus the damaged versions.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use cairn_format::keys;
use cairn_format::leaf_v2::{LeafDigest, RunLeaf};
use cairn_format::node::Leaf;
use cairn_format::pack::{self, BlobEntry};
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::tree_walk::{decode_node, walk_tree, Node, NodeAt, TreeVisitor};
use cairn_repo::{BlobLocation, Damaged, Repo, RepoError};
use tokio::task::JoinSet;

use crate::error::{EngineError, EngineResult};
use crate::progress::{self, Unit, WorkProgress};

mod grouped;

pub(crate) use grouped::unindexed_packs;

/// Which packs a verify reads in full (restic's `--read-data-subset`): metadata is always
/// checked whole; data only in the chosen packs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PackSubset {
    /// Every pack.
    All,
    /// Part `k` of `n` (1-based): the packs whose id, read as a number, is `k - 1` modulo
    /// `n`. Running 1/n … n/n on successive days covers every pack.
    Part { k: u32, n: u32 },
    /// A random sample of this fraction (0..=1) of the packs.
    Fraction(f64),
}

impl PackSubset {
    /// Parses `N%`, `K/N` or `all`.
    pub fn parse(s: &str) -> Result<PackSubset, String> {
        let bad = || format!("{s:?}: expected N% (0 < N <= 100), K/N (1 <= K <= N) or all");
        if s == "all" {
            return Ok(PackSubset::All);
        }
        if let Some(p) = s.strip_suffix('%') {
            let p: f64 = p.trim().parse().map_err(|_| bad())?;
            if !(p > 0.0 && p <= 100.0) {
                return Err(bad());
            }
            return Ok(PackSubset::Fraction(p / 100.0));
        }
        let (k, n) = s.split_once('/').ok_or_else(bad)?;
        let (k, n): (u32, u32) = (
            k.trim().parse().map_err(|_| bad())?,
            n.trim().parse().map_err(|_| bad())?,
        );
        if k == 0 || n == 0 || k > n {
            return Err(bad());
        }
        Ok(PackSubset::Part { k, n })
    }

    fn includes(&self, pack: &Id) -> bool {
        match *self {
            PackSubset::All => true,
            PackSubset::Part { k, n } => {
                let x = u32::from_le_bytes(pack.as_bytes()[..4].try_into().expect("4 bytes"));
                x % n == k - 1
            }
            PackSubset::Fraction(f) => rand::random::<f64>() < f,
        }
    }
}

/// What to verify.
#[derive(Debug, Clone)]
pub struct VerifyOptions {
    /// Only these versions (and the blobs they use); empty: the whole repository.
    pub versions: Vec<(Id, VersionRecord)>,
    /// Which packs to read in full.
    pub subset: PackSubset,
    /// Counters for a progress display: the blob bytes of the packs checked, then the versions
    /// whose trees are walked.
    pub progress: Option<Arc<WorkProgress>>,
}

impl Default for VerifyOptions {
    fn default() -> Self {
        VerifyOptions {
            versions: Vec::new(),
            subset: PackSubset::All,
            progress: None,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    /// Packs in the scope, and those read in full (fewer with a subset).
    pub packs_in_scope: u64,
    pub packs_checked: u64,
    pub blobs_checked: u64,
    pub read_bytes: u64,
    pub versions_checked: u64,
    /// One line per problem found, naming what and where.
    pub problems: Vec<String>,
    /// Versions that cannot be restored intact, sorted by image and sequence.
    pub damaged_versions: Vec<DamagedVersion>,
    /// Metadata objects (version records, heads, tags) that cannot be read.
    pub damaged_metadata: Vec<Damaged>,
    /// Blob copies found damaged and quarantined by this run (the next commit that meets
    /// their content stores them again).
    pub quarantined: u64,
    /// Packs damaged only in copies quarantined before this run: known, not used, and
    /// rewritten or deleted by the next `gc --repair`. Not a problem by themselves.
    pub packs_with_quarantined: u64,
    /// Format 2, whole repository: packs in the store that no index run names (a killed
    /// commit's, or one whose run was lost; see `verify/grouped.rs`). Not a problem by
    /// themselves: a version that needs one is reported damaged.
    pub unindexed_packs: Vec<Id>,
    /// Packs whose trailer or footer is lost but whose group frames give groups back, or
    /// whose frames are damaged while everything else reads: `cairn repair` stores their
    /// groups again in a new pack and sets them aside.
    pub rescuable_packs: Vec<Id>,
    /// Findings that are not damage but need an operator's eye (a version no ref reaches
    /// that may never have been published).
    pub notes: Vec<String>,
}

impl VerifyReport {
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty()
            && self.damaged_versions.is_empty()
            && self.damaged_metadata.is_empty()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DamagedVersion {
    pub image: String,
    pub seq: u64,
    pub id: Id,
    /// The first problem found in this version.
    pub reason: String,
}

/// Verifies the whole repository.
pub async fn verify(repo: Arc<Repo>) -> EngineResult<VerifyReport> {
    verify_with(repo, &VerifyOptions::default()).await
}

/// Verifies the repository, or the versions `options` names, reading the packs it selects.
pub async fn verify_with(repo: Arc<Repo>, options: &VerifyOptions) -> EngineResult<VerifyReport> {
    let mut report = VerifyReport::default();
    report.problems.extend(repo.index_errors());
    report
        .problems
        .extend(repo.gc_bookkeeping_problems().await?);
    let scoped = !options.versions.is_empty();

    // The versions to walk: the given ones, or every live one (damaged metadata is a finding,
    // never a reason to stop).
    let mut versions: Vec<(Id, VersionRecord)> = if scoped {
        options.versions.clone()
    } else {
        let live = crate::live::live_versions(&repo).await?;
        report.damaged_metadata.extend(live.damage);
        for (image, other, id) in &live.misdirected_heads {
            report.problems.push(format!(
                "the head of image {image:?} names version {} of image {other:?}; `cairn \
                 repair` points it at {image:?}'s newest version",
                id.short()
            ));
        }
        for (provable, line) in crate::live::describe_strays(&live.strays) {
            match provable {
                true => report.problems.push(line),
                false => report.notes.push(line),
            }
        }
        live.live.into_iter().collect()
    };
    versions.sort_by(|a, b| (&a.1.image, a.1.seq).cmp(&(&b.1.image, b.1.seq)));

    // 1. Packs and blobs: every indexed blob, or (scoped) those the versions use.
    let bad_blobs = match repo.v2() {
        Some(reader) => {
            grouped::check_packs(&repo, reader, &versions, scoped, options, &mut report).await?
        }
        None => check_format1_packs(&repo, &versions, scoped, options, &mut report).await?,
    };

    // 2. Version records and heads (the whole repository only).
    let mut known: HashSet<Id> = versions.iter().map(|(id, _)| *id).collect();
    if !scoped {
        check_records_and_heads(&repo, &mut known, &mut report).await?;
    }

    // 3. Manifest trees of the versions.
    check_trees(
        &repo,
        &versions,
        &bad_blobs,
        &known,
        scoped,
        options,
        &mut report,
    )
    .await?;
    report.damaged_metadata.sort_by(|a, b| a.key.cmp(&b.key));
    report.damaged_metadata.dedup();
    if let Err(e) = repo.flush_quarantine().await {
        report.problems.push(format!(
            "could not record the damaged blobs (quarantine): {e}"
        ));
    }
    Ok(report)
}

/// Step 2 of a whole-repository verify: every version record reads (damage is listed, and
/// the readable ones are `known`), and every head names a known version.
async fn check_records_and_heads(
    repo: &Arc<Repo>,
    known: &mut HashSet<Id>,
    report: &mut VerifyReport,
) -> EngineResult<()> {
    for listed in repo.version_record_ids().await? {
        let id = match listed {
            Ok(id) => id,
            Err(key) => {
                report
                    .problems
                    .push(format!("{key}: not a version record name"));
                continue;
            }
        };
        match repo.load_version(&id).await {
            Ok(_) => {
                known.insert(id);
            }
            Err(e) if e.is_damage() => {
                let d = Damaged {
                    key: keys::version(&id),
                    problem: match e {
                        RepoError::Corrupt { source, .. } => source.to_string(),
                        other => other.to_string(),
                    },
                };
                if !report.damaged_metadata.contains(&d) {
                    report.damaged_metadata.push(d);
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    let (images, bad_heads) = repo.images_checked().await?;
    for d in bad_heads {
        if !report.damaged_metadata.contains(&d) {
            report.damaged_metadata.push(d);
        }
    }
    for image in images {
        match repo.head(&image).await {
            Ok(Some(h)) if !known.contains(&h.version) => report.problems.push(format!(
                "head of image {image:?} names version {} which is missing or unreadable",
                h.version
            )),
            Ok(_) => {}
            Err(RepoError::Corrupt { key, source })
                if !matches!(source, cairn_format::FormatError::TooNew { .. }) =>
            {
                let d = Damaged {
                    key,
                    problem: source.to_string(),
                };
                if !report.damaged_metadata.contains(&d) {
                    report.damaged_metadata.push(d);
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Step 3: the manifest trees of `versions` (a missing parent is a problem unless `scoped`).
/// Deleted versions (and records no ref reaches, left by interrupted commits) may
/// legitimately have lost their data to GC, so only these are walked.
async fn check_trees(
    repo: &Arc<Repo>,
    versions: &[(Id, VersionRecord)],
    bad_blobs: &HashMap<Id, String>,
    known: &HashSet<Id>,
    scoped: bool,
    options: &VerifyOptions,
    report: &mut VerifyReport,
) -> EngineResult<()> {
    let mut walker = TreeChecker {
        repo: repo.clone(),
        bad_blobs,
        memo: HashMap::new(),
        leaf_digests: HashMap::new(),
    };
    progress::start(
        &options.progress,
        "walking trees",
        Unit::Items,
        versions.len() as u64,
    );
    for (id, record) in versions {
        report.versions_checked += 1;
        progress::add(&options.progress, 1);
        if let Some(parent) = record.parent {
            if !scoped && !known.contains(&parent) && !repo.is_known_lost_version(&parent).await? {
                report.problems.push(format!(
                    "version {}@{} ({}): parent {} is missing",
                    record.image,
                    record.seq,
                    id.short(),
                    parent.short()
                ));
            }
        }
        let Some(root) = record.root else { continue };
        if let Some(reason) = walker.check(root, record.height, record).await {
            report.damaged_versions.push(DamagedVersion {
                image: record.image.clone(),
                seq: record.seq,
                id: *id,
                reason,
            });
        }
    }
    Ok(())
}

/// Step 1 in format 1: reads the packs that hold the blobs in scope and checks every blob;
/// returns the bad blobs with the reason.
async fn check_format1_packs(
    repo: &Arc<Repo>,
    versions: &[(Id, VersionRecord)],
    scoped: bool,
    options: &VerifyOptions,
    report: &mut VerifyReport,
) -> EngineResult<HashMap<Id, String>> {
    let by_pack = if scoped {
        let used = used_blobs(repo, versions).await;
        let mut by_pack: HashMap<Id, Vec<BlobEntry>> = HashMap::new();
        let index = repo.index();
        for id in &used {
            if let Some(loc) = index.get(id) {
                by_pack.entry(loc.pack).or_default().push(loc.entry);
            }
        }
        by_pack
    } else {
        repo.index().by_pack()
    };
    report.packs_in_scope = by_pack.len() as u64;
    let by_pack: Vec<(Id, Vec<BlobEntry>)> = by_pack
        .into_iter()
        .filter(|(pack, _)| options.subset.includes(pack))
        .collect();
    let blob_bytes = by_pack
        .iter()
        .flat_map(|(_, entries)| entries)
        .map(|e| e.range().end - e.range().start)
        .sum();
    progress::start(&options.progress, "reading packs", Unit::Bytes, blob_bytes);
    check_packs(repo, by_pack, report, &options.progress).await
}

/// Every blob (manifest nodes and chunks) the versions use, as far as their trees can be read
/// (what cannot be read is reported by the tree walk later).
async fn used_blobs(repo: &Arc<Repo>, versions: &[(Id, VersionRecord)]) -> HashSet<Id> {
    /// Collects ids; an unreadable node is reported by the check that follows, not here.
    struct Used(HashSet<Id>);
    impl TreeVisitor<RepoError> for Used {
        fn enter(&mut self, at: &NodeAt) -> bool {
            self.0.insert(at.id)
        }
        fn leaf(&mut self, _: &NodeAt, leaf: Leaf) -> Result<(), RepoError> {
            self.0.extend(leaf.chunk_ids());
            Ok(())
        }
        fn unreadable(&mut self, _: &NodeAt, _: RepoError) -> Result<(), RepoError> {
            Ok(())
        }
    }
    let mut used = Used(HashSet::new());
    let mut reader: &Repo = repo;
    for (_, record) in versions {
        let Some(root) = record.root else { continue };
        let walk = walk_tree(&mut reader, root, record.height, record.fanout, &mut used);
        if let Err(e) = walk.await {
            tracing::debug!("reading the tree of {}@{}: {e}", record.image, record.seq);
        }
    }
    used.0
}

/// Reads every indexed pack and checks every blob; returns the bad blobs with the reason.
async fn check_packs(
    repo: &Arc<Repo>,
    by_pack: Vec<(Id, Vec<BlobEntry>)>,
    report: &mut VerifyReport,
    progress: &Option<Arc<WorkProgress>>,
) -> EngineResult<HashMap<Id, String>> {
    let mut bad = HashMap::new();
    let mut tasks = JoinSet::new();
    let mut pending = by_pack.into_iter();
    loop {
        crate::interrupt::check()?;
        while tasks.len() < 4 {
            let Some((pack, entries)) = pending.next() else {
                break;
            };
            let repo = repo.clone();
            tasks.spawn(async move { check_pack(&repo, pack, entries).await });
        }
        let Some(done) = tasks.join_next().await else {
            break;
        };
        let outcome = done.map_err(|e| EngineError::internal("verify task", e))??;
        report.packs_checked += 1;
        report.blobs_checked += outcome.blobs;
        progress::add(progress, outcome.blob_bytes);
        report.read_bytes += outcome.bytes;
        report.problems.extend(outcome.problems);
        report.packs_with_quarantined += u64::from(outcome.known_damaged);
        for (entry, reason) in outcome.bad {
            // The next commit that meets this content stores it again.
            repo.quarantine(
                &BlobLocation {
                    pack: outcome.pack,
                    entry,
                },
                &reason,
            );
            report.quarantined += 1;
            bad.insert(entry.id, reason);
        }
    }
    Ok(bad)
}

struct PackOutcome {
    pack: Id,
    /// The pack is damaged, but only in copies quarantined before this run.
    known_damaged: bool,
    blobs: u64,
    /// Bytes read (the whole pack).
    bytes: u64,
    /// Bytes of the blobs checked (the index's view of the pack).
    blob_bytes: u64,
    problems: Vec<String>,
    bad: Vec<(BlobEntry, String)>,
}

async fn check_pack(repo: &Repo, pack: Id, entries: Vec<BlobEntry>) -> EngineResult<PackOutcome> {
    let key = keys::pack(&pack);
    let blob_bytes = entries
        .iter()
        .map(|e| e.range().end - e.range().start)
        .sum();
    // A pack holding a copy quarantined earlier no longer matches its id, and is known to:
    // its other blobs are checked as usual, the copy is not used, and the next
    // `gc --repair` rewrites or deletes the pack.
    let known_damaged = repo.quarantined().iter().any(|(p, _)| *p == pack);
    let data = match repo.read_whole_pack(&pack).await {
        Ok(d) => d,
        Err(e) if e.is_not_found() => {
            let reason = format!("pack {pack} is missing");
            return Ok(PackOutcome {
                pack,
                known_damaged: false,
                blobs: entries.len() as u64,
                bytes: 0,
                blob_bytes,
                bad: entries.iter().map(|e| (*e, reason.clone())).collect(),
                problems: vec![format!("{key}: missing ({} blobs lost)", entries.len())],
            });
        }
        Err(e) => return Err(e.into()),
    };
    let bytes = data.len() as u64;
    tokio::task::spawn_blocking(move || {
        let mut problems = Vec::new();
        let mut bad = Vec::new();
        let mismatch = Id::of(&data) != pack;
        match pack::parse_pack(&data) {
            Ok(trailer) => {
                let listed: HashSet<&BlobEntry> = trailer.iter().collect();
                if let Some(e) = entries.iter().find(|e| !listed.contains(e)) {
                    problems.push(format!(
                        "{key}: trailer does not list blob {} of the index",
                        e.id
                    ));
                }
            }
            Err(e) => problems.push(format!("{key}: {e}")),
        }
        for e in &entries {
            let r = e.range();
            let outcome = if r.end > data.len() as u64 {
                Err(format!(
                    "pack {pack} is truncated before blob {} at offset {}",
                    e.id, e.offset
                ))
            } else {
                pack::decode_blob(e, &data[r.start as usize..r.end as usize])
                    .map(|_| ())
                    .map_err(|err| {
                        format!("blob {} in pack {pack} at offset {}: {err}", e.id, e.offset)
                    })
            };
            if let Err(reason) = outcome {
                problems.push(reason.clone());
                bad.push((*e, reason));
            }
        }
        let known = known_damaged && bad.is_empty() && problems.is_empty();
        if mismatch && !known {
            problems.insert(
                0,
                format!("{key}: content does not match its id (corrupt or truncated)"),
            );
        }
        PackOutcome {
            pack,
            known_damaged: mismatch && known,
            blobs: entries.len() as u64,
            bytes,
            blob_bytes,
            problems,
            bad,
        }
    })
    .await
    .map_err(|e| EngineError::internal("verify task", e))
}

/// Walks manifest trees, remembering the verdict for every node it has seen.
struct TreeChecker<'a> {
    repo: Arc<Repo>,
    bad_blobs: &'a HashMap<Id, String>,
    /// Node id → first problem in its subtree (`None`: intact).
    memo: HashMap<Id, Option<String>>,
    /// Format 2: each leaf's digest and figures, to check what level-1 nodes carry for it.
    leaf_digests: HashMap<Id, Option<LeafDigest>>,
}

type Verdict<'b> = Pin<Box<dyn Future<Output = Option<String>> + Send + 'b>>;

impl TreeChecker<'_> {
    fn check<'b>(&'b mut self, id: Id, level: u8, record: &'b VersionRecord) -> Verdict<'b> {
        Box::pin(async move {
            if let Some(v) = self.memo.get(&id) {
                return v.clone();
            }
            let verdict = self.check_uncached(id, level, record).await;
            self.memo.insert(id, verdict.clone());
            verdict
        })
    }

    /// What is wrong with leaf `id`'s chunks, if anything.
    fn check_leaf(&self, id: &Id, leaf: &Leaf, record: &VersionRecord) -> Option<String> {
        if leaf.len() > record.segment_size as u64 {
            return Some(format!("manifest leaf {id} is longer than a segment"));
        }
        for chunk in leaf.chunk_ids() {
            if let Some(reason) = self.bad_blobs.get(&chunk) {
                return Some(format!("chunk damaged: {reason}"));
            }
            if !self.repo.index().contains(&chunk) {
                return Some(format!("chunk {chunk} is missing from every index"));
            }
        }
        None
    }

    async fn check_uncached(
        &mut self,
        id: Id,
        level: u8,
        record: &VersionRecord,
    ) -> Option<String> {
        // Format 2 reads a node from any good copy (damaged ones are quarantined by now), so
        // only a failed read says it is lost.
        let bad = self.bad_blobs.get(&id);
        if let (Some(reason), None) = (bad, self.repo.v2()) {
            return Some(format!("manifest node damaged: {reason}"));
        }
        let raw = match self.repo.read_blob(&id).await {
            Ok(raw) => raw,
            Err(e) => {
                return Some(match bad {
                    Some(reason) => format!("manifest node damaged: {reason}"),
                    None => format!("manifest node unreadable: {e}"),
                })
            }
        };
        if level == 0 {
            if let Some(reader) = self.repo.v2() {
                let digest = RunLeaf::decode(&raw).ok().and_then(|l| l.leaf_digest());
                self.leaf_digests.insert(id, digest);
                return grouped::check_run_leaf(reader, self.bad_blobs, &id, &raw, record).await;
            }
        }
        let node = match decode_node(&id, level, &raw) {
            Ok(Node::Interior(n)) => n,
            Ok(Node::Leaf(leaf)) => return self.check_leaf(&id, &leaf, record),
            Err(e) => return Some(e.to_string()),
        };
        for (i, &(_, child)) in node.children.iter().enumerate() {
            if let Some(reason) = self.check(child, level - 1, record).await {
                return Some(reason);
            }
            // What a commit trusts to reuse the leaf unread must be the leaf's own.
            if let Some(carried) = node.leaf_digest(i) {
                if self.leaf_digests.get(&child) != Some(&Some(carried)) {
                    return Some(format!(
                        "manifest node {id}: the digest it carries for leaf {child} is not the \
                         leaf's"
                    ));
                }
            }
        }
        None
    }
}

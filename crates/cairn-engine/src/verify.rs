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
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::tree_walk::{decode_node, Node};
use cairn_repo::{Damaged, Repo, RepoError};

use crate::error::EngineResult;
use crate::progress::{self, Unit, WorkProgress};

mod format1;
mod format2;

pub(crate) use format2::unindexed_packs;

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
    /// VM version records read (the whole repository only).
    pub vm_versions_checked: u64,
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
    /// commit's, or one whose run was lost; see `verify/format2.rs`). Not a problem by
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
            format2::check_packs(&repo, reader, &versions, scoped, options, &mut report).await?
        }
        None => format1::check_packs(&repo, &versions, scoped, options, &mut report).await?,
    };

    // 2. Version records and heads (the whole repository only).
    let mut known: HashSet<Id> = versions.iter().map(|(id, _)| *id).collect();
    if !scoped {
        check_records_and_heads(&repo, &mut known, &mut report).await?;
        let vms = crate::vm::check::check_vms(&repo, &known).await?;
        report.damaged_metadata.extend(vms.damaged);
        report.problems.extend(vms.problems);
        report.vm_versions_checked = vms.checked;
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
                return format2::check_run_leaf(reader, self.bad_blobs, &id, &raw, record).await;
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

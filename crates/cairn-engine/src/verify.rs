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

use cairn_format::node::{Extent, Interior, Leaf};
use cairn_format::pack::{self, BlobEntry};
use cairn_format::version::{self, VersionRecord};
use cairn_format::Id;
use cairn_repo::{pack_key, Repo, RepoError};
use cairn_store::StoreError;
use tokio::task::JoinSet;

use crate::error::{EngineError, EngineResult};

#[derive(Debug, Clone, Default)]
pub struct VerifyReport {
    pub packs_checked: u64,
    pub blobs_checked: u64,
    pub bytes_read: u64,
    pub versions_checked: u64,
    /// One line per problem found, naming what and where.
    pub problems: Vec<String>,
    /// Versions that cannot be restored intact, sorted by image and sequence.
    pub damaged_versions: Vec<DamagedVersion>,
}

impl VerifyReport {
    pub fn is_clean(&self) -> bool {
        self.problems.is_empty() && self.damaged_versions.is_empty()
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
    let mut report = VerifyReport::default();
    report.problems.extend(repo.index_errors());

    // 1. Packs and blobs.
    let bad_blobs = check_packs(&repo, &mut report).await?;

    // 2. Version records and heads.
    let mut versions: Vec<(Id, VersionRecord)> = Vec::new();
    for meta in repo.store().list(version::PREFIX).await? {
        let Ok(id) = meta.key[version::PREFIX.len()..].parse::<Id>() else {
            report
                .problems
                .push(format!("{}: not a version record name", meta.key));
            continue;
        };
        match repo.load_version(&id).await {
            Ok(record) => versions.push((id, record)),
            Err(e) => report.problems.push(e.to_string()),
        }
    }
    let known: HashSet<Id> = versions.iter().map(|(id, _)| *id).collect();
    for image in repo.images().await? {
        match repo.head(&image).await {
            Ok(Some(h)) if !known.contains(&h.version) => report.problems.push(format!(
                "head of image {image:?} names version {} which is missing or unreadable",
                h.version
            )),
            Ok(_) => {}
            Err(e) => report.problems.push(e.to_string()),
        }
    }

    // 3. Manifest trees of the live versions. Deleted versions (and records no ref reaches,
    // left by interrupted commits) may legitimately have lost their data to GC.
    let live = crate::live::live_versions(&repo).await?;
    versions.retain(|(id, _)| live.live.contains_key(id));
    let mut walker = TreeChecker {
        repo: repo.clone(),
        bad_blobs: &bad_blobs,
        memo: HashMap::new(),
    };
    versions.sort_by(|a, b| (&a.1.image, a.1.seq).cmp(&(&b.1.image, b.1.seq)));
    for (id, record) in &versions {
        report.versions_checked += 1;
        if let Some(parent) = record.parent {
            if !known.contains(&parent) {
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
    Ok(report)
}

/// Reads every indexed pack and checks every blob; returns the bad blobs with the reason.
async fn check_packs(
    repo: &Arc<Repo>,
    report: &mut VerifyReport,
) -> EngineResult<HashMap<Id, String>> {
    let by_pack = repo.index().by_pack();
    let mut bad = HashMap::new();
    let mut tasks = JoinSet::new();
    let mut pending = by_pack.into_iter();
    loop {
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
        let outcome = done.map_err(|e| EngineError::Pipeline(format!("verify task: {e}")))??;
        report.packs_checked += 1;
        report.blobs_checked += outcome.blobs;
        report.bytes_read += outcome.bytes;
        report.problems.extend(outcome.problems);
        bad.extend(outcome.bad);
    }
    Ok(bad)
}

struct PackOutcome {
    blobs: u64,
    bytes: u64,
    problems: Vec<String>,
    bad: Vec<(Id, String)>,
}

async fn check_pack(repo: &Repo, pack: Id, entries: Vec<BlobEntry>) -> EngineResult<PackOutcome> {
    let key = pack_key(&pack);
    let data = match repo.store().get(&key).await {
        Ok(d) => d,
        Err(StoreError::NotFound { .. }) => {
            let reason = format!("pack {pack} is missing");
            return Ok(PackOutcome {
                blobs: entries.len() as u64,
                bytes: 0,
                bad: entries.iter().map(|e| (e.id, reason.clone())).collect(),
                problems: vec![format!("{key}: missing ({} blobs lost)", entries.len())],
            });
        }
        Err(e) => return Err(RepoError::from(e).into()),
    };
    let bytes = data.len() as u64;
    tokio::task::spawn_blocking(move || {
        let mut problems = Vec::new();
        let mut bad = Vec::new();
        if Id::of(&data) != pack {
            problems.push(format!(
                "{key}: content does not match its id (corrupt or truncated)"
            ));
        }
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
                bad.push((e.id, reason));
            }
        }
        PackOutcome {
            blobs: entries.len() as u64,
            bytes,
            problems,
            bad,
        }
    })
    .await
    .map_err(|e| EngineError::Pipeline(format!("verify task: {e}")))
}

/// Walks manifest trees, remembering the verdict for every node it has seen.
struct TreeChecker<'a> {
    repo: Arc<Repo>,
    bad_blobs: &'a HashMap<Id, String>,
    /// Node id → first problem in its subtree (`None`: intact).
    memo: HashMap<Id, Option<String>>,
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

    async fn check_uncached(
        &mut self,
        id: Id,
        level: u8,
        record: &VersionRecord,
    ) -> Option<String> {
        if let Some(reason) = self.bad_blobs.get(&id) {
            return Some(format!("manifest node damaged: {reason}"));
        }
        let raw = match self.repo.read_blob(&id).await {
            Ok(raw) => raw,
            Err(e) => return Some(format!("manifest node unreadable: {e}")),
        };
        if level == 0 {
            let leaf = match Leaf::decode(&raw) {
                Ok(l) => l,
                Err(e) => return Some(format!("manifest leaf {id}: {e}")),
            };
            if leaf.len() > record.segment_size as u64 {
                return Some(format!("manifest leaf {id} is longer than a segment"));
            }
            for e in &leaf.extents {
                if let Extent::Chunk { id: chunk, .. } = e {
                    if let Some(reason) = self.bad_blobs.get(chunk) {
                        return Some(format!("chunk damaged: {reason}"));
                    }
                    if !self.repo.index().contains(chunk) {
                        return Some(format!("chunk {chunk} is missing from every index"));
                    }
                }
            }
            return None;
        }
        let node = match Interior::decode(&raw) {
            Ok(n) if n.level == level => n,
            Ok(n) => {
                return Some(format!(
                    "manifest node {id} has level {}, expected {level}",
                    n.level
                ))
            }
            Err(e) => return Some(format!("manifest node {id}: {e}")),
        };
        for (_, child) in node.children {
            if let Some(reason) = self.check(child, level - 1, record).await {
                return Some(reason);
            }
        }
        None
    }
}

//! Verify's first step in format 1 (read only since format 2): the packs that hold the blobs
//! in scope are read, and every blob checked against its id; a bad blob is quarantined.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use cairn_format::keys;
use cairn_format::node::Leaf;
use cairn_format::pack::{self, BlobEntry};
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::tree_walk::{walk_tree, NodeAt, TreeVisitor};
use cairn_repo::{BlobLocation, Repo, RepoError};
use tokio::task::JoinSet;

use super::{VerifyOptions, VerifyReport};
use crate::error::{EngineError, EngineResult};
use crate::progress::{self, Unit, WorkProgress};

/// Step 1 in format 1: reads the packs that hold the blobs in scope and checks every blob;
/// returns the bad blobs with the reason.
pub(super) async fn check_packs(
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
    check_listed_packs(repo, by_pack, report, &options.progress).await
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
async fn check_listed_packs(
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

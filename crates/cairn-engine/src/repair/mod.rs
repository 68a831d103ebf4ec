//! `cairn repair`: rebuild what can be rebuilt, set aside what cannot be read, and say exactly
//! what stays lost.
//!
//! In order, each step only adding objects or replacing what is unreadable:
//!
//! 1. **Version records** that are corrupt are set aside (`damaged/versions/<id>`); missing
//!    ones are recorded as known lost. Either way the version is gone, and later walks treat
//!    the break in its image's chain as known.
//! 2. **Heads** that cannot be decoded, or that name a lost version, are rebuilt from the
//!    newest intact, undeleted version record of the image; an image with none left loses
//!    its head. **Tags** that cannot be decoded are set aside (the version they named is
//!    unknown: the tag is lost, the version is not).
//! 3. **Index**: index files that cannot be decoded are replaced by an index rebuilt from the
//!    trailers of the packs no readable index names (every entry verified), then set aside,
//!    so GC, which refuses a partial view, can run again.
//! 4. **Blobs from a source** (`--from IMAGE_FILE`): the file is chunked exactly as a commit
//!    would, and every chunk or manifest node that live versions need but the repository lacks
//!    (missing, or only a quarantined copy) is stored. Nodes restored this way reveal the
//!    blobs below them, so this runs until nothing new is found (at most once per tree level).
//! 5. **Reference summaries** of live trees that are missing or damaged are rebuilt.
//!
//! The report ends with what is still lost: blobs no copy of which is readable, and the
//! versions that need them.
//!
//! Format 2 (`grouped.rs`) takes the same steps in its own terms: damaged index runs are
//! replaced by a run rebuilt from the trailers of the packs no intact run names; `--from`
//! stores every block of the source the repository holds no good copy of (a commit's
//! pipeline without its version), after which a damaged group's slots read from those
//! copies and the next GC rebuilds the group itself (`gc/rebuild.rs`); what is lost are the
//! chunks of group runs and the manifest nodes that no good copy holds.

use cairn_format::keys;
use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;

use cairn_format::index::{IndexFile, PackIndex};
use cairn_format::node::Leaf;
use cairn_format::pack::{self, BlobEntry};
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::tree_walk::{walk_tree, NodeAt, TreeVisitor};
use cairn_repo::{BlobLocation, Repo, RepoError};

use crate::commit::{run_pipeline, CommitOptions, CommitProgress};
use crate::error::{EngineError, EngineResult};
use crate::gc::summaries::{ensure_summary, SummaryCheck};
use crate::live::{live_versions, records_of, LiveVersions};
use crate::source::Source;

mod grouped;

/// Opens the source a repair reads blobs from, once per pass (it may be read several times).
pub type SourceOpener = Box<dyn Fn() -> EngineResult<Box<dyn Source>> + Send + Sync>;

#[derive(Default)]
pub struct RepairOptions {
    /// Report what would be done; change nothing.
    pub dry_run: bool,
    /// A disk image holding (some of) the lost data, e.g. the disk a damaged version was
    /// committed from.
    pub from: Option<SourceOpener>,
}

/// A version that still cannot be restored intact, and how many of its blobs are lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostVersion {
    pub image: String,
    pub seq: u64,
    pub id: Id,
    pub missing_blobs: u64,
}

#[derive(Debug, Clone, Default)]
pub struct RepairReport {
    pub dry_run: bool,
    /// Version records set aside (corrupt) or recorded as lost (missing).
    pub records_set_aside: Vec<String>,
    /// Heads rebuilt: (image, new head as `IMAGE@SEQ`, or None if the image had no intact
    /// version left and its head was removed).
    pub heads_rebuilt: Vec<(String, Option<String>)>,
    /// Tag refs that could not be read and were set aside.
    pub tags_lost: Vec<String>,
    /// Index files that could not be read and were set aside.
    pub index_files_set_aside: Vec<String>,
    /// Format 2: packs read whole and checked before anything was judged lost.
    pub packs_checked: u64,
    /// Packs whose trailers were read to rebuild the index, and the blobs indexed from them.
    pub packs_reindexed: u64,
    pub blobs_reindexed: u64,
    /// Damaged packs whose groups were stored again in new packs (their trailer or footer
    /// lost: groups read from their frames; or a frame damaged) and then set aside, and the
    /// groups so stored.
    pub packs_rescued: u64,
    pub groups_rescued: u64,
    /// Blobs stored again from `--from`, and their plain bytes.
    pub blobs_restored: u64,
    pub bytes_restored: u64,
    pub summaries_rebuilt: u64,
    /// Blobs live versions need that no readable copy holds, after the repair.
    pub blobs_lost: u64,
    /// The live versions those blobs belong to.
    pub lost_versions: Vec<LostVersion>,
}

impl RepairReport {
    /// Whether anything stays lost.
    pub fn is_clean(&self) -> bool {
        self.blobs_lost == 0
    }
}

pub async fn repair(repo: &Arc<Repo>, options: RepairOptions) -> EngineResult<RepairReport> {
    let mut report = RepairReport {
        dry_run: options.dry_run,
        ..Default::default()
    };
    let live = live_versions(repo).await?;
    repair_metadata(repo, &live, options.dry_run, &mut report).await?;
    if repo.v2().is_some() {
        let unreadable_unnamed = grouped::repair_runs(repo, options.dry_run, &mut report).await?;
        // Every pack read whole first, as verify reads them: damage no read has met yet is
        // found and quarantined, and quarantine markers whose copies read intact (or that
        // name nothing) are lifted, so what follows is judged on what the packs hold now —
        // never "nothing is lost" because nobody looked.
        repo.refresh_index().await?;
        let checked = crate::verify::verify(repo.clone()).await?;
        report.packs_checked = checked.packs_checked;
        let mut rescuable = checked.rescuable_packs;
        rescuable.extend(unreadable_unnamed);
        grouped::rescue_packs(repo, &rescuable, options.dry_run, &mut report).await?;
        let live = live_versions(repo).await?;
        if let Some(open) = &options.from {
            grouped::store_from(repo, &live, open()?, options.dry_run, &mut report).await?;
        }
        let (lost, per_version) = grouped::lost_blobs(repo, &live).await?;
        report.blobs_lost = lost.len() as u64;
        report.lost_versions = per_version;
        return Ok(report);
    }
    repair_index(repo, options.dry_run, &mut report).await?;
    let live = live_versions(repo).await?;

    if let Some(open) = &options.from {
        let mut tried: HashSet<Id> = HashSet::new();
        loop {
            crate::interrupt::check()?;
            let (wanted, _) = lost_blobs(repo, &live).await?;
            let new: HashSet<Id> = wanted.difference(&tried).copied().collect();
            if new.is_empty() || options.dry_run {
                break;
            }
            tried.extend(new.iter().copied());
            let (n, bytes) = store_from(repo, open()?, new).await?;
            report.blobs_restored += n;
            report.bytes_restored += bytes;
            if n == 0 {
                break;
            }
        }
    }

    if !options.dry_run {
        let index = repo.fresh_index().await?;
        let mut seen = HashSet::new();
        for record in live.live.values() {
            let Some(root) = record.root else { continue };
            if !seen.insert(root) {
                continue;
            }
            let needs = match repo.load_summary(&root).await {
                Ok(Some(_)) => None,
                Ok(None) => Some(SummaryCheck::Missing),
                Err(_) => Some(SummaryCheck::Load),
            };
            if let Some(check) = needs {
                // A tree that cannot be read keeps its summary missing: reported as lost below.
                if let Ok(e) = ensure_summary(repo, &index, record, check, true).await {
                    report.summaries_rebuilt += u64::from(e.written > 0);
                }
            }
        }
    }

    let (lost, per_version) = lost_blobs(repo, &live).await?;
    report.blobs_lost = lost.len() as u64;
    report.lost_versions = per_version;
    Ok(report)
}

/// Steps 1 and 2: records, heads, tags.
async fn repair_metadata(
    repo: &Repo,
    live: &LiveVersions,
    dry_run: bool,
    report: &mut RepairReport,
) -> EngineResult<()> {
    let mut lost_versions: HashSet<Id> = HashSet::new();
    for d in &live.damage {
        if let Some(id) = d
            .key
            .strip_prefix(keys::VERSIONS)
            .and_then(|h| h.parse::<Id>().ok())
        {
            lost_versions.insert(id);
            report
                .records_set_aside
                .push(format!("{}: {}", d.key, d.problem));
            if !dry_run {
                repo.set_aside_object(&d.key).await?;
                repo.acknowledge_lost_version(&id).await?;
            }
        }
    }
    // Heads that cannot be read, or name a lost version, and tags that cannot be read.
    for d in &live.damage {
        if d.key.starts_with("refs/tags/") {
            report.tags_lost.push(format!("{}: {}", d.key, d.problem));
            if !dry_run {
                repo.set_aside_ref(&d.key["refs/".len()..]).await?;
            }
        }
    }
    let (images, bad_keys) = repo.images_checked().await?;
    for d in bad_keys {
        report.heads_rebuilt.push((d.key.clone(), None));
        if !dry_run {
            repo.set_aside_ref(&d.key["refs/".len()..]).await?;
        }
    }
    for image in images {
        let broken = match repo.head(&image).await {
            Ok(Some(h)) => {
                lost_versions.contains(&h.version) || !version_readable(repo, &h.version).await?
            }
            Ok(None) => false,
            Err(e) if e.is_damage() => true,
            Err(e) => return Err(e.into()),
        };
        if !broken {
            continue;
        }
        let mut damage = Vec::new();
        let images = std::collections::BTreeSet::from([image.clone()]);
        let newest = records_of(repo, &mut Default::default(), &images, &mut damage)
            .await?
            .into_iter()
            .filter(|(id, _)| !live.deleted.contains(id))
            .max_by_key(|(_, r)| (r.seq, r.time_ns));
        let key = keys::head(&image);
        match newest {
            Some((id, record)) => {
                report
                    .heads_rebuilt
                    .push((image.clone(), Some(format!("{image}@{}", record.seq))));
                if !dry_run {
                    repo.overwrite_head(&image, &id).await?;
                }
            }
            None => {
                report.heads_rebuilt.push((image.clone(), None));
                if !dry_run {
                    repo.set_aside_ref(&key).await?;
                }
            }
        }
    }
    repoint_heads(repo, live, dry_run, report).await
}

/// Step 2 (continued): an image whose head is missing, names another image's version, or
/// was moved back behind published versions gets its head pointed at its newest version no
/// ref reaches (`LiveVersions::strays`). A head is never moved back.
async fn repoint_heads(
    repo: &Repo,
    live: &LiveVersions,
    dry_run: bool,
    report: &mut RepairReport,
) -> EngineResult<()> {
    let misdirected: HashSet<&str> = live
        .misdirected_heads
        .iter()
        .map(|(image, _, _)| image.as_str())
        .collect();
    for group in live.strays.chunk_by(|a, b| a.image == b.image) {
        let newest = group
            .iter()
            .max_by_key(|s| (s.seq, live.live.get(&s.id).map(|r| r.time_ns)))
            .expect("a group has a stray");
        let image = &newest.image;
        let behind = match repo.head(image).await? {
            None => true,
            Some(_) if misdirected.contains(image.as_str()) => true,
            Some(h) => match repo.load_version(&h.version).await {
                Ok(head) => head.seq < newest.seq,
                Err(e) if e.is_damage() => false, // rebuilt above
                Err(e) => return Err(e.into()),
            },
        };
        if !behind {
            continue;
        }
        report
            .heads_rebuilt
            .push((image.clone(), Some(format!("{image}@{}", newest.seq))));
        if !dry_run {
            repo.overwrite_head(image, &newest.id).await?;
        }
    }
    Ok(())
}

/// Whether a version record can be read (a store error is still an error).
async fn version_readable(repo: &Repo, id: &Id) -> EngineResult<bool> {
    match repo.load_version(id).await {
        Ok(_) => Ok(true),
        Err(e) if e.is_damage() => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Step 3: an index rebuilt from the trailers of unindexed packs, where index files are
/// damaged or blobs are missing.
async fn repair_index(repo: &Repo, dry_run: bool, report: &mut RepairReport) -> EngineResult<()> {
    let (files, damaged_files) = repo.index_files_checked().await?;
    let indexed: HashSet<Id> = files
        .iter()
        .flat_map(|(_, f)| f.packs.iter().map(|p| p.pack))
        .collect();
    if damaged_files.is_empty() {
        return Ok(());
    }
    let mut orphans: Vec<Id> = repo
        .pack_sizes()
        .await?
        .into_keys()
        .filter(|p| !indexed.contains(p))
        .collect();
    orphans.sort();
    let mut rebuilt: Vec<PackIndex> = Vec::new();
    for pack in orphans {
        crate::interrupt::check()?;
        let data = match repo.read_whole_pack(&pack).await {
            Ok(d) => d,
            Err(e) if e.is_not_found() => continue,
            Err(e) => return Err(e.into()),
        };
        let Ok(entries) = pack::parse_pack(&data) else {
            continue; // no readable trailer: nothing to index from it
        };
        let good: Vec<BlobEntry> = entries
            .into_iter()
            .filter(|e| {
                let r = e.range();
                r.end <= data.len() as u64
                    && repo
                        .check_blob(
                            &BlobLocation { pack, entry: *e },
                            &data[r.start as usize..r.end as usize],
                        )
                        .is_ok()
            })
            .collect();
        if !good.is_empty() {
            report.packs_reindexed += 1;
            report.blobs_reindexed += good.len() as u64;
            rebuilt.push(PackIndex {
                pack,
                entries: good,
            });
        }
    }
    if dry_run {
        report
            .index_files_set_aside
            .extend(damaged_files.into_iter().map(|(k, e)| format!("{k}: {e}")));
        return Ok(());
    }
    // The rebuilt index is durable before the damaged files go. Rebuilt from the same packs
    // it may encode exactly as a damaged file did before the damage, i.e. under that file's
    // key: then it is written in another order (same content, another key), so that no
    // moment passes without an index naming these packs.
    let mut file = IndexFile { packs: rebuilt };
    let damaged_keys: HashSet<&str> = damaged_files.iter().map(|(k, _)| k.as_str()).collect();
    let mut late = None;
    if !file.packs.is_empty() {
        if damaged_keys.contains(keys::index_file(&Id::of(&file.encode())).as_str()) {
            if let Some(p) = file.packs.iter_mut().find(|p| p.entries.len() > 1) {
                p.entries.reverse();
            } else if file.packs.len() > 1 {
                file.packs.reverse();
            } else {
                late = Some(file.clone()); // one blob: written once its damaged copy is gone
            }
        }
        if late.is_none() {
            repo.put_index_file(&file).await?;
        }
    }
    for (key, e) in &damaged_files {
        repo.set_aside_object(key).await?;
        report.index_files_set_aside.push(format!("{key}: {e}"));
    }
    if let Some(file) = late {
        repo.put_index_file(&file).await?;
    }
    repo.refresh_index().await?;
    Ok(())
}

/// Stores the blobs in `wanted` that `source` holds; returns how many, and their plain bytes.
async fn store_from(
    repo: &Arc<Repo>,
    source: Box<dyn Source>,
    wanted: HashSet<Id>,
) -> EngineResult<(u64, u64)> {
    let handle = tokio::runtime::Handle::current();
    let progress = Arc::new(CommitProgress::default());
    let out = {
        let (repo, progress) = (repo.clone(), progress.clone());
        tokio::task::spawn_blocking(move || {
            run_pipeline(
                repo,
                handle,
                source,
                &CommitOptions::default(),
                &progress,
                Some(wanted),
            )
        })
        .await
        .map_err(|e| EngineError::internal("repair thread", e))??
    };
    let n: u64 = out.packs.iter().map(|(_, e)| e.len() as u64).sum();
    let bytes: u64 = out
        .packs
        .iter()
        .flat_map(|(_, e)| e.iter().map(|e| e.raw_len as u64))
        .sum();
    repo.put_index(out.packs).await?;
    Ok((n, bytes))
}

/// The blobs live versions need that no readable copy holds (as far as their trees can be
/// read: a lost node counts, its subtree is unknown), and per version how many it needs.
async fn lost_blobs(
    repo: &Repo,
    live: &LiveVersions,
) -> EngineResult<(HashSet<Id>, Vec<LostVersion>)> {
    let mut lost: HashSet<Id> = HashSet::new();
    let mut per_version = Vec::new();
    // Node id → the lost blobs under it (memoised: versions share subtrees).
    let mut memo: BTreeMap<Id, Vec<Id>> = BTreeMap::new();
    for (id, record) in in_order(live) {
        let Some(root) = record.root else { continue };
        let mine = lost_under(repo, root, record.height, record.fanout, &mut memo).await?;
        tally(&mut lost, &mut per_version, id, record, mine);
    }
    Ok((lost, per_version))
}

/// The live versions by image and number.
fn in_order(live: &LiveVersions) -> Vec<(&Id, &VersionRecord)> {
    let mut records: Vec<(&Id, &VersionRecord)> = live.live.iter().collect();
    records.sort_by(|a, b| (&a.1.image, a.1.seq).cmp(&(&b.1.image, b.1.seq)));
    records
}

/// Adds what version `id` lacks (`mine`) to the totals.
fn tally(
    lost: &mut HashSet<Id>,
    per_version: &mut Vec<LostVersion>,
    id: &Id,
    record: &VersionRecord,
    mine: HashSet<Id>,
) {
    if mine.is_empty() {
        return;
    }
    lost.extend(mine.iter().copied());
    per_version.push(LostVersion {
        image: record.image.clone(),
        seq: record.seq,
        id: *id,
        missing_blobs: mine.len() as u64,
    });
}

/// The lost blobs under `node` (the node itself if it cannot be read). `memo` remembers the
/// verdict for leaves and unreadable nodes, which versions share.
async fn lost_under(
    repo: &Repo,
    root: Id,
    height: u8,
    fanout: u16,
    memo: &mut BTreeMap<Id, Vec<Id>>,
) -> EngineResult<HashSet<Id>> {
    let mut lost = LostUnder {
        repo,
        memo,
        out: HashSet::new(),
    };
    let mut reader = repo;
    walk_tree(&mut reader, root, height, fanout, &mut lost).await?;
    Ok(lost.out)
}

/// Collects the lost blobs of a tree: chunks no index holds, and unreadable nodes.
struct LostUnder<'a> {
    repo: &'a Repo,
    memo: &'a mut BTreeMap<Id, Vec<Id>>,
    out: HashSet<Id>,
}

impl TreeVisitor<RepoError> for LostUnder<'_> {
    fn enter(&mut self, at: &NodeAt) -> bool {
        match self.memo.get(&at.id) {
            Some(known) => {
                self.out.extend(known.iter().copied());
                false
            }
            None => true,
        }
    }

    fn leaf(&mut self, at: &NodeAt, leaf: Leaf) -> Result<(), RepoError> {
        let here: Vec<Id> = leaf
            .chunk_ids()
            .filter(|id| !self.repo.index().contains(id))
            .collect();
        self.out.extend(here.iter().copied());
        self.memo.insert(at.id, here);
        Ok(())
    }

    /// A damaged or missing node is lost itself (a failing store still ends the walk).
    fn unreadable(&mut self, at: &NodeAt, e: RepoError) -> Result<(), RepoError> {
        if !e.is_damage() {
            return Err(e);
        }
        self.out.insert(at.id);
        self.memo.insert(at.id, vec![at.id]);
        Ok(())
    }
}

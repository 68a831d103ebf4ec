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
//!    unknown: the tag is lost, the version is not). **VM heads** likewise (`vm_heads`):
//!    pointed at the VM's newest version no ref reaches when lost, damaged or behind.
//! 3. **Index runs** (`index_runs`): damaged runs are replaced by a run rebuilt from the
//!    trailers of the packs no intact run names, then set aside, so GC, which refuses a
//!    partial view, can run again. Every pack is then read whole, as `verify` reads it, and
//!    **damaged packs** whose groups can still be read (`rescue`) have them stored again in
//!    new packs, and are set aside.
//! 4. **Data from a source** (`--from IMAGE_FILE`, `from_source`): every block of the source
//!    the repository holds no good copy of is stored (a commit's pipeline without its
//!    version); a damaged group's slots then read from those copies and the next GC rebuilds
//!    the group itself (`gc/rebuild.rs`).
//!
//! The report ends with what is still lost (`lost`): the chunks of group runs and the manifest
//! nodes no good copy holds, and the versions that need them.

use cairn_format::keys;
use std::collections::HashSet;
use std::sync::Arc;

use cairn_format::Id;
use cairn_repo::Repo;

use crate::error::{EngineError, EngineResult};
use crate::live::{live_versions, records_of, LiveVersions};
use crate::source::Source;

mod from_source;
mod index_runs;
mod lost;
mod rescue;
mod vm_heads;

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
    /// VM heads pointed at the VM's newest version no ref reached: (VM, `VM@SEQ`).
    pub vm_heads_rebuilt: Vec<(String, String)>,
    /// Tag refs that could not be read and were set aside.
    pub tags_lost: Vec<String>,
    /// Index runs that could not be read and were set aside.
    pub index_runs_set_aside: Vec<String>,
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
    pub restored_bytes: u64,
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
    EngineError::ensure_writable(repo, "repair")?;
    let mut report = RepairReport {
        dry_run: options.dry_run,
        ..Default::default()
    };
    let live = live_versions(repo).await?;
    repair_metadata(repo, &live, options.dry_run, &mut report).await?;
    vm_heads::repoint_vm_heads(repo, options.dry_run, &mut report).await?;
    let unreadable_unnamed = index_runs::repair_runs(repo, options.dry_run, &mut report).await?;
    // Every pack read whole first, as verify reads them: damage no read has met yet is found
    // and quarantined, and quarantine markers whose copies read intact (or that name nothing)
    // are lifted, so what follows is judged on what the packs hold now — never "nothing is
    // lost" because nobody looked.
    repo.refresh_index().await?;
    let checked = crate::verify::verify(repo.clone()).await?;
    report.packs_checked = checked.packs_checked;
    let mut rescuable = checked.rescuable_packs;
    rescuable.extend(unreadable_unnamed);
    rescue::rescue_packs(repo, &rescuable, options.dry_run, &mut report).await?;
    let live = live_versions(repo).await?;
    if let Some(open) = &options.from {
        from_source::store_from(repo, &live, open()?, options.dry_run, &mut report).await?;
    }
    let (lost, per_version) = lost::lost_blobs(repo, &live).await?;
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

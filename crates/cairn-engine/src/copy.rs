//! `cairn copy`: versions from one repository into another — local ↔ S3, format 1 → 2,
//! plain → encrypted — sending only what changed and keeping images, times, messages, order
//! and tags (restic's `copy`, PBS's sync jobs).
//!
//! A source version's **copy** is the destination version of the same image with the same
//! time, logical size and message (the chunks, nodes and ids differ between repositories of
//! other formats or keys, so the contents cannot name it). Versions that have a copy are
//! skipped, so a second run copies nothing and an interrupted run resumes where it stopped.
//!
//! Each version is committed as a patch ([`commit_patch`]): the previous version of its image
//! that has a copy is the base, and only the segments whose leaf differs between the two
//! source versions are read from the source (equal leaf ids in one repository mean equal
//! bytes). The first version of an image, and one whose size or segment size changed, is
//! read whole. The destination deduplicates what it receives like any commit, so it stores
//! only what it lacks. Copies are appended to the destination image's history in the
//! source's order (oldest first); tags follow the versions they name, unless the destination
//! has a tag of that name already (tags never move silently: reported, left as they are).
//! An image's boot profile goes along when the destination's image has none.
//! VM versions follow their disks (`vm::copy`).

use std::collections::{BTreeMap, HashMap};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::Repo;
use tokio::runtime::Handle;

use crate::commit::patch::{commit_patch, PatchOptions, PatchSource};
use crate::error::{EngineError, EngineResult};
use crate::progress::{self, Unit, WorkProgress};
use crate::resolve::{history, resolve, VersionSpec};
use crate::segment::read_segment;
use crate::tree::leaf_map;

/// What a copy did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyReport {
    /// Versions committed into the destination.
    pub copied: Vec<CopiedVersion>,
    /// Selected versions the destination had already.
    pub present: u64,
    /// Tags created in the destination.
    pub tags_created: u64,
    /// Tags the destination has with another target (left as they are).
    pub tags_conflicting: Vec<String>,
    /// Boot profiles given to destination images that had none.
    pub profiles_copied: u64,
    /// Plain bytes read from the source (changed segments only).
    pub read_bytes: u64,
    /// Bytes written to the destination's store.
    pub stored_bytes: u64,
    /// Source versions that could not be read whole (damaged): not copied, and the copy
    /// went on with the rest; (image, source seq, source id, what failed).
    pub damaged: Vec<(String, u64, Id, String)>,
    /// VM versions, which follow their disks (`vm::copy`).
    pub vms: crate::vm::copy::VmCopyReport,
}

/// One version copied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopiedVersion {
    pub image: String,
    pub source: Id,
    pub source_seq: u64,
    pub id: Id,
    pub seq: u64,
}

/// What identifies a source version's copy in the destination.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct CopyKey {
    time_ns: i64,
    logical_size: u64,
    message: String,
}

impl CopyKey {
    pub(crate) fn of(record: &VersionRecord) -> Self {
        CopyKey {
            time_ns: record.time_ns,
            logical_size: record.logical_size,
            message: record.message.clone(),
        }
    }
}

/// The images and versions to copy: every version of every image when `specs` is empty;
/// `IMAGE` is all of an image's versions, `IMAGE@REF` one version.
async fn select(
    source: &Repo,
    specs: &[VersionSpec],
) -> EngineResult<BTreeMap<String, Vec<(Id, VersionRecord)>>> {
    let mut out: BTreeMap<String, Vec<(Id, VersionRecord)>> = BTreeMap::new();
    if specs.is_empty() {
        for image in source.images().await? {
            let mut versions = history(source, &image).await?;
            versions.reverse();
            out.insert(image, versions);
        }
        return Ok(out);
    }
    for spec in specs {
        let mut chosen = match spec.reference {
            None => {
                let mut versions = history(source, &spec.image).await?;
                if versions.is_empty() {
                    return Err(EngineError::NotFound(format!(
                        "image {:?} has no versions in the source",
                        spec.image
                    )));
                }
                versions.reverse();
                versions
            }
            Some(_) => vec![resolve(source, spec).await?],
        };
        let list = out.entry(spec.image.clone()).or_default();
        list.append(&mut chosen);
        list.sort_by_key(|(_, r)| r.seq);
        list.dedup_by_key(|(id, _)| *id);
    }
    Ok(out)
}

/// Copies the versions `specs` names (all when empty) from `source` into `dest`.
pub async fn copy(
    source: Arc<Repo>,
    dest: Arc<Repo>,
    specs: &[VersionSpec],
    progress: Option<Arc<WorkProgress>>,
) -> EngineResult<CopyReport> {
    let selected = select(&source, specs).await?;
    let mut report = CopyReport::default();

    // Plan every image first (interior nodes only), so progress has a total.
    let mut plans = Vec::new();
    for (image, versions) in &selected {
        let plan = ImagePlan::new(&source, &dest, image, versions).await?;
        report.present += plan.present;
        plans.push(plan);
    }
    let total: u64 = plans.iter().map(|p| p.bytes_to_read).sum();
    progress::start(&progress, "copying versions", Unit::Bytes, total);

    let read = Arc::new(AtomicU64::new(0));
    for plan in plans {
        plan.run(&source, &dest, &progress, &read, &mut report)
            .await?;
    }
    report.read_bytes = read.load(Ordering::Relaxed);
    report.vms = crate::vm::copy::copy_vm_versions(&source, &dest).await?;
    Ok(report)
}

/// One image's versions in source order, each with its copy if the destination has one.
struct ImagePlan {
    image: String,
    steps: Vec<Step>,
    present: u64,
    bytes_to_read: u64,
}

struct Step {
    id: Id,
    record: VersionRecord,
    leaves: BTreeMap<u64, Id>,
    /// The destination's copy (id and record), once there is one.
    copy: Option<(Id, VersionRecord)>,
    /// Segments to read if it must be copied (against the previous step).
    changed: Vec<u64>,
    /// Why its tree cannot be read, if it cannot.
    damaged: Option<String>,
}

impl ImagePlan {
    async fn new(
        source: &Arc<Repo>,
        dest: &Repo,
        image: &str,
        versions: &[(Id, VersionRecord)],
    ) -> EngineResult<ImagePlan> {
        let existing: HashMap<CopyKey, (Id, VersionRecord)> = match dest.head(image).await? {
            None => HashMap::new(),
            Some(_) => history(dest, image)
                .await?
                .into_iter()
                .map(|(id, r)| (CopyKey::of(&r), (id, r)))
                .collect(),
        };
        let mut steps: Vec<Step> = Vec::with_capacity(versions.len());
        let (mut present, mut bytes_to_read) = (0, 0);
        for (id, record) in versions {
            // A version whose tree cannot be read is skipped when its turn comes (`run`);
            // the others are still copied.
            let (leaves, damaged) = match leaf_map(source, record).await {
                Ok(leaves) => (leaves, None),
                Err(e) if e.is_damage() => (BTreeMap::new(), Some(e.to_string())),
                Err(e) => return Err(e),
            };
            let copy = existing.get(&CopyKey::of(record)).cloned();
            let changed: Vec<u64> = match steps.last() {
                Some(prev) if same_geometry(&prev.record, record) => leaves
                    .keys()
                    .chain(prev.leaves.keys())
                    .filter(|s| leaves.get(s) != prev.leaves.get(s))
                    .copied()
                    .collect::<std::collections::BTreeSet<u64>>()
                    .into_iter()
                    .collect(),
                _ => leaves.keys().copied().collect(),
            };
            match copy {
                Some(_) => present += 1,
                None => {
                    bytes_to_read += changed.iter().map(|s| segment_len(record, *s)).sum::<u64>()
                }
            }
            steps.push(Step {
                id: *id,
                record: record.clone(),
                leaves,
                copy,
                changed,
                damaged,
            });
        }
        Ok(ImagePlan {
            image: image.to_string(),
            steps,
            present,
            bytes_to_read,
        })
    }

    async fn run(
        self,
        source: &Arc<Repo>,
        dest: &Arc<Repo>,
        progress: &Option<Arc<WorkProgress>>,
        read: &Arc<AtomicU64>,
        report: &mut CopyReport,
    ) -> EngineResult<()> {
        let mut copies: HashMap<Id, Id> = HashMap::new();
        let mut prev: Option<&Step> = None;
        let mut prev_copy: Option<(Id, VersionRecord)> = None;
        for step in &self.steps {
            crate::interrupt::check()?;
            let skip = |report: &mut CopyReport, why: String| {
                tracing::warn!(
                    "{}@{} cannot be read ({why}); not copied, going on with the rest",
                    self.image,
                    step.record.seq
                );
                report
                    .damaged
                    .push((self.image.clone(), step.record.seq, step.id, why));
            };
            if let (None, Some(why)) = (&step.copy, &step.damaged) {
                skip(report, why.clone());
                // The next version is read whole: its changed segments were planned
                // against this one.
                prev = None;
                continue;
            }
            let made = match &step.copy {
                Some(c) => c.clone(),
                None => {
                    // A base only if this step's segments were planned against it.
                    let base = prev
                        .filter(|p| same_geometry(&p.record, &step.record))
                        .and(prev_copy.clone());
                    let changed = match base {
                        Some(_) => step.changed.clone(),
                        None => step.leaves.keys().copied().collect(),
                    };
                    let blocks = VersionBlocks {
                        repo: source.clone(),
                        handle: Handle::current(),
                        record: &step.record,
                        leaves: &step.leaves,
                        changed,
                        read: read.clone(),
                        progress: progress.clone(),
                        damaged: AtomicBool::new(false),
                    };
                    let result = match commit_patch(
                        dest.clone(),
                        &self.image,
                        base,
                        step.record.logical_size,
                        &blocks,
                        PatchOptions {
                            message: step.record.message.clone(),
                            base_leaves: None,
                            time_ns: Some(step.record.time_ns),
                            // The repository's default, as a commit of the same data gets.
                            ..PatchOptions::default()
                        },
                    )
                    .await
                    {
                        Ok(result) => result,
                        Err(e) if e.is_damage() || blocks.damaged.load(Ordering::Relaxed) => {
                            skip(report, e.to_string());
                            prev = None;
                            continue;
                        }
                        Err(e) => return Err(e),
                    };
                    tracing::info!(
                        image = self.image,
                        from = step.record.seq,
                        to = result.record.seq,
                        "copied"
                    );
                    report.stored_bytes += result.record.stats.stored_bytes;
                    report.copied.push(CopiedVersion {
                        image: self.image.clone(),
                        source: step.id,
                        source_seq: step.record.seq,
                        id: result.id,
                        seq: result.record.seq,
                    });
                    (result.id, result.record)
                }
            };
            copies.insert(step.id, made.0);
            prev = Some(step);
            prev_copy = Some(made);
        }
        copy_tags(source, dest, &self.image, &copies, report).await?;
        copy_profile(source, dest, &self.image, report).await
    }
}

/// Gives `dest`'s `image` the source's boot profile (sealed under `dest`'s key) unless it has
/// one. A profile is a hint: one that cannot be read is left behind with a warning.
async fn copy_profile(
    source: &Repo,
    dest: &Repo,
    image: &str,
    report: &mut CopyReport,
) -> EngineResult<()> {
    let json = match source.boot_profile(image).await {
        Ok(Some(json)) => json,
        Ok(None) => return Ok(()),
        Err(e) => {
            tracing::warn!("the boot profile of {image} is not copied: {e}");
            return Ok(());
        }
    };
    if dest.boot_profile(image).await.ok().flatten().is_none() {
        dest.put_boot_profile(image, &json).await?;
        report.profiles_copied += 1;
    }
    Ok(())
}

/// Creates in `dest` the tags of `image` whose target has a copy; a tag of the same name that
/// names another version is left alone and reported.
async fn copy_tags(
    source: &Repo,
    dest: &Repo,
    image: &str,
    copies: &HashMap<Id, Id>,
    report: &mut CopyReport,
) -> EngineResult<()> {
    for (tag, target) in source.tags(image).await? {
        let Some(copy) = copies.get(&target) else {
            continue;
        };
        match dest.tag(image, &tag).await? {
            Some(existing) if existing == *copy => {}
            Some(_) => report.tags_conflicting.push(format!("{image}@{tag}")),
            None => {
                dest.create_tag(image, &tag, copy).await?;
                report.tags_created += 1;
            }
        }
    }
    Ok(())
}

/// Whether two versions cut the image into the same segments (then a segment whose leaf is
/// equal holds equal bytes, and only the others need reading).
fn same_geometry(a: &VersionRecord, b: &VersionRecord) -> bool {
    a.logical_size == b.logical_size && a.segment_size == b.segment_size
}

fn segment_len(record: &VersionRecord, segment: u64) -> u64 {
    let seg = u64::from(record.segment_size);
    seg.min(record.logical_size.saturating_sub(segment * seg))
}

/// A source version's segments as the changed blocks of a patch.
struct VersionBlocks<'a> {
    repo: Arc<Repo>,
    handle: Handle,
    record: &'a VersionRecord,
    leaves: &'a BTreeMap<u64, Id>,
    changed: Vec<u64>,
    read: Arc<AtomicU64>,
    progress: Option<Arc<WorkProgress>>,
    /// A read met damaged source data (the error reaching the commit is only an I/O one).
    damaged: AtomicBool,
}

impl PatchSource for VersionBlocks<'_> {
    fn block_size(&self) -> u32 {
        self.record.segment_size
    }

    fn changed_blocks(&self) -> Vec<u64> {
        self.changed.clone()
    }

    fn read_block(&self, index: u64) -> io::Result<Vec<u8>> {
        let len = segment_len(self.record, index);
        let data = match self.leaves.get(&index) {
            // A segment without a leaf is zeros.
            None => vec![0; len as usize],
            Some(leaf) => {
                self.handle
                    .block_on(read_segment(&self.repo, leaf, len))
                    .map_err(|e| {
                        if e.is_damage() {
                            self.damaged.store(true, Ordering::Relaxed);
                        }
                        io::Error::other(format!("source {}: {e}", self.describe()))
                    })?
                    .0
            }
        };
        self.read.fetch_add(len, Ordering::Relaxed);
        progress::add(&self.progress, len);
        Ok(data)
    }
}

impl VersionBlocks<'_> {
    fn describe(&self) -> String {
        format!("{}@{}", self.record.image, self.record.seq)
    }
}

//! Which versions are alive: reachable from an image head or a tag, and not deleted.
//!
//! Parent chains are followed through deleted versions (their records stay as links), so an
//! image's history survives the deletion of versions in the middle, and a clone keeps its
//! origin even after the origin image is removed.
//!
//! **Damaged metadata never blocks this walk.** A head or tag that cannot be decoded, or a
//! version record that is missing or fails its checksum, is recorded as a finding
//! ([`LiveVersions::damage`]) and the walk goes on. Because a broken link hides the versions
//! behind it, the image it belongs to falls back to a conservative answer: every readable,
//! undeleted record of that image counts as live. Over-keeping in a damaged repository costs
//! space until `cairn repair`; under-keeping would lose intact versions.

use bytes::Bytes;
use cairn_format::keys;
use std::collections::{BTreeSet, HashMap};

use cairn_format::id_hash::{IdMap, IdSet};
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::{Damaged, Repo, RepoError};

use crate::error::EngineResult;

#[derive(Debug, Default, Clone)]
pub struct LiveVersions {
    /// Live versions: reachable and not deleted.
    pub live: IdMap<VersionRecord>,
    /// Versions marked deleted (whether reachable or not).
    pub deleted: IdSet,
    /// Version ids named by tags, with the tag's ref key.
    pub tagged: HashMap<Id, Vec<String>>,
    /// Every version record reached from a head or a tag, live or deleted.
    pub reachable: IdSet,
    /// Damaged metadata met on the way, one finding per object.
    pub damage: Vec<Damaged>,
    /// Images whose history is broken by that damage (their records were all kept live).
    pub broken_images: BTreeSet<String>,
    /// Undeleted records no ref reaches that were (or may have been) published: counted
    /// live and reachable above, so that nothing deletes them or their data unasked.
    pub strays: Vec<Stray>,
    /// Undeleted records no ref reaches that a commit (or clone) wrote and never published:
    /// it lost its ref race or was killed before the swap. GC deletes them once older than
    /// every live session.
    pub unpublished: IdMap<VersionRecord>,
    /// Heads that name a version of another image, as (image, the version's image, id).
    pub misdirected_heads: Vec<(String, String, Id)>,
}

/// A version record no ref reaches that was published, or may have been.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stray {
    pub id: Id,
    pub image: String,
    pub seq: u64,
    /// Provably published: another record names it as its parent (a commit builds on a
    /// published head only), or its image's head names a version of another image, or its
    /// parent is not reachable either. Otherwise it is the lone record of an image that has
    /// no head: a first commit killed before it published, or the head of a one-version image
    /// lost.
    pub provable: bool,
}

/// One line per image for the strays of `strays` (sorted by image and sequence): whether any
/// of them is provably published, and what to say.
pub fn describe_strays(strays: &[Stray]) -> Vec<(bool, String)> {
    let mut out = Vec::new();
    for group in strays.chunk_by(|a, b| a.image == b.image) {
        let image = &group[0].image;
        let seqs: Vec<String> = group.iter().map(|s| format!("@{}", s.seq)).collect();
        let versions = match seqs.len() {
            1 => format!("version {image}@{} ({})", group[0].seq, group[0].id.short()),
            n => format!("{n} versions of {image} ({})", seqs.join(", ")),
        };
        let provable = group.iter().any(|s| s.provable);
        out.push((
            provable,
            match provable {
                true => format!(
                    "{versions} were published but no ref reaches them: the image's head was \
                     lost or moved back; `cairn repair` points it at the newest"
                ),
                false => format!(
                    "{versions} is reached by no ref: a first commit killed before it \
                     published, or the head of a one-version image lost; `cairn repair` \
                     publishes it"
                ),
            },
        ));
    }
    out
}

/// Where a walk reads version records: from their own keys, or first from records already
/// at hand (a GC's record bundle, and what this source read before). Records are immutable
/// and named by the hash of their stored bytes, so one at hand is checked exactly as one read,
/// and one opened once (checked and decoded) need not be opened again: a GC walks history
/// twice, and each record is opened once.
#[derive(Default)]
pub struct RecordSource {
    known: IdMap<Bytes>,
    opened: IdMap<VersionRecord>,
    /// Records read from their own keys.
    pub read: u64,
}

impl RecordSource {
    /// A source holding `known` (stored bytes by id) at hand.
    pub fn with(known: impl IntoIterator<Item = (Id, Bytes)>) -> RecordSource {
        let known: IdMap<Bytes> = known.into_iter().collect();
        RecordSource {
            opened: IdMap::with_capacity_and_hasher(known.len(), Default::default()),
            known,
            read: 0,
        }
    }

    /// The stored bytes at hand of record `id`.
    pub fn stored(&self, id: &Id) -> Option<&Bytes> {
        self.known.get(id)
    }

    /// Reads and checks record `id`, from what is at hand when it is there.
    pub async fn load(&mut self, repo: &Repo, id: &Id) -> Result<VersionRecord, RepoError> {
        if let Some(record) = self.opened.get(id) {
            return Ok(record.clone());
        }
        if let Some(stored) = self.known.get(id) {
            match repo.open_version(id, stored) {
                Ok(record) => {
                    self.opened.insert(*id, record.clone());
                    return Ok(record);
                }
                // Bytes that match the id yet do not open (sealed with another key): read
                // the record's own key instead.
                Err(_) => {
                    self.known.remove(id);
                }
            }
        }
        let stored = repo.load_version_stored(id).await?;
        self.read += 1;
        let record = repo.open_version(id, &stored)?;
        self.known.insert(*id, stored);
        self.opened.insert(*id, record.clone());
        Ok(record)
    }

    /// A version record, or `Ok(None)` with the finding pushed to `damage` when it is
    /// damaged or missing. Errors of the store itself (unreachable, denied) still fail: they
    /// say nothing about the data.
    pub async fn load_or_report(
        &mut self,
        repo: &Repo,
        id: &Id,
        damage: &mut Vec<Damaged>,
    ) -> EngineResult<Option<VersionRecord>> {
        match self.load(repo, id).await {
            Ok(record) => Ok(Some(record)),
            // A record `cairn repair` already found lost is a known break, not new damage.
            Err(RepoError::VersionMissing { .. }) if repo.is_known_lost_version(id).await? => {
                Ok(None)
            }
            Err(e) if e.is_damage() => {
                let finding = Damaged {
                    key: keys::version(id),
                    problem: match e {
                        RepoError::VersionMissing { .. } => "missing".to_string(),
                        RepoError::Corrupt { source, .. } => source.to_string(),
                        other => other.to_string(),
                    },
                };
                if !damage.contains(&finding) {
                    damage.push(finding);
                }
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }
}

/// [`RecordSource::load_or_report`], reading the record from its own key.
pub async fn load_or_report(
    repo: &Repo,
    id: &Id,
    damage: &mut Vec<Damaged>,
) -> EngineResult<Option<VersionRecord>> {
    RecordSource::default()
        .load_or_report(repo, id, damage)
        .await
}

/// Walks every head and tag down its parent chain.
pub async fn live_versions(repo: &Repo) -> EngineResult<LiveVersions> {
    live_versions_from(repo, &mut RecordSource::default()).await
}

/// [`live_versions`], reading records through `records`.
pub async fn live_versions_from(
    repo: &Repo,
    records: &mut RecordSource,
) -> EngineResult<LiveVersions> {
    let deleted = repo.deleted_versions().await?;
    let mut damage = Vec::new();
    let mut broken: BTreeSet<String> = BTreeSet::new();
    // (root version, the image whose chain it starts)
    let mut roots: Vec<(Id, String)> = Vec::new();
    let (images, bad_heads) = repo.images_checked().await?;
    damage.extend(bad_heads);
    for image in images {
        match repo.head(&image).await {
            Ok(Some(h)) => roots.push((h.version, image)),
            Ok(None) => {}
            Err(RepoError::Corrupt { key, source })
                if !matches!(source, cairn_format::FormatError::TooNew { .. }) =>
            {
                damage.push(Damaged {
                    key,
                    problem: source.to_string(),
                });
                broken.insert(image);
            }
            Err(e) => return Err(e.into()),
        }
    }
    // Images whose head names a record of the image itself (a clone's first record is its
    // own, with the source as parent), found after the walk.
    let heads = roots.clone();
    let mut tagged: HashMap<Id, Vec<String>> = HashMap::new();
    let (tags, bad_tags) = repo.all_tag_targets_checked().await?;
    for d in bad_tags {
        if let Some(image) = tag_image(&d.key) {
            broken.insert(image);
        }
        damage.push(d);
    }
    for (key, id) in tags {
        let image = tag_image(&format!("refs/{key}")).unwrap_or_default();
        roots.push((id, image));
        tagged.entry(id).or_default().push(key);
    }
    let mut reachable = IdSet::default();
    let mut live = IdMap::default();
    for (root, image) in roots {
        let mut cur = Some(root);
        let mut chain_image = image;
        while let Some(id) = cur {
            if !reachable.insert(id) {
                break;
            }
            let Some(record) = records.load_or_report(repo, &id, &mut damage).await? else {
                reachable.remove(&id);
                broken.insert(chain_image.clone());
                break;
            };
            cur = record.parent;
            chain_image = record.image.clone();
            if !deleted.contains(&id) {
                live.insert(id, record);
            }
        }
    }
    if !broken.is_empty() {
        for (id, record) in records_of(repo, records, &broken, &mut damage).await? {
            reachable.insert(id);
            if !deleted.contains(&id) {
                live.insert(id, record);
            }
        }
    }
    let headed: BTreeSet<String> = heads.iter().map(|(_, image)| image.clone()).collect();
    let mut sound_heads: BTreeSet<String> = BTreeSet::new();
    let mut misdirected_heads = Vec::new();
    for (id, image) in heads {
        match records.load(repo, &id).await {
            Ok(r) if r.image == image => {
                sound_heads.insert(image);
            }
            Ok(r) => misdirected_heads.push((image, r.image, id)),
            Err(_) => {} // reported by the walk
        }
    }
    let mut out = LiveVersions {
        live,
        deleted,
        tagged,
        reachable,
        damage,
        broken_images: broken,
        strays: Vec::new(),
        unpublished: IdMap::default(),
        misdirected_heads,
    };
    judge_unreached(repo, records, &headed, &sound_heads, &mut out).await?;
    Ok(out)
}

/// Lists every version record and judges the undeleted ones no ref reaches: a record is an
/// unpublished commit's only when nothing says otherwise — no record names it as parent,
/// its image has a sound head, and its parent is reachable (or it has none); every other is
/// a [`Stray`], kept live. A lost or moved head thus costs a report, never a version.
async fn judge_unreached(
    repo: &Repo,
    records: &mut RecordSource,
    headed: &BTreeSet<String>,
    sound_heads: &BTreeSet<String>,
    out: &mut LiveVersions,
) -> EngineResult<()> {
    let mut unreached: Vec<(Id, VersionRecord)> = Vec::new();
    for id in repo.version_record_ids().await?.into_iter().flatten() {
        if out.reachable.contains(&id) || out.deleted.contains(&id) {
            continue;
        }
        if let Some(record) = records.load_or_report(repo, &id, &mut out.damage).await? {
            unreached.push((id, record));
        }
    }
    let parents: IdSet = unreached.iter().filter_map(|(_, r)| r.parent).collect();
    let reached_by_refs = out.reachable.clone();
    let mut strays = Vec::new();
    for (id, record) in unreached {
        let parent_reachable = record.parent.is_none_or(|p| reached_by_refs.contains(&p));
        let is_parent = parents.contains(&id);
        if !is_parent && parent_reachable && sound_heads.contains(&record.image) {
            out.unpublished.insert(id, record);
            continue;
        }
        strays.push(Stray {
            id,
            image: record.image.clone(),
            seq: record.seq,
            provable: is_parent || !parent_reachable || headed.contains(&record.image),
        });
        out.reachable.insert(id);
        out.live.insert(id, record);
    }
    strays.sort_by(|a, b| (&a.image, a.seq).cmp(&(&b.image, b.seq)));
    out.strays = strays;
    Ok(())
}

/// Every readable version record of the given images (a listing of all records: only done
/// when damage broke a history). Unreadable records are reported in `damage`.
pub async fn records_of(
    repo: &Repo,
    records: &mut RecordSource,
    images: &BTreeSet<String>,
    damage: &mut Vec<Damaged>,
) -> EngineResult<Vec<(Id, VersionRecord)>> {
    let mut out = Vec::new();
    for id in repo.version_record_ids().await?.into_iter().flatten() {
        if let Some(record) = records.load_or_report(repo, &id, damage).await? {
            if images.contains(&record.image) {
                out.push((id, record));
            }
        }
    }
    Ok(out)
}

/// The image a tag ref key (`refs/tags/<escaped image>/<tag>`) belongs to.
fn tag_image(key: &str) -> Option<String> {
    let rest = key.strip_prefix("refs/")?.strip_prefix(keys::TAGS)?;
    let (escaped, _) = rest.split_once('/')?;
    cairn_format::name::unescape(escaped).ok()
}

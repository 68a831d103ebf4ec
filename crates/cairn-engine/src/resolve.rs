//! Naming versions: `IMAGE`, `IMAGE@N`, `IMAGE@<hex prefix>`; and walking an image's history.

use cairn_format::id_hash::IdSet;

use cairn_format::id::is_hex_prefix;
use cairn_format::name::validate_image_name;
use cairn_format::refs::validate_tag_name;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::{Damaged, Repo, RepoError};

use crate::error::{EngineError, EngineResult};
use crate::live::{load_or_report, records_of};

/// The shortest run of digits that may be an id prefix when no version has it as its sequence
/// number (`log` prints 12 hex digits; 8 is still far above any real sequence number).
pub const MIN_DIGIT_ID_PREFIX: usize = 8;

/// A parsed `IMAGE[@REF]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionSpec {
    pub image: String,
    pub reference: Option<String>,
}

impl VersionSpec {
    pub fn parse(spec: &str) -> EngineResult<Self> {
        let (image, reference) = match spec.split_once('@') {
            Some((i, r)) => (i, Some(r.to_string())),
            None => (spec, None),
        };
        validate_image_name(image)?;
        if reference.as_deref() == Some("") {
            return Err(EngineError::BadInput(format!(
                "{spec:?}: empty reference after '@'"
            )));
        }
        Ok(VersionSpec {
            image: image.to_string(),
            reference,
        })
    }
}

impl std::fmt::Display for VersionSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.reference {
            Some(r) => write!(f, "{}@{r}", self.image),
            None => f.write_str(&self.image),
        }
    }
}

/// Finds the version a spec names. A reference of up to 12 digits is a sequence number
/// (1 = the image's first version); otherwise a tag of the image, or else a hex prefix of a
/// version id. No reference means the newest version that is not deleted.
/// Deleted versions cannot be named.
///
/// One in ~110 ids starts with 10 decimal digits, so a copied id prefix can look like a
/// sequence number: a run of at least [`MIN_DIGIT_ID_PREFIX`] digits that is no version's
/// sequence number is tried as an id prefix. Shorter runs are only ever sequence numbers, so
/// `vm@7` never silently names some other version whose id starts with 7.
pub async fn resolve(repo: &Repo, spec: &VersionSpec) -> EngineResult<(Id, VersionRecord)> {
    let deleted = repo.deleted_versions().await?;
    let (id, record) = resolve_including_deleted(repo, spec, &deleted).await?;
    if deleted.contains(&id) {
        return Err(EngineError::NotFound(format!(
            "{spec}: version {}@{} ({}) was deleted",
            record.image,
            record.seq,
            id.short()
        )));
    }
    Ok((id, record))
}

async fn resolve_including_deleted(
    repo: &Repo,
    spec: &VersionSpec,
    deleted: &IdSet,
) -> EngineResult<(Id, VersionRecord)> {
    let Some(reference) = &spec.reference else {
        return newest_live(repo, &spec.image, deleted).await;
    };
    // A damaged head still lets versions be named: they are then found by listing.
    let head = match repo.head(&spec.image).await {
        Ok(Some(h)) => Some(h.version),
        Ok(None) => return Err(unknown_image(repo, &spec.image).await),
        Err(e) if e.is_damage() => None,
        Err(e) => return Err(e.into()),
    };
    // Up to 12 digits is a sequence number; a longer run of digits can only be an id prefix.
    if reference.len() <= 12 && reference.bytes().all(|b| b.is_ascii_digit()) {
        let seq: u64 = reference
            .parse()
            .map_err(|_| EngineError::BadInput(format!("{spec}: sequence number too large")))?;
        let chain = chain_of(repo, &spec.image, head, seq).await?;
        let newest = chain.versions.first().map(|(_, r)| r.seq);
        if let Some((id, record)) = chain.versions.into_iter().find(|(_, r)| r.seq == seq) {
            return Ok((id, record));
        }
        if reference.len() >= MIN_DIGIT_ID_PREFIX {
            let mut matches = versions_with_id_prefix(repo, &spec.image, reference).await?;
            match matches.len() {
                0 => {}
                1 => return Ok(matches.pop().expect("one")),
                n => return Err(ambiguous_prefix(spec, n)),
            }
            return Err(EngineError::NotFound(format!(
                "{spec}: image {:?} has no version {seq} and no version of it has an id starting with {reference}",
                spec.image
            )));
        }
        let newest = match newest {
            Some(n) if n < seq => format!(" (its newest is {}@{n})", spec.image),
            _ => String::new(),
        };
        return Err(EngineError::NotFound(format!(
            "{spec}: image {:?} has no version {seq}{newest}",
            spec.image
        )));
    }
    if validate_tag_name(reference).is_ok() {
        if let Some(id) = repo.tag(&spec.image, reference).await? {
            let record = repo.load_version(&id).await?;
            return Ok((id, record));
        }
    }
    if !is_hex_prefix(reference) {
        return Err(EngineError::NotFound(format!(
            "{spec}: no tag {reference:?}; a reference is a version number, a tag, or a hex prefix of a version id"
        )));
    }
    let mut matches = versions_with_id_prefix(repo, &spec.image, reference).await?;
    match matches.len() {
        1 => Ok(matches.pop().expect("one")),
        0 => Err(EngineError::NotFound(format!(
            "{spec}: no tag {reference:?} and no version of {:?} has an id starting with {reference}",
            spec.image
        ))),
        n => Err(ambiguous_prefix(spec, n)),
    }
}

/// The error for an image that does not exist, naming the closest existing one (a typo).
async fn unknown_image(repo: &Repo, image: &str) -> EngineError {
    // Listing is best effort: the error is about the name, not the listing.
    let images = repo.images().await.unwrap_or_default();
    let closest = images
        .iter()
        .map(|name| (strsim::jaro_winkler(image, name), name))
        .filter(|(score, _)| *score > 0.8)
        .max_by(|a, b| a.0.total_cmp(&b.0));
    match closest {
        Some((_, name)) => EngineError::NotFound(format!(
            "image {image:?} does not exist; did you mean {name:?}?"
        )),
        None => EngineError::NotFound(format!("image {image:?} does not exist")),
    }
}

/// The versions of `image` whose id starts with the hex `prefix`.
async fn versions_with_id_prefix(
    repo: &Repo,
    image: &str,
    prefix: &str,
) -> EngineResult<Vec<(Id, VersionRecord)>> {
    let mut matches = Vec::new();
    let mut damage = Vec::new();
    for id in repo.versions_with_prefix(prefix).await? {
        if let Some(record) = load_or_report(repo, &id, &mut damage).await? {
            if record.image == image {
                matches.push((id, record));
            }
        }
    }
    Ok(matches)
}

fn ambiguous_prefix(spec: &VersionSpec, n: usize) -> EngineError {
    EngineError::BadInput(format!("{spec}: {n} versions match; use a longer prefix"))
}

/// The live versions of an image, newest first, following parents while they belong to the
/// image (deleted versions are skipped but their links followed). Damaged metadata on the way
/// (see [`history_checked`]) is logged as a warning, and what could be found is returned.
pub async fn history(repo: &Repo, image: &str) -> EngineResult<Vec<(Id, VersionRecord)>> {
    let h = history_checked(repo, image).await?;
    for d in &h.damage {
        tracing::warn!(
            "history of {image:?} is damaged: {d}; run `cairn repair` (versions found by listing are shown)"
        );
    }
    Ok(h.versions)
}

/// An image's history as far as it can be read.
#[derive(Debug, Clone, Default)]
pub struct History {
    /// Live versions, newest first.
    pub versions: Vec<(Id, VersionRecord)>,
    /// Damaged metadata that broke the walk (the head, or a version record). Versions past
    /// the break were found by listing every record of the image.
    pub damage: Vec<Damaged>,
}

/// [`history`], with the damage that broke it, if any.
pub async fn history_checked(repo: &Repo, image: &str) -> EngineResult<History> {
    let deleted = repo.deleted_versions().await?;
    history_with(repo, image, &deleted).await
}

/// The newest version of `image` that is not deleted: down the parent chain from the head,
/// reading only the records down to it, so naming `IMAGE` costs the same at 10 versions and
/// at 1,000 (it read the whole history before: an export's start took 3.6× longer at 1,000
/// versions, BENCHMARKS.md, *Scaling with image size and history*). A head or record on the way that cannot be read
/// is an error ([`EngineError::NewestUnreadable`]): an older version is never used silently
/// in place of the newest. Past a record `cairn repair` recorded as lost, [`history_with`]
/// lists the image's records.
async fn newest_live(
    repo: &Repo,
    image: &str,
    deleted: &IdSet,
) -> EngineResult<(Id, VersionRecord)> {
    validate_image_name(image)?;
    let none_left = || EngineError::NotFound(format!("image {image:?} has no versions left"));
    let whole_history = || async {
        history_with(repo, image, deleted)
            .await?
            .versions
            .into_iter()
            .next()
            .ok_or_else(none_left)
    };
    let unreadable = |reason: String| EngineError::NewestUnreadable {
        image: image.to_string(),
        reason,
    };
    let mut id = match repo.head(image).await {
        Ok(Some(h)) => Some(h.version),
        Ok(None) => return Err(unknown_image(repo, image).await),
        Err(e) if e.is_damage() => return Err(unreadable(e.to_string())),
        Err(e) => return Err(e.into()),
    };
    while let Some(cur) = id {
        let mut damage = Vec::new();
        let Some(record) = load_or_report(repo, &cur, &mut damage).await? else {
            // A record `cairn repair` already found lost is a known break: the newest live
            // version is then past it. Any other is new damage, and the newest unknown.
            return match damage.into_iter().next() {
                None => whole_history().await,
                Some(d) => Err(unreadable(d.to_string())),
            };
        };
        if record.image != image {
            break; // the origin of a clone: not this image's
        }
        if !deleted.contains(&cur) {
            return Ok((cur, record));
        }
        id = record.parent;
    }
    Err(none_left())
}

async fn history_with(repo: &Repo, image: &str, deleted: &IdSet) -> EngineResult<History> {
    validate_image_name(image)?;
    let head = match repo.head(image).await {
        Ok(Some(h)) => Some(h.version),
        Ok(None) => return Err(unknown_image(repo, image).await),
        Err(RepoError::Corrupt { key, source })
            if !matches!(source, cairn_format::FormatError::TooNew { .. }) =>
        {
            let mut h = chain_of(repo, image, None, 0).await?;
            h.damage.insert(
                0,
                Damaged {
                    key,
                    problem: source.to_string(),
                },
            );
            h.versions.retain(|(id, _)| !deleted.contains(id));
            return Ok(h);
        }
        Err(e) => return Err(e.into()),
    };
    let mut h = chain_of(repo, image, head, 0).await?;
    h.versions.retain(|(id, _)| !deleted.contains(id));
    Ok(h)
}

/// Every version of `image` (deleted ones included) from `head` down its parent chain, newest
/// first, down to sequence number `down_to` (0: all). Where the chain breaks (a damaged or
/// missing record, or no readable head: `None`), the image's older records are found by
/// listing instead.
async fn chain_of(
    repo: &Repo,
    image: &str,
    head: Option<Id>,
    down_to: u64,
) -> EngineResult<History> {
    let mut out = History::default();
    let mut id = head;
    let mut broken = head.is_none();
    while let Some(cur) = id {
        let Some(record) = load_or_report(repo, &cur, &mut out.damage).await? else {
            broken = true;
            break;
        };
        if record.image != image {
            break;
        }
        id = record.parent;
        let done = record.seq <= down_to;
        out.versions.push((cur, record));
        if done {
            break;
        }
    }
    if broken {
        let below = out.versions.last().map_or(u64::MAX, |(_, r)| r.seq);
        let have: IdSet = out.versions.iter().map(|(id, _)| *id).collect();
        let images = std::collections::BTreeSet::from([image.to_string()]);
        let mut found: Vec<(Id, VersionRecord)> =
            records_of(repo, &mut Default::default(), &images, &mut out.damage)
                .await?
                .into_iter()
                .filter(|(id, r)| r.seq < below && !have.contains(id))
                .collect();
        found.sort_by_key(|(_, r)| std::cmp::Reverse((r.seq, r.time_ns)));
        out.versions.extend(found);
    }
    Ok(out)
}

/// Where an image's history starts: the version of another image it was cloned from.
/// A history broken by damage has no known origin (`None`).
pub async fn origin(repo: &Repo, image: &str) -> EngineResult<Option<(Id, VersionRecord)>> {
    let head = match repo.head(image).await {
        Ok(Some(h)) => h,
        Ok(None) => return Err(unknown_image(repo, image).await),
        Err(e) if e.is_damage() => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    let mut id = Some(head.version);
    let mut damage = Vec::new();
    while let Some(cur) = id {
        let Some(record) = load_or_report(repo, &cur, &mut damage).await? else {
            return Ok(None);
        };
        if record.image != image {
            return Ok(Some((cur, record)));
        }
        id = record.parent;
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_specs() {
        let s = VersionSpec::parse("web01/disk0@3").unwrap();
        assert_eq!(
            (s.image.as_str(), s.reference.as_deref()),
            ("web01/disk0", Some("3"))
        );
        assert!(VersionSpec::parse("a@").is_err());
        assert!(VersionSpec::parse("../x").is_err());
        assert_eq!(VersionSpec::parse("vm").unwrap().reference, None);
    }
}

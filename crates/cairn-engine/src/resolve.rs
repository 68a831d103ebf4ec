//! Naming versions: `IMAGE`, `IMAGE@N`, `IMAGE@<hex prefix>`; and walking an image's history.

use std::collections::HashSet;

use cairn_format::id::is_hex_prefix;
use cairn_format::name::validate_image_name;
use cairn_format::refs::validate_tag_name;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::Repo;

use crate::error::{EngineError, EngineResult};

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
            return Err(EngineError::BadRef(format!(
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
        return Err(EngineError::BadRef(format!(
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
    deleted: &HashSet<Id>,
) -> EngineResult<(Id, VersionRecord)> {
    let Some(reference) = &spec.reference else {
        return history_with(repo, &spec.image, deleted)
            .await?
            .into_iter()
            .next()
            .ok_or_else(|| {
                EngineError::BadRef(format!("image {:?} has no versions left", spec.image))
            });
    };
    let head = repo
        .head(&spec.image)
        .await?
        .ok_or_else(|| EngineError::BadRef(format!("image {:?} does not exist", spec.image)))?;
    // Up to 12 digits is a sequence number; a longer run of digits can only be an id prefix.
    if reference.len() <= 12 && reference.bytes().all(|b| b.is_ascii_digit()) {
        let seq: u64 = reference
            .parse()
            .map_err(|_| EngineError::BadRef(format!("{spec}: sequence number too large")))?;
        let mut id = Some(head.version);
        while let Some(cur) = id {
            let record = repo.load_version(&cur).await?;
            if record.image != spec.image || record.seq < seq {
                break;
            }
            if record.seq == seq {
                return Ok((cur, record));
            }
            id = record.parent;
        }
        if reference.len() >= MIN_DIGIT_ID_PREFIX {
            let mut matches = versions_with_id_prefix(repo, &spec.image, reference).await?;
            match matches.len() {
                0 => {}
                1 => return Ok(matches.pop().expect("one")),
                n => return Err(ambiguous_prefix(spec, n)),
            }
            return Err(EngineError::BadRef(format!(
                "{spec}: image {:?} has no version {seq} and no version of it has an id starting with {reference}",
                spec.image
            )));
        }
        return Err(EngineError::BadRef(format!(
            "{spec}: image {:?} has no version {seq}",
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
        return Err(EngineError::BadRef(format!(
            "{spec}: no tag {reference:?}; a reference is a version number, a tag, or a hex prefix of a version id"
        )));
    }
    let mut matches = versions_with_id_prefix(repo, &spec.image, reference).await?;
    match matches.len() {
        1 => Ok(matches.pop().expect("one")),
        0 => Err(EngineError::BadRef(format!(
            "{spec}: no tag {reference:?} and no version of {:?} has an id starting with {reference}",
            spec.image
        ))),
        n => Err(ambiguous_prefix(spec, n)),
    }
}

/// The versions of `image` whose id starts with the hex `prefix`.
async fn versions_with_id_prefix(
    repo: &Repo,
    image: &str,
    prefix: &str,
) -> EngineResult<Vec<(Id, VersionRecord)>> {
    let mut matches = Vec::new();
    for id in repo.versions_with_prefix(prefix).await? {
        let record = repo.load_version(&id).await?;
        if record.image == image {
            matches.push((id, record));
        }
    }
    Ok(matches)
}

fn ambiguous_prefix(spec: &VersionSpec, n: usize) -> EngineError {
    EngineError::BadRef(format!("{spec}: {n} versions match; use a longer prefix"))
}

/// The live versions of an image, newest first, following parents while they belong to the
/// image (deleted versions are skipped but their links followed).
pub async fn history(repo: &Repo, image: &str) -> EngineResult<Vec<(Id, VersionRecord)>> {
    let deleted = repo.deleted_versions().await?;
    history_with(repo, image, &deleted).await
}

async fn history_with(
    repo: &Repo,
    image: &str,
    deleted: &HashSet<Id>,
) -> EngineResult<Vec<(Id, VersionRecord)>> {
    validate_image_name(image)?;
    let head = repo
        .head(image)
        .await?
        .ok_or_else(|| EngineError::BadRef(format!("image {image:?} does not exist")))?;
    let mut out = Vec::new();
    let mut id = Some(head.version);
    while let Some(cur) = id {
        let record = repo.load_version(&cur).await?;
        if record.image != image {
            break;
        }
        id = record.parent;
        if !deleted.contains(&cur) {
            out.push((cur, record));
        }
    }
    Ok(out)
}

/// Where an image's history starts: the version of another image it was cloned from.
pub async fn origin(repo: &Repo, image: &str) -> EngineResult<Option<(Id, VersionRecord)>> {
    let head = repo
        .head(image)
        .await?
        .ok_or_else(|| EngineError::BadRef(format!("image {image:?} does not exist")))?;
    let mut id = Some(head.version);
    while let Some(cur) = id {
        let record = repo.load_version(&cur).await?;
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

//! Which versions are alive: reachable from an image head or a tag, and not deleted.
//!
//! Parent chains are followed through deleted versions (their records stay as links), so an
//! image's history survives the deletion of versions in the middle, and a clone keeps its
//! origin even after the origin image is removed.

use std::collections::{HashMap, HashSet};

use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::Repo;

use crate::error::EngineResult;

#[derive(Debug, Default, Clone)]
pub struct LiveVersions {
    /// Live versions: reachable and not deleted.
    pub live: HashMap<Id, VersionRecord>,
    /// Versions marked deleted (whether reachable or not).
    pub deleted: HashSet<Id>,
    /// Version ids named by tags, with the tag's ref key.
    pub tagged: HashMap<Id, Vec<String>>,
}

/// Walks every head and tag down its parent chain.
pub async fn live_versions(repo: &Repo) -> EngineResult<LiveVersions> {
    let deleted = repo.deleted_versions().await?;
    let mut roots = Vec::new();
    for image in repo.images().await? {
        if let Some(h) = repo.head(&image).await? {
            roots.push(h.version);
        }
    }
    let mut tagged: HashMap<Id, Vec<String>> = HashMap::new();
    for (key, id) in repo.all_tag_targets().await? {
        roots.push(id);
        tagged.entry(id).or_default().push(key);
    }
    let mut seen = HashSet::new();
    let mut live = HashMap::new();
    for root in roots {
        let mut cur = Some(root);
        while let Some(id) = cur {
            if !seen.insert(id) {
                break;
            }
            let record = repo.load_version(&id).await?;
            cur = record.parent;
            if !deleted.contains(&id) {
                live.insert(id, record);
            }
        }
    }
    Ok(LiveVersions {
        live,
        deleted,
        tagged,
    })
}

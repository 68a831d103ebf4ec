//! Choosing how a commit is made: in full, or incrementally on top of a parent version when
//! the source can say what changed since it.
//!
//! - A qcow2 overlay whose backing layer holds a known version commits only the overlay's
//!   clusters (CloudVS §3.6). Which layer holds which version is known from the caller's
//!   records ([`KnownVersions`]: the CLI remembers what it committed and restored) or from an
//!   explicit parent, which then is the overlay's direct backing file.
//! - An NBD export read with a dirty bitmap commits the bitmap's extents on top of the parent
//!   (given, or else the image's newest version).
//! - Anything else is committed in full.
//!
//! The premise of every incremental plan — outside the changed extents the source holds the
//! parent's bytes — is checked where it can be (the backing layer's size must be the parent's)
//! and otherwise vouched for by the caller (see [`super::incremental`]).

use std::path::Path;
use std::sync::Arc;

use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_image::{DiskImage, Layer};
use cairn_repo::Repo;

use super::incremental::{commit_changes, layer_changes, Changes, IncrementalStats};
use super::{commit, CommitOptions, CommitResult};
use crate::error::{EngineError, EngineResult};
use crate::resolve::{resolve, VersionSpec};
use crate::source::{ImageSource, Source};

/// A commit's source, opened.
pub enum CommitSource {
    /// A stream (standard input): always committed in full.
    Stream(Box<dyn Source>),
    /// A local file or device, possibly a qcow2 overlay.
    Local(Arc<dyn DiskImage>),
    /// An NBD export, with the extents and name of its dirty bitmap when one was read.
    Nbd {
        image: Arc<dyn DiskImage>,
        dirty: Option<(String, Vec<(u64, u64)>)>,
    },
}

/// How the version will be made.
pub enum CommitPlan {
    Full(Box<dyn Source>),
    Incremental {
        image: Arc<dyn DiskImage>,
        parent: Box<(Id, VersionRecord)>,
        changed: Changes,
        /// Why this parent, for the caller's summary ("dirty bitmap b0 since vm@3").
        because: String,
    },
}

/// What a planned commit published and read.
#[derive(Debug, Clone)]
pub struct PlannedCommit {
    pub result: CommitResult,
    /// For an incremental commit: what it read, and why that parent.
    pub incremental: Option<(IncrementalStats, String)>,
    /// Bytes read from the source.
    pub read_bytes: u64,
}

/// Makes the version `plan` describes: a full commit (progress in `options.progress`) or
/// an incremental one on top of the plan's parent.
pub async fn commit_planned(
    repo: Arc<Repo>,
    image: &str,
    plan: CommitPlan,
    options: CommitOptions,
) -> EngineResult<PlannedCommit> {
    match plan {
        CommitPlan::Full(source) => {
            let progress = options.progress.clone().unwrap_or_default();
            let options = CommitOptions {
                progress: Some(progress.clone()),
                ..options
            };
            let result = commit(repo, image, source, options).await?;
            Ok(PlannedCommit {
                result,
                incremental: None,
                read_bytes: progress.read.load(std::sync::atomic::Ordering::Relaxed),
            })
        }
        CommitPlan::Incremental {
            image: source,
            parent,
            changed,
            because,
        } => {
            let (result, stats) = commit_changes(
                repo,
                image,
                *parent,
                source,
                &changed,
                &options.message,
                options.dedup,
            )
            .await?;
            Ok(PlannedCommit {
                result,
                read_bytes: stats.read_bytes,
                incremental: Some((stats, because)),
            })
        }
    }
}

/// Which version a file was last found to hold (by the caller's records), if any.
pub trait KnownVersions {
    fn lookup(&self, path: &Path) -> Option<Id>;
}

/// No records: an overlay commits incrementally only with an explicit parent.
pub struct NoRecords;

impl KnownVersions for NoRecords {
    fn lookup(&self, _: &Path) -> Option<Id> {
        None
    }
}

/// Plans the commit of `source` as a new version of `image`; `parent` is the version the
/// caller named as the parent, if any.
pub async fn plan_commit(
    repo: &Arc<Repo>,
    image: &str,
    source: CommitSource,
    parent: Option<(Id, VersionRecord)>,
    known: &dyn KnownVersions,
) -> EngineResult<CommitPlan> {
    match source {
        CommitSource::Stream(source) => {
            if parent.is_some() {
                return Err(bad("a parent needs a file or NBD source, not a stream"));
            }
            Ok(CommitPlan::Full(source))
        }
        CommitSource::Nbd { image: nbd, dirty } => match dirty {
            None if parent.is_some() => Err(bad(
                "--parent with an NBD source needs --dirty-bitmap (what changed since it)",
            )),
            None => Ok(CommitPlan::Full(Box::new(ImageSource::new(nbd)?))),
            Some((bitmap, extents)) => {
                let parent = match parent {
                    Some(p) => p,
                    None => resolve(repo, &VersionSpec::parse(image)?)
                        .await
                        .map_err(|e| {
                            bad(format!(
                                "--dirty-bitmap commits on top of a parent version, and {e}: \
                                 commit the image in full first (without --dirty-bitmap), or \
                                 pass --parent"
                            ))
                        })?,
                };
                let because = format!(
                    "dirty bitmap {bitmap} since {}@{}",
                    parent.1.image, parent.1.seq
                );
                Ok(CommitPlan::Incremental {
                    image: nbd,
                    parent: Box::new(parent),
                    changed: Changes::data(extents),
                    because,
                })
            }
        },
        CommitSource::Local(local) => plan_local(repo, local, parent, known).await,
    }
}

async fn plan_local(
    repo: &Arc<Repo>,
    image: Arc<dyn DiskImage>,
    parent: Option<(Id, VersionRecord)>,
    known: &dyn KnownVersions,
) -> EngineResult<CommitPlan> {
    let layers = image.layers();
    if layers.len() < 2 {
        if parent.is_some() {
            return Err(bad(format!(
                "--parent needs a qcow2 overlay (an image with a backing file) or an NBD source \
                 with --dirty-bitmap; {} has no backing file",
                image.describe()
            )));
        }
        return Ok(CommitPlan::Full(Box::new(ImageSource::new(image)?)));
    }
    // An overlay: which layer of the chain holds a known version?
    let (depth, parent, because) = match parent {
        Some(p) => {
            let because = format!(
                "overlay {} on {}@{} (--parent)",
                layers[0].path.display(),
                p.1.image,
                p.1.seq
            );
            (1, p, because)
        }
        None => match known_layer(repo, &layers, known).await {
            Some((depth, id, record)) => {
                let because = format!(
                    "{} holds {}@{}",
                    layers[depth].path.display(),
                    record.image,
                    record.seq
                );
                (depth, (id, record), because)
            }
            None => return Ok(CommitPlan::Full(Box::new(ImageSource::new(image)?))),
        },
    };
    let backing_size = layers[depth].size;
    if backing_size != parent.1.logical_size {
        return Err(bad(format!(
            "{} has {backing_size} bytes but {}@{} has {}: the backing chain does not hold that \
             version",
            layers[depth].path.display(),
            parent.1.image,
            parent.1.seq,
            parent.1.logical_size
        )));
    }
    let changed = layer_changes(image.as_ref(), depth)?;
    Ok(CommitPlan::Incremental {
        image,
        parent: Box::new(parent),
        changed,
        because,
    })
}

/// The shallowest backing layer that the records say holds a version that still exists.
async fn known_layer(
    repo: &Repo,
    layers: &[Layer],
    known: &dyn KnownVersions,
) -> Option<(usize, Id, VersionRecord)> {
    for (depth, layer) in layers.iter().enumerate().skip(1) {
        if let Some(id) = known.lookup(&layer.path) {
            match repo.load_version(&id).await {
                Ok(record) => return Some((depth, id, record)),
                Err(e) => tracing::debug!(
                    "{} was recorded as version {id}, which cannot be loaded: {e}",
                    layer.path.display()
                ),
            }
        }
    }
    None
}

fn bad(msg: impl Into<String>) -> EngineError {
    EngineError::BadInput(msg.into())
}

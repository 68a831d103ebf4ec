//! Boot profiles: where an export's prefetch comes from and where its recording goes, and
//! `cairn profile list|show|set|rm`.
//!
//! An export of one version fetches ahead the image's stored profile (or the file given by
//! `--profile`) and, when the image has none that fits, records the client's first reads and
//! stores them as the image's profile (`--new-profile` records anew, `--no-profile` does
//! neither; `--record-profile PATH` also writes a file). A profile that does not fit is
//! ignored: it can only ever make fetches earlier, never change what is served.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use cairn_engine::resolve::{resolve, VersionSpec};
use cairn_export::profile::{self, BootProfile, Recorder};
use cairn_export::{Base, ExportStats};
use cairn_repo::{Repo, RepoError, SessionKind};
use serde_json::json;

use crate::cli::{ExportArgs, ProfileAction, ProfileArgs};
use crate::context::Context;
use crate::output::print_json;

/// How long storing a recorded profile may take before the export gives up on it.
const STORE_TIMEOUT: Duration = Duration::from_secs(15);

/// A recorder for an export of `versions` versions, when anything may be recorded.
pub fn recorder_for(args: &ExportArgs, versions: usize) -> Result<Option<Arc<Recorder>>> {
    if versions > 1 {
        if args.profile.is_some() || args.record_profile.is_some() || args.new_profile {
            bail!("--profile, --record-profile and --new-profile take one VERSION (a boot profile is one disk's)");
        }
        return Ok(None);
    }
    let records = args.record_profile.is_some() || !args.no_profile;
    Ok(records.then(|| Arc::new(Recorder::default())))
}

/// Starts the prefetch of the export served by `base` and returns the writer of its
/// recording (`None`: nothing is recorded).
pub async fn start(
    ctx: &Context,
    repo: &Arc<Repo>,
    args: &ExportArgs,
    base: Arc<Base>,
    stats: Arc<ExportStats>,
    recorder: Option<Arc<Recorder>>,
) -> Option<Arc<ProfileWriter>> {
    let image = base.record().image.clone();
    let mut store = args.new_profile;
    if let Some(path) = &args.profile {
        let parsed = std::fs::read(path)
            .map_err(|e| e.to_string())
            .and_then(|bytes| BootProfile::parse(&bytes));
        let source = format!("boot profile {}", path.display());
        match parsed {
            Ok(p) => {
                prefetch(ctx, &source, p, base.clone(), stats);
            }
            Err(e) => ctx.warn(&format!("{source} is ignored: {e}")),
        }
    } else if !args.no_profile && !args.new_profile {
        let source = format!("the stored boot profile of {image}");
        store = match repo.boot_profile(&image).await {
            Ok(Some(json)) => match BootProfile::parse(&json) {
                Ok(p) => !prefetch(ctx, &source, p, base.clone(), stats),
                Err(e) => {
                    ctx.warn(&format!("{source} is ignored: {e}; recording a new one"));
                    true
                }
            },
            Ok(None) => true,
            Err(e) => {
                ctx.warn(&format!("{source} is ignored: {e}; recording a new one"));
                true
            }
        };
    }
    // Nothing is written into a format 1 repository.
    let store = store && repo.v2().is_some();
    let recorder = recorder?;
    if !store && args.record_profile.is_none() {
        return None;
    }
    let writer = Arc::new(ProfileWriter {
        file: args.record_profile.clone(),
        repo: store.then(|| repo.clone()),
        recorder,
        image,
        size: base.size(),
        written: AtomicBool::new(false),
    });
    writer.write_when_done();
    Some(writer)
}

/// Starts fetching `p`'s reads for `base` if it fits its image and size (false, with a note
/// saying why, if not).
fn prefetch(
    ctx: &Context,
    source: &str,
    p: BootProfile,
    base: Arc<Base>,
    stats: Arc<ExportStats>,
) -> bool {
    let record = base.record();
    if let Some(why) = p.misfit(&record.image, record.logical_size) {
        ctx.warn(&format!(
            "{source} is ignored: {why} (serving {}@{}, {} bytes)",
            record.image, record.seq, record.logical_size
        ));
        return false;
    }
    tracing::info!(
        "prefetching {} bytes in {} reads from {source}",
        p.bytes(),
        p.reads.len(),
    );
    base.spawn_background(profile::prefetch(base.clone(), p, stats));
    true
}

/// Writes what a recorder recorded, once: to its file and/or as the image's stored profile.
pub struct ProfileWriter {
    file: Option<PathBuf>,
    repo: Option<Arc<Repo>>,
    recorder: Arc<Recorder>,
    image: String,
    size: u64,
    written: AtomicBool,
}

impl ProfileWriter {
    /// Writes the profile when the recording is over (checked every second).
    fn write_when_done(self: &Arc<Self>) {
        let me = self.clone();
        tokio::spawn(async move {
            while !me.recorder.done() {
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            me.write().await;
        });
    }

    /// Writes the profile unless it was written; a failure is a warning: the export goes on.
    pub async fn write(&self) {
        if self.written.swap(true, Ordering::SeqCst) {
            return;
        }
        let p = self.recorder.profile(&self.image, self.size);
        let json = serde_json::to_vec(&p).expect("a profile serializes");
        if let Some(path) = &self.file {
            match write_file(path, &json) {
                Ok(()) => tracing::info!(
                    "boot profile {}: {} bytes in {} reads",
                    path.display(),
                    p.bytes(),
                    p.reads.len()
                ),
                Err(e) => tracing::warn!("cannot write boot profile {}: {e}", path.display()),
            }
        }
        if let Some(repo) = &self.repo {
            if p.reads.is_empty() {
                return;
            }
            // A profile is a hint: an unreachable store must not hold up the export's stop.
            let stored =
                tokio::time::timeout(STORE_TIMEOUT, repo.put_boot_profile(&self.image, &json));
            match stored.await {
                Ok(Ok(())) => tracing::info!(
                    "stored the boot profile of {}: {} bytes in {} reads",
                    self.image,
                    p.bytes(),
                    p.reads.len()
                ),
                Ok(Err(e)) => {
                    tracing::warn!("cannot store the boot profile of {}: {e}", self.image)
                }
                Err(_) => tracing::warn!(
                    "the boot profile of {} was not stored: the store did not answer in {} s",
                    self.image,
                    STORE_TIMEOUT.as_secs()
                ),
            }
        }
    }
}

/// Writes `bytes` to `path` whole (a temporary renamed into place), private to its owner.
fn write_file(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    let result = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        })
        .and_then(|()| std::fs::rename(&tmp, path));
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

pub async fn run(ctx: &Context, args: ProfileArgs) -> Result<ExitCode> {
    match args.action {
        ProfileAction::List => {
            let repo = ctx.open().await?;
            let mut rows = Vec::new();
            for image in repo.boot_profile_images().await? {
                let p = stored(&repo, &image).await;
                rows.push((image, p));
            }
            if ctx.json {
                print_json(&json!(rows
                    .iter()
                    .map(|(image, p)| match p {
                        Ok(p) => summary(image, p),
                        Err(e) => json!({"image": image, "error": format!("{e:#}")}),
                    })
                    .collect::<Vec<_>>()));
            } else {
                for (image, p) in &rows {
                    match p {
                        Ok(p) => outln!("{image}: {}", describe(p)),
                        Err(e) => outln!("{image}: {e:#}"),
                    }
                }
            }
        }
        ProfileAction::Show { image } => {
            let repo = ctx.open().await?;
            let p = stored(&repo, &image).await?;
            if ctx.json {
                print_json(&serde_json::to_value(&p)?);
            } else {
                outln!("{image}: {}", describe(&p));
            }
        }
        ProfileAction::Set { image, path } => {
            let bytes =
                std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
            let p = BootProfile::parse(&bytes)
                .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            let repo = ctx.open_as(SessionKind::Edit).await?;
            crate::context::refuse_format_1(&repo)?;
            let (_, head) = resolve(&repo, &VersionSpec::parse(&image)?).await?;
            if let Some(why) = p.misfit(&image, head.logical_size) {
                bail!(
                    "{} does not fit {image}@{} ({} bytes): {why}",
                    path.display(),
                    head.seq,
                    head.logical_size
                );
            }
            repo.put_boot_profile(&image, &serde_json::to_vec(&p)?)
                .await?;
            if ctx.json {
                print_json(&json!({"stored": summary(&image, &p)}));
            } else {
                ctx.note(&format!(
                    "stored the boot profile of {image}: {}",
                    describe(&p)
                ));
            }
        }
        ProfileAction::Rm { image } => {
            let repo = ctx.open_as(SessionKind::Edit).await?;
            if !repo.remove_boot_profile(&image).await? {
                return Err(RepoError::NotFound(format!("{image} has no boot profile")).into());
            }
            if ctx.json {
                print_json(&json!({"removed": image}));
            } else {
                ctx.note(&format!("removed the boot profile of {image}"));
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `image`'s stored profile, parsed; a missing or unreadable one is an error.
async fn stored(repo: &Repo, image: &str) -> Result<BootProfile> {
    let json = repo
        .boot_profile(image)
        .await?
        .ok_or_else(|| RepoError::NotFound(format!("{image} has no boot profile")))?;
    BootProfile::parse(&json).map_err(|e| anyhow::anyhow!("the boot profile of {image}: {e}"))
}

fn describe(p: &BootProfile) -> String {
    let think = match p.think() {
        Some(t) => format!(", {:.1} s of guest think time", t.as_secs_f64()),
        None => String::new(),
    };
    format!(
        "{} reads, {} (recorded for a size of {}){think}",
        p.reads.len(),
        crate::output::bytes(p.bytes()),
        crate::output::bytes(p.size)
    )
}

fn summary(image: &str, p: &BootProfile) -> serde_json::Value {
    json!({"image": image, "reads": p.reads.len(), "bytes": p.bytes(), "size": p.size,
           "think_seconds": p.think().map(|t| t.as_secs_f64())})
}

//! Resolved global settings and repository opening.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use cairn_repo::SessionKind;
use cairn_repo::{ContentCache, Repo};
use cairn_store::{LocalStore, ObjectStore};

use crate::cli::Cli;
use crate::failure::NoRepository;
use crate::password::PasswordSource;

/// Size limit of the metadata cache (least recently used objects are evicted beyond it).
const META_CACHE_LIMIT: u64 = 2 << 30;

pub struct Context {
    pub repo: Option<String>,
    /// --meta-cache as given.
    meta_cache: Option<String>,
    pub json: bool,
    /// Progress bars wanted (not --json, not --quiet).
    pub progress: bool,
    /// --quiet: no notes on stderr.
    pub quiet: bool,
    /// Where an encrypted repository's passphrase comes from.
    pub password: PasswordSource,
    /// Repositories opened by the command, closed (sessions ended) when it finishes.
    opened: Mutex<Vec<Arc<Repo>>>,
}

/// A repository URL without its query (which holds only settings, but keep messages short).
fn redact_query(location: &str) -> &str {
    location.split('?').next().unwrap_or(location)
}

impl Context {
    pub fn new(cli: &Cli) -> Self {
        Context {
            repo: cli.repo.clone(),
            meta_cache: cli.meta_cache.clone(),
            json: cli.json,
            progress: !cli.json && !cli.quiet,
            quiet: cli.quiet,
            password: PasswordSource {
                file: cli.password_file.clone(),
                command: cli.password_command.clone(),
                names: &crate::password::REPOSITORY,
            },
            opened: Mutex::new(Vec::new()),
        }
    }

    /// A note for the person at the terminal (stderr), unless --quiet.
    pub fn note(&self, text: &str) {
        if !self.quiet {
            eprintln!("{text}");
        }
    }

    /// A warning on stderr, even with --quiet: something the user must act on.
    pub fn warn(&self, text: &str) {
        eprintln!("warning: {text}");
    }

    fn location(&self) -> Result<&str> {
        match self.repo.as_deref() {
            Some(r) if !r.is_empty() => Ok(r),
            _ => Err(NoRepository(
                "no repository given: pass --repo PATH or set CAIRN_REPO".into(),
            )
            .into()),
        }
    }

    /// The store behind --repo, created if `create` (for init).
    pub fn store(&self, create: bool) -> Result<Arc<dyn ObjectStore>> {
        self.store_for(create, false)
    }

    /// The local directory behind --repo, if it is one.
    pub fn local_path(&self) -> Option<PathBuf> {
        let location = self.location().ok()?;
        (!location.contains("://")).then(|| PathBuf::from(location))
    }

    /// The store behind --repo; `deletion`: for a command that frees space, which may use a
    /// local repository's space reserve when the disk is full.
    fn store_for(&self, create: bool, deletion: bool) -> Result<Arc<dyn ObjectStore>> {
        store_at(self.location()?, create, deletion)
    }

    /// The metadata cache for --repo: --meta-cache, else the default for remote repositories.
    fn meta_cache(&self) -> Result<Option<Arc<ContentCache>>> {
        self.meta_cache_for(self.location()?)
    }

    /// The metadata cache for the repository at `location`.
    fn meta_cache_for(&self, location: &str) -> Result<Option<Arc<ContentCache>>> {
        let dir = match self.meta_cache.as_deref() {
            Some("off") => return Ok(None),
            Some(dir) if !dir.is_empty() => PathBuf::from(dir),
            _ if location.starts_with("s3://") => ContentCache::default_meta_dir(),
            _ => return Ok(None),
        };
        match ContentCache::open(&dir, META_CACHE_LIMIT) {
            Ok(cache) => Ok(Some(Arc::new(cache))),
            // A cache is an optimisation: work without one rather than fail the command.
            Err(e) => {
                tracing::warn!(
                    "metadata cache {} unusable, going without: {e}",
                    dir.display()
                );
                Ok(None)
            }
        }
    }

    /// Opens another repository than --repo (`cairn copy --from`); closed with the command.
    pub async fn open_other(
        &self,
        location: &str,
        kind: SessionKind,
        password: &PasswordSource,
    ) -> Result<Arc<Repo>> {
        let store = store_at(location, false, false)?;
        let cache = self.meta_cache_for(location)?;
        let repo = Arc::new(Repo::open_cached(store, kind, cache, Some(password)).await?);
        self.opened.lock().expect("opened lock").push(repo.clone());
        Ok(repo)
    }

    /// Opens the repository at --repo; `kind` names the session (commit, restore, ...).
    /// Commands that free space (`edit`: rm and prune, `gc`, `repair`) may use the space
    /// reserve of a local repository on a full disk.
    pub async fn open_as(&self, kind: SessionKind) -> Result<Arc<Repo>> {
        let frees_space = matches!(
            kind,
            SessionKind::Edit | SessionKind::Gc | SessionKind::Repair
        );
        self.open_with(kind, frees_space).await
    }

    /// [`Self::open_as`] for a command that only adds objects (`relayout`, under a repair
    /// session): on a full disk it fails rather than take the space reserve, which is there
    /// for the commands that free space.
    pub async fn open_adding(&self, kind: SessionKind) -> Result<Arc<Repo>> {
        self.open_with(kind, false).await
    }

    async fn open_with(&self, kind: SessionKind, frees_space: bool) -> Result<Arc<Repo>> {
        let store = self.store_for(false, frees_space)?;
        let repo = Arc::new(
            Repo::open_cached(store, kind, self.meta_cache()?, Some(&self.password)).await?,
        );
        self.opened.lock().expect("opened lock").push(repo.clone());
        let writes = matches!(
            kind,
            SessionKind::Edit | SessionKind::Commit | SessionKind::Repair | SessionKind::Gc
        );
        if writes {
            refuse_format_1(&repo)?;
            self.refuse_downgrade(&repo).await?;
        }
        Ok(repo)
    }

    /// Whoever can write the store can replace an encrypted repository's config with a plain
    /// one and delete its key slots; later commits would then store plaintext. A plain
    /// config beside key slots is refused when the repository opens (`Repo::open`); with the
    /// slots deleted too, a command that writes refuses a plain repository while a
    /// passphrase is given (the user means an encrypted one).
    pub async fn refuse_downgrade(&self, repo: &Repo) -> Result<()> {
        if repo.key().is_some() {
            return Ok(());
        }
        let location = repo.describe();
        if let Some(source) = self.password.given() {
            return Err(crate::failure::MaybeDowngraded(format!(
                "{location} is not encrypted, yet a passphrase is given ({source}): refusing to \
                 write plaintext into it. If it was encrypted, its config was replaced and \
                 its key slots deleted: do not use it. To write to a plain repository, give no \
                 passphrase"
            ))
            .into());
        }
        Ok(())
    }

    /// Opens the repository at --repo for reading (works on a read-only repository too).
    pub async fn open(&self) -> Result<Arc<Repo>> {
        self.open_as(SessionKind::Read).await
    }

    /// Ends the sessions of every repository this command opened. After a failed command
    /// the packs it stored but never published are deleted first; the store may be what
    /// failed, so this gets a few seconds and stays quiet (the command's own error is the
    /// line that matters; what is left behind goes stale and GC removes it).
    pub async fn close(&self, succeeded: bool) {
        let repos = std::mem::take(&mut *self.opened.lock().expect("opened lock"));
        for repo in repos {
            if succeeded {
                if let Err(e) = repo.close().await {
                    tracing::warn!("closing the session: {e}");
                }
                continue;
            }
            let cleanup = async {
                let discarded = repo.discard_unindexed_packs().await;
                if discarded > 0 {
                    tracing::info!("deleted the {discarded} packs the failed command had stored");
                }
                repo.close().await
            };
            match tokio::time::timeout(Duration::from_secs(3), cleanup).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::debug!("closing the session after a failure: {e}"),
                Err(_) => tracing::debug!("closing the session after a failure: timed out"),
            }
        }
    }
}

/// The store at `location` (a directory or s3://BUCKET/PREFIX), created if `create` (for
/// init); `deletion`: for a command that frees space, which may use a local repository's
/// space reserve when the disk is full.
fn store_at(location: &str, create: bool, deletion: bool) -> Result<Arc<dyn ObjectStore>> {
    if location.starts_with("s3://") {
        // The bucket must exist; `init` writes the repository's first objects into it.
        let store = cairn_store_s3::S3Store::open(location)
            .with_context(|| format!("cannot open repository {}", redact_query(location)))?;
        return Ok(Arc::new(store));
    }
    if location.contains("://") {
        bail!("{location}: only local directories and s3://BUCKET/PREFIX are supported");
    }
    let path = PathBuf::from(location);
    let store = if create {
        LocalStore::create(&path)
    } else {
        LocalStore::open(&path)
    };
    match store {
        Ok(s) if deletion => Ok(Arc::new(s.for_deletion())),
        Ok(s) => Ok(Arc::new(s)),
        Err(_) if !create && !path.exists() => {
            Err(NoRepository(format!(
                "no cairn repository at {location} (the directory does not exist; run `cairn init` first)"
            ))
            .into())
        }
        Err(e) => Err(e).with_context(|| format!("cannot open repository {location}")),
    }
}

/// Format 1 is read-only: every command that writes refuses it, saying the way forward.
pub fn refuse_format_1(repo: &Repo) -> Result<()> {
    if repo.config().format() == 1 {
        return Err(crate::failure::ReadOnlyFormat {
            location: repo.describe(),
        }
        .into());
    }
    Ok(())
}

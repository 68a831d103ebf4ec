//! `cairn export VERSION`: serve a version over NBD, fetching data on demand, until SIGTERM
//! or SIGINT; `cairn status`, `cairn overlay` and `cairn commit --from-export` talk to a
//! running export over its control socket.
//!
//! The life of an export (see `cairn_export::lifecycle`): the run directory is checked
//! (0700, the user's), the export names and the NBD socket are claimed (a live holder is
//! refused, naming its pid), the versions are opened, the control sockets bound, a state file
//! written per export, and readiness announced (`--json` lines, systemd's `READY=1`). On
//! SIGTERM/SIGINT it stops accepting, pauses and flushes every export, removes its files,
//! prints one line and exits 0.

use cairn_repo::SessionKind;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use cairn_engine::resolve::{resolve, VersionSpec};
use cairn_export::control::{self, Request};
use cairn_export::lifecycle::{self, ExportState, NameClaim, SocketClaim};
use cairn_export::{notify, policy, Base, ContentCache, ExportStats, VersionExport};
use cairn_format::Id;
use cairn_nbd::{Server, TlsConfig};
use cairn_overlay::{Overlay, OverlayError};
use cairn_repo::Repo;
use serde_json::{json, Value};
use tokio::signal::unix::{signal, SignalKind};

use crate::cli::{ExportArgs, OverlayAction, OverlayArgs, StatusArgs};
use crate::commands::exports;
use crate::commands::profile;
use crate::context::Context;
use crate::output::{bytes, print_json};

/// One export being served.
struct Opened {
    name: String,
    export: Arc<VersionExport>,
    /// `IMAGE@N (short id)`.
    described: String,
    /// `IMAGE@N` and the full id.
    version: String,
    id: String,
    overlay: Option<PathBuf>,
}

/// Where the NBD server listens.
enum Listener {
    Unix(tokio::net::UnixListener, PathBuf),
    Tcp(tokio::net::TcpListener, String),
    /// One connection on stdin/stdout, or a socket handed over by socket activation.
    Stdio,
}

/// What an export leaves in the run directory, removed when it stops (or fails to start):
/// state files first, then control sockets, then the NBD socket; the claims on names and
/// socket go last.
struct Files {
    run: PathBuf,
    states: Vec<String>,
    controls: Vec<PathBuf>,
    socket: Option<SocketClaim>,
    _names: Vec<NameClaim>,
}

impl Drop for Files {
    fn drop(&mut self) {
        for name in &self.states {
            ExportState::remove(&self.run, name);
        }
        for ctl in &self.controls {
            if let Err(e) = std::fs::remove_file(ctl) {
                tracing::warn!("cannot remove {}: {e}", ctl.display());
            }
        }
        if let Some(claim) = &self.socket {
            claim.remove();
        }
    }
}

pub async fn run(ctx: &Context, args: ExportArgs) -> Result<ExitCode> {
    // From here on SIGTERM and SIGINT stop the export cleanly instead of killing it.
    let mut sigterm = signal(SignalKind::terminate()).context("cannot handle SIGTERM")?;
    let mut sigint = signal(SignalKind::interrupt()).context("cannot handle SIGINT")?;
    let plan = export_plan(&args)?;
    let recorder = profile::recorder_for(&args, plan.len())?;
    let tls = tls_config(&args)?;
    if let Some(addr) = &args.listen {
        let certificates = tls
            .as_ref()
            .is_some_and(|t| t.requires_client_certificates());
        policy::check_tcp_listen(addr, args.writable, certificates, args.insecure).await?;
    }
    let stdio = args.stdio || std::env::var_os("LISTEN_FDS").is_some();

    // Claim the names and the socket before opening anything.
    let run = lifecycle::run_dir();
    lifecycle::ensure_private_dir(&run)?;
    let mut names = Vec::new();
    for (_, name) in &plan {
        names.push(lifecycle::claim_name(&run, name).await?);
    }
    let mut files = Files {
        run: run.clone(),
        states: Vec::new(),
        controls: Vec::new(),
        socket: None,
        _names: names,
    };
    let listener = if stdio {
        Listener::Stdio
    } else if let Some(addr) = &args.listen {
        let l = bind_tcp(addr, &run).await?;
        let local = l
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_else(|_| addr.clone());
        Listener::Tcp(l, local)
    } else {
        let path = match &args.socket {
            Some(p) => p.clone(),
            None => run.join(format!("{}.sock", lifecycle::file_key(&plan[0].1))),
        };
        let (claim, l) = lifecycle::claim_socket(&run, &path).await?;
        files.socket = Some(claim);
        Listener::Unix(l, path)
    };

    let repo = ctx.open_as(SessionKind::Export).await?;
    if args.writable {
        // Its COMMIT writes: a format 1 repository is served read-only, and no plaintext goes
        // into a repository that may have been encrypted.
        crate::context::refuse_format_1(&repo)?;
        ctx.refuse_downgrade(&repo).await?;
    }
    let cache = open_cache(args.cache.cache_dir.clone(), args.cache.cache_size)?;
    let seeds = crate::commands::restore::open_seeds(ctx, &args.seeds, None);
    let mut server = Server::new();
    let mut opened = Vec::new();
    for (version, name) in &plan {
        let o = open_export(
            ctx,
            &repo,
            &cache,
            &seeds,
            recorder.as_ref(),
            &args,
            version,
            name,
        )
        .await?;
        server.set_description(&o.name, format!("cairn {}", o.described));
        server.add_export(&o.name, o.export.clone());
        if plan.len() == 1 {
            server.set_default_export(o.export.clone());
        }
        opened.push(o);
    }
    let profile_writer = match plan.len() {
        1 => {
            let o = &opened[0];
            let stats = o.export.stats().clone();
            profile::start(ctx, &repo, &args, o.export.base(), stats, recorder).await
        }
        _ => None,
    };
    let tls_on = tls.is_some();
    if let Some(tls) = tls {
        server.set_tls(tls);
    }
    let server = Arc::new(server);
    for o in &opened {
        let ctl = lifecycle::control_path(&run, &o.name);
        let listener = control::bind(&ctl)
            .with_context(|| format!("cannot bind the control socket {}", ctl.display()))?;
        files.controls.push(ctl.clone());
        let handler = control::export_handler(
            o.export.clone(),
            repo.clone(),
            cache.clone(),
            policy::readahead(&repo, args.cache.readahead),
        );
        tokio::spawn(async move {
            if let Err(e) = control::serve(listener, handler).await {
                tracing::error!("control socket {}: {e}", ctl.display());
            }
        });
    }
    let served_stats: Vec<(String, Arc<ExportStats>)> = opened
        .iter()
        .map(|o| (o.name.clone(), o.export.stats().clone()))
        .collect();
    if let Some(path) = args.stats_file.clone() {
        tokio::spawn(write_stats(path, served_stats.clone()));
    }

    announce(ctx, &run, &opened, &listener, tls_on, stdio, &mut files)?;

    // Serve until a signal (or, on stdin, the end of the connection).
    let serving = async {
        match listener {
            Listener::Stdio if std::env::var_os("LISTEN_FDS").is_some() => {
                cairn_nbd::serve_socket_activation(server).await
            }
            Listener::Stdio => cairn_nbd::serve_stdio(server)
                .await
                .map_err(std::io::Error::other),
            Listener::Tcp(l, _) => cairn_nbd::serve_tcp_listener(server, l).await,
            Listener::Unix(l, _) => cairn_nbd::serve_unix_listener(server, l).await,
        }
    };
    let (signal, served) = tokio::select! {
        r = serving => (None, r),
        _ = sigterm.recv() => (Some("SIGTERM"), Ok(())),
        _ = sigint.recv() => (Some("SIGINT"), Ok(())),
    };
    if let Some(sig) = signal {
        notify_systemd(&format!("STOPPING=1\nSTATUS=stopping ({sig})"));
    }
    if let Some(w) = &profile_writer {
        w.write().await;
    }
    // What was fetched reaches the host-wide cache before the export says it stopped.
    let flushing = cache.clone();
    let _ = tokio::task::spawn_blocking(move || flushing.flush()).await;
    stop(ctx, &args, opened, files, &served_stats, signal, served).await
}

/// The host-wide chunk cache at `dir` (default: $CAIRN_CACHE_DIR, else ~/.cache/cairn/chunks).
pub fn open_cache(dir: Option<PathBuf>, size: u64) -> Result<Arc<ContentCache>> {
    let dir = dir.unwrap_or_else(ContentCache::default_chunk_dir);
    Ok(Arc::new(ContentCache::open(&dir, size).with_context(
        || format!("cannot open the chunk cache {}", dir.display()),
    )?))
}

/// Announces the exports: a state file each, then `--json` lines or notes (not on stdio,
/// where stdout is the NBD connection), then readiness to systemd.
fn announce(
    ctx: &Context,
    run: &Path,
    opened: &[Opened],
    listener: &Listener,
    tls_on: bool,
    stdio: bool,
    files: &mut Files,
) -> Result<()> {
    let (socket, listen) = match listener {
        Listener::Unix(_, p) => (Some(p.clone()), None),
        Listener::Tcp(_, a) => (None, Some(a.clone())),
        Listener::Stdio => (None, None),
    };
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut status = Vec::new();
    for o in opened {
        let uri = uri(&o.name, socket.as_deref(), listen.as_deref(), tls_on);
        let state = ExportState {
            name: o.name.clone(),
            pid: std::process::id(),
            version: o.version.clone(),
            id: o.id.clone(),
            uri: uri.clone(),
            socket: socket
                .as_ref()
                .map(|p| std::path::absolute(p).unwrap_or(p.clone())),
            listen: listen.clone(),
            writable: o.overlay.is_some(),
            tls: tls_on,
            overlay: o.overlay.clone(),
            started,
        };
        state.write(run)?;
        files.states.push(o.name.clone());
        if !stdio {
            if ctx.json {
                let line = json!({
                    "name": o.name,
                    "uri": uri,
                    "version": o.version,
                    "id": o.id,
                    "pid": std::process::id(),
                    "socket": socket.as_ref().map(|p| p.display().to_string()),
                    "listen": listen,
                    "writable": o.overlay.is_some(),
                    "tls": tls_on,
                    "overlay": o.overlay.as_ref().map(|p| p.display().to_string()),
                });
                outln!("{line}");
            } else {
                ctx.note(&format!("serving {} as {uri}", o.described));
            }
        }
        status.push(format!("{} ({}) at {uri}", o.name, o.version));
    }
    {
        use std::io::Write;
        let _ = std::io::stdout().flush();
    }
    notify_systemd(&format!("READY=1\nSTATUS=serving {}", status.join("; ")));
    Ok(())
}

/// (version, export name) of every version to serve: `VERSION=NAME`, or named after its
/// image (or `--name`, for one version).
fn export_plan(args: &ExportArgs) -> Result<Vec<(String, String)>> {
    if args.specs.len() > 1 && (args.name.is_some() || args.overlay.is_some()) {
        bail!("with several versions, name each as VERSION=NAME (--name and --overlay take one)");
    }
    let mut plan: Vec<(String, String)> = Vec::new();
    for spec in &args.specs {
        let (version, name) = match spec.split_once('=') {
            Some((v, n)) => (v.to_string(), n.to_string()),
            None => {
                let image = VersionSpec::parse(spec)?.image;
                (spec.clone(), args.name.clone().unwrap_or(image))
            }
        };
        if plan.iter().any(|(_, n)| *n == name) {
            bail!("export name {name:?} is given twice");
        }
        plan.push((version, name));
    }
    Ok(plan)
}

/// Stops the exports once serving ended (`signal`, or the connection on stdin): requests in
/// progress finish, every overlay is flushed, the run files are removed and the last
/// statistics written.
async fn stop(
    ctx: &Context,
    args: &ExportArgs,
    opened: Vec<Opened>,
    files: Files,
    served_stats: &[(String, Arc<ExportStats>)],
    signal: Option<&str>,
    served: std::io::Result<()>,
) -> Result<ExitCode> {
    // No new connection; let requests in progress finish, then flush every overlay.
    let mut failed = Vec::new();
    for o in &opened {
        if let Err(e) = o.export.shutdown().await {
            failed.push(format!("{}: {e}", o.name));
        }
    }
    drop(files);
    if let Some(path) = &args.stats_file {
        let _ = std::fs::write(path, stats_json(served_stats).to_string());
    }
    let names: Vec<&str> = opened.iter().map(|o| o.name.as_str()).collect();
    let what = match names.as_slice() {
        [one] => format!("export {one}"),
        many => format!("exports {}", many.join(", ")),
    };
    let why = signal.unwrap_or("connection ended");
    if !failed.is_empty() {
        bail!(
            "{what} stopped ({why}) but could not flush its overlay: {}",
            failed.join("; ")
        );
    }
    served.context("nbd server")?;
    if signal.is_some() {
        let flushed = match opened.iter().filter(|o| o.overlay.is_some()).count() {
            0 => "",
            1 => "; overlay flushed",
            _ => "; overlays flushed",
        };
        ctx.note(&format!("cairn: {what} stopped ({why}){flushed}"));
    }
    Ok(ExitCode::SUCCESS)
}

/// `nbd[s]+unix:///NAME?socket=PATH` or `nbd[s]://ADDR/NAME`.
fn uri(name: &str, socket: Option<&Path>, listen: Option<&str>, tls: bool) -> String {
    let s = if tls { "s" } else { "" };
    match (socket, listen) {
        (Some(p), _) => format!("nbd{s}+unix:///{name}?socket={}", p.display()),
        (None, Some(a)) => format!("nbd{s}://{a}/{name}"),
        (None, None) => "stdio".to_string(),
    }
}

fn notify_systemd(message: &str) {
    if let Err(e) = notify::notify(message) {
        tracing::warn!("cannot notify systemd (NOTIFY_SOCKET): {e}");
    }
}

fn tls_config(args: &ExportArgs) -> Result<Option<TlsConfig>> {
    Ok(match (&args.tls_dir, &args.tls_cert, &args.tls_key) {
        (Some(dir), _, _) => Some(TlsConfig::from_dir(dir)?),
        (None, Some(cert), Some(key)) => Some(TlsConfig::from_pem_files(
            cert,
            key,
            args.tls_ca.as_deref(),
        )?),
        _ => None,
    })
}

/// Binds the TCP address; an address in use names the export that has it, if one does.
async fn bind_tcp(addr: &str, run: &Path) -> Result<tokio::net::TcpListener> {
    match tokio::net::TcpListener::bind(addr).await {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
            let holder = lifecycle::live_exports(run)
                .await
                .unwrap_or_default()
                .into_iter()
                .find(|x| x.state.listen.as_deref() == Some(addr));
            match holder {
                Some(x) => bail!(
                    "address {addr} is in use by export {:?} (pid {}); stop it with `cairn \
                     exports stop {}` or choose another --listen",
                    x.state.name,
                    x.pid,
                    x.state.name
                ),
                None => bail!("cannot listen on {addr}: address in use; choose another --listen"),
            }
        }
        Err(e) => Err(e).with_context(|| format!("cannot listen on {addr}")),
    }
}

/// Opens one export: resolves the version, opens its base (and overlay).
#[allow(clippy::too_many_arguments)]
async fn open_export(
    ctx: &Context,
    repo: &Arc<Repo>,
    cache: &Arc<ContentCache>,
    seeds: &cairn_engine::segment::Seeds,
    recorder: Option<&Arc<cairn_export::profile::Recorder>>,
    args: &ExportArgs,
    version: &str,
    name: &str,
) -> Result<Opened> {
    let spec = VersionSpec::parse(version)?;
    let (id, record) = resolve(repo, &spec).await?;
    let stats = Arc::new(ExportStats::default());
    let base = Base::open(
        repo.clone(),
        cache.clone(),
        stats.clone(),
        id,
        record.clone(),
        policy::readahead(repo, args.cache.readahead),
    )
    .await
    .with_context(|| format!("cannot open {}@{}", record.image, record.seq))?
    .with_seeds(seeds.clone());
    let version = format!("{}@{}", record.image, record.seq);
    let overlay = if args.writable {
        let dir = args
            .overlay
            .clone()
            .unwrap_or_else(|| exports::default_overlay_dir(name));
        let dir = std::path::absolute(&dir).unwrap_or(dir);
        let block = repo.config().chunk_size;
        let o = match Overlay::open_rebasing_empty(&dir, record.logical_size, block, &id.to_hex()) {
            Ok((o, rebased)) => {
                if let Some(old) = rebased {
                    ctx.note(&format!(
                        "overlay {} held nothing; moved it from base {} to {version}",
                        dir.display(),
                        &old[..old.len().min(12)]
                    ));
                }
                o
            }
            Err(OverlayError::Mismatch { field: "base", .. }) => {
                let explicit = args.overlay.is_some();
                return Err(base_mismatch(repo, &dir, explicit, name, &version, &id).await);
            }
            Err(e) => {
                return Err(e).with_context(|| format!("cannot open the overlay {}", dir.display()))
            }
        };
        if let Some(depth) = args.copy_on_read {
            o.set_copy_on_read(depth);
        }
        let held = o.stats().blocks_held;
        if held > 0 {
            ctx.note(&format!(
                "reopened the overlay {} with {held} blocks written",
                dir.display()
            ));
        }
        Some(Arc::new(o))
    } else {
        None
    };
    let overlay_dir = overlay.as_ref().map(|o| o.dir().to_path_buf());
    let mut export = VersionExport::with_overlay(base, overlay, stats);
    if let Some(r) = recorder {
        export = export.with_recorder(r.clone());
    }
    let export = Arc::new(export);
    Ok(Opened {
        name: name.to_string(),
        export,
        described: format!("{version} ({})", id.short()),
        version,
        id: id.to_hex(),
        overlay: overlay_dir,
    })
}

/// The overlay in `dir` holds writes on another version than `requested`: say which, and
/// the ways out.
async fn base_mismatch(
    repo: &Repo,
    dir: &Path,
    explicit: bool,
    name: &str,
    requested: &str,
    requested_id: &Id,
) -> anyhow::Error {
    let info = match Overlay::inspect(dir) {
        Ok(i) => i,
        Err(e) => return anyhow::Error::new(e),
    };
    let o = dir.display();
    let discard = if explicit {
        format!("`cairn overlay discard {o} --yes`")
    } else {
        format!("`cairn overlay discard {name} --yes`")
    };
    let short = &info.base[..info.base.len().min(12)];
    let held = bytes(info.held_bytes);
    let base = match info.base.parse::<Id>() {
        Ok(id) => match repo.deleted_versions().await {
            Ok(deleted) if deleted.contains(&id) => None,
            _ => repo.load_version(&id).await.ok(),
        },
        Err(_) => None,
    };
    let Some(base) = base else {
        return anyhow::anyhow!(
            "overlay {o} holds {held} of writes made over version {short}, which this \
             repository does not have (not over {requested} ({})): discard them with {discard}",
            requested_id.short()
        );
    };
    let base = format!("{}@{}", base.image, base.seq);
    let overlay_flag = if explicit {
        format!(" --overlay {o}")
    } else {
        String::new()
    };
    anyhow::anyhow!(
        "overlay {o} holds {held} of writes made over {base} ({short}), not over {requested} \
         ({}): continue with `cairn export {base} --writable --name {name}{overlay_flag}`, \
         commit them while that runs with `cairn commit IMAGE --from-export {name}`, or \
         discard them with {discard}",
        requested_id.short()
    )
}
/// One export: its counters; several: an object of counters by export name.
fn stats_json(stats: &[(String, Arc<ExportStats>)]) -> Value {
    match stats {
        [(_, one)] => one.to_json(),
        many => Value::Object(
            many.iter()
                .map(|(name, s)| (name.clone(), s.to_json()))
                .collect(),
        ),
    }
}

async fn write_stats(path: PathBuf, stats: Vec<(String, Arc<ExportStats>)>) {
    loop {
        if let Err(e) = replace_file(&path, stats_json(&stats).to_string().as_bytes()) {
            tracing::debug!("cannot write {}: {e}", path.display());
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Replaces `path` with `data` atomically: a temporary with a name nobody can guess, created
/// new and never through a symbolic link (a planted link must not make root overwrite the
/// file it points at), renamed into place.
fn replace_file(path: &std::path::Path, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = path.with_file_name(format!(".{name}.{:016x}.tmp", rand::random::<u64>()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW)
        .mode(0o644)
        .open(&tmp)
        .and_then(|mut f| f.write_all(data));
    let renamed = written.and_then(|()| std::fs::rename(&tmp, path));
    if renamed.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    renamed
}

/// `cairn status NAME`.
pub async fn status(ctx: &Context, args: StatusArgs) -> Result<ExitCode> {
    let v = control::request(&args.name, Request::Status)
        .await
        .map_err(anyhow::Error::msg)?;
    if ctx.json {
        print_json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    let s = &v["stats"];
    let n = |k: &str| s[k].as_u64().unwrap_or(0);
    outln!(
        "{} serves {}@{} ({}), {}{}",
        args.name,
        v["image"].as_str().unwrap_or_default(),
        v["seq"],
        &v["id"].as_str().unwrap_or_default()[..12],
        bytes(v["size"].as_u64().unwrap_or(0)),
        if v["writable"] == json!(true) {
            ", writable"
        } else {
            ""
        }
    );
    outln!(
        "read {} in {} requests ({} of zeros); fetched {} in {} chunks from the repository; cache {} hits, {} misses, {} read ahead",
        bytes(n("read_bytes")),
        n("reads"),
        bytes(n("zero_read_bytes")),
        bytes(n("fetched_bytes")),
        n("chunks_fetched"),
        n("cache_hits"),
        n("cache_misses"),
        n("readahead_chunks"),
    );
    if n("seeded_bytes") > 0 {
        outln!("served {} from local seeds", bytes(n("seeded_bytes")));
    }
    if n("prefetched_bytes") > 0 {
        outln!(
            "fetched {} ahead of the client from its boot profile",
            bytes(n("prefetched_bytes"))
        );
    }
    if let Some(o) = v.get("overlay") {
        outln!(
            "overlay {}: {} in {} blocks, {} layers; {} writes ({}), {} flushes",
            o["dir"].as_str().unwrap_or_default(),
            bytes(o["held_bytes"].as_u64().unwrap_or(0)),
            o["blocks_held"],
            o["layers"],
            n("writes"),
            bytes(n("written_bytes")),
            n("flushes"),
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `cairn overlay snapshot|rollback|delete|list EXPORT [NAME]`; `overlay list` and
/// `overlay discard NAME` work on overlays on disk (see `exports.rs`).
pub async fn overlay(ctx: &Context, args: OverlayArgs) -> Result<ExitCode> {
    let (export, req) = match &args.action {
        OverlayAction::Snapshot { export, name } => {
            (export, Request::Snapshot { name: name.clone() })
        }
        OverlayAction::Rollback {
            export,
            name,
            force,
        } => (
            export,
            Request::Rollback {
                name: name.clone(),
                force: *force,
            },
        ),
        OverlayAction::Delete { export, name } => (export, Request::Delete { name: name.clone() }),
        OverlayAction::List {
            export: Some(export),
        } => (export, Request::Snapshots),
        OverlayAction::List { export: None } => return exports::list_overlays(ctx).await,
        OverlayAction::Discard { name, yes } => {
            return exports::discard_overlay(ctx, name, *yes).await
        }
    };
    let done = match &req {
        Request::Snapshot { name } => Some(format!("took snapshot {name}")),
        Request::Rollback { name, .. } => Some(format!(
            "rolled back to snapshot {name}: the writes since are gone"
        )),
        Request::Delete { name } => Some(format!("deleted snapshot {name}")),
        _ => None,
    };
    let rollback = matches!(req, Request::Rollback { .. });
    let v = control::request(export, req)
        .await
        .map_err(|e| match rollback {
            true => anyhow::anyhow!("{export}: {e}"),
            false => anyhow::Error::msg(e),
        })?;
    let clients = v["clients"].as_u64().unwrap_or(0);
    if rollback && clients > 0 {
        // The guest's caches still hold what it wrote after the snapshot: its file systems
        // now disagree with the disk under them.
        ctx.warn(&format!(
            "{export} has {clients} NBD {} connected: a running guest does not know its disk \
             was rolled back; restart it (or detach and attach the disk) before it writes more",
            if clients == 1 { "client" } else { "clients" }
        ));
    }
    if ctx.json {
        print_json(&json!({ "snapshots": v["snapshots"], "tree": v["tree"], "clients": clients }));
    } else {
        let list = snapshot_list(&v["tree"]);
        match done {
            Some(done) => outln!("{export}: {done}; {list}"),
            None => outln!("{export}: {list}"),
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// "snapshots a, b" (oldest first); when some are on another branch than the disk's, also
/// the snapshot the disk now sits on, and each branch's parent.
fn snapshot_list(tree: &Value) -> String {
    let snaps = tree.as_array().cloned().unwrap_or_default();
    if snaps.is_empty() {
        return "no snapshots".to_string();
    }
    let name = |s: &Value| s["name"].as_str().unwrap_or_default().to_string();
    let linear = snaps.iter().all(|s| s["current_path"] == json!(true));
    let names: Vec<String> = snaps
        .iter()
        .map(|s| match (linear, s["parent"].as_str()) {
            (false, Some(p)) => format!("{} (on {p})", name(s)),
            _ => name(s),
        })
        .collect();
    let mut list = format!("snapshots {}", names.join(", "));
    if !linear {
        match snaps
            .iter()
            .rev()
            .find(|s| s["current_path"] == json!(true))
        {
            Some(s) => list.push_str(&format!("; the disk is at {} and later writes", name(s))),
            None => list.push_str("; the disk is on none of them"),
        }
    }
    list
}

/// `cairn commit IMAGE --from-export NAME`.
pub async fn commit_from(
    ctx: &Context,
    image: &str,
    export: &str,
    message: &str,
    force: bool,
) -> Result<ExitCode> {
    if image.is_empty() {
        bail!("give the image to commit into");
    }
    let v = control::request(
        export,
        Request::Commit {
            image: image.to_string(),
            message: message.to_string(),
            force,
        },
    )
    .await
    .map_err(anyhow::Error::msg)?;
    if ctx.json {
        print_json(&v);
    } else {
        outln!(
            "committed {}@{} {} from export {export} — {} new chunks ({}), {} stored",
            v["image"].as_str().unwrap_or_default(),
            v["seq"],
            &v["id"].as_str().unwrap_or_default()[..12],
            v["new_chunks"],
            bytes(v["new_chunk_bytes"].as_u64().unwrap_or(0)),
            bytes(v["stored_bytes"].as_u64().unwrap_or(0)),
        );
    }
    Ok(ExitCode::SUCCESS)
}

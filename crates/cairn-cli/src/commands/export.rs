//! `cairn export VERSION`: serve a version over NBD, fetching data on demand.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context as _, Result};
use cairn_engine::resolve::{resolve, VersionSpec};
use cairn_export::control::{self, Handler};
use cairn_export::{Base, ContentCache, ExportStats, VersionExport};
use cairn_nbd::Server;
use cairn_overlay::Overlay;
use cairn_repo::Repo;
use serde_json::{json, Value};

use crate::cli::{ExportArgs, OverlayAction, OverlayArgs, StatusArgs};
use crate::context::Context;
use crate::output::{bytes, print_json};

pub async fn run(ctx: &Context, args: ExportArgs) -> Result<ExitCode> {
    if args.specs.len() > 1 && (args.name.is_some() || args.overlay.is_some()) {
        bail!("with several versions, name each as VERSION=NAME (--name and --overlay take one)");
    }
    let repo = ctx.open_as("export").await?;
    let cache_dir = args
        .cache_dir
        .clone()
        .unwrap_or_else(ContentCache::default_chunk_dir);
    let cache = Arc::new(
        ContentCache::open(&cache_dir, args.cache_size)
            .with_context(|| format!("cannot open the chunk cache {}", cache_dir.display()))?,
    );
    let mut server = Server::new();
    let mut served_stats = Vec::new();
    let mut lines = Vec::new();
    for spec in &args.specs {
        let (version, explicit) = match spec.split_once('=') {
            Some((v, n)) => (v, Some(n.to_string())),
            None => (spec.as_str(), None),
        };
        let (name, export, described) = open_export(
            &repo,
            &cache,
            &args,
            version,
            explicit.or(args.name.clone()),
        )
        .await?;
        server.set_description(&name, format!("cairn {described}"));
        server.add_export(&name, export.clone());
        if args.specs.len() == 1 {
            server.set_default_export(export.clone());
        }
        served_stats.push((name.clone(), export.stats().clone()));
        lines.push((name, described));
    }
    let server = Arc::new(server);
    if let Some(path) = args.stats_file.clone() {
        tokio::spawn(write_stats(path, served_stats.clone()));
    }

    let served = if args.stdio || std::env::var_os("LISTEN_FDS").is_some() {
        if std::env::var_os("LISTEN_FDS").is_some() {
            cairn_nbd::serve_socket_activation(server).await
        } else {
            cairn_nbd::serve_stdio(server)
                .await
                .map_err(std::io::Error::other)
        }
    } else if let Some(addr) = &args.listen {
        for (name, described) in &lines {
            ctx.note(&format!("serving {described} as nbd://{addr}/{name}"));
        }
        cairn_nbd::serve_tcp(server, addr.as_str()).await
    } else {
        let path = match &args.socket {
            Some(p) => p.clone(),
            None => default_socket(&lines[0].0)?,
        };
        for (name, described) in &lines {
            ctx.note(&format!(
                "serving {described} as nbd+unix:///{name}?socket={}",
                path.display()
            ));
        }
        cairn_nbd::serve_unix(server, &path).await
    };
    if let Some(path) = &args.stats_file {
        let _ = std::fs::write(path, stats_json(&served_stats).to_string());
    }
    served.context("nbd server")?;
    Ok(ExitCode::SUCCESS)
}

/// Opens one export: resolves the version, opens its base (and overlay), starts its control
/// socket. Returns (name, export, description).
async fn open_export(
    repo: &Arc<Repo>,
    cache: &Arc<ContentCache>,
    args: &ExportArgs,
    version: &str,
    name: Option<String>,
) -> Result<(String, Arc<VersionExport>, String)> {
    let spec = VersionSpec::parse(version)?;
    let (id, record) = resolve(repo, &spec).await?;
    let stats = Arc::new(ExportStats::default());
    let base = Base::open(
        repo.clone(),
        cache.clone(),
        stats.clone(),
        id,
        record.clone(),
        args.readahead,
    )
    .await
    .with_context(|| format!("cannot open {}@{}", record.image, record.seq))?;
    let name = name.unwrap_or_else(|| record.image.clone());
    let overlay = if args.writable {
        let dir = args
            .overlay
            .clone()
            .unwrap_or_else(|| default_overlay_dir(&name));
        let block = repo.config().chunk_size;
        let o = Overlay::open(&dir, record.logical_size, block, &id.to_hex())
            .with_context(|| format!("cannot open the overlay {}", dir.display()))?;
        let held = o.stats().blocks_held;
        if held > 0 {
            eprintln!(
                "reopened the overlay {} with {held} blocks written",
                dir.display()
            );
        }
        Some(Arc::new(o))
    } else {
        None
    };
    let export = Arc::new(VersionExport::with_overlay(base, overlay, stats));
    let ctl = control::socket_path(&name);
    tokio::spawn({
        let handler = handler(export.clone(), repo.clone(), cache.clone(), args.readahead);
        let ctl = ctl.clone();
        async move {
            if let Err(e) = control::serve(&ctl, handler).await {
                tracing::error!("control socket {}: {e}", ctl.display());
            }
        }
    });
    let described = format!("{}@{} ({})", record.image, record.seq, id.short());
    Ok((name, export, described))
}

fn default_socket(name: &str) -> Result<PathBuf> {
    let dir = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join("cairn");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir.join(format!("{}.sock", name.replace('/', "_"))))
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
        let tmp = path.with_extension("tmp");
        if std::fs::write(&tmp, stats_json(&stats).to_string()).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

fn default_overlay_dir(name: &str) -> PathBuf {
    std::env::var_os("XDG_STATE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/state")))
        .unwrap_or_else(std::env::temp_dir)
        .join("cairn/overlays")
        .join(name.replace('/', "_"))
}

/// What the control socket of this export answers.
fn handler(
    export: Arc<VersionExport>,
    repo: Arc<Repo>,
    cache: Arc<ContentCache>,
    readahead: usize,
) -> Handler {
    Arc::new(move |req: Value| {
        let (export, repo, cache) = (export.clone(), repo.clone(), cache.clone());
        Box::pin(async move {
            let op = req["op"].as_str().unwrap_or_default().to_string();
            let name = req["name"].as_str().unwrap_or_default().to_string();
            let overlay = || {
                export
                    .overlay()
                    .cloned()
                    .ok_or_else(|| "the export is read-only".to_string())
            };
            match op.as_str() {
                "status" => Ok(status_json(&export)),
                "commit" => {
                    let image = req["image"].as_str().ok_or("commit needs an image")?;
                    let message = req["message"].as_str().unwrap_or_default().to_string();
                    // A session of its own, registered now, so that GC's plans cover it.
                    let session = Repo::open_cached(
                        repo.store().clone(),
                        "commit",
                        repo.meta_cache().cloned(),
                    )
                    .await
                    .map(Arc::new)
                    .map_err(|e| e.to_string())?;
                    let r = export
                        .commit(session.clone(), image, message, readahead, cache)
                        .await;
                    if r.is_err() {
                        // What the failed commit stored is unreferenced: take it back.
                        session.discard_unindexed_packs().await;
                    }
                    let _ = session.close().await;
                    let r = r.map_err(|e| e.to_string())?;
                    Ok(json!({
                        "id": r.id.to_hex(),
                        "image": r.record.image,
                        "seq": r.record.seq,
                        "parent": r.record.parent.map(|p| p.to_hex()),
                        "logical_size": r.record.logical_size,
                        "new_chunks": r.record.stats.new_chunks,
                        "new_chunk_bytes": r.record.stats.new_chunk_bytes,
                        "stored_bytes": r.record.stats.stored_bytes,
                    }))
                }
                "snapshot" | "rollback" | "delete" => {
                    let o = overlay()?;
                    tokio::task::spawn_blocking(move || match op.as_str() {
                        "snapshot" => o.snapshot(&name),
                        "rollback" => o.rollback(&name),
                        _ => o.delete_snapshot(&name),
                    })
                    .await
                    .map_err(|e| e.to_string())?
                    .map_err(|e| e.to_string())?;
                    Ok(json!({ "snapshots": overlay()?.snapshots() }))
                }
                "snapshots" => Ok(json!({ "snapshots": overlay()?.snapshots() })),
                other => Err(format!("unknown operation {other:?}")),
            }
        })
    })
}

fn status_json(export: &VersionExport) -> Value {
    let base = export.base();
    let mut v = json!({
        "image": base.record().image,
        "seq": base.record().seq,
        "id": base.id().to_hex(),
        "size": base.size(),
        "writable": export.overlay().is_some(),
        "stats": export.stats().to_json(),
    });
    if let Some(o) = export.overlay() {
        let s = o.stats();
        v["overlay"] = json!({
            "dir": o.dir().display().to_string(),
            "blocks_held": s.blocks_held,
            "bytes_held": s.bytes_held,
            "layers": s.layers,
            "data_bytes_allocated": s.data_bytes_allocated,
            "snapshots": o.snapshots(),
        });
    }
    v
}

/// `cairn status NAME`.
pub async fn status(ctx: &Context, args: StatusArgs) -> Result<ExitCode> {
    let v = control::request(&args.name, json!({"op": "status"}))
        .await
        .map_err(anyhow::Error::msg)?;
    if ctx.json {
        print_json(&v);
        return Ok(ExitCode::SUCCESS);
    }
    let s = &v["stats"];
    let n = |k: &str| s[k].as_u64().unwrap_or(0);
    println!(
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
    println!(
        "read {} in {} requests ({} of zeros); fetched {} in {} chunks from the repository; cache {} hits, {} misses, {} read ahead",
        bytes(n("bytes_read")),
        n("reads"),
        bytes(n("zero_bytes_read")),
        bytes(n("bytes_fetched")),
        n("chunks_fetched"),
        n("cache_hits"),
        n("cache_misses"),
        n("readahead_chunks"),
    );
    if let Some(o) = v.get("overlay") {
        println!(
            "overlay {}: {} in {} blocks, {} layers; {} writes ({}), {} flushes",
            o["dir"].as_str().unwrap_or_default(),
            bytes(o["bytes_held"].as_u64().unwrap_or(0)),
            o["blocks_held"],
            o["layers"],
            n("writes"),
            bytes(n("bytes_written")),
            n("flushes"),
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// `cairn overlay snapshot|rollback|delete|list EXPORT [NAME]`.
pub async fn overlay(ctx: &Context, args: OverlayArgs) -> Result<ExitCode> {
    let (export, req) = match &args.action {
        OverlayAction::Snapshot { export, name } => {
            (export, json!({"op": "snapshot", "name": name}))
        }
        OverlayAction::Rollback { export, name } => {
            (export, json!({"op": "rollback", "name": name}))
        }
        OverlayAction::Delete { export, name } => (export, json!({"op": "delete", "name": name})),
        OverlayAction::List { export } => (export, json!({"op": "snapshots"})),
    };
    let v = control::request(export, req)
        .await
        .map_err(anyhow::Error::msg)?;
    if ctx.json {
        print_json(&json!({ "snapshots": v["snapshots"] }));
    } else {
        let names: Vec<&str> = v["snapshots"]
            .as_array()
            .map(|a| a.iter().filter_map(|s| s.as_str()).collect())
            .unwrap_or_default();
        if names.is_empty() {
            println!("{export}: no snapshots");
        } else {
            println!("{export}: snapshots {}", names.join(", "));
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `cairn commit IMAGE --from-export NAME`.
pub async fn commit_from(
    ctx: &Context,
    image: &str,
    export: &str,
    message: &str,
) -> Result<ExitCode> {
    if image.is_empty() {
        bail!("give the image to commit into");
    }
    let v = control::request(
        export,
        json!({"op": "commit", "image": image, "message": message}),
    )
    .await
    .map_err(anyhow::Error::msg)?;
    if ctx.json {
        print_json(&v);
    } else {
        println!(
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

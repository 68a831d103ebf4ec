//! `cairn export VERSION`: serve a version over NBD, fetching data on demand.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result};
use cairn_engine::resolve::{resolve, VersionSpec};
use cairn_export::{Base, ChunkCache, ExportStats, VersionExport};
use cairn_nbd::Server;

use crate::cli::ExportArgs;
use crate::context::Context;

pub async fn run(ctx: &Context, args: ExportArgs) -> Result<ExitCode> {
    let spec = VersionSpec::parse(&args.spec)?;
    let repo = ctx.open_as("export").await?;
    let (id, record) = resolve(&repo, &spec).await?;
    let cache_dir = args
        .cache_dir
        .clone()
        .unwrap_or_else(ChunkCache::default_dir);
    let cache = Arc::new(
        ChunkCache::open(&cache_dir, args.cache_size)
            .with_context(|| format!("cannot open the chunk cache {}", cache_dir.display()))?,
    );
    let stats = Arc::new(ExportStats::default());
    let base = Base::open(
        repo.clone(),
        cache,
        stats.clone(),
        id,
        record.clone(),
        args.readahead,
    )
    .await
    .with_context(|| format!("cannot open {}@{}", record.image, record.seq))?;
    let name = args.name.clone().unwrap_or_else(|| record.image.clone());
    let export = Arc::new(VersionExport::new(base, stats.clone()));
    let mut server = Server::new().with_export(&name, export.clone());
    server.set_description(
        &name,
        format!("cairn {}@{} ({})", record.image, record.seq, id.short()),
    );
    let server = Arc::new(server.with_default_export(export));
    if let Some(path) = args.stats_file.clone() {
        tokio::spawn(write_stats(path, stats.clone()));
    }

    let described = format!("{}@{} ({})", record.image, record.seq, id.short());
    let served = if args.stdio || std::env::var_os("LISTEN_FDS").is_some() {
        if std::env::var_os("LISTEN_FDS").is_some() {
            cairn_nbd::serve_socket_activation(server).await
        } else {
            cairn_nbd::serve_stdio(server)
                .await
                .map_err(std::io::Error::other)
        }
    } else if let Some(addr) = &args.listen {
        eprintln!("serving {described} as nbd://{addr}/{name}");
        cairn_nbd::serve_tcp(server, addr.as_str()).await
    } else {
        let path = match &args.socket {
            Some(p) => p.clone(),
            None => default_socket(&name)?,
        };
        eprintln!(
            "serving {described} as nbd+unix:///{name}?socket={}",
            path.display()
        );
        cairn_nbd::serve_unix(server, &path).await
    };
    if let Some(path) = &args.stats_file {
        let _ = std::fs::write(path, stats.to_json().to_string());
    }
    served.context("nbd server")?;
    Ok(ExitCode::SUCCESS)
}

fn default_socket(name: &str) -> Result<PathBuf> {
    let dir = std::env::var_os("XDG_RUNTIME_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir)
        .join("cairn");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir.join(format!("{}.sock", name.replace('/', "_"))))
}

async fn write_stats(path: PathBuf, stats: Arc<ExportStats>) {
    loop {
        let tmp = path.with_extension("tmp");
        if std::fs::write(&tmp, stats.to_json().to_string()).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

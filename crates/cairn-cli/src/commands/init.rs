use std::process::ExitCode;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result};
use cairn_format::config::{Chunker, Compression, RepoConfig, V2Settings};
use cairn_format::crypto::KdfParams;
use cairn_repo::Repo;
use serde_json::json;

use crate::cli::{ChunkerArg, CompressionArg, InitArgs};
use crate::context::Context;
use crate::output::{bytes, print_json};

pub async fn run(ctx: &Context, args: InitArgs) -> Result<ExitCode> {
    let config = RepoConfig {
        repo_id: RepoConfig::new_repo_id(),
        created_ns: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos() as i64)
            .unwrap_or(0),
        ..settings(&args)?
    };
    config
        .validate()
        .map_err(|e| anyhow::anyhow!("{}", e.to_string().trim_start_matches("config: ")))?;
    if let Some(path) = ctx.local_path() {
        refuse_non_empty(&path)?;
    }
    // Asked before anything is created. Exit status 5, as every missing or wrong passphrase.
    let passphrase = match config.v2.is_some_and(|v| v.encrypted()) {
        true => Some(
            ctx.password
                .read_new()
                .map_err(|e| cairn_repo::RepoError::NoPassphrase(format!("{e:#}")))?,
        ),
        false => None,
    };
    let store = ctx.store(true)?;
    let repo = match passphrase {
        Some(passphrase) => {
            Repo::init_encrypted(store, config.clone(), passphrase, KdfParams::DEFAULT).await?
        }
        None => Repo::init(store, config.clone()).await?,
    };
    let config = repo.config().clone();
    repo.close().await?;
    if let Some(path) = ctx.local_path() {
        cairn_store::LocalStore::open(&path)?
            .create_reserve(args.reserve)
            .context("the repository was created, but its space reserve was not")?;
    }
    if ctx.json {
        print_json(&json!({
            "repository": repo.describe(),
            "chunker": config.chunker.name(),
            "chunk_size": config.chunk_size,
            "segment_size": config.segment_size,
            "pack_size": config.pack_target,
            "summary_bits": config.summary_bits,
            "format": config.format(),
            "group_size": config.v2.map(|v| v.group_size),
            "encrypted": config.v2.is_some_and(|v| v.encrypted()),
            "compression": match config.compression {
                Compression::None => "none".to_string(),
                Compression::Zstd { level } => format!("zstd:{level}"),
            },
        }));
    } else {
        let groups = config
            .v2
            .map(|v| format!(" in groups of up to {}", bytes(v.group_size as u64)))
            .unwrap_or_default();
        let encrypted = if config.v2.is_some_and(|v| v.encrypted()) {
            ", encrypted"
        } else {
            ""
        };
        outln!(
            "initialized cairn repository (format {}{encrypted}) at {} ({} chunks of {}{groups}, segments of {})",
            config.format(),
            repo.describe(),
            config.chunker.name(),
            bytes(config.chunk_size as u64),
            bytes(config.segment_size as u64)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Refuses a directory that holds anything: a repository never mixes with other files (GC
/// and `verify` would walk them; deleting the repository would delete them). A repository
/// already there is refused too, by `Repo::init`, with its own message.
fn refuse_non_empty(path: &std::path::Path) -> Result<()> {
    let Ok(entries) = std::fs::read_dir(path) else {
        return Ok(()); // not there yet (or unreadable: creating it says why)
    };
    let names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    if names.is_empty() || names.iter().any(|n| n == "config") {
        return Ok(());
    }
    let mut shown: Vec<&str> = names.iter().map(String::as_str).take(3).collect();
    shown.sort_unstable();
    anyhow::bail!(
        "{} is not empty ({} {}: {}{}): `cairn init` needs a new or empty directory",
        path.display(),
        names.len(),
        if names.len() == 1 { "entry" } else { "entries" },
        shown.join(", "),
        if names.len() > 3 { ", …" } else { "" }
    )
}

/// The repository settings the flags ask for (no id or creation time yet).
fn settings(args: &InitArgs) -> Result<RepoConfig> {
    let to_u32 =
        |v: u64, what: &str| u32::try_from(v).with_context(|| format!("{what} {v} is too large"));
    let format = match args.format {
        Some(1) => anyhow::bail!(
            "format 1 is read-only in this cairn: `cairn init` makes format 2, and `cairn copy \
             --from OLD` moves a format 1 repository into one"
        ),
        Some(f) => f,
        None => 2,
    };
    debug_assert_eq!(format, 2, "clap admits formats 1 and 2");
    let mut defaults = RepoConfig::default_v2();
    if let Some(g) = args.group_size {
        defaults.v2 = Some(V2Settings {
            group_size: to_u32(g, "group size")?,
            key_check: None,
        });
    }
    if args.encrypt {
        // Marks the config encrypted; init puts the real key check in.
        if let Some(v2) = defaults.v2.as_mut() {
            v2.key_check = Some([0; 32]);
        }
    }
    Ok(RepoConfig {
        chunker: match args.chunker {
            ChunkerArg::Fixed => Chunker::Fixed,
            ChunkerArg::Fastcdc => Chunker::FastCdc,
        },
        chunk_size: match args.chunk_size {
            Some(c) => to_u32(c, "chunk size")?,
            None => defaults.chunk_size,
        },
        segment_size: to_u32(args.segment_size, "segment size")?,
        compression: match args.compression {
            CompressionArg::Zstd => Compression::Zstd {
                level: args.zstd_level,
            },
            CompressionArg::None => Compression::None,
        },
        pack_target: to_u32(args.pack_size, "pack size")?,
        summary_bits: args.summary_bits,
        ..defaults
    })
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Command};

    /// The defaults live in cairn-format; the flags' defaults (text, for the help) must agree.
    #[test]
    fn the_flags_default_to_the_formats_defaults() {
        let parse = |argv: &[&str]| {
            let Command::Init(args) = Cli::try_parse_from(argv).unwrap().command else {
                panic!("not init");
            };
            settings(&args).unwrap()
        };
        assert_eq!(parse(&["cairn", "init"]), RepoConfig::default_v2());
        assert_eq!(
            parse(&["cairn", "init", "--format", "2"]),
            RepoConfig::default_v2()
        );
        let Command::Init(args) = Cli::try_parse_from(["cairn", "init", "--format", "1"])
            .unwrap()
            .command
        else {
            panic!("not init");
        };
        let err = settings(&args).unwrap_err().to_string();
        assert!(err.contains("format 1 is read-only"), "{err}");
    }
}

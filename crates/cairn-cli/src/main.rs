//! The `cairn` binary: flags → settings → engine calls → text or JSON.
//!
//! Error policy: library crates return typed errors; here they become one line on stderr,
//! `cairn: error: ...` (one JSON object under `--json`), with a stable code and an exit status
//! by kind: see [`failure`]. What commands print goes through [`output`], which survives a
//! closed pipe.
//!
//! Signals: SIGINT and SIGTERM stop long work (commit, restore, verify, gc, rm, prune) at its
//! next safe point, through the same cleanup as any failure (unpublished packs deleted,
//! temporary files removed, GC plan withdrawn, session closed), then exit 130 or 143 with one
//! line. A second signal, or a cleanup that takes longer than [`CLEANUP_GRACE`], exits at
//! once; what is left then (a session, a temporary file) belongs to a dead process, which
//! the next `cairn gc` recognises and removes. Other commands exit at once.

#[macro_use]
mod output;
mod cli;
mod commands;
mod context;
mod failure;
mod in_place_marker;
mod password;
mod progress;
mod provenance;

use std::process::ExitCode;
use std::time::Duration;

use cairn_engine::interrupt;
use clap::Parser;
use tracing_subscriber::EnvFilter;

use crate::cli::{Cli, Command};
use crate::context::Context;

/// glibc raises its mmap threshold to the size of each large block freed (up to 32 MiB), after
/// which a commit's 16 MiB pack buffers come from per-thread arenas that keep their pages once
/// the upload thread frees them. A fixed threshold (which also turns the raising off) gives
/// every large buffer a mapping of its own, returned whole when freed: a 64 GiB image's
/// first commit peaks at 114–129 MiB instead of 172–201, its re-commit at 91–95 instead of
/// 104–110, for 0.5–1 s more system time in the first commit's 13 s (fresh pages for each
/// pack). A pool of pack buffers instead kept more memory (157 MiB: buffers idle between
/// bursts) and was not kept (BENCHMARKS.md, *Studies behind the design*).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn fix_malloc_mmap_threshold() {
    // SAFETY: mallopt only sets an allocator parameter; it runs first in `main`, before any
    // other thread exists or anything is allocated on one.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn fix_malloc_mmap_threshold() {}

/// A `CAIRN_*` variable set to the empty string counts as unset, as in a shell's `${VAR:-…}`
/// (`CAIRN_PASSWORD_FILE= cairn …` would otherwise be a flag given without its value). Runs
/// first, while the process has one thread: changing the environment races nothing.
fn unset_empty_cairn_variables() {
    let empty: Vec<std::ffi::OsString> = std::env::vars_os()
        .filter(|(k, v)| k.to_string_lossy().starts_with("CAIRN_") && v.is_empty())
        .map(|(k, _)| k)
        .collect();
    for k in empty {
        std::env::remove_var(k);
    }
}

fn main() -> ExitCode {
    fix_malloc_mmap_threshold();
    unset_empty_cairn_variables();
    let cli = parse_command_line();
    init_logging(cli.verbose);
    let limits = match cli.index_memory {
        Some(mib) => cairn_repo::v2::CacheLimits::for_index_memory(mib.saturating_mul(1 << 20)),
        None => cairn_repo::v2::CacheLimits::BUILT_IN,
    };
    cairn_repo::v2::CacheLimits::set_process_default(match cli.command {
        Command::Commit(_) => limits.for_commit(),
        _ => limits,
    });
    let json = cli.json;
    // Every commit of the process takes this default, those without a `--dedup` of their own
    // too (an export's COMMIT, `cairn copy`): a bad value is refused before anything runs.
    if let Err(value) = cairn_engine::commit::DedupMode::from_env() {
        let env = cairn_engine::commit::DEDUP_ENV;
        failure::print_error(
            failure::Kind::USAGE,
            &format!("{env}={value:?}: expected exact or bounded"),
            json,
        );
        return ExitCode::from(failure::Kind::USAGE.exit);
    }
    let ctx = Context::new(&cli);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            return failure::report(
                &anyhow::anyhow!("cannot start the async runtime: {e}"),
                json,
            )
        }
    };
    let graceful = stops_gracefully(&cli.command);
    // An export (and `vm start`, which serves one) and a mount stop on signals by themselves.
    let watches_signals = !matches!(
        &cli.command,
        Command::Export(_)
            | Command::Mount(_)
            | Command::Vm(cli::VmArgs {
                action: cli::VmAction::Start { .. }
            })
    );
    let result = runtime.block_on(async {
        if watches_signals {
            // Installed here, before the command starts, not inside the spawned task: a
            // signal must never meet the default disposition once a session may exist.
            use tokio::signal::unix::{signal, SignalKind};
            if let (Ok(int), Ok(term)) = (
                signal(SignalKind::interrupt()),
                signal(SignalKind::terminate()),
            ) {
                tokio::spawn(watch_signals(graceful, int, term));
            }
        }
        let result = match cli.command {
            Command::Init(args) => commands::init::run(&ctx, args).await,
            Command::Commit(args) => commands::commit::run(&ctx, args).await,
            Command::Log(args) => commands::log::run(&ctx, args).await,
            Command::Clone(args) => commands::clone::run(&ctx, args).await,
            Command::Copy(args) => commands::copy::run(&ctx, args).await,
            Command::Tag(args) => commands::tag::run(&ctx, args).await,
            Command::Tags(args) => commands::tag::list(&ctx, args).await,
            Command::Rm(args) => commands::rm::run(&ctx, args).await,
            Command::Prune(args) => commands::prune::run(&ctx, args).await,
            Command::Images => commands::images::run(&ctx).await,
            Command::Show(args) => commands::show::run(&ctx, args).await,
            Command::Restore(args) => commands::restore::run(&ctx, args).await,
            Command::Diff(args) => commands::diff::run(&ctx, args).await,
            Command::Verify(args) => commands::verify::run(&ctx, args).await,
            Command::Stats { spec } => commands::stats::run(&ctx, spec.as_deref()).await,
            Command::Repair(args) => commands::repair::run(&ctx, args).await,
            Command::Relayout(args) => commands::relayout::run(&ctx, args).await,
            Command::Gc(args) => commands::gc::run(&ctx, args).await,
            Command::Index(args) => commands::index::run(&ctx, args).await,
            Command::Export(args) => commands::export::run(&ctx, args).await,
            Command::Mount(args) => commands::mount::run(&ctx, args).await,
            Command::Ls(args) => commands::guest::ls(&ctx, args).await,
            Command::Cat(args) => commands::guest::cat(&ctx, args).await,
            Command::Exports(args) => commands::exports::run(&ctx, args).await,
            Command::Status(args) => commands::export::status(&ctx, args).await,
            Command::Overlay(args) => commands::export::overlay(&ctx, args).await,
            Command::Key(args) => commands::key::run(&ctx, args).await,
            Command::Profile(args) => commands::profile::run(&ctx, args).await,
            Command::Vm(args) => commands::vm::run(&ctx, args).await,
            Command::Completions(args) => commands::docs::completions(args),
            Command::Man(args) => commands::docs::man(args),
        };
        ctx.close(result.is_ok()).await;
        result
    });
    match result.and_then(|code| output::finish().map(|()| code)) {
        Ok(code) => code,
        Err(e) => failure::report(&e, json),
    }
}

/// The command line, or exit: help and version on stdout (0); a usage error as clap prints
/// it, or under `--json` as one JSON object (2).
fn parse_command_line() -> Cli {
    match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if e.use_stderr() && std::env::args_os().any(|a| a == "--json") => {
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or("invalid command line");
            let message = first.strip_prefix("error: ").unwrap_or(first);
            failure::print_error(failure::Kind::USAGE, message, true);
            std::process::exit(failure::Kind::USAGE.exit.into());
        }
        Err(e) => e.exit(),
    }
}

/// How long a command interrupted by a signal may take to clean up before it exits anyway.
const CLEANUP_GRACE: Duration = Duration::from_secs(20);

/// Commands that stop at a safe point on SIGINT/SIGTERM (they call `interrupt::check`).
fn stops_gracefully(command: &Command) -> bool {
    match command {
        Command::Commit(args) => args.from_export.is_none(),
        Command::Restore(_)
        | Command::Verify(_)
        | Command::Repair(_)
        | Command::Relayout(_)
        | Command::Gc(_)
        | Command::Index(_)
        | Command::Rm(_)
        | Command::Prune(_)
        | Command::Copy(_) => true,
        Command::Vm(args) => matches!(args.action, cli::VmAction::Backup(_)),
        _ => false,
    }
}

/// Turns SIGINT/SIGTERM into a stop request (or an immediate exit for commands that have
/// nothing to clean up); a second signal or an overlong cleanup exits at once.
async fn watch_signals(
    graceful: bool,
    mut int: tokio::signal::unix::Signal,
    mut term: tokio::signal::unix::Signal,
) {
    let first = tokio::select! {
        _ = int.recv() => libc::SIGINT,
        _ = term.recv() => libc::SIGTERM,
    };
    let name = interrupt::signal_name(first);
    if !graceful {
        eprintln!("cairn: interrupted by {name}");
        std::process::exit(128 + first);
    }
    interrupt::request(first);
    tokio::select! {
        _ = int.recv() => {}
        _ = term.recv() => {}
        _ = tokio::time::sleep(CLEANUP_GRACE) => {}
    }
    eprintln!("cairn: interrupted by {name}; exited before the cleanup finished (`cairn gc` removes what is left)");
    std::process::exit(128 + first);
}

fn init_logging(verbose: u8) {
    // fuser (`cairn mount`) warns of every FUSE call a read-only file system leaves to the
    // kernel's defaults; those are not the operator's concern below -vv.
    let default = match verbose {
        0 => "warn,fuser=error",
        1 => "info,fuser=error",
        _ => "debug",
    };
    let filter = EnvFilter::try_from_env("CAIRN_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

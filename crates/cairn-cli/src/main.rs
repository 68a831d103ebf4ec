//! The `cairn` binary: flags → settings → engine calls → text or JSON.
//!
//! Error policy: library crates return typed errors; here they become one line on stderr,
//! `cairn: error: ...`, with exit status 1 (3 for `verify` finding damage, 2 for usage errors,
//! which clap reports itself).
//!
//! Signals: SIGINT and SIGTERM stop long work (commit, restore, verify, gc, rm, prune) at its
//! next safe point, through the same cleanup as any failure (unpublished packs deleted,
//! temporary files removed, GC plan withdrawn, session closed), then exit 130 or 143 with one
//! line. A second signal, or a cleanup that takes longer than [`CLEANUP_GRACE`], exits at
//! once; what is left then (a session, a temporary file) belongs to a dead process, which
//! the next `cairn gc` recognises and removes. Other commands exit at once.

mod cli;
mod commands;
mod context;
mod output;
mod progress;
mod provenance;

use std::process::ExitCode;
use std::time::Duration;

use cairn_engine::{interrupt, EngineError};
use clap::Parser;
use tracing_subscriber::EnvFilter;

use crate::cli::{Cli, Command};
use crate::context::Context;

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging(cli.verbose);
    let ctx = Context::new(&cli);
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("cairn: error: cannot start the async runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let graceful = stops_gracefully(&cli.command);
    let watches_signals = !matches!(cli.command, Command::Export(_));
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
            Command::Tag(args) => commands::tag::run(&ctx, args).await,
            Command::Tags(args) => commands::tag::list(&ctx, args).await,
            Command::Rm(args) => commands::rm::run(&ctx, args).await,
            Command::Prune(args) => commands::prune::run(&ctx, args).await,
            Command::Images => commands::images::run(&ctx).await,
            Command::Show(args) => commands::show::run(&ctx, args).await,
            Command::Restore(args) => commands::restore::run(&ctx, args).await,
            Command::Diff(args) => commands::diff::run(&ctx, args).await,
            Command::Verify(args) => commands::verify::run(&ctx, args).await,
            Command::Stats => commands::stats::run(&ctx).await,
            Command::Repair(args) => commands::repair::run(&ctx, args).await,
            Command::Gc(args) => commands::gc::run(&ctx, args).await,
            Command::Export(args) => commands::export::run(&ctx, args).await,
            Command::Exports(args) => commands::exports::run(&ctx, args).await,
            Command::Status(args) => commands::export::status(&ctx, args).await,
            Command::Overlay(args) => commands::export::overlay(&ctx, args).await,
        };
        ctx.close(result.is_ok()).await;
        result
    });
    match result {
        Ok(code) => code,
        Err(e) => match interrupted_by(&e) {
            Some(signal) => {
                eprintln!(
                    "cairn: interrupted by {}; stopped cleanly, nothing half-done was kept",
                    interrupt::signal_name(signal)
                );
                ExitCode::from(128 + signal as u8)
            }
            None => {
                eprintln!("cairn: error: {}", one_line(&e));
                ExitCode::from(1)
            }
        },
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
        | Command::Gc(_)
        | Command::Rm(_)
        | Command::Prune(_) => true,
        _ => false,
    }
}

/// The signal behind an interrupted command's error, if that is what ended it.
fn interrupted_by(e: &anyhow::Error) -> Option<i32> {
    e.chain()
        .find_map(|cause| match cause.downcast_ref::<EngineError>() {
            Some(EngineError::Interrupted { .. }) => interrupt::requested(),
            _ => None,
        })
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

/// The whole cause chain on one line, skipping causes whose text a higher level already
/// included in its own message.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = e.to_string();
    for cause in e.chain().skip(1) {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
    }
    line.replace('\n', " ")
}

fn init_logging(verbose: u8) {
    let default = match verbose {
        0 => "warn",
        1 => "info",
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

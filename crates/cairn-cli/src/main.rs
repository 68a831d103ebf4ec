//! The `cairn` binary: flags → settings → engine calls → text or JSON.
//!
//! Error policy: library crates return typed errors; here they become one line on stderr,
//! `cairn: error: ...`, with exit status 1 (3 for `verify` finding damage, 2 for usage errors,
//! which clap reports itself).

mod cli;
mod commands;
mod context;
mod output;
mod progress;
mod provenance;

use std::process::ExitCode;

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
    let result = runtime.block_on(async {
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
            Command::Verify => commands::verify::run(&ctx).await,
            Command::Stats => commands::stats::run(&ctx).await,
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
        Err(e) => {
            eprintln!("cairn: error: {}", one_line(&e));
            ExitCode::from(1)
        }
    }
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

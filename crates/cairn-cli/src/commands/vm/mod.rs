//! `cairn vm`: whole-VM backups (over QMP) and the VM versions they publish.

mod backup;
mod history;
mod instant;
mod restore;

use std::process::ExitCode;

use anyhow::Result;
use cairn_vm::VmError;

use crate::cli::{VmAction, VmArgs};
use crate::context::Context;
use backup::run_backup;
use history::{diff, list, log, prune, rm, show, tag};
use instant::{commit, start};
use restore::restore;

pub async fn run(ctx: &Context, args: VmArgs) -> Result<ExitCode> {
    match args.action {
        VmAction::Backup(args) => run_backup(ctx, args).await,
        VmAction::Log { vm } => log(ctx, &vm).await,
        VmAction::Show { spec, config } => show(ctx, &spec, config).await,
        VmAction::List => list(ctx).await,
        VmAction::Rm { versions, no_gc } => rm(ctx, &versions, no_gc).await,
        VmAction::Prune(args) => prune(ctx, args).await,
        VmAction::Diff { a, b } => diff(ctx, &a, &b).await,
        VmAction::Tag { spec, name, delete } => tag(ctx, &spec, &name, delete).await,
        VmAction::Start {
            spec,
            socket,
            no_memory,
        } => start(ctx, &spec, socket, no_memory).await,
        VmAction::Commit { vm, qmp, message } => commit(ctx, &vm, qmp.as_deref(), &message).await,
        VmAction::Restore {
            spec,
            to,
            format,
            force,
            no_memory,
            define,
            connect,
        } => {
            let libvirt = (define, connect);
            restore(ctx, &spec, &to, format, force, no_memory, libvirt).await
        }
    }
}

/// A VM error as the CLI reports it: repository and engine errors keep their own kinds.
pub(super) fn unwrap(e: VmError) -> anyhow::Error {
    match e {
        VmError::Engine(e) => e.into(),
        VmError::Repo(e) => e.into(),
        other => other.into(),
    }
}

//! `cairn key list|add|remove|passwd`: the passphrases (key slots) of an encrypted repository.

use std::process::ExitCode;

use anyhow::Result;
use cairn_format::crypto::KdfParams;
use cairn_repo::{match_slot, SessionKind};
use serde_json::json;

use crate::cli::{KeyAction, KeyArgs};
use crate::context::Context;
use crate::output::print_json;
use crate::password::new_passphrase;

pub async fn run(ctx: &Context, args: KeyArgs) -> Result<ExitCode> {
    let repo = ctx.open_as(SessionKind::Edit).await?;
    match args.action {
        KeyAction::List => {
            let slots = repo.key_slots().await?;
            if ctx.json {
                print_json(&json!(slots
                    .iter()
                    .map(|s| json!({
                        "slot": s.id.to_hex(),
                        "current": s.current,
                        "kdf": "argon2id",
                        "memory_kib": s.kdf.memory_kib,
                        "passes": s.kdf.passes,
                        "lanes": s.kdf.lanes,
                    }))
                    .collect::<Vec<_>>()));
            } else {
                for s in &slots {
                    outln!(
                        "{} {}argon2id, {} MiB, {} passes, {} lane(s)",
                        s.id.short(),
                        if s.current { "(this passphrase) " } else { "" },
                        s.kdf.memory_kib / 1024,
                        s.kdf.passes,
                        s.kdf.lanes
                    );
                }
            }
        }
        KeyAction::Add { new_password_file } => {
            let passphrase = new_passphrase(new_password_file.as_deref())?;
            let id = repo.add_key_slot(passphrase, KdfParams::DEFAULT).await?;
            report(ctx, "added", "added key slot", &id);
        }
        KeyAction::Remove { slot } => {
            let id = match_slot(&repo.key_slots().await?, &slot)?;
            repo.remove_key_slot(&id).await?;
            report(ctx, "removed", "removed key slot", &id);
        }
        KeyAction::Passwd { new_password_file } => {
            let passphrase = new_passphrase(new_password_file.as_deref())?;
            let old = repo
                .key_slots()
                .await?
                .into_iter()
                .find(|s| s.current)
                .map(|s| s.id);
            let id = repo.add_key_slot(passphrase, KdfParams::DEFAULT).await?;
            // The new slot is stored before the old one goes: a failure in between leaves
            // both passphrases working, never none.
            if let Some(old) = old.filter(|old| *old != id) {
                repo.remove_key_slot(&old).await?;
            }
            report(
                ctx,
                "passwd",
                "changed the passphrase; its key slot is now",
                &id,
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

fn report(ctx: &Context, action: &str, text: &str, id: &cairn_format::Id) {
    if ctx.json {
        print_json(&json!({ "action": action, "slot": id.to_hex() }));
    } else {
        outln!("{text} {}", id.short());
    }
}

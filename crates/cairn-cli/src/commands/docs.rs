//! `cairn completions SHELL` and `cairn man`: generated from the command definitions, so they
//! never disagree with `--help`.

use std::process::ExitCode;

use anyhow::{Context as _, Result};
use clap::CommandFactory;

use crate::cli::{Cli, CompletionsArgs, ManArgs};

pub fn completions(args: CompletionsArgs) -> Result<ExitCode> {
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut Cli::command(), "cairn", &mut script);
    outln!("{}", String::from_utf8_lossy(&script).trim_end());
    Ok(ExitCode::SUCCESS)
}

pub fn man(args: ManArgs) -> Result<ExitCode> {
    let command = Cli::command();
    let Some(dir) = args.dir else {
        let mut page = Vec::new();
        clap_mangen::Man::new(command).render(&mut page)?;
        outln!("{}", String::from_utf8_lossy(&page).trim_end());
        return Ok(ExitCode::SUCCESS);
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    // cairn.1, then cairn-SUBCOMMAND.1 for each command (and nested ones), as git does.
    let mut written = Vec::new();
    write_pages(&command, "cairn", &dir, &mut written)?;
    outln!("wrote {} man pages to {}", written.len(), dir.display());
    Ok(ExitCode::SUCCESS)
}

fn write_pages(
    command: &clap::Command,
    name: &str,
    dir: &std::path::Path,
    written: &mut Vec<std::path::PathBuf>,
) -> Result<()> {
    let command = command.clone().name(name.to_string());
    let path = dir.join(format!("{name}.1"));
    let mut page = Vec::new();
    clap_mangen::Man::new(command.clone()).render(&mut page)?;
    std::fs::write(&path, page).with_context(|| format!("cannot write {}", path.display()))?;
    written.push(path);
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
        write_pages(sub, &format!("{name}-{}", sub.get_name()), dir, written)?;
    }
    Ok(())
}

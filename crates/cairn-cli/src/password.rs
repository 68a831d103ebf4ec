//! Where an encrypted repository's passphrase comes from, in this order: `--password-file`,
//! `--password-command`, `$CAIRN_PASSWORD`, then a prompt — only when standard input is a
//! terminal, so a script without a passphrase fails at once instead of waiting. A passphrase
//! is never taken from argv and never logged; it is asked only when the repository turns out
//! to be encrypted.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context as _, Result};
use cairn_repo::{RepoError, RepoResult};
use zeroize::Zeroizing;

pub type Secret = Zeroizing<Vec<u8>>;

/// The passphrase sources the command line and environment name.
#[derive(Debug, Clone)]
pub struct PasswordSource {
    pub file: Option<PathBuf>,
    pub command: Option<String>,
    /// Which repository's: the names of its variable and flags, for the messages.
    pub names: &'static Names,
}

/// The variable and flags that give one repository's passphrase.
#[derive(Debug)]
pub struct Names {
    pub env: &'static str,
    pub file_flag: &'static str,
    /// `None` where there is no such flag (a new passphrase).
    pub command_flag: Option<&'static str>,
    pub prompt: &'static str,
}

/// The repository at --repo.
pub const REPOSITORY: Names = Names {
    env: "CAIRN_PASSWORD",
    file_flag: "--password-file",
    command_flag: Some("--password-command"),
    prompt: "Passphrase: ",
};

/// The repository `cairn copy --from` reads.
pub const COPY_SOURCE: Names = Names {
    env: "CAIRN_FROM_PASSWORD",
    file_flag: "--from-password-file",
    command_flag: Some("--from-password-command"),
    prompt: "Passphrase of the source (--from): ",
};

impl Default for PasswordSource {
    fn default() -> Self {
        PasswordSource {
            file: None,
            command: None,
            names: &REPOSITORY,
        }
    }
}

impl PasswordSource {
    /// Which source would give a passphrase without asking (a flag, or the variable set),
    /// named as the user gave it; nothing is read.
    pub fn given(&self) -> Option<String> {
        if self.file.is_some() {
            return Some(self.names.file_flag.to_string());
        }
        if self.command.is_some() {
            return self.names.command_flag.map(str::to_string);
        }
        std::env::var_os(self.names.env)
            .filter(|v| !v.is_empty())
            .map(|_| format!("${}", self.names.env))
    }

    /// The passphrase of an existing repository.
    pub fn read(&self) -> Result<Secret> {
        self.read_or_ask(|| ask(self.names))
    }

    /// A new repository's passphrase (`init --encrypt`): the same sources, asked twice at a
    /// terminal.
    pub fn read_new(&self) -> Result<Secret> {
        self.read_or_ask(|| ask_new(self.names))
    }

    fn read_or_ask(&self, ask: impl FnOnce() -> Result<Secret>) -> Result<Secret> {
        if let Some(path) = &self.file {
            return from_file(path);
        }
        if let Some(command) = &self.command {
            return from_command(command, self.names.command_flag.unwrap_or("the command"));
        }
        from_env(self.names.env).unwrap_or_else(ask)
    }
}

impl cairn_repo::Passphrase for PasswordSource {
    fn get(&self) -> RepoResult<Secret> {
        // The message names the source, never the passphrase.
        self.read()
            .map_err(|e| RepoError::NoPassphrase(format!("{e:#}")))
    }
}

/// A new passphrase for `cairn key add|passwd`: `--new-password-file`, `$CAIRN_NEW_PASSWORD`,
/// or asked twice at the terminal.
pub fn new_passphrase(file: Option<&Path>) -> Result<Secret> {
    if let Some(path) = file {
        return from_file(path);
    }
    from_env(NEW.env).unwrap_or_else(|| ask_new(&NEW))
}

/// The passphrase in environment variable `name`, if it is set.
fn from_env(name: &str) -> Option<Result<Secret>> {
    std::env::var_os(name).map(|value| {
        non_empty(
            Zeroizing::new(value.into_encoded_bytes()),
            &format!("${name}"),
        )
    })
}

/// The first line of a file (a trailing newline is not part of the passphrase).
fn from_file(path: &Path) -> Result<Secret> {
    let bytes = Zeroizing::new(
        std::fs::read(path)
            .with_context(|| format!("cannot read the password file {}", path.display()))?,
    );
    non_empty(
        first_line(&bytes),
        &format!("password file {}", path.display()),
    )
}

/// The first line a shell command prints; `flag` names where the command came from.
fn from_command(command: &str, flag: &str) -> Result<Secret> {
    let out = Command::new("sh")
        .arg("-c")
        .arg(command)
        .stdin(Stdio::inherit())
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("cannot run {flag}"))?;
    let stdout = Zeroizing::new(out.stdout);
    if !out.status.success() {
        bail!("{flag} failed ({})", out.status);
    }
    non_empty(first_line(&stdout), &format!("{flag}'s output"))
}

fn first_line(bytes: &[u8]) -> Secret {
    let line = bytes.split(|b| *b == b'\n').next().unwrap_or_default();
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    Zeroizing::new(line.to_vec())
}

fn non_empty(secret: Secret, what: &str) -> Result<Secret> {
    if secret.is_empty() {
        bail!("{what} is empty: an empty passphrase protects nothing");
    }
    Ok(secret)
}

fn ask(names: &Names) -> Result<Secret> {
    if !std::io::stdin().is_terminal() {
        let flags = match names.command_flag {
            Some(command) => format!("{} or {command}", names.file_flag),
            None => names.file_flag.to_string(),
        };
        bail!(
            "no passphrase given: set {} or pass {flags} (standard input is not a terminal \
             to ask at)",
            names.env
        );
    }
    let typed = rpassword::prompt_password(names.prompt).context("cannot read the passphrase")?;
    non_empty(Zeroizing::new(typed.into_bytes()), "the passphrase")
}

/// A new passphrase for a key slot (`cairn key add|passwd`).
const NEW: Names = Names {
    env: "CAIRN_NEW_PASSWORD",
    file_flag: "--new-password-file",
    command_flag: None,
    prompt: "New passphrase: ",
};

/// A new passphrase, asked twice at the terminal; `names` say where else it could come from.
fn ask_new(names: &'static Names) -> Result<Secret> {
    let first = ask(&Names {
        prompt: "New passphrase: ",
        ..*names
    })?;
    let again = ask(&Names {
        prompt: "Repeat it: ",
        ..*names
    })?;
    if first != again {
        bail!("the two passphrases differ; nothing was changed");
    }
    Ok(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_gives_its_first_line_and_an_empty_one_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pw");
        std::fs::write(&path, "correct horse\r\nsecond line\n").unwrap();
        assert_eq!(from_file(&path).unwrap().as_slice(), b"correct horse");
        std::fs::write(&path, "\n").unwrap();
        let e = from_file(&path).unwrap_err().to_string();
        assert!(e.contains("is empty"), "{e}");
        assert!(from_file(&dir.path().join("absent")).is_err());
    }

    #[test]
    fn a_command_gives_its_first_line_and_a_failure_is_named() {
        assert_eq!(
            from_command("printf 'from a vault\\nx'", "--password-command")
                .unwrap()
                .as_slice(),
            b"from a vault"
        );
        let e = from_command("exit 3", "--password-command")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--password-command failed") && e.contains('3'),
            "{e}"
        );
    }
}

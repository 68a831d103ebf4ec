//! How a failed command is reported: one line on stderr (one JSON object under `--json`), a
//! stable code that scripts can match, and an exit status that tells the kinds apart.
//!
//! | code            | exit    | meaning                                                        |
//! |-----------------|---------|----------------------------------------------------------------|
//! | `error`         | 1       | anything not named below                                       |
//! | `not_found`     | 1       | the image, version or tag named (or a path in its guest) does not exist |
//! | `store`         | 1       | the store failed: I/O, S3 request, unreachable endpoint       |
//! | `disk_full`     | 1       | the repository's file system is full                           |
//! | `unsupported`   | 1       | the command writes, and this repository's format is read-only; or a guest file system cairn cannot read |
//! | `usage`         | 2       | the command line is wrong (clap's own message)                 |
//! | `damage`        | 3       | stored data is damaged or missing                              |
//! | `no_repository` | 4       | no repository given, or none at the location given            |
//! | `password`      | 5       | a passphrase is missing or wrong, or given to a plain repository that a command would write (a downgrade?) |
//! | `interrupted`   | 130/143 | SIGINT/SIGTERM stopped the command cleanly                     |
//!
//! The text is the error's whole cause chain on one line (see [`one_line`]); the code is
//! derived from the typed errors in that chain, never from the text.

use std::process::ExitCode;

use cairn_engine::{interrupt, EngineError};
use cairn_repo::RepoError;
use cairn_store::StoreError;
use serde_json::json;

/// No repository was given, or there is none at the location given.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct NoRepository(pub String);

/// A command that writes, on a repository format cairn only reads (format 1).
#[derive(Debug, thiserror::Error)]
#[error(
    "{location} is a format 1 repository, which this cairn only reads (log, show, images, \
     stats, restore, export, diff, verify, copy --from); to keep using it, copy it into a \
     format 2 repository: `cairn --repo NEW init && cairn --repo NEW copy --from {location}`"
)]
pub struct ReadOnlyFormat {
    pub location: String,
}

/// A destructive step refused until the user confirms it (`--yes`) or removes what protects
/// it; the message says which.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct Refused(pub String);

/// A command that would write plaintext into a repository that may have been encrypted:
/// its config says it is not, yet key slots are stored, or a passphrase was given.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct MaybeDowngraded(pub String);

/// What kind of failure an error is: its stable code and exit status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kind {
    pub code: &'static str,
    pub exit: u8,
}

impl Kind {
    const ERROR: Kind = Kind {
        code: "error",
        exit: 1,
    };
    const NOT_FOUND: Kind = Kind {
        code: "not_found",
        exit: 1,
    };
    const STORE: Kind = Kind {
        code: "store",
        exit: 1,
    };
    const DISK_FULL: Kind = Kind {
        code: "disk_full",
        exit: 1,
    };
    pub const USAGE: Kind = Kind {
        code: "usage",
        exit: 2,
    };
    const DAMAGE: Kind = Kind {
        code: "damage",
        exit: 3,
    };
    const UNSUPPORTED: Kind = Kind {
        code: "unsupported",
        exit: 1,
    };
    const EXISTS: Kind = Kind {
        code: "exists",
        exit: 1,
    };
    const REFUSED: Kind = Kind {
        code: "refused",
        exit: 1,
    };
    const NO_REPOSITORY: Kind = Kind {
        code: "no_repository",
        exit: 4,
    };
    const PASSWORD: Kind = Kind {
        code: "password",
        exit: 5,
    };
}

/// The kind of the first cause in the chain that has one.
pub fn kind_of(e: &anyhow::Error) -> Kind {
    if let Some(signal) = interrupted_by(e) {
        return Kind {
            code: "interrupted",
            exit: 128 + signal as u8,
        };
    }
    e.chain()
        .find_map(|cause| {
            if cause.is::<NoRepository>() {
                return Some(Kind::NO_REPOSITORY);
            }
            if cause.is::<ReadOnlyFormat>() {
                return Some(Kind::UNSUPPORTED);
            }
            if cause.is::<Refused>() {
                return Some(Kind::REFUSED);
            }
            if cause.is::<MaybeDowngraded>() {
                return Some(Kind::PASSWORD);
            }
            if let Some(e) = cause.downcast_ref::<EngineError>() {
                return match e {
                    _ if e.is_damage() => Some(Kind::DAMAGE),
                    EngineError::NotFound(_) => Some(Kind::NOT_FOUND),
                    EngineError::Exists(_) => Some(Kind::EXISTS),
                    EngineError::BadInput(_) | EngineError::Name(_) => Some(Kind::USAGE),
                    EngineError::Tagged { .. }
                    | EngineError::VmTagged { .. }
                    | EngineError::BoundToVm { .. } => Some(Kind::REFUSED),
                    EngineError::ReadOnlyFormat { .. } => Some(Kind::UNSUPPORTED),
                    _ => None, // a typed source further down may say more
                };
            }
            if let Some(e) = cause.downcast_ref::<RepoError>() {
                return match e {
                    _ if e.is_damage() => Some(Kind::DAMAGE),
                    RepoError::NotARepository { .. } => Some(Kind::NO_REPOSITORY),
                    RepoError::NoSuchImage(_) | RepoError::NotFound(_) => Some(Kind::NOT_FOUND),
                    RepoError::BadInput(_) => Some(Kind::USAGE),
                    RepoError::Exists(_) => Some(Kind::EXISTS),
                    RepoError::Refused(_) => Some(Kind::REFUSED),
                    RepoError::Locked { .. }
                    | RepoError::NoPassphrase(_)
                    | RepoError::WrongPassphrase { .. } => Some(Kind::PASSWORD),
                    _ => None,
                };
            }
            if let Some(e) = cause.downcast_ref::<cairn_files::FilesError>() {
                use cairn_files::FilesError as F;
                return match e {
                    F::MountPoint { .. } => Some(Kind::REFUSED),
                    F::NoFileSystem(_) => Some(Kind::UNSUPPORTED),
                    F::GuestMissing { .. } => Some(Kind::NOT_FOUND),
                    _ => None,
                };
            }
            if let Some(cairn_vm::VmError::BadInput(_)) = cause.downcast_ref::<cairn_vm::VmError>()
            {
                return Some(Kind::USAGE);
            }
            cause.downcast_ref::<StoreError>().map(|e| match e {
                StoreError::Full { .. } => Kind::DISK_FULL,
                _ => Kind::STORE,
            })
        })
        .unwrap_or(Kind::ERROR)
}

/// Prints the error (one line, or one JSON object) and returns the exit status for it.
pub fn report(e: &anyhow::Error, json: bool) -> ExitCode {
    let kind = kind_of(e);
    let message = match interrupted_by(e) {
        Some(signal) => format!(
            "interrupted by {}; stopped cleanly, nothing half-done was kept",
            interrupt::signal_name(signal)
        ),
        None => one_line(e),
    };
    print_error(kind, &message, json);
    ExitCode::from(kind.exit)
}

/// One error on stderr: `cairn: error: MESSAGE`, or under `--json` one object
/// `{"error": {"code", "message", "exit_code"}}` on one line.
pub fn print_error(kind: Kind, message: &str, json: bool) {
    if json {
        let value = json!({
            "error": { "code": kind.code, "message": message, "exit_code": kind.exit }
        });
        eprintln!("{value}");
    } else if kind.code == "interrupted" {
        eprintln!("cairn: {message}");
    } else {
        eprintln!("cairn: error: {message}");
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

/// The whole cause chain on one line, skipping causes whose text a higher level already
/// included in its own message.
pub fn one_line(e: &anyhow::Error) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_come_from_the_typed_chain_not_the_text() {
        let e = anyhow::Error::new(NoRepository("no repository given".into()));
        assert_eq!(kind_of(&e), Kind::NO_REPOSITORY);
        let e = anyhow::Error::new(EngineError::Repo(RepoError::NotARepository {
            location: "/x".into(),
        }))
        .context("opening");
        assert_eq!(kind_of(&e), Kind::NO_REPOSITORY);
        let e = anyhow::Error::new(EngineError::Manifest("leaf x".into()));
        assert_eq!(kind_of(&e), Kind::DAMAGE);
        let e = anyhow::Error::new(EngineError::NotFound("vm@9".into()));
        assert_eq!(kind_of(&e), Kind::NOT_FOUND);
        let e = anyhow::Error::new(EngineError::Repo(RepoError::Store(StoreError::Full {
            location: "/r".into(),
        })));
        assert_eq!(kind_of(&e), Kind::DISK_FULL);
        let e = anyhow::anyhow!("commit pipeline: damaged manifest"); // text alone says nothing
        assert_eq!(kind_of(&e), Kind::ERROR);
    }
}

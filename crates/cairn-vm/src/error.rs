//! Errors of whole-VM work.
//!
//! Policy: every error names the VM-side object it is about (the QMP or agent socket, the
//! disk, the QMP command and QEMU's own error class and text) and, where there is one, what
//! the operator can do. Repository and engine errors pass through unchanged, so their kinds
//! (damage, usage, contention) keep their exit codes.

use std::path::PathBuf;

use cairn_engine::EngineError;
use cairn_repo::RepoError;

#[derive(Debug, thiserror::Error)]
pub enum VmError {
    #[error("QMP {}: {detail}", socket.display())]
    Qmp { socket: PathBuf, detail: String },
    #[error("QMP {command}: {desc} ({class})")]
    QmpCommand {
        command: String,
        class: String,
        desc: String,
    },
    #[error("guest agent {}: {detail}", socket.display())]
    Agent { socket: PathBuf, detail: String },
    /// The VM is in a state a backup cannot work with.
    #[error("{0}")]
    State(String),
    /// The operator asked for something that cannot be done as asked.
    #[error("{0}")]
    BadInput(String),
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Repo(#[from] RepoError),
}

impl VmError {
    pub fn io(what: impl Into<String>, source: std::io::Error) -> VmError {
        VmError::Io {
            what: what.into(),
            source,
        }
    }
}

pub type VmResult<T> = Result<T, VmError>;

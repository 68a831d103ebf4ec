//! A QMP client (QEMU Machine Protocol: JSON objects over a Unix socket): the greeting, the
//! capabilities handshake, commands answered in order, events set aside.
//!
//! Hand-written rather than a crate: the protocol is one JSON object per line, and the
//! crates that speak it pin a QEMU schema version; cairn needs a dozen commands and their
//! error classes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;

use crate::error::{VmError, VmResult};

/// How long one command may take to be answered (block jobs and transactions answer at once;
/// their work goes on in the background).
pub const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);

/// How long QEMU may take to greet a new client.
const GREETING_TIMEOUT: Duration = Duration::from_secs(10);

/// A connected QMP monitor.
pub struct Qmp {
    path: PathBuf,
    reader: BufReader<tokio::net::unix::OwnedReadHalf>,
    writer: OwnedWriteHalf,
    /// The QEMU process's id, from the socket's peer credentials.
    pid: Option<u32>,
    /// Events received while waiting for answers.
    pub events: Vec<Value>,
    next_id: u64,
}

impl Qmp {
    /// Connects to the monitor at `path` and leaves capabilities negotiation mode.
    pub async fn connect(path: &Path) -> VmResult<Qmp> {
        let stream = UnixStream::connect(path).await.map_err(|e| VmError::Qmp {
            socket: path.to_path_buf(),
            detail: format!(
                "cannot connect: {e} (is the VM running, with -qmp unix:{},server,wait=off?)",
                path.display()
            ),
        })?;
        let pid = stream
            .peer_cred()
            .ok()
            .and_then(|c| c.pid())
            .and_then(|p| u32::try_from(p).ok());
        let (read, writer) = stream.into_split();
        let mut qmp = Qmp {
            path: path.to_path_buf(),
            reader: BufReader::new(read),
            writer,
            pid,
            events: Vec::new(),
            next_id: 1,
        };
        // QEMU serves one client per monitor: another holding it means no greeting at all.
        let greeting = tokio::time::timeout(GREETING_TIMEOUT, qmp.read_message())
            .await
            .map_err(|_| {
                qmp.fail(format!(
                    "no greeting in {} s: another client holds this monitor (QEMU serves one \
                     at a time), or it is not a QMP socket",
                    GREETING_TIMEOUT.as_secs()
                ))
            })??;
        if greeting.get("QMP").is_none() {
            return Err(qmp.fail(format!("not a QMP greeting: {greeting}")));
        }
        qmp.execute("qmp_capabilities", json!({})).await?;
        Ok(qmp)
    }

    /// The QEMU process's id, when the socket says.
    pub fn pid(&self) -> Option<u32> {
        self.pid
    }

    pub fn socket(&self) -> &Path {
        &self.path
    }

    /// Runs `command` with `arguments`; its `return` value, or [`VmError::QmpCommand`] with
    /// QEMU's error class and description.
    pub async fn execute(&mut self, command: &str, arguments: Value) -> VmResult<Value> {
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = json!({"execute": command, "id": id});
        if arguments.as_object().is_some_and(|o| !o.is_empty()) {
            msg["arguments"] = arguments;
        }
        tracing::debug!(%msg, "QMP");
        let mut line = msg.to_string();
        line.push('\n');
        self.writer
            .write_all(line.as_bytes())
            .await
            .map_err(|e| self.fail(format!("{command}: cannot send: {e}")))?;
        let answer = tokio::time::timeout(COMMAND_TIMEOUT, self.answer(id))
            .await
            .map_err(|_| {
                self.fail(format!(
                    "{command}: no answer in {} s",
                    COMMAND_TIMEOUT.as_secs()
                ))
            })??;
        if let Some(err) = answer.get("error") {
            return Err(VmError::QmpCommand {
                command: command.to_string(),
                class: err["class"].as_str().unwrap_or("").to_string(),
                desc: err["desc"].as_str().unwrap_or("").to_string(),
            });
        }
        Ok(answer.get("return").cloned().unwrap_or(Value::Null))
    }

    async fn answer(&mut self, id: u64) -> VmResult<Value> {
        loop {
            let msg = self.read_message().await?;
            if msg.get("event").is_some() {
                self.events.push(msg);
                continue;
            }
            if msg.get("id").and_then(Value::as_u64) == Some(id) {
                return Ok(msg);
            }
            tracing::debug!(%msg, "QMP: an answer to another command");
        }
    }

    async fn read_message(&mut self) -> VmResult<Value> {
        let mut line = String::new();
        let n = self
            .reader
            .read_line(&mut line)
            .await
            .map_err(|e| self.fail(format!("cannot read: {e}")))?;
        if n == 0 {
            return Err(self.fail("QEMU closed the monitor (did the VM stop or crash?)".into()));
        }
        serde_json::from_str(&line).map_err(|e| self.fail(format!("bad JSON from QEMU: {e}")))
    }

    fn fail(&self, detail: String) -> VmError {
        VmError::Qmp {
            socket: self.path.clone(),
            detail,
        }
    }
}

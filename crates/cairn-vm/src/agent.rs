//! The QEMU guest agent (qemu-ga inside the guest, reached through the chardev socket the VM
//! exposes for it): freezing and thawing the guest's file systems around a backup's point in
//! time.
//!
//! Every exchange is bounded in time: an agent that is not installed, not started or hung
//! never answers, and a backup must then go on without a freeze (and say so), never wait.
//! The protocol resynchronizes with `guest-sync-delimited` first (a 0xFF byte before the
//! answer marks where the stream is clean), since an earlier client may have left a half
//! exchange in the channel.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;

use crate::error::{VmError, VmResult};

/// A connected guest agent that answered the sync.
pub struct Agent {
    path: PathBuf,
    stream: BufReader<UnixStream>,
    timeout: Duration,
}

/// The guest's file systems, as the agent reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FreezeStatus {
    Thawed,
    Frozen,
}

impl Agent {
    /// Connects and synchronizes, each step bounded by `timeout`.
    pub async fn connect(path: &Path, timeout: Duration) -> VmResult<Agent> {
        let fail = |detail: String| VmError::Agent {
            socket: path.to_path_buf(),
            detail,
        };
        let stream = tokio::time::timeout(timeout, UnixStream::connect(path))
            .await
            .map_err(|_| fail("connecting timed out".into()))?
            .map_err(|e| fail(format!("cannot connect: {e}")))?;
        let mut agent = Agent {
            path: path.to_path_buf(),
            stream: BufReader::new(stream),
            timeout,
        };
        agent.sync().await?;
        Ok(agent)
    }

    async fn sync(&mut self) -> VmResult<()> {
        let token: u32 = rand::random::<u32>() >> 1;
        let mut msg = vec![0xFFu8];
        msg.extend(
            json!({"execute": "guest-sync-delimited", "arguments": {"id": token}})
                .to_string()
                .bytes(),
        );
        msg.push(b'\n');
        let limit = self.timeout;
        let exchange = async {
            self.stream.get_mut().write_all(&msg).await?;
            // Skip everything up to the 0xFF delimiter, then read the answer.
            loop {
                let byte = self.stream.read_u8().await?;
                if byte == 0xFF {
                    break;
                }
            }
            loop {
                let answer = self.read_line().await?;
                if answer.get("return").and_then(Value::as_u64) == Some(token as u64) {
                    return Ok::<(), std::io::Error>(());
                }
            }
        };
        match tokio::time::timeout(limit, exchange).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(self.fail(format!("sync failed: {e}"))),
            Err(_) => Err(self.fail(format!(
                "no answer in {:.0} s (is qemu-guest-agent installed and running in the guest?)",
                limit.as_secs_f64()
            ))),
        }
    }

    async fn read_line(&mut self) -> std::io::Result<Value> {
        let mut line = String::new();
        if self.stream.read_line(&mut line).await? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the agent channel closed",
            ));
        }
        serde_json::from_str(line.trim_start_matches('\u{FF}'))
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
    }

    /// Runs `command` within `limit`; its `return` value.
    async fn execute(&mut self, command: &str, limit: Duration) -> VmResult<Value> {
        let mut line = json!({ "execute": command }).to_string();
        line.push('\n');
        let exchange = async {
            self.stream.get_mut().write_all(line.as_bytes()).await?;
            self.read_line().await
        };
        let answer = match tokio::time::timeout(limit, exchange).await {
            Ok(Ok(a)) => a,
            Ok(Err(e)) => return Err(self.fail(format!("{command}: {e}"))),
            Err(_) => {
                return Err(self.fail(format!(
                    "{command}: no answer in {:.0} s",
                    limit.as_secs_f64()
                )))
            }
        };
        if let Some(err) = answer.get("error") {
            return Err(self.fail(format!(
                "{command}: {}",
                err["desc"].as_str().unwrap_or("refused")
            )));
        }
        Ok(answer.get("return").cloned().unwrap_or(Value::Null))
    }

    /// Freezes the guest's file systems; how many were frozen.
    pub async fn freeze(&mut self) -> VmResult<u64> {
        let limit = self.timeout;
        let n = self.execute("guest-fsfreeze-freeze", limit).await?;
        Ok(n.as_u64().unwrap_or(0))
    }

    /// Thaws the guest's file systems; how many were thawed.
    pub async fn thaw(&mut self) -> VmResult<u64> {
        let limit = self.timeout;
        let n = self.execute("guest-fsfreeze-thaw", limit).await?;
        Ok(n.as_u64().unwrap_or(0))
    }

    pub async fn status(&mut self) -> VmResult<FreezeStatus> {
        let limit = self.timeout;
        match self.execute("guest-fsfreeze-status", limit).await?.as_str() {
            Some("frozen") => Ok(FreezeStatus::Frozen),
            _ => Ok(FreezeStatus::Thawed),
        }
    }

    fn fail(&self, detail: String) -> VmError {
        VmError::Agent {
            socket: self.path.clone(),
            detail,
        }
    }
}

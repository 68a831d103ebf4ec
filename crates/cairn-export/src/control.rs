//! The control socket of a running export: other `cairn` processes ask it for its counters,
//! to COMMIT its overlay, or to snapshot / roll back / delete overlay snapshots.
//!
//! One JSON object per line in each direction on a Unix socket
//! (`<run dir>/<export name>.ctl`; the run directory is 0700 and the user's, checked):
//! `{"op":"status"}`, `{"op":"commit","image":"…","message":"…"}`,
//! `{"op":"snapshot"|"rollback"|"delete","name":"…"}`. Replies are `{"ok":true,…}` or
//! `{"ok":false,"error":"…"}`.

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

/// Handles one request; returns the reply's fields (or an error message).
pub type Handler =
    Arc<dyn Fn(Value) -> Pin<Box<dyn Future<Output = Result<Value, String>> + Send>> + Send + Sync>;

/// Where control sockets live; see [`crate::lifecycle::run_dir`].
pub fn run_dir() -> PathBuf {
    crate::lifecycle::run_dir()
}

/// The control socket of export `name`.
pub fn socket_path(name: &str) -> PathBuf {
    crate::lifecycle::control_path(&run_dir(), name)
}

/// Binds the control socket `path`. Its directory must already be the private run directory
/// ([`crate::lifecycle::ensure_private_dir`]) and the export name claimed
/// ([`crate::lifecycle::claim_name`], which removes a stale socket of that name).
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    UnixListener::bind(path)
}

/// Serves requests on `listener` until the process ends.
pub async fn serve(listener: UnixListener, handler: Handler) -> io::Result<()> {
    loop {
        let (stream, _) = listener.accept().await?;
        let handler = handler.clone();
        tokio::spawn(async move {
            let (read, mut write) = stream.into_split();
            let mut lines = BufReader::new(read).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let reply = match serde_json::from_str::<Value>(&line) {
                    Err(e) => json!({"ok": false, "error": format!("bad request: {e}")}),
                    Ok(req) => match handler(req).await {
                        Ok(mut v) => {
                            v["ok"] = json!(true);
                            v
                        }
                        Err(e) => json!({"ok": false, "error": e}),
                    },
                };
                let mut out = reply.to_string();
                out.push('\n');
                if write.write_all(out.as_bytes()).await.is_err() {
                    break;
                }
            }
        });
    }
}

/// Sends one request to the export `name` and returns its reply (an `ok: false` reply
/// becomes an error carrying the export's message).
pub async fn request(name: &str, req: Value) -> Result<Value, String> {
    let path = socket_path(name);
    let stream = UnixStream::connect(&path)
        .await
        .map_err(|e| format!("no running export named {name:?} ({}: {e})", path.display()))?;
    request_on(stream, name, req).await
}

/// Sends one request on a connected control socket of export `name`.
pub async fn request_on(stream: UnixStream, name: &str, req: Value) -> Result<Value, String> {
    let (read, mut write) = stream.into_split();
    let mut line = req.to_string();
    line.push('\n');
    write
        .write_all(line.as_bytes())
        .await
        .map_err(|e| format!("export {name:?}: {e}"))?;
    let mut lines = BufReader::new(read).lines();
    let reply = lines
        .next_line()
        .await
        .map_err(|e| format!("export {name:?}: {e}"))?
        .ok_or_else(|| format!("export {name:?} closed the control connection"))?;
    let v: Value = serde_json::from_str(&reply).map_err(|e| format!("export {name:?}: {e}"))?;
    if v["ok"] == json!(true) {
        Ok(v)
    } else {
        Err(v["error"].as_str().unwrap_or("unknown error").to_string())
    }
}

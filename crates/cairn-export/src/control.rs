//! The control socket of a running export: other `cairn` processes ask it for its counters,
//! to COMMIT its overlay, or to snapshot / roll back / delete overlay snapshots.
//!
//! One JSON object per line in each direction on a Unix socket
//! (`<run dir>/<export name>.ctl`; the run directory is 0700 and the user's, checked). A
//! request is a [`Request`] (`{"op":"status"}`, `{"op":"commit","image":"…","message":"…"}`,
//! `{"op":"snapshot"|"rollback"|"delete","name":"…"}`, `{"op":"snapshots"}`); replies are
//! `{"ok":true,…}` or `{"ok":false,"error":"…"}`. The export's side of every request,
//! COMMIT included, is [`export_handler`].

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use cairn_repo::{ContentCache, Repo, SessionKind};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{UnixListener, UnixStream};

use crate::export::VersionExport;

/// A request to a running export.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    /// The export's version, overlay and counters.
    Status,
    /// Publish base + overlay as a new version of `image`; the export then serves it.
    Commit {
        image: String,
        #[serde(default)]
        message: String,
        /// Commit even when the export's base is not the image's newest version.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        force: bool,
    },
    /// Overlay snapshots: take, roll back to, delete, list.
    Snapshot {
        name: String,
    },
    /// Refused while NBD clients are connected unless `force`: a running guest does not
    /// know its disk changed under it.
    Rollback {
        name: String,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        force: bool,
    },
    Delete {
        name: String,
    },
    Snapshots,
}

/// Handles one request; returns the reply's fields (or an error message).
pub type Handler = Arc<
    dyn Fn(Request) -> Pin<Box<dyn Future<Output = Result<Value, String>> + Send>> + Send + Sync,
>;

/// The export's side of the control protocol: status, COMMIT (in a session of its own,
/// taking back what a failed commit stored) and overlay snapshots.
pub fn export_handler(
    export: Arc<VersionExport>,
    repo: Arc<Repo>,
    cache: Arc<ContentCache>,
    readahead: usize,
) -> Handler {
    Arc::new(move |req: Request| {
        let (export, repo, cache) = (export.clone(), repo.clone(), cache.clone());
        Box::pin(async move {
            let overlay = || {
                export
                    .overlay()
                    .cloned()
                    .ok_or_else(|| "the export is read-only".to_string())
            };
            match req {
                Request::Status => Ok(status_json(&export)),
                Request::Commit {
                    image,
                    message,
                    force,
                } => commit(&export, &repo, cache, readahead, &image, message, force).await,
                op @ (Request::Snapshot { .. }
                | Request::Rollback { .. }
                | Request::Delete { .. }) => {
                    let o = overlay()?;
                    let clients = export.stats().clients.load(Ordering::Relaxed);
                    if let Request::Rollback { force: false, .. } = op {
                        if clients > 0 {
                            return Err(format!(
                                "{clients} NBD {} connected, and a running guest would not know \
                                 its disk was rolled back under it: shut the guest down first, or \
                                 pass --force (then restart it before it writes more)",
                                if clients == 1 {
                                    "client is"
                                } else {
                                    "clients are"
                                }
                            ));
                        }
                    }
                    tokio::task::spawn_blocking(move || match op {
                        Request::Snapshot { name } => o.snapshot(&name),
                        Request::Rollback { name, .. } => o.rollback(&name),
                        Request::Delete { name } => o.delete_snapshot(&name),
                        _ => unreachable!("matched above"),
                    })
                    .await
                    .map_err(|e| e.to_string())?
                    .map_err(|e| e.to_string())?;
                    let o = overlay()?;
                    let mut v = snapshots_json(&o);
                    v["clients"] = json!(clients);
                    Ok(v)
                }
                Request::Snapshots => overlay().map(|o| snapshots_json(&o)),
            }
        })
    })
}

/// COMMIT: in a session of its own, registered now, so that GC's plans cover it.
async fn commit(
    export: &VersionExport,
    repo: &Repo,
    cache: Arc<ContentCache>,
    readahead: usize,
    image: &str,
    message: String,
    force: bool,
) -> Result<Value, String> {
    let session = repo
        .reopen(SessionKind::Commit)
        .await
        .map(Arc::new)
        .map_err(|e| e.to_string())?;
    let r = export
        .commit(session.clone(), image, message, force, readahead, cache)
        .await;
    if r.is_err() {
        // What the failed commit stored is unreferenced: take it back.
        session.discard_unindexed_packs().await;
    }
    let _ = session.close().await;
    let r = r.map_err(|e| e.to_string())?;
    Ok(json!({
        "id": r.id.to_hex(),
        "image": r.record.image,
        "seq": r.record.seq,
        "parent": r.record.parent.map(|p| p.to_hex()),
        "logical_size": r.record.logical_size,
        "new_chunks": r.record.stats.new_chunks,
        "new_chunk_bytes": r.record.stats.new_chunk_bytes,
        "stored_bytes": r.record.stats.stored_bytes,
    }))
}

/// The overlay's snapshots: names (oldest first) and the tree (each one's parent, whether
/// the current state reads through it, the blocks its layer holds).
pub fn snapshots_json(o: &cairn_overlay::Overlay) -> Value {
    let tree: Vec<Value> = o
        .snapshot_tree()
        .into_iter()
        .map(|s| {
            json!({
                "name": s.name,
                "parent": s.parent,
                "current_path": s.current_path,
                "blocks": s.blocks,
            })
        })
        .collect();
    let names: Vec<&Value> = tree.iter().map(|s| &s["name"]).collect();
    json!({ "snapshots": names, "tree": tree })
}

/// The reply to [`Request::Status`].
pub fn status_json(export: &VersionExport) -> Value {
    let base = export.base();
    let mut v = json!({
        "pid": std::process::id(),
        "image": base.record().image,
        "seq": base.record().seq,
        "id": base.id().to_hex(),
        "size": base.size(),
        "writable": export.overlay().is_some(),
        "stats": export.stats().to_json(),
    });
    if let Some(o) = export.overlay() {
        let s = o.stats();
        v["overlay"] = json!({
            "dir": o.dir().display().to_string(),
            "blocks_held": s.blocks_held,
            "held_bytes": s.held_bytes,
            "layers": s.layers,
            "data_bytes_allocated": s.data_bytes_allocated,
            "copied_on_read": s.copied_on_read,
            "snapshots": o.snapshots(),
            "snapshot_tree": snapshots_json(o)["tree"],
        });
    }
    v
}

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
                let reply = match serde_json::from_str::<Request>(&line) {
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
pub async fn request(name: &str, req: Request) -> Result<Value, String> {
    let path = socket_path(name);
    let stream = UnixStream::connect(&path)
        .await
        .map_err(|e| format!("no running export named {name:?} ({}: {e})", path.display()))?;
    request_on(stream, name, req).await
}

/// Sends one request on a connected control socket of export `name`.
pub async fn request_on(stream: UnixStream, name: &str, req: Request) -> Result<Value, String> {
    let (read, mut write) = stream.into_split();
    let mut line = serde_json::to_string(&req).map_err(|e| format!("export {name:?}: {e}"))?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The wire format is a contract with other cairn processes (possibly other releases).
    #[test]
    fn requests_keep_their_wire_format() {
        let cases = [
            (Request::Status, r#"{"op":"status"}"#),
            (
                Request::Commit {
                    image: "vm".into(),
                    message: "m".into(),
                    force: false,
                },
                r#"{"op":"commit","image":"vm","message":"m"}"#,
            ),
            (
                Request::Commit {
                    image: "vm".into(),
                    message: "m".into(),
                    force: true,
                },
                r#"{"op":"commit","image":"vm","message":"m","force":true}"#,
            ),
            (
                Request::Rollback {
                    name: "s1".into(),
                    force: false,
                },
                r#"{"op":"rollback","name":"s1"}"#,
            ),
            (
                Request::Rollback {
                    name: "s1".into(),
                    force: true,
                },
                r#"{"op":"rollback","name":"s1","force":true}"#,
            ),
            (Request::Snapshots, r#"{"op":"snapshots"}"#),
        ];
        for (req, wire) in cases {
            assert_eq!(serde_json::to_string(&req).unwrap(), wire);
            assert_eq!(serde_json::from_str::<Request>(wire).unwrap(), req);
        }
        // A commit without a message has an empty one.
        assert_eq!(
            serde_json::from_str::<Request>(r#"{"op":"commit","image":"vm"}"#).unwrap(),
            Request::Commit {
                image: "vm".into(),
                message: String::new(),
                force: false,
            }
        );
        let err = serde_json::from_str::<Request>(r#"{"op":"format"}"#).unwrap_err();
        assert!(
            err.to_string().contains("unknown variant `format`"),
            "{err}"
        );
        assert!(serde_json::from_str::<Request>(r#"{"op":"snapshot"}"#).is_err());
    }
}

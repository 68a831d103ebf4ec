//! The VM's block layer over QMP: its disks and their dirty bitmaps, and the objects a backup
//! adds for the time it reads (scratch "fleece" nodes holding the point in time, block jobs
//! that copy old data into them, NBD exports of them, a merged read bitmap).
//!
//! Everything a backup adds is named with the prefix `cairn-`, so that the next backup can
//! find and remove what a killed one left ([`clean_stale`]). Node names are at most 31
//! bytes in QEMU: objects are named by the disk's index, not its name.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::error::{VmError, VmResult};
use crate::qmp::Qmp;

/// Prefix of every QEMU object and dirty bitmap a backup creates.
pub const PREFIX: &str = "cairn-";
pub use crate::hypervisor::CHECKPOINT_PREFIX;
/// The bitmap a backup merges its reads from (every checkpoint since the last backup).
pub const READ_BITMAP: &str = "cairn-read";
/// Dirty-bitmap granularity: the commit's default block and QEMU's default.
pub const GRANULARITY: u64 = 64 * 1024;
/// How long a cancelled job or a deleted export may take to go away.
const SETTLE: Duration = Duration::from_secs(30);

/// A dirty bitmap of a disk, as QEMU reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bitmap {
    pub name: String,
    pub recording: bool,
    pub persistent: bool,
    /// Left in use by a QEMU that stopped without saving it: it may miss writes.
    pub inconsistent: bool,
}

/// One disk of the VM.
#[derive(Debug, Clone)]
pub struct Disk {
    /// Its name in the VM (the drive id, else the device id): its image is `VM/NAME`.
    pub name: String,
    /// The format node: what bitmaps and the point-in-time job attach to.
    pub node: String,
    /// The node's format (`qcow2` keeps bitmaps across QEMU restarts; others do not).
    pub format: String,
    pub size: u64,
    pub bitmaps: Vec<Bitmap>,
}

impl Disk {
    /// Whether bitmaps of this disk can be persistent (saved in the image file).
    pub fn persistent_bitmaps(&self) -> bool {
        self.format == "qcow2"
    }

    pub fn checkpoints(&self) -> impl Iterator<Item = &Bitmap> {
        self.bitmaps
            .iter()
            .filter(|b| b.name.starts_with(CHECKPOINT_PREFIX))
    }
}

/// The VM's writable disks, in QEMU's order (read-only media such as CD-ROMs are skipped).
pub async fn disks(qmp: &mut Qmp) -> VmResult<Vec<Disk>> {
    let blocks = qmp.execute("query-block", json!({})).await?;
    let mut out: Vec<Disk> = Vec::new();
    for b in blocks.as_array().into_iter().flatten() {
        let Some(inserted) = b.get("inserted") else {
            continue;
        };
        if inserted["ro"].as_bool().unwrap_or(false) {
            continue;
        }
        let name = disk_name(b);
        let node = inserted["node-name"].as_str().unwrap_or("").to_string();
        if name.is_empty() || node.is_empty() {
            continue;
        }
        let bitmaps = inserted["dirty-bitmaps"]
            .as_array()
            .into_iter()
            .flatten()
            // Block jobs keep anonymous bitmaps of their own.
            .filter(|m| m["name"].as_str().is_some_and(|n| !n.is_empty()))
            .map(|m| Bitmap {
                name: m["name"].as_str().unwrap_or("").to_string(),
                recording: m["recording"].as_bool().unwrap_or(false),
                persistent: m["persistent"].as_bool().unwrap_or(false),
                inconsistent: m["inconsistent"].as_bool().unwrap_or(false),
            })
            .collect();
        out.push(Disk {
            name,
            node,
            format: inserted["image"]["format"]
                .as_str()
                .unwrap_or("")
                .to_string(),
            size: inserted["image"]["virtual-size"].as_u64().unwrap_or(0),
            bitmaps,
        });
    }
    Ok(out)
}

/// A disk's name: the drive id (`-drive id=...`), else the device's id (`-device
/// ...,id=...` in its QOM path `/machine/peripheral/ID/...`).
fn disk_name(block: &Value) -> String {
    if let Some(device) = block["device"].as_str().filter(|d| !d.is_empty()) {
        return device.to_string();
    }
    let qdev = block["qdev"].as_str().unwrap_or("");
    match qdev.strip_prefix("/machine/peripheral/") {
        Some(rest) => rest.split('/').next().unwrap_or("").to_string(),
        None => qdev.trim_matches('/').replace('/', "_"),
    }
}

/// What a backup adds for disk number `index`.
#[derive(Debug, Clone)]
pub struct Fleece {
    pub index: usize,
    /// The scratch node holding the point in time (old data copied in before guest writes).
    pub node: String,
    /// The `blockdev-backup` job (sync none) that does the copying.
    pub job: String,
    pub export: String,
    /// The scratch file under the node.
    pub file: PathBuf,
}

impl Fleece {
    pub fn new(index: usize, scratch: &Path, vm_key: &str) -> Fleece {
        Fleece {
            index,
            node: format!("{PREFIX}f{index}"),
            job: format!("{PREFIX}j{index}"),
            export: format!("{PREFIX}e{index}"),
            file: scratch.join(format!("{}{index}.qcow2", scratch_prefix(vm_key))),
        }
    }
}

/// Scratch files of the VM `vm_key` names begin with this.
pub fn scratch_prefix(vm_key: &str) -> String {
    format!("cairn-fleece-{vm_key}-")
}

/// Creates the scratch file (owner-only: it receives guest data) and the node over it,
/// backed by the disk.
pub async fn add_fleece(qmp: &mut Qmp, disk: &Disk, fleece: &Fleece) -> VmResult<()> {
    create_scratch(&fleece.file, disk.size).await?;
    qmp.execute(
        "blockdev-add",
        json!({
            "driver": "qcow2",
            "node-name": fleece.node,
            "file": {"driver": "file", "filename": fleece.file},
            "backing": disk.node,
            "discard": "unmap",
        }),
    )
    .await?;
    Ok(())
}

async fn create_scratch(file: &Path, size: u64) -> VmResult<()> {
    {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(file)
            .map_err(|e| VmError::io(format!("scratch file {}", file.display()), e))?;
    }
    let (path, size) = (file.to_path_buf(), size.to_string());
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2"])
            .arg(&path)
            .arg(&size)
            .output()
    })
    .await
    .map_err(|e| VmError::State(format!("qemu-img: {e}")))?
    .map_err(|e| {
        VmError::io(
            "qemu-img (needed for the scratch image; Debian package qemu-utils)",
            e,
        )
    })?;
    if !out.status.success() {
        return Err(VmError::State(format!(
            "qemu-img create {}: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// The point in time across every disk, in one transaction: each disk's writes start copying
/// old data into its fleece node, a new checkpoint bitmap starts recording, and the
/// checkpoints before it stop.
pub async fn point_in_time(
    qmp: &mut Qmp,
    disks: &[(&Disk, &Fleece)],
    checkpoint: &str,
) -> VmResult<()> {
    let mut actions = Vec::new();
    for (disk, fleece) in disks {
        actions.push(json!({"type": "blockdev-backup", "data": {
            "job-id": fleece.job, "device": disk.node, "target": fleece.node, "sync": "none"}}));
        actions.push(json!({"type": "block-dirty-bitmap-add", "data": {
            "node": disk.node, "name": checkpoint, "granularity": GRANULARITY,
            "persistent": disk.persistent_bitmaps()}}));
        for old in disk.checkpoints().filter(|b| b.recording) {
            actions.push(json!({"type": "block-dirty-bitmap-disable", "data": {
                "node": disk.node, "name": old.name}}));
        }
    }
    qmp.execute("transaction", json!({ "actions": actions }))
        .await?;
    Ok(())
}

/// Merges `sources` (stopped checkpoints) into a new, stopped read bitmap of the disk.
pub async fn add_read_bitmap(qmp: &mut Qmp, disk: &Disk, sources: &[String]) -> VmResult<()> {
    qmp.execute(
        "block-dirty-bitmap-add",
        json!({"node": disk.node, "name": READ_BITMAP, "granularity": GRANULARITY,
               "persistent": false, "disabled": true}),
    )
    .await?;
    qmp.execute(
        "block-dirty-bitmap-merge",
        json!({"node": disk.node, "target": READ_BITMAP, "bitmaps": sources}),
    )
    .await?;
    Ok(())
}

/// Exports the fleece node over QEMU's NBD server, with the read bitmap when there is one.
pub async fn export(qmp: &mut Qmp, fleece: &Fleece, bitmap: bool) -> VmResult<()> {
    let mut args = json!({"type": "nbd", "id": fleece.export, "node-name": fleece.node,
                          "name": fleece.export, "writable": false});
    if bitmap {
        args["bitmaps"] = json!([READ_BITMAP]);
    }
    qmp.execute("block-export-add", args).await?;
    Ok(())
}

/// Makes QEMU take back the disk under `fleece` that a migration left inactive (handed over):
/// QEMU activates the node of every export it adds, with its children.
pub async fn activate(qmp: &mut Qmp, fleece: &Fleece) -> VmResult<()> {
    let id = format!("{}-activate", fleece.export);
    qmp.execute(
        "block-export-add",
        json!({"type": "nbd", "id": id, "node-name": fleece.node, "name": id,
               "writable": false}),
    )
    .await?;
    qmp.execute("block-export-del", json!({"id": id, "mode": "hard"}))
        .await?;
    Ok(())
}

/// Starts QEMU's NBD server on `socket`; false when one already listens there (started by a
/// backup that was killed: it is used as it is).
pub async fn start_nbd_server(qmp: &mut Qmp, socket: &Path) -> VmResult<bool> {
    match qmp
        .execute(
            "nbd-server-start",
            json!({"addr": {"type": "unix", "data": {"path": socket}}}),
        )
        .await
    {
        Ok(_) => Ok(true),
        Err(VmError::QmpCommand { desc, .. }) if desc.contains("already running") => {
            if socket.exists() {
                Ok(false)
            } else {
                Err(VmError::State(format!(
                    "QEMU already runs an NBD server that cairn did not start ({desc}); a \
                     backup needs its own: stop that one (QMP nbd-server-stop) and try again"
                )))
            }
        }
        Err(e) => Err(e),
    }
}

/// Removes everything named [`PREFIX`] a backup adds (exports, jobs, nodes, the read bitmap)
/// and the scratch files of `vm_key` in `scratch`; what it removed, one line each. Errors
/// are logged, not returned: teardown must go as far as it can.
pub async fn clean_stale(qmp: &mut Qmp, scratch: &Path, vm_key: &str) -> Vec<String> {
    let mut removed = Vec::new();
    if let Err(e) = clean(qmp, &mut removed).await {
        tracing::warn!("cleaning QEMU up: {e}");
    }
    let prefix = scratch_prefix(vm_key);
    if let Ok(dir) = std::fs::read_dir(scratch) {
        for entry in dir.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            if name.starts_with(&prefix) && std::fs::remove_file(entry.path()).is_ok() {
                removed.push(format!("scratch file {}", entry.path().display()));
            }
        }
    }
    removed
}

async fn clean(qmp: &mut Qmp, removed: &mut Vec<String>) -> VmResult<()> {
    let exports = qmp.execute("query-block-exports", json!({})).await?;
    for e in ours(&exports, "id") {
        qmp.execute("block-export-del", json!({"id": e, "mode": "hard"}))
            .await?;
        removed.push(format!("NBD export {e}"));
    }
    wait_gone(qmp, "query-block-exports", "id").await?;
    let jobs = qmp.execute("query-block-jobs", json!({})).await?;
    for j in ours(&jobs, "device") {
        qmp.execute("block-job-cancel", json!({"device": j, "force": true}))
            .await?;
        removed.push(format!("block job {j}"));
    }
    wait_gone(qmp, "query-block-jobs", "device").await?;
    let nodes = qmp
        .execute("query-named-block-nodes", json!({"flat": true}))
        .await?;
    for n in ours(&nodes, "node-name") {
        // A fleece node's file child is listed too (an automatic name): delete the top.
        qmp.execute("blockdev-del", json!({ "node-name": n }))
            .await?;
        removed.push(format!("block node {n}"));
    }
    for disk in disks(qmp).await? {
        if disk.bitmaps.iter().any(|b| b.name == READ_BITMAP) {
            qmp.execute(
                "block-dirty-bitmap-remove",
                json!({"node": disk.node, "name": READ_BITMAP}),
            )
            .await?;
        }
    }
    Ok(())
}

/// The values of `field` that start with [`PREFIX`] in a QMP list.
fn ours(list: &Value, field: &str) -> Vec<String> {
    let mut out: Vec<String> = list
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| v[field].as_str())
        .filter(|s| s.starts_with(PREFIX))
        .map(str::to_string)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// Waits until `query` lists nothing of ours.
async fn wait_gone(qmp: &mut Qmp, query: &str, field: &str) -> VmResult<()> {
    let started = Instant::now();
    loop {
        let list = qmp.execute(query, json!({})).await?;
        let left = ours(&list, field);
        if left.is_empty() {
            return Ok(());
        }
        if started.elapsed() > SETTLE {
            return Err(VmError::State(format!(
                "{} still listed by {query} after {} s",
                left.join(", "),
                SETTLE.as_secs()
            )));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Removes the disk's bitmaps named in `names` (older checkpoints once a newer one is
/// recorded in a published VM version).
pub async fn remove_bitmaps(qmp: &mut Qmp, disk: &Disk, names: &[String]) -> VmResult<()> {
    for name in names {
        qmp.execute(
            "block-dirty-bitmap-remove",
            json!({"node": disk.node, "name": name}),
        )
        .await?;
    }
    Ok(())
}

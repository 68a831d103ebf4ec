//! `cairn vm backup` over QMP: one consistent point in time across every disk of a running
//! VM, read over NBD (only what changed since the last backup when its checkpoint bitmap is
//! still there), committed as one VM version.
//!
//! The steps, and what each leaves when it fails:
//! 1. clean up what a killed backup left in QEMU (exports, jobs, scratch nodes and files,
//!    the read bitmap; a guest left frozen is thawed) and discard disk versions it committed
//!    that no VM version binds;
//! 2. add a scratch ("fleece") node per disk, backed by the disk;
//! 3. freeze the guest's file systems (guest agent, bounded wait), then one QMP transaction:
//!    per disk a `blockdev-backup` (sync none: guest writes first copy the old data into the
//!    fleece node, which so keeps the point in time), a new checkpoint bitmap, and the older
//!    checkpoints stopped; thaw at once;
//! 4. per disk, a read bitmap merged from every older checkpoint (the changes since the last
//!    published VM version's point in time, even when backups failed since), and an NBD
//!    export of the fleece node with it;
//! 5. commit each disk: incrementally on the disk version the last VM version binds when its
//!    checkpoint is there and consistent, in full otherwise (said, with the reason);
//! 6. publish the VM version, then remove the older checkpoints.
//!
//! Teardown (exports, jobs, nodes, files, read bitmap) runs whatever happened. Until step 6
//! succeeds no checkpoint is removed: the next backup's read bitmap still covers every change
//! since the last published version, so a failed backup costs a re-read, never a missed
//! change.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_engine::commit::plan::{commit_planned, plan_commit, CommitSource, NoRecords};
use cairn_engine::commit::{CommitOptions, DedupMode};
use cairn_engine::source::RateLimited;
use cairn_engine::vm::{
    discard_disks, latest_vm, publish_vm, unbound_disk_versions, NewVmVersion, DISK_MESSAGE_PREFIX,
};
use cairn_format::version::VersionRecord;
use cairn_format::vm::{ConfigKind, Freeze, VmDisk, VmVersion};
use cairn_format::Id;
use cairn_image::DiskImage;
use cairn_nbd::client::NbdImage;
use cairn_repo::Repo;
use serde_json::json;

use crate::agent::{Agent, FreezeStatus};
use crate::block::{self, Disk, Fleece, CHECKPOINT_PREFIX, READ_BITMAP};
use crate::error::{VmError, VmResult};
use crate::qmp::Qmp;

/// What to back up, and how.
#[derive(Debug, Clone)]
pub struct BackupOptions {
    pub vm: String,
    /// The VM's QMP monitor socket.
    pub qmp: PathBuf,
    /// The guest agent's socket, when the VM has one.
    pub agent: Option<PathBuf>,
    /// The longest wait for each guest agent exchange.
    pub agent_timeout: Duration,
    /// Where the scratch images go (they grow by what the guest writes during the backup).
    pub scratch_dir: PathBuf,
    /// Only these disks (by name); all writable disks when empty.
    pub only: Vec<String>,
    pub message: String,
    pub dedup: DedupMode,
    /// Bytes per second each disk is read at, at most.
    pub rate_limit: Option<u64>,
}

/// What happened to one disk.
#[derive(Debug, Clone)]
pub struct DiskReport {
    pub name: String,
    pub image: String,
    pub id: Id,
    pub record: VersionRecord,
    /// Why it was read whole (`None`: only what changed was read).
    pub full_because: Option<String>,
    /// Bytes the read bitmap marked (incremental only).
    pub dirty_bytes: u64,
    pub read_bytes: u64,
    pub duration: Duration,
}

/// What a backup did.
#[derive(Debug, Clone)]
pub struct BackupReport {
    pub id: Id,
    pub record: VmVersion,
    pub disks: Vec<DiskReport>,
    /// From the freeze request to the thaw's answer (or the transaction alone, unfrozen).
    pub paused_for: Duration,
    /// The transaction that took the point in time.
    pub point_in_time: Duration,
    pub total: Duration,
}

/// Backs the VM up as one new VM version of `options.vm`. `say` receives the lines an
/// operator should read as they happen (what was cleaned up, why a disk is read whole, a
/// guest agent that did not answer).
pub async fn backup(
    repo: Arc<Repo>,
    options: &BackupOptions,
    say: &(dyn Fn(String) + Send + Sync),
) -> VmResult<BackupReport> {
    let started = Instant::now();
    for d in &options.only {
        cairn_format::vm::validate_disk_name(&options.vm, d)
            .map_err(|e| VmError::BadInput(format!("--disk {d:?}: {e}")))?;
    }
    let vm_key = hex::encode(&blake3::hash(options.vm.as_bytes()).as_bytes()[..4]);
    // One backup at a time per VM and per QEMU: a second would take the first's leftovers
    // in QEMU, and its disk versions, for a killed backup's and remove them.
    let qemu_key = std::fs::canonicalize(&options.qmp).unwrap_or_else(|_| options.qmp.clone());
    let _locks = (
        exclusive(&format!("VM {}", options.vm), &format!("vm-{vm_key}"))?,
        exclusive(
            &format!("the QEMU behind {}", options.qmp.display()),
            &format!(
                "qemu-{}",
                hex::encode(&blake3::hash(qemu_key.as_os_str().as_encoded_bytes()).as_bytes()[..4])
            ),
        )?,
    );
    let mut qmp = Qmp::connect(&options.qmp).await?;
    let status = qmp.execute("query-status", json!({})).await?;
    let state = status["status"].as_str().unwrap_or("unknown").to_string();
    if !matches!(state.as_str(), "running" | "paused" | "prelaunch") {
        return Err(VmError::State(format!(
            "the VM behind {} is {state}: a backup needs a running or paused VM",
            options.qmp.display()
        )));
    }
    for line in block::clean_stale(&mut qmp, &options.scratch_dir, &vm_key).await {
        say(format!("removed what an earlier backup left: {line}"));
    }
    let mut agent = connect_agent(options, say).await;
    // An agent was given but does not answer: recorded as such, not as "not tried".
    let unanswered = options.agent.is_some() && agent.is_none();

    let disks: Vec<Disk> = block::disks(&mut qmp)
        .await?
        .into_iter()
        .filter(|d| options.only.is_empty() || options.only.contains(&d.name))
        .collect();
    if disks.is_empty() {
        return Err(VmError::State(format!(
            "the VM behind {} has no writable disk{}",
            options.qmp.display(),
            match options.only.is_empty() {
                true => String::new(),
                false => format!(" named {}", options.only.join(", ")),
            }
        )));
    }
    for d in &disks {
        cairn_format::vm::validate_disk_name(&options.vm, &d.name).map_err(|e| {
            VmError::BadInput(format!("disk {:?} cannot name an image: {e}", d.name))
        })?;
    }
    let latest = latest_vm(&repo, &options.vm).await?;
    let names: Vec<String> = disks.iter().map(|d| d.name.clone()).collect();
    let left =
        unbound_disk_versions(&repo, &options.vm, latest.as_ref().map(|l| &l.1), &names).await?;
    if !left.is_empty() {
        discard_disks(&repo, &left).await?;
        for (_, r) in &left {
            say(format!(
                "discarded {}@{}: an interrupted backup committed it, and no VM version binds it",
                r.image, r.seq
            ));
        }
    }
    let mut disks = disks;
    for disk in &mut disks {
        // A checkpoint QEMU could not save (it stopped without closing the image) may miss
        // writes, and can only be removed: the plan below reads such a disk whole.
        let bad: Vec<String> = disk
            .checkpoints()
            .filter(|b| b.inconsistent)
            .map(|b| b.name.clone())
            .collect();
        if !bad.is_empty() {
            block::remove_bitmaps(&mut qmp, disk, &bad).await?;
            say(format!(
                "{}: removed checkpoint(s) {} that QEMU left inconsistent (it stopped without \
                 saving them)",
                disk.name,
                bad.join(", ")
            ));
            disk.bitmaps.retain(|b| !b.inconsistent);
        }
    }
    let plans = plan_disks(&repo, &disks, latest.as_ref().map(|l| &l.1)).await;
    for (disk, plan) in disks.iter().zip(&plans) {
        if let Some(because) = &plan.full_because {
            say(format!("{}: reading the whole disk: {because}", disk.name));
        }
        if !disk.persistent_bitmaps() {
            say(format!(
                "{}: a {} disk keeps no bitmap across QEMU restarts: after one, the next \
                 backup reads it whole (qcow2 keeps them)",
                disk.name, disk.format
            ));
        }
    }

    let fleeces: Vec<Fleece> = (0..disks.len())
        .map(|i| Fleece::new(i, &options.scratch_dir, &vm_key))
        .collect();
    let nbd_socket = options.scratch_dir.join(format!("cairn-nbd-{vm_key}.sock"));
    let checkpoint = format!("{CHECKPOINT_PREFIX}{}", cairn_repo::session::now_ns());
    let mut run = Run {
        qmp,
        nbd_socket,
        nbd_started: false,
        committed: Vec::new(),
    };
    let outcome = run
        .take_and_commit(
            &repo,
            options,
            &disks,
            &fleeces,
            &plans,
            &checkpoint,
            agent.as_mut(),
        )
        .await;
    // Teardown, whatever happened.
    for line in block::clean_stale(&mut run.qmp, &options.scratch_dir, &vm_key).await {
        tracing::debug!("teardown: {line}");
    }
    if run.nbd_started {
        if let Err(e) = run.qmp.execute("nbd-server-stop", json!({})).await {
            tracing::warn!("nbd-server-stop: {e}");
        }
        let _ = std::fs::remove_file(&run.nbd_socket);
    }
    let taken = match outcome {
        Ok(taken) => taken,
        Err(e) => {
            if !run.committed.is_empty() {
                let versions: Vec<(Id, VersionRecord)> = run
                    .committed
                    .iter()
                    .map(|d| (d.id, d.record.clone()))
                    .collect();
                match discard_disks(&repo, &versions).await {
                    Ok(()) => say(format!(
                        "discarded the {} disk version(s) this backup committed: no VM version \
                         binds them",
                        versions.len()
                    )),
                    Err(d) => say(format!(
                        "could not discard this backup's disk versions ({d}): the next backup \
                         does"
                    )),
                }
            }
            return Err(e);
        }
    };

    let config = match qmp_config(run.qmp.pid()) {
        Some(args) => (ConfigKind::QemuArgs, args),
        None => (ConfigKind::None, String::new()),
    };
    let vm_disks: Vec<VmDisk> = disks
        .iter()
        .zip(&run.committed)
        .map(|(d, c)| VmDisk {
            name: d.name.clone(),
            version: c.id,
            seq: c.record.seq,
            node: d.node.clone(),
            checkpoint: checkpoint.clone(),
        })
        .collect();
    let published = publish_vm(
        &repo,
        NewVmVersion {
            vm: options.vm.clone(),
            time_ns: taken.time_ns,
            config_kind: config.0,
            config: config.1,
            disks: vm_disks,
            memory: None,
            freeze: match (taken.freeze, unanswered) {
                (Freeze::NotTried, true) => Freeze::NoAnswer,
                (f, _) => f,
            },
            freeze_ns: taken.paused_for.as_nanos() as u64,
            message: options.message.clone(),
        },
    )
    .await;
    let (id, record) = match published {
        Ok(p) => p,
        Err(e) => {
            let versions: Vec<(Id, VersionRecord)> = run
                .committed
                .iter()
                .map(|d| (d.id, d.record.clone()))
                .collect();
            if discard_disks(&repo, &versions).await.is_ok() {
                say(
                    "discarded this backup's disk versions: its VM version was not published"
                        .into(),
                );
            }
            return Err(e.into());
        }
    };
    // Published: the older checkpoints are no longer needed.
    for disk in &disks {
        let old: Vec<String> = disk.checkpoints().map(|b| b.name.clone()).collect();
        if let Err(e) = block::remove_bitmaps(&mut run.qmp, disk, &old).await {
            say(format!(
                "{}: could not remove older checkpoint bitmaps ({e}); the next backup reads \
                 a little more",
                disk.name
            ));
        }
    }
    Ok(BackupReport {
        id,
        record,
        disks: run.committed,
        paused_for: taken.paused_for,
        point_in_time: taken.point_in_time,
        total: started.elapsed(),
    })
}

/// Holds the lock `name` (a file in the export run directory, kept) for as long as the
/// returned file lives; refuses when another process holds it.
fn exclusive(what: &str, name: &str) -> VmResult<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    let run = cairn_export::lifecycle::run_dir();
    cairn_export::lifecycle::ensure_private_dir(&run)
        .map_err(|e| VmError::State(format!("run directory {}: {e}", run.display())))?;
    let path = run.join(format!("backup-{name}.lock"));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(&path)
        .map_err(|e| VmError::io(format!("lock {}", path.display()), e))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(VmError::State(format!(
            "another `cairn vm backup` of {what} is running on this host (lock {})",
            path.display()
        ))),
        Err(std::fs::TryLockError::Error(e)) => {
            Err(VmError::io(format!("lock {}", path.display()), e))
        }
    }
}

/// How one disk will be read.
struct DiskPlan {
    /// The disk version the last VM version binds, when the disk can be read incrementally
    /// on top of it.
    base: Option<(Id, VersionRecord)>,
    /// Older checkpoints to merge into the read bitmap.
    sources: Vec<String>,
    full_because: Option<String>,
}

async fn plan_disks(repo: &Repo, disks: &[Disk], latest: Option<&VmVersion>) -> Vec<DiskPlan> {
    let mut out = Vec::new();
    for disk in disks {
        out.push(match plan_disk(repo, disk, latest).await {
            Ok((base, sources)) => DiskPlan {
                base: Some(base),
                sources,
                full_because: None,
            },
            Err(because) => DiskPlan {
                base: None,
                sources: Vec::new(),
                full_because: Some(because),
            },
        });
    }
    out
}

/// The base version and read-bitmap sources of an incremental read, or why the disk must be
/// read whole.
async fn plan_disk(
    repo: &Repo,
    disk: &Disk,
    latest: Option<&VmVersion>,
) -> Result<((Id, VersionRecord), Vec<String>), String> {
    let Some(latest) = latest else {
        return Err("the VM's first backup".into());
    };
    let Some(bound) = latest.disks.iter().find(|d| d.name == disk.name) else {
        return Err(format!("{}@{} has no such disk", latest.vm, latest.seq));
    };
    if bound.checkpoint.is_empty() {
        return Err(format!(
            "{}@{} started no checkpoint",
            latest.vm, latest.seq
        ));
    }
    if !disk.bitmaps.iter().any(|b| b.name == bound.checkpoint) {
        return Err(format!(
            "its checkpoint {} is not in QEMU (QEMU restarted, or the bitmap was removed)",
            bound.checkpoint
        ));
    }
    match repo.deleted_versions().await {
        Ok(deleted) if deleted.contains(&bound.version) => {
            return Err(format!(
                "its last version {}@{} was removed",
                latest.vm, bound.seq
            ))
        }
        Ok(_) => {}
        Err(e) => return Err(format!("the deleted versions cannot be listed ({e})")),
    }
    let record = match repo.load_version(&bound.version).await {
        Ok(r) => r,
        Err(e) => return Err(format!("its last version cannot be read ({e})")),
    };
    if record.logical_size > disk.size {
        return Err(format!(
            "it shrank from {} to {} bytes",
            record.logical_size, disk.size
        ));
    }
    let sources = disk.checkpoints().map(|b| b.name.clone()).collect();
    Ok(((bound.version, record), sources))
}

/// The state of one backup between its point in time and its teardown.
struct Run {
    qmp: Qmp,
    nbd_socket: PathBuf,
    nbd_started: bool,
    /// Disk versions published so far, in disk order.
    committed: Vec<DiskReport>,
}

/// What the point in time was.
struct Taken {
    time_ns: i64,
    freeze: Freeze,
    paused_for: Duration,
    point_in_time: Duration,
}

impl Run {
    #[allow(clippy::too_many_arguments)]
    async fn take_and_commit(
        &mut self,
        repo: &Arc<Repo>,
        options: &BackupOptions,
        disks: &[Disk],
        fleeces: &[Fleece],
        plans: &[DiskPlan],
        checkpoint: &str,
        agent: Option<&mut Agent>,
    ) -> VmResult<Taken> {
        // Ours either way (started now, or left by a killed backup): stopped at teardown.
        block::start_nbd_server(&mut self.qmp, &self.nbd_socket).await?;
        self.nbd_started = true;
        for (disk, fleece) in disks.iter().zip(fleeces) {
            block::add_fleece(&mut self.qmp, disk, fleece).await?;
        }
        let taken = self
            .point_in_time(disks, fleeces, checkpoint, agent)
            .await?;
        for ((disk, fleece), plan) in disks.iter().zip(fleeces).zip(plans) {
            if plan.base.is_some() {
                block::add_read_bitmap(&mut self.qmp, disk, &plan.sources).await?;
            }
            block::export(&mut self.qmp, fleece, plan.base.is_some()).await?;
        }
        for ((disk, fleece), plan) in disks.iter().zip(fleeces).zip(plans) {
            let report = self
                .commit_disk(repo, options, disk, fleece, plan, taken.time_ns)
                .await?;
            self.committed.push(report);
        }
        Ok(taken)
    }

    /// Freeze, one transaction, thaw.
    async fn point_in_time(
        &mut self,
        disks: &[Disk],
        fleeces: &[Fleece],
        checkpoint: &str,
        agent: Option<&mut Agent>,
    ) -> VmResult<Taken> {
        let pairs: Vec<(&Disk, &Fleece)> = disks.iter().zip(fleeces).collect();
        let paused = Instant::now();
        let (freeze, agent) = match agent {
            None => (Freeze::NotTried, None),
            Some(agent) => match agent.freeze().await {
                Ok(n) => {
                    tracing::info!(filesystems = n, "guest frozen");
                    (Freeze::Frozen, Some(agent))
                }
                Err(e) => {
                    tracing::warn!("{e}: going on without a freeze");
                    // A freeze that timed out may still happen: thaw regardless.
                    let _ = agent.thaw().await;
                    (Freeze::NoAnswer, None)
                }
            },
        };
        let time_ns = cairn_repo::session::now_ns();
        let tx = Instant::now();
        let result = block::point_in_time(&mut self.qmp, &pairs, checkpoint).await;
        let point_in_time = tx.elapsed();
        if let Some(agent) = agent {
            if let Err(e) = agent.thaw().await {
                // Said loudly: a guest left frozen stops writing.
                tracing::error!("{e}: the guest may still be frozen; the next backup thaws it");
            }
        }
        let paused_for = paused.elapsed();
        result?;
        Ok(Taken {
            time_ns,
            freeze,
            paused_for,
            point_in_time,
        })
    }

    async fn commit_disk(
        &mut self,
        repo: &Arc<Repo>,
        options: &BackupOptions,
        disk: &Disk,
        fleece: &Fleece,
        plan: &DiskPlan,
        time_ns: i64,
    ) -> VmResult<DiskReport> {
        let started = Instant::now();
        let image_name = VmVersion::disk_image(&options.vm, &disk.name);
        let url = format!(
            "nbd+unix:///{}?socket={}",
            fleece.export,
            self.nbd_socket.display()
        );
        let incremental = plan.base.is_some();
        let (nbd, dirty) = tokio::task::spawn_blocking(move || {
            let bitmap = incremental.then_some(READ_BITMAP);
            let nbd = NbdImage::connect(&url, bitmap)?;
            let dirty = match incremental {
                true => Some(nbd.dirty_extents()?),
                false => None,
            };
            Ok::<_, cairn_image::ImageError>((nbd, dirty))
        })
        .await
        .map_err(|e| VmError::State(format!("NBD reader: {e}")))?
        .map_err(|e| VmError::State(format!("{}: {e}", disk.name)))?;
        let dirty_bytes = dirty
            .as_ref()
            .map(|d| d.iter().map(|(s, e)| e - s).sum())
            .unwrap_or(0);
        let image: Arc<dyn DiskImage> = match options.rate_limit {
            Some(rate) => Arc::new(RateLimited::new(Box::new(nbd), rate)),
            None => Arc::new(nbd),
        };
        let source = CommitSource::Nbd {
            image,
            dirty: dirty.map(|d| (READ_BITMAP.to_string(), d)),
        };
        let planned = plan_commit(repo, &image_name, source, plan.base.clone(), &NoRecords).await?;
        let message = format!(
            "{DISK_MESSAGE_PREFIX}{} at {}{}",
            options.vm,
            time_ns,
            match options.message.is_empty() {
                true => String::new(),
                false => format!(": {}", options.message),
            }
        );
        let done = commit_planned(
            repo.clone(),
            &image_name,
            planned,
            CommitOptions {
                message,
                dedup: options.dedup,
                ..Default::default()
            },
        )
        .await?;
        Ok(DiskReport {
            name: disk.name.clone(),
            image: image_name,
            id: done.result.id,
            record: done.result.record,
            full_because: plan.full_because.clone(),
            dirty_bytes,
            read_bytes: done.read_bytes,
            duration: started.elapsed(),
        })
    }
}

/// Connects to the guest agent when one is configured; says why not when it does not answer.
/// A guest that an interrupted backup left frozen is thawed here.
async fn connect_agent(
    options: &BackupOptions,
    say: &(dyn Fn(String) + Send + Sync),
) -> Option<Agent> {
    let Some(path) = &options.agent else {
        say(
            "no guest agent given (--guest-agent): the disks are crash-consistent, as after \
             a power cut, not frozen"
                .into(),
        );
        return None;
    };
    match Agent::connect(path, options.agent_timeout).await {
        Ok(mut agent) => {
            if let Ok(FreezeStatus::Frozen) = agent.status().await {
                let _ = agent.thaw().await;
                say("the guest was left frozen (by a backup that was killed): thawed".into());
            }
            Some(agent)
        }
        Err(e) => {
            say(format!(
                "{e}: backing up without a freeze (crash-consistent, as after a power cut)"
            ));
            None
        }
    }
}

/// The QEMU command line of process `pid`, one argument per line.
fn qmp_config(pid: Option<u32>) -> Option<String> {
    let raw = std::fs::read(format!("/proc/{}/cmdline", pid?)).ok()?;
    let args: Vec<String> = raw
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    Some(args.join("\n"))
}

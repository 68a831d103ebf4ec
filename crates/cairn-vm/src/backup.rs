//! `cairn vm backup`: one consistent point in time across every disk of a running VM, read
//! over NBD (only what changed since the last backup when its checkpoint is still there),
//! committed as one VM version. The hypervisor side (QEMU over QMP, or libvirt) is a
//! [`Hypervisor`]; everything that touches the repository is here, once.
//!
//! The steps, and what each leaves when it fails:
//! 1. clean up what a killed backup left on the hypervisor (jobs, exports, scratch images; a
//!    guest left frozen is thawed) and discard disk versions it committed that no VM version
//!    binds;
//! 2. prepare (scratch nodes), freeze the guest's file systems (guest agent, bounded wait),
//!    take the point in time across every disk with a new checkpoint, thaw at once;
//! 3. expose each disk's point-in-time view over NBD, with a bitmap of what changed since the
//!    checkpoint the last published VM version started (even when backups failed since);
//! 4. commit each disk: incrementally on the disk version the last VM version binds when its
//!    checkpoint is there, in full otherwise (said, with the reason);
//! 5. publish the VM version, then drop the older checkpoints.
//!
//! Teardown runs whatever happened. Until step 5 succeeds no checkpoint is dropped: the next
//! backup still reads every change since the last published version, so a failed backup costs
//! a re-read, never a missed change.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cairn_engine::commit::plan::{commit_planned, plan_commit, CommitSource, NoRecords};
use cairn_engine::commit::{CommitOptions, DedupMode};
use cairn_engine::source::RateLimited;
use cairn_engine::vm::{
    discard_disks, latest_vm, publish_vm, unbound_disk_versions, NewVmVersion, DISK_MESSAGE_PREFIX,
};
use cairn_format::memstate::MEMORY_IMAGE;
use cairn_format::version::VersionRecord;
use cairn_format::vm::{Freeze, VmDisk, VmVersion};
use cairn_format::Id;
use cairn_image::DiskImage;
use cairn_nbd::client::NbdImage;
use cairn_repo::Repo;

use crate::error::{VmError, VmResult};
use crate::hypervisor::{DiskInfo, Frozen, Hypervisor, Reader, CHECKPOINT_PREFIX};

/// Which hypervisor runs the VM.
#[derive(Debug, Clone)]
pub enum Target {
    /// A QEMU over its QMP socket, with its guest agent's socket when it has one, and where
    /// the scratch images go (they grow by what the guest writes during the backup).
    Qmp {
        socket: PathBuf,
        agent: Option<PathBuf>,
        scratch_dir: PathBuf,
    },
    /// A libvirt domain (`connect`: a libvirt URI, default qemu:///system).
    Libvirt {
        domain: String,
        connect: Option<String>,
        scratch_dir: PathBuf,
    },
}

/// What to back up, and how.
#[derive(Debug, Clone)]
pub struct BackupOptions {
    pub vm: String,
    pub target: Target,
    /// The longest wait for each guest agent exchange.
    pub agent_timeout: Duration,
    /// Only these disks (by name); all writable disks when empty.
    pub only: Vec<String>,
    pub message: String,
    pub dedup: DedupMode,
    /// Bytes per second each disk is read at, at most.
    pub rate_limit: Option<u64>,
    /// Also save the guest's memory and device state ([`crate::memory`]).
    pub memory: bool,
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

/// What saving the memory state did.
#[derive(Debug, Clone)]
pub struct MemoryReport {
    /// The memory state image's version (`VM/.memory`).
    pub version: DiskReport,
    /// The guest's RAM, and the bytes of QEMU's migration stream.
    pub ram_bytes: u64,
    pub stream_bytes: u64,
    /// Pages holding data (zero pages are holes of the image).
    pub data_pages: u64,
    pub page_size: u32,
    /// The last pass, with the guest paused, as QEMU measured it.
    pub downtime: Duration,
    /// The copy, from the migration's start to its end.
    pub copy: Duration,
}

/// What a backup did.
#[derive(Debug, Clone)]
pub struct BackupReport {
    pub id: Id,
    pub record: VmVersion,
    pub disks: Vec<DiskReport>,
    pub memory: Option<MemoryReport>,
    /// From the freeze request to the thaw's answer (the point in time alone, unfrozen).
    pub paused_for: Duration,
    /// Taking the point in time (the transaction, or libvirt's backup-begin).
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
    for d in &options.only {
        cairn_format::vm::validate_disk_name(&options.vm, d)
            .map_err(|e| VmError::BadInput(format!("--disk {d:?}: {e}")))?;
    }
    if options.memory && matches!(options.target, Target::Libvirt { .. }) {
        return Err(VmError::BadInput(
            crate::libvirt::MEMORY_WITH_QMP_ONLY.into(),
        ));
    }
    let vm_key = hex::encode(&blake3::hash(options.vm.as_bytes()).as_bytes()[..4]);
    let _vm_lock = exclusive(&format!("VM {}", options.vm), &format!("vm-{vm_key}"))?;
    match &options.target {
        Target::Qmp {
            socket,
            agent,
            scratch_dir,
        } => {
            let mut qemu = crate::qemu::Qemu::connect(
                socket,
                agent.clone(),
                options.agent_timeout,
                scratch_dir,
                &vm_key,
            )
            .await?;
            run(repo, options, &mut qemu, say).await
        }
        Target::Libvirt {
            domain,
            connect,
            scratch_dir,
        } => {
            let mut libvirt =
                crate::libvirt::Libvirt::new(domain, connect.clone(), scratch_dir, &vm_key)?;
            run(repo, options, &mut libvirt, say).await
        }
    }
}

/// One VM of a batch and how its backup ended.
#[derive(Debug)]
pub struct BatchItem {
    pub vm: String,
    pub result: VmResult<BackupReport>,
}

/// Backs up several VMs in one run, one after the other. Each VM gets its own point in time,
/// taken just before its disks are read (its freeze stays as short as alone), and each commit
/// deduplicates against what the VMs before it stored: VMs cloned from one image and updated
/// alike store each new block once, as if backed up one by one, where backups running at once
/// would each store what none of them has published yet. A VM that fails is reported (`say`
/// hears it, named) and the others go on.
pub async fn backup_all(
    repo: Arc<Repo>,
    batch: &[BackupOptions],
    say: &(dyn Fn(String) + Send + Sync),
) -> Vec<BatchItem> {
    let mut out = Vec::with_capacity(batch.len());
    for options in batch {
        let named = |line: String| say(format!("{}: {line}", options.vm));
        let result = backup(repo.clone(), options, &named).await;
        if let Err(e) = &result {
            named(format!("backup failed: {e}"));
        }
        out.push(BatchItem {
            vm: options.vm.clone(),
            result,
        });
    }
    out
}

/// The backup on hypervisor `hv`.
async fn run<H: Hypervisor>(
    repo: Arc<Repo>,
    options: &BackupOptions,
    hv: &mut H,
    say: &(dyn Fn(String) + Send + Sync),
) -> VmResult<BackupReport> {
    let started = Instant::now();
    let key = hex::encode(&blake3::hash(hv.lock_key().as_bytes()).as_bytes()[..4]);
    let _hv_lock = exclusive(&hv.describe(), &format!("hv-{key}"))?;
    hv.check_running().await?;
    for line in hv.clean_stale().await {
        say(format!("removed what an earlier backup left: {line}"));
    }
    let disks: Vec<DiskInfo> = hv
        .disks(say)
        .await?
        .into_iter()
        .filter(|d| options.only.is_empty() || options.only.contains(&d.name))
        .collect();
    if disks.is_empty() {
        return Err(VmError::State(format!(
            "{} has no writable disk{}",
            hv.describe(),
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
    let latest = latest_vm(&repo, &options.vm).await?.map(|l| l.1);
    let mut names: Vec<String> = disks.iter().map(|d| d.name.clone()).collect();
    names.push(MEMORY_IMAGE.to_string());
    let left = unbound_disk_versions(&repo, &options.vm, latest.as_ref(), &names).await?;
    if !left.is_empty() {
        discard_disks(&repo, &left).await?;
        for (_, r) in &left {
            say(format!(
                "discarded {}@{}: an interrupted backup committed it, and no VM version binds it",
                r.image, r.seq
            ));
        }
    }
    let mut plans = Vec::new();
    for disk in &disks {
        let plan = plan_disk(&repo, disk, latest.as_ref()).await;
        if let Err(because) = &plan {
            say(format!("{}: reading the whole disk: {because}", disk.name));
        }
        plans.push(plan);
    }
    let since: Vec<Option<String>> = plans
        .iter()
        .map(|p| p.as_ref().ok().map(|(_, cp)| cp.clone()))
        .collect();

    let checkpoint = format!("{CHECKPOINT_PREFIX}{}", cairn_repo::session::now_ns());
    let mut committed = Vec::new();
    let mut memory = None;
    let outcome = take_and_commit(
        &repo,
        options,
        hv,
        &disks,
        &plans,
        &since,
        &checkpoint,
        &mut committed,
        &mut memory,
        say,
    )
    .await;
    hv.teardown().await;
    let taken = match outcome {
        Ok(taken) => taken,
        Err(e) => {
            discard_committed(&repo, &committed, &memory, say).await;
            return Err(e);
        }
    };
    let (config_kind, config) = hv.config().await;
    let vm_disks: Vec<VmDisk> = disks
        .iter()
        .zip(&committed)
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
            config_kind,
            config,
            disks: vm_disks,
            memory: memory.as_ref().map(|m| m.version.id),
            freeze: taken.freeze,
            freeze_ns: taken.paused_for.as_nanos() as u64,
            message: options.message.clone(),
        },
    )
    .await;
    let (id, record) = match published {
        Ok(p) => p,
        Err(e) => {
            discard_committed(&repo, &committed, &memory, say).await;
            return Err(e.into());
        }
    };
    // Published: the older checkpoints are no longer needed.
    if let Err(e) = hv.drop_checkpoints(&disks, &checkpoint).await {
        say(format!(
            "could not drop the older checkpoints ({e}); the next backup reads a little more"
        ));
    }
    Ok(BackupReport {
        id,
        record,
        disks: committed,
        memory,
        paused_for: taken.paused_for,
        point_in_time: taken.point_in_time,
        total: started.elapsed(),
    })
}

/// Marks the disk versions a failed backup committed deleted: no VM version binds them.
async fn discard_committed(
    repo: &Repo,
    committed: &[DiskReport],
    memory: &Option<MemoryReport>,
    say: &(dyn Fn(String) + Send + Sync),
) {
    let versions: Vec<(Id, VersionRecord)> = committed
        .iter()
        .chain(memory.as_ref().map(|m| &m.version))
        .map(|d| (d.id, d.record.clone()))
        .collect();
    if versions.is_empty() {
        return;
    }
    match discard_disks(repo, &versions).await {
        Ok(()) => say(format!(
            "discarded the {} disk version(s) this backup committed: no VM version binds them",
            versions.len()
        )),
        Err(d) => say(format!(
            "could not discard this backup's disk versions ({d}): the next backup does"
        )),
    }
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

/// A disk's incremental read: the version to build on and the checkpoint to read changes
/// since; or why the disk must be read whole.
type DiskPlan = Result<((Id, VersionRecord), String), String>;

async fn plan_disk(repo: &Repo, disk: &DiskInfo, latest: Option<&VmVersion>) -> DiskPlan {
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
    if !disk.checkpoints.contains(&bound.checkpoint) {
        return Err(format!(
            "its checkpoint {} is gone (the hypervisor restarted, or it was removed)",
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
    Ok(((bound.version, record), bound.checkpoint.clone()))
}

/// What the point in time was.
struct Taken {
    time_ns: i64,
    freeze: Freeze,
    paused_for: Duration,
    point_in_time: Duration,
}

#[allow(clippy::too_many_arguments)]
async fn take_and_commit<H: Hypervisor>(
    repo: &Arc<Repo>,
    options: &BackupOptions,
    hv: &mut H,
    disks: &[DiskInfo],
    plans: &[DiskPlan],
    since: &[Option<String>],
    checkpoint: &str,
    committed: &mut Vec<DiskReport>,
    memory: &mut Option<MemoryReport>,
    say: &(dyn Fn(String) + Send + Sync),
) -> VmResult<Taken> {
    hv.prepare(disks).await?;
    let (taken, saved) = match options.memory {
        false => (
            freeze_and_take(options, hv, disks, since, checkpoint, say).await?,
            None,
        ),
        true => {
            let (taken, saved) = save_and_take(hv, disks, since, checkpoint, say).await?;
            (taken, Some(saved))
        }
    };
    let readers = hv.expose(disks, since).await?;
    for ((disk, plan), reader) in disks.iter().zip(plans).zip(readers) {
        let report = commit_disk(repo, options, disk, plan, reader, taken.time_ns).await?;
        committed.push(report);
    }
    if let Some(saved) = saved {
        *memory = Some(commit_memory(repo, options, saved, taken.time_ns).await?);
    }
    Ok(taken)
}

/// Freeze, the point in time, thaw: as short as the hypervisor lets it be.
async fn freeze_and_take<H: Hypervisor>(
    options: &BackupOptions,
    hv: &mut H,
    disks: &[DiskInfo],
    since: &[Option<String>],
    checkpoint: &str,
    say: &(dyn Fn(String) + Send + Sync),
) -> VmResult<Taken> {
    let paused = Instant::now();
    let (frozen, note) = hv.freeze(options.agent_timeout).await;
    if let Some(note) = note {
        say(note);
    }
    let time_ns = cairn_repo::session::now_ns();
    let tx = Instant::now();
    let result = hv.point_in_time(disks, since, checkpoint).await;
    let point_in_time = tx.elapsed();
    if frozen == Frozen::Yes {
        hv.thaw(options.agent_timeout).await;
    }
    let paused_for = paused.elapsed();
    result?;
    Ok(Taken {
        time_ns,
        freeze: match frozen {
            Frozen::NoAgent => Freeze::NotTried,
            Frozen::Yes => Freeze::Frozen,
            Frozen::NoAnswer => Freeze::NoAnswer,
        },
        paused_for,
        point_in_time,
    })
}

/// The memory state, then the disks' point in time while the guest is still paused at the
/// memory's instant, then the guest runs again (whatever happened).
async fn save_and_take<H: Hypervisor>(
    hv: &mut H,
    disks: &[DiskInfo],
    since: &[Option<String>],
    checkpoint: &str,
    say: &(dyn Fn(String) + Send + Sync),
) -> VmResult<(Taken, crate::memory::Saved)> {
    let saved = match hv.save_memory().await {
        Ok(saved) => saved,
        Err(e) => {
            hv.resume().await;
            return Err(e);
        }
    };
    if saved.forced_pause {
        say(
            "the guest wrote memory faster than it could be copied: it was paused to finish, \
             and a guest resumed from this state starts paused (QMP `cont` runs it)"
                .into(),
        );
    }
    let time_ns = cairn_repo::session::now_ns();
    let tx = Instant::now();
    let result = hv.point_in_time(disks, since, checkpoint).await;
    let point_in_time = tx.elapsed();
    hv.resume().await;
    let paused_for = saved.downtime + saved.paused_at.elapsed();
    result?;
    Ok((
        Taken {
            time_ns,
            freeze: Freeze::NotTried,
            paused_for,
            point_in_time,
        },
        saved,
    ))
}

/// Commits the memory state image as a version of `VM/.memory` (deduplicated against the
/// VM's earlier states by content; its zero pages are holes).
async fn commit_memory(
    repo: &Arc<Repo>,
    options: &BackupOptions,
    saved: crate::memory::Saved,
    time_ns: i64,
) -> VmResult<MemoryReport> {
    let started = Instant::now();
    let image_name = VmVersion::disk_image(&options.vm, MEMORY_IMAGE);
    let file = saved.file.clone();
    let image = cairn_image::RawImage::open(&file, Default::default())
        .map_err(|e| VmError::State(format!("memory state image {}: {e}", file.display())))?;
    let source = CommitSource::Local(Arc::new(image));
    let planned = plan_commit(repo, &image_name, source, None, &NoRecords).await?;
    let done = commit_planned(
        repo.clone(),
        &image_name,
        planned,
        CommitOptions {
            message: disk_message(options, time_ns),
            dedup: options.dedup,
            ..Default::default()
        },
    )
    .await?;
    let _ = std::fs::remove_file(&saved.file);
    let layout = &saved.received.layout;
    Ok(MemoryReport {
        version: DiskReport {
            name: MEMORY_IMAGE.to_string(),
            image: image_name,
            id: done.result.id,
            record: done.result.record,
            full_because: None,
            dirty_bytes: 0,
            read_bytes: done.read_bytes,
            duration: started.elapsed(),
        },
        ram_bytes: layout.ram_bytes(),
        stream_bytes: saved.received.stream_bytes,
        data_pages: saved.received.data_pages,
        page_size: layout.page_size,
        downtime: saved.downtime,
        copy: saved.duration,
    })
}

/// The message of every image version a backup commits: the prefix that tells it apart.
fn disk_message(options: &BackupOptions, time_ns: i64) -> String {
    format!(
        "{DISK_MESSAGE_PREFIX}{} at {}{}",
        options.vm,
        time_ns,
        match options.message.is_empty() {
            true => String::new(),
            false => format!(": {}", options.message),
        }
    )
}

async fn commit_disk(
    repo: &Arc<Repo>,
    options: &BackupOptions,
    disk: &DiskInfo,
    plan: &DiskPlan,
    reader: Reader,
    time_ns: i64,
) -> VmResult<DiskReport> {
    let started = Instant::now();
    let image_name = VmVersion::disk_image(&options.vm, &disk.name);
    let bitmap = reader.bitmap.clone();
    let (nbd, dirty) = tokio::task::spawn_blocking(move || {
        let nbd = NbdImage::connect(&reader.url, bitmap.as_deref())?;
        let dirty = match bitmap {
            Some(_) => Some(nbd.dirty_extents()?),
            None => None,
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
        dirty: dirty.map(|d| (reader.bitmap.unwrap_or_default(), d)),
    };
    let base = plan.as_ref().ok().map(|(base, _)| base.clone());
    let planned = plan_commit(repo, &image_name, source, base, &NoRecords).await?;
    let message = disk_message(options, time_ns);
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
        full_because: plan.as_ref().err().cloned(),
        dirty_bytes,
        read_bytes: done.read_bytes,
        duration: started.elapsed(),
    })
}

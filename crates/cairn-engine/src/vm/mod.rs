//! Whole VMs: a VM version binds one version of each disk (each disk an image of its own,
//! `VM/DISK`), the VM's configuration and, when saved, its memory state, all taken at one
//! point in time.
//!
//! Publication order: every disk's version is published first as an ordinary image version
//! (so every command that works on images works on a VM's disk), then the VM version record,
//! then the VM head by compare-and-swap. A VM version is therefore all or nothing: it exists
//! only once every disk it binds is published. Disk versions of a backup that failed before
//! its VM version was published belong to no VM version; [`discard_disks`] marks them
//! deleted (the backup itself on failure, the next backup after a kill).

use std::collections::HashMap;

use cairn_format::version::VersionRecord;
use cairn_format::vm::{ConfigKind, Freeze, VmDisk, VmVersion};
use cairn_format::Id;
use cairn_repo::Repo;

use crate::error::{EngineError, EngineResult};

pub mod check;
pub mod copy;
pub mod strays;

/// Publication attempts when other backups of the same VM move its head meanwhile.
const PUBLISH_ATTEMPTS: u32 = 8;

/// A parsed `VM[@N|@TAG]`: the newest version, the version with sequence number N, or the
/// version a tag of the VM names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmSpec {
    pub vm: String,
    pub seq: Option<u64>,
    pub tag: Option<String>,
}

impl VmSpec {
    pub fn parse(spec: &str) -> EngineResult<VmSpec> {
        let (vm, seq, tag) = match spec.split_once('@') {
            None => (spec, None, None),
            Some((vm, r))
                if !r.is_empty() && r.len() <= 12 && r.bytes().all(|b| b.is_ascii_digit()) =>
            {
                match r.parse::<u64>() {
                    Ok(n) if n > 0 => (vm, Some(n), None),
                    _ => {
                        return Err(EngineError::BadInput(format!(
                            "{spec:?}: VM versions are numbered from 1 (`cairn vm log {vm}` \
                             lists them)"
                        )))
                    }
                }
            }
            Some((vm, r)) => {
                cairn_format::refs::validate_tag_name(r).map_err(|e| {
                    EngineError::BadInput(format!(
                        "{spec:?}: a VM version is VM@N (its sequence number) or VM@TAG: {e}"
                    ))
                })?;
                (vm, None, Some(r.to_string()))
            }
        };
        cairn_format::name::validate_image_name(vm)?;
        Ok(VmSpec {
            vm: vm.to_string(),
            seq,
            tag,
        })
    }

    /// The version with sequence number `seq` of `vm`.
    pub fn numbered(vm: &str, seq: u64) -> VmSpec {
        VmSpec {
            vm: vm.to_string(),
            seq: Some(seq),
            tag: None,
        }
    }

    /// Whether the spec names one version rather than "the newest".
    pub fn is_pinned(&self) -> bool {
        self.seq.is_some() || self.tag.is_some()
    }
}

impl std::fmt::Display for VmSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match (&self.seq, &self.tag) {
            (Some(n), _) => write!(f, "{}@{n}", self.vm),
            (None, Some(t)) => write!(f, "{}@{t}", self.vm),
            (None, None) => f.write_str(&self.vm),
        }
    }
}

/// What a new VM version binds (its sequence number and parent come from the VM's head).
#[derive(Debug, Clone)]
pub struct NewVmVersion {
    pub vm: String,
    pub time_ns: i64,
    pub config_kind: ConfigKind,
    pub config: String,
    pub disks: Vec<VmDisk>,
    pub memory: Option<Id>,
    pub freeze: Freeze,
    pub freeze_ns: u64,
    pub message: String,
}

/// Publishes a VM version on top of the VM's newest one; returns its id and record.
pub async fn publish_vm(repo: &Repo, new: NewVmVersion) -> EngineResult<(Id, VmVersion)> {
    EngineError::ensure_writable(repo, "vm backup")?;
    for disk in &new.disks {
        cairn_format::vm::validate_disk_name(&new.vm, &disk.name)?;
    }
    for _ in 0..PUBLISH_ATTEMPTS {
        let head = repo.vm_head(&new.vm).await?;
        let (parent, seq) = match &head {
            Some(h) => (
                Some(h.version),
                repo.load_vm_version(&h.version).await?.seq + 1,
            ),
            None => (None, 1),
        };
        let record = VmVersion {
            vm: new.vm.clone(),
            seq,
            parent,
            time_ns: new.time_ns,
            config_kind: new.config_kind,
            config: new.config.clone(),
            disks: new.disks.clone(),
            memory: new.memory,
            freeze: new.freeze,
            freeze_ns: new.freeze_ns,
            message: new.message.clone(),
        };
        let (id, _) = repo.put_vm_version(&record).await?;
        if repo.swap_vm_head(&new.vm, head.as_ref(), &id).await? {
            tracing::info!(vm = %new.vm, seq, %id, "VM version published");
            return Ok((id, record));
        }
    }
    Err(EngineError::Repo(cairn_repo::RepoError::Contention {
        image: new.vm,
        attempts: PUBLISH_ATTEMPTS,
    }))
}

/// The VM's live versions, newest first (deleted ones are skipped; their records still
/// link the history).
pub async fn vm_history(repo: &Repo, vm: &str) -> EngineResult<Vec<(Id, VmVersion)>> {
    let deleted = repo.vm_deleted_versions().await?;
    let all = vm_history_all(repo, vm).await?;
    Ok(all
        .into_iter()
        .filter(|(id, _)| !deleted.contains(id))
        .collect())
}

/// Every version of the VM, deleted ones included, newest first.
async fn vm_history_all(repo: &Repo, vm: &str) -> EngineResult<Vec<(Id, VmVersion)>> {
    let Some(head) = repo.vm_head(vm).await? else {
        return Err(EngineError::NotFound(format!(
            "VM {vm:?} has no versions (`cairn vm list` shows the VMs)"
        )));
    };
    let mut out = Vec::new();
    let mut next = Some(head.version);
    while let Some(id) = next {
        let record = repo.load_vm_version(&id).await?;
        next = record.parent;
        out.push((id, record));
    }
    Ok(out)
}

/// Every image version a live VM version binds (disks, memory state), with the first such VM
/// version's name (`web@3`): what removing versions of `images` must keep. A VM version binds
/// only images under its VM's name (`VM/…`), so a VM whose history cannot be read whole is an
/// error only when one of `images` lies under it (what it binds there cannot be known); for
/// other images it is said and passed over (`verify` names the damage).
pub async fn bound_versions(repo: &Repo, images: &[&str]) -> EngineResult<HashMap<Id, String>> {
    let mut out = HashMap::new();
    for vm in repo.vms().await? {
        let history = match vm_history(repo, &vm).await {
            Ok(h) => h,
            Err(e) => {
                let prefix = format!("{vm}/");
                if let Some(image) = images.iter().find(|i| i.starts_with(&prefix)) {
                    return Err(EngineError::Repo(cairn_repo::RepoError::Refused(format!(
                        "{image} is a disk of VM {vm:?}, whose versions cannot all be read \
                         ({e}): which of its versions a VM version binds is unknown, so none \
                         is removed (`cairn verify` names the damage)"
                    ))));
                }
                tracing::warn!(vm, "{e}: its VM versions cannot all be read");
                continue;
            }
        };
        for (_, v) in history {
            for (_, version) in v.bound() {
                out.entry(version)
                    .or_insert_with(|| format!("{}@{}", v.vm, v.seq));
            }
        }
    }
    // VM versions whose head was lost or moved back bind their disks all the same.
    let strays = strays::vm_strays(repo).await?;
    if let (Some(damaged), Some(image)) = (
        strays.damaged.first(),
        images.iter().find(|i| i.contains('/')),
    ) {
        return Err(EngineError::Repo(cairn_repo::RepoError::Refused(format!(
            "{image} may be a VM's disk, and VM version record {} cannot be read ({}): which \
             versions it binds is unknown, so none is removed (`cairn verify` names the damage)",
            damaged.key, damaged.problem
        ))));
    }
    for (_, v) in &strays.strays {
        for (_, version) in v.bound() {
            out.entry(version)
                .or_insert_with(|| format!("{}@{} (reached by no head)", v.vm, v.seq));
        }
    }
    Ok(out)
}

/// What removing VM versions took away.
#[derive(Debug, Clone)]
pub struct RemovedVmVersion {
    pub id: Id,
    pub record: VmVersion,
    /// Disk versions removed with it (those no other live VM version binds and no tag names).
    pub disks: Vec<(Id, VersionRecord)>,
}

/// Removes the VM versions `specs` name (each resolved first: nothing changes unless all
/// resolve), and with each the disk versions that only it binds; tagged disk versions stay
/// as image versions. Space is freed by GC.
pub async fn remove_vm_versions(
    repo: &Repo,
    specs: &[VmSpec],
) -> EngineResult<Vec<RemovedVmVersion>> {
    EngineError::ensure_writable(repo, "vm rm")?;
    let mut targets: Vec<(Id, VmVersion)> = Vec::new();
    for spec in specs {
        if !spec.is_pinned() {
            return Err(EngineError::BadInput(format!(
                "{}: name the versions to remove (VM@N; `cairn vm log {}` lists them)",
                spec.vm, spec.vm
            )));
        }
        let target = resolve_vm(repo, spec).await?;
        if !targets.iter().any(|(id, _)| *id == target.0) {
            targets.push(target);
        }
    }
    for (id, record) in &targets {
        if let Some((tag, _)) = repo
            .vm_tags(&record.vm)
            .await?
            .into_iter()
            .find(|(_, t)| t == id)
        {
            return Err(EngineError::VmTagged {
                version: format!("{}@{}", record.vm, record.seq),
                vm: record.vm.clone(),
                tag,
            });
        }
    }
    let (tags, _) = repo.all_tag_targets_checked().await?;
    let tagged: std::collections::HashSet<Id> = tags.into_iter().map(|(_, id)| id).collect();
    let mut out = Vec::new();
    for (id, record) in targets {
        repo.mark_vm_deleted(&id).await?;
        // Bound by the VM versions still live after this one's removal.
        let images: Vec<String> = record
            .bound()
            .iter()
            .map(|(name, _)| VmVersion::disk_image(&record.vm, name))
            .collect();
        let images: Vec<&str> = images.iter().map(String::as_str).collect();
        let still = bound_versions(repo, &images).await?;
        let mut disks = Vec::new();
        for (name, version) in record.bound() {
            if still.contains_key(&version) || tagged.contains(&version) {
                continue;
            }
            match repo.load_version(&version).await {
                Ok(r) => {
                    repo.mark_deleted(&version).await?;
                    disks.push((version, r));
                }
                Err(e) => tracing::warn!(disk = %name, "{e}: left as it is"),
            }
        }
        tracing::info!(vm = %record.vm, seq = record.seq, %id, "removed VM version");
        out.push(RemovedVmVersion { id, record, disks });
    }
    Ok(out)
}

/// The VM version `spec` names (a live one: deleted versions cannot be named).
pub async fn resolve_vm(repo: &Repo, spec: &VmSpec) -> EngineResult<(Id, VmVersion)> {
    let history = vm_history(repo, &spec.vm).await?;
    let tagged = match &spec.tag {
        None => None,
        Some(tag) => match repo
            .vm_tags(&spec.vm)
            .await?
            .into_iter()
            .find(|(t, _)| t == tag)
        {
            Some((_, id)) => Some(id),
            None => {
                return Err(EngineError::NotFound(format!(
                    "{spec}: VM {} has no tag {tag:?} (`cairn vm log {}` shows its tags)",
                    spec.vm, spec.vm
                )))
            }
        },
    };
    let found = history
        .into_iter()
        .find(|(id, v)| match (spec.seq, tagged) {
            (Some(n), _) => v.seq == n,
            (None, Some(t)) => *id == t,
            (None, None) => true,
        });
    found.ok_or_else(|| {
        EngineError::NotFound(format!(
            "{spec}: no such VM version (`cairn vm log {}` lists them)",
            spec.vm
        ))
    })
}

/// The newest live VM version, if the VM has any.
pub async fn latest_vm(repo: &Repo, vm: &str) -> EngineResult<Option<(Id, VmVersion)>> {
    if repo.vm_head(vm).await?.is_none() {
        return Ok(None);
    }
    Ok(vm_history(repo, vm).await?.into_iter().next())
}

/// How the message of every disk version a VM backup commits starts: what tells a disk
/// version a killed backup left from a commit the operator made by hand.
pub const DISK_MESSAGE_PREFIX: &str = "vm backup: ";

/// Disk versions of `vm` newer than what its newest VM version binds and committed by a VM
/// backup (their message starts with [`DISK_MESSAGE_PREFIX`]): left by a backup that failed
/// or was killed before it published its VM version. Each disk's image history is read down
/// to the version the VM binds (or to its start for a disk the VM never had).
pub async fn unbound_disk_versions(
    repo: &Repo,
    vm: &str,
    latest: Option<&VmVersion>,
    disks: &[String],
) -> EngineResult<Vec<(Id, VersionRecord)>> {
    let mut out = Vec::new();
    // A VM version whose head was lost binds its disks: they are not a killed backup's.
    let strays = strays::vm_strays(repo).await?;
    let kept: std::collections::HashSet<Id> = strays
        .of(vm)
        .flat_map(|(_, v)| v.bound().into_iter().map(|(_, id)| id))
        .collect();
    for disk in disks {
        let image = VmVersion::disk_image(vm, disk);
        let bound = match latest {
            None => None,
            Some(v) => match v.disks.iter().find(|d| &d.name == disk) {
                Some(d) => Some((d.version, d.seq)),
                // The memory state binds no seq: its record says.
                None => match v.bound().into_iter().find(|(n, _)| n == disk) {
                    Some((_, id)) => Some((id, repo.load_version(&id).await?.seq)),
                    None => None,
                },
            },
        };
        let history = match crate::resolve::history(repo, &image).await {
            Ok(h) => h,
            Err(EngineError::Repo(cairn_repo::RepoError::NoSuchImage(_))) => continue,
            Err(EngineError::NotFound(_)) => continue,
            Err(e) => return Err(e),
        };
        for (id, record) in history {
            if bound.is_some_and(|(version, seq)| version == id || record.seq <= seq) {
                break;
            }
            if record.message.starts_with(DISK_MESSAGE_PREFIX) && !kept.contains(&id) {
                out.push((id, record));
            }
        }
    }
    Ok(out)
}

/// Marks disk versions that belong to no VM version deleted (GC frees what only they used).
pub async fn discard_disks(repo: &Repo, versions: &[(Id, VersionRecord)]) -> EngineResult<()> {
    for (id, record) in versions {
        repo.mark_deleted(id).await?;
        tracing::info!(image = %record.image, seq = record.seq, %id,
            "discarded a disk version no VM version binds");
    }
    Ok(())
}

/// Applies `policy` to the live versions of VM `vm` and, unless `dry_run`, removes the ones
/// it does not keep (each with the disk versions only it binds). Every decision, newest first,
/// with the version's time.
pub async fn prune_vm(
    repo: &Repo,
    vm: &str,
    policy: &crate::retention::KeepPolicy,
    dry_run: bool,
) -> EngineResult<Vec<(crate::retention::RetentionDecision, i64)>> {
    use crate::retention::{plan_dated, Dated};
    if policy.is_empty() {
        return Err(EngineError::BadInput(format!(
            "refusing to remove every version of VM {vm:?}: the retention policy keeps nothing"
        )));
    }
    let versions = vm_history(repo, vm).await?;
    let dated: Vec<Dated> = versions
        .iter()
        .map(|(id, v)| Dated {
            id: *id,
            seq: v.seq,
            time_ns: v.time_ns,
        })
        .collect();
    let mut tagged: HashMap<Id, Vec<String>> = HashMap::new();
    for (tag, id) in repo.vm_tags(vm).await? {
        tagged.entry(id).or_default().push(tag);
    }
    let decisions = plan_dated(&dated, policy, &tagged);
    if !dry_run {
        let doomed: Vec<VmSpec> = decisions
            .iter()
            .filter(|d| !d.keep)
            .map(|d| VmSpec::numbered(vm, d.seq))
            .collect();
        if !doomed.is_empty() {
            remove_vm_versions(repo, &doomed).await?;
        }
    }
    Ok(decisions
        .into_iter()
        .zip(versions.iter().map(|(_, v)| v.time_ns))
        .collect())
}

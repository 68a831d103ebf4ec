//! VM version records no VM head or tag reaches. A VM version is published disks first, then
//! its record, then its head: so a record in the store names a complete VM version, and one
//! no ref reaches is either a backup's that lost the race for the head or was killed just
//! before moving it (*unpublished*: nothing may bind to it), or one whose head was lost,
//! damaged or moved back (a *stray*: kept). As for image versions (`live::judge_unreached`),
//! a record is taken for unpublished only when nothing says otherwise — no other such record
//! names it as parent, its parent is reached (or it has none) and its VM has a sound head —
//! so a lost head costs a report and a `cairn repair`, never a VM version or the disks it
//! binds.

use std::collections::HashSet;

use cairn_format::vm::VmVersion;
use cairn_format::Id;
use cairn_repo::{Damaged, Repo, RepoError};

use crate::error::EngineResult;

/// What the VM records no ref reaches are.
#[derive(Debug, Default)]
pub struct VmStrays {
    /// Undeleted records no ref reaches that are not an unpublished backup's: their
    /// bindings are kept, `verify` names them and `repair` points their VM's head at the
    /// newest.
    pub strays: Vec<(Id, VmVersion)>,
    /// Records no ref reaches that cannot be read (their VM is unknown).
    pub damaged: Vec<Damaged>,
    /// VMs whose head cannot be read.
    pub damaged_heads: Vec<String>,
}

/// Lists every VM version record and judges those no head or tag reaches.
pub async fn vm_strays(repo: &Repo) -> EngineResult<VmStrays> {
    let mut out = VmStrays::default();
    let mut reached: HashSet<Id> = HashSet::new();
    let mut sound: HashSet<String> = HashSet::new();
    for vm in repo.vms().await? {
        let mut starts = Vec::new();
        match repo.vm_head(&vm).await {
            Ok(Some(head)) => {
                sound.insert(vm.clone());
                starts.push(head.version);
            }
            Ok(None) => {}
            Err(e) if e.is_damage() => out.damaged_heads.push(vm.clone()),
            Err(e) => return Err(e.into()),
        }
        match repo.vm_tags(&vm).await {
            Ok(tags) => starts.extend(tags.into_iter().map(|(_, id)| id)),
            Err(e) if e.is_damage() => tracing::warn!(vm, "{e}"),
            Err(e) => return Err(e.into()),
        }
        for start in starts {
            let mut next = Some(start);
            while let Some(id) = next.filter(|id| reached.insert(*id)) {
                next = match repo.load_vm_version(&id).await {
                    Ok(record) => record.parent,
                    // A record that cannot be read ends the walk; `verify` names it.
                    Err(e) if e.is_damage() || matches!(e, RepoError::NotFound(_)) => None,
                    Err(e) => return Err(e.into()),
                };
            }
        }
    }
    let deleted = repo.vm_deleted_versions().await?;
    let mut unreached: Vec<(Id, VmVersion)> = Vec::new();
    for id in repo.vm_version_ids().await?.into_iter().flatten() {
        if reached.contains(&id) || deleted.contains(&id) {
            continue;
        }
        match repo.load_vm_version(&id).await {
            Ok(record) => unreached.push((id, record)),
            Err(RepoError::Corrupt { key, source }) => out.damaged.push(Damaged {
                key,
                problem: source.to_string(),
            }),
            Err(RepoError::NotFound(_)) => {} // deleted since it was listed
            Err(e) => return Err(e.into()),
        }
    }
    let parents: HashSet<Id> = unreached.iter().filter_map(|(_, r)| r.parent).collect();
    for (id, record) in unreached {
        let parent_reached = record.parent.is_none_or(|p| reached.contains(&p));
        if !parents.contains(&id) && parent_reached && sound.contains(&record.vm) {
            continue; // unpublished
        }
        out.strays.push((id, record));
    }
    out.strays
        .sort_by(|(_, a), (_, b)| (&a.vm, a.seq, a.time_ns).cmp(&(&b.vm, b.seq, b.time_ns)));
    Ok(out)
}

impl VmStrays {
    /// The strays of VM `vm`.
    pub fn of<'a>(&'a self, vm: &'a str) -> impl Iterator<Item = &'a (Id, VmVersion)> + 'a {
        self.strays.iter().filter(move |(_, v)| v.vm == vm)
    }

    /// One line per stray and per unreadable record, as `verify` reports them.
    pub fn problems(&self) -> Vec<String> {
        let mut out: Vec<String> = self
            .strays
            .iter()
            .map(|(id, v)| {
                format!(
                    "VM version {}@{} ({}) is reached by no VM head or tag (a head lost, \
                     damaged or moved back): its disks are kept; `cairn repair` points the \
                     head at the newest such version",
                    v.vm,
                    v.seq,
                    id.short()
                )
            })
            .collect();
        out.extend(self.damaged.iter().map(|d| {
            format!(
                "{}: a VM version record no ref reaches cannot be read ({}); the versions it \
                 binds are unknown",
                d.key, d.problem
            )
        }));
        out
    }
}

//! What `verify` checks of whole VMs: every VM's head and records read, and every image
//! version a live VM version binds (disks and memory state) is there and not deleted. GC does
//! not read VM records, so a damaged one loses no data; but what it bound can no longer be
//! named as one VM version, and `rm`/`prune` hold back the VM's images until it is known
//! ([`super::bound_versions`]).

use std::collections::HashSet;

use cairn_format::id_hash::IdSet;
use cairn_format::keys;
use cairn_format::vm::VmVersion;
use cairn_format::Id;
use cairn_repo::{Damaged, Repo, RepoError};

use crate::error::EngineResult;

/// What the VM checks found.
#[derive(Debug, Default)]
pub struct VmFindings {
    /// VM heads and records that cannot be read.
    pub damaged: Vec<Damaged>,
    /// One line per other problem (a record missing, a bound version missing or deleted).
    pub problems: Vec<String>,
    /// VM versions read.
    pub checked: u64,
}

/// Checks every VM; `known` holds the image version records that read.
pub async fn check_vms(repo: &Repo, known: &HashSet<Id>) -> EngineResult<VmFindings> {
    let mut out = VmFindings::default();
    let deleted_vm = repo.vm_deleted_versions().await?;
    let deleted = repo.deleted_versions().await?;
    let strays = super::strays::vm_strays(repo).await?;
    out.problems.extend(strays.problems());
    for (_, record) in &strays.strays {
        out.checked += 1;
        check_bound(record, known, &deleted, &mut out);
    }
    for vm in repo.vms().await? {
        let mut next = match repo.vm_head(&vm).await {
            Ok(head) => head.map(|h| h.version),
            Err(RepoError::Corrupt { key, source }) => {
                out.damaged.push(Damaged {
                    key,
                    problem: source.to_string(),
                });
                None
            }
            Err(e) => return Err(e.into()),
        };
        while let Some(id) = next {
            let record = match repo.load_vm_version(&id).await {
                Ok(r) => r,
                Err(RepoError::Corrupt { source, .. }) => {
                    out.damaged.push(Damaged {
                        key: keys::vm_version(&id),
                        problem: source.to_string(),
                    });
                    break;
                }
                Err(RepoError::NotFound(_)) => {
                    out.problems.push(format!(
                        "VM {vm:?}: its history names VM version {id}, whose record {} is \
                         missing",
                        keys::vm_version(&id)
                    ));
                    break;
                }
                Err(e) => return Err(e.into()),
            };
            out.checked += 1;
            next = record.parent;
            if deleted_vm.contains(&id) {
                continue;
            }
            check_bound(&record, known, &deleted, &mut out);
        }
    }
    Ok(out)
}

/// Names each image version `record` binds that is missing, unreadable or deleted.
fn check_bound(record: &VmVersion, known: &HashSet<Id>, deleted: &IdSet, out: &mut VmFindings) {
    for (name, version) in record.bound() {
        let image = VmVersion::disk_image(&record.vm, name);
        let why = if !known.contains(&version) {
            "missing or unreadable"
        } else if deleted.contains(&version) {
            "deleted (it should have gone only with its VM version)"
        } else {
            continue;
        };
        out.problems.push(format!(
            "VM version {}@{} binds {image} version {}, which is {why}",
            record.vm,
            record.seq,
            version.short()
        ));
    }
}

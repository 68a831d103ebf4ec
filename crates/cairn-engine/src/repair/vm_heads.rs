//! Step 2 for whole VMs: a VM whose head is missing, unreadable, names a record that cannot
//! be read, or was moved back behind published VM versions gets its head pointed at its
//! newest VM version no ref reaches (`vm::strays`). A head is never moved back.

use cairn_format::keys;
use cairn_repo::Repo;

use super::RepairReport;
use crate::error::EngineResult;
use crate::vm::strays::vm_strays;

pub(super) async fn repoint_vm_heads(
    repo: &Repo,
    dry_run: bool,
    report: &mut RepairReport,
) -> EngineResult<()> {
    let strays = vm_strays(repo).await?;
    for group in strays.strays.chunk_by(|(_, a), (_, b)| a.vm == b.vm) {
        let (newest_id, newest) = group
            .iter()
            .max_by_key(|(_, v)| (v.seq, v.time_ns))
            .expect("a group has a stray");
        let vm = &newest.vm;
        let damaged_head = strays.damaged_heads.contains(vm);
        let behind = damaged_head
            || match repo.vm_head(vm).await? {
                None => true,
                Some(h) => match repo.load_vm_version(&h.version).await {
                    Ok(head) => head.seq < newest.seq,
                    Err(e) if e.is_damage() || e.is_not_found() => true,
                    Err(e) => return Err(e.into()),
                },
            };
        if !behind {
            continue;
        }
        report
            .vm_heads_rebuilt
            .push((vm.clone(), format!("{vm}@{}", newest.seq)));
        if !dry_run {
            if damaged_head {
                repo.set_aside_ref(&keys::vm_head(vm)).await?;
            }
            repo.overwrite_vm_head(vm, newest_id).await?;
        }
    }
    Ok(())
}

//! VM versions in `cairn copy`: a VM version follows its disks. Once every image version it
//! binds (each disk's, and the memory state's) has a copy in the destination, the VM version
//! is published there naming those copies, in the source's order, with its time, message,
//! configuration and freeze as they were. A VM version whose copy the destination has (same
//! time and message) is skipped, so a second run copies nothing; one whose disks were not
//! all copied (not selected, or damaged in the source) stops its VM's copy there, so that
//! the destination's history keeps the source's order, and is reported.

use std::collections::HashMap;

use cairn_format::vm::{VmDisk, VmVersion};
use cairn_format::Id;
use cairn_repo::Repo;

use super::{publish_vm, vm_history, NewVmVersion};
use crate::copy::CopyKey;
use crate::error::EngineResult;
use crate::resolve::history;

/// What the copy of VM versions did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VmCopyReport {
    /// (VM, source seq, destination seq) of each VM version copied.
    pub copied: Vec<(String, u64, u64)>,
    /// VM versions the destination had already.
    pub present: u64,
    /// (VM, source seq, why) of the first VM version of each VM that could not be copied:
    /// an image version it binds has no copy in the destination.
    pub incomplete: Vec<(String, u64, String)>,
}

/// Publishes in `dest` every VM version of `source` whose bound image versions all have a
/// copy there (run after the images were copied).
pub async fn copy_vm_versions(source: &Repo, dest: &Repo) -> EngineResult<VmCopyReport> {
    let mut report = VmCopyReport::default();
    for vm in source.vms().await? {
        crate::interrupt::check()?;
        let mut versions = vm_history(source, &vm).await?;
        versions.reverse();
        let present: HashMap<(i64, String), Id> = match dest.vm_head(&vm).await? {
            None => HashMap::new(),
            Some(_) => vm_history(dest, &vm)
                .await?
                .into_iter()
                .map(|(id, v)| ((v.time_ns, v.message), id))
                .collect(),
        };
        let mut copies = Copies::default();
        for (_, version) in &versions {
            if present.contains_key(&(version.time_ns, version.message.clone())) {
                report.present += 1;
                continue;
            }
            match copies.bind(source, dest, version).await? {
                Ok((disks, memory)) => {
                    let (_, made) = publish_vm(
                        dest,
                        NewVmVersion {
                            vm: vm.clone(),
                            time_ns: version.time_ns,
                            config_kind: version.config_kind,
                            config: version.config.clone(),
                            disks,
                            memory,
                            freeze: version.freeze,
                            freeze_ns: version.freeze_ns,
                            message: version.message.clone(),
                        },
                    )
                    .await?;
                    tracing::info!(vm, from = version.seq, to = made.seq, "VM version copied");
                    report.copied.push((vm.clone(), version.seq, made.seq));
                }
                Err(why) => {
                    // Only a VM some of whose images were copied is worth a word: the others
                    // were not asked for.
                    if copies.any_found {
                        report.incomplete.push((vm.clone(), version.seq, why));
                    }
                    break;
                }
            }
        }
    }
    Ok(report)
}

/// The destination's copies of the source's image versions, by image, as they are asked for.
#[derive(Default)]
struct Copies {
    /// Per image: the destination's versions by copy key (id, seq).
    dest: HashMap<String, HashMap<CopyKey, (Id, u64)>>,
    /// Whether any bound version had a copy.
    any_found: bool,
}

impl Copies {
    /// The destination's copy (id, seq) of source version `id` of `image`.
    async fn of(
        &mut self,
        source: &Repo,
        dest: &Repo,
        image: &str,
        id: &Id,
    ) -> EngineResult<Option<(Id, u64)>> {
        if !self.dest.contains_key(image) {
            let known = match dest.head(image).await? {
                None => HashMap::new(),
                Some(_) => history(dest, image)
                    .await?
                    .into_iter()
                    .map(|(id, r)| (CopyKey::of(&r), (id, r.seq)))
                    .collect(),
            };
            self.dest.insert(image.to_string(), known);
        }
        let record = source.load_version(id).await?;
        let found = self.dest[image].get(&CopyKey::of(&record)).copied();
        self.any_found |= found.is_some();
        Ok(found)
    }

    /// `version`'s disks and memory state with the destination's copies in place of the
    /// source's versions, or why one has none.
    async fn bind(
        &mut self,
        source: &Repo,
        dest: &Repo,
        version: &VmVersion,
    ) -> EngineResult<Result<(Vec<VmDisk>, Option<Id>), String>> {
        let missing = |image: &str, seq: u64| {
            format!("{image}@{seq} has no copy in the destination (copy the VM's images too)")
        };
        let mut disks = Vec::with_capacity(version.disks.len());
        for disk in &version.disks {
            let image = VmVersion::disk_image(&version.vm, &disk.name);
            match self.of(source, dest, &image, &disk.version).await? {
                Some((id, seq)) => disks.push(VmDisk {
                    version: id,
                    seq,
                    ..disk.clone()
                }),
                None => return Ok(Err(missing(&image, disk.seq))),
            }
        }
        let memory = match version.memory {
            None => None,
            Some(source_id) => {
                let image =
                    VmVersion::disk_image(&version.vm, cairn_format::memstate::MEMORY_IMAGE);
                match self.of(source, dest, &image, &source_id).await? {
                    Some((id, _)) => Some(id),
                    None => {
                        let seq = source.load_version(&source_id).await?.seq;
                        return Ok(Err(missing(&image, seq)));
                    }
                }
            }
        };
        Ok(Ok((disks, memory)))
    }
}

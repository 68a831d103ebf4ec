//! VM version records and VM heads: the owner of the keys `vms/<id>` and `vm-heads/<vm>`.
//! A VM version is published like an image version: its record first (immutable, named by
//! the hash of its stored bytes), then its head by compare-and-swap.

use bytes::Bytes;
use cairn_format::crypto::Domain;
use cairn_format::id_hash::IdSet;
use cairn_format::keys;
use cairn_format::marker::encode_deleted;
use cairn_format::name::unescape;
use cairn_format::refs::validate_tag_name;
use cairn_format::vm::VmVersion;
use cairn_format::Id;
use cairn_store::{PutOutcome, StoreError};

use crate::error::{RepoError, RepoResult};
use crate::repository::Repo;
use crate::versions::HeadState;

impl Repo {
    /// The newest version of VM `vm`, if it has any.
    pub async fn vm_head(&self, vm: &str) -> RepoResult<Option<HeadState>> {
        self.head_at(&keys::vm_head(vm)).await
    }

    /// Moves VM `vm`'s head to `new` if it still is `expected` (`None`: the VM must have no
    /// version yet). Returns false if someone else moved it first.
    pub async fn swap_vm_head(
        &self,
        vm: &str,
        expected: Option<&HeadState>,
        new: &Id,
    ) -> RepoResult<bool> {
        self.swap_head_at(&keys::vm_head(vm), expected, new).await
    }

    /// Points VM `vm`'s head at `new` whatever it holds now (`cairn repair`, after a head was
    /// lost, damaged or moved back). Returns false if it changed meanwhile.
    pub async fn overwrite_vm_head(&self, vm: &str, new: &Id) -> RepoResult<bool> {
        let key = keys::vm_head(vm);
        let token = self.store().read_ref(&key).await?.map(|s| s.version);
        let outcome = self
            .store()
            .cas_ref(
                &key,
                token.as_ref(),
                Some(Bytes::from(cairn_format::refs::encode(new))),
            )
            .await?;
        Ok(matches!(outcome, cairn_store::CasOutcome::Swapped { .. }))
    }

    /// The id of every VM version record in the store; a key that names no id is returned as
    /// the error.
    pub async fn vm_version_ids(&self) -> RepoResult<Vec<Result<Id, String>>> {
        Ok(self
            .store()
            .list_keys(keys::VMS)
            .await?
            .into_iter()
            .map(|key| keys::id_after(keys::VMS, &key).ok_or(key))
            .collect())
    }

    /// Every VM that has a head, sorted; head keys that name no valid VM are skipped.
    pub async fn vms(&self) -> RepoResult<Vec<String>> {
        let listed = self.store().list_refs(keys::VM_HEADS).await?;
        let mut out: Vec<String> = listed
            .iter()
            .filter_map(|k| match unescape(&k[keys::VM_HEADS.len()..]) {
                Ok(name) => Some(name),
                Err(e) => {
                    tracing::warn!("refs/{k}: {e}");
                    None
                }
            })
            .collect();
        out.sort();
        Ok(out)
    }

    /// Reads, checks and decodes a VM version record.
    pub async fn load_vm_version(&self, id: &Id) -> RepoResult<VmVersion> {
        let key = keys::vm_version(id);
        let stored = match self.store().get(&key).await {
            Ok(raw) => raw,
            Err(StoreError::NotFound { .. }) => {
                return Err(RepoError::NotFound(format!(
                    "VM version {id} does not exist ({key} is missing)"
                )))
            }
            Err(e) => return Err(e.into()),
        };
        if Id::of(&stored) != *id {
            return Err(RepoError::corrupt(
                key,
                cairn_format::FormatError::Checksum {
                    what: "VM version record",
                },
            ));
        }
        let raw = match self.key() {
            None => stored,
            Some(_) => self.open_sealed(Domain::VmRecord, "VM version record", &key, stored)?,
        };
        VmVersion::decode(&raw).map_err(|e| RepoError::corrupt(key, e))
    }

    /// Stores a VM version record (sealed in an encrypted repository); returns its id and
    /// the bytes written.
    pub async fn put_vm_version(&self, record: &VmVersion) -> RepoResult<(Id, u64)> {
        let raw = self.seal(Domain::VmRecord, record.encode());
        let id = Id::of(&raw);
        let len = raw.len() as u64;
        let written = match self
            .store()
            .put_if_absent(&keys::vm_version(&id), Bytes::from(raw))
            .await?
        {
            PutOutcome::Created => len,
            PutOutcome::AlreadyExists => 0,
        };
        Ok((id, written))
    }

    /// Marks a VM version deleted (`vm-deleted/<id>`; the record stays as a link of the
    /// VM's history, as image versions do).
    pub async fn mark_vm_deleted(&self, id: &Id) -> RepoResult<()> {
        let data =
            Bytes::from(self.seal(Domain::Marker, encode_deleted(id, crate::session::now_ns())));
        self.store()
            .put_if_absent(&keys::vm_deleted(id), data)
            .await?;
        Ok(())
    }

    /// Every VM version marked deleted (one listing: the key names the version).
    pub async fn vm_deleted_versions(&self) -> RepoResult<IdSet> {
        let mut out = IdSet::default();
        for key in self.store().list_keys(keys::VM_DELETED).await? {
            match keys::id_after(keys::VM_DELETED, &key) {
                Some(id) => {
                    out.insert(id);
                }
                None => tracing::warn!("{key}: not a VM version deletion marker"),
            }
        }
        Ok(out)
    }

    /// Names VM version `version` `tag`; fails if the VM has that tag already (tags never
    /// move silently).
    pub async fn create_vm_tag(&self, vm: &str, tag: &str, version: &Id) -> RepoResult<()> {
        validate_tag_name(tag).map_err(|e| RepoError::BadInput(e.to_string()))?;
        self.create_tag_at(&keys::vm_tag(vm, tag), version, || {
            format!("tag {tag:?} of VM {vm:?} already exists (delete it first)")
        })
        .await
    }

    /// Deletes a VM's tag; fails if it does not exist.
    pub async fn delete_vm_tag(&self, vm: &str, tag: &str) -> RepoResult<()> {
        validate_tag_name(tag).map_err(|e| RepoError::BadInput(e.to_string()))?;
        self.delete_tag_at(&keys::vm_tag(vm, tag), || {
            format!("VM {vm:?} has no tag {tag:?}")
        })
        .await
    }

    /// Every tag of VM `vm` as (name, VM version), sorted by name.
    pub async fn vm_tags(&self, vm: &str) -> RepoResult<Vec<(String, Id)>> {
        self.tags_under(&keys::vm_tags_of(vm)).await
    }
}

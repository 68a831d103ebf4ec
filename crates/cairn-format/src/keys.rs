//! Every key of a repository, in one place: the object keys (immutable, written once) and the
//! ref keys (mutable by compare-and-swap, in the store's separate ref namespace).
//!
//! No other module spells a key or a prefix; readers that list a prefix turn keys back into
//! ids with [`id_after`] (or [`pack_id`] for the fanned-out pack keys). docs/FORMAT.md,
//! "Object layout", describes the same names.

use crate::name::escape;
use crate::{FormatError, FormatResult, Id};

// ---- Objects ----

/// The repository's configuration.
pub const CONFIG: &str = "config";
/// Packs: `packs/<first two hex digits>/<id>` (fan-out keeps directories small).
pub const PACKS: &str = "packs/";
/// Index files: `index/<id>`.
pub const INDEX: &str = "index/";
/// Version records: `versions/<id>`.
pub const VERSIONS: &str = "versions/";
/// VM version records: `vms/<VM version id>`.
pub const VMS: &str = "vms/";
/// Deletion markers of VM versions: `vm-deleted/<VM version id>`.
pub const VM_DELETED: &str = "vm-deleted/";
/// Reference summaries (Bloom filters of a tree's blobs): `summaries/<root id>`.
pub const SUMMARIES: &str = "summaries/";
/// Deletion markers: `deleted/<version id>`.
pub const DELETED: &str = "deleted/";
/// Markers of deleted versions whose space a GC gave back: `gc/freed/<version id>`.
pub const FREED: &str = "gc/freed/";
/// Published GC plans: `gc/plans/<plan id>`.
pub const PLANS: &str = "gc/plans/";
/// Blobs fast deletion could not free yet, judged again next time: `gc/leftover/<id>`.
pub const LEFTOVERS: &str = "gc/leftover/";
/// Format 2's merged reference summaries, one per image, kept by fast deletion:
/// `gc/merged/<content id>`.
pub const MERGED_SUMMARIES: &str = "gc/merged/";
/// The version records the last GC reached, in one object: `gc/records/<content id>`.
pub const RECORD_BUNDLES: &str = "gc/records/";
/// Quarantine markers of damaged blob copies: `quarantine/<pack>/<blob>`.
pub const QUARANTINE: &str = "quarantine/";
/// Layout markers: `layout/<pack>/<time>` (empty; the time as 16 hex digits of nanoseconds)
/// says that `cairn relayout` wrote the pack at that time (or GC repacked a relayout's copies
/// into it), whose copies of groups readers and GC prefer to other copies, the latest first.
pub const LAYOUT: &str = "layout/";
/// Damaged objects and refs set aside by `cairn repair`: `damaged/<key>`,
/// `damaged/refs/<ref key>`.
pub const SET_ASIDE: &str = "damaged/";

pub fn pack(id: &Id) -> String {
    let hex = id.to_hex();
    format!("{PACKS}{}/{hex}", &hex[..2])
}

/// The pack id in a pack key (`packs/ab/<id>`).
pub fn pack_id(key: &str) -> Option<Id> {
    key.strip_prefix(PACKS)?.rsplit('/').next()?.parse().ok()
}

/// Index runs of format v2 (`cairn_format::index_run`), named by the hash of their bytes.
pub const INDEX_RUNS: &str = "index-runs/";

pub fn index_run(id: &Id) -> String {
    format!("{INDEX_RUNS}{}", id.to_hex())
}

/// Key slots of an encrypted repository (format v2), named by the hash of their bytes: each
/// opens the master key with one passphrase.
pub const KEY_SLOTS: &str = "keys/";

pub fn key_slot(id: &Id) -> String {
    format!("{KEY_SLOTS}{}", id.to_hex())
}

pub fn index_file(id: &Id) -> String {
    format!("{INDEX}{id}")
}

pub fn version(id: &Id) -> String {
    format!("{VERSIONS}{id}")
}

pub fn vm_version(id: &Id) -> String {
    format!("{VMS}{id}")
}

pub fn vm_deleted(id: &Id) -> String {
    format!("{VM_DELETED}{id}")
}

pub fn summary(root: &Id) -> String {
    format!("{SUMMARIES}{root}")
}

pub fn deleted(version: &Id) -> String {
    format!("{DELETED}{version}")
}

pub fn freed(version: &Id) -> String {
    format!("{FREED}{version}")
}

pub fn plan(id: &Id) -> String {
    format!("{PLANS}{id}")
}

pub fn leftover(id: &Id) -> String {
    format!("{LEFTOVERS}{id}")
}

pub fn merged_summary(id: &Id) -> String {
    format!("{MERGED_SUMMARIES}{id}")
}

pub fn record_bundle(id: &Id) -> String {
    format!("{RECORD_BUNDLES}{id}")
}

/// Key of the quarantine marker of the copy of `blob` in `pack`.
pub fn quarantine(pack: &Id, blob: &Id) -> String {
    format!("{QUARANTINE}{pack}/{blob}")
}

/// The (pack, blob) a quarantine marker key names.
pub fn parse_quarantine(key: &str) -> FormatResult<(Id, Id)> {
    let bad = || FormatError::invalid("quarantine marker key", key.to_string());
    let rest = key.strip_prefix(QUARANTINE).ok_or_else(bad)?;
    let (pack, blob) = rest.split_once('/').ok_or_else(bad)?;
    Ok((pack.parse()?, blob.parse()?))
}

/// Key of the layout marker of `pack`, laid out at `time` (ns since the epoch).
pub fn layout(pack: &Id, time: u64) -> String {
    format!("{LAYOUT}{pack}/{time:016x}")
}

/// The (pack, time) a layout marker key names; `None` for another key.
pub fn parse_layout(key: &str) -> Option<(Id, u64)> {
    let (pack, time) = key.strip_prefix(LAYOUT)?.split_once('/')?;
    if time.len() != 16 {
        return None;
    }
    Some((pack.parse().ok()?, u64::from_str_radix(time, 16).ok()?))
}

/// Where `cairn repair` sets aside the object `key`.
pub fn set_aside_object(key: &str) -> String {
    format!("{SET_ASIDE}{key}")
}

/// Where `cairn repair` sets aside the content of the ref `key`.
pub fn set_aside_ref(key: &str) -> String {
    format!("{SET_ASIDE}refs/{key}")
}

/// The id at the end of a key listed under `prefix` (`index/<id>`, `versions/<id>`, …);
/// `None` for a key that is not `prefix` followed by an id.
pub fn id_after(prefix: &str, key: &str) -> Option<Id> {
    key.strip_prefix(prefix)?.parse().ok()
}

// ---- Refs ----

/// Heads: `heads/<escaped image>` names an image's newest version.
pub const HEADS: &str = "heads/";
/// Tags: `tags/<escaped image>/<escaped tag>`.
pub const TAGS: &str = "tags/";
/// VM heads: `vm-heads/<escaped VM name>` names a VM's newest version.
pub const VM_HEADS: &str = "vm-heads/";
/// VM tags: `vm-tags/<escaped VM name>/<escaped tag>`.
pub const VM_TAGS: &str = "vm-tags/";
/// Boot profiles: `profiles/<escaped image>` holds the image's (see `boot_profile`).
pub const PROFILES: &str = "profiles/";
/// Sessions of running processes: `sessions/<random hex>`.
pub const SESSIONS: &str = "sessions/";
/// The GC lock: the session key of the GC holding it.
pub const GC_LOCK: &str = "gc/lock";
/// The newest completed GC: its session cutoff and plan id.
pub const GC_LAST: &str = "gc/last";

pub fn head(image: &str) -> String {
    format!("{HEADS}{}", escape(image))
}

pub fn boot_profile(image: &str) -> String {
    format!("{PROFILES}{}", escape(image))
}

pub fn vm_head(vm: &str) -> String {
    format!("{VM_HEADS}{}", escape(vm))
}

/// Prefix of every tag of VM `vm`: `vm-tags/<escaped VM>/`.
pub fn vm_tags_of(vm: &str) -> String {
    format!("{VM_TAGS}{}/", escape(vm))
}

pub fn vm_tag(vm: &str, tag: &str) -> String {
    format!("{}{}", vm_tags_of(vm), escape(tag))
}

/// Prefix of every tag of `image`: `tags/<escaped image>/`.
pub fn tags_of(image: &str) -> String {
    format!("{TAGS}{}/", escape(image))
}

/// Key of tag `tag` of `image` (a tag name is percent-encoded like an image name: `+` is not
/// a key character).
pub fn tag(image: &str, tag: &str) -> String {
    format!("{}{}", tags_of(image), escape(tag))
}

/// The tag name in a tag ref key (`tags/<escaped image>/<escaped tag>`, or its last segment).
pub fn tag_from_key(key: &str) -> String {
    let last = key.rsplit('/').next().unwrap_or(key);
    crate::name::unescape_segment(last).unwrap_or_else(|_| last.to_string())
}

/// The escaped image name in a head key.
pub fn image_segment_of_head(key: &str) -> Option<&str> {
    key.strip_prefix(HEADS)
}

pub fn session(random: &[u8]) -> String {
    format!("{SESSIONS}{}", hex::encode(random))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_come_back_out_of_the_keys_that_hold_them() {
        let id = Id::of(b"x");
        assert_eq!(pack_id(&pack(&id)), Some(id));
        assert_eq!(id_after(INDEX, &index_file(&id)), Some(id));
        assert_eq!(id_after(VERSIONS, &version(&id)), Some(id));
        assert_eq!(id_after(VERSIONS, &index_file(&id)), None);
        assert_eq!(parse_quarantine(&quarantine(&id, &id)).unwrap(), (id, id));
        assert_eq!(tag_from_key(&tag("a/b", "v1.0+x")), "v1.0+x");
    }
}

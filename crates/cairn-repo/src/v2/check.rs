//! Checking a whole v2 pack, as `verify` does: one read of the pack, its id recomputed, its
//! trailer parsed, and every group opened and every stored chunk hashed against its id.
//! Nothing is cached: a verify reads each pack once, and its verdicts are its own.

use cairn_format::crypto::MasterKey;
use cairn_format::group::{group_id, Group};
use cairn_format::pack::BlobKind;
use cairn_format::pack_v2;
use cairn_format::{keys, Id};

use super::groups::OpenedGroup;
use super::tail::get_whole;
use super::{sealed_error, V2Reader};
use crate::error::{RepoError, RepoResult};

/// What checking one pack found.
#[derive(Debug, Default)]
pub struct PackCheck {
    /// Bytes read (the whole pack; 0 if it is missing).
    pub bytes: u64,
    /// Groups and stored chunks (manifest nodes included) checked.
    pub groups: u64,
    pub chunks: u64,
    /// One line per problem, naming the pack (and the group).
    pub problems: Vec<String>,
    /// Ids that cannot be read from this pack, with why: each damaged group's id and the ids
    /// of the chunks and nodes it stores. A pack whose trailer cannot be read lists none here
    /// (its groups are unknown): readers that look them up meet the same error.
    pub bad: Vec<(Id, String)>,
    /// The damaged groups: (group id, offset in the pack, why), for quarantine.
    pub damaged_groups: Vec<(Id, u32, String)>,
    /// The pack does not exist (an index run names it).
    pub missing: bool,
    /// The trailer was read, so every group was checked (`damaged_groups` is complete).
    pub readable: bool,
    /// The bytes do not hash to the pack's id, yet every group in them reads intact: they
    /// are another pack's (a swap, a misplaced copy), so what this pack held is unknown.
    pub foreign: bool,
    /// `cairn repair` can store this pack's groups again in a new pack: its trailer or footer
    /// is lost but group frames give groups back, or a frame is damaged while the trailer
    /// and every group read (see [`rescuable_groups`]).
    pub rescuable: bool,
}

/// The groups of a damaged pack that can be stored again, with their kinds: from the trailer
/// when it reads and every group in it opens (the pack's frames are what is damaged), else
/// from the group frames (version 3; the trailer or footer is what is lost). Every group
/// returned decodes, and a salvaged one's ids are hashed from its bytes.
pub fn rescuable_groups(data: &[u8], key: Option<&MasterKey>) -> Vec<(BlobKind, Group)> {
    let id_of = |d: &[u8]| key.map_or_else(|| Id::of(d), |k| k.id_of(d));
    if let Ok(groups) = pack_v2::parse_pack(data, key) {
        let mut out = Vec::with_capacity(groups.len());
        for g in groups {
            let range = g.range();
            let Some(stored) = data.get(range.start as usize..range.end as usize) else {
                return Vec::new();
            };
            if OpenedGroup::open(&g.desc, stored, key).is_err() {
                return Vec::new(); // its trailer entry is what a rebuild from copies needs
            }
            out.push((
                g.kind,
                Group {
                    stored: stored.to_vec(),
                    desc: g.desc,
                },
            ));
        }
        return out;
    }
    match pack_v2::salvage_pack(data, key, id_of) {
        Ok(s) => s.groups.into_iter().map(|g| (g.kind, g.group)).collect(),
        Err(_) => Vec::new(),
    }
}

impl V2Reader {
    /// Quarantines the copy of group `group` at `offset` of `pack` (found damaged by a whole
    /// pack check; `group` = `pack`: the whole pack, found missing); `false` if it was known.
    pub fn quarantine_copy(&self, pack: &Id, group: &Id, offset: u32, reason: &str) -> bool {
        self.quarantine.add(*pack, *group, offset, reason)
    }

    /// The quarantined copies of `pack` (group ids; the pack's own id: the whole pack).
    pub fn quarantined_in(&self, pack: &Id) -> Vec<Id> {
        self.quarantine.in_pack(pack)
    }

    /// Lifts the quarantine of the copy of `group` in `pack`, which a whole read of its pack
    /// found intact after all (a marker is advisory: it only ever costs a second copy), and
    /// deletes its marker.
    pub async fn release_quarantine(&self, pack: &Id, group: &Id) -> RepoResult<()> {
        if self.quarantine.remove(pack, group) {
            tracing::info!(%pack, %group, "a quarantined copy reads intact: quarantine lifted");
            self.store.delete(&keys::quarantine(pack, group)).await?;
        }
        Ok(())
    }

    /// Whether some copy of `group` (or blob) is quarantined, as far as this process knows.
    /// A whole pack quarantined (missing or unreadable) may have held a copy of anything,
    /// and a damaged index run may have been the only one to locate it: either makes every
    /// group suspect.
    pub fn has_quarantined_copy(&self, group: &Id) -> bool {
        self.quarantine.pack_of(group).is_some()
            || self.quarantine.any_whole_pack()
            || self.index_damaged()
    }

    /// Whether an index run or a piece of one was found damaged by this reader.
    pub fn index_damaged(&self) -> bool {
        self.index_damaged
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Records that an index run or a piece of one is damaged.
    pub(crate) fn note_index_damage(&self) {
        self.index_damaged
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether the copy of `group` in `pack` is quarantined.
    pub fn is_quarantined_copy(&self, pack: &Id, group: &Id) -> bool {
        self.quarantine.contains(pack, group)
    }

    /// Reads pack `pack` whole and checks everything in it.
    pub async fn check_pack(&self, pack: &Id) -> RepoResult<PackCheck> {
        let key = keys::pack(pack);
        let Some(data) = get_whole(&*self.store, &key).await? else {
            return Ok(PackCheck {
                problems: vec![format!("{key}: missing (an index run names it)")],
                missing: true,
                ..Default::default()
            });
        };
        let master = self.key.clone();
        let pack = *pack;
        tokio::task::spawn_blocking(move || check_bytes(&pack, &key, &data, master.as_ref()))
            .await
            .map_err(|e| RepoError::internal("pack check", format!("{}: {e}", keys::pack(&pack))))
    }
}

fn check_bytes(pack: &Id, key: &str, data: &[u8], master: Option<&MasterKey>) -> PackCheck {
    let mut check = PackCheck {
        bytes: data.len() as u64,
        ..Default::default()
    };
    if Id::of(data) != *pack {
        check.problems.push(format!(
            "{key}: content does not match its id (corrupt or truncated)"
        ));
    }
    let groups = match pack_v2::parse_header(data)
        .map_err(cairn_format::crypto::CryptoError::from)
        .and_then(|sealed| {
            if sealed != master.is_some() {
                let why = if sealed {
                    "the pack is sealed but the repository is not encrypted"
                } else {
                    "the pack is not sealed but the repository is encrypted"
                };
                return Err(cairn_format::FormatError::invalid("pack", why).into());
            }
            pack_v2::parse_pack(data, master)
        }) {
        Ok(groups) => groups,
        Err(e) => {
            let mut line = format!("{key}: {}", why(key, e));
            let id_of = |d: &[u8]| master.map_or_else(|| Id::of(d), |k| k.id_of(d));
            if let Ok(s) = pack_v2::salvage_pack(data, master, id_of) {
                if !s.groups.is_empty() {
                    check.rescuable = true;
                    line.push_str(&format!(
                        "; {} of its groups read from their frames: `cairn repair` stores them again",
                        s.groups.len()
                    ));
                }
            }
            check.problems.push(line);
            return check;
        }
    };
    check.readable = true;
    let id_matches = check.problems.is_empty();
    let frames = pack_v2::check_frames(data, &groups, master);
    for (i, g) in groups.iter().enumerate() {
        check.groups += 1;
        let stored_ids = g.desc.chunks.iter().filter(|c| c.stored).map(|c| c.id);
        check.chunks += stored_ids.clone().count() as u64;
        let range = g.range();
        let stored = data.get(range.start as usize..range.end as usize);
        let outcome = match stored {
            None => Err(format!("ends past the pack's {} bytes", data.len())),
            Some(stored) => OpenedGroup::open(&g.desc, stored, master)
                .map(|_| ())
                .map_err(|e| why(key, e)),
        };
        if let Err(why) = outcome {
            let gid = group_id(&g.desc.chunks, master);
            let reason = format!("{key} group {i} (at byte {}): {why}", g.offset);
            check.problems.push(reason.clone());
            check.bad.push((gid, reason.clone()));
            check.damaged_groups.push((gid, g.offset, reason.clone()));
            check.bad.extend(stored_ids.map(|id| (id, reason.clone())));
        }
    }
    // (A damaged frame also changes the pack's hash; it is not another pack's bytes.)
    check.foreign = !id_matches && check.damaged_groups.is_empty() && frames.is_ok();
    // Every group reads but the bytes around them do not (a frame, or the header, which no
    // checksum covers, or the bytes are another pack's): the groups are written again and
    // the pack set aside. With a damaged group the pack stays, since its trailer is what a
    // rebuild of that group from other copies reads.
    check.rescuable = check.damaged_groups.is_empty() && (frames.is_err() || !id_matches);
    if let Err(why) = &frames {
        let what_next = match check.rescuable {
            true => "`cairn repair` writes the pack again",
            false => "`cairn gc --repair` rewrites the pack with its damaged group",
        };
        check.problems.push(format!(
            "{key}: {why} (the trailer reads, so no group is lost by it; {what_next})"
        ));
    }
    check
}

/// What is wrong, without the object's name (the caller's line names it).
fn why(key: &str, e: cairn_format::crypto::CryptoError) -> String {
    match sealed_error(key, e) {
        RepoError::Corrupt { source, .. } => source.to_string(),
        other => other.to_string(),
    }
}

//! Quarantine: a stored copy of a blob that failed its check on some read is never trusted
//! again — not for reading, not for deduplication — so damage heals instead of spreading.
//!
//! Without it, a commit of the same disk after a byte flipped in a pack would find the
//! damaged chunk in the index, store nothing, and produce one more damaged version. With it:
//! the read that finds the damage (restore, export, verify, GC, repair) records a marker
//! `quarantine/<pack>/<blob>` (see `cairn_format::marker`); every process loads the markers
//! at open and leaves that copy out of its index, so the next commit that meets the content
//! stores it again. Versions refer to chunks by id, not by location, so that one good copy
//! heals every version that uses the chunk, old ones included.
//!
//! Format 2 quarantines whole groups (`<blob>` is the group id; one flipped byte spoils a
//! zstd frame): a quarantined copy of a group is neither read nor deduplicated against, so
//! the next commit stores its chunks again in new groups, and a read of the damaged group's
//! slots falls back to each chunk's good copy by id (`V2Reader::read_group_run`) — the same
//! healing, through the chunk ids the pack trailer lists for every slot.
//!
//! Markers are written when the repository is closed (or by [`Repo::flush_quarantine`]):
//! reads that find damage often run on blocking threads. A marker is advisory and safe in
//! both directions — a wrong one only costs a duplicate copy — so GC removes a marker once
//! its pack is gone.

use cairn_format::keys;
use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};

use bytes::Bytes;
use cairn_format::marker::Quarantine;
use cairn_format::Id;

use crate::blob_index::BlobLocation;
use crate::error::{RepoError, RepoResult};
use crate::repository::Repo;
use crate::session::now_ns;

/// A copy found damaged, waiting for its marker to be written.
#[derive(Debug, Clone)]
pub(crate) struct PendingMarker {
    pack: Id,
    blob: Id,
    marker: Quarantine,
}

/// The copies (pack, blob) one process knows to be damaged, shared by the repository and
/// every format 2 reader it makes, and the markers not written yet.
#[derive(Debug, Default)]
pub(crate) struct QuarantineBook {
    copies: Mutex<HashSet<(Id, Id)>>,
    /// The pack of a quarantined copy of each blob, for messages.
    packs: Mutex<HashMap<Id, Id>>,
    pending: Mutex<Vec<PendingMarker>>,
}

impl QuarantineBook {
    /// Records the copy of `blob` in `pack` (at `offset`) as damaged; `false` if it was known.
    pub(crate) fn add(&self, pack: Id, blob: Id, offset: u32, reason: &str) -> bool {
        if !self.copies().insert((pack, blob)) {
            return false;
        }
        // Info, not a warning: every caller reports the damage in its own terms (an error,
        // verify's report, restore's damaged ranges, the export's warning).
        tracing::info!(%blob, %pack, "quarantined a damaged copy: {reason}");
        self.packs().insert(blob, pack);
        self.pending().push(PendingMarker {
            pack,
            blob,
            marker: Quarantine {
                time_ns: now_ns(),
                offset,
                reason: reason.to_string(),
            },
        });
        true
    }

    /// Adds copies known from markers in the store (nothing to write for them).
    pub(crate) fn load(&self, markers: &[(Id, Id)]) {
        self.packs()
            .extend(markers.iter().map(|(pack, blob)| (*blob, *pack)));
        self.copies().extend(markers.iter().copied());
    }

    /// Whether the copy of `blob` in `pack` is quarantined, alone or with its whole pack
    /// (a pack found missing or unreadable is quarantined under its own id).
    pub(crate) fn contains(&self, pack: &Id, blob: &Id) -> bool {
        let copies = self.copies();
        copies.contains(&(*pack, *blob)) || copies.contains(&(*pack, *pack))
    }

    /// Whether some whole pack is quarantined.
    pub(crate) fn any_whole_pack(&self) -> bool {
        self.copies().iter().any(|(pack, blob)| pack == blob)
    }

    pub(crate) fn copies(&self) -> MutexGuard<'_, HashSet<(Id, Id)>> {
        self.copies.lock().expect("quarantine lock")
    }

    fn packs(&self) -> MutexGuard<'_, HashMap<Id, Id>> {
        self.packs.lock().expect("quarantine lock")
    }

    fn pending(&self) -> MutexGuard<'_, Vec<PendingMarker>> {
        self.pending.lock().expect("quarantine lock")
    }

    /// Forgets the copy of `blob` in `pack` (found intact after all); `true` if it was
    /// known. Its marker, if already written, is the caller's to delete.
    pub(crate) fn remove(&self, pack: &Id, blob: &Id) -> bool {
        let known = self.copies().remove(&(*pack, *blob));
        self.pending()
            .retain(|p| (p.pack, p.blob) != (*pack, *blob));
        let mut packs = self.packs();
        if packs.get(blob) == Some(pack) {
            packs.remove(blob);
        }
        known
    }

    /// The quarantined copies in `pack`.
    pub(crate) fn in_pack(&self, pack: &Id) -> Vec<Id> {
        self.copies()
            .iter()
            .filter(|(p, _)| p == pack)
            .map(|(_, blob)| *blob)
            .collect()
    }

    /// The pack of a quarantined copy of `blob`, if any.
    pub(crate) fn pack_of(&self, blob: &Id) -> Option<Id> {
        self.packs().get(blob).copied()
    }
}

impl Repo {
    /// Decodes a blob's stored bytes and checks them against its id; a copy that fails is
    /// quarantined (see the module docs) before the error is returned.
    pub fn check_blob(&self, loc: &BlobLocation, stored: &[u8]) -> RepoResult<Vec<u8>> {
        Self::decode_blob(loc, stored).map_err(|e| self.quarantine_if_damaged(e, loc))
    }

    /// Quarantines the copy at `loc` if `e` says it is damaged or gone (a failed check, a
    /// truncated or missing pack); returns `e` either way.
    pub fn quarantine_if_damaged(&self, e: RepoError, loc: &BlobLocation) -> RepoError {
        if matches!(e, RepoError::BadBlob { .. } | RepoError::PackMissing { .. }) {
            self.quarantine(loc, &e.to_string());
        }
        e
    }

    /// Stops trusting the copy of a blob at `loc`: it leaves this process's index at once,
    /// and a marker is written for every other process at the next flush.
    pub fn quarantine(&self, loc: &BlobLocation, reason: &str) {
        if self
            .quarantine_book()
            .add(loc.pack, loc.entry.id, loc.entry.offset, reason)
        {
            self.index_mut().forget_at(&loc.entry.id, &loc.pack);
        }
    }

    /// The pack of a quarantined copy of `blob`, if there is one: for messages when no good
    /// copy is left.
    pub fn quarantined_copy(&self, blob: &Id) -> Option<Id> {
        self.quarantine_book().pack_of(blob)
    }

    /// Whether the copy of `blob` in `pack` is quarantined (as far as this process knows).
    pub fn is_quarantined(&self, pack: &Id, blob: &Id) -> bool {
        self.quarantine_book().contains(pack, blob)
    }

    /// The (pack, blob) copies quarantined as far as this process knows.
    pub fn quarantined(&self) -> HashSet<(Id, Id)> {
        self.quarantine_book().copies().clone()
    }

    /// Writes the markers of the copies quarantined since the last flush. Returns how many
    /// were written; on a store error the rest stay pending.
    pub async fn flush_quarantine(&self) -> RepoResult<usize> {
        let pending = std::mem::take(&mut *self.quarantine_book().pending());
        let mut written = 0;
        let mut left = Vec::new();
        let mut error = None;
        for p in pending {
            if error.is_some() {
                left.push(p);
                continue;
            }
            let key = keys::quarantine(&p.pack, &p.blob);
            match self
                .store()
                .put_if_absent(&key, Bytes::from(p.marker.encode()))
                .await
            {
                Ok(_) => written += 1,
                Err(e) => {
                    error = Some(e);
                    left.push(p);
                }
            }
        }
        self.quarantine_book().pending().extend(left);
        match error {
            Some(e) => Err(e.into()),
            None => Ok(written),
        }
    }

    /// Every quarantine marker in the store, as (pack, blob).
    pub async fn quarantine_markers(&self) -> RepoResult<Vec<(Id, Id)>> {
        let mut out = Vec::new();
        for meta in self.store().list(keys::QUARANTINE).await? {
            match keys::parse_quarantine(&meta.key) {
                Ok(pair) => out.push(pair),
                Err(e) => tracing::warn!("{}: {e}", meta.key),
            }
        }
        Ok(out)
    }

    /// Removes the marker of a copy that no longer exists (its pack was deleted).
    pub async fn delete_quarantine_marker(&self, pack: &Id, blob: &Id) -> RepoResult<()> {
        self.store().delete(&keys::quarantine(pack, blob)).await?;
        Ok(())
    }
}

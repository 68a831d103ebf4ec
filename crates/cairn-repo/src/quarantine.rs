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
//! Markers are written when the repository is closed (or by [`Repo::flush_quarantine`]):
//! reads that find damage often run on blocking threads. A marker is advisory and safe in
//! both directions — a wrong one only costs a duplicate copy — so GC removes a marker once
//! its pack is gone.

use cairn_format::keys;
use std::collections::HashSet;

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
        let key = (loc.pack, loc.entry.id);
        if !self.quarantined_set().insert(key) {
            return; // known already
        }
        // Info, not a warning: every caller reports the damage in its own terms (an error,
        // verify's report, restore's damaged ranges, the export's warning).
        tracing::info!(blob = %loc.entry.id, pack = %loc.pack, "quarantined a damaged copy: {reason}");
        self.index_mut().forget_at(&loc.entry.id, &loc.pack);
        self.quarantined_packs().insert(loc.entry.id, loc.pack);
        self.pending_markers().push(PendingMarker {
            pack: loc.pack,
            blob: loc.entry.id,
            marker: Quarantine {
                time_ns: now_ns(),
                offset: loc.entry.offset,
                reason: reason.to_string(),
            },
        });
    }

    /// The pack of a quarantined copy of `blob`, if there is one: for messages when no good
    /// copy is left.
    pub fn quarantined_copy(&self, blob: &Id) -> Option<Id> {
        self.quarantined_packs().get(blob).copied()
    }

    /// Whether the copy of `blob` in `pack` is quarantined (as far as this process knows).
    pub fn is_quarantined(&self, pack: &Id, blob: &Id) -> bool {
        self.quarantined_set().contains(&(*pack, *blob))
    }

    /// The (pack, blob) copies quarantined as far as this process knows.
    pub fn quarantined(&self) -> HashSet<(Id, Id)> {
        self.quarantined_set().clone()
    }

    /// Writes the markers of the copies quarantined since the last flush. Returns how many
    /// were written; on a store error the rest stay pending.
    pub async fn flush_quarantine(&self) -> RepoResult<usize> {
        let pending = std::mem::take(&mut *self.pending_markers());
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
        self.pending_markers().extend(left);
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

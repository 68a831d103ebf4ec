//! The version records GC walks, kept between GCs in one bundle (`gc/records/`, format in
//! `cairn_format::record_bundle`): GC walks every image's history twice (before deciding and
//! after its wait), and reading one object per version made that walk grow with history.
//! With the bundle, a GC reads it and only the records committed since the last GC; the
//! walk after the wait reads only what was committed during it.
//!
//! Only GC writes bundles, under `gc/lock`, and only after a walk: the new bundle holds every
//! record that walk reached (live or deleted: deleted records are links of the chains), the
//! old ones are then deleted. A damaged bundle is ignored and replaced. The exact pass reads
//! no bundle (it reads every record from its own key, as it trusts nothing kept between
//! GCs) but writes one.

use bytes::Bytes;
use cairn_format::id_hash::IdSet;
use cairn_format::record_bundle::RecordBundle;
use cairn_format::Id;
use cairn_repo::Repo;

use super::{GcMode, GcOptions, GcReport};
use crate::error::EngineResult;
use crate::live::{LiveVersions, RecordSource};

/// The records at hand for one GC, and the bundles they came from.
pub(super) struct GcRecords {
    pub(super) source: RecordSource,
    /// Keys of the bundles read, and of those found damaged.
    bundles: Vec<String>,
    damaged: Vec<String>,
    /// Ids the bundles held.
    bundled: IdSet,
}

impl GcRecords {
    /// Reads the bundles (fast deletion; the exact pass starts with none at hand).
    pub(super) async fn load(
        repo: &Repo,
        options: &GcOptions,
        report: &mut GcReport,
    ) -> EngineResult<GcRecords> {
        let mut known: Vec<(Id, Bytes)> = Vec::new();
        let (mut bundles, mut damaged) = (Vec::new(), Vec::new());
        for (key, bundle, len) in repo.record_bundles().await? {
            match bundle {
                Ok(b) => {
                    if options.mode == GcMode::Fast {
                        report.record_bundle_bytes += len;
                        known.extend(b.records.into_iter().map(|(id, r)| (id, Bytes::from(r))));
                    }
                    bundles.push(key);
                }
                Err(e) => {
                    tracing::warn!("{e}: ignored; gc reads the records it needs and replaces it");
                    damaged.push(key);
                }
            }
        }
        let bundled = known.iter().map(|(id, _)| *id).collect();
        Ok(GcRecords {
            source: RecordSource::with(known),
            bundles,
            damaged,
            bundled,
        })
    }

    /// Whether a live version was committed since the last GC (its record is in no bundle):
    /// then fast deletion looks for what concurrent commits stored twice.
    pub(super) fn has_new(&self, live: &LiveVersions) -> bool {
        live.live.keys().any(|id| !self.bundled.contains(id))
    }

    /// After the last walk (`live`): writes a bundle of every record it reached, unless the
    /// one bundle read holds exactly those, then deletes the others. Not in a dry run.
    pub(super) async fn keep(
        &self,
        repo: &Repo,
        live: &LiveVersions,
        options: &GcOptions,
        report: &mut GcReport,
    ) -> EngineResult<()> {
        report.records_read = self.source.read;
        if options.dry_run {
            return Ok(());
        }
        let kept: Vec<(&Id, &Bytes)> = live
            .reachable
            .iter()
            .filter_map(|id| Some((id, self.source.stored(id)?)))
            .collect();
        if self.damaged.is_empty()
            && self.bundles.len() == 1
            && kept.len() == self.bundled.len()
            && kept.iter().all(|(id, _)| self.bundled.contains(*id))
        {
            return Ok(());
        }
        let bundle = RecordBundle {
            records: kept
                .into_iter()
                .map(|(id, stored)| (*id, stored.to_vec()))
                .collect(),
        };
        // A damaged bundle goes first: the new one may have its key (the same records), and
        // would otherwise not be written over it.
        for key in &self.damaged {
            repo.delete_record_bundle(key).await?;
        }
        let (new_key, _) = repo.put_record_bundle(&bundle).await?;
        for key in self.bundles.iter().filter(|k| **k != new_key) {
            repo.delete_record_bundle(key).await?;
        }
        Ok(())
    }
}

//! `cairn relayout IMAGE@V --alpha A`: CloudVS's tunable delta storage (§3.3) on a
//! deduplicated repository.
//!
//! A version whose data many commits stored lies scattered over many packs: a restore makes
//! one ranged read per run of neighbouring groups, each a seek on a disk or a request on S3
//! (`cairn stats IMAGE@V`). CloudVS divides a version into fixed-size chunk groups, counts
//! each one's non-sequential reads, and stores the top proportion α of them — the most
//! scattered — again, contiguously. Here a chunk group is a batch of segments a restore reads
//! together (`restore::LEAVES_PER_READ` leaves, 4 MiB by default), its cost the ranged reads
//! its groups take beyond those they would take side by side (`stats::read_batches`, whose
//! reads `cairn stats IMAGE@V` adds up); the batches chosen have their groups copied — same ids, same stored bytes, each checked on the way —
//! into new packs in the order the restore reads them. The copies are *layout copies*
//! (`cairn_repo::layout`): readers and GC prefer them, so versions refer to the same ids as
//! before and nothing in any tree changes. The other copies become dead bytes in their
//! packs, the space α spends, given back as GC repacks those packs.
//!
//! A batch already read in as few requests as its size allows gains nothing from a copy and
//! is never chosen, so α = 1 re-stores only what is scattered. A group that several batches
//! of the version read is not copied: one copy is kept per id, so moving it next to one batch
//! would take it away from the others. Only additions are made (packs, their markers,
//! then the index run naming them), so an interrupted relayout leaves a consistent
//! repository: packs no run names are GC's orphans.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use cairn_format::group::Group;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::v2::{GroupLocation, OpenedGroup};
use cairn_repo::{Repo, RepoError};

use crate::error::{EngineError, EngineResult};
use crate::gc::repacker::Repacker;

/// A relayout's packs get layout times this many bits of nanoseconds apart (65 µs), so that
/// the packs a GC repacks them into can take the times in between and keep the order.
const LAYOUT_TIME_STEP_BITS: u32 = 16;
use crate::progress::{self, Unit, WorkProgress};
use crate::stats::{layout_of, read_batches, version_layout, ReadBatch, VersionLayout};

/// What a relayout found and did.
#[derive(Debug, Clone, Default)]
pub struct RelayoutReport {
    /// Batches of segments a restore reads together (`restore::LEAVES_PER_READ`) that hold
    /// data, and those it reads in more requests than their groups would take side by side.
    pub batches: u64,
    pub scattered: u64,
    /// Batches chosen (the top α of all, scattered ones only) and re-stored.
    pub chosen: u64,
    /// Groups copied (on a dry run: to copy), their stored bytes (the space the relayout
    /// spends until GC gives back the old copies' packs), and the packs written.
    pub groups_copied: u64,
    pub bytes_copied: u64,
    pub packs_written: u64,
    /// Where the version's data lies before and after (after = before on a dry run).
    pub before: VersionLayout,
    pub after: VersionLayout,
}

/// Re-stores the most scattered proportion `alpha` (0–1) of `record`'s read batches
/// contiguously. `dry_run`: chooses and reports, writes nothing.
pub async fn relayout(
    repo: &Arc<Repo>,
    record: &VersionRecord,
    alpha: f64,
    dry_run: bool,
    progress: Option<Arc<WorkProgress>>,
) -> EngineResult<RelayoutReport> {
    if !(0.0..=1.0).contains(&alpha) {
        return Err(EngineError::BadInput(format!(
            "--alpha {alpha} is not between 0 and 1 (the proportion of the version's data to re-store)"
        )));
    }
    if repo.v2().is_none() {
        return Err(EngineError::BadInput(
            "relayout works on format 2 repositories only".into(),
        ));
    }
    progress::start(&progress, "finding scattered data", Unit::Items, 0);
    let (batches, data_bytes) = read_batches(repo, record).await?;
    let mut report = RelayoutReport {
        before: layout_of(&batches, data_bytes),
        ..Default::default()
    };
    let batches: Vec<ReadBatch> = batches
        .into_iter()
        .filter(|b| !b.groups.is_empty())
        .collect();
    report.batches = batches.len() as u64;
    // A batch's scatter: the reads it takes beyond those its groups would take side by side.
    let extra = |b: &ReadBatch| b.reads.saturating_sub(b.fewest_reads);
    report.scattered = batches.iter().filter(|b| extra(b) > 0).count() as u64;
    // The top α of all batches by extra reads (ties: image order), of which the scattered.
    let take = (alpha * batches.len() as f64).round() as usize;
    let mut ranked: Vec<usize> = (0..batches.len()).collect();
    ranked.sort_by_key(|&i| std::cmp::Reverse(extra(&batches[i])));
    let mut chosen: Vec<usize> = ranked
        .into_iter()
        .take(take)
        .filter(|&i| extra(&batches[i]) > 0)
        .collect();
    chosen.sort_unstable();
    report.chosen = chosen.len() as u64;
    // Each chosen batch's own groups. A group that other batches of the version read too
    // (the same data in several places of the disk) stays where it is: with one copy kept
    // per id, moving it next to one batch would take it away from the others.
    let mut batches_naming: HashMap<Id, u32> = HashMap::new();
    for b in &batches {
        for g in &b.groups {
            *batches_naming.entry(g.id()).or_default() += 1;
        }
    }
    let copies: Vec<Vec<&GroupLocation>> = chosen
        .iter()
        .map(|&i| {
            batches[i]
                .groups
                .iter()
                .filter(|g| batches_naming[&g.id()] == 1)
                .collect()
        })
        .collect();
    for g in copies.iter().flatten() {
        report.groups_copied += 1;
        report.bytes_copied += range_of(g).end - range_of(g).start;
    }
    if dry_run || chosen.is_empty() {
        report.after = report.before.clone();
        return Ok(report);
    }
    progress::start(
        &progress,
        "re-storing segments",
        Unit::Bytes,
        report.bytes_copied,
    );
    let mut writer = Repacker::new(repo);
    for wanted in &copies {
        crate::interrupt::check()?;
        for group in read_stored(repo, wanted).await? {
            progress::add(&progress, group.stored.len() as u64);
            writer
                .push(cairn_format::pack::BlobKind::Data, group, None)
                .await?;
        }
    }
    let entries = writer.finish().await?;
    report.packs_written = writer.written.len() as u64;
    // One time per pack, rising in the order the packs were written (the relayout's time
    // plus the pack's ordinal in units of 2^16 ns, room for a GC's packs in between): a GC
    // that repacks them copies them in that order, so the version's restore order survives
    // (`gc::collect::repack_order`).
    let time = cairn_repo::session::now_ns().max(0) as u64;
    for (ordinal, (pack, _)) in writer.written.iter().enumerate() {
        let at = time.saturating_add((ordinal as u64) << LAYOUT_TIME_STEP_BITS);
        repo.put_layout_marker(pack, at).await?;
    }
    repo.put_run_entries(entries, repo.key()).await?;
    tracing::info!(
        image = %record.image,
        seq = record.seq,
        groups = report.groups_copied,
        bytes = report.bytes_copied,
        "relayout stored the version's most scattered segments again"
    );
    report.after = version_layout(repo, record).await?;
    Ok(report)
}

/// The stored bytes of `wanted` (in its order), read with one ranged read per run of
/// neighbouring groups of a pack, each group opened and its chunks checked before it is
/// copied: damage is never copied into a new pack.
async fn read_stored(repo: &Arc<Repo>, wanted: &[&GroupLocation]) -> EngineResult<Vec<Group>> {
    let mut by_place: Vec<usize> = (0..wanted.len()).collect();
    by_place.sort_unstable_by_key(|&i| {
        (
            wanted[i].trailer.pack,
            wanted[i].trailer.groups[wanted[i].group as usize].offset,
        )
    });
    // Spans of indexes into `wanted`: groups of one pack a reader reads at once
    // (`cairn_repo::v2::joins_read`, the rule restores read by).
    let mut spans: Vec<Vec<usize>> = Vec::new();
    for i in by_place {
        let this = range_of(wanted[i]);
        match spans.last_mut() {
            Some(span)
                if {
                    let last = wanted[*span.last().expect("a span is never empty")];
                    last.trailer.pack == wanted[i].trailer.pack
                        && cairn_repo::v2::joins_read(
                            &range_of(wanted[span[0]]),
                            &range_of(last),
                            &this,
                            span.len(),
                        )
                } =>
            {
                span.push(i)
            }
            _ => spans.push(vec![i]),
        }
    }
    // The spans' reads run at once (on S3 each is a request).
    let mut reads = tokio::task::JoinSet::new();
    for (n, span) in spans.iter().enumerate() {
        let pack = wanted[span[0]].trailer.pack;
        let last = wanted[*span.last().expect("a span is never empty")];
        let range = range_of(wanted[span[0]]).start..range_of(last).end;
        let repo = repo.clone();
        reads.spawn(async move { (n, repo.read_pack_range(&pack, range).await) });
    }
    let mut fetched = vec![bytes::Bytes::new(); spans.len()];
    while let Some(done) = reads.join_next().await {
        let (n, bytes) = done.map_err(|e| EngineError::internal("relayout read", e))?;
        fetched[n] = bytes?;
    }
    let mut out: Vec<Option<Group>> = (0..wanted.len()).map(|_| None).collect();
    for (span, bytes) in spans.iter().zip(fetched) {
        let base = range_of(wanted[span[0]]).start;
        for &i in span {
            let loc = wanted[i];
            let r = range_of(loc);
            let desc = &loc.trailer.groups[loc.group as usize].desc;
            let stored = bytes
                .get((r.start - base) as usize..(r.end - base) as usize)
                .ok_or_else(|| RepoError::BlobMissing { id: loc.id() })?;
            OpenedGroup::open(desc, stored, repo.key()).map_err(|e| {
                let reason = format!(
                    "group {} in pack {} is damaged: {e}",
                    loc.id(),
                    loc.trailer.pack
                );
                if let Some(reader) = repo.v2() {
                    reader.quarantine_group(loc, &reason);
                }
                EngineError::Repo(RepoError::BadBlob {
                    id: loc.id(),
                    pack: loc.trailer.pack,
                    offset: loc.trailer.groups[loc.group as usize].offset,
                    source: cairn_format::FormatError::invalid("group", e.to_string()),
                })
            })?;
            out[i] = Some(Group {
                stored: stored.to_vec(),
                desc: desc.clone(),
            });
        }
    }
    Ok(out
        .into_iter()
        .map(|g| g.expect("every group read"))
        .collect())
}

fn range_of(loc: &GroupLocation) -> Range<u64> {
    loc.trailer.groups[loc.group as usize].range()
}

//! Cold recompression (issue 56, CloudVS's storage trade-off, the other way): GC's exact pass
//! can compress the data it keeps again at a higher zstd level. A group keeps its id (its slot
//! list does not change), so no leaf, tree or version changes: the group is copied into a new
//! pack like any repacked group, and the old pack goes by GC's protocol. Which kept packs are
//! worth it is asked of their bytes, not recorded anywhere: the largest compressed data group
//! of each is compressed at the level, and the pack is copied when that group shrinks by at
//! least [`MIN_GAIN`] (a pack already recompressed at the level does not).

use cairn_format::config::Compression;
use cairn_format::group::{Group, GroupBuilder};
use cairn_format::pack::{BlobEncoding, BlobKind};
use cairn_format::Id;
use cairn_repo::v2::{OpenedGroup, PackTrailer};
use cairn_repo::Repo;

use super::liveness::Snapshot;
use super::pack_plan::PackPlan;
use crate::error::EngineResult;

/// The share a sample group must lose for its pack to be recompressed.
const MIN_GAIN: f64 = 0.02;

/// Groups sampled from each kept pack (spread over it).
const SAMPLES: usize = 4;

/// A pack, the stored bytes of the groups sampled from it, and each one's plain bytes.
type Sample = (Id, u64, Vec<(u32, Vec<u8>)>);

/// Moves every kept data pack whose groups would shrink at `level` from the plan's kept
/// packs to those it repacks; returns how many.
pub(super) async fn select(
    repo: &Repo,
    snapshot: &Snapshot,
    plan: &mut PackPlan,
    level: i32,
) -> EngineResult<u64> {
    let mut samples: Vec<Sample> = Vec::new();
    for pack in &plan.kept {
        crate::interrupt::check()?;
        let (Some(trailer), Some(canonical)) =
            (snapshot.trailers.get(pack), plan.canonical_in.get(pack))
        else {
            continue;
        };
        let compressed: Vec<u32> = canonical
            .iter()
            .copied()
            .filter(|&g| {
                let group = &trailer.groups[g as usize];
                group.kind == BlobKind::Data && group.desc.encoding == BlobEncoding::Zstd
            })
            .collect();
        if compressed.is_empty() {
            continue;
        }
        let step = compressed.len().div_ceil(SAMPLES);
        let mut stored_total = 0u64;
        let mut plains = Vec::new();
        for &g in compressed.iter().step_by(step) {
            let group = &trailer.groups[g as usize];
            let stored = repo.read_pack_range(pack, group.range()).await?;
            // A damaged copy is for verify and repair to name; never a reason to copy it.
            if let Ok(opened) = OpenedGroup::open(&group.desc, &stored, repo.key()) {
                stored_total += u64::from(group.desc.stored_len);
                plains.push((g, opened.plain().to_vec()));
            }
        }
        if !plains.is_empty() {
            samples.push((*pack, stored_total, plains));
        }
    }
    let chosen: Vec<Id> = parallel_map(samples, |(pack, before, plains)| {
        let trailer = &snapshot.trailers[&pack];
        let after: usize = plains
            .iter()
            .map(|(g, plain)| {
                recompressed(repo, trailer, *g, plain, None, level)
                    .stored
                    .len()
            })
            .sum();
        (1.0 - after as f64 / before.max(1) as f64 >= MIN_GAIN).then_some(pack)
    })
    .into_iter()
    .flatten()
    .collect();
    plan.kept.retain(|p| !chosen.contains(p));
    plan.to_repack.extend(chosen.iter().copied());
    Ok(chosen.len() as u64)
}

/// `f` over `items` on every core, results in order (recompression at high levels is CPU
/// work worth spreading).
pub(super) fn parallel_map<T: Send, R: Send>(items: Vec<T>, f: impl Fn(T) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let per = items.len().div_ceil(threads).max(1);
    let mut batches: Vec<Vec<T>> = Vec::new();
    let mut items = items.into_iter().peekable();
    while items.peek().is_some() {
        batches.push(items.by_ref().take(per).collect());
    }
    std::thread::scope(|scope| {
        let f = &f;
        let handles: Vec<_> = batches
            .into_iter()
            .map(|batch| scope.spawn(move || batch.into_iter().map(f).collect::<Vec<R>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("a recompression thread panicked"))
            .collect()
    })
}

/// Group `g` of `trailer` from its plain bytes, compressed at `level`, with its `live` slots
/// (every stored slot when `None`): the same id, since every slot stays listed.
pub(super) fn recompressed(
    repo: &Repo,
    trailer: &PackTrailer,
    g: u32,
    plain: &[u8],
    live: Option<&cairn_format::slots::SlotSet>,
    level: i32,
) -> Group {
    let desc = &trailer.groups[g as usize].desc;
    GroupBuilder::repack(desc, plain, |slot| {
        desc.chunks[slot].stored && live.is_none_or(|l| l.contains(slot))
    })
    .finish(Compression::Zstd { level }, repo.key())
}

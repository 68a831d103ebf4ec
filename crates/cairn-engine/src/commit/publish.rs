//! Publication of a committed tree, in the order that makes every crash safe: packs (already
//! durable) → index file → reference summary → version record → head ref by compare-and-swap.

use std::sync::atomic::Ordering;

use cairn_format::refs;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::{Repo, RepoError};

use super::{CommitProgress, CommitResult, PipelineOutput};
use crate::error::{EngineError, EngineResult};

/// GC safety, last line of defence: a GC whose plan this session did not see, and whose
/// cutoff is after this session started, normally waits for it. If such a GC finished anyway
/// (it judged this process dead, e.g. after a long stall), check that every blob the new
/// version reuses (refers to without storing it) still exists before publishing anything
/// that refers to it.
pub(crate) async fn check_stale_gc(repo: &Repo, out: &PipelineOutput) -> EngineResult<()> {
    // A damaged plan read at open hides what its GC dooms: always check then.
    if !repo.saw_damaged_plan() {
        let Some((cutoff_ns, plan)) = repo.last_gc().await? else {
            return Ok(());
        };
        if cutoff_ns < repo.session_started_ns() || repo.saw_plan(&plan) {
            return Ok(());
        }
    }
    // Every reused node and slot must still be located in what the store holds now (every
    // run: a GC pending now waits for this session and rescues what it reuses), and the slot
    // still stored there. Another GC's sweep may delete a superseded run while it is read: a
    // run found gone is read no more, so the check starts again from a new listing.
    let mut attempt = 1;
    let missing = loop {
        match missing_in_store(repo, out).await {
            Err(EngineError::Repo(e)) if e.is_not_found() && attempt < SWEPT_RETRIES => {
                tracing::debug!("{e}; a sweep removed a run: checking again");
                attempt += 1;
            }
            r => break r?,
        }
    };
    if missing > 0 {
        return Err(EngineError::RacedGc { missing });
    }
    Ok(())
}

/// Listings of the runs the stale-GC guard tries when runs vanish under it.
const SWEPT_RETRIES: u32 = 8;

/// How many of the nodes and group slots `out` reuses are not stored in any run the store
/// holds now.
async fn missing_in_store(repo: &Repo, out: &PipelineOutput) -> EngineResult<usize> {
    let (view, _) = repo.v2_view_all().await?;
    let mut missing = 0;
    for id in &out.reused {
        let gone = view.find_chunk(id).await?.is_none();
        if gone {
            tracing::debug!(%id, "a reused node is located in no run");
        }
        missing += usize::from(gone);
    }
    // Every slot of a group the tree uses that this commit did not store itself (the
    // reference summary lists them all, unread leaves' included, by key).
    if let Some(summary) = &out.group_summary {
        // The summary's groups and the run's keys both ascend: one pass over each.
        let mut own = out.run.keys().peekable();
        for (key, slots) in summary.groups() {
            let mut stored_here = false;
            while let Some(next) = own.peek() {
                match next {
                    Ok(k) if *k < key => {
                        own.next();
                    }
                    Ok(k) => {
                        stored_here = *k == key;
                        break;
                    }
                    Err(_) => {
                        let e = own.next().expect("peeked").expect_err("peeked an error");
                        return Err(RepoError::from_entries(e).into());
                    }
                }
            }
            if stored_here {
                continue;
            }
            let stored = match view.stores_group_key(key, &slots.runs()).await {
                Ok(stored) => stored,
                Err(e) if e.is_damage() => false,
                Err(e) => return Err(e.into()),
            };
            if !stored {
                tracing::debug!(key, "a reused group's slots are stored in no run");
            }
            missing += usize::from(!stored);
        }
    }
    Ok(missing)
}

/// Publishes a version whose packs are durable: checks the stale-GC guard, then writes the
/// index file, the reference summary, the version record and swaps the head ref, in that
/// order. The parent is the image's head when the ref is swapped; an image without a head
/// gets `origin` as parent (None for a plain first commit, the source version for a version
/// derived from another image's, like a clone) and seq 1.
pub(crate) async fn publish(
    repo: &Repo,
    image: &str,
    out: PipelineOutput,
    time_ns: i64,
    message: &str,
    origin: Option<Id>,
    progress: &CommitProgress,
) -> EngineResult<CommitResult> {
    check_stale_gc(repo, &out).await?;

    // Publication step 2: the index run, once every pack is durable; then the tree's
    // reference summary, which every published version must have (fast deletion trusts it).
    let mut index_bytes = match out.run.is_empty() {
        true => 0,
        false => out.run.put(repo).await?.1,
    };
    if let (Some(root), Some(summary)) = (&out.root, &out.group_summary) {
        index_bytes += repo
            .put_group_summary(root, summary, out.summary_base.as_ref())
            .await?;
    }
    let mut stats = out.stats;
    stats.stored_bytes = out.pack_bytes + index_bytes;
    let (reused_segments, dedup) = (out.reused_segments, out.dedup);
    progress.stored.fetch_add(index_bytes, Ordering::Relaxed);

    // Steps 3 and 4: version record, then the head ref by compare-and-swap. A lost race
    // means another commit of the same image won: re-parent onto it and try again (the
    // record we wrote for the old parent stays unreferenced, for GC).
    const ATTEMPTS: u32 = 64;
    for attempt in 0..ATTEMPTS {
        let head = repo.head(image).await?;
        let (parent, seq) = match &head {
            Some(h) => (
                Some(h.version),
                repo.load_version(&h.version).await?.seq + 1,
            ),
            None => (origin, 1),
        };
        let mut record = VersionRecord {
            image: image.to_string(),
            seq,
            parent,
            time_ns,
            logical_size: out.size,
            root: out.root,
            height: out.height,
            segment_size: repo.config().segment_size,
            fanout: repo.config().fanout,
            stats,
            message: message.to_string(),
        };
        // The record's length does not depend on the figure, so it can count itself and the ref.
        let own = record.encode().len() as u64 + refs::encode(&Id::ZERO).len() as u64;
        record.stats.stored_bytes += own;
        let (id, _) = repo.put_version(&record).await?;
        match repo.swap_head(image, head.as_ref(), &id).await {
            Ok(true) => {
                progress.stored.fetch_add(own, Ordering::Relaxed);
                tracing::info!(image, seq, %id, attempt, "committed");
                return Ok(CommitResult {
                    id,
                    record,
                    reused_segments,
                    dedup,
                });
            }
            // Another commit moved the head first: the record no ref will ever name is taken
            // back (its time makes it unique to this commit, so nothing else refers to it).
            // After an error the swap may still have happened (a request cut off after the
            // server acted), so the record stays; what is left is removed by the exact GC.
            // A record with the very same bytes may be what won (two copies of one version
            // made at once): it is published, never taken back.
            Ok(false) => {
                if repo.head(image).await?.is_some_and(|h| h.version == id) {
                    return Ok(CommitResult {
                        id,
                        record,
                        reused_segments,
                        dedup,
                    });
                }
                repo.delete_unpublished_version(&id).await
            }
            Err(e) => return Err(e.into()),
        }
        tracing::debug!(image, attempt, "head moved during commit; retrying");
    }
    Err(RepoError::Contention {
        image: image.to_string(),
        attempts: ATTEMPTS,
    }
    .into())
}

//! The commit pipeline's reader stage: the source's segments, in order (sparse-aware), into
//! a bounded channel, with the source's size checked again at the end.

use std::sync::atomic::{AtomicBool, Ordering};

use cairn_format::config::RepoConfig;
use crossbeam_channel::{Receiver, Sender};

use super::CommitProgress;
use crate::error::{EngineError, EngineResult};
use crate::source::{Segment, Source};

/// The reader stage: sends every segment of `source`, then returns its size (an error if the
/// size changed while it was read). Any error sets `cancel`.
pub(crate) fn read_all(
    source: &mut dyn Source,
    config: &RepoConfig,
    seg_tx: Sender<Segment>,
    recycle_rx: &Receiver<Vec<u8>>,
    cancel: &AtomicBool,
    progress: &CommitProgress,
) -> EngineResult<u64> {
    let r = read_source(source, config, &seg_tx, recycle_rx, cancel, progress);
    drop(seg_tx);
    let r = r.and_then(|()| {
        let size = source.final_size();
        match source.size_now() {
            Some(now) if now != size => Err(EngineError::SourceResized {
                what: source.describe(),
                was: size,
                now,
            }),
            _ => Ok(size),
        }
    });
    if r.is_err() {
        cancel.store(true, Ordering::Relaxed);
    }
    r
}

fn read_source(
    source: &mut dyn Source,
    config: &RepoConfig,
    seg_tx: &Sender<Segment>,
    recycle_rx: &Receiver<Vec<u8>>,
    cancel: &AtomicBool,
    progress: &CommitProgress,
) -> EngineResult<()> {
    while !cancel.load(Ordering::Relaxed) {
        crate::interrupt::check()?;
        let buf = recycle_rx.try_recv().unwrap_or_default();
        let Some(seg) = source.next_segment(config.segment_size, buf)? else {
            return Ok(());
        };
        progress
            .read
            .fetch_add(seg.data.len() as u64, Ordering::Relaxed);
        if seg_tx.send(seg).is_err() {
            break; // workers stopped; their error is reported
        }
    }
    Ok(())
}

//! Encoding blobs and packing them: data and manifest nodes go to separate packs (a version's
//! tree is read from few places), full packs upload while the next fill, with a bound on how
//! many are in flight.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use cairn_format::config::RepoConfig;
use cairn_format::pack::{encode_blob, BlobEncoding, BlobEntry, BlobKind, PackBuilder};
use cairn_format::Id;
use cairn_repo::{Repo, RepoResult};
use crossbeam_channel::Receiver;
use tokio::runtime::Handle;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use super::CommitProgress;
use crate::error::{EngineError, EngineResult};

/// A blob ready to be packed.
pub(crate) struct EncodedBlob {
    id: Id,
    kind: BlobKind,
    encoding: BlobEncoding,
    stored: Vec<u8>,
    raw_len: u32,
}

pub(crate) fn encode(id: Id, kind: BlobKind, plain: &[u8], config: &RepoConfig) -> EncodedBlob {
    let (stored, encoding) = encode_blob(plain, config.compression);
    EncodedBlob {
        id,
        kind,
        encoding,
        stored,
        raw_len: plain.len() as u32,
    }
}

/// A stored pack: its final id, its blobs, the bytes written.
type Uploaded = (Id, Vec<BlobEntry>, u64);
type Upload = JoinHandle<RepoResult<Uploaded>>;

/// A pack written by this commit and the blobs in it.
pub(crate) type PackedPack = (Id, Vec<BlobEntry>);

/// Packs blobs (data and manifest nodes in separate packs, so a version's tree is read from
/// few places) and uploads full packs, at most `uploads` at a time.
pub(crate) fn pack_blobs(
    repo: Arc<Repo>,
    handle: Handle,
    config: &RepoConfig,
    blob_rx: Receiver<EncodedBlob>,
    uploads: usize,
    progress: &CommitProgress,
) -> EngineResult<(Vec<PackedPack>, u64)> {
    let limit = Arc::new(Semaphore::new(uploads.max(1)));
    let mut in_flight = Uploads {
        handle: &handle,
        list: Vec::new(),
    };
    let mut packs = Vec::new();
    let mut written = 0u64;
    let mut data = PackBuilder::new();
    let mut nodes = PackBuilder::new();
    let target = config.pack_target as usize;

    let flush = |builder: &mut PackBuilder,
                 packs: &mut Vec<PackedPack>,
                 in_flight: &mut Vec<Upload>,
                 written: &mut u64|
     -> EngineResult<()> {
        let (id, bytes, entries) = std::mem::take(builder).finish();
        let permit = handle
            .block_on(limit.clone().acquire_owned())
            .map_err(|e| EngineError::internal("upload limiter", e))?;
        let repo = repo.clone();
        in_flight.push(handle.spawn(async move {
            let r = repo.put_pack(&id, bytes).await;
            drop(permit);
            r.map(|(id, n)| (id, entries, n))
        }));
        // Reap finished uploads so an error surfaces early.
        let mut i = 0;
        while i < in_flight.len() {
            if in_flight[i].is_finished() {
                let (id, entries, n) = join_upload(&handle, in_flight.swap_remove(i), progress)?;
                packs.push((id, entries));
                *written += n;
            } else {
                i += 1;
            }
        }
        Ok(())
    };

    for blob in blob_rx {
        let builder = match blob.kind {
            BlobKind::Data => &mut data,
            BlobKind::Node => &mut nodes,
        };
        builder.push(
            blob.id,
            blob.kind,
            blob.encoding,
            &blob.stored,
            blob.raw_len,
        );
        if builder.len() >= target {
            flush(builder, &mut packs, &mut in_flight.list, &mut written)?;
        }
    }
    for builder in [&mut data, &mut nodes] {
        if !builder.is_empty() {
            flush(builder, &mut packs, &mut in_flight.list, &mut written)?;
        }
    }
    while !in_flight.list.is_empty() {
        let upload = in_flight.list.remove(0);
        let (id, entries, n) = join_upload(&handle, upload, progress)?;
        packs.push((id, entries));
        written += n;
    }
    Ok((packs, written))
}

/// Pack uploads still running. On an early return (an error) they are cancelled and waited
/// for, so that when a failed commit returns, every pack it stored is known to
/// `Repo::discard_unindexed_packs` and none lands later.
struct Uploads<'h> {
    handle: &'h Handle,
    list: Vec<Upload>,
}

impl Drop for Uploads<'_> {
    fn drop(&mut self) {
        for upload in self.list.drain(..) {
            upload.abort();
            let _ = self.handle.block_on(upload);
        }
    }
}

fn join_upload(
    handle: &Handle,
    upload: Upload,
    progress: &CommitProgress,
) -> EngineResult<Uploaded> {
    let done = handle
        .block_on(upload)
        .map_err(|e| EngineError::internal("upload task", e))??;
    progress.stored.fetch_add(done.2, Ordering::Relaxed);
    Ok(done)
}

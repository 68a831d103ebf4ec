//! Reading many blobs at once: the blobs are grouped by pack and neighbours are fetched in one
//! ranged read, so a manifest's leaves (written next to each other by one commit) cost a few
//! requests instead of one each. On S3 a request costs a round trip; this is what keeps
//! opening a version cheap there.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use cairn_format::pack::BlobKind;
use cairn_format::Id;
use tokio::task::JoinSet;

use crate::blob_index::BlobLocation;
use crate::error::{RepoError, RepoResult};
use crate::repository::{blob_read_error, Repo};

/// Upper bound of one coalesced read.
const MAX_READ: u64 = 16 << 20;
/// Ranged reads in flight.
const PARALLEL_READS: usize = 8;

/// One ranged read of a pack and the blobs (by position in the request) inside it.
struct Read {
    pack: Id,
    range: Range<u64>,
    blobs: Vec<(usize, BlobLocation)>,
}

impl Repo {
    /// Reads blobs `ids`, verified, in the order given. Manifest nodes go through the metadata
    /// cache (if any); the rest is fetched with as few ranged reads as the store's read-gap
    /// hint allows.
    pub async fn read_blobs(self: &Arc<Self>, ids: &[Id]) -> RepoResult<Vec<Vec<u8>>> {
        if self.v2().is_some() {
            // Format 2 nodes are groups of their own, found and cached by the v2 reader.
            let mut out = Vec::with_capacity(ids.len());
            for id in ids {
                out.push(self.read_blob(id).await?);
            }
            return Ok(out);
        }
        let mut out: Vec<Option<Vec<u8>>> = vec![None; ids.len()];
        let mut by_pack: HashMap<Id, Vec<(usize, BlobLocation)>> = HashMap::new();
        for (i, id) in ids.iter().enumerate() {
            let loc = self.locate(id)?;
            if loc.entry.kind == BlobKind::Node {
                if let Some(plain) = self.meta_cache().and_then(|c| c.get(id)) {
                    out[i] = Some(plain);
                    continue;
                }
            }
            by_pack.entry(loc.pack).or_default().push((i, loc));
        }
        let gap = self.store().hints().read_gap;
        let mut reads = Vec::new();
        for (pack, mut blobs) in by_pack {
            blobs.sort_by_key(|(_, loc)| loc.entry.offset);
            let mut current: Option<Read> = None;
            for (i, loc) in blobs {
                let r = loc.entry.range();
                match &mut current {
                    Some(cur)
                        if r.start <= cur.range.end + gap
                            && r.end - cur.range.start <= MAX_READ =>
                    {
                        cur.range.end = cur.range.end.max(r.end);
                        cur.blobs.push((i, loc));
                    }
                    _ => {
                        reads.extend(current.take());
                        current = Some(Read {
                            pack,
                            range: r,
                            blobs: vec![(i, loc)],
                        });
                    }
                }
            }
            reads.extend(current);
        }

        let mut tasks = JoinSet::new();
        let mut pending = reads.into_iter();
        loop {
            while tasks.len() < PARALLEL_READS {
                let Some(read) = pending.next() else { break };
                let repo = self.clone();
                tasks.spawn(async move { repo.fetch_read(read).await });
            }
            let Some(done) = tasks.join_next().await else {
                break;
            };
            let blobs = done.map_err(|e| RepoError::internal("blob reader", e))??;
            for (i, plain) in blobs {
                out[i] = Some(plain);
            }
        }
        Ok(out
            .into_iter()
            .map(|b| b.expect("every blob was read"))
            .collect())
    }

    /// Performs one coalesced read and decodes (and caches, for nodes) its blobs.
    async fn fetch_read(&self, read: Read) -> RepoResult<Vec<(usize, Vec<u8>)>> {
        let bytes = match self.read_pack_range(&read.pack, read.range.clone()).await {
            Ok(b) => b,
            Err(e) => {
                let loc = &read.blobs[0].1;
                return Err(self.quarantine_if_damaged(blob_read_error(e, loc), loc));
            }
        };
        if bytes.len() as u64 != read.range.end - read.range.start {
            let loc = &read.blobs[0].1;
            return Err(RepoError::BadBlob {
                id: loc.entry.id,
                pack: read.pack,
                offset: loc.entry.offset,
                source: cairn_format::FormatError::invalid(
                    "blob",
                    format!("short read of pack bytes {:?}", read.range),
                ),
            });
        }
        let mut out = Vec::with_capacity(read.blobs.len());
        for (i, loc) in read.blobs {
            let r = loc.entry.range();
            let start = (r.start - read.range.start) as usize;
            let stored = &bytes[start..start + (r.end - r.start) as usize];
            let plain = self.check_blob(&loc, stored)?;
            if loc.entry.kind == BlobKind::Node {
                if let Some(cache) = self.meta_cache() {
                    if let Err(e) = cache.put(&loc.entry.id, &plain) {
                        tracing::debug!("metadata cache: {e}");
                    }
                }
            }
            out.push((i, plain));
        }
        Ok(out)
    }
}

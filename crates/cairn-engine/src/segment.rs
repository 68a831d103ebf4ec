//! The plain bytes of one segment of a version, read through its leaf: what a restore writes
//! and what `cairn copy` sends. Format 1 leaves name chunks (fetched with coalesced ranged
//! reads); format 2 leaves name runs of slots of groups (a leaf's groups opened together,
//! neighbouring ones in one read). Every byte is checked against its id on the way.

use std::sync::Arc;

use cairn_format::leaf_v2::{RunExtent, RunLeaf};
use cairn_format::node::Extent;
use cairn_format::Id;
use cairn_repo::v2::V2Reader;
use cairn_repo::{Repo, RepoError};

use crate::error::{EngineError, EngineResult};
use crate::tree::read_leaf;

/// The `len` plain bytes of the segment whose leaf is `id` (zero extents as zeros), and how
/// many of them are stored data.
pub async fn read_segment(repo: &Arc<Repo>, id: &Id, len: u64) -> EngineResult<(Vec<u8>, u64)> {
    match repo.v2() {
        Some(reader) => read_run_segment(repo, reader, id, len).await,
        None => read_chunk_segment(repo, id, len).await,
    }
}

/// Format 1: the leaf's chunks, read together.
async fn read_chunk_segment(repo: &Arc<Repo>, id: &Id, len: u64) -> EngineResult<(Vec<u8>, u64)> {
    let leaf = read_leaf(repo, id).await?;
    let ids: Vec<Id> = leaf.chunk_ids().collect();
    let mut chunks = repo.read_blobs(&ids).await?.into_iter();
    let mut data = Vec::with_capacity(len as usize);
    let mut stored = 0;
    for e in &leaf.extents {
        match e {
            Extent::Chunk { id: chunk, len } => {
                let bytes = chunks.next().expect("one read per chunk");
                if bytes.len() != *len as usize {
                    return Err(EngineError::Manifest(format!(
                        "leaf {id}: chunk {chunk} has {} bytes, the leaf says {len}",
                        bytes.len()
                    )));
                }
                data.extend_from_slice(&bytes);
                stored += u64::from(*len);
            }
            other => data.resize(data.len() + other.len() as usize, 0),
        }
    }
    check_len(id, data.len() as u64, len)?;
    Ok((data, stored))
}

fn check_len(leaf: &Id, covers: u64, len: u64) -> EngineResult<()> {
    match covers == len {
        true => Ok(()),
        false => Err(EngineError::Manifest(format!(
            "leaf {leaf} covers {covers} bytes where its segment has {len}"
        ))),
    }
}

/// Format 2: the leaf's groups, opened in one go (neighbouring groups in one read).
async fn read_run_segment(
    repo: &Repo,
    reader: &V2Reader,
    id: &Id,
    len: u64,
) -> EngineResult<(Vec<u8>, u64)> {
    let raw = repo.read_blob(id).await?;
    let leaf =
        RunLeaf::decode(&raw).map_err(|e| RepoError::corrupt(format!("manifest node {id}"), e))?;
    check_len(id, leaf.len(), len)?;
    // Every group the leaf names, opened in one go (neighbouring groups in one read).
    let mut names: Vec<Id> = Vec::new();
    let mut wanted: Vec<Vec<(u16, u16)>> = Vec::new();
    for e in leaf.extents() {
        if let RunExtent::Run {
            group,
            first,
            count,
            ..
        } = *e
        {
            let at = match names.iter().rposition(|g| *g == group) {
                Some(at) => at,
                None => {
                    names.push(group);
                    wanted.push(Vec::new());
                    names.len() - 1
                }
            };
            wanted[at].push((first, count));
        }
    }
    let mut located = Vec::with_capacity(names.len());
    for (group, slots) in names.iter().zip(&wanted) {
        located.push(reader.locate_group_storing(group, slots).await?);
    }
    let opened = reader.open_groups(&located).await?;
    let mut data = Vec::with_capacity(len as usize);
    let mut stored = 0;
    for e in leaf.extents() {
        match *e {
            RunExtent::Zero { len } => data.resize(data.len() + len as usize, 0),
            RunExtent::Run {
                group,
                first,
                count,
                len,
            } => {
                let at = names
                    .iter()
                    .position(|g| *g == group)
                    .expect("every group named");
                let bytes = located[at].slots(&opened[at], first, count)?;
                if bytes.len() != len as usize {
                    return Err(EngineError::Manifest(format!(
                        "leaf {id}: slots {first}..{} of group {group} hold {} bytes, the leaf \
                         says {len}",
                        u32::from(first) + u32::from(count),
                        bytes.len()
                    )));
                }
                data.extend_from_slice(&bytes);
                stored += u64::from(len);
            }
        }
    }
    Ok((data, stored))
}

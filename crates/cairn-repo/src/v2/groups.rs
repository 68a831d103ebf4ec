//! Opened groups, kept: a reader that wants three slots of a group, or the same group again
//! for the next block, gets it from memory. A group is fetched with one ranged read, opened
//! (unsealed, decompressed) and every stored chunk checked against its id before it enters the
//! cache, so what the cache holds is trusted. Concurrent readers of one group wait for one
//! fetch (the cache's placeholder), not one each.

use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use cairn_format::crypto::{CryptoError, MasterKey};
use cairn_format::group::{open_group, GroupDesc};
use cairn_format::{keys, FormatError, Id};

use super::tail::get_exact;
use super::trailers::PackTrailer;
use super::{sealed_error, Cost, V2Reader};
use crate::error::{RepoError, RepoResult};

/// A group's plain bytes, every stored chunk checked, and where each slot lies in them.
#[derive(Debug)]
pub struct OpenedGroup {
    plain: Bytes,
    /// Per slot: its bytes in `plain`, or `None` for a slot GC dropped.
    slots: Vec<Option<Range<usize>>>,
}

impl OpenedGroup {
    /// Opens a stored group (unseals, decompresses) and checks every stored chunk against its
    /// id (`key`: the keyed ids of an encrypted repository).
    pub fn open(
        desc: &GroupDesc,
        stored: &[u8],
        key: Option<&MasterKey>,
    ) -> Result<OpenedGroup, CryptoError> {
        let plain = open_group(desc, stored, key)?;
        let mut slots = Vec::with_capacity(desc.chunks.len());
        let mut offset = 0usize;
        for (slot, c) in desc.chunks.iter().enumerate() {
            if !c.stored {
                slots.push(None);
                continue;
            }
            let r = offset..offset + c.len as usize;
            offset = r.end;
            let id = match key {
                Some(k) => k.id_of(&plain[r.clone()]),
                None => Id::of(&plain[r.clone()]),
            };
            if id != c.id {
                return Err(FormatError::invalid(
                    "group",
                    format!("slot {slot}: bytes do not hash to chunk {}", c.id),
                )
                .into());
            }
            slots.push(Some(r));
        }
        Ok(OpenedGroup {
            plain: Bytes::from(plain),
            slots,
        })
    }

    /// The plain bytes of slots `first .. first + count`, which must all be stored (they are
    /// then contiguous).
    pub fn slots(&self, first: usize, count: usize) -> Result<Bytes, FormatError> {
        let end = first
            .checked_add(count)
            .filter(|e| count > 0 && *e <= self.slots.len())
            .ok_or_else(|| {
                FormatError::invalid(
                    "group",
                    format!(
                        "slots {first}..{} of a group of {}",
                        first.saturating_add(count),
                        self.slots.len()
                    ),
                )
            })?;
        let mut range: Option<Range<usize>> = None;
        for slot in first..end {
            let Some(r) = &self.slots[slot] else {
                return Err(FormatError::invalid(
                    "group",
                    format!("slot {slot} is no longer stored (GC dropped it)"),
                ));
            };
            range = Some(range.map_or(r.clone(), |acc| acc.start..r.end));
        }
        Ok(self.plain.slice(range.expect("count > 0")))
    }

    /// The plain bytes the group stores.
    pub fn plain(&self) -> &Bytes {
        &self.plain
    }
}

impl Cost for OpenedGroup {
    fn cost(&self) -> u64 {
        (self.plain.len() + self.slots.len() * 24) as u64
    }
}

impl V2Reader {
    /// Group `group` of the pack `trailer` describes, from the cache or fetched and checked.
    pub async fn open_group(
        &self,
        trailer: &PackTrailer,
        group: u32,
    ) -> RepoResult<Arc<OpenedGroup>> {
        self.groups
            .get_or_insert_async(&(trailer.pack, group), self.fetch_group(trailer, group))
            .await
    }

    /// [`Self::open_group`], saying whether this call fetched the group from the store
    /// (`false`: from the cache, or fetched by a concurrent caller this one waited for) — what
    /// an export counts as fetched.
    pub async fn open_group_counted(
        &self,
        trailer: &PackTrailer,
        group: u32,
    ) -> RepoResult<(Arc<OpenedGroup>, bool)> {
        let fetched = std::sync::atomic::AtomicBool::new(false);
        let opened = self
            .groups
            .get_or_insert_async(&(trailer.pack, group), async {
                fetched.store(true, std::sync::atomic::Ordering::Relaxed);
                self.fetch_group(trailer, group).await
            })
            .await?;
        Ok((opened, fetched.into_inner()))
    }

    async fn fetch_group(&self, trailer: &PackTrailer, group: u32) -> RepoResult<Arc<OpenedGroup>> {
        self.fetched
            .groups
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let key = keys::pack(&trailer.pack);
        let g = trailer.groups.get(group as usize).ok_or_else(|| {
            RepoError::corrupt(
                &key,
                FormatError::invalid("pack", format!("no group {group}")),
            )
        })?;
        let at = |e: RepoError| match e {
            RepoError::Corrupt { key, source } => RepoError::Corrupt {
                key: format!("{key} group {group} (at byte {})", g.offset),
                source,
            },
            other => other,
        };
        let stored = get_exact(&*self.store, &key, g.range()).await.map_err(at)?;
        self.fetched
            .group_bytes
            .fetch_add(stored.len() as u64, std::sync::atomic::Ordering::Relaxed);
        let opened = OpenedGroup::open(&g.desc, &stored, self.key())
            .map_err(|e| at(sealed_error(&key, e)))?;
        Ok(Arc::new(opened))
    }
}

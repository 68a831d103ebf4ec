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
use cairn_format::pack_v2::PackGroup;
use std::sync::atomic::Ordering;

/// At most this many groups in one read (at most 4 MiB of plain bytes at the default group
/// size, about 1.5 MiB stored on the su-* images), so a span's bytes stay a small part of the
/// group cache. A restore asks a few leaves' groups at once, which lie side by side.
const MAX_SPAN_GROUPS: usize = 64;

/// Groups of one pack at most this far apart are read in one request, the bytes between them
/// read and dropped (as format 1's restore coalesces chunks): the groups of a version's
/// segment were written by several commits, so they are near each other more often than
/// next to each other. One skipped group of 64 KiB fits, with the frames around it (pack
/// version 3: 33–65 bytes a group, more when a frame lists its slots).
const MAX_SPAN_GAP: u64 = (64 << 10) + 4096;

/// At most this many stored bytes in one read, gaps included.
const MAX_SPAN_BYTES: u64 = 4 << 20;

/// Whether a group stored at `this` joins a read of `len` groups of the same pack that spans
/// `first.start .. last.end`: near enough, and the read not too long (the one rule every
/// reader of several groups plans its ranged reads by).
pub fn joins_read(first: &Range<u64>, last: &Range<u64>, this: &Range<u64>, len: usize) -> bool {
    this.start >= last.end
        && this.start - last.end <= MAX_SPAN_GAP
        && this.end - first.start <= MAX_SPAN_BYTES
        && len < MAX_SPAN_GROUPS
}

/// How many ranged reads a reader makes for groups stored at `groups` (pack, bytes), sorted
/// by pack and offset, when it asks for them together: groups of one pack near each other
/// share a read, as the reader plans its reads (`cairn stats IMAGE@V` reports it).
pub fn ranged_reads(groups: &[(Id, Range<u64>)]) -> u64 {
    let mut reads = 0;
    let mut span: Option<(Id, Range<u64>, Range<u64>, usize)> = None;
    for (pack, this) in groups {
        match &mut span {
            Some((p, first, last, len)) if p == pack && joins_read(first, last, this, *len) => {
                *last = this.clone();
                *len += 1;
            }
            _ => {
                reads += 1;
                span = Some((*pack, this.clone(), this.clone(), 1));
            }
        }
    }
    reads
}
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
        Self::open_inner(desc, stored, key, true)
    }

    /// Opens a stored group without hashing its chunks: for a reader that checks the bytes
    /// it assembles another way (a restore checks each segment against its leaf's digest, one
    /// BLAKE3 pass at full SIMD width instead of one per 4 KiB chunk). Never cached.
    pub fn open_unchecked(
        desc: &GroupDesc,
        stored: &[u8],
        key: Option<&MasterKey>,
    ) -> Result<OpenedGroup, CryptoError> {
        Self::open_inner(desc, stored, key, false)
    }

    fn open_inner(
        desc: &GroupDesc,
        stored: &[u8],
        key: Option<&MasterKey>,
        check: bool,
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
            if !check {
                slots.push(Some(r));
                continue;
            }
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

    /// [`Self::open_group`] for a group read once (a commit's parent leaves, each a group of
    /// its own): from the cache if there, else fetched and checked but not cached. A commit
    /// reads every changed segment's parent leaf, and kept in the cache of opened groups
    /// (data, 64 MiB by default) they grew it with the image: 5 MiB of a 64 GiB re-commit.
    pub async fn open_group_once(
        &self,
        trailer: &PackTrailer,
        group: u32,
    ) -> RepoResult<Arc<OpenedGroup>> {
        match self.groups.get(&(trailer.pack, group)) {
            Some(opened) => Ok(opened),
            None => self.fetch_group(trailer, group).await,
        }
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

    /// Whether group `group` of `pack` is in the cache of opened groups (an export counts
    /// only what it fetches).
    pub fn is_open(&self, pack: &Id, group: u32) -> bool {
        self.groups.get(&(*pack, group)).is_some()
    }

    /// Opens every group of `wanted` (in its order), fetching the ones not cached with as few
    /// reads as possible: neighbouring groups of one pack — what a leaf's runs usually name,
    /// since a commit writes a segment's groups in order — come in one ranged read. A
    /// restore asks this once per leaf instead of once per group (one blocking read instead
    /// of dozens, and as many fewer thread wakeups).
    pub async fn open_groups(
        &self,
        wanted: &[super::GroupLocation],
    ) -> RepoResult<Vec<Arc<OpenedGroup>>> {
        let opened = self.fetch_missing(wanted, true).await?;
        // Duplicates of a group fetched above are in the cache now.
        let mut out = Vec::with_capacity(wanted.len());
        for (w, o) in wanted.iter().zip(opened) {
            out.push(match o {
                Some(g) => g,
                None => self.open_group(&w.trailer, w.group).await?,
            });
        }
        Ok(out)
    }

    /// [`Self::open_groups`] for a reader that checks what it assembles itself (see
    /// [`OpenedGroup::open_unchecked`]): groups in the cache (checked) are taken from there;
    /// the others are fetched with as few reads, opened without hashing their chunks and not
    /// cached.
    pub async fn open_groups_unchecked(
        &self,
        wanted: &[super::GroupLocation],
    ) -> RepoResult<Vec<Arc<OpenedGroup>>> {
        let opened = self.fetch_missing(wanted, false).await?;
        let mut out: Vec<Arc<OpenedGroup>> = Vec::with_capacity(wanted.len());
        for (i, o) in opened.into_iter().enumerate() {
            out.push(match o {
                Some(g) => g,
                // A repeat of a group fetched above.
                None => {
                    let first = (0..i)
                        .find(|&j| {
                            (wanted[j].trailer.pack, wanted[j].group)
                                == (wanted[i].trailer.pack, wanted[i].group)
                        })
                        .expect("every group is fetched once");
                    out[first].clone()
                }
            });
        }
        Ok(out)
    }

    /// Each group of `wanted` from the cache, or fetched in spans (`checked`: opened, hashed
    /// and cached; otherwise opened unchecked and not cached); `None` for a repeat of a group
    /// fetched here.
    async fn fetch_missing(
        &self,
        wanted: &[super::GroupLocation],
        checked: bool,
    ) -> RepoResult<Vec<Option<Arc<OpenedGroup>>>> {
        let mut opened: Vec<Option<Arc<OpenedGroup>>> = wanted
            .iter()
            .map(|w| self.groups.get(&(w.trailer.pack, w.group)))
            .collect();
        for span in self.spans(wanted, &opened) {
            for (i, group) in self.fetch_span_with(wanted, &span, checked).await? {
                opened[i] = Some(group);
            }
        }
        Ok(opened)
    }

    /// The groups of `wanted` not `opened` yet, each once, as spans of groups of one pack
    /// near each other (indexes into `wanted`), in pack order.
    fn spans(
        &self,
        wanted: &[super::GroupLocation],
        opened: &[Option<Arc<OpenedGroup>>],
    ) -> Vec<Vec<usize>> {
        let mut missing: Vec<usize> = (0..wanted.len()).filter(|&i| opened[i].is_none()).collect();
        missing.sort_by_key(|&i| (wanted[i].trailer.pack, wanted[i].group));
        missing.dedup_by_key(|i| (wanted[*i].trailer.pack, wanted[*i].group));
        let mut spans: Vec<Vec<usize>> = Vec::new();
        for i in missing {
            let w = &wanted[i];
            let range = |l: &super::GroupLocation| {
                l.trailer.groups.get(l.group as usize).map(PackGroup::range)
            };
            let neighbour = spans.last().is_some_and(|span| {
                let first = &wanted[span[0]];
                let last = &wanted[*span.last().expect("spans are never empty")];
                let (Some(first), Some(last), Some(this)) = (range(first), range(last), range(w))
                else {
                    return false;
                };
                wanted[span[0]].trailer.pack == w.trailer.pack
                    && joins_read(&first, &last, &this, span.len())
            });
            match spans.last_mut() {
                Some(span) if neighbour => span.push(i),
                _ => spans.push(vec![i]),
            }
        }
        spans
    }

    /// Fetches groups `span` (indexes into `wanted`, one pack, in pack order, near each
    /// other) with one ranged read and opens each: `checked`, every chunk hashed and the
    /// group cached; otherwise neither ([`OpenedGroup::open_unchecked`]).
    async fn fetch_span_with(
        &self,
        wanted: &[super::GroupLocation],
        span: &[usize],
        checked: bool,
    ) -> RepoResult<Vec<(usize, Arc<OpenedGroup>)>> {
        let trailer = &wanted[span[0]].trailer;
        if span.len() == 1 && checked {
            let g = self.open_group(trailer, wanted[span[0]].group).await?;
            return Ok(vec![(span[0], g)]);
        }
        let key = keys::pack(&trailer.pack);
        let entry = |i: usize| -> RepoResult<&PackGroup> {
            let group = wanted[i].group;
            trailer.groups.get(group as usize).ok_or_else(|| {
                RepoError::corrupt(
                    &key,
                    FormatError::invalid("pack", format!("no group {group}")),
                )
            })
        };
        let start = entry(span[0])?.range().start;
        let end = entry(*span.last().expect("a span is never empty"))?
            .range()
            .end;
        let stored = get_exact(&*self.store, &key, start..end).await?;
        let mut out = Vec::with_capacity(span.len());
        for &i in span {
            let group = wanted[i].group;
            let g = entry(i)?;
            let r = g.range();
            let bytes = r
                .start
                .checked_sub(start)
                .and_then(|at| stored.get(at as usize..(r.end - start) as usize))
                .ok_or_else(|| {
                    RepoError::corrupt(
                        &key,
                        FormatError::invalid(
                            "pack",
                            format!("group {group} overlaps its neighbours"),
                        ),
                    )
                })?;
            self.fetched.groups.fetch_add(1, Ordering::Relaxed);
            self.fetched
                .group_bytes
                .fetch_add(bytes.len() as u64, Ordering::Relaxed);
            let open = match checked {
                true => OpenedGroup::open,
                false => OpenedGroup::open_unchecked,
            };
            let opened = open(&g.desc, bytes, self.key())
                .map_err(|e| at_group(sealed_error(&key, e), group, g.offset))?;
            let opened = Arc::new(opened);
            if checked {
                self.groups.insert((trailer.pack, group), opened.clone());
            }
            out.push((i, opened));
        }
        Ok(out)
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
        let at = |e| at_group(e, group, g.offset);
        let stored = match get_exact(&*self.store, &key, g.range()).await {
            Err(e) if e.is_not_found() => {
                return Err(RepoError::PackMissing {
                    pack: trailer.pack,
                    id: trailer.group_id(group).unwrap_or(trailer.pack),
                })
            }
            other => other.map_err(at)?,
        };
        self.fetched
            .group_bytes
            .fetch_add(stored.len() as u64, std::sync::atomic::Ordering::Relaxed);
        let opened = OpenedGroup::open(&g.desc, &stored, self.key())
            .map_err(|e| at(sealed_error(&key, e)))?;
        Ok(Arc::new(opened))
    }
}

/// A damaged group's error names the group and where it starts in its pack.
fn at_group(e: RepoError, group: u32, offset: u32) -> RepoError {
    match e {
        RepoError::Corrupt { key, source } => RepoError::Corrupt {
            key: format!("{key} group {group} (at byte {offset})"),
            source,
        },
        other => other,
    }
}

//! Writing GC's copies of live groups and nodes into new packs (repack, rescue), and what
//! the consolidated index run must name for them.

use cairn_format::group::Group;
use cairn_format::index_run::RunEntries;
use cairn_format::pack::BlobKind;
use cairn_format::slots::SlotSet;
use cairn_format::Id;
use cairn_repo::v2::{pack_capacity, OpenPack};
use cairn_repo::Repo;

use crate::error::EngineResult;

/// Writes copied groups into new packs (data and nodes apart: nodes live longer) and
/// collects what the index run must name for them. A pack is opened by its first group, in
/// a file the store publishes as it is when it stages (a local repository), else in memory.
pub(crate) struct Repacker<'a> {
    repo: &'a Repo,
    data: (Option<OpenPack>, Vec<Id>),
    nodes: (Option<OpenPack>, Vec<Id>),
    /// The index entries of the packs stored (8 bytes an id: a GC of the whole repository
    /// names every live chunk here).
    pub(crate) locations: RunEntries,
    /// The packs stored so far, and their sizes.
    pub(crate) written: Vec<(Id, u64)>,
    /// The latest layout time of the copies from layout packs in the open data pack, and
    /// the packs stored that hold such copies, with theirs (to be marked `layout/` in turn,
    /// so a repack keeps a relayout's work), rising in the order the packs were stored.
    data_laid_out: Option<u64>,
    pub(crate) laid_out: Vec<(Id, u64)>,
}

impl<'a> Repacker<'a> {
    pub(crate) fn new(repo: &'a Repo) -> Repacker<'a> {
        Repacker {
            repo,
            data: (None, Vec::new()),
            nodes: (None, Vec::new()),
            locations: RunEntries::default(),
            written: Vec::new(),
            data_laid_out: None,
            laid_out: Vec::new(),
        }
    }

    /// Adds `group` (of `kind`); a data group's index entries are its id and the chunks of
    /// `live` slots it stores (every stored chunk when `live` is `None`).
    pub(crate) async fn push(
        &mut self,
        kind: BlobKind,
        group: Group,
        live: Option<&SlotSet>,
    ) -> EngineResult<()> {
        self.push_copy(kind, group, live, None).await
    }

    /// [`Self::push`] of a copy, with the layout time of the pack it was taken from if that
    /// is a layout pack (`cairn_repo::layout`): the data pack it goes into is then listed in
    /// `laid_out`.
    pub(crate) async fn push_copy(
        &mut self,
        kind: BlobKind,
        group: Group,
        live: Option<&SlotSet>,
        from_layout: Option<u64>,
    ) -> EngineResult<()> {
        if kind == BlobKind::Data {
            self.data_laid_out = self.data_laid_out.max(from_layout);
        }
        let target = self.repo.config().pack_target as usize;
        let key = self.repo.key();
        let (writer, ids) = match kind {
            BlobKind::Data => &mut self.data,
            BlobKind::Node => &mut self.nodes,
        };
        match kind {
            BlobKind::Node => ids.push(group.desc.chunks[0].id),
            BlobKind::Data => {
                ids.push(cairn_format::group::group_id(&group.desc.chunks, key));
                ids.extend(
                    group
                        .desc
                        .chunks
                        .iter()
                        .enumerate()
                        .filter(|(slot, c)| c.stored && live.is_none_or(|l| l.contains(*slot)))
                        .map(|(_, c)| c.id),
                );
            }
        }
        if writer.is_none() {
            let staged = self.repo.stage_pack().await?;
            let group_size = self.repo.config().v2.map_or(64 << 10, |v| v.group_size);
            let capacity = pack_capacity(target, group_size as usize);
            *writer = Some(OpenPack::new(staged, key, capacity)?);
        }
        let open = writer.as_mut().expect("opened");
        open.push(kind, group)?;
        if open.len() >= target {
            let full = writer.take().expect("opened");
            let ids = std::mem::take(ids);
            self.store(kind, full, ids).await?;
        }
        Ok(())
    }

    async fn store(&mut self, kind: BlobKind, writer: OpenPack, ids: Vec<Id>) -> EngineResult<()> {
        let (id, bytes) = writer.finish()?;
        let (pack, size) = self.repo.put_pack(&id, bytes).await?;
        self.locations.add_pack(pack, &ids);
        self.written.push((pack, size));
        if kind == BlobKind::Data {
            if let Some(time) = self.data_laid_out.take() {
                // Times rise with the order the packs are written, as a relayout's do.
                let last = self
                    .laid_out
                    .last()
                    .map_or(0, |&(_, t)| t.saturating_add(1));
                self.laid_out.push((pack, time.max(last)));
            }
        }
        Ok(())
    }

    /// Stores the open packs; returns the index entries of every pack written.
    pub(crate) async fn finish(&mut self) -> EngineResult<RunEntries> {
        for which in [BlobKind::Data, BlobKind::Node] {
            let (writer, ids) = match which {
                BlobKind::Data => &mut self.data,
                BlobKind::Node => &mut self.nodes,
            };
            if let Some(open) = writer.take().filter(|w| !w.is_empty()) {
                let ids = std::mem::take(ids);
                self.store(which, open, ids).await?;
            }
        }
        Ok(std::mem::take(&mut self.locations))
    }
}

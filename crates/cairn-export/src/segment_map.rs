//! Which leaf holds each segment of an export's version: the interior nodes of its tree,
//! each read the first time a segment under it is touched. Opening an export reads only the
//! root, so it costs the same for a 1 GiB and a 64 GiB image; reading every interior node
//! at open (one per 256 segments) made a 64 GiB export start take twice a 1 GiB one's time
//! (BENCHMARKS.md, *Scaling with image size and history*). A damaged interior node now fails the reads under it
//! with an I/O error, as a damaged leaf always did, instead of the start.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};

use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::tree_walk::{decode_interior, NodeReader};

use crate::error::{ExportError, ExportResult};

/// The children of one interior node: (slot, child id), ascending slots.
type Children = Arc<Vec<(u16, Id)>>;

pub(crate) struct SegmentMap {
    root: Option<Id>,
    /// Levels above the leaves (0: the root is the only leaf).
    height: u8,
    fanout: u64,
    /// Interior nodes read so far, by (level, index among the nodes of its level).
    nodes: RwLock<HashMap<(u8, u64), Children>>,
}

impl SegmentMap {
    /// The map of `record`'s tree, its root read (a version whose root cannot be read does
    /// not start).
    pub(crate) async fn open<R>(reader: &mut R, record: &VersionRecord) -> ExportResult<Self>
    where
        R: NodeReader<Error = ExportError>,
    {
        let map = SegmentMap {
            root: record.root,
            height: record.height,
            fanout: u64::from(record.fanout.max(1)),
            nodes: RwLock::new(HashMap::new()),
        };
        if let Some(root) = map.root.filter(|_| map.height > 0) {
            map.children(reader, map.height, 0, &root).await?;
        }
        Ok(map)
    }

    /// The leaf of segment `seg` (`None`: the segment is all zeros), reading the interior
    /// nodes on its path that were not read before.
    pub(crate) async fn leaf<R>(&self, reader: &mut R, seg: u64) -> ExportResult<Option<Id>>
    where
        R: NodeReader<Error = ExportError>,
    {
        let Some(mut id) = self.root else {
            return Ok(None);
        };
        let covered = self.fanout.saturating_pow(u32::from(self.height));
        if seg >= covered {
            return Ok(None);
        }
        for level in (1..=self.height).rev() {
            // Segments under each child of a node of this level.
            let span = self.fanout.saturating_pow(u32::from(level) - 1);
            let children = self
                .children(reader, level, seg / span / self.fanout, &id)
                .await?;
            let slot = (seg / span) % self.fanout;
            match children.binary_search_by_key(&slot, |(s, _)| u64::from(*s)) {
                Ok(i) => id = children[i].1,
                Err(_) => return Ok(None),
            }
        }
        Ok(Some(id))
    }

    /// The children of node `id`, at `level` and `index`: kept, or read and decoded.
    async fn children<R>(
        &self,
        reader: &mut R,
        level: u8,
        index: u64,
        id: &Id,
    ) -> ExportResult<Children>
    where
        R: NodeReader<Error = ExportError>,
    {
        if let Some(c) = self
            .nodes
            .read()
            .expect("segment map lock")
            .get(&(level, index))
        {
            return Ok(c.clone());
        }
        let raw = reader.read_node(id).await?;
        let mut children = decode_interior(id, level, &raw)?.children;
        children.sort_unstable_by_key(|(slot, _)| *slot);
        let children = Arc::new(children);
        self.nodes
            .write()
            .expect("segment map lock")
            .insert((level, index), children.clone());
        Ok(children)
    }
}

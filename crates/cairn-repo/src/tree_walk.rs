//! One walk over a manifest tree, for everything that visits a version's nodes: GC marking and
//! summaries, fast deletion, verify, repair, and an export's segment map.
//!
//! The walk reads nodes through a [`NodeReader`] (the repository's index, a GC's own snapshot
//! of it, an export's cache), checks that each node decodes *at the level its parent says*
//! ([`decode_node`], typed [`NodeError`]s), and hands what it finds to a [`TreeVisitor`],
//! which may skip subtrees (already marked, claimed by a summary, memoised) and decides what
//! an unreadable node means: the end of the walk, or a subtree to report and skip.

use std::collections::HashSet;

use cairn_format::node::{Interior, Leaf};
use cairn_format::{FormatError, Id};
use thiserror::Error;

use crate::error::RepoError;
use crate::repository::Repo;

/// A manifest node that is not what its parent says it is.
#[derive(Debug, Error)]
pub enum NodeError {
    #[error("manifest node {id}: {source}")]
    Corrupt {
        id: Id,
        #[source]
        source: FormatError,
    },
    #[error("manifest node {id} is at level {found} where level {expected} was expected")]
    WrongLevel { id: Id, expected: u8, found: u8 },
}

/// A decoded manifest node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    Interior(Interior),
    Leaf(Leaf),
}

/// Decodes `raw` as node `id`, which its parent places at `level` (0: a leaf).
pub fn decode_node(id: &Id, level: u8, raw: &[u8]) -> Result<Node, NodeError> {
    let corrupt = |source| NodeError::Corrupt { id: *id, source };
    if level == 0 {
        return Leaf::decode(raw).map(Node::Leaf).map_err(corrupt);
    }
    let node = Interior::decode(raw).map_err(corrupt)?;
    if node.level != level {
        return Err(NodeError::WrongLevel {
            id: *id,
            expected: level,
            found: node.level,
        });
    }
    Ok(Node::Interior(node))
}

/// Decodes `raw` as the interior node `id` at `level` (≥ 1).
pub fn decode_interior(id: &Id, level: u8, raw: &[u8]) -> Result<Interior, NodeError> {
    match decode_node(id, level.max(1), raw)? {
        Node::Interior(n) => Ok(n),
        Node::Leaf(_) => unreachable!("level ≥ 1 decodes an interior node"),
    }
}

/// Decodes `raw` as the leaf `id`.
pub fn decode_leaf(id: &Id, raw: &[u8]) -> Result<Leaf, NodeError> {
    Leaf::decode(raw).map_err(|source| NodeError::Corrupt { id: *id, source })
}

/// Where a walk reads manifest nodes from: verified node bytes by id.
#[allow(async_fn_in_trait)]
pub trait NodeReader {
    type Error: From<NodeError>;
    async fn read_node(&mut self, id: &Id) -> Result<Vec<u8>, Self::Error>;
}

/// The repository reads nodes through the index it loaded.
impl NodeReader for &Repo {
    type Error = RepoError;
    async fn read_node(&mut self, id: &Id) -> Result<Vec<u8>, RepoError> {
        self.read_blob(id).await
    }
}

/// A node's place in its tree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeAt {
    pub id: Id,
    /// 0 for a leaf.
    pub level: u8,
    /// Its position among the nodes of its level: for a leaf, its segment.
    pub index: u64,
}

impl NodeAt {
    /// The first segment the node covers.
    pub fn first_segment(&self, fanout: u16) -> u64 {
        self.index
            .saturating_mul((fanout as u64).saturating_pow(self.level as u32))
    }

    /// How many segments the node covers (at most).
    pub fn segments(&self, fanout: u16) -> u64 {
        (fanout as u64).saturating_pow(self.level as u32)
    }
}

/// What a walk does at each node. Every method has a default: visit everything, fail on the
/// first node that cannot be read.
pub trait TreeVisitor<E> {
    /// Before `at` is read: `false` skips it and everything under it.
    fn enter(&mut self, at: &NodeAt) -> bool {
        let _ = at;
        true
    }

    /// An interior node was read (its children are visited next, in order).
    fn interior(&mut self, at: &NodeAt, node: &Interior) -> Result<(), E> {
        let _ = (at, node);
        Ok(())
    }

    /// A leaf was read.
    fn leaf(&mut self, at: &NodeAt, leaf: Leaf) -> Result<(), E> {
        let _ = (at, leaf);
        Ok(())
    }

    /// `at` could not be read or does not decode at its level: an error ends the walk,
    /// `Ok` skips its subtree.
    fn unreadable(&mut self, at: &NodeAt, error: E) -> Result<(), E> {
        let _ = at;
        Err(error)
    }
}

/// Collects the node ids of format 2 trees — each once, however many trees share it — and
/// their leaves, unread (a walk decodes format 1 leaves only: the caller reads leaves of group
/// runs itself). An unreadable interior node ends the walk, or is skipped with
/// `skip_unreadable` (what cannot be read is then the caller's finding).
#[derive(Debug, Default)]
pub struct GroupedTreeNodes {
    pub nodes: HashSet<Id>,
    pub leaves: Vec<Id>,
    pub skip_unreadable: bool,
}

impl<E> TreeVisitor<E> for GroupedTreeNodes {
    fn enter(&mut self, at: &NodeAt) -> bool {
        if !self.nodes.insert(at.id) {
            return false;
        }
        if at.level == 0 {
            self.leaves.push(at.id);
            return false;
        }
        true
    }

    fn unreadable(&mut self, _: &NodeAt, error: E) -> Result<(), E> {
        match self.skip_unreadable {
            true => Ok(()),
            false => Err(error),
        }
    }
}

/// Walks the tree under `root` (of `height` levels above the leaves, `fanout` children per
/// node) depth-first, in segment order.
pub async fn walk_tree<R: NodeReader>(
    reader: &mut R,
    root: Id,
    height: u8,
    fanout: u16,
    visitor: &mut impl TreeVisitor<R::Error>,
) -> Result<(), R::Error> {
    let mut stack = vec![NodeAt {
        id: root,
        level: height,
        index: 0,
    }];
    while let Some(at) = stack.pop() {
        if !visitor.enter(&at) {
            continue;
        }
        let node = match reader.read_node(&at.id).await {
            Ok(raw) => decode_node(&at.id, at.level, &raw).map_err(R::Error::from),
            Err(e) => Err(e),
        };
        match node {
            Err(e) => visitor.unreadable(&at, e)?,
            Ok(Node::Leaf(leaf)) => visitor.leaf(&at, leaf)?,
            Ok(Node::Interior(node)) => {
                visitor.interior(&at, &node)?;
                // Pushed in reverse so that they pop in order.
                for &(slot, child) in node.children.iter().rev() {
                    stack.push(NodeAt {
                        id: child,
                        level: at.level - 1,
                        index: at.index * fanout as u64 + slot as u64,
                    });
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cairn_format::node::Extent;
    use std::collections::HashMap;

    /// Nodes from a map; a missing id is an error.
    struct MapReader(HashMap<Id, Vec<u8>>);

    #[derive(Debug)]
    enum TestError {
        Missing(Id),
        Node(NodeError),
    }

    impl From<NodeError> for TestError {
        fn from(e: NodeError) -> Self {
            TestError::Node(e)
        }
    }

    impl NodeReader for MapReader {
        type Error = TestError;
        async fn read_node(&mut self, id: &Id) -> Result<Vec<u8>, TestError> {
            self.0.get(id).cloned().ok_or(TestError::Missing(*id))
        }
    }

    fn leaf(tag: u8) -> Vec<u8> {
        Leaf {
            extents: vec![Extent::Chunk {
                id: Id::of(&[tag]),
                len: 4096,
            }],
        }
        .encode()
    }

    /// A two-level tree (fanout 4): root → interiors at slots 0 and 2 → leaves.
    fn tree() -> (Id, HashMap<Id, Vec<u8>>) {
        let mut nodes = HashMap::new();
        let mut put = |raw: Vec<u8>| {
            let id = Id::of(&raw);
            nodes.insert(id, raw);
            id
        };
        let (l0, l1, l9) = (put(leaf(0)), put(leaf(1)), put(leaf(9)));
        let a = put(Interior::new(1, vec![(0, l0), (1, l1)]).encode());
        let b = put(Interior::new(1, vec![(1, l9)]).encode());
        let root = put(Interior::new(2, vec![(0, a), (2, b)]).encode());
        (root, nodes)
    }

    #[derive(Default)]
    struct Collect {
        leaves: Vec<(u64, u8)>,
        skipped: Vec<(Id, TestError)>,
    }

    impl TreeVisitor<TestError> for Collect {
        fn leaf(&mut self, at: &NodeAt, leaf: Leaf) -> Result<(), TestError> {
            let Extent::Chunk { id, .. } = leaf.extents[0] else {
                panic!("a chunk extent");
            };
            let tag = (0..=9u8).find(|t| Id::of(&[*t]) == id).unwrap();
            self.leaves.push((at.index, tag));
            Ok(())
        }
        fn unreadable(&mut self, at: &NodeAt, e: TestError) -> Result<(), TestError> {
            self.skipped.push((at.id, e));
            Ok(())
        }
    }

    fn walk(root: Id, nodes: HashMap<Id, Vec<u8>>, height: u8) -> Collect {
        let mut v = Collect::default();
        block_on(walk_tree(&mut MapReader(nodes), root, height, 4, &mut v)).unwrap();
        v
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn leaves_come_in_segment_order_with_their_segment() {
        let (root, nodes) = tree();
        let v = walk(root, nodes, 2);
        assert_eq!(v.leaves, vec![(0, 0), (1, 1), (9, 9)]);
        assert!(v.skipped.is_empty());
    }

    #[test]
    fn a_node_at_the_wrong_level_is_a_typed_error_and_its_subtree_is_skipped() {
        let (root, nodes) = tree();
        // Claim one more level than the tree has: the root (level 2) sits where level 3 is
        // expected.
        let v = walk(root, nodes.clone(), 3);
        assert!(v.leaves.is_empty());
        assert!(
            matches!(
                v.skipped[..],
                [(id, TestError::Node(NodeError::WrongLevel { id: bad, expected: 3, found: 2 }))]
                    if id == root && bad == root
            ),
            "{:?}",
            v.skipped
        );
    }

    #[test]
    fn a_corrupt_or_missing_node_reaches_the_visitor_and_the_rest_is_walked() {
        let (root, mut nodes) = tree();
        let l1 = Id::of(&leaf(1));
        nodes.insert(l1, b"not a leaf".to_vec());
        let l9 = Id::of(&leaf(9));
        nodes.remove(&l9);
        let v = walk(root, nodes, 2);
        assert_eq!(v.leaves, vec![(0, 0)]);
        assert!(
            matches!(
                v.skipped[..],
                [
                    (a, TestError::Node(NodeError::Corrupt { id: bad, .. })),
                    (b, TestError::Missing(missing)),
                ] if a == l1 && bad == l1 && b == l9 && missing == l9
            ),
            "{:?}",
            v.skipped
        );
    }

    #[test]
    fn the_default_visitor_ends_the_walk_at_the_first_unreadable_node() {
        struct Strict;
        impl TreeVisitor<TestError> for Strict {}
        let (root, mut nodes) = tree();
        nodes.remove(&Id::of(&leaf(1)));
        let r = block_on(walk_tree(&mut MapReader(nodes), root, 2, 4, &mut Strict));
        assert!(matches!(r, Err(TestError::Missing(id)) if id == Id::of(&leaf(1))));
    }
}

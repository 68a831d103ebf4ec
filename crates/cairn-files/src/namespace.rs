//! The names a mount shows: a directory per image, and in it a file per live version
//! (`@N.raw`), per tag (`@TAG.raw`) and `latest.raw`.
//!
//! Inode numbers are stable for the mount's life: an image keeps its directory's number, and a
//! version keeps its file's number under every name that points at it (`latest.raw` and
//! `@7.raw` are the same file while 7 is the newest), so the kernel's page cache of a version
//! is shared by its names and never serves one version's bytes for another. The refs are read
//! again at most once per [`LISTING_TTL`]: a commit or a tag made while mounted shows up,
//! and a deleted version's names go away (a file already open keeps reading).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cairn_engine::resolve::history;
use cairn_format::version::VersionRecord;
use cairn_format::Id;
use cairn_repo::Repo;

use crate::error::FilesResult;

/// How long a listing of the refs is trusted before it is read again.
pub const LISTING_TTL: Duration = Duration::from_secs(1);

/// The root directory's inode (FUSE's fixed number).
pub const ROOT: u64 = 1;

/// The name of the file that is always the newest live version.
pub const LATEST: &str = "latest.raw";

/// What an inode is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Node {
    /// A directory: the path of image names it stands for (`""` for the root, `web01` for
    /// the images `web01/disk0` and `web01/disk1`, or an image's own name).
    Dir(String),
    Version(Id),
}

/// One name in a directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Child {
    pub name: String,
    pub ino: u64,
    /// The version of a file; `None` for a directory.
    pub version: Option<Id>,
}

#[derive(Default)]
struct State {
    next_ino: u64,
    nodes: HashMap<u64, Node>,
    dir_inos: HashMap<String, u64>,
    version_inos: HashMap<Id, u64>,
    records: HashMap<Id, VersionRecord>,
    images: Option<(Instant, Vec<String>)>,
    versions: HashMap<String, (Instant, Vec<(String, Id)>)>,
}

impl State {
    fn new() -> State {
        let mut s = State {
            next_ino: ROOT + 1,
            ..State::default()
        };
        s.nodes.insert(ROOT, Node::Dir(String::new()));
        s.dir_inos.insert(String::new(), ROOT);
        s
    }

    fn ino_of(&mut self, node: Node) -> u64 {
        let known = match &node {
            Node::Dir(path) => self.dir_inos.get(path),
            Node::Version(id) => self.version_inos.get(id),
        };
        if let Some(ino) = known {
            return *ino;
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        match &node {
            Node::Dir(path) => self.dir_inos.insert(path.clone(), ino),
            Node::Version(id) => self.version_inos.insert(*id, ino),
        };
        self.nodes.insert(ino, node);
        ino
    }
}

/// The mount's names, read from the repository's refs and cached briefly.
pub struct Namespace {
    repo: Arc<Repo>,
    state: Mutex<State>,
}

impl Namespace {
    pub fn new(repo: Arc<Repo>) -> Namespace {
        Namespace {
            repo,
            state: Mutex::new(State::new()),
        }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("namespace lock")
    }

    /// What inode `ino` is, if the mount has shown it.
    pub fn node(&self, ino: u64) -> Option<Node> {
        self.state().nodes.get(&ino).cloned()
    }

    /// The record of a version the mount has listed.
    pub fn record(&self, id: &Id) -> Option<VersionRecord> {
        self.state().records.get(id).cloned()
    }

    /// The images with a live version whose names make a path, sorted.
    async fn images(&self) -> FilesResult<Vec<String>> {
        if let Some((at, names)) = &self.state().images {
            if at.elapsed() < LISTING_TTL {
                return Ok(names.clone());
            }
        }
        let mut names: Vec<String> = self
            .repo
            .images()
            .await?
            .into_iter()
            .filter(|n| n.split('/').all(usable_name))
            .collect();
        names.sort();
        self.state().images = Some((Instant::now(), names.clone()));
        Ok(names)
    }

    /// The file names of `image`'s versions ([`version_names`]).
    async fn versions(&self, image: &str) -> FilesResult<Vec<(String, Id)>> {
        if let Some((at, names)) = self.state().versions.get(image) {
            if at.elapsed() < LISTING_TTL {
                return Ok(names.clone());
            }
        }
        let versions = history(&self.repo, image).await?;
        let tags = self.repo.tags(image).await?;
        let names = version_names(&versions, &tags);
        let mut s = self.state();
        for (id, record) in versions {
            s.records.insert(id, record);
        }
        s.versions
            .insert(image.to_string(), (Instant::now(), names.clone()));
        Ok(names)
    }

    /// The names in directory `dir`: the next path component of every image under it, then,
    /// when `dir` is an image itself, its versions' files. A subdirectory whose name is also a
    /// version file's is not shown.
    pub async fn children(&self, dir: &str) -> FilesResult<Vec<Child>> {
        let images = self.images().await?;
        let files = if images.iter().any(|i| i == dir) {
            self.versions(dir).await?
        } else {
            Vec::new()
        };
        let subdirs = subdirectories(&images, dir);
        let mut s = self.state();
        let mut out: Vec<Child> = subdirs
            .into_iter()
            .filter(|name| !files.iter().any(|(f, _)| f == name))
            .map(|name| {
                let path = if dir.is_empty() {
                    name.clone()
                } else {
                    format!("{dir}/{name}")
                };
                Child {
                    ino: s.ino_of(Node::Dir(path)),
                    name,
                    version: None,
                }
            })
            .collect();
        out.extend(files.into_iter().map(|(name, id)| Child {
            ino: s.ino_of(Node::Version(id)),
            name,
            version: Some(id),
        }));
        Ok(out)
    }
}

/// The distinct next components of the image names under directory `dir`, sorted.
fn subdirectories(images: &[String], dir: &str) -> Vec<String> {
    let mut out: Vec<String> = images
        .iter()
        .filter_map(|i| {
            if dir.is_empty() {
                Some(i.as_str())
            } else {
                i.strip_prefix(dir)?.strip_prefix('/')
            }
        })
        .filter_map(|rest| rest.split('/').next())
        .map(str::to_owned)
        .collect();
    out.sort();
    out.dedup();
    out
}

/// The file names of an image's live versions (`history`, newest first) and of its tags that
/// point at one of them: `latest.raw`, then `@N.raw` from the oldest, then `@TAG.raw` by name.
/// A tag whose version is deleted, or whose name is a version number's, is not shown.
pub fn version_names(versions: &[(Id, VersionRecord)], tags: &[(String, Id)]) -> Vec<(String, Id)> {
    let mut out = Vec::with_capacity(versions.len() + tags.len() + 1);
    if let Some((newest, _)) = versions.first() {
        out.push((LATEST.to_string(), *newest));
    }
    for (id, r) in versions.iter().rev() {
        out.push((format!("@{}.raw", r.seq), *id));
    }
    let live: HashMap<Id, ()> = versions.iter().map(|(id, _)| (*id, ())).collect();
    let mut tags: Vec<&(String, Id)> = tags
        .iter()
        .filter(|(name, id)| {
            live.contains_key(id) && usable_name(name) && name.parse::<u64>().is_err()
        })
        .collect();
    tags.sort();
    for (name, id) in tags {
        out.push((format!("@{name}.raw"), *id));
    }
    out
}

/// Whether `name` can be one path component.
fn usable_name(name: &str) -> bool {
    !name.is_empty() && name != "." && name != ".." && !name.contains(['/', '\0'])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(seq: u64) -> VersionRecord {
        VersionRecord {
            image: "vm".into(),
            seq,
            parent: None,
            time_ns: 0,
            logical_size: 4096,
            root: None,
            height: 0,
            segment_size: 4096,
            fanout: 2,
            stats: Default::default(),
            message: String::new(),
        }
    }

    fn id(n: u8) -> Id {
        Id::of(&[n])
    }

    #[test]
    fn latest_then_versions_from_the_oldest_then_tags_of_live_versions() {
        let versions = vec![(id(3), record(3)), (id(1), record(1))];
        let tags = vec![
            ("prod".to_string(), id(1)),
            ("gone".to_string(), id(2)),
            ("7".to_string(), id(3)),
            ("base".to_string(), id(3)),
        ];
        let names: Vec<(String, Id)> = version_names(&versions, &tags);
        assert_eq!(
            names,
            vec![
                ("latest.raw".to_string(), id(3)),
                ("@1.raw".to_string(), id(1)),
                ("@3.raw".to_string(), id(3)),
                ("@base.raw".to_string(), id(3)),
                ("@prod.raw".to_string(), id(1)),
            ]
        );
        assert!(version_names(&[], &tags).is_empty());
    }

    #[test]
    fn a_version_keeps_one_inode_under_every_name() {
        let mut s = State::new();
        let a = s.ino_of(Node::Version(id(1)));
        let dir = s.ino_of(Node::Dir("vm".into()));
        assert_eq!(s.ino_of(Node::Version(id(1))), a);
        assert_ne!(a, dir);
        assert_eq!(s.ino_of(Node::Dir(String::new())), ROOT);
        assert_eq!(s.nodes.get(&dir), Some(&Node::Dir("vm".into())));
    }

    #[test]
    fn image_names_with_slashes_are_nested_directories() {
        let images: Vec<String> = [
            "db",
            "web01/disk0",
            "web01-old",
            "web01/disk1",
            "web01/disk1/x",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            subdirectories(&images, ""),
            vec!["db", "web01", "web01-old"]
        );
        assert_eq!(subdirectories(&images, "web01"), vec!["disk0", "disk1"]);
        assert_eq!(subdirectories(&images, "web01/disk1"), vec!["x"]);
        assert!(subdirectories(&images, "db").is_empty());
        assert!(subdirectories(&images, "web").is_empty());
    }
}

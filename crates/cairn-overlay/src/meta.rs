//! `meta.json`: the overlay's manifest (image parameters, base version, snapshot tree).
//!
//! The file is a JSON object `{"blake3":"<hex>","body":{...}}` where the hash is BLAKE3 of
//! the compact JSON serialization of `body` exactly as written. On read the body is parsed
//! into [`Meta`], serialized again and hashed: any edit, truncation or bit flip fails the
//! check (serialization of these plain types is deterministic).
//!
//! Version 2 (written now) records a tree: every layer names its parent and the writable
//! layer is `current`. Version 1 recorded a stack (bottom first, the last layer writable);
//! it is read as the tree whose layers each have the one before as parent.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::OverlayError;

pub(crate) const FORMAT: &str = "cairn-overlay";
pub(crate) const VERSION: u32 = 2;

/// One layer of the tree as recorded in the manifest.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct LayerMeta {
    pub id: u64,
    /// The layer below this one; `None` for a layer straight on the base.
    pub parent: Option<u64>,
    /// Snapshot name of a frozen layer; `None` for the writable layer and deleted ones.
    pub snapshot: Option<String>,
    /// Deleted snapshot kept because layers above it still read through it (iROW's virtual
    /// deletion); it goes once no layer does.
    pub deleted: bool,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct Meta {
    pub format: String,
    pub version: u32,
    pub size: u64,
    pub block_size: u32,
    pub base: String,
    /// Layer ids are never reused; this is the next one to hand out.
    pub next_layer_id: u64,
    /// The writable layer's id.
    pub current: u64,
    /// Every layer, by increasing id (a parent's id is below its children's).
    pub layers: Vec<LayerMeta>,
}

/// Version 1's body, exactly as it was written (for its checksum).
#[derive(Serialize, Deserialize)]
struct MetaV1 {
    format: String,
    version: u32,
    size: u64,
    block_size: u32,
    base: String,
    next_layer_id: u64,
    layers: Vec<LayerV1>,
}

#[derive(Serialize, Deserialize)]
struct LayerV1 {
    id: u64,
    snapshot: Option<String>,
}

#[derive(Serialize)]
struct EnvelopeOut<'a> {
    blake3: String,
    body: &'a Meta,
}

#[derive(Deserialize)]
struct EnvelopeIn<T> {
    blake3: String,
    body: T,
}

#[derive(Deserialize)]
struct VersionOnly {
    version: u32,
}

impl Meta {
    pub(crate) fn encode(&self) -> Vec<u8> {
        let body = serde_json::to_vec(self).expect("meta serializes");
        let env = EnvelopeOut {
            blake3: blake3::hash(&body).to_hex().to_string(),
            body: self,
        };
        let mut out = serde_json::to_vec(&env).expect("meta serializes");
        out.push(b'\n');
        out
    }

    pub(crate) fn decode(bytes: &[u8], path: &Path) -> Result<Meta, OverlayError> {
        let unreadable = |e: serde_json::Error| {
            OverlayError::corrupt(path, format!("unreadable (truncated or corrupted): {e}"))
        };
        let version = serde_json::from_slice::<EnvelopeIn<VersionOnly>>(bytes)
            .map_err(unreadable)?
            .body
            .version;
        let m = if version == 1 {
            let env: EnvelopeIn<MetaV1> = serde_json::from_slice(bytes).map_err(unreadable)?;
            check_sum(&env.body, &env.blake3, path)?;
            Meta::from_v1(env.body)
        } else {
            let env: EnvelopeIn<Meta> = serde_json::from_slice(bytes).map_err(unreadable)?;
            check_sum(&env.body, &env.blake3, path)?;
            env.body
        };
        m.validate().map_err(|r| OverlayError::corrupt(path, r))?;
        Ok(m)
    }

    /// A version 1 stack as a tree: each layer on the one before it, the last one writable.
    fn from_v1(v1: MetaV1) -> Meta {
        let mut parent = None;
        let layers: Vec<LayerMeta> = v1
            .layers
            .iter()
            .map(|l| {
                let m = LayerMeta {
                    id: l.id,
                    parent,
                    snapshot: l.snapshot.clone(),
                    deleted: false,
                };
                parent = Some(l.id);
                m
            })
            .collect();
        let mut meta = Meta {
            format: v1.format,
            version: VERSION,
            size: v1.size,
            block_size: v1.block_size,
            base: v1.base,
            next_layer_id: v1.next_layer_id,
            // An empty stack fails validation below (no current layer).
            current: v1.layers.last().map_or(u64::MAX, |l| l.id),
            layers,
        };
        meta.layers.sort_by_key(|l| l.id);
        meta
    }

    fn validate(&self) -> Result<(), String> {
        if self.format != FORMAT {
            return Err(format!("format is {:?}, expected {FORMAT:?}", self.format));
        }
        if self.version != VERSION {
            return Err(format!("unsupported format version {}", self.version));
        }
        if self.layers.len() > crate::MAX_LAYERS {
            return Err(format!(
                "{} layers (max {})",
                self.layers.len(),
                crate::MAX_LAYERS
            ));
        }
        let mut ids = HashSet::new();
        let mut names = HashSet::new();
        let by_id: HashMap<u64, &LayerMeta> = self.layers.iter().map(|l| (l.id, l)).collect();
        for l in &self.layers {
            if l.id >= self.next_layer_id || !ids.insert(l.id) {
                return Err(format!("bad or duplicate layer id {}", l.id));
            }
            if let Some(p) = l.parent {
                // Parents are created first, so this also rules out cycles.
                if p >= l.id || !by_id.contains_key(&p) {
                    return Err(format!("layer {} has a bad parent {p}", l.id));
                }
                if by_id[&p].id == self.current {
                    return Err(format!("layer {} sits on the writable layer", l.id));
                }
            }
            let writable = l.id == self.current;
            match (&l.snapshot, writable, l.deleted) {
                (_, true, true) => return Err("the writable layer is deleted".into()),
                (Some(_), true, _) => return Err("the writable layer has a snapshot name".into()),
                (Some(_), false, true) => {
                    return Err(format!("deleted layer {} has a snapshot name", l.id))
                }
                (None, false, false) => {
                    return Err(format!("frozen layer {} has no snapshot name", l.id))
                }
                (Some(n), false, false) if !names.insert(n.as_str()) => {
                    return Err(format!("duplicate snapshot name {n:?}"))
                }
                _ => {}
            }
        }
        if !by_id.contains_key(&self.current) {
            return Err(format!("the writable layer {} is not listed", self.current));
        }
        Ok(())
    }
}

fn check_sum<T: Serialize>(body: &T, sum: &str, path: &Path) -> Result<(), OverlayError> {
    let bytes = serde_json::to_vec(body).expect("meta serializes");
    if blake3::hash(&bytes).to_hex().as_str() != sum {
        return Err(OverlayError::corrupt(
            path,
            "checksum mismatch (edited or corrupted)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Fuzzing the parser: arbitrary bytes never panic.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = Meta::decode(&bytes, Path::new("meta.json"));
        }
    }

    #[test]
    fn every_bit_flip_and_truncation_is_rejected() {
        let good = sample().encode();
        for i in 0..good.len() {
            for bit in 0..8 {
                let mut bad = good.clone();
                bad[i] ^= 1 << bit;
                // A flip inside JSON whitespace could leave the same document: then it must
                // decode to exactly the same metadata.
                if let Ok(m) = Meta::decode(&bad, Path::new("m")) {
                    assert_eq!(
                        m,
                        sample(),
                        "flip {i}:{bit} accepted with a different meaning"
                    );
                }
            }
            // Only dropping trailing whitespace may leave the same document.
            if let Ok(m) = Meta::decode(&good[..i], Path::new("m")) {
                assert!(
                    good[i..].iter().all(|b| b.is_ascii_whitespace()),
                    "truncated to {i}"
                );
                assert_eq!(m, sample());
            }
        }
    }

    fn sample() -> Meta {
        Meta {
            format: FORMAT.into(),
            version: VERSION,
            size: 12345,
            block_size: 4096,
            base: "v1 \"quoted\" ünïcode".into(),
            next_layer_id: 5,
            current: 4,
            layers: vec![
                LayerMeta {
                    id: 0,
                    parent: None,
                    snapshot: Some("a\tb".into()),
                    deleted: false,
                },
                LayerMeta {
                    id: 2,
                    parent: Some(0),
                    snapshot: None,
                    deleted: true,
                },
                LayerMeta {
                    id: 3,
                    parent: Some(2),
                    snapshot: Some("c".into()),
                    deleted: false,
                },
                LayerMeta {
                    id: 4,
                    parent: Some(2),
                    snapshot: None,
                    deleted: false,
                },
            ],
        }
    }

    /// A manifest written by a build that kept a stack reads as the same chain.
    #[test]
    fn version_1_stack_reads_as_a_chain() {
        let body = r#"{"format":"cairn-overlay","version":1,"size":8192,"block_size":4096,"base":"b","next_layer_id":4,"layers":[{"id":1,"snapshot":"a"},{"id":3,"snapshot":null}]}"#;
        let sum = blake3::hash(body.as_bytes()).to_hex();
        let file = format!(r#"{{"blake3":"{sum}","body":{body}}}"#);
        let m = Meta::decode(file.as_bytes(), Path::new("m")).unwrap();
        assert_eq!(m.version, VERSION);
        assert_eq!(m.current, 3);
        assert_eq!(
            m.layers,
            vec![
                LayerMeta {
                    id: 1,
                    parent: None,
                    snapshot: Some("a".into()),
                    deleted: false
                },
                LayerMeta {
                    id: 3,
                    parent: Some(1),
                    snapshot: None,
                    deleted: false
                },
            ]
        );
        let tampered = file.replace("8192", "8193");
        assert!(Meta::decode(tampered.as_bytes(), Path::new("m")).is_err());
    }

    #[test]
    fn a_tree_that_does_not_hold_together_is_refused() {
        let p = Path::new("m");
        type Damage = fn(&mut Meta);
        let cases: [(&str, Damage); 5] = [
            ("bad parent", |m| m.layers[1].parent = Some(9)),
            ("bad parent", |m| m.layers[2].parent = Some(4)),
            ("writable layer is deleted", |m| m.layers[3].deleted = true),
            ("has no snapshot name", |m| m.layers[2].snapshot = None),
            ("not listed", |m| {
                m.current = 9;
                m.layers[3].snapshot = Some("d".into());
            }),
        ];
        for (want, damage) in cases {
            let mut m = sample();
            damage(&mut m);
            let err = Meta::decode(&m.encode(), p).unwrap_err().to_string();
            assert!(err.contains(want), "{want}: {err}");
        }
    }

    #[test]
    fn round_trip_and_tamper() {
        let p = Path::new("meta.json");
        let m = sample();
        let enc = m.encode();
        assert_eq!(Meta::decode(&enc, p).unwrap(), m);
        let s = String::from_utf8(enc.clone()).unwrap();
        let tampered = s.replace("12345", "12346");
        let err = Meta::decode(tampered.as_bytes(), p)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("meta.json") && err.contains("checksum"),
            "{err}"
        );
        // (cutting only the trailing newline leaves the same JSON)
        for cut in [2, 3, 10, enc.len() / 2] {
            assert!(
                Meta::decode(&enc[..enc.len() - cut], p).is_err(),
                "cut {cut}"
            );
        }
    }
}

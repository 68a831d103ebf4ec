//! `meta.json`: the overlay's manifest (image parameters, base version, layer stack).
//!
//! The file is a JSON object `{"blake3":"<hex>","body":{...}}` where the hash is BLAKE3 of
//! the compact JSON serialization of `body` exactly as written. On read the body is parsed
//! into [`Meta`], serialized again and hashed: any edit, truncation or bit flip fails the
//! check (serialization of these plain types is deterministic).

use std::collections::HashSet;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::OverlayError;

pub(crate) const FORMAT: &str = "cairn-overlay";
pub(crate) const VERSION: u32 = 1;

/// One layer of the stack as recorded in the manifest.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub(crate) struct LayerMeta {
    pub id: u64,
    /// Snapshot name of a frozen layer; `None` for the writable top layer.
    pub snapshot: Option<String>,
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
    /// Bottom (oldest) first; the last one is the writable top layer.
    pub layers: Vec<LayerMeta>,
}

#[derive(Serialize)]
struct EnvelopeOut<'a> {
    blake3: String,
    body: &'a Meta,
}

#[derive(Deserialize)]
struct EnvelopeIn {
    blake3: String,
    body: Meta,
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
        let env: EnvelopeIn = serde_json::from_slice(bytes).map_err(|e| {
            OverlayError::corrupt(path, format!("unreadable (truncated or corrupted): {e}"))
        })?;
        let body = serde_json::to_vec(&env.body).expect("meta serializes");
        if blake3::hash(&body).to_hex().as_str() != env.blake3 {
            return Err(OverlayError::corrupt(
                path,
                "checksum mismatch (edited or corrupted)",
            ));
        }
        let m = env.body;
        m.validate().map_err(|r| OverlayError::corrupt(path, r))?;
        Ok(m)
    }

    fn validate(&self) -> Result<(), String> {
        if self.format != FORMAT {
            return Err(format!("format is {:?}, expected {FORMAT:?}", self.format));
        }
        if self.version != VERSION {
            return Err(format!("unsupported format version {}", self.version));
        }
        let Some(top) = self.layers.last() else {
            return Err("no layers".into());
        };
        if top.snapshot.is_some() {
            return Err("the top layer has a snapshot name".into());
        }
        let mut ids = HashSet::new();
        let mut names = HashSet::new();
        for (i, l) in self.layers.iter().enumerate() {
            if l.id >= self.next_layer_id || !ids.insert(l.id) {
                return Err(format!("bad or duplicate layer id {}", l.id));
            }
            if i + 1 < self.layers.len() {
                match &l.snapshot {
                    None => return Err(format!("frozen layer {} has no snapshot name", l.id)),
                    Some(n) if !names.insert(n.as_str()) => {
                        return Err(format!("duplicate snapshot name {n:?}"))
                    }
                    Some(_) => {}
                }
            }
        }
        if self.layers.len() > crate::MAX_LAYERS {
            return Err(format!(
                "{} layers (max {})",
                self.layers.len(),
                crate::MAX_LAYERS
            ));
        }
        Ok(())
    }
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
            next_layer_id: 3,
            layers: vec![
                LayerMeta {
                    id: 0,
                    snapshot: Some("a\tb".into()),
                },
                LayerMeta {
                    id: 2,
                    snapshot: None,
                },
            ],
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

//! Content identifiers: 32-byte BLAKE3 digests.
//!
//! One type names chunks, manifest nodes, packs, index files and versions; what an id refers
//! to is always clear from where it is stored. The all-zero id is reserved as "nothing"
//! (an absent parent, an all-zero subtree): no BLAKE3 output is expected to be all zeros.

use std::fmt;
use std::str::FromStr;

use crate::{FormatError, FormatResult};

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Id(pub [u8; 32]);

impl Id {
    /// The reserved "nothing" id.
    pub const ZERO: Id = Id([0; 32]);

    /// BLAKE3 of `data`.
    pub fn of(data: &[u8]) -> Id {
        Id(*blake3::hash(data).as_bytes())
    }

    pub fn is_zero(&self) -> bool {
        self.0 == [0; 32]
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.0)
    }

    /// The first `n` hex digits, for display.
    pub fn short(&self) -> String {
        let mut s = self.to_hex();
        s.truncate(12);
        s
    }

    /// A few bits of the id for sharding maps and choosing directories.
    pub fn prefix_u64(&self) -> u64 {
        u64::from_le_bytes(self.0[..8].try_into().expect("8 bytes"))
    }
}

impl fmt::Debug for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Id({})", self.short())
    }
}

impl fmt::Display for Id {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl FromStr for Id {
    type Err = FormatError;
    fn from_str(s: &str) -> FormatResult<Id> {
        let mut out = [0u8; 32];
        hex::decode_to_slice(s, &mut out)
            .map_err(|_| FormatError::invalid("id", format!("{s:?} is not 64 hex digits")))?;
        Ok(Id(out))
    }
}

/// Whether `s` is a plausible hex prefix of an id (1..=64 lowercase/uppercase hex digits).
pub fn is_hex_prefix(s: &str) -> bool {
    !s.is_empty() && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trip() {
        let id = Id::of(b"hello");
        let parsed: Id = id.to_hex().parse().unwrap();
        assert_eq!(parsed, id);
        assert_eq!(id.short().len(), 12);
        assert!("xyz".parse::<Id>().is_err());
        assert!(is_hex_prefix("abc0"));
        assert!(!is_hex_prefix("abg"));
    }
}

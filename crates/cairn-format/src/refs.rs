//! Refs: the only mutable state. A ref names one version id and changes by compare-and-swap.
//!
//! Ref keys (in the store's ref namespace): `heads/<escaped image>` for an image's newest
//! version. Content: envelope "CRNREF\0\0" around the 32-byte version id.

use crate::envelope;
use crate::name::escape;
use crate::{FormatError, FormatResult, Id};

pub const MAGIC: &[u8; 8] = b"CRNREF\0\0";
pub const HEADS_PREFIX: &str = "heads/";

pub fn head_key(image: &str) -> String {
    format!("{HEADS_PREFIX}{}", escape(image))
}

pub fn encode(target: &Id) -> Vec<u8> {
    envelope::seal(MAGIC, target.as_bytes())
}

pub fn decode(data: &[u8]) -> FormatResult<Id> {
    let payload = envelope::open(MAGIC, data, "ref")?;
    let bytes: [u8; 32] = payload.try_into().map_err(|_| {
        FormatError::invalid(
            "ref",
            format!("payload of {} bytes, expected 32", payload.len()),
        )
    })?;
    Ok(Id(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip() {
        let id = Id::of(b"v");
        assert_eq!(decode(&encode(&id)).unwrap(), id);
        assert_eq!(head_key("web01/disk0"), "heads/web01%2Fdisk0");
    }
}

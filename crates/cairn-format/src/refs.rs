//! Refs: the only mutable state. A ref names one version id and changes by compare-and-swap.
//!
//! Ref keys (in the store's ref namespace): `heads/<escaped image>` for an image's newest
//! version. Content: envelope "CRNREF\0\0" around the 32-byte version id.

use crate::envelope;
use crate::{FormatError, FormatResult, Id};

pub const MAGIC: &[u8; 8] = b"CRNREF\0\0";
/// Checks a tag name: 1..=80 bytes of `[A-Za-z0-9._+-]`, not only digits (those name
/// sequence numbers), not starting with '.'.
pub fn validate_tag_name(tag: &str) -> FormatResult<()> {
    let bad = |reason: &str| {
        Err(FormatError::invalid(
            "tag name",
            format!("{tag:?}: {reason}"),
        ))
    };
    if tag.is_empty() || tag.len() > 80 {
        return bad("must be 1 to 80 bytes");
    }
    if !tag
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'+' | b'-'))
    {
        return bad("use letters, digits, . _ + and -");
    }
    if tag.bytes().all(|b| b.is_ascii_digit()) {
        return bad("a tag of only digits would be read as a version number");
    }
    if tag.starts_with('.') {
        return bad("must not start with '.'");
    }
    Ok(())
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
    use crate::keys;

    #[test]
    fn round_trip() {
        let id = Id::of(b"v");
        assert_eq!(decode(&encode(&id)).unwrap(), id);
        assert_eq!(keys::head("web01/disk0"), "heads/web01%2Fdisk0");
        // `+` is allowed in tags but not in keys: it is percent-encoded, and decoded back.
        let key = keys::tag("vm", "v1+build.2");
        assert_eq!(key, "tags/vm/v1%2Bbuild.2");
        assert_eq!(keys::tag_from_key(&key), "v1+build.2");
        validate_tag_name(&"+".repeat(80)).unwrap(); // 240 bytes encoded: fits a file name
        assert!(validate_tag_name(&"a".repeat(81)).is_err());
    }
}

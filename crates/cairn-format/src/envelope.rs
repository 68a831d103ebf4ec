//! The envelope around every standalone metadata object (config, index, version, ref).
//!
//! ```text
//! offset  size  field
//! 0       8     magic (ASCII, identifies the structure)
//! 8       4     format version (u32 LE)
//! 12      4     payload length N (u32 LE)
//! 16      N     payload
//! 16+N    32    BLAKE3 of bytes 0 .. 16+N
//! ```
//! The checksum is verified before the payload is parsed, and the length must match the
//! object exactly, so truncation, bit flips and trailing garbage are all detected.

use crate::{FormatError, FormatResult, FORMAT_VERSION};

pub const HEADER_LEN: usize = 16;
pub const CHECKSUM_LEN: usize = 32;

/// Wraps `payload` in an envelope with `magic`, at format version 1 (every envelope but a
/// format 2 repository's config: see [`seal_version`]).
pub fn seal(magic: &[u8; 8], payload: &[u8]) -> Vec<u8> {
    seal_version(magic, FORMAT_VERSION, payload)
}

/// Wraps `payload` in an envelope with `magic` at format version `version` (the config of a
/// format 2 repository carries 2, so that a reader knowing only format 1 refuses it).
pub fn seal_version(magic: &[u8; 8], version: u32, payload: &[u8]) -> Vec<u8> {
    let len = u32::try_from(payload.len()).expect("metadata object larger than 4 GiB");
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len() + CHECKSUM_LEN);
    out.extend_from_slice(magic);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(payload);
    let sum = blake3::hash(&out);
    out.extend_from_slice(sum.as_bytes());
    out
}

/// Checks an envelope of format version 1 and returns its payload.
pub fn open<'a>(magic: &[u8; 8], data: &'a [u8], what: &'static str) -> FormatResult<&'a [u8]> {
    open_version(magic, data, what, FORMAT_VERSION).map(|(_, payload)| payload)
}

/// Checks an envelope of a format version up to `newest` and returns the version and the
/// payload.
pub fn open_version<'a>(
    magic: &[u8; 8],
    data: &'a [u8],
    what: &'static str,
    newest: u32,
) -> FormatResult<(u32, &'a [u8])> {
    if data.len() < HEADER_LEN + CHECKSUM_LEN {
        return Err(FormatError::Truncated {
            what,
            needed: (HEADER_LEN + CHECKSUM_LEN) as u64,
            available: data.len() as u64,
        });
    }
    if &data[..8] != magic {
        return Err(FormatError::BadMagic { what });
    }
    let len = u32::from_le_bytes(data[12..16].try_into().expect("4")) as usize;
    let total = HEADER_LEN + len + CHECKSUM_LEN;
    if data.len() < total {
        return Err(FormatError::Truncated {
            what,
            needed: total as u64,
            available: data.len() as u64,
        });
    }
    if data.len() > total {
        return Err(FormatError::invalid(
            what,
            format!("{} bytes after the end of the object", data.len() - total),
        ));
    }
    let body = &data[..HEADER_LEN + len];
    if blake3::hash(body).as_bytes() != &data[HEADER_LEN + len..] {
        return Err(FormatError::Checksum { what });
    }
    let version = u32::from_le_bytes(data[8..12].try_into().expect("4"));
    if version > newest {
        return Err(FormatError::TooNew {
            what,
            found: version,
            supported: newest,
        });
    }
    if version == 0 {
        return Err(FormatError::invalid(what, "format version 0"));
    }
    Ok((version, &data[HEADER_LEN..HEADER_LEN + len]))
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: &[u8; 8] = b"CRNTEST\0";

    #[test]
    fn round_trip_and_every_corruption_is_caught() {
        let sealed = seal(M, b"payload bytes");
        assert_eq!(open(M, &sealed, "test").unwrap(), b"payload bytes");
        for i in 0..sealed.len() {
            let mut bad = sealed.clone();
            bad[i] ^= 0x40;
            assert!(open(M, &bad, "test").is_err(), "flip at {i} not detected");
        }
        for n in 0..sealed.len() {
            assert!(
                open(M, &sealed[..n], "test").is_err(),
                "truncation to {n} not detected"
            );
        }
        let mut long = sealed.clone();
        long.push(0);
        assert!(open(M, &long, "test").is_err());
        assert_eq!(
            open(b"CRNOTHER", &sealed, "test"),
            Err(FormatError::BadMagic { what: "test" })
        );
    }

    #[test]
    fn newer_version_is_refused_clearly() {
        let mut raw = Vec::new();
        raw.extend_from_slice(M);
        raw.extend_from_slice(&(FORMAT_VERSION + 1).to_le_bytes());
        raw.extend_from_slice(&0u32.to_le_bytes());
        let sum = blake3::hash(&raw);
        raw.extend_from_slice(sum.as_bytes());
        let err = open(M, &raw, "config").unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "config: format version {} is newer than this cairn supports ({}); upgrade cairn",
                FORMAT_VERSION + 1,
                FORMAT_VERSION
            )
        );
    }
}

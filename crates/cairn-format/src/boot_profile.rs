//! The stored form of an image's boot profile, ref `profiles/<escaped image>` (since
//! 2026-12-04; earlier builds never read the prefix).
//!
//! ```text
//! envelope "CRNBPRF\0" (format version 1) around:
//!   plain repository:      zstd frame of the profile's JSON
//!   encrypted repository:  that frame sealed as domain 12 (BootProfile)
//! ```
//! The JSON is the file `cairn export --record-profile` writes (`cairn_boot_profile`: 1, the
//! image, its size, the reads); this module only moves its bytes. A ref, not an object: each
//! recording replaces the last whole, and nothing is left behind to collect.

use crate::crypto::{open_if_sealed, CryptoError, Domain, MasterKey};
use crate::{envelope, FormatError};

const MAGIC: &[u8; 8] = b"CRNBPRF\0";
/// The largest profile JSON read back (a profile holds at most 1 GiB of reads; at one 4 KiB
/// read per ~25 bytes of JSON that is 6.5 MiB).
pub const MAX_JSON: usize = 64 << 20;
const WHAT: &str = "boot profile";

/// The ref's bytes for a profile's `json` (sealed under `key` when given).
pub fn encode(json: &[u8], key: Option<&MasterKey>) -> Vec<u8> {
    let frame = zstd::bulk::compress(json, 3).expect("zstd compresses in memory");
    let payload = match key {
        Some(k) => k.seal(Domain::BootProfile, &frame),
        None => frame,
    };
    envelope::seal(MAGIC, &payload)
}

/// The profile's JSON from the ref's bytes, checked (checksum, seal) and bounded.
pub fn decode(data: &[u8], key: Option<&MasterKey>) -> Result<Vec<u8>, CryptoError> {
    let payload = envelope::open(MAGIC, data, WHAT)?;
    let frame = open_if_sealed(key.is_some(), key, Domain::BootProfile, WHAT, payload)?;
    let json = zstd::bulk::decompress(&frame, MAX_JSON)
        .map_err(|e| FormatError::invalid(WHAT, format!("does not decompress: {e}")))?;
    Ok(json)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_profile_round_trips_plain_and_sealed_and_damage_is_an_error() {
        let json = br#"{"cairn_boot_profile":1,"image":"a","size":4096,"reads":[[0,512]]}"#;
        let plain = encode(json, None);
        assert_eq!(decode(&plain, None).unwrap(), json);

        let key = MasterKey::generate();
        let sealed = encode(json, Some(&key));
        assert_eq!(decode(&sealed, Some(&key)).unwrap(), json);
        assert!(!sealed.windows(5).any(|w| w == b"image"));
        // Another key, or no key, does not open it.
        assert!(matches!(
            decode(&sealed, Some(&MasterKey::generate())),
            Err(CryptoError::Tampered { .. })
        ));
        assert!(decode(&sealed, None).is_err());

        for i in 0..plain.len() {
            let mut bad = plain.clone();
            bad[i] ^= 0x40;
            assert!(decode(&bad, None).is_err(), "flip at {i}");
        }
        for n in 0..plain.len() {
            assert!(decode(&plain[..n], None).is_err(), "cut at {n}");
        }
    }

    #[test]
    fn a_frame_that_inflates_past_the_limit_is_refused() {
        let big = vec![b' '; MAX_JSON + 1];
        let stored = encode(&big, None);
        assert!(decode(&stored, None).is_err());
    }
}

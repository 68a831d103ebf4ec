//! Image names: what users may call an image, and how a name maps to a storage key.
//!
//! Names look like paths (`web01/disk0`) because operators organise disks by VM, but they are
//! never used as paths: each name is percent-encoded into a single key segment, so no name can
//! reach outside its place in the store.

use crate::{FormatError, FormatResult};

pub const MAX_NAME_LEN: usize = 200;

/// Longest encoded name ([`escape`]): one file name on the file systems a local repository
/// lives on (`NAME_MAX` is 255 bytes on ext4, XFS, btrfs and tmpfs). Checked up front, so a
/// commit never writes its data and then fails at the ref.
pub const MAX_ENCODED_NAME_LEN: usize = 255;

/// A name as error messages show it: in full when short, else its start and its length, so
/// a 10 KB name does not flood the terminal.
pub fn shown(name: &str) -> String {
    const KEEP: usize = 48;
    if name.chars().count() <= KEEP + 16 {
        return format!("{name:?}");
    }
    let head: String = name.chars().take(KEEP).collect();
    format!("{head:?}… ({} bytes)", name.len())
}

/// Checks an image name: 1..=200 bytes of `[A-Za-z0-9._+-]` in `/`-separated components, no
/// empty, `.` or `..` component. `@` is not allowed (it separates an image from a ref).
pub fn validate_image_name(name: &str) -> FormatResult<()> {
    let bad = |reason: &str| {
        Err(FormatError::Invalid {
            what: "image name",
            reason: format!("{}: {reason}", shown(name)),
        })
    };
    if name.is_empty() {
        return bad("must not be empty");
    }
    if name.len() > MAX_NAME_LEN {
        return bad("longer than 200 bytes");
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '+' | '-' | '/')))
    {
        return if c.is_control() {
            bad("control characters are not allowed")
        } else {
            bad(&format!(
                "character {c:?} is not allowed (use letters, digits, . _ + - and /)"
            ))
        };
    }
    for comp in name.split('/') {
        match comp {
            "" => return bad("empty path component (leading, trailing or double '/')"),
            "." | ".." => return bad("'.' and '..' are not allowed as path components"),
            _ => {}
        }
    }
    let encoded = escaped_len(name);
    if encoded > MAX_ENCODED_NAME_LEN {
        return bad(&format!(
            "{encoded} bytes once encoded for storage, at most {MAX_ENCODED_NAME_LEN} \
             ('+' and '/' take 3 bytes each, other characters 1)"
        ));
    }
    Ok(())
}

/// Length of [`escape`]`(name)` without building it.
fn escaped_len(name: &str) -> usize {
    name.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') {
                1
            } else {
                3
            }
        })
        .sum()
}

/// Percent-encodes a valid image name into one key segment (`web01/disk0` → `web01%2Fdisk0`).
pub fn escape(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 8);
    for b in name.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Inverse of [`escape`] for an image name (checked to be valid).
pub fn unescape(seg: &str) -> FormatResult<String> {
    let name = unescape_segment(seg)?;
    validate_image_name(&name)?;
    Ok(name)
}

/// Inverse of [`escape`], without checking what the name is for.
pub fn unescape_segment(seg: &str) -> FormatResult<String> {
    let bytes = seg.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = seg
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    FormatError::invalid("image key", format!("bad escape in {seg:?}"))
                })?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| FormatError::invalid("image key", "not UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_and_rejects() {
        for ok in ["a", "web01/disk0", "vm-1.2_x+y", "a/b/c"] {
            validate_image_name(ok).unwrap();
            assert_eq!(unescape(&escape(ok)).unwrap(), ok);
        }
        for bad in [
            "", "/a", "a/", "a//b", "../evil", "a/../b", "./a", "a\nb", "a b", "a@1", "é",
        ] {
            assert!(validate_image_name(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(escape("web01/disk0"), "web01%2Fdisk0");
        // 200 bytes is a valid length, but 200 '+' characters encode to 600 bytes: refused
        // before anything is written, naming the encoded length.
        let pluses = "+".repeat(200);
        assert_eq!(
            validate_image_name(&pluses).unwrap_err().to_string(),
            format!(
                "image name: {:?}… (200 bytes): 600 bytes once encoded for storage, at most 255 \
                 ('+' and '/' take 3 bytes each, other characters 1)",
                "+".repeat(48)
            )
        );
        let slashes = vec!["a"; 100].join("/");
        assert!(
            validate_image_name(&slashes).is_err(),
            "199 bytes, 495 encoded"
        );
        let just_fits = format!("{}{}", "a".repeat(195), "+".repeat(20));
        assert_eq!(escape(&just_fits).len(), 255);
        assert_eq!(just_fits.len(), 215);
        assert!(validate_image_name(&just_fits).is_err(), "over 200 bytes");
        let fits = format!("{}{}", "a".repeat(150), "/b".repeat(25));
        assert_eq!(escaped_len(&fits), escape(&fits).len());
        validate_image_name(&fits).unwrap();
        // A 10 KB name is shown by its start and length only.
        let long = "x".repeat(10_000);
        let msg = validate_image_name(&long).unwrap_err().to_string();
        assert!(msg.len() < 120, "{msg}");
        assert!(msg.contains("(10000 bytes)"), "{msg}");
        assert_eq!(
            validate_image_name("../evil").unwrap_err().to_string(),
            "image name: \"../evil\": '.' and '..' are not allowed as path components"
        );
    }
}

//! Image names: what users may call an image, and how a name maps to a storage key.
//!
//! Names look like paths (`web01/disk0`) because operators organise disks by VM, but they are
//! never used as paths: each name is percent-encoded into a single key segment, so no name can
//! reach outside its place in the store.

use crate::{FormatError, FormatResult};

pub const MAX_NAME_LEN: usize = 200;

/// Checks an image name: 1..=200 bytes of `[A-Za-z0-9._+-]` in `/`-separated components, no
/// empty, `.` or `..` component. `@` is not allowed (it separates an image from a ref).
pub fn validate_image_name(name: &str) -> FormatResult<()> {
    let bad = |reason: &str| {
        Err(FormatError::Invalid {
            what: "image name",
            reason: format!("{name:?}: {reason}"),
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
    Ok(())
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

/// Inverse of [`escape`].
pub fn unescape(seg: &str) -> FormatResult<String> {
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
    let name =
        String::from_utf8(out).map_err(|_| FormatError::invalid("image key", "not UTF-8"))?;
    validate_image_name(&name)?;
    Ok(name)
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
        assert_eq!(
            validate_image_name("../evil").unwrap_err().to_string(),
            "image name: \"../evil\": '.' and '..' are not allowed as path components"
        );
    }
}

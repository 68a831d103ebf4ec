//! Key syntax shared by every backend.
//!
//! The rules are the intersection of what a POSIX directory tree and an S3 bucket can both
//! hold without escaping, so a repository can be copied between backends byte for byte.

use crate::{StoreError, StoreResult};

/// Longest key accepted, in bytes (S3's limit is 1024 bytes too).
pub const MAX_KEY_LEN: usize = 1024;

/// Name prefix of the local store's temporary files; a segment may not start with it, so a
/// half-written temp file can never be mistaken for an object.
pub const TEMP_PREFIX: &str = ".tmp-";

/// Name of the local store's ref lock file, relative to the ref namespace.
pub(crate) const REF_LOCK_NAME: &str = ".lock";

/// First segment reserved for refs; objects may not use it.
pub const REFS_SEGMENT: &str = "refs";

fn invalid(key: &str, reason: &'static str) -> StoreError {
    StoreError::InvalidKey {
        key: key.to_owned(),
        reason,
    }
}

fn check_chars(key: &str) -> StoreResult<()> {
    if key.len() > MAX_KEY_LEN {
        return Err(invalid(key, "longer than 1024 bytes"));
    }
    let ok = key
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'%' | b'-' | b'/'));
    if ok {
        Ok(())
    } else {
        Err(invalid(key, "only [A-Za-z0-9._%-] and '/' are allowed"))
    }
}

/// A complete path segment: what a directory or file name may be.
fn check_segment(key: &str, segment: &str) -> StoreResult<()> {
    match segment {
        "" => Err(invalid(
            key,
            "empty segment (leading, trailing or doubled '/')",
        )),
        "." | ".." => Err(invalid(key, "'.' and '..' segments are not allowed")),
        s if s.starts_with(TEMP_PREFIX) => Err(invalid(
            key,
            "segments starting with \".tmp-\" are reserved for temporary files",
        )),
        _ => Ok(()),
    }
}

/// Check that `key` is a valid key: non-empty, at most 1024 bytes, `/`-separated segments of
/// `[A-Za-z0-9._%-]`, no empty, `.` or `..` segment, and no segment starting with `.tmp-`
/// (reserved for the local store's temporary files).
///
/// Every backend calls this before touching storage, so a key that works on one works on all.
pub fn validate_key(key: &str) -> StoreResult<()> {
    if key.is_empty() {
        return Err(invalid(key, "empty key"));
    }
    check_chars(key)?;
    key.split('/').try_for_each(|s| check_segment(key, s))
}

/// [`validate_key`], plus: the first segment may not be `refs`, because refs have their own
/// namespace and an object there would shadow (or be shadowed by) a ref on some backends.
pub fn validate_object_key(key: &str) -> StoreResult<()> {
    validate_key(key)?;
    if key.split('/').next() == Some(REFS_SEGMENT) {
        return Err(invalid(key, "keys under \"refs/\" are refs, not objects"));
    }
    Ok(())
}

/// [`validate_key`], plus: not the name of the local store's lock file.
pub fn validate_ref_key(key: &str) -> StoreResult<()> {
    validate_key(key)?;
    if key == REF_LOCK_NAME {
        return Err(invalid(key, "\".lock\" is reserved for the ref lock"));
    }
    Ok(())
}

/// Check a listing prefix. Leniently: it may be empty, end with `/`, or stop in the middle of
/// a segment, but every *complete* segment (one followed by `/`) must be a valid segment, so
/// a prefix can never climb out of the store with `..`.
pub fn validate_prefix(prefix: &str) -> StoreResult<()> {
    check_chars(prefix)?;
    let mut segments: Vec<&str> = prefix.split('/').collect();
    let partial = segments.pop().unwrap_or("");
    if partial == ".." {
        return Err(invalid(prefix, "'.' and '..' segments are not allowed"));
    }
    segments.iter().try_for_each(|s| check_segment(prefix, s))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_ordinary_keys() {
        for k in [
            "a",
            "packs/ab/abcdef.pack",
            "config",
            "x/y.z/%41-_",
            ".hidden",
            "a..b",
        ] {
            validate_key(k).unwrap_or_else(|e| panic!("{k}: {e}"));
            validate_object_key(k).unwrap();
        }
        validate_key(&"a".repeat(MAX_KEY_LEN)).unwrap();
        validate_key("refs/heads/x").unwrap();
        validate_ref_key("refs/heads/x").unwrap();
    }

    #[test]
    fn rejects_bad_keys() {
        let long = "a".repeat(MAX_KEY_LEN + 1);
        for k in [
            "",
            "/a",
            "a/",
            "a//b",
            "a/../b",
            "a/./b",
            "..",
            ".",
            "a\nb",
            "a b",
            "é",
            "a\\b",
            ".tmp-1",
            "a/.tmp-x/b",
            &long,
        ] {
            assert!(
                matches!(validate_key(k), Err(StoreError::InvalidKey { .. })),
                "{k:?} accepted"
            );
        }
        assert!(validate_object_key("refs/x").is_err());
        assert!(validate_object_key("refs").is_err());
        assert!(validate_object_key("refsx/y").is_ok());
        assert!(validate_ref_key(".lock").is_err());
        assert!(validate_ref_key("a/.lock").is_ok());
    }

    #[test]
    fn prefixes_are_lenient_but_safe() {
        for p in ["", "a", "a/", "packs/ab", "a/.", "a/.t", "refs/"] {
            validate_prefix(p).unwrap_or_else(|e| panic!("{p}: {e}"));
        }
        for p in [
            "/", "/a", "a//", "../", "a/../b", "..", "a/..", "a b", "a/./",
        ] {
            assert!(validate_prefix(p).is_err(), "{p:?} accepted");
        }
    }
}

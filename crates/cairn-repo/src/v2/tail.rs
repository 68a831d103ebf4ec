//! Reading an object's header and tail without reading it whole: v2 packs and index runs end
//! in a footer that says how long their trailer or meta is. One request asks the length, then
//! the header and a guessed tail go out together; a tail longer than the guess costs one more
//! ranged read.

use std::ops::Range;

use bytes::Bytes;
use cairn_store::ObjectStore;

use crate::error::{RepoError, RepoResult};

/// An object's length, its first bytes and its last bytes.
pub(super) struct HeadAndTail {
    pub len: u64,
    pub head: Bytes,
    /// The bytes from `tail_start` to the end.
    pub tail: Bytes,
    pub tail_start: u64,
}

impl HeadAndTail {
    /// Reads `head_len` bytes from the start and about `guess` from the end of `key`, which
    /// must be at least `min_len` bytes long. `None` if the object does not exist.
    pub async fn read(
        store: &dyn ObjectStore,
        key: &str,
        head_len: usize,
        min_len: usize,
        guess: u64,
    ) -> RepoResult<Option<HeadAndTail>> {
        let Some(len) = store.head(key).await? else {
            return Ok(None);
        };
        if len < min_len as u64 {
            return Err(RepoError::corrupt(
                key,
                cairn_format::FormatError::Truncated {
                    what: "object",
                    needed: min_len as u64,
                    available: len,
                },
            ));
        }
        let tail_start = len.saturating_sub(guess);
        let (head, tail) = if tail_start <= head_len as u64 {
            let all = get_exact(store, key, 0..len).await?;
            (all.slice(..head_len), all)
        } else {
            tokio::try_join!(
                get_exact(store, key, 0..head_len as u64),
                get_exact(store, key, tail_start..len)
            )?
        };
        let tail_start = if tail_start <= head_len as u64 {
            0
        } else {
            tail_start
        };
        Ok(Some(HeadAndTail {
            len,
            head,
            tail,
            tail_start,
        }))
    }

    /// The bytes of `range` (which must end at or before the object's end): from the tail if
    /// it holds them, else read.
    pub async fn bytes(
        &self,
        store: &dyn ObjectStore,
        key: &str,
        range: Range<u64>,
    ) -> RepoResult<Bytes> {
        if range.start >= self.tail_start {
            let at = (range.start - self.tail_start) as usize;
            return Ok(self.tail.slice(at..at + (range.end - range.start) as usize));
        }
        get_exact(store, key, range).await
    }
}

/// Object `key` whole, or `None` if it does not exist (what a whole check reads).
pub(super) async fn get_whole(store: &dyn ObjectStore, key: &str) -> RepoResult<Option<Bytes>> {
    match store.get(key).await {
        Ok(data) => Ok(Some(data)),
        Err(e) => match RepoError::from(e) {
            e if e.is_not_found() => Ok(None),
            e => Err(e),
        },
    }
}

/// A ranged read that must return exactly the range (a short read is damage: the object is
/// shorter than its own footer says, or changed under us).
pub(super) async fn get_exact(
    store: &dyn ObjectStore,
    key: &str,
    range: Range<u64>,
) -> RepoResult<Bytes> {
    let want = range.end - range.start;
    let bytes = store.get_range(key, range.clone()).await?;
    if bytes.len() as u64 != want {
        return Err(RepoError::corrupt(
            key,
            cairn_format::FormatError::invalid(
                "object",
                format!("short read of bytes {range:?}: {} bytes", bytes.len()),
            ),
        ));
    }
    Ok(bytes)
}

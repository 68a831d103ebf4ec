//! A cairn repository in an S3-compatible bucket, through the `object_store` crate.
//!
//! Layout under `s3://BUCKET/PREFIX/`: objects at `PREFIX/<key>`, refs at
//! `PREFIX/refs/<key>` (object keys may not start with `refs/`, so the two never meet).
//!
//! - `put_if_absent` is a PUT with `If-None-Match: *` (`PutMode::Create`).
//! - `cas_ref` creates with `If-None-Match: *` and updates with `If-Match: <ETag>`
//!   (`PutMode::Update`); a ref's [`RefVersion`] is its ETag.
//! - Deleting a ref: S3 has no portable conditional DELETE, so a ref is deleted by
//!   CAS-writing a *tombstone* — an empty object — over the expected version. Readers treat an
//!   empty ref object as absent (`read_ref` returns `None`, `list_refs` skips it, `cas_ref`
//!   with `expected = None` overwrites it with `If-Match` on the tombstone's ETag). Hence an
//!   empty ref *value* cannot be stored here and is refused. A tombstone is removed only under
//!   prefixes whose keys are never reused (`forget_deleted_refs`: sessions, whose keys are
//!   random) — elsewhere removing one unconditionally could erase a ref re-created meanwhile,
//!   so those stay, one empty object each.
//! - Before its first write the store checks once that the server honours conditional
//!   writes (a second create must fail, an `If-Match` on a wrong ETag must fail) and refuses
//!   to write at all if not, rather than risk a lost update.
//!
//! Configuration comes from the URL query (`endpoint`, `region`, `path_style`) and from the
//! standard environment (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`,
//! `AWS_ENDPOINT_URL`, `AWS_REGION`, ...); credentials are never accepted in the URL and never
//! appear in [`ObjectStore::describe`] or in errors.
#![forbid(unsafe_code)]

mod conditional;
mod config;
mod error_text;

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use cairn_store::{
    validate_object_key, validate_prefix, validate_ref_key, CasOutcome, ObjectMeta, ObjectStore,
    PutOutcome, RefState, RefVersion, StoreError, StoreHints, StoreResult, REFS_SEGMENT,
    TEMP_PREFIX,
};
use futures_util::TryStreamExt;
use object_store::aws::{AmazonS3, AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path;
use object_store::{
    ClientOptions, GetOptions, ObjectStore as _, ObjectStoreExt as _, PutMode, PutOptions,
    RetryConfig,
};
use tokio::sync::{OnceCell, Semaphore};

use conditional::IfMatchStyle;
pub use config::S3Config;
use error_text::{is_transport_error, one_line, tidy_reason, unreachable_reason};

/// ETag of an empty object (MD5 of nothing): the version of every tombstone.
/// How long [`ObjectStore::check_reachable`] tries before it reports the store unreachable.
const PROBE_BUDGET: Duration = Duration::from_secs(10);

const EMPTY_ETAG: &str = "d41d8cd98f00b204e9800998ecf8427e";

/// How many times `cas_ref` re-reads and retries when a tombstone changes under it.
const CAS_ATTEMPTS: usize = 64;

/// An [`ObjectStore`] on an S3-compatible bucket. Cheap to clone.
#[derive(Clone)]
pub struct S3Store {
    inner: Arc<Inner>,
}

struct Inner {
    config: S3Config,
    client: AmazonS3,
    /// The same store with a retry budget of seconds, for [`ObjectStore::check_reachable`].
    probe: AmazonS3,
    /// Bounds requests in flight.
    permits: Semaphore,
    /// Result of the one-time conditional-write check (`Err` holds the reason).
    conditional: OnceCell<Result<IfMatchStyle, String>>,
    /// Strings that must never appear in an error message (the secret key, the token).
    secrets: Vec<String>,
}

impl fmt::Debug for S3Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "S3Store({})", self.describe())
    }
}

impl S3Store {
    /// Open `s3://BUCKET/PREFIX?...` with credentials from the environment. Makes no request.
    pub fn open(url: &str) -> StoreResult<Self> {
        Self::with_config(S3Config::parse(url)?)
    }

    /// Open with an explicit configuration (credentials still from the environment).
    pub fn with_config(config: S3Config) -> StoreResult<Self> {
        let mut builder = AmazonS3Builder::from_env().with_bucket_name(&config.bucket);
        if std::env::var_os("AWS_REGION").is_none()
            && std::env::var_os("AWS_DEFAULT_REGION").is_none()
        {
            builder = builder.with_region("us-east-1");
        }
        if let Some(region) = &config.region {
            builder = builder.with_region(region);
        }
        if let Some(endpoint) = &config.endpoint {
            builder = builder.with_endpoint(endpoint);
        }
        if let Some(path_style) = config.path_style {
            builder = builder.with_virtual_hosted_style_request(!path_style);
        }
        let secrets: Vec<String> = [AmazonS3ConfigKey::SecretAccessKey, AmazonS3ConfigKey::Token]
            .iter()
            .filter_map(|k| builder.get_config_value(k))
            .filter(|s| s.len() >= 4)
            .collect();
        let build = |retry: RetryConfig, connect: Duration, timeout: Duration| {
            // Client options first: they replace allow_http as a whole.
            let mut b = builder.clone().with_retry(retry).with_client_options(
                ClientOptions::new()
                    .with_connect_timeout(connect)
                    .with_timeout(timeout),
            );
            let endpoint = b
                .get_config_value(&AmazonS3ConfigKey::Endpoint)
                .unwrap_or_default();
            if endpoint.starts_with("http://") {
                b = b.with_allow_http(true);
            }
            b.build().map_err(|e| StoreError::Remote {
                op: "open",
                location: config.describe(),
                reason: one_line(&e.to_string(), &secrets),
            })
        };
        // retry_timeout is the bound that matters; a small count would end an outage's
        // retries within seconds. The count is one retry per initial backoff of the timeout,
        // more than can ever happen, but a number a log line ("retry 3 of 1200") can show.
        let defaults = RetryConfig::default();
        let max_retries = (config.retry_timeout.as_millis()
            / defaults.backoff.init_backoff.as_millis().max(1))
        .clamp(1, 100_000) as usize;
        let retry = RetryConfig {
            max_retries,
            retry_timeout: config.retry_timeout,
            ..defaults
        };
        let client = build(retry, Duration::from_secs(10), config.timeout)?;
        // The reachability check gives up within seconds: a store that never answered is
        // misconfigured far more often than it is in an outage. Enough retries that a
        // throttling server (503 SlowDown) still gets through.
        let probe_retry = RetryConfig {
            max_retries: 7,
            retry_timeout: PROBE_BUDGET.min(config.retry_timeout),
            ..RetryConfig::default()
        };
        let probe = build(
            probe_retry,
            Duration::from_secs(3),
            PROBE_BUDGET.min(config.timeout),
        )?;
        Ok(S3Store {
            inner: Arc::new(Inner {
                permits: Semaphore::new(config.max_requests),
                config,
                client,
                probe,
                conditional: OnceCell::new(),
                secrets,
            }),
        })
    }

    /// The parsed configuration.
    pub fn config(&self) -> &S3Config {
        &self.inner.config
    }

    fn object_path(&self, key: &str) -> Path {
        self.path(key)
    }

    fn ref_path(&self, key: &str) -> Path {
        self.path(&format!("{REFS_SEGMENT}/{key}"))
    }

    /// Bucket-relative path of a (validated) store key.
    fn path(&self, key: &str) -> Path {
        let full = if self.inner.config.prefix.is_empty() {
            key.to_owned()
        } else {
            format!("{}/{key}", self.inner.config.prefix)
        };
        // Validated keys contain no control characters, '.'/'..' or empty segments, which is
        // all `Path::parse` rejects; `from` would percent-encode '%' and change the key.
        Path::parse(&full).unwrap_or_else(|_| Path::from(full.as_str()))
    }

    /// `s3://bucket/prefix/key` for error messages.
    fn url(&self, path: &Path) -> String {
        format!("s3://{}/{}", self.inner.config.bucket, path.as_ref())
    }

    fn remote(&self, op: &'static str, path: &Path, err: object_store::Error) -> StoreError {
        StoreError::Remote {
            op,
            location: self.url(path),
            reason: one_line(&tidy_reason(&err.to_string()), &self.inner.secrets),
        }
    }

    async fn permit(&self) -> tokio::sync::SemaphorePermit<'_> {
        self.inner
            .permits
            .acquire()
            .await
            .expect("the request semaphore is never closed")
    }

    /// The raw ref object: `(data, etag)`, `None` if there is no object at all.
    async fn read_raw_ref(&self, key: &str) -> StoreResult<Option<(Bytes, String)>> {
        let path = self.ref_path(key);
        let _permit = self.permit().await;
        let result = match self
            .inner
            .client
            .get_opts(&path, GetOptions::default())
            .await
        {
            Ok(r) => r,
            Err(object_store::Error::NotFound { .. }) => return Ok(None),
            Err(e) => return Err(self.remote("read ref", &path, e)),
        };
        let etag = result
            .meta
            .e_tag
            .clone()
            .ok_or_else(|| StoreError::Remote {
                op: "read ref",
                location: self.url(&path),
                reason: "the server sent no ETag, which compare-and-swap needs".into(),
            })?;
        let data = result
            .bytes()
            .await
            .map_err(|e| self.remote("read ref", &path, e))?;
        Ok(Some((data, etag)))
    }

    /// Conditional PUT of a ref object; `Ok(None)` if the precondition failed.
    async fn put_ref(
        &self,
        key: &str,
        data: Bytes,
        mode: PutMode,
    ) -> StoreResult<Option<RefVersion>> {
        let path = self.ref_path(key);
        let _permit = self.permit().await;
        let opts = PutOptions {
            mode,
            ..PutOptions::default()
        };
        match self.inner.client.put_opts(&path, data.into(), opts).await {
            Ok(result) => {
                let etag = result.e_tag.ok_or_else(|| StoreError::Remote {
                    op: "write ref",
                    location: self.url(&path),
                    reason: "the server sent no ETag, which compare-and-swap needs".into(),
                })?;
                Ok(Some(RefVersion(etag)))
            }
            Err(
                object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. }
                | object_store::Error::NotFound { .. },
            ) => Ok(None),
            Err(e) => Err(self.remote("write ref", &path, e)),
        }
    }
}

fn live(raw: Option<(Bytes, String)>) -> Option<RefState> {
    raw.filter(|(data, _)| !data.is_empty())
        .map(|(data, etag)| RefState {
            data,
            version: RefVersion(etag),
        })
}

fn is_tombstone_version(version: &RefVersion) -> bool {
    version.0.trim_matches('"') == EMPTY_ETAG
}

/// Store keys of a listing: strip the store prefix, drop what is not an object of ours.
fn store_key<'a>(prefix: &str, location: &'a str) -> Option<&'a str> {
    let key = if prefix.is_empty() {
        location
    } else {
        location.strip_prefix(prefix)?.strip_prefix('/')?
    };
    // Temporary probes and anything else no valid key could name are not objects.
    if key.split('/').any(|s| s.starts_with(TEMP_PREFIX)) {
        return None;
    }
    Some(key)
}

impl S3Store {
    /// Every (store key, size) under store-relative `prefix`, sorted by key.
    async fn list_raw(&self, prefix: &str) -> StoreResult<Vec<(String, u64)>> {
        // List the enclosing "directory" and filter, so a prefix ending mid-segment works.
        let dir = match prefix.rfind('/') {
            Some(i) => &prefix[..i],
            None => "",
        };
        let dir_path = if dir.is_empty() {
            if self.inner.config.prefix.is_empty() {
                None
            } else {
                Some(Path::parse(&self.inner.config.prefix).unwrap_or_default())
            }
        } else {
            Some(self.path(dir))
        };
        let _permit = self.permit().await;
        let metas: Vec<object_store::ObjectMeta> = self
            .inner
            .client
            .list(dir_path.as_ref())
            .try_collect()
            .await
            .map_err(|e| {
                let p = dir_path.clone().unwrap_or_default();
                self.remote("list", &p, e)
            })?;
        let mut out: Vec<(String, u64)> = metas
            .iter()
            .filter_map(|m| {
                let key = store_key(&self.inner.config.prefix, m.location.as_ref())?;
                key.starts_with(prefix).then(|| (key.to_owned(), m.size))
            })
            .collect();
        out.sort();
        Ok(out)
    }
}

#[async_trait]
impl ObjectStore for S3Store {
    fn hints(&self) -> StoreHints {
        StoreHints::REMOTE
    }

    fn describe(&self) -> String {
        self.inner.config.describe()
    }

    async fn check_reachable(&self) -> StoreResult<()> {
        let prefix = (!self.inner.config.prefix.is_empty()).then(|| self.path("config"));
        let _permit = self.permit().await;
        match self.inner.probe.list_with_delimiter(prefix.as_ref()).await {
            Ok(_) => Ok(()),
            Err(e) => Err(StoreError::Unavailable {
                location: self.inner.config.describe(),
                reason: one_line(
                    &unreachable_reason(&e, &self.inner.config.bucket, PROBE_BUDGET),
                    &self.inner.secrets,
                ),
            }),
        }
    }

    async fn put_if_absent(&self, key: &str, data: Bytes) -> StoreResult<PutOutcome> {
        validate_object_key(key)?;
        self.require_conditional_writes().await?;
        let path = self.object_path(key);
        let _permit = self.permit().await;
        // object_store does not retry a conditional PUT whose connection broke or timed out
        // (it may have landed), so this does, within retry_timeout. If an earlier attempt did
        // land, the retry answers AlreadyExists: callers treat that conservatively (a pack is
        // re-salted and stored again, leaving an orphan for `gc --repair`).
        let deadline = Instant::now() + self.inner.config.retry_timeout;
        let mut backoff = Duration::from_millis(200);
        loop {
            let opts = PutOptions {
                mode: PutMode::Create,
                ..PutOptions::default()
            };
            match self
                .inner
                .client
                .put_opts(&path, data.clone().into(), opts)
                .await
            {
                Ok(_) => return Ok(PutOutcome::Created),
                Err(object_store::Error::AlreadyExists { .. }) => {
                    return Ok(PutOutcome::AlreadyExists)
                }
                Err(e) if is_transport_error(&e) && Instant::now() + backoff < deadline => {
                    tracing::info!(
                        "put {}: {}; retrying in {backoff:?}",
                        self.url(&path),
                        one_line(&e.to_string(), &self.inner.secrets)
                    );
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(10));
                }
                Err(e) => return Err(self.remote("put", &path, e)),
            }
        }
    }

    async fn get(&self, key: &str) -> StoreResult<Bytes> {
        validate_object_key(key)?;
        let path = self.object_path(key);
        let _permit = self.permit().await;
        let result = match self.inner.client.get(&path).await {
            Ok(r) => r,
            Err(object_store::Error::NotFound { .. }) => return Err(not_found(key)),
            Err(e) => return Err(self.remote("get", &path, e)),
        };
        let size = result.meta.size;
        let data = result
            .bytes()
            .await
            .map_err(|e| self.remote("get", &path, e))?;
        if data.len() as u64 != size {
            return Err(StoreError::Remote {
                op: "get",
                location: self.url(&path),
                reason: format!("short read: {} of {size} bytes", data.len()),
            });
        }
        Ok(data)
    }

    async fn get_range(&self, key: &str, range: Range<u64>) -> StoreResult<Bytes> {
        validate_object_key(key)?;
        let out_of_bounds = |size: u64| StoreError::RangeOutOfBounds {
            key: key.to_owned(),
            start: range.start,
            end: range.end,
            size,
        };
        if range.start > range.end {
            let size = self.head(key).await?.ok_or_else(|| not_found(key))?;
            return Err(out_of_bounds(size));
        }
        if range.start == range.end {
            // S3 cannot serve an empty range; the answer only depends on the size.
            let size = self.head(key).await?.ok_or_else(|| not_found(key))?;
            return if range.end <= size {
                Ok(Bytes::new())
            } else {
                Err(out_of_bounds(size))
            };
        }
        let path = self.object_path(key);
        let result = {
            let _permit = self.permit().await;
            let opts = GetOptions::new().with_range(Some(range.clone()));
            match self.inner.client.get_opts(&path, opts).await {
                Ok(result) => {
                    let size = result.meta.size;
                    let got = result.range.clone();
                    match result.bytes().await {
                        Ok(data) => Ok((size, got, data)),
                        Err(e) => Err(e),
                    }
                }
                Err(e) => Err(e),
            }
        };
        match result {
            Ok((size, _, _)) if range.end > size => Err(out_of_bounds(size)),
            Ok((_, got, data)) if got == range && data.len() as u64 == range.end - range.start => {
                Ok(data)
            }
            Ok((_, got, data)) => Err(StoreError::Remote {
                op: "get range of",
                location: self.url(&path),
                reason: format!(
                    "asked for {range:?}, got {got:?} ({} bytes): short read refused",
                    data.len()
                ),
            }),
            Err(object_store::Error::NotFound { .. }) => Err(not_found(key)),
            Err(e) => {
                // A range starting at or past the end is refused by the server (416); tell
                // that apart from other failures by the object's size.
                match self.head(key).await {
                    Ok(Some(size)) if range.end > size => Err(out_of_bounds(size)),
                    Ok(None) => Err(not_found(key)),
                    _ => Err(self.remote("get range of", &path, e)),
                }
            }
        }
    }

    async fn head(&self, key: &str) -> StoreResult<Option<u64>> {
        validate_object_key(key)?;
        let path = self.object_path(key);
        let _permit = self.permit().await;
        match self.inner.client.head(&path).await {
            Ok(meta) => Ok(Some(meta.size)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(self.remote("head", &path, e)),
        }
    }

    async fn list(&self, prefix: &str) -> StoreResult<Vec<ObjectMeta>> {
        validate_prefix(prefix)?;
        let refs = format!("{REFS_SEGMENT}/");
        Ok(self
            .list_raw(prefix)
            .await?
            .into_iter()
            .filter(|(key, _)| !key.starts_with(&refs))
            .map(|(key, size)| ObjectMeta { key, size })
            .collect())
    }

    async fn delete(&self, key: &str) -> StoreResult<()> {
        validate_object_key(key)?;
        let path = self.object_path(key);
        let _permit = self.permit().await;
        match self.inner.client.delete(&path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(self.remote("delete", &path, e)),
        }
    }

    async fn read_ref(&self, key: &str) -> StoreResult<Option<RefState>> {
        validate_ref_key(key)?;
        Ok(live(self.read_raw_ref(key).await?))
    }

    async fn list_refs(&self, prefix: &str) -> StoreResult<Vec<String>> {
        validate_prefix(prefix)?;
        let refs = format!("{REFS_SEGMENT}/");
        Ok(self
            .list_raw(&format!("{refs}{prefix}"))
            .await?
            .into_iter()
            // Empty ref objects are tombstones of deleted refs.
            .filter(|(_, size)| *size > 0)
            .filter_map(|(key, _)| key.strip_prefix(&refs).map(str::to_owned))
            .collect())
    }

    async fn forget_deleted_refs(&self, prefix: &str) -> StoreResult<usize> {
        validate_prefix(prefix)?;
        let refs = format!("{REFS_SEGMENT}/");
        let mut removed = 0;
        for (key, size) in self.list_raw(&format!("{refs}{prefix}")).await? {
            if size > 0 {
                continue;
            }
            // Unconditional: safe only because keys under `prefix` are never reused (the
            // caller's promise), so nobody can have re-created this ref meanwhile.
            let path = self.path(&key);
            let _permit = self.permit().await;
            match self.inner.client.delete(&path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => removed += 1,
                Err(e) => return Err(self.remote("delete", &path, e)),
            }
        }
        Ok(removed)
    }

    async fn cas_ref(
        &self,
        key: &str,
        expected: Option<&RefVersion>,
        new: Option<Bytes>,
    ) -> StoreResult<CasOutcome> {
        validate_ref_key(key)?;
        if new.as_ref().is_some_and(|d| d.is_empty()) {
            return Err(StoreError::Remote {
                op: "cas_ref",
                location: self.url(&self.ref_path(key)),
                reason: "an S3 store cannot hold an empty ref value (an empty object marks a \
                         deleted ref)"
                    .into(),
            });
        }
        let style = self.require_conditional_writes().await?;
        let payload = new.clone().unwrap_or_default();
        let swapped = |version: RefVersion| CasOutcome::Swapped {
            version: new.is_some().then_some(version),
        };
        let conflict = |raw| CasOutcome::Conflict { current: live(raw) };

        if let Some(expected) = expected {
            if is_tombstone_version(expected) {
                // Not a version read_ref can hand out; never overwrite a tombstone with it.
                return Ok(conflict(self.read_raw_ref(key).await?));
            }
            let mode = style.update(&expected.0);
            return match self.put_ref(key, payload, mode).await? {
                Some(version) => Ok(swapped(version)),
                None => Ok(conflict(self.read_raw_ref(key).await?)),
            };
        }

        // Expected absent: no object, or a tombstone.
        for _ in 0..CAS_ATTEMPTS {
            let raw = self.read_raw_ref(key).await?;
            let mode = match &raw {
                None if new.is_none() => return Ok(CasOutcome::Swapped { version: None }),
                None => PutMode::Create,
                Some((data, _)) if !data.is_empty() => return Ok(conflict(raw)),
                // Tombstone: deleting is a no-op, creating replaces it conditionally.
                Some(_) if new.is_none() => return Ok(CasOutcome::Swapped { version: None }),
                Some((_, etag)) => style.update(etag),
            };
            if let Some(version) = self.put_ref(key, payload.clone(), mode).await? {
                return Ok(swapped(version));
            }
            // Someone else wrote it meanwhile: look again.
        }
        Err(StoreError::Remote {
            op: "cas_ref",
            location: self.url(&self.ref_path(key)),
            reason: format!("the ref kept changing over {CAS_ATTEMPTS} attempts"),
        })
    }
}

fn not_found(key: &str) -> StoreError {
    StoreError::NotFound {
        key: key.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listing_keys() {
        assert_eq!(store_key("p", "p/a/b"), Some("a/b"));
        assert_eq!(store_key("p", "pq/a"), None);
        assert_eq!(store_key("", "a/b"), Some("a/b"));
        assert_eq!(store_key("p", "p/.tmp-cas-probe-00"), None);
        assert!(is_tombstone_version(&RefVersion(format!(
            "\"{EMPTY_ETAG}\""
        ))));
    }
}

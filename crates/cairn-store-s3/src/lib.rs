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
    PutPayload, RetryConfig, UpdateVersion,
};
use tokio::sync::{OnceCell, Semaphore};

/// ETag of an empty object (MD5 of nothing): the version of every tombstone.
const EMPTY_ETAG: &str = "d41d8cd98f00b204e9800998ecf8427e";

/// How many times `cas_ref` re-reads and retries when a tombstone changes under it.
const CAS_ATTEMPTS: usize = 64;

/// Where and how to reach the bucket, parsed from `s3://BUCKET/PREFIX?...`.
#[derive(Clone, PartialEq, Eq)]
pub struct S3Config {
    pub bucket: String,
    /// Key prefix inside the bucket, without leading or trailing `/` (may be empty).
    pub prefix: String,
    pub endpoint: Option<String>,
    pub region: Option<String>,
    /// `Some(true)`: path-style requests (`ENDPOINT/BUCKET/KEY`), what MinIO and Ceph want.
    pub path_style: Option<bool>,
    /// Most requests in flight at once.
    pub max_requests: usize,
    /// Longest a single request may take before it counts as failed (and is retried).
    pub timeout: Duration,
    /// How long to keep retrying a failing request (throttling, 5xx, refused connections)
    /// before giving up with an error.
    pub retry_timeout: Duration,
}

impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

fn config_error(url: &str, reason: impl Into<String>) -> StoreError {
    StoreError::Remote {
        op: "open",
        location: url.split('?').next().unwrap_or("").to_owned(),
        reason: reason.into(),
    }
}

impl S3Config {
    /// Parse `s3://BUCKET[/PREFIX][?endpoint=URL&region=R&path_style=true|false&max_requests=N
    /// &timeout=SECONDS&retry_timeout=SECONDS]`.
    pub fn parse(url: &str) -> StoreResult<Self> {
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| config_error(url, "not an s3:// URL"))?;
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (bucket, prefix) = path.split_once('/').unwrap_or((path, ""));
        let prefix = prefix.trim_matches('/');
        if bucket.is_empty() {
            return Err(config_error(url, "no bucket name (s3://BUCKET/PREFIX)"));
        }
        if !prefix.is_empty() {
            cairn_store::validate_key(prefix).map_err(|e| config_error(url, e.to_string()))?;
        }
        let mut config = S3Config {
            bucket: bucket.to_owned(),
            prefix: prefix.to_owned(),
            endpoint: None,
            region: None,
            path_style: None,
            max_requests: 32,
            timeout: Duration::from_secs(300),
            retry_timeout: Duration::from_secs(120),
        };
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
            let value = percent_decode(value);
            match name {
                "endpoint" => config.endpoint = Some(value),
                "region" => config.region = Some(value),
                "path_style" => {
                    config.path_style = Some(parse_bool(&value).ok_or_else(|| {
                        config_error(url, format!("path_style={value}: want true or false"))
                    })?)
                }
                "max_requests" => {
                    config.max_requests =
                        value.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
                            config_error(url, format!("max_requests={value}: want a number > 0"))
                        })?
                }
                "timeout" | "retry_timeout" => {
                    let secs = value
                        .parse::<u64>()
                        .ok()
                        .filter(|&n| n > 0)
                        .ok_or_else(|| {
                            config_error(url, format!("{name}={value}: want seconds > 0"))
                        })?;
                    let d = Duration::from_secs(secs);
                    if name == "timeout" {
                        config.timeout = d;
                    } else {
                        config.retry_timeout = d;
                    }
                }
                _ => {
                    // Deliberately not echoing the value: it might be a secret.
                    return Err(config_error(
                        url,
                        format!(
                            "unknown URL parameter {name:?} (known: endpoint, region, \
                             path_style, max_requests, timeout, retry_timeout; credentials \
                             come from AWS_* variables)"
                        ),
                    ));
                }
            }
        }
        Ok(config)
    }

    /// `s3://BUCKET/PREFIX` plus the endpoint if one was given in the URL; no secrets.
    pub fn describe(&self) -> String {
        let mut s = format!("s3://{}", self.bucket);
        if !self.prefix.is_empty() {
            s.push('/');
            s.push_str(&self.prefix);
        }
        if let Some(endpoint) = &self.endpoint {
            s.push_str(" at ");
            s.push_str(strip_userinfo(endpoint));
        }
        s
    }
}

fn parse_bool(s: &str) -> Option<bool> {
    match s {
        "true" | "1" | "yes" => Some(true),
        "false" | "0" | "no" => Some(false),
        _ => None,
    }
}

/// `http://user:pw@host` → `host...`: never show userinfo of an endpoint.
fn strip_userinfo(endpoint: &str) -> &str {
    match endpoint.split_once('@') {
        Some((_, host)) => host,
        None => endpoint,
    }
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let escaped = (bytes[i] == b'%')
            .then(|| s.get(i + 1..i + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(b) => {
                out.push(b);
                i += 3;
            }
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// How the server wants the ETag in `If-Match` on PUT (found by the conditional-write probe).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum IfMatchStyle {
    /// As the server sent it, quoted (RFC 9110; MinIO, AWS).
    Quoted,
    /// Without the quotes: Ceph RGW (16.2 at least) compares the header byte for byte with the
    /// bare MD5 it stores, so a quoted ETag never matches.
    Bare,
}

impl IfMatchStyle {
    fn update(self, etag: &str) -> PutMode {
        let e_tag = match self {
            IfMatchStyle::Quoted => etag.to_owned(),
            IfMatchStyle::Bare => etag.trim_matches('"').to_owned(),
        };
        PutMode::Update(UpdateVersion {
            e_tag: Some(e_tag),
            version: None,
        })
    }
}

/// An [`ObjectStore`] on an S3-compatible bucket. Cheap to clone.
#[derive(Clone)]
pub struct S3Store {
    inner: Arc<Inner>,
}

struct Inner {
    config: S3Config,
    client: AmazonS3,
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
        let retry = RetryConfig {
            // retry_timeout is the bound that matters; a count would end an outage's retries
            // within seconds.
            max_retries: usize::MAX,
            retry_timeout: config.retry_timeout,
            ..RetryConfig::default()
        };
        let options = ClientOptions::new()
            .with_connect_timeout(Duration::from_secs(10))
            .with_timeout(config.timeout);
        // Client options first: they replace allow_http as a whole.
        builder = builder.with_retry(retry).with_client_options(options);
        let endpoint = builder
            .get_config_value(&AmazonS3ConfigKey::Endpoint)
            .unwrap_or_default();
        if endpoint.starts_with("http://") {
            builder = builder.with_allow_http(true);
        }
        let secrets: Vec<String> = [AmazonS3ConfigKey::SecretAccessKey, AmazonS3ConfigKey::Token]
            .iter()
            .filter_map(|k| builder.get_config_value(k))
            .filter(|s| s.len() >= 4)
            .collect();
        let client = builder.build().map_err(|e| StoreError::Remote {
            op: "open",
            location: config.describe(),
            reason: one_line(&e.to_string(), &secrets),
        })?;
        Ok(S3Store {
            inner: Arc::new(Inner {
                permits: Semaphore::new(config.max_requests),
                config,
                client,
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

    /// Fail (every time, with the same reason) if the server does not honour conditional
    /// writes; checked once per store, before the first write.
    async fn require_conditional_writes(&self) -> StoreResult<IfMatchStyle> {
        let result = self
            .inner
            .conditional
            .get_or_init(|| async { self.probe_conditional_writes().await })
            .await;
        result.clone().map_err(|reason| StoreError::Remote {
            op: "check conditional writes at",
            location: self.describe(),
            reason,
        })
    }

    async fn probe_conditional_writes(&self) -> Result<IfMatchStyle, String> {
        let name = format!(
            "{TEMP_PREFIX}cas-probe-{}",
            hex::encode(rand::random::<[u8; 8]>())
        );
        let path = self.path(&name);
        let put = |data: &'static [u8], mode: PutMode| {
            let path = path.clone();
            async move {
                let _permit = self.permit().await;
                let opts = PutOptions {
                    mode,
                    ..PutOptions::default()
                };
                self.inner
                    .client
                    .put_opts(&path, PutPayload::from_static(data), opts)
                    .await
            }
        };
        let reason = |e: object_store::Error| one_line(&e.to_string(), &self.inner.secrets);
        let created = put(b"probe", PutMode::Create).await.map_err(reason)?;
        let verdict = async {
            match put(b"again", PutMode::Create).await {
                Err(object_store::Error::AlreadyExists { .. }) => {}
                Ok(_) => {
                    return Err("the server ignores If-None-Match on PUT (a second create \
                                succeeded); refusing to write, since compare-and-swap would \
                                lose updates"
                        .to_owned())
                }
                Err(e) => return Err(reason(e)),
            }
            let stale = UpdateVersion {
                e_tag: Some(format!("\"{}\"", "0".repeat(32))),
                version: None,
            };
            match put(b"stale", PutMode::Update(stale)).await {
                Err(object_store::Error::Precondition { .. }) => {}
                Ok(_) => {
                    return Err(
                        "the server ignores If-Match on PUT (a write with a wrong ETag \
                                succeeded); refusing to write, since compare-and-swap would \
                                lose updates"
                            .to_owned(),
                    )
                }
                Err(e) => return Err(reason(e)),
            }
            // A write on the right ETag must succeed, quoted as the server sent it or bare.
            let etag = created
                .e_tag
                .ok_or("the server sent no ETag, which compare-and-swap needs")?;
            for style in [IfMatchStyle::Quoted, IfMatchStyle::Bare] {
                match put(b"update", style.update(&etag)).await {
                    Ok(_) => return Ok(style),
                    Err(object_store::Error::Precondition { .. }) => {}
                    Err(e) => return Err(reason(e)),
                }
            }
            Err(format!(
                "the server refuses If-Match on PUT with the object's own ETag {etag}, quoted or \
                 not; compare-and-swap cannot work"
            ))
        }
        .await;
        let _permit = self.permit().await;
        if let Err(e) = self.inner.client.delete(&path).await {
            tracing::warn!("removing the conditional-write probe: {}", reason(e));
        }
        if let Err(why) = &verdict {
            tracing::error!("{}: {why}", self.describe());
        }
        verdict
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

/// One line, secrets masked, bounded length.
/// object_store's error text without what the caller prints anyway (the store name, the
/// request URL) and with an S3 XML error body reduced to its code and message, so the line
/// stays short enough to show the server's reason (`XMinioStorageFull: Storage backend ...`).
fn tidy_reason(text: &str) -> String {
    let mut s = text
        .strip_prefix("Generic S3 error: ")
        .unwrap_or(text)
        .to_owned();
    if let Some(start) = s.find("Error performing ") {
        let rest = &s[start + "Error performing ".len()..];
        // "Error performing <METHOD> <URL> in <time>..." → "<METHOD> in <time>..."
        if let (Some(sp), Some(inn)) = (rest.find(' '), rest.find(" in ")) {
            if sp < inn {
                s = format!("{}{}{}", &s[..start], &rest[..sp], &rest[inn..]);
            }
        }
    }
    // The retry count is unbounded (retry_timeout bounds it): drop its meaningless maximum.
    if let Some(at) = s.find(", max_retries: ") {
        let end = s[at + 2..].find(',').map_or(s.len(), |i| at + 2 + i);
        s.replace_range(at..end, "");
    }
    let tag = |name: &str| {
        let open = format!("<{name}>");
        let close = format!("</{name}>");
        let from = s.find(&open)? + open.len();
        let to = from + s[from..].find(&close)?;
        Some(s[from..to].to_owned())
    };
    if let (Some(code), Some(xml)) = (tag("Code"), s.find("<?xml").or_else(|| s.find("<Error>"))) {
        let message = tag("Message").unwrap_or_default();
        s = format!("{}{code}: {message}", &s[..xml]);
    }
    s
}

/// Whether the request failed in transport (connection refused, reset, timed out) rather
/// than with an answer from the server.
fn is_transport_error(e: &object_store::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        if s.downcast_ref::<object_store::client::HttpError>()
            .is_some()
        {
            return true;
        }
        source = s.source();
    }
    false
}

fn one_line(text: &str, secrets: &[String]) -> String {
    let mut s: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    for secret in secrets {
        s = s.replace(secret.as_str(), "[redacted]");
    }
    const MAX: usize = 400;
    if s.len() > MAX {
        let mut cut = MAX;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
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
    fn parses_urls() {
        let c = S3Config::parse(
            "s3://bkt/some/prefix/?endpoint=http%3A%2F%2F127.0.0.1%3A9000&region=eu-1&path_style=true",
        )
        .unwrap();
        assert_eq!(c.bucket, "bkt");
        assert_eq!(c.prefix, "some/prefix");
        assert_eq!(c.endpoint.as_deref(), Some("http://127.0.0.1:9000"));
        assert_eq!(c.region.as_deref(), Some("eu-1"));
        assert_eq!(c.path_style, Some(true));
        assert_eq!(
            c.describe(),
            "s3://bkt/some/prefix at http://127.0.0.1:9000"
        );

        let c = S3Config::parse("s3://bkt").unwrap();
        assert_eq!((c.bucket.as_str(), c.prefix.as_str()), ("bkt", ""));
        assert_eq!(c.describe(), "s3://bkt");
        assert_eq!(c.timeout, Duration::from_secs(300));
        assert_eq!(c.retry_timeout, Duration::from_secs(120));

        let c = S3Config::parse("s3://bkt/p?timeout=5&retry_timeout=20").unwrap();
        assert_eq!(c.timeout, Duration::from_secs(5));
        assert_eq!(c.retry_timeout, Duration::from_secs(20));

        for bad in [
            "http://x/y",
            "s3:///p",
            "s3://b/a/../c",
            "s3://b?path_style=maybe",
            "s3://b?timeout=0",
            "s3://b?retry_timeout=soon",
        ] {
            assert!(S3Config::parse(bad).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn never_echoes_secrets_from_the_url() {
        let err = S3Config::parse("s3://b/p?secret_access_key=hunter2hunter2").unwrap_err();
        let msg = err.to_string();
        assert!(!msg.contains("hunter2"), "{msg}");
        assert!(msg.contains("secret_access_key"), "{msg}");
        let c = S3Config::parse("s3://b/p?endpoint=http://user:pw@h:9000").unwrap();
        assert!(!c.describe().contains("pw"), "{}", c.describe());
    }

    #[test]
    fn error_text_keeps_the_servers_reason() {
        let raw = "Generic S3 error: Error performing PUT http://127.0.0.1:9000/b/p/packs/a0/x \
                   in 1.13s, after 8 retries, max_retries: 18446744073709551615, retry_timeout: \
                   8s  - Server returned non-2xx status code: 507 \
                   Insufficient Storage: <?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error>\
                   <Code>XMinioStorageFull</Code><Message>Storage backend has reached its \
                   minimum free drive threshold.</Message><Key>p/packs/a0/x</Key></Error>";
        assert_eq!(
            tidy_reason(raw),
            "PUT in 1.13s, after 8 retries, retry_timeout: 8s  - Server returned non-2xx status \
             code: 507 Insufficient Storage: XMinioStorageFull: Storage backend has reached its \
             minimum free drive threshold."
        );
        let plain = "Generic S3 error: Error performing GET http://h/k in 2.0s - HTTP error: \
                     error sending request";
        assert_eq!(
            tidy_reason(plain),
            "GET in 2.0s - HTTP error: error sending request"
        );
    }

    #[test]
    fn error_text_is_one_line_and_redacted() {
        let s = one_line("a\nsecretKEY b\r\n", &["secretKEY".to_owned()]);
        assert_eq!(s, "a [redacted] b  ");
        assert!(one_line(&"x".repeat(1000), &[]).len() < 410);
    }

    #[test]
    fn listing_keys() {
        assert_eq!(store_key("p", "p/a/b"), Some("a/b"));
        assert_eq!(store_key("p", "pq/a"), None);
        assert_eq!(store_key("", "a/b"), Some("a/b"));
        assert_eq!(store_key("p", "p/.tmp-cas-probe-00"), None);
        assert!(is_tombstone_version(&RefVersion(format!(
            "\"{EMPTY_ETAG}\""
        ))));
        assert_eq!(percent_decode("a%2Fb%"), "a/b%");
    }
}

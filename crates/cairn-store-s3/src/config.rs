//! The bucket's address and client settings, parsed from `s3://BUCKET/PREFIX?...`.

use std::fmt;
use std::time::Duration;

use cairn_store::{StoreError, StoreResult};

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
        assert_eq!(percent_decode("a%2Fb%"), "a/b%");
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
}

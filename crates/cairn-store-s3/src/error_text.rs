//! Turning object_store's errors into one short line that keeps the server's reason and never
//! a secret.

/// object_store's error text without what the caller prints anyway (the store name, the
/// request URL) and with an S3 XML error body reduced to its code and message, so the line
/// stays short enough to show the server's reason (`XMinioStorageFull: Storage backend ...`).
pub(crate) fn tidy_reason(text: &str) -> String {
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
pub(crate) fn is_transport_error(e: &object_store::Error) -> bool {
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

/// Why a store that was never reached cannot be used, in the terms of what to fix: the
/// bucket, the credentials, or the endpoint (which did not answer within `budget`).
pub(crate) fn unreachable_reason(
    e: &object_store::Error,
    bucket: &str,
    budget: std::time::Duration,
) -> String {
    let text = tidy_reason(&e.to_string());
    let has = |needles: &[&str]| needles.iter().any(|n| text.contains(n));
    if has(&["NoSuchBucket"]) {
        format!("bucket {bucket:?} does not exist (create it first: cairn init writes into an existing bucket)")
    } else if has(&[
        "AccessDenied",
        "InvalidAccessKeyId",
        "SignatureDoesNotMatch",
        "403 Forbidden",
        "InvalidToken",
        "ExpiredToken",
    ]) {
        format!(
            "access denied: check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and \
             AWS_SESSION_TOKEN) and the bucket's policy ({text})"
        )
    } else if is_transport_error(e) {
        format!(
            "the endpoint does not answer (tried for up to {} s; check the endpoint URL and \
             the network): {text}",
            budget.as_secs()
        )
    } else {
        text
    }
}

/// One line, secrets masked, bounded length.
pub(crate) fn one_line(text: &str, secrets: &[String]) -> String {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}

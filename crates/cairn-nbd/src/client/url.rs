//! NBD URLs (`doc/uri.md` of NetworkBlockDevice/nbd): `nbd://HOST[:PORT][/EXPORT]` and
//! `nbd+unix:///EXPORT?socket=PATH`. TLS schemes are recognised only to refuse them clearly.

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;

use crate::protocol::{MAX_STRING_LEN, NBD_DEFAULT_PORT};

/// Where to connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Address {
    /// A TCP host (name or IP address, without IPv6 brackets) and port.
    Tcp { host: String, port: u16 },
    /// A Unix domain socket path; a leading NUL byte names a Linux abstract socket.
    Unix(OsString),
}

/// A parsed NBD URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NbdUrl {
    pub address: Address,
    /// The export name (the path without its leading `/`, percent-decoded).
    pub export: String,
}

const USAGE: &str = "expected nbd://HOST[:PORT][/EXPORT] or nbd+unix:///EXPORT?socket=PATH";

/// Parses an NBD URL; the error is a one-line explanation (without the URL itself).
pub fn parse(url: &str) -> Result<NbdUrl, String> {
    let Some((scheme, rest)) = url.split_once("://") else {
        return Err(format!("not an NBD URL ({USAGE})"));
    };
    let unix = match scheme.to_ascii_lowercase().as_str() {
        "nbd" => false,
        "nbd+unix" => true,
        "nbds" => return Err("TLS (nbds://) is not supported".into()),
        "nbds+unix" => return Err("TLS (nbds+unix://) is not supported".into()),
        "nbd+vsock" | "nbds+vsock" => return Err("vsock NBD URLs are not supported".into()),
        other => return Err(format!("unknown URL scheme {other:?} ({USAGE})")),
    };
    if rest.contains('#') {
        return Err("NBD URLs take no #fragment".into());
    }
    let (rest, query) = match rest.split_once('?') {
        Some((r, q)) => (r, Some(q)),
        None => (rest, None),
    };
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    let export = match path.strip_prefix('/') {
        Some(p) => {
            let bytes = percent_decode(p)?;
            let name = String::from_utf8(bytes)
                .map_err(|_| "the export name is not valid UTF-8".to_string())?;
            if name.contains('\0') {
                return Err("the export name contains a NUL character".into());
            }
            if name.len() > MAX_STRING_LEN {
                return Err(format!(
                    "the export name is longer than {MAX_STRING_LEN} bytes"
                ));
            }
            name
        }
        None => String::new(),
    };

    let mut socket: Option<OsString> = None;
    for param in query.into_iter().flat_map(|q| q.split('&')) {
        if param.is_empty() {
            continue;
        }
        let (key, value) = param.split_once('=').unwrap_or((param, ""));
        let key = String::from_utf8_lossy(&percent_decode(key)?).into_owned();
        match key.as_str() {
            "socket" => {
                if !unix {
                    return Err("the socket= parameter is only valid in nbd+unix:// URLs".into());
                }
                if socket.is_some() {
                    return Err("the socket= parameter is given twice".into());
                }
                let path = percent_decode(value)?;
                if path.is_empty() {
                    return Err("the socket= parameter is empty".into());
                }
                socket = Some(OsString::from_vec(path));
            }
            k if k.starts_with("tls-") => {
                return Err(format!("TLS is not supported (URL query parameter {k}=)"))
            }
            k => return Err(format!("unknown URL query parameter {k:?}")),
        }
    }

    let address = if unix {
        if !authority.is_empty() {
            return Err(format!(
                "nbd+unix:// URLs take no host (found {authority:?}); use nbd+unix:///EXPORT?socket=PATH"
            ));
        }
        match socket {
            Some(s) => Address::Unix(s),
            None => {
                return Err(
                    "nbd+unix:// URLs need a socket=PATH query parameter (nbd+unix:///EXPORT?socket=PATH)"
                        .into(),
                )
            }
        }
    } else {
        parse_authority(authority)?
    };
    Ok(NbdUrl { address, export })
}

fn parse_authority(authority: &str) -> Result<Address, String> {
    if authority.contains('@') {
        return Err("user names in NBD URLs are only used for TLS, which is not supported".into());
    }
    let (host, port) = if let Some(rest) = authority.strip_prefix('[') {
        let Some((host, after)) = rest.split_once(']') else {
            return Err(format!("unterminated IPv6 address in {authority:?}"));
        };
        let port = match after {
            "" => None,
            p => Some(
                p.strip_prefix(':')
                    .ok_or_else(|| format!("unexpected {p:?} after the IPv6 address"))?,
            ),
        };
        (host.to_string(), port)
    } else {
        match authority.rsplit_once(':') {
            Some((h, p)) => {
                if h.contains(':') {
                    return Err(format!(
                        "IPv6 addresses must be written in brackets ([{authority}])"
                    ));
                }
                (h.to_string(), Some(p))
            }
            None => (authority.to_string(), None),
        }
    };
    let host = String::from_utf8(percent_decode(&host)?)
        .map_err(|_| "the host name is not valid UTF-8".to_string())?;
    if host.is_empty() {
        return Err(format!("nbd:// URLs need a host ({USAGE})"));
    }
    let port = match port {
        None | Some("") => NBD_DEFAULT_PORT,
        Some(p) => match p.parse::<u16>() {
            Ok(n) if n != 0 && p.bytes().all(|b| b.is_ascii_digit()) => n,
            _ => return Err(format!("invalid port {p:?}")),
        },
    };
    Ok(Address::Tcp { host, port })
}

/// Decodes `%XX` escapes (RFC 3986); `+` is left alone.
fn percent_decode(s: &str) -> Result<Vec<u8>, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = |c: u8| (c as char).to_digit(16);
            match (
                b.get(i + 1).and_then(|&c| hex(c)),
                b.get(i + 2).and_then(|&c| hex(c)),
            ) {
                (Some(h), Some(l)) => out.push((h * 16 + l) as u8),
                _ => return Err(format!("bad percent-encoding in {s:?}")),
            }
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tcp(host: &str, port: u16, export: &str) -> NbdUrl {
        NbdUrl {
            address: Address::Tcp {
                host: host.into(),
                port,
            },
            export: export.into(),
        }
    }

    #[test]
    fn spec_examples() {
        assert_eq!(
            parse("nbd://example.com/disk"),
            Ok(tcp("example.com", 10809, "disk"))
        );
        assert_eq!(
            parse("nbd+unix:///disk?socket=sock"),
            Ok(NbdUrl {
                address: Address::Unix("sock".into()),
                export: "disk".into()
            })
        );
        assert_eq!(
            parse("nbd://example.com/"),
            Ok(tcp("example.com", 10809, ""))
        );
        assert_eq!(
            parse("nbd://example.com"),
            Ok(tcp("example.com", 10809, ""))
        );
        assert_eq!(
            parse("nbd://example.com//disk"),
            Ok(tcp("example.com", 10809, "/disk"))
        );
        assert_eq!(
            parse("nbd://example.com/hello%20world"),
            Ok(tcp("example.com", 10809, "hello world"))
        );
        assert_eq!(
            parse("nbd+unix:///?socket=%00/abstract").unwrap().address,
            Address::Unix(OsString::from_vec(b"\0/abstract".to_vec()))
        );
    }

    #[test]
    fn hosts_and_ports() {
        assert_eq!(parse("nbd://127.0.0.1:1/"), Ok(tcp("127.0.0.1", 1, "")));
        assert_eq!(parse("NBD://h:10810/x"), Ok(tcp("h", 10810, "x")));
        assert_eq!(parse("nbd://[::1]:2000/x"), Ok(tcp("::1", 2000, "x")));
        assert_eq!(parse("nbd://[::1]/x"), Ok(tcp("::1", 10809, "x")));
        assert_eq!(parse("nbd://h:/x"), Ok(tcp("h", 10809, "x")));
        assert!(parse("nbd://::1/x").unwrap_err().contains("brackets"));
        assert!(parse("nbd://h:0/").unwrap_err().contains("invalid port"));
        assert!(parse("nbd://h:65536/")
            .unwrap_err()
            .contains("invalid port"));
        assert!(parse("nbd://h:+1/").unwrap_err().contains("invalid port"));
        assert!(parse("nbd:///disk").unwrap_err().contains("need a host"));
        assert!(parse("nbd://u@h/").unwrap_err().contains("TLS"));
        assert!(parse("nbd://[::1/").unwrap_err().contains("unterminated"));
    }

    #[test]
    fn refusals() {
        assert_eq!(
            parse("nbds://h/disk").unwrap_err(),
            "TLS (nbds://) is not supported"
        );
        assert_eq!(
            parse("nbds+unix:///d?socket=/s").unwrap_err(),
            "TLS (nbds+unix://) is not supported"
        );
        assert!(parse("http://h/")
            .unwrap_err()
            .starts_with("unknown URL scheme \"http\""));
        assert!(parse("/tmp/disk.raw")
            .unwrap_err()
            .starts_with("not an NBD URL"));
        assert!(parse("nbd+unix:///disk")
            .unwrap_err()
            .contains("need a socket=PATH"));
        assert!(parse("nbd+unix://host/disk?socket=/s")
            .unwrap_err()
            .contains("take no host"));
        assert!(parse("nbd://h/disk?socket=/s")
            .unwrap_err()
            .contains("only valid in nbd+unix"));
        assert!(parse("nbd://h/disk?tls-type=x509")
            .unwrap_err()
            .contains("TLS"));
        assert!(parse("nbd://h/disk?foo=1")
            .unwrap_err()
            .contains("unknown URL query parameter"));
        assert!(parse("nbd://h/%zz")
            .unwrap_err()
            .contains("percent-encoding"));
        assert!(parse("nbd://h/%ff").unwrap_err().contains("UTF-8"));
        assert!(parse("nbd://h/a%00b").unwrap_err().contains("NUL"));
        assert!(parse("nbd+unix:///d?socket=")
            .unwrap_err()
            .contains("empty"));
        assert!(parse("nbd+unix:///d?socket=/a&socket=/b")
            .unwrap_err()
            .contains("twice"));
    }

    #[test]
    fn socket_is_percent_decoded() {
        assert_eq!(
            parse("nbd+unix:///my%20disk?socket=/tmp/a%20b.sock"),
            Ok(NbdUrl {
                address: Address::Unix("/tmp/a b.sock".into()),
                export: "my disk".into()
            })
        );
    }
}

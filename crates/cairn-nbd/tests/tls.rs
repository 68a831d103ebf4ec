//! NBD over TLS (`NBD_OPT_STARTTLS`, FORCEDTLS mode) driven by a hand-rolled client with
//! rustls, against certificates made here with rcgen: options before TLS are refused with
//! `NBD_REP_ERR_TLS_REQD`, the upgrade works, and untrusted certificates fail the handshake.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use cairn_nbd::protocol::*;
use cairn_nbd::{MemoryExport, Server, TlsConfig};
use cairn_testkit::tls::Ca;
use common::{patterned, TestServer};
use tokio_rustls::rustls;

const SIZE: usize = 256 * 1024;

fn write_files(dir: &Path, files: &[(&str, &str)]) {
    std::fs::create_dir_all(dir).unwrap();
    for (name, body) in files {
        std::fs::write(dir.join(name), body).unwrap();
    }
}

fn start(tls: TlsConfig) -> (TestServer, Vec<u8>) {
    let data = patterned(SIZE);
    let mut server =
        Server::new().with_export("disk", Arc::new(MemoryExport::from_vec(data.clone())));
    server.set_tls(tls);
    (TestServer::start(server), data)
}

fn handshake<S: Read + Write>(s: &mut S) {
    let mut g = [0u8; GREETING_LEN];
    s.read_exact(&mut g).unwrap();
    assert_eq!(&g[..16], b"NBDMAGICIHAVEOPT");
    s.write_all(&(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
}

/// Sends an option; returns its replies up to the final one.
fn opt<S: Read + Write>(s: &mut S, option: u32, data: &[u8]) -> Vec<(u32, Vec<u8>)> {
    s.write_all(&encode_option_request(option, data)).unwrap();
    s.flush().unwrap();
    let mut out = Vec::new();
    loop {
        let mut h = [0u8; 20];
        s.read_exact(&mut h).unwrap();
        let h = decode_option_reply_header(&h).unwrap();
        assert_eq!(h.option, option);
        let mut payload = vec![0u8; h.len as usize];
        s.read_exact(&mut payload).unwrap();
        out.push((h.reply_type, payload));
        if !matches!(h.reply_type, NBD_REP_SERVER | NBD_REP_INFO) {
            return out;
        }
    }
}

fn connect(socket: &Path) -> UnixStream {
    let s = UnixStream::connect(socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// A rustls client trusting `ca_pem`, with an optional client certificate.
fn client_config(ca_pem: &str, identity: Option<&(String, String)>) -> Arc<rustls::ClientConfig> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca_pem.as_bytes()).unwrap())
        .unwrap();
    let b = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    Arc::new(match identity {
        None => b.with_no_client_auth(),
        Some((cert, key)) => b
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_slice(cert.as_bytes()).unwrap()],
                PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
            )
            .unwrap(),
    })
}

/// STARTTLS, then the TLS handshake (driven to completion, so that a refusal shows here).
fn start_tls(
    mut s: UnixStream,
    config: Arc<rustls::ClientConfig>,
) -> Result<rustls::StreamOwned<rustls::ClientConnection, UnixStream>, std::io::Error> {
    let r = opt(&mut s, NBD_OPT_STARTTLS, &[]);
    assert_eq!(r, vec![(NBD_REP_ACK, vec![])]);
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut conn = rustls::ClientConnection::new(config, name).unwrap();
    while conn.is_handshaking() {
        conn.complete_io(&mut s)?;
    }
    // TLS 1.3: a rejected client certificate shows on the first read.
    let mut tls = rustls::StreamOwned::new(conn, s);
    let r = opt(&mut tls, NBD_OPT_STRUCTURED_REPLY, &[]);
    assert_eq!(r[0].0, NBD_REP_ACK);
    Ok(tls)
}

#[test]
fn options_before_starttls_are_refused_and_abort_is_honoured() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("test CA");
    let (cert, key) = ca.sign(&["localhost"], false);
    write_files(dir.path(), &[("c.pem", &cert), ("k.pem", &key)]);
    let tls = TlsConfig::from_pem_files(&dir.path().join("c.pem"), &dir.path().join("k.pem"), None)
        .unwrap();
    let (server, _) = start(tls);
    let mut s = connect(&server.socket);
    handshake(&mut s);
    for (option, data) in [
        (NBD_OPT_LIST, vec![]),
        (NBD_OPT_STRUCTURED_REPLY, vec![]),
        (NBD_OPT_GO, encode_info_request("disk", &[])),
        (NBD_OPT_INFO, encode_info_request("disk", &[])),
        (99, vec![1, 2, 3]),
    ] {
        let r = opt(&mut s, option, &data);
        assert_eq!(r.len(), 1, "{option}: {r:?}");
        assert_eq!(r[0].0, NBD_REP_ERR_TLS_REQD, "{option}");
        assert_eq!(
            String::from_utf8_lossy(&r[0].1),
            "TLS is required: send NBD_OPT_STARTTLS first"
        );
    }
    assert_eq!(opt(&mut s, NBD_OPT_ABORT, &[]), vec![(NBD_REP_ACK, vec![])]);

    // EXPORT_NAME cannot be refused with an error: the connection ends.
    let mut s = connect(&server.socket);
    handshake(&mut s);
    s.write_all(&encode_option_request(NBD_OPT_EXPORT_NAME, b"disk"))
        .unwrap();
    let mut buf = [0u8; 16];
    assert_eq!(s.read(&mut buf).unwrap(), 0, "the server must hang up");
}

#[test]
fn after_starttls_the_export_serves_and_a_second_starttls_is_invalid() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("test CA");
    let (cert, key) = ca.sign(&["localhost", "127.0.0.1"], false);
    write_files(
        dir.path(),
        &[("server-cert.pem", &cert), ("server-key.pem", &key)],
    );
    let tls = TlsConfig::from_dir(dir.path()).unwrap();
    assert!(!tls.requires_client_certificates());
    let (server, data) = start(tls);
    let mut s = connect(&server.socket);
    handshake(&mut s);
    let mut t = start_tls(s, client_config(&ca.pem, None)).unwrap();
    let r = opt(&mut t, NBD_OPT_STARTTLS, &[]);
    assert_eq!(r[0].0, NBD_REP_ERR_INVALID);
    let r = opt(&mut t, NBD_OPT_GO, &encode_info_request("disk", &[]));
    assert_eq!(r.last().unwrap().0, NBD_REP_ACK, "{r:?}");
    // READ the whole export (structured replies: one OFFSET_DATA or OFFSET_HOLE chunk).
    let mut got = Vec::new();
    for (i, off) in (0..SIZE as u64).step_by(64 * 1024).enumerate() {
        let req = Request {
            flags: 0,
            command: NBD_CMD_READ,
            cookie: i as u64,
            offset: off,
            len: 64 * 1024,
        };
        t.write_all(&encode_request(&req)).unwrap();
        t.flush().unwrap();
        let mut h = [0u8; STRUCTURED_HEADER_LEN];
        t.read_exact(&mut h).unwrap();
        let kind = u16::from_be_bytes([h[6], h[7]]);
        let len = u32::from_be_bytes(h[16..20].try_into().unwrap()) as usize;
        let mut payload = vec![0u8; len];
        t.read_exact(&mut payload).unwrap();
        match kind {
            NBD_REPLY_TYPE_OFFSET_DATA => got.extend_from_slice(&payload[8..]),
            NBD_REPLY_TYPE_OFFSET_HOLE => got.resize(got.len() + 64 * 1024, 0),
            other => panic!("reply type {other}"),
        }
    }
    assert!(got == data, "the export read over TLS differs");
}

#[test]
fn untrusted_certificates_fail_the_handshake() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("test CA");
    let other = Ca::new("someone else");
    let (cert, key) = ca.sign(&["localhost"], false);
    write_files(
        dir.path(),
        &[
            ("server-cert.pem", &cert),
            ("server-key.pem", &key),
            ("ca-cert.pem", &ca.pem),
        ],
    );
    // With ca-cert.pem in the directory, clients need a certificate from that CA.
    let tls = TlsConfig::from_dir(dir.path()).unwrap();
    assert!(tls.requires_client_certificates());
    let (server, _) = start(tls);
    let good = ca.sign(&["client"], true);
    let forged = other.sign(&["client"], true);

    let attempt = |config| {
        let mut s = connect(&server.socket);
        handshake(&mut s);
        start_tls(s, config).map(|_| ())
    };
    // A client that trusts another CA refuses the server.
    assert!(attempt(client_config(&other.pem, Some(&good))).is_err());
    // The server refuses a client without a certificate, or with one from another CA.
    let r = std::panic::catch_unwind(|| attempt(client_config(&ca.pem, None)));
    assert!(
        !matches!(r, Ok(Ok(()))),
        "a client without a certificate got in"
    );
    let r = std::panic::catch_unwind(|| attempt(client_config(&ca.pem, Some(&forged))));
    assert!(
        !matches!(r, Ok(Ok(()))),
        "a client with a forged certificate got in"
    );
    // The right one gets in.
    attempt(client_config(&ca.pem, Some(&good))).unwrap();
}

#[test]
fn bad_credentials_are_named_without_their_contents() {
    let dir = tempfile::tempdir().unwrap();
    let ca = Ca::new("test CA");
    let (cert, key) = ca.sign(&["localhost"], false);
    let (_, other_key) = ca.sign(&["localhost"], false);
    write_files(
        dir.path(),
        &[
            ("c.pem", &cert),
            ("k.pem", &key),
            ("k2.pem", &other_key),
            ("junk.pem", "-----BEGIN PRIVATE KEY-----\nsecret-material\n"),
        ],
    );
    let p = |n: &str| dir.path().join(n);
    let err = TlsConfig::from_pem_files(&p("missing.pem"), &p("k.pem"), None).unwrap_err();
    assert!(
        err.to_string()
            .starts_with(&format!("TLS certificate {}: ", p("missing.pem").display())),
        "{err}"
    );
    let err = TlsConfig::from_pem_files(&p("c.pem"), &p("junk.pem"), None).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("TLS private key {}: not valid PEM", p("junk.pem").display())
    );
    let err = TlsConfig::from_pem_files(&p("c.pem"), &p("c.pem"), None).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "TLS private key {}: no PEM item of the expected kind in it",
            p("c.pem").display()
        )
    );
    // A key that does not belong to the certificate.
    let err = TlsConfig::from_pem_files(&p("c.pem"), &p("k2.pem"), None).unwrap_err();
    let text = err.to_string();
    assert!(
        text.starts_with(&format!("TLS private key {}: ", p("k2.pem").display())),
        "{text}"
    );
    assert!(
        !text.contains("PRIVATE KEY") && !text.contains(&other_key[30..60]),
        "{text}"
    );
}

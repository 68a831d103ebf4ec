//! TLS for the NBD server (`NBD_OPT_STARTTLS`), with rustls and X.509 certificates.
//!
//! A server given a [`TlsConfig`] runs in the spec's FORCEDTLS mode, as `qemu-nbd
//! --tls-creds` and `nbdkit --tls=require` do: before TLS, `NBD_OPT_STARTTLS` is
//! acknowledged and the connection upgraded, `NBD_OPT_ABORT` is honoured, every other option
//! gets `NBD_REP_ERR_TLS_REQD`, and `NBD_OPT_EXPORT_NAME` (which cannot carry an error) ends
//! the connection. Nothing negotiated before TLS carries over.
//!
//! Certificates come from PEM files, or from a directory laid out as QEMU's
//! `tls-creds-x509` expects (`server-cert.pem`, `server-key.pem`, and `ca-cert.pem`, whose
//! presence makes client certificates required, as QEMU's `verify-peer=yes` default does).
//! Pre-shared keys (`tls-creds-psk`) are not supported: rustls has no external-PSK support.
//!
//! Errors name files, never their contents: a private key is never logged or echoed.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_rustls::rustls::{self, pki_types};

use pki_types::pem::PemObject;
use pki_types::{CertificateDer, PrivateKeyDer};

/// Why TLS could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("TLS certificate {}: {reason}", path.display())]
    Certificate { path: PathBuf, reason: String },
    #[error("TLS private key {}: {reason}", path.display())]
    Key { path: PathBuf, reason: String },
    #[error("TLS CA certificate {}: {reason}", path.display())]
    Ca { path: PathBuf, reason: String },
    #[error("TLS set-up: {0}")]
    Config(String),
}

/// A server-side TLS configuration: what [`crate::Server::set_tls`] takes.
#[derive(Clone)]
pub struct TlsConfig {
    pub(crate) acceptor: tokio_rustls::TlsAcceptor,
    client_certificates: bool,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConfig")
            .field("client_certificates", &self.client_certificates)
            .finish_non_exhaustive()
    }
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

/// The certificates in a PEM file (the server's first, then its chain).
fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(pem_reason)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem_reason)?;
    if certs.is_empty() {
        return Err("no PEM certificate in it".into());
    }
    Ok(certs)
}

/// Describes a PEM error without quoting the file (it may be a private key).
fn pem_reason(e: pki_types::pem::Error) -> String {
    match e {
        pki_types::pem::Error::Io(e) => e.to_string(),
        pki_types::pem::Error::NoItemsFound => "no PEM item of the expected kind in it".into(),
        _ => "not valid PEM".into(),
    }
}

impl TlsConfig {
    /// Serves the certificate chain `cert` with private key `key` (PEM: PKCS#8, PKCS#1 or
    /// SEC1). With `client_ca`, clients must present a certificate that this CA signed.
    pub fn from_pem_files(
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
    ) -> Result<TlsConfig, TlsError> {
        let chain = read_certificates(cert).map_err(|reason| TlsError::Certificate {
            path: cert.to_path_buf(),
            reason,
        })?;
        let private = PrivateKeyDer::from_pem_file(key).map_err(|e| TlsError::Key {
            path: key.to_path_buf(),
            reason: pem_reason(e),
        })?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let ca_err = |reason: String| TlsError::Ca {
                    path: ca.to_path_buf(),
                    reason,
                };
                let mut roots = rustls::RootCertStore::empty();
                for c in read_certificates(ca).map_err(ca_err)? {
                    roots.add(c).map_err(|e| ca_err(e.to_string()))?;
                }
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider(),
                )
                .build()
                .map_err(|e| ca_err(e.to_string()))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let config = builder
            .with_single_cert(chain, private)
            .map_err(|e| TlsError::Key {
                path: key.to_path_buf(),
                // rustls says which check failed (e.g. the key does not match the
                // certificate); it never includes key material.
                reason: e.to_string(),
            })?;
        Ok(TlsConfig {
            acceptor: tokio_rustls::TlsAcceptor::from(Arc::new(config)),
            client_certificates: client_ca.is_some(),
        })
    }

    /// Reads a directory laid out as QEMU's `tls-creds-x509,endpoint=server` expects:
    /// `server-cert.pem`, `server-key.pem`, and optionally `ca-cert.pem`, which when present
    /// makes client certificates signed by that CA required.
    pub fn from_dir(dir: &Path) -> Result<TlsConfig, TlsError> {
        let ca = dir.join("ca-cert.pem");
        TlsConfig::from_pem_files(
            &dir.join("server-cert.pem"),
            &dir.join("server-key.pem"),
            ca.exists().then_some(ca.as_path()),
        )
    }

    /// Whether clients must present a certificate.
    pub fn requires_client_certificates(&self) -> bool {
        self.client_certificates
    }
}

/// A connection before and after `NBD_OPT_STARTTLS`.
pub(crate) enum MaybeTls<S> {
    Plain(S),
    Tls(Box<tokio_rustls::server::TlsStream<S>>),
}

impl<S> MaybeTls<S> {
    pub(crate) fn is_tls(&self) -> bool {
        matches!(self, MaybeTls::Tls(_))
    }
}

use std::pin::Pin;
use std::task::{Context, Poll};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for MaybeTls<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_read(cx, buf),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for MaybeTls<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_write(cx, buf),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_flush(cx),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_shutdown(cx),
            MaybeTls::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

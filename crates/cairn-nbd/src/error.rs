//! Errors that end an NBD connection.
//!
//! Per-request failures (a read past the end, an I/O error from the export)
//! are *not* `NbdError`s: they are reported to the client as NBD error
//! replies and the connection continues. An `NbdError` means the
//! connection itself is over.

use thiserror::Error;

/// Why a connection (or a listener) stopped.
#[derive(Debug, Error)]
pub enum NbdError {
    /// Socket-level failure, including the peer disconnecting mid-message.
    #[error("i/o error: {0}")]
    Io(#[from] std::io::Error),
    /// The peer violated the protocol badly enough that we hard-disconnect
    /// (bad magic, unknown client flags, oversized option, ...).
    #[error("protocol violation: {0}")]
    Protocol(#[from] crate::protocol::ProtocolError),
    /// The client refused fixed newstyle negotiation, which we require.
    #[error("client does not support fixed newstyle negotiation")]
    NotFixedNewstyle,
    /// `NBD_OPT_EXPORT_NAME` named an export we do not have; that option
    /// cannot return an error, so the spec makes us drop the connection.
    #[error("client asked for unknown export {0:?}")]
    UnknownExport(String),
    /// `NBD_OPT_EXPORT_NAME` before TLS on a server that requires TLS; that option cannot
    /// return an error, so the spec makes us drop the connection.
    #[error("client asked for an export before starting TLS, which this server requires")]
    TlsRequired,
    /// The TLS handshake after `NBD_OPT_STARTTLS` failed (untrusted or missing certificate,
    /// no common protocol version, ...).
    #[error("TLS handshake failed: {0}")]
    TlsHandshake(std::io::Error),
    /// The client did not finish the handshake in time (see `server::HANDSHAKE_TIMEOUT`).
    #[error("the client did not finish the handshake within {0:?}")]
    HandshakeTimeout(std::time::Duration),
}

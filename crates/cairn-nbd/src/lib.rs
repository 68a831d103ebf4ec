//! `cairn-nbd`: an NBD (Network Block Device) server library, and a blocking
//! client ([`client::NbdImage`]) that reads any NBD export as a
//! `cairn_image::DiskImage` (feature `client`, on by default).
//!
//! cairn serves VM disk images lazily over NBD so that QEMU, `qemu-img`,
//! `nbdcopy` and the kernel client can use them directly. Implement
//! [`Export`] for a backend, put it in a [`Server`], and run one of the
//! accept loops in [`listen`].
//!
//! Supported (see `doc/proto.md` of NetworkBlockDevice/nbd):
//! - fixed newstyle handshake only (with `NBD_FLAG_NO_ZEROES`);
//! - TLS (`NBD_OPT_STARTTLS`, rustls, X.509) in FORCEDTLS mode when the server is given a
//!   [`TlsConfig`] ([`tls`]); without one, `NBD_OPT_STARTTLS` gets `NBD_REP_ERR_POLICY`;
//! - options `EXPORT_NAME`, `INFO`/`GO` (`NBD_INFO_EXPORT`, `BLOCK_SIZE`,
//!   `NAME`, `DESCRIPTION`), `LIST`, `ABORT`, `STRUCTURED_REPLY`,
//!   `LIST_META_CONTEXT`/`SET_META_CONTEXT` with `base:allocation`;
//!   everything else gets `NBD_REP_ERR_UNSUP`;
//! - commands `READ` (simple or structured: `OFFSET_DATA`, all-zero reads
//!   as one `OFFSET_HOLE`; `DF` honoured trivially since every read is one
//!   chunk), `WRITE` (+`FUA`), `FLUSH`, `TRIM`, `WRITE_ZEROES`
//!   (+`NO_HOLE`, `FUA`), `CACHE`, `DISC`, `BLOCK_STATUS` (+`REQ_ONE`);
//! - requests on one connection run concurrently and may complete out of
//!   order; multi-conn is advertised when the export allows it.
//!
//! ```no_run
//! use std::sync::Arc;
//! use cairn_nbd::{serve_unix, MemoryExport, Server};
//!
//! # async fn run() -> std::io::Result<()> {
//! let server = Server::new().with_export("disk", Arc::new(MemoryExport::new(1 << 20)));
//! // qemu-img info 'nbd+unix:///disk?socket=/tmp/cairn.sock'
//! serve_unix(Arc::new(server), "/tmp/cairn.sock").await
//! # }
//! ```
//!
//! Not supported: oldstyle and non-fixed newstyle negotiation, TLS with
//! pre-shared keys (rustls has no external PSK), extended headers, `NBD_CMD_FLAG_FAST_ZERO`, resize.

#[cfg(feature = "client")]
pub mod client;
pub mod contract;
pub mod error;
pub mod export;
pub mod listen;
pub mod protocol;
pub mod server;
pub mod tls;

#[cfg(feature = "client")]
pub use client::NbdImage;
pub use error::NbdError;
pub use export::{Export, Extent, MemoryExport};
pub use listen::{
    serve_socket_activation, serve_stdio, serve_tcp, serve_tcp_listener, serve_unix,
    serve_unix_listener,
};
pub use server::Server;
pub use tls::{TlsConfig, TlsError};

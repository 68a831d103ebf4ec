//! One NBD connection: fixed-newstyle handshake, then the transmission
//! phase with requests handled concurrently.
//!
//! Transmission design: the connection future runs a *reader* (parses
//! request headers, reads WRITE payloads off the socket, validates, spawns
//! one task per request) and a *writer* (drains a channel of complete
//! replies) side by side. Reply frames are only ever written by the writer,
//! so replies from concurrent tasks never interleave mid-message, and the
//! stream type needs no `'static` bound. A byte budget (semaphore) bounds
//! the memory held by in-flight requests.

use std::collections::HashMap;
use std::io;
use std::sync::Arc;

use bytes::Bytes;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tracing::{debug, trace};

use crate::error::NbdError;
use crate::export::Export;
use crate::protocol::*;
use crate::tls::{MaybeTls, TlsConfig};

/// Context id we hand out for `base:allocation`.
const BASE_ALLOCATION_ID: u32 = 1;
/// In-flight budget per connection, in units of [`BUDGET_UNIT`] bytes.
const BUDGET_UNITS: u32 = 4096;
const BUDGET_UNIT: u32 = 64 * 1024;
/// Most descriptors in one block status chunk (spec: SHOULD NOT exceed 2^20).
const MAX_EXTENTS: usize = 1 << 20;

/// A set of named exports served over NBD.
pub struct Server {
    exports: HashMap<String, Arc<dyn Export>>,
    descriptions: HashMap<String, String>,
    default_export: Option<Arc<dyn Export>>,
    tls: Option<TlsConfig>,
    /// [`HANDSHAKE_TIMEOUT`] unless set.
    handshake_timeout: std::time::Duration,
}

impl Default for Server {
    fn default() -> Self {
        Server {
            exports: HashMap::new(),
            descriptions: HashMap::new(),
            default_export: None,
            tls: None,
            handshake_timeout: HANDSHAKE_TIMEOUT,
        }
    }
}

/// What the option phase decided.
struct Selected {
    name: String,
    export: Arc<dyn Export>,
}

/// Per-connection negotiation state.
struct Negotiated {
    no_zeroes: bool,
    structured: bool,
    /// Export name for which `base:allocation` was selected (if it was).
    meta_export: Option<String>,
}

/// How long a client may take from connecting to the end of option haggling (QEMU and
/// libnbd take milliseconds; a TLS handshake over a slow link a few seconds).
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

/// Transmission-phase settings fixed at the end of the handshake.
struct Session {
    export: Arc<dyn Export>,
    size: u64,
    structured: bool,
    base_allocation: bool,
}

/// A complete reply, ready for the writer; the permit returns the budget
/// only once the bytes are on the socket.
struct Reply {
    frames: Vec<Bytes>,
    _permit: Option<OwnedSemaphorePermit>,
}

impl Server {
    /// An empty server; add exports before serving.
    pub fn new() -> Self {
        Self::default()
    }

    /// Serve `export` under `name`.
    pub fn add_export(&mut self, name: impl Into<String>, export: Arc<dyn Export>) {
        self.exports.insert(name.into(), export);
    }

    /// Builder form of [`Server::add_export`].
    pub fn with_export(mut self, name: impl Into<String>, export: Arc<dyn Export>) -> Self {
        self.add_export(name, export);
        self
    }

    /// A human-readable description sent with `NBD_OPT_LIST` and
    /// `NBD_INFO_DESCRIPTION`.
    pub fn set_description(&mut self, name: impl Into<String>, description: impl Into<String>) {
        self.descriptions.insert(name.into(), description.into());
    }

    /// The export served when a client asks for the empty name `""`
    /// (unless an export was explicitly added under `""`).
    pub fn set_default_export(&mut self, export: Arc<dyn Export>) {
        self.default_export = Some(export);
    }

    /// Builder form of [`Server::set_default_export`].
    pub fn with_default_export(mut self, export: Arc<dyn Export>) -> Self {
        self.set_default_export(export);
        self
    }

    /// Look up an export by the name a client sent.
    pub fn lookup(&self, name: &str) -> Option<Arc<dyn Export>> {
        self.exports.get(name).cloned().or_else(|| {
            if name.is_empty() {
                self.default_export.clone()
            } else {
                None
            }
        })
    }

    /// Names as listed by `NBD_OPT_LIST`: sorted, with `""` for the default
    /// export if there is one.
    pub fn export_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.exports.keys().cloned().collect();
        if self.default_export.is_some() && !self.exports.contains_key("") {
            names.push(String::new());
        }
        names.sort();
        names
    }

    /// Run one connection to completion.
    ///
    /// Needs a tokio runtime with its time driver enabled (the handshake is bounded by
    /// [`HANDSHAKE_TIMEOUT`]).
    ///
    /// Returns `Ok(())` when the client disconnects cleanly (`NBD_OPT_ABORT`,
    /// `NBD_CMD_DISC`, or EOF between messages); errors mean the connection
    /// was dropped for a protocol violation or socket failure. Either way
    /// only this connection is affected.
    pub async fn serve<S: AsyncRead + AsyncWrite + Unpin + Send>(
        &self,
        stream: S,
    ) -> Result<(), NbdError> {
        // A client that connects and never finishes negotiating holds a connection and a
        // task for nothing: bounded, so that idle connections cannot pile up. (The
        // transmission phase has no such bound: a guest may leave its disk idle for hours.)
        let handshake = self.handshake(MaybeTls::Plain(stream));
        let limit = self.handshake_timeout;
        let Some((session, conn)) = tokio::time::timeout(limit, handshake)
            .await
            .map_err(|_| NbdError::HandshakeTimeout(limit))??
        else {
            return Ok(());
        };
        let (r, w) = tokio::io::split(conn);
        let r = BufReader::with_capacity(64 * 1024, r);
        let w = BufWriter::with_capacity(64 * 1024, w);
        transmission(session, r, w).await
    }

    /// How long a client may take to finish the handshake (default [`HANDSHAKE_TIMEOUT`]).
    pub fn set_handshake_timeout(&mut self, limit: std::time::Duration) {
        self.handshake_timeout = limit;
    }

    /// Serve only over TLS from now on (the spec's FORCEDTLS mode; see [`crate::tls`]).
    pub fn set_tls(&mut self, tls: TlsConfig) {
        self.tls = Some(tls);
    }

    /// Whether connections must start TLS.
    pub fn tls(&self) -> Option<&TlsConfig> {
        self.tls.as_ref()
    }

    /// Fixed-newstyle handshake and option haggling, upgrading the connection to TLS on
    /// `NBD_OPT_STARTTLS`. The stream is read unbuffered here, so nothing a client sends
    /// after STARTTLS is consumed as plain text. `None` means the client aborted (soft
    /// disconnect).
    async fn handshake<S>(
        &self,
        mut conn: MaybeTls<S>,
    ) -> Result<Option<(Session, MaybeTls<S>)>, NbdError>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        conn.write_all(&encode_greeting(
            NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES,
        ))
        .await?;
        conn.flush().await?;
        let mut buf = [0u8; 4];
        conn.read_exact(&mut buf).await?;
        let cf = decode_client_flags(&buf)?;
        if !cf.fixed_newstyle {
            return Err(NbdError::NotFixedNewstyle);
        }
        let fresh = || Negotiated {
            no_zeroes: cf.no_zeroes,
            structured: false,
            meta_export: None,
        };
        let mut st = fresh();
        // Replies of one option, written out together.
        let mut out: Vec<u8> = Vec::new();
        loop {
            let mut hdr = [0u8; OPTION_HEADER_LEN];
            conn.read_exact(&mut hdr).await?;
            let h = decode_option_header(&hdr)?;
            let mut data = vec![0u8; h.len as usize];
            conn.read_exact(&mut data).await?;
            trace!(option = h.option, len = h.len, "nbd option");
            out.clear();
            let outcome = if self.tls.is_some()
                && !conn.is_tls()
                && !matches!(h.option, NBD_OPT_STARTTLS | NBD_OPT_ABORT)
            {
                if h.option == NBD_OPT_EXPORT_NAME {
                    // EXPORT_NAME cannot carry an error: end the session.
                    return Err(NbdError::TlsRequired);
                }
                let msg = "TLS is required: send NBD_OPT_STARTTLS first";
                reply_err(&mut out, h.option, NBD_REP_ERR_TLS_REQD, msg).await?;
                OptOutcome::Continue
            } else {
                match decode_option(h.option, &data) {
                    Ok(req) => {
                        self.handle_option(h.option, req, &mut st, conn.is_tls(), &mut out)
                            .await?
                    }
                    Err(e) => {
                        if h.option == NBD_OPT_EXPORT_NAME {
                            // EXPORT_NAME cannot carry an error reply.
                            return Err(e.into());
                        }
                        if h.option == NBD_OPT_SET_META_CONTEXT {
                            // SET replaces the selection even when it fails, a malformed
                            // request included (found by the session fuzzer: a second SET
                            // with a mutated query count left the first one selected).
                            st.meta_export = None;
                        }
                        reply_err(&mut out, h.option, NBD_REP_ERR_INVALID, &e.to_string()).await?;
                        OptOutcome::Continue
                    }
                }
            };
            conn.write_all(&out).await?;
            conn.flush().await?;
            match outcome {
                OptOutcome::Continue => {}
                OptOutcome::Abort => return Ok(None),
                OptOutcome::StartTls => {
                    let tls = self
                        .tls
                        .as_ref()
                        .expect("STARTTLS is acknowledged only with TLS");
                    conn = match conn {
                        MaybeTls::Plain(s) => MaybeTls::Tls(Box::new(
                            tls.acceptor
                                .accept(s)
                                .await
                                .map_err(NbdError::TlsHandshake)?,
                        )),
                        MaybeTls::Tls(_) => unreachable!("STARTTLS is refused once TLS is on"),
                    };
                    debug!("nbd: TLS started");
                    // Nothing negotiated before TLS counts after it.
                    st = fresh();
                }
                OptOutcome::Go(sel) => {
                    let base_allocation =
                        st.structured && st.meta_export.as_deref() == Some(sel.name.as_str());
                    let size = sel.export.size();
                    debug!(export = %sel.name, size, structured = st.structured, base_allocation, tls = conn.is_tls(), "nbd transmission");
                    return Ok(Some((
                        Session {
                            export: sel.export,
                            size,
                            structured: st.structured,
                            base_allocation,
                        },
                        conn,
                    )));
                }
            }
        }
    }

    async fn handle_option<W: AsyncWrite + Unpin>(
        &self,
        option: u32,
        req: OptionRequest,
        st: &mut Negotiated,
        tls_on: bool,
        w: &mut W,
    ) -> Result<OptOutcome, NbdError> {
        match req {
            OptionRequest::ExportName(name) => {
                let Some(export) = self.lookup(&name) else {
                    return Err(NbdError::UnknownExport(name));
                };
                let flags = transmission_flags(export.as_ref(), st.structured);
                w.write_all(&encode_export_name_reply(
                    export.size(),
                    flags,
                    st.no_zeroes,
                ))
                .await?;
                return Ok(OptOutcome::Go(Selected { name, export }));
            }
            OptionRequest::Abort => {
                reply(w, option, NBD_REP_ACK, &[]).await?;
                return Ok(OptOutcome::Abort);
            }
            OptionRequest::List => {
                for name in self.export_names() {
                    let desc = self.descriptions.get(&name).map(String::as_str);
                    reply(w, option, NBD_REP_SERVER, &encode_rep_server(&name, desc)).await?;
                }
                reply(w, option, NBD_REP_ACK, &[]).await?;
            }
            OptionRequest::StartTls => {
                if self.tls.is_none() {
                    let msg = "TLS is not configured on this server";
                    reply_err(w, option, NBD_REP_ERR_POLICY, msg).await?;
                } else if tls_on {
                    reply_err(w, option, NBD_REP_ERR_INVALID, "TLS is already on").await?;
                } else {
                    reply(w, option, NBD_REP_ACK, &[]).await?;
                    return Ok(OptOutcome::StartTls);
                }
            }
            OptionRequest::StructuredReply => {
                st.structured = true;
                reply(w, option, NBD_REP_ACK, &[]).await?;
            }
            OptionRequest::Info(info) | OptionRequest::Go(info) => {
                return self.reply_info(option, info, st, w).await;
            }
            OptionRequest::ListMetaContext(m) | OptionRequest::SetMetaContext(m) => {
                return self.reply_meta_context(option, m, st, w).await;
            }
            OptionRequest::Unknown(o) => {
                let msg = format!("option {o} is not supported");
                reply_err(w, option, NBD_REP_ERR_UNSUP, &msg).await?;
            }
        }
        Ok(OptOutcome::Continue)
    }

    /// `NBD_OPT_INFO` / `NBD_OPT_GO`: describe the export; GO also selects it.
    async fn reply_info<W: AsyncWrite + Unpin>(
        &self,
        option: u32,
        info: InfoRequest,
        st: &Negotiated,
        w: &mut W,
    ) -> Result<OptOutcome, NbdError> {
        let Some(export) = self.lookup(&info.name) else {
            let msg = format!("unknown export {:?}", info.name);
            reply_err(w, option, NBD_REP_ERR_UNKNOWN, &msg).await?;
            return Ok(OptOutcome::Continue);
        };
        let flags = transmission_flags(export.as_ref(), st.structured);
        reply(
            w,
            option,
            NBD_REP_INFO,
            &encode_info_export(export.size(), flags),
        )
        .await?;
        // Always advertise our (default-compatible) constraints;
        // clients ignore info they did not ask for.
        let pref = export.preferred_block_size().clamp(512, MAX_PAYLOAD);
        reply(
            w,
            option,
            NBD_REP_INFO,
            &encode_info_block_size(1, pref, MAX_PAYLOAD),
        )
        .await?;
        if info.info_requests.contains(&NBD_INFO_NAME) {
            reply(
                w,
                option,
                NBD_REP_INFO,
                &encode_info_string(NBD_INFO_NAME, &info.name),
            )
            .await?;
        }
        if info.info_requests.contains(&NBD_INFO_DESCRIPTION) {
            if let Some(d) = self.descriptions.get(&info.name) {
                reply(
                    w,
                    option,
                    NBD_REP_INFO,
                    &encode_info_string(NBD_INFO_DESCRIPTION, d),
                )
                .await?;
            }
        }
        reply(w, option, NBD_REP_ACK, &[]).await?;
        if option == NBD_OPT_GO {
            return Ok(OptOutcome::Go(Selected {
                name: info.name,
                export,
            }));
        }
        Ok(OptOutcome::Continue)
    }

    /// `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`: only `base:allocation` exists.
    async fn reply_meta_context<W: AsyncWrite + Unpin>(
        &self,
        option: u32,
        m: MetaContextRequest,
        st: &mut Negotiated,
        w: &mut W,
    ) -> Result<OptOutcome, NbdError> {
        let set = option == NBD_OPT_SET_META_CONTEXT;
        if set {
            // SET replaces the selection even when it fails.
            st.meta_export = None;
        }
        if !st.structured {
            let msg = "structured replies must be negotiated first";
            reply_err(w, option, NBD_REP_ERR_INVALID, msg).await?;
            return Ok(OptOutcome::Continue);
        }
        if self.lookup(&m.name).is_none() {
            let msg = format!("unknown export {:?}", m.name);
            reply_err(w, option, NBD_REP_ERR_UNKNOWN, &msg).await?;
            return Ok(OptOutcome::Continue);
        }
        let matched = if set {
            m.queries.iter().any(|q| q == BASE_ALLOCATION)
        } else {
            m.queries.is_empty()
                || m.queries
                    .iter()
                    .any(|q| q == "base:" || q == BASE_ALLOCATION)
        };
        if matched {
            let id = if set { BASE_ALLOCATION_ID } else { 0 };
            reply(
                w,
                option,
                NBD_REP_META_CONTEXT,
                &encode_rep_meta_context(id, BASE_ALLOCATION),
            )
            .await?;
            if set {
                st.meta_export = Some(m.name);
            }
        }
        reply(w, option, NBD_REP_ACK, &[]).await?;
        Ok(OptOutcome::Continue)
    }
}

enum OptOutcome {
    Continue,
    Abort,
    StartTls,
    Go(Selected),
}

async fn reply<W: AsyncWrite + Unpin>(
    w: &mut W,
    option: u32,
    reply_type: u32,
    data: &[u8],
) -> io::Result<()> {
    w.write_all(&encode_option_reply(option, reply_type, data))
        .await
}

async fn reply_err<W: AsyncWrite + Unpin>(
    w: &mut W,
    option: u32,
    reply_type: u32,
    msg: &str,
) -> io::Result<()> {
    debug!(option, reply_type, msg, "nbd option error");
    let mut end = msg.len().min(MAX_STRING_LEN);
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    reply(w, option, reply_type, &msg.as_bytes()[..end]).await
}

/// Transmission flags for `export`; DF only makes sense with structured
/// replies (and the spec forbids it otherwise).
fn transmission_flags(export: &dyn Export, structured: bool) -> u16 {
    let mut f = NBD_FLAG_HAS_FLAGS
        | NBD_FLAG_SEND_FLUSH
        | NBD_FLAG_SEND_FUA
        | NBD_FLAG_SEND_TRIM
        | NBD_FLAG_SEND_WRITE_ZEROES
        | NBD_FLAG_SEND_CACHE;
    if export.read_only() {
        f |= NBD_FLAG_READ_ONLY;
    }
    if export.multi_conn() {
        f |= NBD_FLAG_CAN_MULTI_CONN;
    }
    if structured {
        f |= NBD_FLAG_SEND_DF;
    }
    f
}

// ================================================================ transmission

/// Tells the export a client is attached for as long as it lives (the transmission phase).
struct Attached(Arc<dyn Export>);

impl Attached {
    fn new(export: Arc<dyn Export>) -> Self {
        export.client_attached(true);
        Attached(export)
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        self.0.client_attached(false);
    }
}

async fn transmission<R, W>(session: Session, r: R, w: W) -> Result<(), NbdError>
where
    R: AsyncRead + Unpin + Send,
    W: AsyncWrite + Unpin + Send,
{
    let (tx, rx) = mpsc::unbounded_channel::<Reply>();
    let _attached = Attached::new(session.export.clone());
    let session = Arc::new(session);
    let reader = read_loop(session, r, tx);
    let writer = write_loop(rx, w);
    tokio::pin!(reader, writer);
    tokio::select! {
        res = &mut reader => {
            // Reader finished (DISC, EOF, or violation) and dropped its
            // sender; on a clean end, let in-flight requests finish and
            // their replies go out.
            res?;
            match writer.await {
                Ok(()) => Ok(()),
                // The client may legitimately have gone away already.
                Err(e) => {
                    debug!(error = %e, "nbd: could not deliver final replies");
                    Ok(())
                }
            }
        }
        res = &mut writer => {
            // The writer only ends early if the socket broke.
            res.map_err(NbdError::from)
        }
    }
}

async fn write_loop<W: AsyncWrite + Unpin>(
    mut rx: mpsc::UnboundedReceiver<Reply>,
    mut w: W,
) -> io::Result<()> {
    while let Some(reply) = rx.recv().await {
        for f in &reply.frames {
            w.write_all(f).await?;
        }
        drop(reply);
        // Batch: only flush when nothing else is immediately ready.
        if rx.is_empty() {
            w.flush().await?;
        }
    }
    w.flush().await?;
    let _ = w.shutdown().await;
    Ok(())
}

async fn read_loop<R: AsyncRead + Unpin>(
    session: Arc<Session>,
    mut r: R,
    tx: mpsc::UnboundedSender<Reply>,
) -> Result<(), NbdError> {
    let budget = Arc::new(Semaphore::new(BUDGET_UNITS as usize));
    loop {
        let mut hdr = [0u8; REQUEST_LEN];
        match read_exact_or_eof(&mut r, &mut hdr).await? {
            ReadOutcome::Eof => return Ok(()),
            ReadOutcome::Full => {}
        }
        let req = decode_request(&hdr)?;
        trace!(?req, "nbd request");
        if req.command == NBD_CMD_DISC {
            return Ok(());
        }
        // Reserve budget before allocating anything for this request.
        let units = 1 + (req.len.min(MAX_PAYLOAD) / BUDGET_UNIT);
        let permit = budget
            .clone()
            .acquire_many_owned(units)
            .await
            .map_err(|_| io::Error::other("budget closed"))?;
        let mut payload = Bytes::new();
        if req.command == NBD_CMD_WRITE {
            if req.len > MAX_PAYLOAD {
                // We cannot skip an attacker-sized payload cheaply; the spec
                // allows a hard disconnect for denial-of-service lengths.
                return Err(ProtocolError::Malformed("write payload over 32 MiB").into());
            }
            let mut buf = vec![0u8; req.len as usize];
            r.read_exact(&mut buf).await?;
            payload = Bytes::from(buf);
        }
        let frames_for = |res: Result<Vec<Bytes>, (u32, String)>| match res {
            Ok(frames) => frames,
            Err((errno, msg)) => error_reply(session.structured, req.cookie, errno, &msg),
        };
        if let Err(e) = validate(&session, &req) {
            let _ = tx.send(Reply {
                frames: frames_for(Err(e)),
                _permit: Some(permit),
            });
            continue;
        }
        let session2 = session.clone();
        let tx2 = tx.clone();
        let structured = session.structured;
        tokio::spawn(async move {
            // Run the export call in its own task so a panicking export
            // turns into an EIO reply instead of a hung request.
            let work = tokio::spawn(execute(session2, req, payload));
            let frames = match work.await {
                Ok(Ok(frames)) => frames,
                Ok(Err((errno, msg))) => error_reply(structured, req.cookie, errno, &msg),
                Err(e) => error_reply(structured, req.cookie, NBD_EIO, &e.to_string()),
            };
            let _ = tx2.send(Reply {
                frames,
                _permit: Some(permit),
            });
        });
    }
}

enum ReadOutcome {
    Full,
    Eof,
}

/// Like `read_exact`, but a clean EOF before the first byte is not an error.
async fn read_exact_or_eof<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut [u8],
) -> io::Result<ReadOutcome> {
    let mut got = 0;
    while got < buf.len() {
        let n = r.read(&mut buf[got..]).await?;
        if n == 0 {
            if got == 0 {
                return Ok(ReadOutcome::Eof);
            }
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        got += n;
    }
    Ok(ReadOutcome::Full)
}

type ReqResult = Result<Vec<Bytes>, (u32, String)>;

/// Checks done before touching the export: command, flags, length, range,
/// permissions.
fn validate(s: &Session, req: &Request) -> Result<(), (u32, String)> {
    let einval = |m: &str| Err((NBD_EINVAL, m.to_string()));
    let allowed = match req.command {
        NBD_CMD_READ if s.structured => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_DF,
        NBD_CMD_READ | NBD_CMD_WRITE | NBD_CMD_FLUSH | NBD_CMD_TRIM | NBD_CMD_CACHE => {
            NBD_CMD_FLAG_FUA
        }
        NBD_CMD_WRITE_ZEROES => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_NO_HOLE,
        NBD_CMD_BLOCK_STATUS => NBD_CMD_FLAG_FUA | NBD_CMD_FLAG_REQ_ONE,
        _ => return einval("unknown command"),
    };
    if req.flags & !allowed != 0 {
        return einval("unsupported command flags");
    }
    if req.command == NBD_CMD_FLUSH {
        return Ok(());
    }
    if req.len == 0 {
        return einval("zero-length request");
    }
    if matches!(req.command, NBD_CMD_READ | NBD_CMD_WRITE) && req.len > MAX_PAYLOAD {
        return einval("request exceeds the 32 MiB maximum payload");
    }
    let writes = matches!(
        req.command,
        NBD_CMD_WRITE | NBD_CMD_WRITE_ZEROES | NBD_CMD_TRIM
    );
    if writes && s.export.read_only() {
        return Err((NBD_EPERM, "export is read-only".into()));
    }
    let in_bounds = req
        .offset
        .checked_add(req.len as u64)
        .is_some_and(|end| end <= s.size);
    if !in_bounds {
        let errno = if matches!(req.command, NBD_CMD_WRITE | NBD_CMD_WRITE_ZEROES) {
            NBD_ENOSPC
        } else {
            NBD_EINVAL
        };
        return Err((errno, "request beyond the end of the export".into()));
    }
    if req.command == NBD_CMD_BLOCK_STATUS && !(s.structured && s.base_allocation) {
        return einval("base:allocation was not negotiated");
    }
    Ok(())
}

/// Perform a validated request against the export and build its reply.
async fn execute(s: Arc<Session>, req: Request, payload: Bytes) -> ReqResult {
    let fua = req.flags & NBD_CMD_FLAG_FUA != 0;
    let e = &s.export;
    let ok = || {
        Ok(vec![Bytes::copy_from_slice(&encode_simple_reply(
            0, req.cookie,
        ))])
    };
    match req.command {
        NBD_CMD_READ => {
            let data = e.read(req.offset, req.len).await.map_err(io_errno)?;
            if data.len() != req.len as usize {
                return Err((NBD_EIO, "export returned a short read".into()));
            }
            if !s.structured {
                return Ok(vec![
                    Bytes::copy_from_slice(&encode_simple_reply(0, req.cookie)),
                    data,
                ]);
            }
            if data.iter().all(|&b| b == 0) {
                return Ok(vec![encode_offset_hole(
                    req.cookie,
                    NBD_REPLY_FLAG_DONE,
                    req.offset,
                    req.len,
                )]);
            }
            Ok(vec![
                encode_offset_data_header(req.cookie, NBD_REPLY_FLAG_DONE, req.offset, req.len),
                data,
            ])
        }
        NBD_CMD_WRITE => {
            e.write(req.offset, payload, fua).await.map_err(io_errno)?;
            ok()
        }
        NBD_CMD_FLUSH => {
            e.flush().await.map_err(io_errno)?;
            ok()
        }
        NBD_CMD_TRIM => {
            e.trim(req.offset, req.len).await.map_err(io_errno)?;
            if fua {
                e.flush().await.map_err(io_errno)?;
            }
            ok()
        }
        NBD_CMD_WRITE_ZEROES => {
            let may_trim = req.flags & NBD_CMD_FLAG_NO_HOLE == 0;
            e.write_zeroes(req.offset, req.len, may_trim, fua)
                .await
                .map_err(io_errno)?;
            ok()
        }
        NBD_CMD_CACHE => {
            e.cache(req.offset, req.len).await.map_err(io_errno)?;
            ok()
        }
        NBD_CMD_BLOCK_STATUS => {
            // Never let the export describe bytes past the end.
            let avail = (s.size - req.offset).min(req.len as u64) as u32;
            let extents = e.block_status(req.offset, avail).await.map_err(io_errno)?;
            let req_one = req.flags & NBD_CMD_FLAG_REQ_ONE != 0;
            let descs = clip_extents(&extents, avail, req_one);
            if descs.is_empty() {
                return Err((NBD_EIO, "export reported no extents".into()));
            }
            Ok(vec![encode_block_status(
                req.cookie,
                NBD_REPLY_FLAG_DONE,
                BASE_ALLOCATION_ID,
                &descs,
            )])
        }
        _ => Err((NBD_EINVAL, "unknown command".into())),
    }
}

/// Turn export extents into wire descriptors covering at most `limit` bytes:
/// drop empty extents, stop once `limit` is reached (clipping the last),
/// keep one if `req_one`, and cap the count.
fn clip_extents(
    extents: &[crate::export::Extent],
    limit: u32,
    req_one: bool,
) -> Vec<BlockDescriptor> {
    let mut out = Vec::new();
    let mut covered: u32 = 0;
    for ex in extents.iter().filter(|x| x.len > 0) {
        if covered >= limit || out.len() >= MAX_EXTENTS {
            break;
        }
        let len = ex.len.min(limit - covered);
        covered += len;
        match out.last_mut() {
            Some(BlockDescriptor { len: l, flags }) if *flags == ex.flags() => *l += len,
            _ => out.push(BlockDescriptor {
                len,
                flags: ex.flags(),
            }),
        }
        if req_one && out.len() > 1 {
            break;
        }
    }
    if req_one {
        // One descriptor (same-status neighbours were merged into it).
        out.truncate(1);
    }
    out
}

/// The error reply for `cookie`: an error chunk when structured replies are
/// on (the message reaches the user), else a simple reply.
fn error_reply(structured: bool, cookie: u64, errno: u32, msg: &str) -> Vec<Bytes> {
    debug!(cookie, errno, msg, "nbd request failed");
    if structured {
        vec![encode_error_chunk(cookie, errno, msg)]
    } else {
        vec![Bytes::copy_from_slice(&encode_simple_reply(errno, cookie))]
    }
}

/// Map an export's `io::Error` to an NBD error code.
pub fn io_errno(e: io::Error) -> (u32, String) {
    let code = match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) | Some(libc::EROFS) => NBD_EPERM,
        Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => NBD_ENOSPC,
        Some(libc::EINVAL) => NBD_EINVAL,
        Some(libc::EOVERFLOW) => NBD_EOVERFLOW,
        Some(libc::ESHUTDOWN) => NBD_ESHUTDOWN,
        Some(_) => NBD_EIO,
        None => match e.kind() {
            io::ErrorKind::PermissionDenied => NBD_EPERM,
            io::ErrorKind::InvalidInput => NBD_EINVAL,
            _ => NBD_EIO,
        },
    };
    (code, e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::Extent;

    #[test]
    fn errno_mapping() {
        assert_eq!(
            io_errno(io::Error::from_raw_os_error(libc::EPERM)).0,
            NBD_EPERM
        );
        assert_eq!(
            io_errno(io::Error::from_raw_os_error(libc::EDQUOT)).0,
            NBD_ENOSPC
        );
        assert_eq!(
            io_errno(io::Error::from_raw_os_error(libc::EOVERFLOW)).0,
            NBD_EOVERFLOW
        );
        assert_eq!(
            io_errno(io::Error::from_raw_os_error(libc::ENOENT)).0,
            NBD_EIO
        );
        assert_eq!(io_errno(io::Error::other("x")).0, NBD_EIO);
        assert_eq!(io_errno(io::ErrorKind::InvalidInput.into()).0, NBD_EINVAL);
        assert_eq!(
            io_errno(io::ErrorKind::PermissionDenied.into()).0,
            NBD_EPERM
        );
    }

    #[test]
    fn extents_are_clipped() {
        let x = |len, hole| Extent {
            len,
            hole,
            zero: hole,
        };
        let ext = [x(100, true), x(0, false), x(50, true), x(200, false)];
        assert_eq!(
            clip_extents(&ext, 1000, false),
            vec![
                BlockDescriptor { len: 150, flags: 3 },
                BlockDescriptor { len: 200, flags: 0 }
            ]
        );
        assert_eq!(
            clip_extents(&ext, 120, false),
            vec![BlockDescriptor { len: 120, flags: 3 }]
        );
        assert_eq!(
            clip_extents(&ext, 1000, true),
            vec![BlockDescriptor { len: 150, flags: 3 }]
        );
        assert!(clip_extents(&[x(0, true)], 10, false).is_empty());
    }
}

//! Mutation fuzzing of the NBD server's network-facing decoding: the option haggling of the
//! fixed-newstyle handshake and the transmission-phase request decoding. Valid client
//! transcripts (client flags, `LIST`, `INFO`/`GO` with info requests, `LIST`/`SET_META_CONTEXT`,
//! `STRUCTURED_REPLY`, `EXPORT_NAME`, `ABORT`, then `READ`, `WRITE` with its payload, `FLUSH`,
//! `TRIM`, `WRITE_ZEROES`, `BLOCK_STATUS`, `CACHE`, `DISC`) are mutated (bit flips, length and
//! count fields overwritten with values such as `0xFFFFFFFF`, truncation, insertion, deletion,
//! duplicated messages) or replaced by random bytes, and fed to [`Server::serve`] over an
//! in-memory duplex whose write side is then closed. For every case the server must return
//! within 5 s (a hang fails), must not panic (a `JoinError::is_panic` fails), and must not
//! allocate an attacker-chosen size: the test process runs under an address-space limit
//! (`RLIMIT_AS`, [`HEADROOM`] above its size at start) far below the 4 GiB a 32-bit length
//! field can name, so such an allocation aborts the test binary ("memory allocation of N bytes
//! failed"). What the server wrote is also checked against the spec where that is cheap: the
//! greeting first; every option answered by replies for that option ending in one final
//! reply (`ACK` or an error), `NBD_INFO_EXPORT` before a successful `INFO`/`GO`,
//! `NBD_REP_ERR_UNSUP` for unknown options, `NBD_REP_ERR_TLS_REQD` before `STARTTLS` on a
//! TLS server; a hard disconnect (no further output, an `Err`) on bad magic, unknown client
//! flags, an option over [`MAX_OPTION_LEN`], a `WRITE` over [`MAX_PAYLOAD`] or input cut short;
//! well-framed transmission replies, structured only when negotiated, to cookies that were
//! sent, with errors from {`EPERM`, `EINVAL`, `ENOSPC`} (an `EIO` would mean an export call
//! panicked), and, when the client ended cleanly (`DISC` or EOF between requests), exactly one
//! final reply per request and an `Ok` from `serve`. Deterministic regression tests pin the
//! outcome of specific hostile inputs.
//!
//! `CAIRN_FUZZ_CASES` sets the number of cases per property (default 256);
//! `CAIRN_FUZZ_LOG=1` prints every input before it runs (an abort on the address-space limit
//! leaves no proptest report behind).

mod common;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use cairn_nbd::protocol::*;
use cairn_nbd::{MemoryExport, Server, TlsConfig};
use common::patterned;
use proptest::prelude::*;
use proptest::sample::Index;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Size of the writable export `disk` (also the default export).
const DISK: u64 = 256 * 1024;
/// Size of the read-only export `ro`.
const RO: u64 = 64 * 1024;
/// A case that has not finished after this long is a hang.
const CASE_TIMEOUT: Duration = Duration::from_secs(5);
/// More output than any case can legitimately produce.
const MAX_OUTPUT: usize = 64 << 20;
/// Address space the test process may grow by once the fuzzing starts: room for the
/// runtime's threads and malloc arenas and for the server's own bounded buffers (a 32 MiB
/// WRITE payload, a 64 KiB option, the in-flight budget), but not for the 4 GiB a hostile
/// 32-bit length can name.
const HEADROOM: u64 = 2 << 30;
/// The only errors a [`MemoryExport`] behind this server can produce.
const ALLOWED_ERRORS: [u32; 3] = [NBD_EPERM, NBD_EINVAL, NBD_ENOSPC];

// ================================================================ running one connection

fn rt() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        common::limit_address_space(HEADROOM);
        rt
    })
}

/// A server certificate for the TLS-configured server, made once.
fn tls_config() -> TlsConfig {
    static TLS: OnceLock<(tempfile::TempDir, TlsConfig)> = OnceLock::new();
    TLS.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        let cert = dir.path().join("cert.pem");
        let key = dir.path().join("key.pem");
        std::fs::write(&cert, ck.cert.pem()).unwrap();
        std::fs::write(&key, ck.signing_key.serialize_pem()).unwrap();
        let tls = TlsConfig::from_pem_files(&cert, &key, None).unwrap();
        (dir, tls)
    })
    .1
    .clone()
}

/// A fresh server (so that cases do not share export contents): `disk` (writable, also the
/// default export, with a description), `ro` (read-only); in FORCEDTLS mode with `tls`.
fn server(tls: bool) -> Arc<Server> {
    let disk = Arc::new(MemoryExport::from_vec(patterned(DISK as usize)));
    let ro = Arc::new(MemoryExport::from_vec(patterned(RO as usize)).read_only(true));
    let mut s = Server::new()
        .with_export("disk", disk.clone())
        .with_export("ro", ro)
        .with_default_export(disk);
    s.set_description("disk", "the fuzzed disk");
    if tls {
        s.set_tls(tls_config());
    }
    Arc::new(s)
}

/// What one connection did.
#[derive(Debug)]
struct Run {
    /// Everything the server wrote.
    out: Vec<u8>,
    /// How `Server::serve` ended: `Ok`, or the error as text.
    result: Result<(), String>,
}

/// Serve one connection whose client sends `input`, closes its write side and reads until
/// the server hangs up. Panics on a hang, a server panic or unbounded output.
async fn drive(server: Arc<Server>, input: Vec<u8>) -> Run {
    let (client, conn) = tokio::io::duplex(64 * 1024);
    let task = tokio::spawn(async move { server.serve(conn).await });
    let abort = task.abort_handle();
    let n_in = input.len();
    let io = async move {
        let (mut rd, mut wr) = tokio::io::split(client);
        let send = async move {
            // The server may hang up before reading it all: a broken pipe is expected.
            let _ = wr.write_all(&input).await;
            let _ = wr.shutdown().await;
            wr
        };
        let recv = async move {
            let mut out = Vec::new();
            let mut buf = vec![0u8; 64 * 1024];
            loop {
                let n = rd.read(&mut buf).await.expect("reading a duplex");
                if n == 0 {
                    return out;
                }
                out.extend_from_slice(&buf[..n]);
                assert!(
                    out.len() <= MAX_OUTPUT,
                    "the server wrote over {MAX_OUTPUT} bytes"
                );
            }
        };
        let (_wr, out) = tokio::join!(send, recv);
        out
    };
    let Ok(out) = tokio::time::timeout(CASE_TIMEOUT, io).await else {
        abort.abort();
        panic!("hang: the connection was still open {CASE_TIMEOUT:?} after the client sent {n_in} bytes and closed its side");
    };
    let Ok(joined) = tokio::time::timeout(CASE_TIMEOUT, task).await else {
        abort.abort();
        panic!("hang: the server closed the connection but serve() did not return");
    };
    let result = match joined {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(e) if e.is_panic() => {
            let p = e.into_panic();
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            panic!("the server panicked: {msg}");
        }
        Err(e) => panic!("server task: {e}"),
    };
    Run { out, result }
}

/// Run `input` against a fresh server and check the output against the spec.
fn run_checked(input: &[u8], tls: bool) -> (Run, Parsed) {
    if std::env::var_os("CAIRN_FUZZ_LOG").is_some() {
        eprintln!("case (tls {tls}): {}", hex(input));
    }
    let run = rt().block_on(drive(server(tls), input.to_vec()));
    match check(input, &run, tls) {
        Ok(p) => (run, p),
        Err(e) => panic!(
            "{e}\ninput ({} bytes): {}\nserve: {:?}\noutput ({} bytes): {}",
            input.len(),
            hex(&input[..input.len().min(4096)]),
            run.result,
            run.out.len(),
            hex(&run.out[..run.out.len().min(4096)]),
        ),
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

// ================================================================ the oracle

/// One transmission reply message.
#[derive(Debug, Clone)]
struct Msg {
    cookie: u64,
    /// NBD error (0 on success); for a structured chunk, the error chunk's code.
    error: u32,
    /// Final message of its reply (always, for a simple reply).
    done: bool,
    /// `None` for a simple reply, else the chunk type.
    chunk: Option<u16>,
    /// READ data of a simple reply, or the chunk payload.
    payload: Vec<u8>,
}

/// What the server said, as far as it could be framed.
#[derive(Debug, Default)]
struct Parsed {
    /// Option replies: (option, reply type, payload).
    options: Vec<(u32, u32, Vec<u8>)>,
    /// The reply to `NBD_OPT_EXPORT_NAME` (size, flags), if it was given.
    export_name: Option<(u64, u16)>,
    /// The context id the last `NBD_OPT_SET_META_CONTEXT` selected, if any.
    meta_id: Option<u32>,
    /// The handshake ended in transmission.
    transmission: bool,
    /// Transmission replies in arrival order.
    replies: Vec<Msg>,
}

impl Parsed {
    /// The single final reply to `cookie`.
    fn done(&self, cookie: u64) -> &Msg {
        let v: Vec<&Msg> = self
            .replies
            .iter()
            .filter(|m| m.cookie == cookie && m.done)
            .collect();
        assert_eq!(
            v.len(),
            1,
            "final replies to cookie {cookie}: {:?}",
            self.replies
        );
        v[0]
    }
}

/// A bounds-checked reader.
struct Rd<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Rd<'a> {
    fn new(b: &'a [u8]) -> Self {
        Rd { b, pos: 0 }
    }
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len())?;
        let s = &self.b[self.pos..end];
        self.pos = end;
        Some(s)
    }
    fn at_end(&self) -> bool {
        self.pos == self.b.len()
    }
    fn rest(&self) -> usize {
        self.b.len() - self.pos
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().unwrap())
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().unwrap())
}

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)*) => {
        if !$cond {
            return Err(format!($($fmt)*));
        }
    };
}

/// The server must have hung up here: nothing more on the wire, and `serve` failed.
fn hung_up(o: &Rd, run: &Run, why: &str, p: Parsed) -> Result<Parsed, String> {
    ensure!(
        o.at_end(),
        "{why}: the server should hang up, but wrote {} more bytes",
        o.rest()
    );
    ensure!(run.result.is_err(), "{why}: serve() returned Ok");
    Ok(p)
}

/// Options the server implements; anything else must get `NBD_REP_ERR_UNSUP`.
const KNOWN_OPTIONS: [u32; 9] = [
    NBD_OPT_EXPORT_NAME,
    NBD_OPT_ABORT,
    NBD_OPT_LIST,
    NBD_OPT_STARTTLS,
    NBD_OPT_INFO,
    NBD_OPT_GO,
    NBD_OPT_STRUCTURED_REPLY,
    NBD_OPT_LIST_META_CONTEXT,
    NBD_OPT_SET_META_CONTEXT,
];

/// Walks the client's bytes as the server must read them, and checks the server's output
/// against what the spec demands of each message.
fn check(input: &[u8], run: &Run, tls: bool) -> Result<Parsed, String> {
    let mut p = Parsed::default();
    let mut i = Rd::new(input);
    let mut o = Rd::new(&run.out);
    let g = o.take(GREETING_LEN).ok_or("no greeting")?;
    ensure!(
        g == encode_greeting(NBD_FLAG_FIXED_NEWSTYLE | NBD_FLAG_NO_ZEROES),
        "bad greeting"
    );
    let Some(f) = i.take(4) else {
        return hung_up(&o, run, "client flags cut short", p);
    };
    let flags = u32_at(f, 0);
    if flags & !(NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES) != 0
        || flags & NBD_FLAG_C_FIXED_NEWSTYLE == 0
    {
        return hung_up(&o, run, "unknown client flags or no fixed newstyle", p);
    }
    let no_zeroes = flags & NBD_FLAG_C_NO_ZEROES != 0;
    let mut structured = false;
    loop {
        let Some(h) = i.take(OPTION_HEADER_LEN) else {
            return hung_up(&o, run, "EOF during option haggling", p);
        };
        let (magic, option, len) = (u64_at(h, 0), u32_at(h, 8), u32_at(h, 12));
        if magic != IHAVEOPT {
            return hung_up(&o, run, "bad option magic", p);
        }
        if len > MAX_OPTION_LEN {
            // The spec lets a server hard-disconnect a client whose behaviour it considers a
            // denial of service; this one does so for an option over MAX_OPTION_LEN, before
            // allocating it.
            return hung_up(&o, run, "option length over MAX_OPTION_LEN", p);
        }
        if i.take(len as usize).is_none() {
            return hung_up(&o, run, "option data cut short", p);
        }
        if option == NBD_OPT_EXPORT_NAME {
            if tls {
                return hung_up(&o, run, "EXPORT_NAME before STARTTLS", p);
            }
            if o.at_end() {
                // Unknown export or a malformed name: EXPORT_NAME cannot carry an error.
                ensure!(
                    run.result.is_err(),
                    "EXPORT_NAME refused, yet serve() is Ok"
                );
                return Ok(p);
            }
            let n = if no_zeroes { 10 } else { 134 };
            let r = o.take(n).ok_or("EXPORT_NAME reply cut short")?;
            ensure!(r[10..].iter().all(|&b| b == 0), "reserved bytes not zero");
            let tflags = u16_at(r, 8);
            ensure!(tflags & NBD_FLAG_HAS_FLAGS != 0, "no NBD_FLAG_HAS_FLAGS");
            p.export_name = Some((u64_at(r, 0), tflags));
            return transmission(&mut i, &mut o, run, structured, p);
        }
        let mut export_info = false;
        let mut meta_id = None;
        let last = loop {
            let h = o
                .take(20)
                .ok_or_else(|| format!("option {option} got no final reply"))?;
            let r = decode_option_reply_header(h).map_err(|e| e.to_string())?;
            ensure!(
                r.option == option,
                "reply for option {} to option {option}",
                r.option
            );
            let payload = o
                .take(r.len as usize)
                .ok_or("option reply payload cut short")?;
            p.options.push((option, r.reply_type, payload.to_vec()));
            let info = matches!(option, NBD_OPT_INFO | NBD_OPT_GO);
            let meta = matches!(option, NBD_OPT_LIST_META_CONTEXT | NBD_OPT_SET_META_CONTEXT);
            match r.reply_type {
                NBD_REP_SERVER if option == NBD_OPT_LIST => {}
                NBD_REP_INFO if info => {
                    ensure!(payload.len() >= 2, "short NBD_REP_INFO");
                    if u16_at(payload, 0) == NBD_INFO_EXPORT {
                        ensure!(payload.len() == 12, "NBD_INFO_EXPORT of {}", payload.len());
                        export_info = true;
                    }
                }
                NBD_REP_META_CONTEXT if meta => {
                    ensure!(payload.len() > 4, "short NBD_REP_META_CONTEXT");
                    meta_id = Some(u32_at(payload, 0));
                }
                NBD_REP_ACK => break NBD_REP_ACK,
                t if t & NBD_REP_FLAG_ERROR != 0 => {
                    ensure!(payload.len() <= MAX_STRING_LEN, "error message too long");
                    break t;
                }
                t => return Err(format!("reply type {t:#x} to option {option}")),
            }
        };
        if tls && !matches!(option, NBD_OPT_STARTTLS | NBD_OPT_ABORT) {
            ensure!(
                last == NBD_REP_ERR_TLS_REQD,
                "option {option} before STARTTLS got {last:#x}"
            );
            continue;
        }
        if !KNOWN_OPTIONS.contains(&option) {
            ensure!(
                last == NBD_REP_ERR_UNSUP,
                "unknown option {option} got {last:#x}"
            );
        }
        match option {
            NBD_OPT_ABORT => {
                ensure!(last == NBD_REP_ACK, "ABORT got {last:#x}");
                ensure!(o.at_end(), "output after the ABORT acknowledgement");
                ensure!(
                    run.result.is_ok(),
                    "ABORT is a soft disconnect: {:?}",
                    run.result
                );
                return Ok(p);
            }
            NBD_OPT_STARTTLS if last == NBD_REP_ACK => {
                ensure!(tls, "STARTTLS acknowledged without TLS");
                // The rest is a TLS handshake over mutated bytes: only the absence of a
                // hang or a panic is checked.
                return Ok(p);
            }
            NBD_OPT_STRUCTURED_REPLY if last == NBD_REP_ACK => structured = true,
            // SET replaces the selection, even when it fails.
            NBD_OPT_SET_META_CONTEXT => p.meta_id = meta_id,
            NBD_OPT_INFO | NBD_OPT_GO if last == NBD_REP_ACK => {
                ensure!(export_info, "INFO/GO acknowledged without NBD_INFO_EXPORT");
                if option == NBD_OPT_GO {
                    return transmission(&mut i, &mut o, run, structured, p);
                }
            }
            _ => {}
        }
    }
}

/// The transmission phase: frames the replies and matches them to the requests sent.
fn transmission(
    i: &mut Rd,
    o: &mut Rd,
    run: &Run,
    structured: bool,
    mut p: Parsed,
) -> Result<Parsed, String> {
    p.transmission = true;
    // cookie -> every request the server must answer.
    let mut sent: HashMap<u64, Vec<Request>> = HashMap::new();
    let clean = loop {
        if i.at_end() {
            break true;
        }
        let Some(h) = i.take(REQUEST_LEN) else {
            break false;
        };
        let Ok(req) = decode_request(h) else {
            break false;
        };
        if req.command == NBD_CMD_DISC {
            break true;
        }
        if req.command == NBD_CMD_WRITE
            && (req.len > MAX_PAYLOAD || i.take(req.len as usize).is_none())
        {
            // An oversize payload cannot be skipped cheaply: a hard disconnect.
            break false;
        }
        sent.entry(req.cookie).or_default().push(req);
    };
    if clean {
        ensure!(
            run.result.is_ok(),
            "clean end, yet serve() failed: {:?}",
            run.result
        );
    } else {
        ensure!(run.result.is_err(), "protocol violation, yet serve() is Ok");
    }
    let mut finals: HashMap<u64, usize> = HashMap::new();
    // Bytes of a READ covered by data and hole chunks so far.
    let mut covered: HashMap<u64, u64> = HashMap::new();
    let cut = |what: &str| -> Result<(), String> {
        // Only a hard disconnect may leave a reply half-written.
        ensure!(!clean, "{what} cut short after a clean end");
        Ok(())
    };
    while !o.at_end() {
        let Some(m) = o.take(4) else {
            cut("reply magic")?;
            break;
        };
        let magic = u32_at(m, 0);
        if magic == SIMPLE_REPLY_MAGIC {
            let Some(h) = o.take(12) else {
                cut("simple reply")?;
                break;
            };
            let (error, cookie) = (u32_at(h, 0), u64_at(h, 4));
            let reqs = sent
                .get(&cookie)
                .ok_or_else(|| format!("reply to cookie {cookie:#x}, never sent"))?;
            let reads: Vec<u32> = reqs
                .iter()
                .filter(|r| r.command == NBD_CMD_READ)
                .map(|r| r.len)
                .collect();
            let mut payload = Vec::new();
            if !reads.is_empty() {
                if reads.len() != reqs.len() || reads.iter().any(|&l| l != reads[0]) {
                    // A mutated cookie shared by requests of different shapes: simple
                    // replies can no longer be framed. Stop checking here.
                    return Ok(p);
                }
                ensure!(
                    !structured,
                    "simple reply to a READ with structured replies on"
                );
                if error == 0 {
                    match o.take(reads[0] as usize) {
                        Some(d) => payload = d.to_vec(),
                        None => {
                            cut("READ data")?;
                            break;
                        }
                    }
                }
            }
            ensure!(
                error == 0 || ALLOWED_ERRORS.contains(&error),
                "error {error} to cookie {cookie:#x}"
            );
            *finals.entry(cookie).or_default() += 1;
            p.replies.push(Msg {
                cookie,
                error,
                done: true,
                chunk: None,
                payload,
            });
        } else if magic == STRUCTURED_REPLY_MAGIC {
            ensure!(
                structured,
                "structured reply without NBD_OPT_STRUCTURED_REPLY"
            );
            let Some(h) = o.take(16) else {
                cut("chunk header")?;
                break;
            };
            let (flags, ty, cookie, len) =
                (u16_at(h, 0), u16_at(h, 2), u64_at(h, 4), u32_at(h, 12));
            ensure!(
                len <= MAX_PAYLOAD + 64,
                "chunk of {len} bytes to cookie {cookie:#x}"
            );
            let Some(payload) = o.take(len as usize) else {
                cut("chunk payload")?;
                break;
            };
            let reqs = sent
                .get(&cookie)
                .ok_or_else(|| format!("chunk to cookie {cookie:#x}, never sent"))?;
            // The request this chunk answers, when its cookie was not reused.
            let only = (reqs.len() == 1).then(|| reqs[0]);
            let mut error = 0;
            match ty {
                NBD_REPLY_TYPE_NONE => ensure!(len == 0, "NONE chunk with a payload"),
                NBD_REPLY_TYPE_OFFSET_DATA | NBD_REPLY_TYPE_OFFSET_HOLE => {
                    let n = if ty == NBD_REPLY_TYPE_OFFSET_DATA {
                        ensure!(len > 8, "OFFSET_DATA of {len}");
                        len as u64 - 8
                    } else {
                        ensure!(len == 12, "OFFSET_HOLE of {len}");
                        u32_at(payload, 8) as u64
                    };
                    if let Some(r) = only {
                        let off = u64_at(payload, 0);
                        ensure!(
                            r.command == NBD_CMD_READ,
                            "data chunk to command {}",
                            r.command
                        );
                        ensure!(
                            off >= r.offset && off + n <= r.offset + r.len as u64,
                            "data chunk {off}+{n} outside READ {}+{}",
                            r.offset,
                            r.len
                        );
                        *covered.entry(cookie).or_default() += n;
                    }
                }
                NBD_REPLY_TYPE_BLOCK_STATUS => {
                    ensure!(len >= 12 && (len - 4) % 8 == 0, "BLOCK_STATUS of {len}");
                    let id = u32_at(payload, 0);
                    ensure!(
                        p.meta_id == Some(id),
                        "BLOCK_STATUS for context {id}, selected: {:?}",
                        p.meta_id
                    );
                    let lens: Vec<u64> = payload[4..]
                        .chunks(8)
                        .map(|d| u32_at(d, 0) as u64)
                        .collect();
                    ensure!(lens.iter().all(|&l| l > 0), "empty extent {lens:?}");
                    if let Some(r) = only {
                        ensure!(
                            r.command == NBD_CMD_BLOCK_STATUS,
                            "extents to {}",
                            r.command
                        );
                        let total: u64 = lens.iter().sum();
                        ensure!(total <= r.len as u64, "extents {lens:?} beyond {}", r.len);
                        if r.flags & NBD_CMD_FLAG_REQ_ONE != 0 {
                            ensure!(lens.len() == 1, "REQ_ONE answered with {lens:?}");
                        }
                    }
                }
                NBD_REPLY_TYPE_ERROR | NBD_REPLY_TYPE_ERROR_OFFSET => {
                    ensure!(len >= 6, "error chunk of {len}");
                    error = u32_at(payload, 0);
                    let msg = u16_at(payload, 4) as usize;
                    ensure!(
                        msg <= MAX_STRING_LEN && 6 + msg <= len as usize,
                        "error message"
                    );
                    ensure!(
                        ALLOWED_ERRORS.contains(&error),
                        "error {error} to cookie {cookie:#x}: {}",
                        String::from_utf8_lossy(&payload[6..6 + msg])
                    );
                }
                t => return Err(format!("chunk type {t:#x}")),
            }
            let done = flags & NBD_REPLY_FLAG_DONE != 0;
            if done {
                *finals.entry(cookie).or_default() += 1;
                let failed =
                    error != 0 || p.replies.iter().any(|m| m.cookie == cookie && m.error != 0);
                if let Some(r) = only.filter(|r| r.command == NBD_CMD_READ && !failed) {
                    // A successful structured READ describes every byte it was asked for.
                    let c = covered.get(&cookie).copied().unwrap_or(0);
                    ensure!(
                        c == r.len as u64,
                        "READ of {} answered with {c} bytes",
                        r.len
                    );
                }
            }
            p.replies.push(Msg {
                cookie,
                error,
                done,
                chunk: Some(ty),
                payload: payload.to_vec(),
            });
        } else {
            return Err(format!("bad reply magic {magic:#x}"));
        }
    }
    for (cookie, reqs) in &sent {
        let n = finals.get(cookie).copied().unwrap_or(0);
        ensure!(
            n <= reqs.len(),
            "{n} final replies to {} requests with cookie {cookie:#x}",
            reqs.len()
        );
        ensure!(
            !clean || n == reqs.len(),
            "{n} final replies to {} requests with cookie {cookie:#x} (clean end)",
            reqs.len()
        );
    }
    Ok(p)
}

// ================================================================ building transcripts

/// What a field of a transcript holds, for targeted mutation.
#[derive(Debug, Clone, Copy)]
struct Field {
    at: usize,
    width: usize,
    /// The valid value.
    actual: u64,
    /// An option, command or info code: small values are the interesting ones.
    code: bool,
}

/// Client bytes, with the positions of their length, count, code, flag and offset fields
/// and of the start of every message.
#[derive(Debug, Clone, Default)]
struct Transcript {
    bytes: Vec<u8>,
    fields: Vec<Field>,
    bounds: Vec<usize>,
}

impl Transcript {
    /// Client flags: the first message.
    fn new(flags: u32) -> Self {
        let mut t = Transcript::default();
        t.bounds.push(0);
        t.field(flags as u64, 4);
        t
    }

    fn field(&mut self, v: u64, width: usize) {
        self.push_field(v, width, false);
    }

    fn code(&mut self, v: u64, width: usize) {
        self.push_field(v, width, true);
    }

    fn push_field(&mut self, v: u64, width: usize, code: bool) {
        self.fields.push(Field {
            at: self.bytes.len(),
            width,
            actual: v,
            code,
        });
        self.bytes.extend_from_slice(&v.to_be_bytes()[8 - width..]);
    }

    fn raw(&mut self, b: &[u8]) {
        self.bytes.extend_from_slice(b);
    }

    fn append(&mut self, other: Transcript) {
        let base = self.bytes.len();
        self.fields.extend(other.fields.into_iter().map(|f| Field {
            at: f.at + base,
            ..f
        }));
        self.bytes.extend_from_slice(&other.bytes);
    }

    /// An option with `data` as its payload.
    fn opt(mut self, option: u32, data: Transcript) -> Self {
        self.bounds.push(self.bytes.len());
        self.raw(&IHAVEOPT.to_be_bytes());
        self.code(option as u64, 4);
        self.field(data.bytes.len() as u64, 4);
        self.append(data);
        self
    }

    fn opt_empty(self, option: u32) -> Self {
        self.opt(option, Transcript::default())
    }

    /// A transmission request; a WRITE carries `len` bytes of payload.
    fn req(mut self, flags: u16, command: u16, cookie: u64, offset: u64, len: u32) -> Self {
        self.bounds.push(self.bytes.len());
        self.raw(&REQUEST_MAGIC.to_be_bytes());
        self.field(flags as u64, 2);
        self.code(command as u64, 2);
        self.raw(&cookie.to_be_bytes());
        self.field(offset, 8);
        self.field(len as u64, 4);
        if command == NBD_CMD_WRITE {
            self.raw(&(0..len).map(|i| (i * 13 + 5) as u8).collect::<Vec<_>>());
        }
        self
    }
}

/// Payload of INFO/GO.
fn info(name: &str, infos: &[u16]) -> Transcript {
    let mut t = Transcript::default();
    t.field(name.len() as u64, 4);
    t.raw(name.as_bytes());
    t.field(infos.len() as u64, 2);
    for &i in infos {
        t.code(i as u64, 2);
    }
    t
}

/// Payload of LIST/SET_META_CONTEXT.
fn meta(name: &str, queries: &[&str]) -> Transcript {
    let mut t = Transcript::default();
    t.field(name.len() as u64, 4);
    t.raw(name.as_bytes());
    t.field(queries.len() as u64, 4);
    for q in queries {
        t.field(q.len() as u64, 4);
        t.raw(q.as_bytes());
    }
    t
}

fn bytes(b: &[u8]) -> Transcript {
    let mut t = Transcript::default();
    t.raw(b);
    t
}

const BOTH_FLAGS: u32 = NBD_FLAG_C_FIXED_NEWSTYLE | NBD_FLAG_C_NO_ZEROES;

/// Flags, structured replies, base:allocation on `name`, GO `name`.
fn structured_go(name: &str) -> Transcript {
    Transcript::new(BOTH_FLAGS)
        .opt_empty(NBD_OPT_STRUCTURED_REPLY)
        .opt(NBD_OPT_SET_META_CONTEXT, meta(name, &[BASE_ALLOCATION]))
        .opt(NBD_OPT_GO, info(name, &[]))
}

/// Flags and GO `name`, simple replies.
fn simple_go(name: &str) -> Transcript {
    Transcript::new(BOTH_FLAGS).opt(NBD_OPT_GO, info(name, &[]))
}

/// Valid client sessions: the seeds of the mutations.
fn seeds() -> &'static [Transcript] {
    static SEEDS: OnceLock<Vec<Transcript>> = OnceLock::new();
    SEEDS.get_or_init(|| {
        let hole = 16 * 4096; // patterned(): blocks 16..32 are zero
        vec![
            // Everything the server negotiates, then every command, structured.
            Transcript::new(BOTH_FLAGS)
                .opt_empty(NBD_OPT_LIST)
                .opt_empty(NBD_OPT_STRUCTURED_REPLY)
                .opt(NBD_OPT_LIST_META_CONTEXT, meta("disk", &["base:"]))
                .opt(
                    NBD_OPT_SET_META_CONTEXT,
                    meta("disk", &[BASE_ALLOCATION, "qemu:dirty-bitmap:x"]),
                )
                .opt(
                    NBD_OPT_INFO,
                    info(
                        "disk",
                        &[NBD_INFO_NAME, NBD_INFO_DESCRIPTION, NBD_INFO_BLOCK_SIZE],
                    ),
                )
                .opt(NBD_OPT_GO, info("disk", &[NBD_INFO_NAME]))
                .req(0, NBD_CMD_READ, 1, 0, 4096)
                .req(0, NBD_CMD_READ, 2, hole, 8192)
                .req(NBD_CMD_FLAG_FUA, NBD_CMD_WRITE, 3, 8192, 512)
                .req(0, NBD_CMD_FLUSH, 4, 0, 0)
                .req(0, NBD_CMD_TRIM, 5, 20 * 4096, 8192)
                .req(
                    NBD_CMD_FLAG_NO_HOLE,
                    NBD_CMD_WRITE_ZEROES,
                    6,
                    40 * 4096,
                    4096,
                )
                .req(0, NBD_CMD_BLOCK_STATUS, 7, 0, DISK as u32)
                .req(
                    NBD_CMD_FLAG_REQ_ONE,
                    NBD_CMD_BLOCK_STATUS,
                    8,
                    hole - 100,
                    5000,
                )
                .req(0, NBD_CMD_CACHE, 9, 0, 4096)
                .req(NBD_CMD_FLAG_DF, NBD_CMD_READ, 10, DISK - 4096, 4096)
                .req(0, NBD_CMD_DISC, 11, 0, 0),
            // EXPORT_NAME with the 124 zero bytes, simple replies.
            Transcript::new(NBD_FLAG_C_FIXED_NEWSTYLE)
                .opt(NBD_OPT_EXPORT_NAME, bytes(b"disk"))
                .req(0, NBD_CMD_READ, 1, 4096, 1024)
                .req(NBD_CMD_FLAG_FUA, NBD_CMD_WRITE, 2, 0, 4096)
                .req(0, NBD_CMD_FLUSH, 3, 0, 0)
                .req(NBD_CMD_FLAG_FUA, NBD_CMD_TRIM, 4, 4096, 4096)
                .req(NBD_CMD_FLAG_FUA, NBD_CMD_WRITE_ZEROES, 5, 8192, 100)
                .req(0, NBD_CMD_READ, 6, 0, 8192)
                .req(0, NBD_CMD_DISC, 7, 0, 0),
            // The default export, ended by EOF instead of DISC.
            Transcript::new(BOTH_FLAGS)
                .opt(NBD_OPT_GO, info("", &[NBD_INFO_BLOCK_SIZE]))
                .req(0, NBD_CMD_READ, 1, 0, 8192)
                .req(0, NBD_CMD_WRITE, 2, 512, 1000)
                .req(0, NBD_CMD_READ, 3, 512, 1000),
            // Read-only export: writes get EPERM, BLOCK_STATUS without a context EINVAL.
            Transcript::new(BOTH_FLAGS)
                .opt_empty(NBD_OPT_STRUCTURED_REPLY)
                .opt(NBD_OPT_SET_META_CONTEXT, meta("disk", &[BASE_ALLOCATION]))
                .opt(NBD_OPT_GO, info("ro", &[NBD_INFO_BLOCK_SIZE]))
                .req(0, NBD_CMD_READ, 1, 0, 4096)
                .req(0, NBD_CMD_WRITE, 2, 0, 512)
                .req(0, NBD_CMD_WRITE_ZEROES, 3, 0, 512)
                .req(0, NBD_CMD_BLOCK_STATUS, 4, 0, 4096)
                .req(0, NBD_CMD_DISC, 5, 0, 0),
            // Option haggling that ends in ABORT.
            Transcript::new(BOTH_FLAGS)
                .opt_empty(NBD_OPT_LIST)
                .opt(NBD_OPT_INFO, info("ro", &[NBD_INFO_NAME]))
                .opt(NBD_OPT_INFO, info("nope", &[]))
                .opt(77, bytes(&[1, 2, 3]))
                .opt_empty(NBD_OPT_EXTENDED_HEADERS)
                .opt_empty(NBD_OPT_STARTTLS)
                .opt(NBD_OPT_LIST_META_CONTEXT, meta("disk", &[]))
                .opt(NBD_OPT_ABORT, bytes(b"bye")),
            // STARTTLS first (a TLS server acknowledges it and reads a TLS hello).
            Transcript::new(BOTH_FLAGS)
                .opt_empty(NBD_OPT_STARTTLS)
                .opt_empty(NBD_OPT_ABORT),
            structured_go("disk")
                .req(0, NBD_CMD_BLOCK_STATUS, 1, 4096, 100_000)
                .req(0, NBD_CMD_READ, 2, 0, 65536)
                .req(0, NBD_CMD_DISC, 3, 0, 0),
        ]
    })
}

/// A value that is often interesting for a field holding `actual`.
fn interesting(pick: u64, random: u64, actual: u64) -> u64 {
    match pick % 20 {
        0 => 0,
        1 => 1,
        2 => actual.wrapping_sub(1),
        3 => actual.wrapping_add(1),
        4 => u32::MAX as u64,
        5 => 0x8000_0000,
        6 => MAX_OPTION_LEN as u64,
        7 => MAX_OPTION_LEN as u64 + 1,
        8 => MAX_STRING_LEN as u64 + 1,
        9 => MAX_PAYLOAD as u64,
        10 => MAX_PAYLOAD as u64 + 1,
        11 => DISK,
        12 => DISK - 512,
        13 => u64::MAX,
        14 => u64::MAX - 511,
        15 => random % 16,
        16 => 1 << (random % 64),
        17 => MAX_META_QUERIES as u64 + 1,
        18 => actual ^ (1 << (random % 64)),
        _ => random,
    }
}

type Mutation = (u8, Index, Index, u64, u64);

fn mutate(t: &Transcript, mutations: &[Mutation]) -> Vec<u8> {
    let mut b = t.bytes.clone();
    for &(kind, place, other, pick, random) in mutations {
        // A message boundary or any position, both clamped to the current length.
        let boundary = t.bounds[place.index(t.bounds.len())].min(b.len());
        let anywhere = if b.is_empty() {
            0
        } else {
            place.index(b.len())
        };
        let pos = if pick % 2 == 0 { boundary } else { anywhere };
        match kind % 7 {
            0 => {
                if !b.is_empty() {
                    b[anywhere] ^= 1 << (random % 8);
                }
            }
            1 => {
                if !b.is_empty() {
                    b[anywhere] = random as u8;
                }
            }
            2 | 3 => {
                // Most mutations hit a length, count, code, flag or offset field.
                let f = t.fields[place.index(t.fields.len())];
                let v = if f.code && pick % 4 < 2 {
                    // Every option and command number up to past the last one defined.
                    random % 24
                } else {
                    interesting(pick / 4, random, f.actual)
                };
                let v = v.to_be_bytes();
                if f.at + f.width <= b.len() {
                    b[f.at..f.at + f.width].copy_from_slice(&v[8 - f.width..]);
                }
            }
            4 => b.truncate(pos),
            5 => {
                if random % 2 == 0 {
                    // Random bytes.
                    let n = (random >> 8) as usize % 40;
                    let ins: Vec<u8> = (0..n)
                        .map(|k| (random >> (k % 7 * 8)) as u8 ^ k as u8)
                        .collect();
                    b.splice(pos..pos, ins);
                } else {
                    // Delete a run.
                    let end = (pos + (random >> 8) as usize % 64).min(b.len());
                    b.drain(pos..end);
                }
            }
            _ => {
                // Copy one message to a message boundary: options after the handshake,
                // requests before it, repeated messages.
                let k = other.index(t.bounds.len());
                let start = t.bounds[k];
                let end = t.bounds.get(k + 1).copied().unwrap_or(t.bytes.len());
                let msg = t.bytes[start..end].to_vec();
                b.splice(boundary..boundary, msg);
            }
        }
    }
    b
}

/// A request for the random-request property.
#[derive(Debug, Clone)]
struct Req {
    flags: u16,
    command: u16,
    cookie: u64,
    offset: u64,
    len: u32,
    /// For a WRITE, how many payload bytes to send (clamped to `len`).
    payload: Option<u32>,
}

fn req_strategy() -> impl Strategy<Value = Req> {
    let flags = prop_oneof![
        Just(0u16),
        Just(NBD_CMD_FLAG_FUA),
        Just(NBD_CMD_FLAG_NO_HOLE),
        Just(NBD_CMD_FLAG_DF),
        Just(NBD_CMD_FLAG_REQ_ONE),
        Just(NBD_CMD_FLAG_FAST_ZERO),
        any::<u16>(),
    ];
    let command = prop_oneof![6 => 0u16..=7, 2 => 8u16..=24, 1 => any::<u16>()];
    let offset = prop_oneof![
        Just(0u64),
        Just(DISK - 512),
        Just(DISK),
        Just(RO),
        // Data blocks end and a hole starts at 64 KiB (patterned()).
        Just(60 * 1024),
        Just(u64::MAX),
        Just(u64::MAX - 4095),
        0..DISK,
        any::<u64>(),
    ];
    let len = prop_oneof![
        Just(0u32),
        Just(1u32),
        Just(512u32),
        Just(4096u32),
        Just(8192u32),
        Just(MAX_PAYLOAD),
        Just(MAX_PAYLOAD + 1),
        Just(u32::MAX),
        1..=DISK as u32,
        any::<u32>(),
    ];
    let payload = prop_oneof![
        Just(None),
        Just(Some(u32::MAX)),
        (0u32..8192).prop_map(Some)
    ];
    (flags, command, 0u64..8, offset, len, payload).prop_map(
        |(flags, command, cookie, offset, len, payload)| Req {
            flags,
            command,
            cookie,
            offset,
            len,
            payload,
        },
    )
}

/// An option for the random-option property: its code, its payload, and perhaps a length
/// field that lies about the payload.
#[derive(Debug, Clone)]
struct Opt {
    option: u32,
    data: Vec<u8>,
    len: Option<u32>,
}

fn opt_strategy() -> impl Strategy<Value = Opt> {
    // Mostly the options the server implements, weighted towards those that do not end
    // the haggling, so that sequences of them build up state.
    let option = prop_oneof![
        3 => Just(NBD_OPT_LIST),
        3 => Just(NBD_OPT_STRUCTURED_REPLY),
        3 => Just(NBD_OPT_LIST_META_CONTEXT),
        4 => Just(NBD_OPT_SET_META_CONTEXT),
        3 => Just(NBD_OPT_INFO),
        1 => Just(NBD_OPT_GO),
        1 => Just(NBD_OPT_EXPORT_NAME),
        1 => Just(NBD_OPT_ABORT),
        1 => Just(NBD_OPT_STARTTLS),
        2 => 0u32..=24,
        1 => any::<u32>(),
    ];
    let name = prop_oneof![
        Just("disk".to_string()),
        Just("ro".to_string()),
        Just(String::new()),
        Just("nope".to_string()),
        "[a-z:\\x00]{0,12}",
    ];
    let query = prop_oneof![
        Just(BASE_ALLOCATION.to_string()),
        Just("base:".to_string()),
        Just("qemu:dirty-bitmap:x".to_string()),
        "[a-z:]{0,20}",
    ];
    let infos = prop::collection::vec(prop_oneof![0u16..=4, any::<u16>()], 0..4);
    let queries = prop::collection::vec(query, 0..4);
    let raw = prop::collection::vec(any::<u8>(), 0..64);
    // The lengths sometimes lie about the payload.
    let len = prop_oneof![
        8 => Just(None),
        1 => any::<u32>().prop_map(Some),
        1 => (0u32..80).prop_map(Some),
    ];
    // The payload fits the option (4 in 5) or is another option's or random.
    let fits = prop::bool::weighted(0.8);
    (option, name, infos, queries, raw, any::<Index>(), fits, len).prop_map(
        |(option, name, infos, queries, raw, pick, fits, len)| {
            let q: Vec<&str> = queries.iter().map(String::as_str).collect();
            let bodies = [
                info(&name, &infos).bytes,
                meta(&name, &q).bytes,
                name.as_bytes().to_vec(),
                Vec::new(),
                raw,
            ];
            let k = match option {
                _ if !fits => pick.index(bodies.len()),
                NBD_OPT_INFO | NBD_OPT_GO => 0,
                NBD_OPT_LIST_META_CONTEXT | NBD_OPT_SET_META_CONTEXT => 1,
                NBD_OPT_EXPORT_NAME => 2,
                NBD_OPT_LIST | NBD_OPT_STRUCTURED_REPLY | NBD_OPT_STARTTLS | NBD_OPT_ABORT => 3,
                _ => 4,
            };
            Opt {
                option,
                data: bodies[k].clone(),
                len,
            }
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cairn_testkit::fuzz_cases(),
        failure_persistence: None,
        // A hang costs CASE_TIMEOUT per shrinking step: report a less simple input sooner.
        max_shrink_time: 120_000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn mutated_sessions_are_answered_or_refused(
        which in any::<Index>(),
        tls in prop::bool::weighted(0.125),
        mutations in prop::collection::vec(
            (any::<u8>(), any::<Index>(), any::<Index>(), any::<u64>(), any::<u64>()),
            1..6,
        ),
    ) {
        let seeds = seeds();
        let input = mutate(&seeds[which.index(seeds.len())], &mutations);
        run_checked(&input, tls);
    }

    #[test]
    fn random_bytes_are_answered_or_refused(
        prefix in 0usize..4,
        tls in prop::bool::weighted(0.125),
        rest in prop::collection::vec(any::<u8>(), 0..4096),
    ) {
        // Random bytes from the start, after valid client flags, after IHAVEOPT, or in
        // place of requests after a complete handshake.
        let mut input = match prefix {
            0 => Vec::new(),
            1 => BOTH_FLAGS.to_be_bytes().to_vec(),
            2 => [&BOTH_FLAGS.to_be_bytes()[..], &IHAVEOPT.to_be_bytes()].concat(),
            _ => structured_go("disk").bytes,
        };
        input.extend_from_slice(&rest);
        run_checked(&input, tls);
    }

    #[test]
    fn random_options_are_answered_or_refused(
        flags in prop_oneof![4 => Just(BOTH_FLAGS), 1 => Just(NBD_FLAG_C_FIXED_NEWSTYLE), 1 => any::<u32>()],
        tls in prop::bool::weighted(0.125),
        opts in prop::collection::vec(opt_strategy(), 1..12),
        reqs in prop::collection::vec(req_strategy(), 0..6),
    ) {
        let mut input = flags.to_be_bytes().to_vec();
        for o in &opts {
            input.extend_from_slice(&IHAVEOPT.to_be_bytes());
            input.extend_from_slice(&o.option.to_be_bytes());
            input.extend_from_slice(&o.len.unwrap_or(o.data.len() as u32).to_be_bytes());
            input.extend_from_slice(&o.data);
        }
        // Requests, in case an option entered transmission.
        for r in &reqs {
            input.extend_from_slice(&encode_request(&Request {
                flags: r.flags,
                command: r.command,
                cookie: r.cookie,
                offset: r.offset,
                len: r.len,
            }));
        }
        run_checked(&input, tls);
    }

    #[test]
    fn random_requests_are_answered_or_refused(
        session in 0usize..4,
        reqs in prop::collection::vec(req_strategy(), 1..24),
        end in 0usize..3,
    ) {
        let t = match session {
            0 => simple_go("disk"),
            1 => structured_go("disk"),
            2 => structured_go("ro"),
            _ => Transcript::new(BOTH_FLAGS)
                .opt_empty(NBD_OPT_STRUCTURED_REPLY)
                .opt(NBD_OPT_GO, info("", &[])),
        };
        let mut input = t.bytes;
        for r in &reqs {
            input.extend_from_slice(&encode_request(&Request {
                flags: r.flags,
                command: r.command,
                cookie: r.cookie,
                offset: r.offset,
                len: r.len,
            }));
            if r.command == NBD_CMD_WRITE {
                if let Some(n) = r.payload {
                    input.extend((0..n.min(r.len).min(1 << 20)).map(|i| i as u8));
                }
            }
        }
        match end {
            0 => input.extend_from_slice(&encode_request(&Request {
                flags: 0, command: NBD_CMD_DISC, cookie: 99, offset: 0, len: 0,
            })),
            1 => {}
            _ => input.extend_from_slice(&REQUEST_MAGIC.to_be_bytes()),
        }
        run_checked(&input, false);
    }
}

// ================================================================ regression tests

fn go_simple_and(reqs: impl FnOnce(Transcript) -> Transcript) -> Vec<u8> {
    reqs(simple_go("disk")).bytes
}

/// Option replies after the handshake's own, for `option`.
fn replies_to(p: &Parsed, option: u32) -> Vec<u32> {
    p.options
        .iter()
        .filter(|o| o.0 == option)
        .map(|o| o.1)
        .collect()
}

/// A raw option header announcing `len` bytes, whatever follows.
fn option_header(option: u32, len: u32) -> Vec<u8> {
    let mut v = IHAVEOPT.to_be_bytes().to_vec();
    v.extend_from_slice(&option.to_be_bytes());
    v.extend_from_slice(&len.to_be_bytes());
    v
}

/// The memory guard is on: a 4 GiB allocation fails in this process.
#[test]
fn address_space_is_capped() {
    rt();
    assert!(Vec::<u8>::new().try_reserve_exact(4 << 30).is_err());
}

#[test]
fn seeds_are_served_in_full() {
    for (k, t) in seeds().iter().enumerate() {
        let (run, p) = run_checked(&t.bytes, false);
        assert!(run.result.is_ok(), "seed {k}: {:?}", run.result);
        if let Some((size, flags)) = p.export_name {
            assert_eq!(size, DISK, "seed {k}");
            assert_eq!(flags & NBD_FLAG_READ_ONLY, 0, "seed {k}");
        }
        if p.transmission {
            assert!(!p.replies.is_empty(), "seed {k}: no replies");
        }
    }
}

#[test]
fn option_length_0xffffffff_is_a_hard_disconnect_without_allocating() {
    for option in [
        NBD_OPT_LIST,
        NBD_OPT_GO,
        NBD_OPT_EXPORT_NAME,
        NBD_OPT_SET_META_CONTEXT,
        NBD_OPT_ABORT,
        77,
    ] {
        for len in [u32::MAX, 0x8000_0000, MAX_OPTION_LEN + 1] {
            let mut input = BOTH_FLAGS.to_be_bytes().to_vec();
            input.extend(option_header(option, len));
            input.extend_from_slice(&[0u8; 4096]);
            let (run, p) = run_checked(&input, false);
            assert_eq!(run.out.len(), GREETING_LEN, "option {option}, len {len:#x}");
            assert!(p.options.is_empty());
            let err = run.result.unwrap_err();
            assert!(err.contains("exceeds the limit"), "{err}");
        }
    }
    // Exactly MAX_OPTION_LEN is read and answered; the session goes on.
    let mut input = BOTH_FLAGS.to_be_bytes().to_vec();
    input.extend(option_header(77, MAX_OPTION_LEN));
    input.extend(vec![0xa5; MAX_OPTION_LEN as usize]);
    input.extend(option_header(NBD_OPT_GO, MAX_OPTION_LEN));
    input.extend(vec![0; MAX_OPTION_LEN as usize]);
    input.extend(option_header(NBD_OPT_ABORT, 0));
    let (run, p) = run_checked(&input, false);
    assert_eq!(run.result, Ok(()));
    assert_eq!(replies_to(&p, 77), vec![NBD_REP_ERR_UNSUP]);
    assert_eq!(replies_to(&p, NBD_OPT_GO), vec![NBD_REP_ERR_INVALID]);
    assert_eq!(replies_to(&p, NBD_OPT_ABORT), vec![NBD_REP_ACK]);
}

#[test]
fn go_with_a_name_longer_than_the_option_is_invalid_and_haggling_goes_on() {
    for option in [
        NBD_OPT_GO,
        NBD_OPT_INFO,
        NBD_OPT_LIST_META_CONTEXT,
        NBD_OPT_SET_META_CONTEXT,
    ] {
        for name_len in [100u32, 5, MAX_STRING_LEN as u32 + 1, u32::MAX] {
            let mut data = name_len.to_be_bytes().to_vec();
            data.extend_from_slice(b"disk\0\0\0\0");
            let input = Transcript::new(BOTH_FLAGS)
                .opt(option, bytes(&data))
                .opt(NBD_OPT_GO, info("disk", &[]))
                .req(0, NBD_CMD_READ, 1, 0, 512)
                .req(0, NBD_CMD_DISC, 2, 0, 0)
                .bytes;
            let (run, p) = run_checked(&input, false);
            assert_eq!(
                run.result,
                Ok(()),
                "option {option}, name length {name_len}"
            );
            assert_eq!(p.options[0].0, option);
            assert_eq!(
                p.options[0].1, NBD_REP_ERR_INVALID,
                "option {option}, {name_len}"
            );
            assert_eq!(p.done(1).error, 0);
            assert_eq!(p.done(1).payload, patterned(512));
        }
    }
}

#[test]
fn info_request_count_larger_than_the_option_is_invalid() {
    for count in [2u16, 0x8000, u16::MAX] {
        // One info request present, `count` announced.
        let mut data = 4u32.to_be_bytes().to_vec();
        data.extend_from_slice(b"disk");
        data.extend_from_slice(&count.to_be_bytes());
        data.extend_from_slice(&NBD_INFO_NAME.to_be_bytes());
        let input = Transcript::new(BOTH_FLAGS)
            .opt(NBD_OPT_GO, bytes(&data))
            .opt(NBD_OPT_INFO, bytes(&data))
            .opt_empty(NBD_OPT_ABORT)
            .bytes;
        let (run, p) = run_checked(&input, false);
        assert_eq!(run.result, Ok(()));
        assert_eq!(replies_to(&p, NBD_OPT_GO), vec![NBD_REP_ERR_INVALID]);
        assert_eq!(replies_to(&p, NBD_OPT_INFO), vec![NBD_REP_ERR_INVALID]);
    }
    // A meta-context query count far beyond the option (and beyond MAX_META_QUERIES).
    for count in [2u32, MAX_META_QUERIES as u32 + 1, u32::MAX] {
        let mut data = 4u32.to_be_bytes().to_vec();
        data.extend_from_slice(b"disk");
        data.extend_from_slice(&count.to_be_bytes());
        data.extend_from_slice(&15u32.to_be_bytes());
        data.extend_from_slice(BASE_ALLOCATION.as_bytes());
        let input = Transcript::new(BOTH_FLAGS)
            .opt_empty(NBD_OPT_STRUCTURED_REPLY)
            .opt(NBD_OPT_SET_META_CONTEXT, bytes(&data))
            .opt_empty(NBD_OPT_ABORT)
            .bytes;
        let (run, p) = run_checked(&input, false);
        assert_eq!(run.result, Ok(()));
        assert_eq!(
            replies_to(&p, NBD_OPT_SET_META_CONTEXT),
            vec![NBD_REP_ERR_INVALID]
        );
    }
}

#[test]
fn a_malformed_set_meta_context_clears_the_selection() {
    // Found by the session fuzzer: a valid SET, then a SET whose query count is mutated, then
    // GO and BLOCK_STATUS. SET replaces the selection even when it fails, so the block status
    // request has no context to answer for (the oracle refuses a reply for context 1).
    let mut bad = 4u32.to_be_bytes().to_vec();
    bad.extend_from_slice(b"disk");
    bad.extend_from_slice(&0xa725_bef7u32.to_be_bytes());
    bad.extend_from_slice(&15u32.to_be_bytes());
    bad.extend_from_slice(BASE_ALLOCATION.as_bytes());
    let input = Transcript::new(BOTH_FLAGS)
        .opt_empty(NBD_OPT_STRUCTURED_REPLY)
        .opt(NBD_OPT_SET_META_CONTEXT, meta("disk", &[BASE_ALLOCATION]))
        .opt(NBD_OPT_SET_META_CONTEXT, bytes(&bad))
        .opt(NBD_OPT_GO, info("disk", &[]))
        .req(0, NBD_CMD_BLOCK_STATUS, 1, 0, 4096)
        .req(0, NBD_CMD_DISC, 2, 0, 0)
        .bytes;
    let (run, p) = run_checked(&input, false);
    assert_eq!(run.result, Ok(()));
    assert_eq!(
        replies_to(&p, NBD_OPT_SET_META_CONTEXT),
        vec![NBD_REP_META_CONTEXT, NBD_REP_ACK, NBD_REP_ERR_INVALID]
    );
}

#[test]
fn write_over_the_maximum_payload_is_a_hard_disconnect() {
    for len in [MAX_PAYLOAD + 1, 0x8000_0000, u32::MAX] {
        let mut input = go_simple_and(|t| t.req(0, NBD_CMD_READ, 1, 0, 512));
        input.extend_from_slice(&encode_request(&Request {
            flags: 0,
            command: NBD_CMD_WRITE,
            cookie: 2,
            offset: 0,
            len,
        }));
        input.extend_from_slice(&[0x11; 64 * 1024]);
        let (run, p) = run_checked(&input, false);
        let err = run.result.unwrap_err();
        assert!(err.contains("write payload over 32 MiB"), "{err}");
        // The WRITE got no reply; the READ before it may or may not have gone out.
        assert!(p.replies.iter().all(|m| m.cookie == 1), "{:?}", p.replies);
    }
}

#[test]
fn read_over_the_maximum_payload_is_einval_and_the_connection_goes_on() {
    for len in [MAX_PAYLOAD + 1, u32::MAX] {
        let input = go_simple_and(|t| {
            t.req(0, NBD_CMD_READ, 1, 0, len)
                .req(0, NBD_CMD_READ, 2, 0, 100)
                .req(0, NBD_CMD_DISC, 3, 0, 0)
        });
        let (run, p) = run_checked(&input, false);
        assert_eq!(run.result, Ok(()));
        assert_eq!(p.done(1).error, NBD_EINVAL);
        assert!(p.done(1).payload.is_empty());
        assert_eq!(p.done(2).payload, patterned(100));
    }
}

#[test]
fn requests_before_the_handshake_finished_end_the_connection() {
    let read = encode_request(&Request {
        flags: 0,
        command: NBD_CMD_READ,
        cookie: 1,
        offset: 0,
        len: 512,
    });
    // In place of the client flags: REQUEST_MAGIC's bits are unknown client flags.
    let (run, _) = run_checked(&read, false);
    assert_eq!(run.out.len(), GREETING_LEN);
    assert!(run.result.unwrap_err().contains("unknown client flags"));
    // In place of the first option, and after an answered option.
    for first in [
        Transcript::new(BOTH_FLAGS),
        Transcript::new(BOTH_FLAGS)
            .opt_empty(NBD_OPT_STRUCTURED_REPLY)
            .opt_empty(NBD_OPT_LIST),
    ] {
        let n_opts = first.bounds.len() - 1;
        let mut input = first.bytes;
        input.extend_from_slice(&read);
        let (run, p) = run_checked(&input, false);
        assert!(run.result.unwrap_err().contains("bad magic"));
        assert!(!p.transmission);
        // Every option before it was answered (LIST: one SERVER per export and an ACK).
        let finals = p
            .options
            .iter()
            .filter(|o| o.1 == NBD_REP_ACK || o.1 & NBD_REP_FLAG_ERROR != 0)
            .count();
        assert_eq!(finals, n_opts);
    }
    // A request in place of a WRITE's payload is just payload.
    let input = go_simple_and(|t| {
        let mut t = t.req(0, NBD_CMD_WRITE, 1, 0, 28);
        t.bytes.truncate(t.bytes.len() - 28);
        t.raw(&read);
        t.req(0, NBD_CMD_READ, 2, 0, 28)
    });
    let (run, p) = run_checked(&input, false);
    assert_eq!(run.result, Ok(()));
    // check() already failed the case if the embedded header had been taken for a request
    // (a second final reply to cookie 1).
    assert_eq!(p.done(1).error, 0);
    assert_eq!(p.done(2).payload.len(), 28);
}

#[test]
fn requests_past_the_end_get_errors_and_the_connection_goes_on() {
    let reqs = |t: Transcript| {
        t.req(0, NBD_CMD_READ, 1, DISK - 512, 1024)
            .req(0, NBD_CMD_READ, 2, u64::MAX, 1)
            .req(0, NBD_CMD_READ, 3, DISK, 1)
            .req(0, NBD_CMD_READ, 4, 0, 0)
            .req(0, NBD_CMD_WRITE, 5, DISK - 10, 20)
            .req(0, NBD_CMD_WRITE_ZEROES, 6, u64::MAX - 511, 1024)
            .req(0, NBD_CMD_TRIM, 7, DISK, 4096)
            .req(0, NBD_CMD_CACHE, 8, DISK + 1, 1)
            .req(0, NBD_CMD_READ, 9, 4096 - 16, 16)
            .req(0, NBD_CMD_DISC, 10, 0, 0)
    };
    let expected = [
        (1, NBD_EINVAL),
        (2, NBD_EINVAL),
        (3, NBD_EINVAL),
        (4, NBD_EINVAL),
        (5, NBD_ENOSPC),
        (6, NBD_ENOSPC),
        (7, NBD_EINVAL),
        (8, NBD_EINVAL),
        (9, 0),
    ];
    for structured in [false, true] {
        let t = if structured {
            structured_go("disk")
        } else {
            simple_go("disk")
        };
        let (run, p) = run_checked(&reqs(t).bytes, false);
        assert_eq!(run.result, Ok(()));
        for (cookie, errno) in expected {
            let m = p.done(cookie);
            assert_eq!(m.error, errno, "cookie {cookie}, structured {structured}");
            if structured && errno != 0 {
                assert_eq!(m.chunk, Some(NBD_REPLY_TYPE_ERROR));
            }
        }
        let last = p.done(9);
        let data = if structured {
            assert_eq!(last.chunk, Some(NBD_REPLY_TYPE_OFFSET_DATA));
            &last.payload[8..]
        } else {
            &last.payload[..]
        };
        assert_eq!(data, &patterned(4096)[4096 - 16..]);
    }
    // BLOCK_STATUS past the end, and beyond a read-only export.
    let t = structured_go("disk")
        .req(0, NBD_CMD_BLOCK_STATUS, 1, DISK, 1)
        .req(0, NBD_CMD_BLOCK_STATUS, 2, DISK - 1, u32::MAX)
        .req(0, NBD_CMD_BLOCK_STATUS, 3, DISK - 4096, 4096);
    let (run, p) = run_checked(&t.bytes, false);
    assert_eq!(run.result, Ok(()));
    assert_eq!(p.done(1).error, NBD_EINVAL);
    assert_eq!(p.done(2).error, NBD_EINVAL);
    assert_eq!(p.done(3).chunk, Some(NBD_REPLY_TYPE_BLOCK_STATUS));
}

#[test]
fn export_name_that_cannot_be_served_ends_the_connection() {
    let long = vec![b'x'; MAX_STRING_LEN + 1];
    for name in [&b"nope"[..], &[0xff, 0xfe], b"di\0sk", &long] {
        let input = Transcript::new(BOTH_FLAGS)
            .opt_empty(NBD_OPT_LIST)
            .opt(NBD_OPT_EXPORT_NAME, bytes(name))
            .req(0, NBD_CMD_READ, 1, 0, 512)
            .bytes;
        let (run, p) = run_checked(&input, false);
        assert!(run.result.is_err());
        assert!(!p.transmission);
        assert_eq!(p.options.last().unwrap().1, NBD_REP_ACK);
    }
}

#[test]
fn input_cut_short_ends_the_connection_without_a_reply() {
    let full = seeds()[0].bytes.clone();
    let go_end = {
        let t = Transcript::new(BOTH_FLAGS).opt_empty(NBD_OPT_LIST);
        t.bytes.len()
    };
    // Inside the LIST header, inside the LIST_META_CONTEXT payload, inside the WRITE payload
    // (8 requests of 28 bytes follow it).
    for cut in [go_end - 3, go_end + 40, full.len() - 8 * 28 - 100] {
        let (run, _) = run_checked(&full[..cut], false);
        assert!(run.result.is_err(), "cut at {cut}");
    }
}

#[test]
fn tls_server_refuses_options_before_starttls_and_survives_a_garbage_hello() {
    let input = Transcript::new(BOTH_FLAGS)
        .opt_empty(NBD_OPT_LIST)
        .opt(NBD_OPT_GO, info("disk", &[]))
        .opt_empty(NBD_OPT_STARTTLS)
        .bytes;
    let mut garbage = input.clone();
    garbage.extend_from_slice(&[0x16, 0x03, 0x01, 0xff, 0xff]);
    garbage.extend_from_slice(&[0x42; 300]);
    for input in [input, garbage] {
        let (run, p) = run_checked(&input, true);
        assert!(run.result.unwrap_err().contains("TLS handshake failed"));
        assert_eq!(replies_to(&p, NBD_OPT_LIST), vec![NBD_REP_ERR_TLS_REQD]);
        assert_eq!(replies_to(&p, NBD_OPT_GO), vec![NBD_REP_ERR_TLS_REQD]);
        assert_eq!(replies_to(&p, NBD_OPT_STARTTLS), vec![NBD_REP_ACK]);
    }
}

//! Mutation fuzzing of the NBD client's decoding of what a server sends: the greeting, option
//! replies (`INFO`/`GO` with their info chunks, `SET_META_CONTEXT`), and transmission replies
//! (simple and structured: data, holes, block status, errors). A real transcript — every byte
//! cairn's own server sent to the client while it connected to a 256 KiB export (data, then a
//! hole), read its allocation map and its first 64 KiB — is recorded once through a proxy,
//! then mutated (bit flips, 16/32/64-bit fields overwritten with extreme values, truncation,
//! insertion, deletion, a duplicated span) or replaced by random bytes, and played to
//! [`drive_client_with_server_bytes`]. For every case the client must return within 5 s,
//! must not panic, and must not allocate a size the bytes name: the test process runs under
//! an address-space limit far below the 4 GiB a 32-bit length can name, so such an
//! allocation aborts the binary. The unmutated transcript must drive the client to the end:
//! it connects and reads the export's bytes (checked through a real connection first).
//!
//! `CAIRN_FUZZ_CASES` sets the number of cases per property (default 256).

mod common;

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use cairn_image::DiskImage;
use cairn_nbd::client::drive_client_with_server_bytes;
use cairn_nbd::{MemoryExport, NbdImage, Server};
use common::{patterned, TestServer};
use proptest::prelude::*;

const DISK: usize = 256 * 1024;
const CASE_TIMEOUT: Duration = Duration::from_secs(5);
/// Address space the process may grow by once fuzzing starts (threads, arenas, the client's
/// bounded buffers), far below the 4 GiB a hostile 32-bit length names.
const HEADROOM: u64 = 1 << 30;

/// 256 KiB: patterned data in the first half, a hole (zeros) in the second.
fn contents() -> Vec<u8> {
    let mut v = patterned(DISK);
    v[DISK / 2..].fill(0);
    v
}

/// Copies `from` to `to` until EOF, keeping a copy of the bytes in `log` if given.
fn pump(mut from: UnixStream, mut to: UnixStream, log: Option<Arc<Mutex<Vec<u8>>>>) {
    let mut buf = [0u8; 64 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if let Some(log) = &log {
            log.lock().unwrap().extend_from_slice(&buf[..n]);
        }
        if to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(std::net::Shutdown::Write);
}

/// Everything cairn's server sends a client that connects to `disk`, maps it and reads its
/// first 64 KiB (the same steps `drive_client_with_server_bytes` takes), recorded once.
fn transcript() -> &'static [u8] {
    static T: OnceLock<Vec<u8>> = OnceLock::new();
    T.get_or_init(|| {
        let server = TestServer::start(
            Server::new().with_export("disk", Arc::new(MemoryExport::from_vec(contents()))),
        );
        let proxy_path = server.path("proxy.sock");
        let listener = UnixListener::bind(&proxy_path).unwrap();
        let log = Arc::new(Mutex::new(Vec::new()));
        let upstream = server.socket.clone();
        let recorded = log.clone();
        let proxy = std::thread::spawn(move || {
            let (client, _) = listener.accept().unwrap();
            let srv = UnixStream::connect(&upstream).unwrap();
            let (c2, s2) = (client.try_clone().unwrap(), srv.try_clone().unwrap());
            let up = std::thread::spawn(move || pump(c2, s2, None));
            pump(srv, client, Some(recorded));
            up.join().unwrap();
        });
        let url = format!("nbd+unix:///disk?socket={}", proxy_path.display());
        let image = NbdImage::connect(&url, None).expect("connect through the proxy");
        assert!(!image.map().unwrap().is_empty());
        let mut buf = vec![0u8; 64 << 10];
        image.read_at(&mut buf, 0).unwrap();
        assert!(buf == contents()[..64 << 10], "read through the proxy");
        drop(image); // disconnects: the proxy's copies end
        proxy.join().unwrap();
        let t = log.lock().unwrap().clone();
        assert!(t.len() > 64 << 10, "the transcript holds the read's data");
        t
    })
}

/// Plays `bytes` to the client on a thread of its own: a panic or a hang fails the case.
/// Returns what the client read, if it got that far.
fn play(bytes: Vec<u8>) -> Result<Option<Vec<u8>>, TestCaseError> {
    static LIMITED: OnceLock<()> = OnceLock::new();
    LIMITED.get_or_init(|| common::limit_address_space(HEADROOM));
    let started = Instant::now();
    let worker = std::thread::spawn(move || drive_client_with_server_bytes(&bytes));
    while !worker.is_finished() {
        prop_assert!(started.elapsed() < CASE_TIMEOUT, "the client hung");
        std::thread::sleep(Duration::from_millis(1));
    }
    match worker.join() {
        Ok(read) => Ok(read.ok()),
        Err(_) => Err(TestCaseError::fail("the client panicked")),
    }
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip { at: usize, bit: u8 },
    Field { at: usize, width: u8, value: u64 },
    Truncate { at: usize },
    Insert { at: usize, bytes: Vec<u8> },
    Delete { at: usize, len: usize },
    Duplicate { at: usize, len: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let at = any::<prop::sample::Index>();
    let extreme = prop_oneof![
        Just(0u64),
        Just(1),
        Just(0xFFFF),
        Just(0xFFFF_FFFF),
        Just(0x8000_0000),
        Just(u64::MAX),
        any::<u64>()
    ];
    prop_oneof![
        (at.clone(), 0u8..8)
            .prop_map(|(a, bit)| (a, bit))
            .prop_map(|(a, bit)| Mutation::Flip {
                at: a.index(usize::MAX),
                bit
            }),
        (
            at.clone(),
            prop_oneof![Just(2u8), Just(4), Just(8)],
            extreme
        )
            .prop_map(|(a, width, value)| Mutation::Field {
                at: a.index(usize::MAX),
                width,
                value
            }),
        at.clone().prop_map(|a| Mutation::Truncate {
            at: a.index(usize::MAX)
        }),
        (at.clone(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(a, bytes)| {
            Mutation::Insert {
                at: a.index(usize::MAX),
                bytes,
            }
        }),
        (at.clone(), 1usize..64).prop_map(|(a, len)| Mutation::Delete {
            at: a.index(usize::MAX),
            len
        }),
        (at, 1usize..64).prop_map(|(a, len)| Mutation::Duplicate {
            at: a.index(usize::MAX),
            len
        }),
    ]
}

/// Applies `m` to `t`; positions wrap to the transcript's length, most of them in its first
/// 4 KiB (the handshake and the reply headers) rather than the read's data.
fn apply(t: &[u8], m: &Mutation) -> Vec<u8> {
    let mut v = t.to_vec();
    let pos = |at: usize| {
        if !at.is_multiple_of(4) {
            at % v.len().clamp(1, 4096)
        } else {
            at % v.len().max(1)
        }
    };
    match m {
        Mutation::Flip { at, bit } => {
            let i = pos(*at);
            v[i] ^= 1 << bit;
        }
        Mutation::Field { at, width, value } => {
            let w = *width as usize;
            let i = pos(*at).min(v.len().saturating_sub(w));
            let bytes = value.to_be_bytes();
            v[i..i + w].copy_from_slice(&bytes[8 - w..]);
        }
        Mutation::Truncate { at } => v.truncate(pos(*at)),
        Mutation::Insert { at, bytes } => {
            let i = pos(*at);
            v.splice(i..i, bytes.iter().copied());
        }
        Mutation::Delete { at, len } => {
            let i = pos(*at);
            let end = (i + len).min(v.len());
            v.drain(i..end);
        }
        Mutation::Duplicate { at, len } => {
            let i = pos(*at);
            let end = (i + len).min(v.len());
            let span = v[i..end].to_vec();
            v.splice(end..end, span);
        }
    }
    v
}

fn cases() -> u32 {
    std::env::var("CAIRN_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256)
}

#[test]
fn the_recorded_transcript_drives_the_client_to_the_end() {
    // The replayed server answers the client's requests (its cookies are the same, in the
    // same order), so the client connects, maps and reads the export's first 64 KiB.
    let read = play(transcript().to_vec()).unwrap();
    assert!(
        read.as_deref() == Some(&contents()[..64 << 10]),
        "the replay reached the read"
    );
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), ..ProptestConfig::default() })]

    #[test]
    fn mutated_server_bytes_never_panic_hang_or_allocate_their_lengths(
        ms in prop::collection::vec(mutation(), 1..4)
    ) {
        let mut t = transcript().to_vec();
        for m in &ms {
            t = apply(&t, m);
        }
        play(t)?;
    }

    #[test]
    fn random_server_bytes_never_panic_hang_or_allocate_their_lengths(
        bytes in prop::collection::vec(any::<u8>(), 0..2048)
    ) {
        play(bytes)?;
    }
}

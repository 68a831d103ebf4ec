//! Any bytes a client sends to the NBD server (its whole side of one connection: client
//! flags, option haggling, transmission requests) get option replies, NBD error replies or
//! a closed connection: never a panic, a hang or a huge allocation. libFuzzer's `-timeout`
//! catches a hang (the client's write side is closed after the bytes, so a server that
//! does not finish is stuck), its `-malloc_limit_mb` an allocation of a hostile length.
#![no_main]

use std::sync::{Arc, OnceLock};

use cairn_nbd::{MemoryExport, Server};
use libfuzzer_sys::fuzz_target;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn rt() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        // Time enabled: the server bounds its handshake with a timer.
        tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime")
    })
}

/// 64 KiB: data in the first half, a hole in the second.
fn contents() -> Vec<u8> {
    (0..64 * 1024)
        .map(|i: usize| if i < 32 * 1024 { (i % 251) as u8 + 1 } else { 0 })
        .collect()
}

fuzz_target!(|data: &[u8]| {
    let disk = Arc::new(MemoryExport::from_vec(contents()));
    let ro = Arc::new(MemoryExport::from_vec(contents()).read_only(true));
    let server = Arc::new(
        Server::new()
            .with_export("disk", disk.clone())
            .with_export("ro", ro)
            .with_default_export(disk),
    );
    rt().block_on(async {
        let (client, conn) = tokio::io::duplex(64 * 1024);
        let serve = tokio::spawn(async move { server.serve(conn).await });
        let (mut rd, mut wr) = tokio::io::split(client);
        let send = async {
            // The server may hang up first: a broken pipe is expected.
            let _ = wr.write_all(data).await;
            let _ = wr.shutdown().await;
        };
        let recv = async {
            let mut buf = vec![0u8; 64 * 1024];
            while let Ok(n) = rd.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        };
        tokio::join!(send, recv);
        // Ok or a protocol error are both fine; a panic of the server task is a finding.
        if let Err(e) = serve.await {
            std::panic::resume_unwind(e.into_panic());
        }
    });
});

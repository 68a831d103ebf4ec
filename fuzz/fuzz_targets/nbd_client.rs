//! Any bytes a server sends the NBD client (its whole side of one connection: greeting,
//! option replies, transmission replies) give the client an error or an image it reads:
//! never a panic, a hang or a huge allocation. libFuzzer's `-malloc_limit_mb` catches an
//! allocation of a hostile length; EOF ends every wait, so a hang is a bug, caught by
//! `-timeout`.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = cairn_nbd::client::drive_client_with_server_bytes(data);
});

//! Any bytes given to the qcow2 parser give `Ok` or `Err`: never a panic, a hang or a huge
//! allocation.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = cairn_image::qcow2::Qcow2Image::parse_bytes(data);
});

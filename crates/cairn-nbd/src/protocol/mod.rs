//! Wire format of the NBD protocol (`doc/proto.md` of NetworkBlockDevice/nbd).
//!
//! Everything here is pure: constants plus encode/decode functions over byte
//! slices, so the framing can be unit-tested and fuzzed without sockets.
//! Decoders treat their input as hostile: every length is checked against
//! the bytes actually present and against fixed caps, and they return
//! [`ProtocolError`] instead of panicking.
//!
//! - [`constants`]: magics, flags, codes and the limits on what a peer may send
//! - [`handshake`]: greeting, client flags, options and option replies
//! - [`transmission`]: requests, simple and structured replies, block status

pub mod constants;
pub mod handshake;
pub mod transmission;
mod wire;

pub use constants::*;
pub use handshake::*;
pub use transmission::*;

use thiserror::Error;

/// Malformed input from the peer.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ProtocolError {
    #[error("buffer too short: need {need} bytes, have {have}")]
    Short { need: usize, have: usize },
    #[error("bad magic {0:#x}")]
    BadMagic(u64),
    #[error("unknown client flags {0:#x}")]
    UnknownClientFlags(u32),
    #[error("option payload of {0} bytes exceeds the limit")]
    OptionTooLong(u32),
    #[error("string of {0} bytes exceeds the limit")]
    StringTooLong(usize),
    #[error("string is not valid UTF-8")]
    NotUtf8,
    #[error("malformed option payload: {0}")]
    Malformed(&'static str),
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    // Every decoder of both phases, fed noise: an error, never a panic.
    proptest! {
        #[test]
        fn parsers_never_panic(option in any::<u32>(), data in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = decode_client_flags(&data);
            let _ = decode_option_header(&data);
            let _ = decode_request(&data);
            let _ = decode_reply_header(&data);
            let _ = decode_option_reply_header(&data);
            let _ = decode_option(option, &data);
            for opt in [NBD_OPT_EXPORT_NAME, NBD_OPT_INFO, NBD_OPT_GO,
                        NBD_OPT_LIST_META_CONTEXT, NBD_OPT_SET_META_CONTEXT, NBD_OPT_LIST] {
                let _ = decode_option(opt, &data);
            }
        }

        #[test]
        fn structured_option_payloads_never_panic(
            name_len in any::<u32>(), count in any::<u32>(),
            tail in proptest::collection::vec(any::<u8>(), 0..200)
        ) {
            // Plausible-looking prefixes reach deeper into the parsers than pure noise.
            let mut data = name_len.to_be_bytes().to_vec();
            data.extend_from_slice(&count.to_be_bytes());
            data.extend_from_slice(&tail);
            for opt in [NBD_OPT_INFO, NBD_OPT_GO, NBD_OPT_LIST_META_CONTEXT, NBD_OPT_SET_META_CONTEXT] {
                let _ = decode_option(opt, &data);
            }
        }
    }
}

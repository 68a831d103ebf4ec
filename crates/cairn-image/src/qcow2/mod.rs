//! qcow2 (QEMU copy-on-write, versions 2 and 3): reading with backing chains, and writing
//! compact images. Layout facts from QEMU's `docs/interop/qcow2.txt`.

mod header;
mod io;
mod layer;
mod layout;
mod reader;
mod writer;

pub use reader::{OpenOptions, Qcow2Image, MAX_CHAIN_LEN};
pub use writer::{Backing, Qcow2Writer};

//! The qcow2 header, its extensions and the backing file name (QEMU's
//! `docs/interop/qcow2.txt`, "Header" and "Header extensions").
//!
//! Every field is checked before it is used for arithmetic or an allocation: a hostile header
//! yields an error, never a panic or a huge buffer.

use std::path::Path;

use super::io::HostIo;
use super::layout::{MAX_CLUSTER_BITS, MAX_L1_BYTES, MIN_CLUSTER_BITS};
use crate::detect::QCOW2_MAGIC;
use crate::error::{ImageError, ImageResult};

/// Smallest and largest cluster sizes (log2) QEMU reads.
/// Longest backing file name QEMU accepts.
const MAX_BACKING_NAME: u64 = 1023;
/// Length of a version 2 header; also the smallest file that can hold any header.
const V2_HEADER_LEN: u64 = 72;
/// Smallest version 3 header.
const V3_MIN_HEADER_LEN: u64 = 104;

// Incompatible feature bits (version 3).
const INCOMPAT_DIRTY: u64 = 1 << 0;
const INCOMPAT_CORRUPT: u64 = 1 << 1;
const INCOMPAT_DATA_FILE: u64 = 1 << 2;
const INCOMPAT_COMPRESSION: u64 = 1 << 3;
const INCOMPAT_EXTL2: u64 = 1 << 4;
const INCOMPAT_KNOWN: u64 =
    INCOMPAT_DIRTY | INCOMPAT_CORRUPT | INCOMPAT_DATA_FILE | INCOMPAT_COMPRESSION | INCOMPAT_EXTL2;

// Header extension types.
const EXT_END: u32 = 0;
const EXT_BACKING_FORMAT: u32 = 0xE279_2ACA;
const EXT_FDE: u32 = 0x0537_BE77;
const EXT_DATA_FILE: u32 = 0x4441_5441;

/// How compressed clusters are compressed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Compression {
    /// Raw deflate (no zlib header), QEMU's default.
    Deflate,
    Zstd,
}

/// The parts of a qcow2 header a reader needs, all validated.
#[derive(Debug, Clone)]
pub(crate) struct Header {
    pub version: u32,
    pub cluster_bits: u32,
    /// Virtual (guest) size in bytes.
    pub size: u64,
    /// Host offset of the active L1 table (cluster-aligned when `l1_entries > 0`).
    pub l1_table_offset: u64,
    /// L1 entries needed to cover `size` (`<= l1_size`, and the table is inside the file).
    pub l1_entries: u64,
    pub compression: Compression,
    /// The backing file name as stored (raw bytes), if any.
    pub backing_name: Option<Vec<u8>>,
    /// The backing format from the header extension, if any.
    pub backing_format: Option<String>,
}

impl Header {
    pub(crate) fn cluster_size(&self) -> u64 {
        1 << self.cluster_bits
    }
    /// Guest bytes covered by one L2 table (one L1 entry).
    pub(crate) fn l1_coverage(&self) -> u64 {
        1u64 << (2 * self.cluster_bits - 3)
    }
}

pub(crate) fn corrupt(path: &Path, what: impl Into<String>) -> ImageError {
    ImageError::Corrupt {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

pub(crate) fn unsupported(path: &Path, what: impl Into<String>) -> ImageError {
    ImageError::Unsupported {
        path: path.to_path_buf(),
        what: what.into(),
    }
}

pub(crate) fn read_error(path: &Path, source: std::io::Error) -> ImageError {
    ImageError::Io {
        op: "cannot read",
        path: path.to_path_buf(),
        source,
    }
}

fn be32(b: &[u8], at: usize) -> u32 {
    let mut x = [0u8; 4];
    x.copy_from_slice(&b[at..at + 4]);
    u32::from_be_bytes(x)
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    x.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(x)
}

/// Parses and validates the header of the qcow2 file behind `io`.
pub(crate) fn parse_header(io: &dyn HostIo, path: &Path) -> ImageResult<Header> {
    let file_len = io.len();
    if file_len < V2_HEADER_LEN {
        return Err(corrupt(
            path,
            format!("too short for a qcow2 header ({file_len} bytes)"),
        ));
    }
    // The fixed part: 72 bytes for v2, up to 112 for v3 (what follows 104 is read only if the
    // header says it is there).
    let mut fixed = [0u8; 112];
    let have = file_len.min(fixed.len() as u64) as usize;
    io.read_exact_at(&mut fixed[..have], 0)
        .map_err(|e| read_error(path, e))?;
    if fixed[0..4] != QCOW2_MAGIC {
        return Err(corrupt(path, "not a qcow2 image (bad magic)"));
    }
    let version = be32(&fixed, 4);
    if version != 2 && version != 3 {
        return Err(unsupported(path, format!("qcow2 version {version}")));
    }
    let backing_file_offset = be64(&fixed, 8);
    let backing_file_size = u64::from(be32(&fixed, 16));
    let cluster_bits = be32(&fixed, 20);
    let size = be64(&fixed, 24);
    let crypt_method = be32(&fixed, 32);
    let l1_size = u64::from(be32(&fixed, 36));
    let l1_table_offset = be64(&fixed, 40);

    if cluster_bits < MIN_CLUSTER_BITS {
        return Err(corrupt(
            path,
            format!("invalid cluster_bits {cluster_bits} (the smallest is {MIN_CLUSTER_BITS})"),
        ));
    }
    if cluster_bits > MAX_CLUSTER_BITS {
        return Err(unsupported(
            path,
            format!("a cluster size of 2^{cluster_bits} bytes (QEMU's largest is 2 MiB)"),
        ));
    }
    let cluster_size = 1u64 << cluster_bits;

    let (header_length, incompatible, compression_byte) = match version {
        2 => (V2_HEADER_LEN, 0u64, None),
        _ => v3_fields(&fixed[..have], path, file_len, cluster_size)?,
    };
    let compression = features(path, incompatible, crypt_method, compression_byte)?;

    if size > i64::MAX as u64 {
        return Err(corrupt(path, format!("virtual size {size} is too large")));
    }

    // The rest of the first cluster: header extensions and the backing file name. Bytes past
    // the end of a short file read as zeros (an end-of-extensions marker), as QEMU reads them.
    let (backing_name, ext_end) = backing_name(
        io,
        path,
        backing_file_offset,
        backing_file_size,
        cluster_size,
    )?;
    let backing_format = match header_length < ext_end {
        true => extensions(io, path, header_length, ext_end)?,
        false => None,
    };
    let l1_entries = check_l1(io, path, size, cluster_bits, l1_size, l1_table_offset)?;
    Ok(Header {
        version,
        cluster_bits,
        size,
        l1_table_offset,
        l1_entries,
        compression,
        backing_name,
        backing_format,
    })
}

/// The fields of a version 3 header past version 2's (`fixed` holds what the file has of its
/// first 112 bytes): header length, incompatible features, compression type byte.
fn v3_fields(
    fixed: &[u8],
    path: &Path,
    file_len: u64,
    cluster_size: u64,
) -> ImageResult<(u64, u64, Option<u8>)> {
    let have = fixed.len();
    if have < V3_MIN_HEADER_LEN as usize {
        return Err(corrupt(
            path,
            format!("too short for a qcow2 version 3 header ({file_len} bytes)"),
        ));
    }
    let incompatible = be64(fixed, 72);
    let refcount_order = be32(fixed, 96);
    let header_length = u64::from(be32(fixed, 100));
    if header_length < V3_MIN_HEADER_LEN {
        return Err(corrupt(
            path,
            format!("header_length {header_length} is too short (at least {V3_MIN_HEADER_LEN})"),
        ));
    }
    if header_length % 8 != 0 {
        return Err(corrupt(
            path,
            format!("header_length {header_length} is not a multiple of 8"),
        ));
    }
    if header_length > cluster_size {
        return Err(corrupt(
            path,
            format!("header_length {header_length} exceeds the cluster size {cluster_size}"),
        ));
    }
    if refcount_order > 6 {
        return Err(corrupt(
            path,
            format!("invalid refcount_order {refcount_order} (at most 6)"),
        ));
    }
    let compression_byte = if header_length > V3_MIN_HEADER_LEN {
        if have <= V3_MIN_HEADER_LEN as usize {
            return Err(corrupt(
                path,
                format!(
                    "the header ({header_length} bytes) is longer than the file ({file_len} bytes)"
                ),
            ));
        }
        Some(fixed[104])
    } else {
        None
    };
    Ok((header_length, incompatible, compression_byte))
}

/// Refuses what cairn does not read (an image QEMU marked corrupt, encryption, an external
/// data file, subclusters, unknown incompatible features); returns the compression type.
fn features(
    path: &Path,
    incompatible: u64,
    crypt_method: u32,
    compression_byte: Option<u8>,
) -> ImageResult<Compression> {
    if incompatible & INCOMPAT_CORRUPT != 0 {
        return Err(corrupt(
            path,
            "the image is marked corrupt by QEMU (run `qemu-img check -r all` on it)",
        ));
    }
    match crypt_method {
        0 => {}
        1 => return Err(unsupported(path, "an encrypted qcow2 (AES)")),
        2 => return Err(unsupported(path, "an encrypted qcow2 (LUKS)")),
        m => {
            return Err(unsupported(
                path,
                format!("an encrypted qcow2 (encryption method {m})"),
            ))
        }
    }
    if incompatible & INCOMPAT_DATA_FILE != 0 {
        return Err(unsupported(path, "a qcow2 with an external data file"));
    }
    if incompatible & INCOMPAT_EXTL2 != 0 {
        return Err(unsupported(path, "extended L2 entries (subclusters)"));
    }
    let unknown = incompatible & !INCOMPAT_KNOWN;
    if unknown != 0 {
        return Err(unsupported(
            path,
            format!("unknown incompatible feature bits 0x{unknown:x}"),
        ));
    }
    Ok(if incompatible & INCOMPAT_COMPRESSION != 0 {
        match compression_byte {
            None => {
                return Err(corrupt(
                    path,
                    "the compression type feature bit is set but the header has no compression type field",
                ))
            }
            Some(0) => Compression::Deflate,
            Some(1) => Compression::Zstd,
            Some(t) => return Err(unsupported(path, format!("compression type {t}"))),
        }
    } else {
        match compression_byte {
            None | Some(0) => Compression::Deflate,
            Some(t) => {
                return Err(corrupt(
                    path,
                    format!("compression type {t} without the compression type feature bit"),
                ))
            }
        }
    })
}

/// The backing file name, if the header names one, and where the header extensions end
/// (the name, or the end of the first cluster).
fn backing_name(
    io: &dyn HostIo,
    path: &Path,
    backing_file_offset: u64,
    backing_file_size: u64,
    cluster_size: u64,
) -> ImageResult<(Option<Vec<u8>>, u64)> {
    let file_len = io.len();
    if backing_file_offset != 0 && backing_file_size != 0 {
        if backing_file_offset > cluster_size {
            return Err(corrupt(
                path,
                format!("backing file name offset 0x{backing_file_offset:x} is outside the first cluster"),
            ));
        }
        if backing_file_size > MAX_BACKING_NAME
            || backing_file_size > cluster_size - backing_file_offset
        {
            return Err(corrupt(
                path,
                format!("backing file name is too long ({backing_file_size} bytes)"),
            ));
        }
        let end = backing_file_offset + backing_file_size;
        if end > file_len {
            return Err(corrupt(
                path,
                format!(
                    "backing file name at 0x{backing_file_offset:x} is past the end of the file (0x{file_len:x} bytes): truncated?"
                ),
            ));
        }
        let mut name = vec![0u8; backing_file_size as usize];
        io.read_exact_at(&mut name, backing_file_offset)
            .map_err(|e| read_error(path, e))?;
        if name.contains(&0) {
            return Err(corrupt(path, "the backing file name contains a NUL byte"));
        }
        Ok((Some(name), backing_file_offset))
    } else {
        Ok((None, cluster_size))
    }
}

/// The header extensions between the header's end and `ext_end`: the backing format, if
/// given; an encryption header or an external data file is refused.
fn extensions(
    io: &dyn HostIo,
    path: &Path,
    header_length: u64,
    ext_end: u64,
) -> ImageResult<Option<String>> {
    let file_len = io.len();
    let mut backing_format = None;
    let area_len = ext_end - header_length; // <= 2 MiB
    let mut area = vec![0u8; area_len as usize];
    let avail = file_len.saturating_sub(header_length).min(area_len) as usize;
    io.read_exact_at(&mut area[..avail], header_length)
        .map_err(|e| read_error(path, e))?;
    let mut at = 0usize;
    while area.len() - at >= 8 {
        let ty = be32(&area, at);
        let len = be32(&area, at + 4) as usize;
        at += 8;
        if ty == EXT_END {
            break;
        }
        if len > area.len() - at {
            return Err(corrupt(
                path,
                format!("header extension 0x{ty:08x} ({len} bytes) overruns the header area"),
            ));
        }
        let data = &area[at..at + len];
        match ty {
            EXT_BACKING_FORMAT => {
                if len >= 16 {
                    return Err(corrupt(
                        path,
                        format!("backing format extension too long ({len} bytes)"),
                    ));
                }
                backing_format = Some(String::from_utf8_lossy(data).into_owned());
            }
            EXT_FDE => return Err(unsupported(path, "a full disk encryption header")),
            EXT_DATA_FILE => return Err(unsupported(path, "a qcow2 with an external data file")),
            // Feature names, bitmaps and anything unknown do not change what is read.
            _ => {}
        }
        // Extension data is padded to a multiple of 8 bytes.
        let padded = len.div_ceil(8) * 8;
        at = at.saturating_add(padded).min(area.len());
    }
    Ok(backing_format)
}

/// Checks the active L1 table's size and place; returns the entries the virtual size uses.
fn check_l1(
    io: &dyn HostIo,
    path: &Path,
    size: u64,
    cluster_bits: u32,
    l1_size: u64,
    l1_table_offset: u64,
) -> ImageResult<u64> {
    let (file_len, cluster_size) = (io.len(), 1u64 << cluster_bits);
    if l1_size * 8 > MAX_L1_BYTES {
        return Err(unsupported(
            path,
            format!("an L1 table of {l1_size} entries (more than {MAX_L1_BYTES} bytes)"),
        ));
    }
    let coverage = 1u64 << (2 * cluster_bits - 3);
    let l1_entries = size.div_ceil(coverage);
    if l1_entries > l1_size {
        return Err(corrupt(
            path,
            format!(
                "the L1 table has {l1_size} entries, too few for a virtual size of {size} bytes (needs {l1_entries})"
            ),
        ));
    }
    if l1_entries > 0 {
        if l1_table_offset & (cluster_size - 1) != 0 {
            return Err(corrupt(
                path,
                format!("L1 table offset 0x{l1_table_offset:x} is not aligned to the cluster size"),
            ));
        }
        let fits = l1_table_offset
            .checked_add(l1_size * 8)
            .is_some_and(|end| end <= file_len);
        if !fits {
            return Err(corrupt(
                path,
                format!(
                    "L1 table at 0x{l1_table_offset:x} ({l1_size} entries) is past the end of the file (0x{file_len:x} bytes): truncated?"
                ),
            ));
        }
    }
    Ok(l1_entries)
}

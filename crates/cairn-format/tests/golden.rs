//! Golden test vectors for every on-disk structure of format v1 (`docs/FORMAT.md`), and for
//! the format-v2 structures written so far (the `v2_` vectors: encryption, issue 16).
//!
//! Each structure is built from fixed inputs, encoded, and compared byte for byte with a
//! checked-in vector (`tests/golden/<name>.hex`); the checked-in bytes are then decoded and
//! compared with the built value. Where a key or id derives from the content (the BLAKE3 of
//! an object names it), that key is pinned as a literal too. So no later change (format v2
//! included) can alter what v1 writes, or how v1 bytes read, without a test here failing.
//!
//! To (re)create the vectors after a deliberate change: `CAIRN_BLESS_GOLDEN=1 cargo test -p
//! cairn-format --test golden`, then review the diff of `tests/golden/`. A v1 vector should
//! never need that: a diff there means v1 repositories are read or written differently.

use cairn_format::keys;
use std::collections::BTreeSet;
use std::fmt::Display;
use std::path::PathBuf;

use cairn_format::codec::{Decoder, Encoder};
use cairn_format::config::{Chunker, Compression, RepoConfig};
use cairn_format::crypto::{Domain, KdfParams, KeySlot, MasterKey};
use cairn_format::group::{chunk, group_id, open_group, GroupBuilder, GroupChunk};
use cairn_format::group_summary::{
    key_of, Before, GroupSummary, Resolved, SummaryBuilder, SummaryDelta,
};
use cairn_format::index::{IndexFile, PackIndex};
use cairn_format::index_run;
use cairn_format::leaf_v2::{LeafDigest, RunExtent, RunLeaf};
use cairn_format::marker::{self, GcLeftover, GcPlan, ProcessTag, Quarantine, Session};
use cairn_format::merged_summary::MergedSummary;
use cairn_format::name::{escape, unescape, unescape_segment};
use cairn_format::node::{self, Extent, Interior, Leaf};
use cairn_format::pack::{
    self, decode_blob, encode_blob, BlobEncoding, BlobEntry, BlobKind, PackBuilder,
};
use cairn_format::pack_v2::{self, PackWriter};
use cairn_format::record_bundle::RecordBundle;
use cairn_format::summary::{self, ProbeKey, Summary};
use cairn_format::version::{CommitStats, VersionRecord};
use cairn_format::{envelope, refs, FormatError, Id, FORMAT_VERSION};

// ---------------------------------------------------------------------------------------------
// Vector files: compare, bless, list.
// ---------------------------------------------------------------------------------------------

/// Set to `1` to (re)write the vector files instead of comparing with them.
const BLESS_ENV: &str = "CAIRN_BLESS_GOLDEN";

/// Hex digits per line of a vector file (32 bytes), so that diffs stay readable.
const HEX_PER_LINE: usize = 64;

/// Every vector this test owns. A vector missing from the directory fails its test; a file
/// in the directory that is not listed here fails `vector_directory_holds_exactly_the_list`
/// (a vector whose test was deleted is coverage silently lost).
const VECTORS: &[&str] = &[
    "envelope_empty",
    "envelope_payload",
    "config_fixed_none",
    "config_fastcdc_zstd_negative",
    "config_fixed_zstd_max",
    "config_format2",
    "config_format2_encrypted",
    "config_legacy_no_summary_bits",
    "blob_entries",
    "blob_raw_none",
    "blob_raw_incompressible",
    "blob_raw_tiny",
    "blob_zstd",
    "pack",
    "pack_empty",
    "index_three_packs",
    "index_empty",
    "leaf_mixed",
    "leaf_one_chunk",
    "interior_level1",
    "interior_level3",
    "version_first",
    "version_child_zero_image",
    "version_child_with_root",
    "ref",
    "summary_small",
    "summary_sized",
    "summary_empty",
    "deleted_marker",
    "freed_marker",
    "session_v1_0",
    "session_v1_1",
    "gc_plan",
    "gc_plan_empty",
    "gc_lock",
    "gc_last",
    "quarantine",
    "quarantine_empty_reason",
    "gc_leftover",
    "gc_leftover_empty",
    "v2_sealed_node",
    "v2_sealed_empty",
    "v2_key_slot",
    "v2_group_sealed_raw",
    "v2_pack_plain",
    "v2_pack_3_plain",
    "v2_leaf_runs",
    "v2_leaf_digest",
    "v2_interior_digests",
    "v2_index_run",
    "v2_index_run_2",
    "v2_index_run_3",
    "v2_group_summary",
    "v2_group_summary_counted",
    "v2_merged_summary",
    "v2_merged_summary_chains",
    "v2_summary_delta",
    "v2_record_bundle",
    "vm_version",
    "memory_state_header",
];

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn vector_path(name: &str) -> PathBuf {
    golden_dir().join(format!("{name}.hex"))
}

fn blessing() -> bool {
    std::env::var(BLESS_ENV).is_ok_and(|v| v == "1")
}

/// The canonical text of a vector: lowercase hex, `HEX_PER_LINE` digits a line.
fn to_hex_lines(bytes: &[u8]) -> String {
    let hex = hex::encode(bytes);
    let mut out = String::with_capacity(hex.len() + hex.len() / HEX_PER_LINE + 1);
    for line in hex.as_bytes().chunks(HEX_PER_LINE) {
        out.push_str(std::str::from_utf8(line).expect("hex is ASCII"));
        out.push('\n');
    }
    out
}

/// Reads a vector; a missing or malformed file is a failure, never a silent pass.
fn read_vector(name: &str) -> Vec<u8> {
    assert!(VECTORS.contains(&name), "vector {name} is not in VECTORS");
    let path = vector_path(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "golden vector {name}: cannot read {}: {e} (create it with {BLESS_ENV}=1)",
            path.display()
        )
    });
    let digits: String = text.split_whitespace().collect();
    let bytes = hex::decode(&digits)
        .unwrap_or_else(|e| panic!("golden vector {name}: {} is not hex: {e}", path.display()));
    assert_eq!(
        text,
        to_hex_lines(&bytes),
        "golden vector {name}: {} is not in canonical form (lowercase, {HEX_PER_LINE} digits a line)",
        path.display()
    );
    bytes
}

/// Writes a vector (bless mode), atomically so that a parallel reader never sees half a file.
fn write_vector(name: &str, bytes: &[u8]) {
    assert!(VECTORS.contains(&name), "vector {name} is not in VECTORS");
    std::fs::create_dir_all(golden_dir()).expect("create tests/golden");
    let path = vector_path(name);
    let tmp = golden_dir().join(format!(".{name}.hex.tmp"));
    std::fs::write(&tmp, to_hex_lines(bytes)).expect("write vector");
    std::fs::rename(&tmp, &path).expect("rename vector into place");
}

/// Fails with the vector's name and the first differing offset unless the bytes are equal.
fn assert_same_bytes(name: &str, expected: &[u8], actual: &[u8]) {
    if expected == actual {
        return;
    }
    let at = expected
        .iter()
        .zip(actual)
        .position(|(a, b)| a != b)
        .unwrap_or(expected.len().min(actual.len()));
    let around =
        |b: &[u8]| hex::encode(&b[at.saturating_sub(8).min(b.len())..(at + 8).min(b.len())]);
    panic!(
        "golden vector {name}: encoding differs at byte {at} (0x{at:x}); golden is {} bytes, \
         encoder wrote {}\n  golden  [{}..]: {}\n  encoded [{}..]: {}\n\
         v1 bytes must never change; if this is deliberate, rerun with {BLESS_ENV}=1 and review",
        expected.len(),
        actual.len(),
        at.saturating_sub(8),
        around(expected),
        at.saturating_sub(8),
        around(actual),
    );
}

/// Encode direction: `encoded` must equal the vector (in bless mode it becomes the vector).
/// Returns the golden bytes, for the decode direction.
fn golden(name: &str, encoded: &[u8]) -> Vec<u8> {
    if blessing() {
        write_vector(name, encoded);
        return encoded.to_vec();
    }
    let expected = read_vector(name);
    assert_same_bytes(name, &expected, encoded);
    expected
}

/// Decode direction only, for bytes whose encoding may legitimately vary (zstd frames): in
/// bless mode the vector becomes what the code writes now; else it is read as checked in.
fn golden_decode_only(name: &str, current: impl FnOnce() -> Vec<u8>) -> Vec<u8> {
    if blessing() {
        let bytes = current();
        write_vector(name, &bytes);
        return bytes;
    }
    read_vector(name)
}

/// Pins a key or id derived from content (or from a name) as a literal.
fn pin(what: &str, actual: impl Display, expected: &str) {
    assert_eq!(actual.to_string(), expected, "{what} changed");
}

#[test]
fn vector_directory_holds_exactly_the_list() {
    if blessing() {
        return; // the other tests are writing the files right now
    }
    let listed: BTreeSet<String> = VECTORS.iter().map(|s| s.to_string()).collect();
    assert_eq!(listed.len(), VECTORS.len(), "VECTORS has duplicates");
    let dir = std::fs::read_dir(golden_dir()).expect("tests/golden exists");
    let present: BTreeSet<String> = dir
        .map(|e| {
            e.expect("dir entry")
                .file_name()
                .to_string_lossy()
                .into_owned()
        })
        .map(|f| f.strip_suffix(".hex").map(str::to_string).unwrap_or(f))
        .collect();
    let missing: Vec<_> = listed.difference(&present).collect();
    let stray: Vec<_> = present.difference(&listed).collect();
    assert!(
        missing.is_empty() && stray.is_empty(),
        "missing vectors {missing:?}, unlisted files {stray:?} in {}",
        golden_dir().display()
    );
}

// ---------------------------------------------------------------------------------------------
// Fixed inputs.
// ---------------------------------------------------------------------------------------------

/// 2026-01-01T00:00:00.123456789Z in ns since the epoch.
const T0: i64 = 1_767_225_600_123_456_789;

/// A fixed id whose 32 bytes are all `n`.
fn id(n: u8) -> Id {
    Id([n; 32])
}

/// A fixed id with distinct bytes (a real BLAKE3 output), for places where the bytes matter.
fn hid(tag: &str) -> Id {
    Id::of(tag.as_bytes())
}

// ---------------------------------------------------------------------------------------------
// Envelope.
// ---------------------------------------------------------------------------------------------

/// The envelope every metadata object shares: magic, version 1, length, payload, BLAKE3.
#[test]
fn envelope() {
    const MAGIC: &[u8; 8] = b"CRNTEST\0";
    for (name, payload) in [
        ("envelope_empty", &b""[..]),
        ("envelope_payload", &b"golden payload \x00\xff"[..]),
    ] {
        let bytes = golden(name, &envelope::seal(MAGIC, payload));
        assert_eq!(&bytes[8..12], &1u32.to_le_bytes(), "{name}: format version");
        assert_eq!(envelope::open(MAGIC, &bytes, "test").unwrap(), payload);
    }
    assert_eq!(FORMAT_VERSION, 1, "this file pins format v1");
}

// ---------------------------------------------------------------------------------------------
// Config.
// ---------------------------------------------------------------------------------------------

fn config_fixed_none() -> RepoConfig {
    RepoConfig {
        repo_id: *b"golden-repo-id16",
        chunker: Chunker::Fixed,
        chunk_size: 4096,
        segment_size: 64 * 1024,
        fanout: 2,
        compression: Compression::None,
        pack_target: 1 << 20,
        created_ns: T0,
        summary_bits: 4,
        v2: None,
    }
}

/// Every chunker and compression, a negative zstd level (stored as i8), a pre-1970 time.
#[test]
fn config() {
    let cases = [
        ("config_fixed_none", config_fixed_none()),
        (
            "config_fastcdc_zstd_negative",
            RepoConfig {
                repo_id: [0xc0; 16],
                chunker: Chunker::FastCdc,
                chunk_size: 64 * 1024,
                segment_size: 4 << 20,
                fanout: 256,
                compression: Compression::Zstd { level: -7 },
                pack_target: 16 << 20,
                created_ns: -1_000_000_007,
                summary_bits: 24,
                v2: None,
            },
        ),
        (
            "config_fixed_zstd_max",
            RepoConfig {
                repo_id: [0x01; 16],
                chunker: Chunker::Fixed,
                chunk_size: 4 << 20,
                segment_size: 64 << 20,
                fanout: 4096,
                compression: Compression::Zstd { level: 19 },
                pack_target: 1 << 30,
                created_ns: i64::MAX,
                summary_bits: 64,
                v2: None,
            },
        ),
    ];
    for (name, cfg) in cases {
        cfg.validate().unwrap();
        let bytes = golden(name, &cfg.encode());
        assert_eq!(RepoConfig::decode(&bytes).unwrap(), cfg, "{name}");
    }
    pin("config key", keys::CONFIG, "config");
}

/// A format 2 config, and its bytes checked against FORMAT.md's description rather than the
/// encoder's v2 path alone: the format 1 payload of the same settings, then the group size and
/// zero flags, in an envelope of version 2.
#[test]
fn config_format2() {
    let cfg = RepoConfig {
        v2: Some(cairn_format::config::V2Settings {
            group_size: 64 * 1024,
            key_check: None,
        }),
        ..config_fixed_none()
    };
    cfg.validate().unwrap();
    let bytes = golden("config_format2", &cfg.encode());
    assert_eq!(RepoConfig::decode(&bytes).unwrap(), cfg);
    let v1 = config_fixed_none().encode();
    let v1_payload = &v1[16..v1.len() - 32];
    let mut payload = v1_payload.to_vec();
    payload.extend_from_slice(&(64u32 * 1024).to_le_bytes());
    payload.extend_from_slice(&0u32.to_le_bytes());
    let mut expected = b"CRNCONF\0".to_vec();
    expected.extend_from_slice(&2u32.to_le_bytes());
    expected.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    expected.extend_from_slice(&payload);
    let sum = blake3::hash(&expected);
    expected.extend_from_slice(sum.as_bytes());
    assert_same_bytes("config_format2", &expected, &bytes);
}

/// An encrypted format 2 config: flags bit 0, then the master key's key check — BLAKE3 keyed
/// with the id key (master key bytes 32..64) over "cairn/2 key check", computed here with the
/// blake3 crate directly rather than through `MasterKey`.
#[test]
fn config_format2_encrypted() {
    let master: [u8; 64] = std::array::from_fn(|i| i as u8);
    let key = cairn_format::crypto::MasterKey::from_bytes(master);
    let check =
        *blake3::keyed_hash(master[32..].try_into().unwrap(), b"cairn/2 key check").as_bytes();
    assert_eq!(key.key_check(), check);
    let cfg = RepoConfig {
        v2: Some(cairn_format::config::V2Settings {
            group_size: 64 * 1024,
            key_check: Some(check),
        }),
        ..config_fixed_none()
    };
    let bytes = golden("config_format2_encrypted", &cfg.encode());
    assert_eq!(RepoConfig::decode(&bytes).unwrap(), cfg);
    let plain = RepoConfig {
        v2: Some(cairn_format::config::V2Settings {
            group_size: 64 * 1024,
            key_check: None,
        }),
        ..config_fixed_none()
    }
    .encode();
    let mut payload = plain[16..plain.len() - 32].to_vec();
    let n = payload.len();
    payload[n - 4..].copy_from_slice(&1u32.to_le_bytes());
    payload.extend_from_slice(&check);
    assert_same_bytes(
        "config_format2_encrypted",
        &envelope::seal_version(b"CRNCONF\0", 2, &payload),
        &bytes,
    );
}

/// Configs written before reference summaries existed have no summary-bits byte; they read
/// as 24 bits per chunk. (Only decoded: v1 always writes the byte now.)
#[test]
fn config_legacy_without_summary_bits() {
    let cfg = config_fixed_none();
    let full = cfg.encode();
    let payload = envelope::open(b"CRNCONF\0", &full, "config").unwrap();
    let legacy = envelope::seal(b"CRNCONF\0", &payload[..payload.len() - 1]);
    let bytes = golden("config_legacy_no_summary_bits", &legacy);
    let back = RepoConfig::decode(&bytes).unwrap();
    assert_eq!(
        back,
        RepoConfig {
            summary_bits: summary::DEFAULT_BITS_PER_CHUNK,
            ..cfg
        }
    );
    assert_eq!(summary::DEFAULT_BITS_PER_CHUNK, 24);
}

// ---------------------------------------------------------------------------------------------
// Blobs and packs.
// ---------------------------------------------------------------------------------------------

/// The 48-byte blob entry of pack trailers and index files: every kind × encoding, extreme
/// values.
#[test]
fn blob_entries() {
    let entries = [
        BlobEntry {
            id: id(0x01),
            kind: BlobKind::Data,
            encoding: BlobEncoding::Raw,
            offset: 16,
            stored_len: 4096,
            raw_len: 4096,
        },
        BlobEntry {
            id: id(0x02),
            kind: BlobKind::Data,
            encoding: BlobEncoding::Zstd,
            offset: 4112,
            stored_len: 100,
            raw_len: 65536,
        },
        BlobEntry {
            id: id(0x03),
            kind: BlobKind::Node,
            encoding: BlobEncoding::Raw,
            offset: 0x0102_0304,
            stored_len: 8,
            raw_len: 8,
        },
        BlobEntry {
            id: hid("node"),
            kind: BlobKind::Node,
            encoding: BlobEncoding::Zstd,
            offset: u32::MAX - 1,
            stored_len: u32::MAX,
            raw_len: u32::MAX,
        },
    ];
    let mut e = Encoder::new();
    for entry in &entries {
        entry.encode(&mut e);
    }
    let bytes = golden("blob_entries", &e.finish());
    assert_eq!(bytes.len(), entries.len() * pack::ENTRY_LEN);
    let mut d = Decoder::new(&bytes, "test");
    for entry in &entries {
        assert_eq!(&BlobEntry::decode(&mut d, "test").unwrap(), entry);
    }
    d.finish().unwrap();
    // The reserved u16 (bytes 34..36) is written as zero and ignored by v1 readers: a v2
    // that gives it a meaning cannot count on v1 readers noticing it.
    let mut reserved = bytes[..pack::ENTRY_LEN].to_vec();
    reserved[34..36].copy_from_slice(&[0xff, 0xff]);
    let mut d = Decoder::new(&reserved, "test");
    assert_eq!(BlobEntry::decode(&mut d, "test").unwrap(), entries[0]);
}

fn raw_plain() -> Vec<u8> {
    b"cairn golden blob, stored raw\n".to_vec()
}

/// 1 KiB that zstd cannot shrink by 1/32: the BLAKE3 output stream of a fixed key.
fn incompressible_plain() -> Vec<u8> {
    let mut out = vec![0; 1024];
    blake3::Hasher::new()
        .update(b"golden incompressible")
        .finalize_xof()
        .fill(&mut out);
    out
}

/// Text that zstd shrinks well.
fn zstd_plain() -> Vec<u8> {
    (0..100)
        .flat_map(|i| format!("block {i:05} of the golden zstd blob\n").into_bytes())
        .collect()
}

/// The stored bytes of the zstd vector, for other tests (read only: its own test writes it).
fn zstd_stored() -> Vec<u8> {
    if blessing() {
        encode_blob(&zstd_plain(), Compression::Zstd { level: 3 }).0
    } else {
        read_vector("blob_zstd")
    }
}

fn entry_for(plain: &[u8], encoding: BlobEncoding, stored: &[u8]) -> BlobEntry {
    BlobEntry {
        id: Id::of(plain),
        kind: BlobKind::Data,
        encoding,
        offset: 16,
        stored_len: stored.len() as u32,
        raw_len: plain.len() as u32,
    }
}

/// Blobs stored raw: without compression, and with zstd when it does not save 1/32 (a tiny
/// blob, random bytes). Both directions are pinned: raw is the plain bytes.
#[test]
fn blobs_raw() {
    let cases = [
        ("blob_raw_none", raw_plain(), Compression::None),
        (
            "blob_raw_incompressible",
            incompressible_plain(),
            Compression::Zstd { level: 3 },
        ),
        (
            "blob_raw_tiny",
            b"tiny".to_vec(),
            Compression::Zstd { level: 19 },
        ),
    ];
    for (name, plain, compression) in cases {
        let (stored, encoding) = encode_blob(&plain, compression);
        assert_eq!(encoding, BlobEncoding::Raw, "{name}");
        let bytes = golden(name, &stored);
        assert_eq!(bytes, plain, "{name}: raw is the plain bytes");
        let entry = entry_for(&plain, BlobEncoding::Raw, &bytes);
        assert_eq!(decode_blob(&entry, &bytes).unwrap(), plain, "{name}");
    }
    pin(
        "id of blob_raw_none",
        Id::of(&raw_plain()),
        "4501ede1d00fc40a7eb3e731cbbf1a6317c42a8a84b9a0d9a2ca9ace0327978a",
    );
}

/// A zstd-encoded blob. zstd's output may differ between library versions (and levels), and
/// any valid frame is fine for v1, so only the decode direction is pinned: the checked-in
/// frame must decode to the plain bytes. The encode direction is checked for its decision
/// (zstd, because it pays) and its round trip, not its bytes.
#[test]
fn blob_zstd() {
    let plain = zstd_plain();
    let compression = Compression::Zstd { level: 3 };
    let bytes = golden_decode_only("blob_zstd", || encode_blob(&plain, compression).0);
    let entry = entry_for(&plain, BlobEncoding::Zstd, &bytes);
    assert_eq!(decode_blob(&entry, &bytes).unwrap(), plain);
    assert!(bytes.len() + plain.len() / 32 < plain.len());

    let (stored, encoding) = encode_blob(&plain, compression);
    assert_eq!(encoding, BlobEncoding::Zstd);
    let now = entry_for(&plain, BlobEncoding::Zstd, &stored);
    assert_eq!(decode_blob(&now, &stored).unwrap(), plain);

    // The frame read as raw bytes, or with a wrong plain length, is refused.
    let as_raw = entry_for(&plain, BlobEncoding::Raw, &bytes);
    assert_eq!(
        decode_blob(&as_raw, &bytes),
        Err(FormatError::Checksum { what: "blob" })
    );
    let short = BlobEntry {
        raw_len: plain.len() as u32 - 1,
        ..entry
    };
    assert!(decode_blob(&short, &bytes).is_err());
}

/// The salt the pack vectors use instead of a random one (the only random bytes of a pack).
const SALT: u32 = 0x5a17_c0de;

/// Finishes `builder` and replaces its random salt with `SALT`; returns (id, bytes, entries).
fn finish_salted(builder: PackBuilder) -> (Id, Vec<u8>, Vec<BlobEntry>) {
    let (_, mut bytes, entries) = builder.finish();
    bytes[12..16].copy_from_slice(&SALT.to_le_bytes());
    (Id::of(&bytes), bytes, entries)
}

/// A pack with a raw data blob, a zstd data blob (the golden frame, so the pack's bytes do not
/// depend on the zstd version) and a raw manifest node; header, offsets, trailer and footer.
#[test]
fn pack_with_blobs() {
    let raw = raw_plain();
    let zplain = zstd_plain();
    let zstored = zstd_stored();
    let node = leaf_mixed().encode();
    let mut builder = PackBuilder::new();
    builder.push(
        Id::of(&raw),
        BlobKind::Data,
        BlobEncoding::Raw,
        &raw,
        raw.len() as u32,
    );
    builder.push(
        Id::of(&zplain),
        BlobKind::Data,
        BlobEncoding::Zstd,
        &zstored,
        zplain.len() as u32,
    );
    builder.push(
        Id::of(&node),
        BlobKind::Node,
        BlobEncoding::Raw,
        &node,
        node.len() as u32,
    );
    let expected_len = builder.len();
    let (pack_id, encoded, entries) = finish_salted(builder);
    assert_eq!(encoded.len(), expected_len);
    let expected_entries = vec![
        BlobEntry {
            id: Id::of(&raw),
            kind: BlobKind::Data,
            encoding: BlobEncoding::Raw,
            offset: 16,
            stored_len: raw.len() as u32,
            raw_len: raw.len() as u32,
        },
        BlobEntry {
            id: Id::of(&zplain),
            kind: BlobKind::Data,
            encoding: BlobEncoding::Zstd,
            offset: 16 + raw.len() as u32,
            stored_len: zstored.len() as u32,
            raw_len: zplain.len() as u32,
        },
        BlobEntry {
            id: Id::of(&node),
            kind: BlobKind::Node,
            encoding: BlobEncoding::Raw,
            offset: 16 + (raw.len() + zstored.len()) as u32,
            stored_len: node.len() as u32,
            raw_len: node.len() as u32,
        },
    ];
    assert_eq!(entries, expected_entries);

    let bytes = golden("pack", &encoded);
    assert_eq!(&bytes[..8], pack::MAGIC);
    assert_eq!(&bytes[8..12], &1u32.to_le_bytes());
    assert_eq!(&bytes[12..16], &SALT.to_le_bytes());
    assert_eq!(pack::parse_pack(&bytes).unwrap(), expected_entries);
    let footer = &bytes[bytes.len() - pack::FOOTER_LEN..];
    let (n, trailer_len, sum) = pack::parse_footer(footer).unwrap();
    assert_eq!((n, trailer_len), (3, 3 * 48));
    let trailer_start = bytes.len() - pack::FOOTER_LEN - trailer_len as usize;
    assert_eq!(
        &sum,
        blake3::hash(&bytes[trailer_start..bytes.len() - pack::FOOTER_LEN]).as_bytes()
    );
    for (entry, plain) in expected_entries.iter().zip([&raw, &zplain, &node]) {
        let r = entry.range();
        assert_eq!(
            &decode_blob(entry, &bytes[r.start as usize..r.end as usize]).unwrap(),
            plain
        );
    }
    // The pack's id (and so its key `packs/<hh>/<id>`, built in cairn-repo) is its BLAKE3.
    pin(
        "pack id",
        Id::of(&bytes),
        "3368cc3bfe40f028137f34ddda6925dac80c3332ae716082a39445eb72a58e2e",
    );
    assert_eq!(pack_id, Id::of(&bytes));
}

/// A pack with no blob: header and a footer over an empty trailer (parse_pack accepts it).
#[test]
fn pack_empty() {
    let (_, encoded, entries) = finish_salted(PackBuilder::new());
    assert!(entries.is_empty());
    let bytes = golden("pack_empty", &encoded);
    assert_eq!(bytes.len(), pack::HEADER_LEN + pack::FOOTER_LEN);
    assert_eq!(pack::parse_pack(&bytes).unwrap(), vec![]);
    assert_eq!(&bytes[bytes.len() - 8..], pack::END_MAGIC);
}

// ---------------------------------------------------------------------------------------------
// Index files.
// ---------------------------------------------------------------------------------------------

fn index_three_packs() -> IndexFile {
    let entry = |n: u8, kind, encoding, offset| BlobEntry {
        id: id(n),
        kind,
        encoding,
        offset,
        stored_len: 1000 + n as u32,
        raw_len: 4096,
    };
    IndexFile {
        packs: vec![
            PackIndex {
                pack: hid("pack a"),
                entries: vec![
                    entry(0x10, BlobKind::Data, BlobEncoding::Zstd, 16),
                    entry(0x11, BlobKind::Data, BlobEncoding::Raw, 1032),
                    entry(0x12, BlobKind::Node, BlobEncoding::Raw, 2049),
                ],
            },
            PackIndex {
                pack: hid("pack b (no blobs)"),
                entries: vec![],
            },
            PackIndex {
                pack: hid("pack c"),
                entries: vec![entry(0x20, BlobKind::Node, BlobEncoding::Zstd, 16)],
            },
        ],
    }
}

/// Index files: several packs (one without entries), and none at all. Pins `index/<id>`.
#[test]
fn index_files() {
    let cases = [
        (
            "index_three_packs",
            index_three_packs(),
            "index/61a93910d326c4cd4100be88dd92dcea567cfd7002be89c353bc61e81e8890b3",
        ),
        (
            "index_empty",
            IndexFile::default(),
            "index/952a5bf9a10e74d6c1293b7ecca78d42e2862e62b7303f15f695aabc8ea4d796",
        ),
    ];
    for (name, file, key) in cases {
        let bytes = golden(name, &file.encode());
        assert_eq!(IndexFile::decode(&bytes).unwrap(), file, "{name}");
        pin(name, keys::index_file(&Id::of(&bytes)), key);
    }
}

// ---------------------------------------------------------------------------------------------
// Manifest nodes.
// ---------------------------------------------------------------------------------------------

/// Zero runs and chunks, adjacent zero runs merged by `push`.
fn leaf_mixed() -> Leaf {
    let mut leaf = Leaf::default();
    leaf.push(Extent::Zero { len: 4096 });
    leaf.push(Extent::Zero { len: 4096 });
    leaf.push(Extent::Chunk {
        id: hid("chunk 1"),
        len: 16384,
    });
    leaf.push(Extent::Chunk {
        id: hid("chunk 2"),
        len: 8192,
    });
    leaf.push(Extent::Zero { len: 1 });
    leaf.push(Extent::Chunk {
        id: id(0x33),
        len: 32767,
    });
    leaf
}

/// Leaves (the kind-1 blobs for one segment). A leaf's id is the BLAKE3 of its encoding.
#[test]
fn leaves() {
    let mixed = leaf_mixed();
    assert_eq!(mixed.extents.len(), 5, "two zero runs merged");
    assert_eq!(mixed.len(), 64 * 1024);
    let one = Leaf {
        extents: vec![Extent::Chunk {
            id: id(0xee),
            len: 1 << 20,
        }],
    };
    let cases = [
        (
            "leaf_mixed",
            mixed,
            "480d20e658f746f42372f3711874d22c0224b19b63e85b1c1f29f18468ccbb62",
        ),
        (
            "leaf_one_chunk",
            one,
            "fe4c47f9a94e23da816ac0fdf68d7cf9ecdfb2d0ff2e8569816c064bdc17b592",
        ),
    ];
    for (name, leaf, node_id) in cases {
        let bytes = golden(name, &leaf.encode());
        assert_eq!(Leaf::decode(&bytes).unwrap(), leaf, "{name}");
        pin(name, Id::of(&bytes), node_id);
    }
}

/// Interior nodes: level 1 (children are leaves) and a higher level with the widest slots.
#[test]
fn interiors() {
    let cases = [
        (
            "interior_level1",
            Interior::new(
                1,
                vec![
                    (0, hid("leaf 0")),
                    (1, hid("leaf 1")),
                    (255, hid("leaf 255")),
                ],
            ),
            "6f8967dfd4e756cb76a0dcf5c66d1035563fc6ad266920478812883d6bb88497",
        ),
        (
            "interior_level3",
            Interior::new(3, vec![(7, id(0x07)), (4095, id(0xff))]),
            "6d796757235dc3a1bdecea52e99ee293ab1c37f6b021077ab98d9330f80d0e33",
        ),
    ];
    for (name, node, node_id) in cases {
        let bytes = golden(name, &node.encode());
        assert_eq!(Interior::decode(&bytes).unwrap(), node, "{name}");
        pin(name, Id::of(&bytes), node_id);
    }
}

// ---------------------------------------------------------------------------------------------
// Version records and refs.
// ---------------------------------------------------------------------------------------------

fn version_first() -> VersionRecord {
    VersionRecord {
        image: "web01/disk0".into(),
        seq: 1,
        parent: None,
        time_ns: T0,
        logical_size: 10 << 30,
        root: Some(hid("root 1")),
        height: 2,
        segment_size: 1 << 20,
        fanout: 256,
        stats: CommitStats {
            data_bytes: 3 << 20,
            chunks: 48,
            new_chunks: 47,
            new_chunk_bytes: (3 << 20) - 65536,
            stored_bytes: 1_234_567,
        },
        message: "first ✓ «golden»\nsecond line".into(),
    }
}

/// Version records: without parent (first), without root (an all-zero image), with both;
/// unicode, empty and multi-line messages. Pins `versions/<id>`.
#[test]
fn version_records() {
    let first = version_first();
    let zero_image = VersionRecord {
        image: "vm-1.2_x+y".into(),
        seq: 2,
        parent: Some(id(0x42)),
        time_ns: T0 + 1,
        logical_size: 0,
        root: None,
        height: 1,
        segment_size: 64 * 1024,
        fanout: 2,
        stats: CommitStats::default(),
        message: String::new(),
    };
    let with_root = VersionRecord {
        seq: u64::MAX,
        parent: Some(hid("parent")),
        root: Some(hid("root 2")),
        height: 3,
        fanout: 4096,
        logical_size: u64::MAX,
        stats: CommitStats {
            data_bytes: u64::MAX,
            chunks: 1,
            new_chunks: 0,
            new_chunk_bytes: 0,
            stored_bytes: 42,
        },
        message: "m".into(),
        ..version_first()
    };
    let cases = [
        (
            "version_first",
            first,
            "versions/0d66a9401ae7402e685a2714baccd9ad32767a2da4dbd36d723c38d636a4626b",
        ),
        (
            "version_child_zero_image",
            zero_image,
            "versions/b19279ae6b1df8624a120f9b3ed46c378885f9e6c116eedb8acd6f06463ccdd7",
        ),
        (
            "version_child_with_root",
            with_root,
            "versions/129f0e5896f82a4fb2fed94578a11a8c18b15406b647ffee2d901cbee8ac56a5",
        ),
    ];
    for (name, record, key) in cases {
        let bytes = golden(name, &record.encode());
        assert_eq!(VersionRecord::decode(&bytes).unwrap(), record, "{name}");
        pin(name, keys::version(&Id::of(&bytes)), key);
    }
}

/// Head and tag refs hold the same envelope around a version id; their keys escape names.
#[test]
fn refs_and_their_keys() {
    let target = hid("version");
    let bytes = golden("ref", &refs::encode(&target));
    assert_eq!(refs::decode(&bytes).unwrap(), target);
    pin("head key", keys::head("web01/disk0"), "heads/web01%2Fdisk0");
    pin(
        "head key with +",
        keys::head("a+b/c.d_e-f"),
        "heads/a%2Bb%2Fc.d_e-f",
    );
    pin(
        "tags prefix",
        keys::tags_of("web01/disk0"),
        "tags/web01%2Fdisk0/",
    );
    pin(
        "tag key",
        keys::tag("web01/disk0", "v1+build.2"),
        "tags/web01%2Fdisk0/v1%2Bbuild.2",
    );
    pin(
        "tag key, plain",
        keys::tag("vm", "release-1_0"),
        "tags/vm/release-1_0",
    );
    pin(
        "tag from key",
        keys::tag_from_key("tags/web01%2Fdisk0/v1%2Bbuild.2"),
        "v1+build.2",
    );
}

/// How names become key segments: only `A-Z a-z 0-9 . _ -` stay, every other byte is `%XX`
/// with uppercase hex; decoding accepts lowercase too.
#[test]
fn name_escaping() {
    let printable: String = (0x20u8..0x7f).map(char::from).collect();
    pin(
        "escape of printable ASCII",
        escape(&printable),
        "%20%21%22%23%24%25%26%27%28%29%2A%2B%2C-.%2F0123456789%3A%3B%3C%3D%3E%3F%40\
         ABCDEFGHIJKLMNOPQRSTUVWXYZ%5B%5C%5D%5E_%60abcdefghijklmnopqrstuvwxyz%7B%7C%7D%7E",
    );
    assert_eq!(unescape_segment(&escape(&printable)).unwrap(), printable);
    pin("escape of UTF-8", escape("é\n"), "%C3%A9%0A");
    assert_eq!(unescape_segment("%c3%a9").unwrap(), "é");
    assert_eq!(unescape("web01%2Fdisk0").unwrap(), "web01/disk0");
}

// ---------------------------------------------------------------------------------------------
// Reference summaries.
// ---------------------------------------------------------------------------------------------

fn keys(tag: &str, n: usize) -> Vec<Id> {
    (0..n).map(|i| hid(&format!("{tag} {i}"))).collect()
}

fn probe_keys(ids: &[Id]) -> Vec<ProbeKey> {
    ids.iter().map(ProbeKey::of).collect()
}

/// Checks one filter of a golden summary against FORMAT.md directly (not through `Bloom`):
/// geometry bytes, length, and every member's probe bits (h1 + i·h2 mod 2^k, LSB first).
/// Returns the offset after the filter.
fn check_filter_as_documented(payload: &[u8], at: usize, k: u8, j: u8, members: &[Id]) -> usize {
    assert_eq!(
        (payload[at], payload[at + 1]),
        (k, j),
        "filter geometry at {at}"
    );
    let bits = &payload[at + 2..at + 2 + (1usize << (k - 3))];
    for m in members {
        let b = m.as_bytes();
        let h1 = u64::from_le_bytes(b[0..8].try_into().unwrap());
        let h2 = u64::from_le_bytes(b[8..16].try_into().unwrap()) | 1;
        for i in 0..j as u64 {
            let bit = (h1.wrapping_add(i.wrapping_mul(h2)) & ((1u64 << k) - 1)) as usize;
            assert!(
                bits[bit / 8] & (1 << (bit % 8)) != 0,
                "{m:?} probe {i} unset"
            );
        }
    }
    at + 2 + bits.len()
}

/// Summaries: the smallest filters, larger ones at other bits per chunk (with duplicate
/// inputs, which count once), and an empty tree's. Pins `summaries/<root>`.
#[test]
fn summaries() {
    let dup = |mut v: Vec<Id>| {
        v.extend(v.clone());
        v
    };
    // (name, chunks, nodes, bits per chunk, expected chunk (k, j), expected node (k, j))
    let cases = [
        (
            "summary_small",
            keys("chunk", 3),
            keys("node", 2),
            24,
            (9, 12),
            (9, 16),
        ),
        (
            "summary_sized",
            dup(keys("chunk", 100)),
            keys("node", 5),
            10,
            (10, 5),
            (11, 16),
        ),
        ("summary_empty", vec![], vec![], 64, (9, 32), (9, 16)),
    ];
    for (name, chunks, nodes, bits, cg, ng) in cases {
        let s = Summary::build(probe_keys(&chunks), probe_keys(&nodes), bits);
        let bytes = golden(name, &s.encode());
        let back = Summary::decode(&bytes).unwrap();
        assert_eq!(back, s, "{name}");
        assert_eq!(back.chunks.geometry(), cg, "{name}");
        assert_eq!(back.nodes.geometry(), ng, "{name}");
        let distinct: BTreeSet<Id> = chunks.iter().copied().collect();
        assert_eq!(back.chunk_items, distinct.len() as u64, "{name}");
        assert_eq!(back.node_items, nodes.len() as u64, "{name}");
        assert!(chunks.iter().all(|c| back.chunks.contains(c)), "{name}");
        assert!(nodes.iter().all(|n| back.nodes.contains(n)), "{name}");
        let payload = envelope::open(b"CRNSUMM\0", &bytes, "summary").unwrap();
        let at = check_filter_as_documented(payload, 16, cg.0, cg.1, &chunks);
        let end = check_filter_as_documented(payload, at, ng.0, ng.1, &nodes);
        assert_eq!(end, payload.len(), "{name}");
    }
    pin(
        "summary key",
        keys::summary(&id(0x5e)),
        "summaries/5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e",
    );
}

// ---------------------------------------------------------------------------------------------
// Deletion, sessions and GC records.
// ---------------------------------------------------------------------------------------------

/// Deletion and freed markers: (version id, time). Pins `deleted/<id>` and `gc/freed/<id>`.
#[test]
fn deleted_and_freed_markers() {
    let v = hid("deleted version");
    let bytes = golden("deleted_marker", &marker::encode_deleted(&v, T0));
    assert_eq!(marker::decode_deleted(&bytes).unwrap(), (v, T0));
    let bytes = golden("freed_marker", &marker::encode_freed(&v, T0 + 5));
    assert_eq!(marker::decode_freed(&bytes).unwrap(), (v, T0 + 5));
    pin(
        "deleted key",
        keys::deleted(&id(0xde)),
        "deleted/dededededededededededededededededededededededededededededededede",
    );
    pin(
        "freed key",
        keys::freed(&id(0xf1)),
        "gc/freed/f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1f1",
    );
    // The two markers differ only in their magic: neither decodes as the other.
    assert!(marker::decode_deleted(&bytes).is_err());
}

/// Sessions as 1.0 wrote them (no process tag) and as 1.1 writes them (with one); 1.1 reads
/// both.
#[test]
fn sessions() {
    let old = Session {
        started_ns: T0,
        heartbeat_ns: T0 + 10_000_000_000,
        pid: 4242,
        kind: "commit".into(),
        process: None,
    };
    let new = Session {
        kind: "gc".into(),
        pid: u32::MAX,
        process: Some(ProcessTag {
            boot_id: "6f1c1d8e-5a0b-4e0a-9d2e-3c1b2a0f9e8d".into(),
            pid_namespace: 4_026_531_836,
            start_ticks: 123_456_789,
            host: "node1.example".into(),
        }),
        ..old.clone()
    };
    for (name, session) in [("session_v1_0", old), ("session_v1_1", new)] {
        let bytes = golden(name, &session.encode());
        assert_eq!(Session::decode(&bytes).unwrap(), session, "{name}");
    }
    pin("sessions prefix", keys::SESSIONS, "sessions/");
}

/// GC plans (dead blobs and superseded index files; both lists empty too), the lock and the
/// completion record.
#[test]
fn gc_records() {
    let plan = GcPlan {
        created_ns: T0,
        dead_blobs: vec![id(0xd1), id(0xd2), hid("dead")],
        superseded_index: vec![hid("old index")],
    };
    let empty = GcPlan {
        created_ns: -5,
        ..GcPlan::default()
    };
    for (name, p) in [("gc_plan", plan), ("gc_plan_empty", empty)] {
        let bytes = golden(name, &p.encode());
        assert_eq!(GcPlan::decode(&bytes).unwrap(), p, "{name}");
    }
    let session_key = "sessions/00112233445566778899aabbccddeeff";
    let bytes = golden("gc_lock", &marker::encode_gc_lock(session_key));
    assert_eq!(marker::decode_gc_lock(&bytes).unwrap(), session_key);
    let plan_id = hid("plan");
    let bytes = golden("gc_last", &marker::encode_gc_last(T0 - 1, &plan_id));
    assert_eq!(marker::decode_gc_last(&bytes).unwrap(), (T0 - 1, plan_id));
    pin("plans prefix", keys::PLANS, "gc/plans/");
    pin("gc lock ref", keys::GC_LOCK, "gc/lock");
    pin("gc last ref", keys::GC_LAST, "gc/last");
}

/// Quarantine markers (1.1): time, offset in the pack, reason. Pins the key and its parse.
#[test]
fn quarantine_markers() {
    let cases = [
        (
            "quarantine",
            Quarantine {
                time_ns: T0,
                offset: 4112,
                reason: "blake3 mismatch ✗".into(),
            },
        ),
        (
            "quarantine_empty_reason",
            Quarantine {
                time_ns: 0,
                offset: u32::MAX,
                reason: String::new(),
            },
        ),
    ];
    for (name, q) in cases {
        let bytes = golden(name, &q.encode());
        assert_eq!(Quarantine::decode(&bytes).unwrap(), q, "{name}");
    }
    let key = keys::quarantine(&id(0xaa), &id(0xbb));
    pin(
        "quarantine key",
        &key,
        "quarantine/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa/\
         bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
    );
    assert_eq!(keys::parse_quarantine(&key).unwrap(), (id(0xaa), id(0xbb)));
}

/// A reason longer than a str16 holds is cut on a character boundary: 40000 × "é" (80000
/// bytes) is stored as 32767 of them (65534 bytes). Pinned by the id of the encoding rather
/// than a 64 KiB vector file.
#[test]
fn quarantine_long_reason_is_cut() {
    let q = Quarantine {
        time_ns: T0,
        offset: 16,
        reason: "é".repeat(40_000),
    };
    let bytes = q.encode();
    let back = Quarantine::decode(&bytes).unwrap();
    assert_eq!(back.reason, "é".repeat(32_767));
    pin(
        "id of the cut quarantine marker",
        Id::of(&bytes),
        "caa6f1f504964ee7ff8bfb778be52444d3d057ad93cd87491a24c4ccd89cee01",
    );
}

/// Leftover lists (1.1): dead blobs fast deletion left in packs it did not repack.
#[test]
fn gc_leftovers() {
    let cases = [
        (
            "gc_leftover",
            GcLeftover {
                created_ns: T0,
                blobs: vec![id(0x01), hid("left over")],
            },
        ),
        ("gc_leftover_empty", GcLeftover::default()),
    ];
    for (name, l) in cases {
        let bytes = golden(name, &l.encode());
        assert_eq!(GcLeftover::decode(&bytes).unwrap(), l, "{name}");
    }
    pin("leftover prefix", keys::LEFTOVERS, "gc/leftover/");
    pin(
        "merged summaries prefix",
        keys::MERGED_SUMMARIES,
        "gc/merged/",
    );
    pin("record bundles prefix", keys::RECORD_BUNDLES, "gc/records/");
    pin("quarantine prefix", keys::QUARANTINE, "quarantine/");
}

// ---------------------------------------------------------------------------------------------
// The vectors are really checked: a changed byte is noticed.
// ---------------------------------------------------------------------------------------------

/// Flips every byte of `bytes` (three ways) and requires `decodes_to_original` to be false,
/// except at the offsets in `unchecked`, where it must be true (a known blind spot).
fn every_flip_is_noticed(
    name: &str,
    bytes: &[u8],
    unchecked: &[usize],
    decodes_to_original: impl Fn(&[u8]) -> bool,
) {
    assert!(
        decodes_to_original(bytes),
        "{name}: golden bytes do not decode"
    );
    for i in 0..bytes.len() {
        for mask in [0x01u8, 0x80, 0xff] {
            let mut bad = bytes.to_vec();
            bad[i] ^= mask;
            let same = decodes_to_original(&bad);
            if unchecked.contains(&i) {
                assert!(same, "{name}: byte {i} is no longer ignored");
            } else {
                assert!(
                    !same,
                    "{name}: flip 0x{mask:02x} at byte {i} went unnoticed"
                );
            }
        }
    }
}

/// Enveloped structures (config, version record, index file) refuse every flip (checksum); a
/// leaf has no checksum of its own (its id is its BLAKE3), so a flip must fail to decode or
/// decode to another leaf, except the reserved byte 3, which v1 readers ignore.
#[test]
fn flipped_bytes_of_golden_vectors_are_noticed() {
    let cfg = config_fixed_none();
    every_flip_is_noticed(
        "config_fixed_none",
        &read_or_bless("config_fixed_none"),
        &[],
        |b| RepoConfig::decode(b).is_ok_and(|c| c == cfg),
    );
    let v = version_first();
    every_flip_is_noticed("version_first", &read_or_bless("version_first"), &[], |b| {
        VersionRecord::decode(b).is_ok_and(|r| r == v)
    });
    let f = index_three_packs();
    every_flip_is_noticed(
        "index_three_packs",
        &read_or_bless("index_three_packs"),
        &[],
        |b| IndexFile::decode(b).is_ok_and(|x| x == f),
    );
    let leaf = leaf_mixed();
    every_flip_is_noticed("leaf_mixed", &read_or_bless("leaf_mixed"), &[3], |b| {
        Leaf::decode(b).is_ok_and(|l| l == leaf)
    });
}

/// The golden bytes (or, in bless mode, what the encoder writes, as the file may be in flux).
fn read_or_bless(name: &str) -> Vec<u8> {
    if !blessing() {
        return read_vector(name);
    }
    match name {
        "config_fixed_none" => config_fixed_none().encode(),
        "version_first" => version_first().encode(),
        "index_three_packs" => index_three_packs().encode(),
        "leaf_mixed" => leaf_mixed().encode(),
        _ => unreachable!("{name}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Format v2: encryption (cairn_format::crypto). Fixed master key, nonces and salt, so that the
// bytes are reproducible: XChaCha20-Poly1305, keyed BLAKE3 and Argon2id are deterministic.
// The vectors and pinned ids were computed with independent implementations (Python's
// blake3, PyNaCl's crypto_aead_xchacha20poly1305_ietf_encrypt and argon2-cffi's
// hash_secret_raw), not blessed from this code, and this code reproduces them.
// ---------------------------------------------------------------------------------------------

fn v2_master() -> MasterKey {
    let mut bytes = [0u8; 64];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = i as u8;
    }
    MasterKey::from_bytes(bytes)
}

/// Argon2id at its smallest, so the vector is cheap to check; the format is the same.
const V2_KDF: KdfParams = KdfParams {
    memory_kib: 64,
    passes: 1,
    lanes: 1,
};

#[test]
fn v2_keyed_ids() {
    let key = v2_master();
    pin(
        "keyed id of \"chunk\"",
        key.id_of(b"chunk"),
        "bd89fd5bac00d03d0cda9114d3f775c3ae6628fc6f3e95be18cf7ec1feac4b62",
    );
    pin(
        "plain id of \"chunk\"",
        Id::of(b"chunk"),
        "6b1d440ada61d0f4e4416c73bcbab3694f96875a3e5df3253075163ffe93cd4d",
    );
}

#[test]
fn v2_sealed_objects() {
    let key = v2_master();
    let node = key.seal_with_nonce(Domain::Node, &[7; 24], b"a manifest node");
    let bytes = golden("v2_sealed_node", &node);
    assert_eq!(
        key.open(Domain::Node, "node", &bytes).unwrap(),
        b"a manifest node"
    );
    assert!(key.open(Domain::Group, "group", &bytes).is_err());
    let empty = key.seal_with_nonce(Domain::Marker, &[0; 24], b"");
    let bytes = golden("v2_sealed_empty", &empty);
    assert_eq!(bytes.len(), 24 + 16);
    assert_eq!(key.open(Domain::Marker, "marker", &bytes).unwrap(), b"");
}

#[test]
fn v2_key_slot() {
    let key = v2_master();
    let slot = KeySlot::create_with(&key, b"correct horse", V2_KDF, [9; 16], [3; 24]).unwrap();
    let bytes = golden("v2_key_slot", &slot.encode());
    assert_eq!(bytes.len(), 4 + 1 + 1 + 4 + 4 + 1 + 16 + 24 + 64 + 16);
    let decoded = KeySlot::decode(&bytes).unwrap();
    assert_eq!(decoded, slot);
    let opened = decoded.open(b"correct horse").unwrap();
    assert_eq!(opened.id_of(b"chunk"), key.id_of(b"chunk"));
    assert!(decoded.open(b"Correct horse").is_err());
}

/// A group of two incompressible chunks (concatenated BLAKE3 outputs), stored raw and sealed:
/// the group bytes are XChaCha20-Poly1305 of the plain chunks, domain 1 ("group").
#[test]
fn v2_group_sealed_raw() {
    let key = v2_master();
    let data: Vec<u8> = (0u8..64).flat_map(|i| Id::of(&[i]).0).collect();
    let (a, b) = data.split_at(1024);
    let mut builder = GroupBuilder::new(64 << 10);
    builder.push(key.id_of(a), a);
    builder.push(key.id_of(b), b);
    let group = builder.finish_with_nonce(Compression::Zstd { level: 3 }, &key, &[4; 24]);
    assert_eq!(group.desc.encoding, BlobEncoding::Raw);
    let bytes = golden("v2_group_sealed_raw", &group.stored);
    let plain = open_group(&group.desc, &bytes, Some(&key)).unwrap();
    assert_eq!(chunk(&group.desc, &plain, 1, |d| key.id_of(d)).unwrap(), b);
    assert!(
        chunk(&group.desc, &plain, 1, Id::of).is_err(),
        "keyed ids, not plain ones"
    );
}

/// The groups of the plain pack vectors: a data group of two incompressible 1 KiB chunks and
/// a node group (both raw), and for pack version 3 a data group of chunks of 100, 200 and 50
/// bytes (a frame that lists its slots).
fn golden_pack_groups(version: u32) -> Vec<(BlobKind, cairn_format::group::Group)> {
    let data: Vec<u8> = (0u8..64).flat_map(|i| Id::of(&[i]).0).collect();
    let group_of = |parts: &[&[u8]]| {
        let mut g = GroupBuilder::new(64 << 10);
        for p in parts {
            g.push(Id::of(p), p);
        }
        g.finish(Compression::Zstd { level: 3 }, None)
    };
    let (a, b) = data.split_at(1024);
    let mut groups = vec![
        (BlobKind::Data, group_of(&[a, b])),
        (BlobKind::Node, group_of(&[b"a manifest node"])),
    ];
    if version >= 3 {
        let listed = group_of(&[&data[..100], &data[100..300], &data[300..350]]);
        groups.push((BlobKind::Data, listed));
    }
    groups
}

/// A plain pack of version 2 (written until 2026-12-02, read still: no group frames), salt
/// 0x01020304. Built from FORMAT.md alone by tests/independent_v2.py.
#[test]
fn v2_pack_plain() {
    let bytes = read_vector("v2_pack_plain");
    let parsed = pack_v2::parse_pack(&bytes, None).unwrap();
    let want = golden_pack_groups(2);
    let got: Vec<_> = parsed.iter().map(|g| (g.kind, &g.desc)).collect();
    let want: Vec<_> = want.iter().map(|(k, g)| (*k, &g.desc)).collect();
    assert_eq!(got, want);
    assert_eq!(parsed[0].desc.encoding, BlobEncoding::Raw);
    assert_eq!(parsed[0].offset, 20, "no frame before the group");
    assert!(pack_v2::salvage_pack(&bytes, None, Id::of).is_err());
    assert!(matches!(
        pack::parse_pack(&bytes),
        Err(FormatError::TooNew { found: 2, .. })
    ));
}

/// A plain pack of version 3: every group behind its frame (a uniform one for the first two
/// groups, a listed one for the third), salt 0x01020304. Built from FORMAT.md alone by
/// tests/independent_v2.py and reproduced by this code; its groups come back from the frames
/// alone once the trailer is cut off.
#[test]
fn v2_pack_3_plain() {
    let groups = golden_pack_groups(3);
    let mut w = PackWriter::with_salt(None, 0x0102_0304);
    for (kind, group) in groups.clone() {
        w.push(kind, group);
    }
    let (id, encoded, written) = w.finish();
    let bytes = golden("v2_pack_3_plain", &encoded);
    pin("v2 pack id", id, &Id::of(&bytes).to_string());
    let parsed = pack_v2::parse_pack(&bytes, None).unwrap();
    assert_eq!(parsed, written);
    pack_v2::check_frames(&bytes, &parsed, None).unwrap();
    let data_end = parsed.last().unwrap().range().end as usize;
    let salvaged = pack_v2::salvage_pack(&bytes[..data_end], None, Id::of).unwrap();
    let got: Vec<_> = salvaged
        .groups
        .iter()
        .map(|g| (g.kind, &g.group.desc, &g.group.stored))
        .collect();
    let want: Vec<_> = groups
        .iter()
        .map(|(k, g)| (*k, &g.desc, &g.stored))
        .collect();
    assert_eq!(got, want);
    assert!(matches!(
        pack::parse_pack(&bytes),
        Err(FormatError::TooNew { found: 3, .. })
    ));
}

/// A v2 leaf: zero runs and group runs (two runs of one group that do not follow each other
/// stay two extents). Built in Python with struct and blake3, not blessed from this code.
#[test]
fn v2_leaf_runs() {
    let (g1, g2) = (Id::of(b"g1"), Id::of(b"g2"));
    let run = |group, first, count, len| RunExtent::Run {
        group,
        first,
        count,
        len,
    };
    let mut leaf = RunLeaf::default();
    leaf.push(RunExtent::Zero { len: 8192 });
    leaf.push(run(g1, 0, 2, 8192));
    leaf.push(run(g1, 2, 1, 4096)); // follows on: one extent of 3 slots
    leaf.push(run(g2, 5, 1, 4096));
    leaf.push(run(g1, 4, 2, 5000));
    leaf.push(RunExtent::Zero { len: 4096 });
    let bytes = golden("v2_leaf_runs", &leaf.encode());
    let decoded = RunLeaf::decode(&bytes).unwrap();
    assert_eq!(decoded, leaf);
    assert_eq!(decoded.extents()[1], run(g1, 0, 3, 12288));
    let runs: Vec<_> = decoded.group_runs().collect();
    assert_eq!(runs, [(g1, 0, 3), (g2, 5, 1), (g1, 4, 2)]);
    assert_eq!(decoded.len(), 8192 + 12288 + 4096 + 5000 + 4096);
    assert!(matches!(
        node::Leaf::decode(&bytes),
        Err(FormatError::TooNew { found: 2, .. })
    ));
}

/// Group ids of a two-chunk list, plain (BLAKE3 key derivation mode) and in the repository of
/// `v2_master` (keyed BLAKE3 under a key derived from the id key). Computed with Python's
/// blake3.
#[test]
fn v2_group_ids() {
    let chunks = [
        GroupChunk::new(Id::of(b"a"), 4096),
        GroupChunk::new(Id::of(b"b"), 100),
    ];
    pin(
        "plain group id",
        group_id(&chunks, None),
        "feaf0bd968aac80c1eaec2ce0e853bce5f64cdb1ddb5016c3df7e164a2fe8a44",
    );
    pin(
        "keyed group id",
        group_id(&chunks, Some(&v2_master())),
        "91e2a9f2c799f3c89983dfac5516786d2889146febcd1a27176af604247de809",
    );
}

/// A plain index run: five ids in two packs, one of them in both, in sections of two entries.
/// A leaf carrying its segment's digest (flags bit 0), built in Python from FORMAT.md.
#[test]
fn v2_leaf_digest() {
    let mut leaf = RunLeaf::default();
    leaf.push(RunExtent::Run {
        group: Id::of(b"g1"),
        first: 0,
        count: 2,
        len: 8192,
    });
    leaf.push(RunExtent::Zero { len: 4096 });
    leaf.set_digest(Id::of(b"segment bytes"));
    let bytes = golden("v2_leaf_digest", &leaf.encode());
    let decoded = RunLeaf::decode(&bytes).unwrap();
    assert_eq!(decoded, leaf);
    assert_eq!(decoded.digest(), Some(Id::of(b"segment bytes")));
}

/// A level-1 node of format 2 carrying two of its three leaves' digests, built in Python from
/// FORMAT.md.
#[test]
fn v2_interior_digests() {
    let digest = |name: &str, chunks, data_bytes| {
        Some(LeafDigest {
            digest: Id::of(name.as_bytes()),
            chunks,
            data_bytes,
        })
    };
    let node = Interior {
        level: 1,
        children: vec![
            (0, Id::of(b"leaf 0")),
            (3, Id::of(b"leaf 3")),
            (255, Id::of(b"leaf 255")),
        ],
        leaf_digests: vec![
            digest("segment 0", 256, 1 << 20),
            None,
            digest("segment 255", 3, 5000),
        ],
    };
    let bytes = golden("v2_interior_digests", &node.encode());
    assert_eq!(Interior::decode(&bytes).unwrap(), node);
}

/// Every location of the golden runs is found in its section, with exactly its packs.
fn check_golden_run(bytes: &[u8], locations: &[(Id, Id)], version: u32) {
    let run = index_run::parse_run(bytes, None).unwrap();
    assert_eq!((run.version(), run.entries()), (version, 6));
    for (id, _) in locations {
        assert!(run.section_for(id).is_some(), "a member passes the filter");
        let mut packs = run.lookup(bytes, id, None).unwrap();
        packs.sort();
        let mut want: Vec<Id> = locations
            .iter()
            .filter(|(x, _)| x == id)
            .map(|(_, p)| *p)
            .collect();
        want.sort();
        assert_eq!(packs, want);
    }
}

fn golden_run_locations() -> Vec<(Id, Id)> {
    let (pa, pb) = (Id::of(b"pack a"), Id::of(b"pack b"));
    let mut locations: Vec<(Id, Id)> = (0u8..5)
        .map(|i| (Id::of(&[i]), if i % 2 == 0 { pa } else { pb }))
        .collect();
    locations.push((Id::of(&[0]), pb));
    locations
}

/// Version 1 (written until 2026-11-26, read still): its filter hashes the full ids. Built
/// from FORMAT.md alone by tests/independent_v2.py (Bloom filter bits included).
#[test]
fn v2_index_run() {
    let bytes = read_vector("v2_index_run");
    check_golden_run(&bytes, &golden_run_locations(), 1);
}

/// Version 2 (written until 2026-11-27, read still): the filter hashes the 8-byte keys, the
/// meta holds every section reference and the pack table. Built from FORMAT.md alone by
/// tests/independent_v2.py (Bloom filter bits included).
#[test]
fn v2_index_run_2() {
    let bytes = read_vector("v2_index_run_2");
    check_golden_run(&bytes, &golden_run_locations(), 2);
}

/// Version 3: a top level of fence keys and checksums, every piece read on demand (here 2
/// sections a directory block, 1 pack a pack block). Built from FORMAT.md alone by
/// tests/independent_v2.py (Bloom filter bits included).
#[test]
fn v2_index_run_3() {
    let locations = golden_run_locations();
    let geometry = index_run::Geometry {
        section_entries: 2,
        block_sections: 2,
        packs_per_block: 1,
    };
    let bytes = golden(
        "v2_index_run_3",
        &index_run::write_run_with(&locations, None, geometry),
    );
    check_golden_run(&bytes, &locations, 3);
    let run = index_run::parse_run(&bytes, None).unwrap();
    assert_eq!((run.meta.blocks.len(), run.meta.pack_blocks.len()), (2, 2));
}

/// The summary of `v2_group_summary`: two nodes, two groups (one with slots in two words),
/// and a stale count.
fn uncounted_summary() -> GroupSummary {
    let mut stale = GroupSummary::default();
    stale.stale_slots = 3;
    let mut s = SummaryBuilder::from(stale);
    s.add_node(&Id::of(b"n1"));
    s.add_node(&Id::of(b"n2"));
    s.add_run(&Id::of(b"g1"), 0, 3);
    s.add_run(&Id::of(b"g1"), 64, 1);
    s.add_run(&Id::of(b"g2"), 5, 2);
    s.finish().unwrap()
}

/// The summary of `v2_group_summary_counted`.
fn counted_summary() -> GroupSummary {
    let mut s = SummaryBuilder::counted();
    s.add_node(&Id::of(b"n1"));
    let (g1, g2) = (Id::of(b"g1"), Id::of(b"g2"));
    for (group, first, count) in [(g1, 0, 3), (g1, 0, 3), (g1, 1, 1), (g1, 64, 1), (g2, 5, 1)] {
        s.add_run(&group, first, count);
    }
    s.finish().unwrap()
}

/// A format 2 reference summary; every flip is refused (envelope checksum).
#[test]
fn v2_group_summary() {
    let s = uncounted_summary();
    let bytes = golden("v2_group_summary", &s.encode());
    assert_eq!(GroupSummary::decode(&bytes).unwrap(), s);
    // envelope 16 | stale 8 | 2 nodes: 4 + 16 | 2 groups: 4 + (8 + 2 + 9) + (8 + 2 + 1) | 32
    assert_eq!(bytes.len(), 16 + 8 + 20 + 4 + 19 + 11 + 32);
    every_flip_is_noticed("v2_group_summary", &bytes, &[], |b| {
        GroupSummary::decode(b).is_ok_and(|x| x == s)
    });
}

/// A counted reference summary (envelope version 2): one node; group g1's leaves reference
/// slots 0..3 twice, slot 1 a third time and slot 64 once; g2's slot 5 once. Every flip is
/// refused (envelope checksum).
#[test]
fn v2_group_summary_counted() {
    let s = counted_summary();
    let bytes = golden("v2_group_summary_counted", &s.encode());
    assert_eq!(GroupSummary::decode(&bytes).unwrap(), s);
    assert!(s.is_counted() && s.repeats().unwrap().len() == 3);
    // envelope 16 | stale 8 | 1 node: 4 + 8 | 2 groups: 4 + (8 + 2 + 9) + (8 + 2 + 1)
    // | 3 repeats: 4 + 3 × (8 + 2 + 4) | 32
    assert_eq!(bytes.len(), 16 + 8 + 12 + 4 + 19 + 11 + 4 + 42 + 32);
    every_flip_is_noticed("v2_group_summary_counted", &bytes, &[], |b| {
        GroupSummary::decode(b).is_ok_and(|x| x == s)
    });
}

/// A merged summary of image "vm" counting the trees of the two summaries above: n1 and g1's
/// slots by both (common 2), g2's slot 6 by one and slot 5 by both (a tie: common 1, one
/// exception). Every flip is refused (envelope checksum).
///
/// The vector is envelope version 1 (no chains), as builds before summary deltas wrote it:
/// it still decodes to the same merge, which is now written as version 2.
#[test]
fn v2_merged_summary() {
    let mut m = MergedSummary::new("vm");
    assert!(m.add_tree(&Id::of(b"r1"), &counted_summary(), &[]));
    assert!(m.add_tree(&Id::of(b"r2"), &uncounted_summary(), &[]));
    let bytes = read_vector("v2_merged_summary");
    assert_eq!(MergedSummary::decode(&bytes).unwrap(), m);
    // envelope 16 | image 4 | 2 trees: 4 + 2 × 64 | 2 nodes: 4 + 2 × 12
    // | 2 groups: 4 + (8 + 2 + 9 + 4 + 2) + (8 + 2 + 1 + 4 + 2 + 6) | 32
    assert_eq!(bytes.len(), 16 + 4 + 132 + 28 + 4 + 25 + 23 + 32);
    every_flip_is_noticed("v2_merged_summary", &bytes, &[], |b| {
        MergedSummary::decode(b).is_ok_and(|x| x == m)
    });
    m.remove_tree(&Id::of(b"r2"), &uncounted_summary()).unwrap();
    let mut alone = MergedSummary::new("vm");
    alone.add_tree(&Id::of(b"r1"), &counted_summary(), &[]);
    assert_eq!(m, alone);
}

/// The merge above, written now (envelope version 2), with r1's summary resolved through the
/// summaries of c0 and c4 (a delta at position 6): the chains follow the trees.
#[test]
fn v2_merged_summary_chains() {
    let chain = [Id::of(b"c0"), Id::of(b"c4")];
    let mut m = MergedSummary::new("vm");
    assert!(m.add_tree(&Id::of(b"r1"), &counted_summary(), &chain));
    assert!(m.add_tree(&Id::of(b"r2"), &uncounted_summary(), &[]));
    let bytes = golden("v2_merged_summary_chains", &m.encode());
    assert_eq!(MergedSummary::decode(&bytes).unwrap(), m);
    // version 1's bytes | a chain length per tree (1) | r1's chain: 2 keys (16)
    assert_eq!(bytes.len(), 16 + 4 + 132 + 2 + 16 + 28 + 4 + 25 + 23 + 32);
    let keys: Vec<u64> = chain.iter().map(key_of).collect();
    assert_eq!(m.chain_keys().collect::<Vec<_>>(), keys);
    every_flip_is_noticed("v2_merged_summary_chains", &bytes, &[], |b| {
        MergedSummary::decode(b).is_ok_and(|x| x == m)
    });
    m.remove_tree(&Id::of(b"r1"), &counted_summary()).unwrap();
    assert_eq!(m.chain_keys().count(), 0);
}

/// A summary stored as a delta: position 6 of a chain (base at position 4; the chain names
/// c0 and c4), from `counted_summary` to a tree with node n3 added, g1's slot 2 dropped and
/// slot 0 referenced twice, g2 gone and g3's slot 7 new. Every flip is refused (checksum).
#[test]
fn v2_summary_delta() {
    let base = counted_summary();
    let mut new = SummaryBuilder::counted();
    new.add_node(&Id::of(b"n1"));
    new.add_node(&Id::of(b"n3"));
    let (g1, g3) = (Id::of(b"g1"), Id::of(b"g3"));
    for (group, first, count) in [(g1, 0, 2), (g1, 0, 1), (g1, 64, 1), (g3, 7, 1)] {
        new.add_run(&group, first, count);
    }
    let new = new.finish().unwrap();
    let at_5 = Resolved {
        summary: base.clone(),
        position: 5,
        chain: vec![Id::of(b"c0"), Id::of(b"c4"), Id::of(b"c5")],
        since: Before::default(),
    };
    let bytes = golden("v2_summary_delta", &at_5.next_delta(&new).unwrap());
    let delta = SummaryDelta::decode(&bytes).unwrap();
    assert_eq!((delta.position, delta.chain.len()), (6, 2));
    // envelope 16 | position 4 | chain 64 | removed 4 | added 4 + 8 | 3 changes: 4
    // + g1 (8 + 1 + 2 + 9 + 2 + 6) + g2 (8 + 1) + g3 (8 + 1 + 2 + 1 + 2) | 32
    assert_eq!(bytes.len(), 16 + 4 + 64 + 4 + 12 + 4 + 28 + 9 + 14 + 32);
    let mut resolved = base;
    resolved.apply(&delta, None).unwrap();
    assert_eq!(resolved, new);
    every_flip_is_noticed("v2_summary_delta", &bytes, &[], |b| {
        SummaryDelta::decode(b).is_ok_and(|x| x == delta)
    });
}

/// A version record bundle of two records, in ascending order of their ids (recomputed, not
/// stored). Every flip is refused (envelope checksum).
#[test]
fn v2_record_bundle() {
    let mut b = RecordBundle::default();
    b.insert(b"another version record".to_vec());
    b.insert(b"a version record".to_vec());
    let bytes = golden("v2_record_bundle", &b.encode());
    assert_eq!(RecordBundle::decode(&bytes).unwrap(), b);
    // envelope 16 | count 4 | 4 + 16 | 4 + 22 | 32
    assert_eq!(bytes.len(), 16 + 4 + 20 + 26 + 32);
    every_flip_is_noticed("v2_record_bundle", &bytes, &[], |x| {
        RecordBundle::decode(x).is_ok_and(|y| y == b)
    });
}

/// A VM version record: web01@2 binding two disks (disk0@5 with checkpoint cairn-cp-1, data@1
/// with none), a QEMU command line, no memory state, frozen for 12 ms. Every flip is refused.
#[test]
fn vm_version() {
    use cairn_format::vm::{ConfigKind, Freeze, VmDisk, VmVersion};
    let v = VmVersion {
        vm: "web01".into(),
        seq: 2,
        parent: Some(Id::of(b"p")),
        time_ns: 1_764_000_000_000_000_000,
        config_kind: ConfigKind::QemuArgs,
        config: "qemu-system-x86_64\n-machine\nq35".into(),
        disks: vec![
            VmDisk {
                name: "disk0".into(),
                version: Id::of(b"d0"),
                seq: 5,
                node: "drive0".into(),
                checkpoint: "cairn-cp-1".into(),
            },
            VmDisk {
                name: "data".into(),
                version: Id::of(b"d1"),
                seq: 1,
                node: "#block123".into(),
                checkpoint: String::new(),
            },
        ],
        memory: None,
        freeze: Freeze::Frozen,
        freeze_ns: 12_000_000,
        message: "nightly".into(),
    };
    let bytes = golden("vm_version", &v.encode());
    assert_eq!(VmVersion::decode(&bytes).unwrap(), v);
    // envelope 16 | name 2 + 5 | seq 8 | parent 32 | time 8 | kind 1 | config 4 + 31 | n 2
    // | disk0 2 + 5 + 32 + 8 + 2 + 6 + 2 + 10 | data 2 + 4 + 32 + 8 + 2 + 9 + 2 + 0
    // | memory 32 | freeze 1 + 8 | message 4 + 7 | 32
    assert_eq!(
        bytes.len(),
        16 + 7 + 8 + 32 + 8 + 1 + 35 + 2 + 67 + 59 + 32 + 9 + 11 + 32
    );
    every_flip_is_noticed("vm_version", &bytes, &[], |b| {
        VmVersion::decode(b).is_ok_and(|x| x == v)
    });
}

/// A memory state header: page size 4096, footers, a 21-byte prefix (QEVM, version 3, the
/// configuration "pc-q35-7.2"), RAM section 2/0/4, blocks pc.ram (128 MiB at 2 MiB) and
/// pc.bios (256 KiB at 130 MiB), a tail of 12345 bytes at 132 MiB. Every flip is refused.
#[test]
fn memory_state_header() {
    use cairn_format::memstate::MemoryLayout;
    let mut prefix = b"QEVM\0\0\0\x03\x07\0\0\0\x0a".to_vec();
    prefix.extend_from_slice(b"pc-q35-7.2");
    let mut l = MemoryLayout::plan(
        4096,
        prefix,
        (2, 0, 4),
        &[("pc.ram".into(), 128 << 20), ("pc.bios".into(), 256 << 10)],
    );
    l.footers = true;
    l.tail_len = 12345;
    let bytes = golden("memory_state_header", &l.encode());
    assert_eq!(MemoryLayout::decode(&bytes).unwrap(), l);
    // envelope 16 | page 4 | footers 1 | prefix 4 + 23 | section 12 | n 2
    // | pc.ram 1 + 6 + 16 | pc.bios 1 + 7 + 16 | tail 16 | 32
    assert_eq!(bytes.len(), 16 + 5 + 27 + 12 + 2 + 23 + 24 + 16 + 32);
    every_flip_is_noticed("memory_state_header", &bytes, &[], |b| {
        MemoryLayout::decode(b).is_ok_and(|x| x == l)
    });
}

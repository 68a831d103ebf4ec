//! Any bytes given to any decoder of cairn-format — everything cairn reads back from a
//! repository (a store it does not control) — get an error or a value: never a panic, a hang
//! or an allocation the input's length does not justify. The first byte chooses the decoder
//! (see `DECODERS`), the rest is its input; scripts/fuzz.sh seeds every decoder with every
//! golden vector (crates/cairn-format/tests/golden), so each starts from valid structures.
//! Checksums would stop the fuzzer at the door, so before decoding it recomputes them: the
//! BLAKE3 that ends every envelope, and the trailer checksum in a v2 pack's footer (sealed
//! objects stay sealed: authentication is the only check they get before parsing).
//! What a decoded value must then satisfy is checked by the stable fuzzer
//! (tests/fuzz_decoders.rs), which knows each structure's invariants.
#![no_main]

use cairn_format::config::RepoConfig;
use cairn_format::crypto::{Domain, KeySlot, MasterKey};
use cairn_format::group::{chunk, open_group, GroupChunk, GroupDesc};
use cairn_format::index::IndexFile;
use cairn_format::index_run;
use cairn_format::group_summary::{Before, GroupSummary, SummaryDelta};
use cairn_format::merged_summary::MergedSummary;
use cairn_format::record_bundle::RecordBundle;
use cairn_format::leaf_v2::RunLeaf;
use cairn_format::marker::{self, GcLeftover, GcPlan, Quarantine, Session};
use cairn_format::node::{Interior, Leaf};
use cairn_format::pack::{self, BlobEncoding, BlobEntry, BlobKind};
use cairn_format::summary::Summary;
use cairn_format::version::VersionRecord;
use cairn_format::memstate::MemoryLayout;
use cairn_format::vm::VmVersion;
use cairn_format::{envelope, pack_v2, refs, Id};
use libfuzzer_sys::fuzz_target;

/// The key of the sealed decoders: the golden vectors' master key (bytes 0..64), so that the
/// sealed golden vectors open and the fuzzer starts past authentication.
fn key() -> MasterKey {
    let mut bytes = [0u8; 64];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = i as u8;
    }
    MasterKey::from_bytes(bytes)
}

type Decoder = fn(&[u8]);

/// Which checksum to recompute before decoding.
#[derive(Clone, Copy)]
enum Fix {
    None,
    /// magic | length | payload | BLAKE3 of everything before it (32).
    Envelope,
    /// v2 pack footer: G (u32) | L (u32) | BLAKE3 of the L bytes before the footer | end magic.
    PackFooter,
    /// index run footer: L (u32) | entries (u64) | BLAKE3 of the L meta bytes | end magic.
    RunFooter,
}

fn fixed(fix: Fix, data: &[u8]) -> Vec<u8> {
    let mut v = data.to_vec();
    match fix {
        Fix::None => {}
        Fix::Envelope if v.len() >= 32 => {
            let n = v.len() - 32;
            let sum = blake3::hash(&v[..n]);
            v[n..].copy_from_slice(sum.as_bytes());
        }
        Fix::PackFooter if v.len() >= 48 => {
            let footer = v.len() - 48;
            let len = u32::from_le_bytes(v[footer + 4..footer + 8].try_into().unwrap()) as usize;
            if let Some(start) = footer.checked_sub(len) {
                let sum = blake3::hash(&v[start..footer]);
                v[footer + 8..footer + 40].copy_from_slice(sum.as_bytes());
            }
        }
        Fix::RunFooter if v.len() >= 52 => {
            let footer = v.len() - 52;
            let len = u32::from_le_bytes(v[footer..footer + 4].try_into().unwrap()) as usize;
            if let Some(start) = footer.checked_sub(len) {
                let sum = blake3::hash(&v[start..footer]);
                v[footer + 12..footer + 44].copy_from_slice(sum.as_bytes());
            }
        }
        Fix::Envelope | Fix::PackFooter | Fix::RunFooter => {}
    }
    v
}

/// Every decoder, in a fixed order: scripts/fuzz.sh writes one seed per (decoder, vector).
const DECODERS: &[(&str, Fix, Decoder)] = &[
    ("envelope", Fix::Envelope, |d| {
        drop(envelope::open(b"CRNTEST\0", d, "test"))
    }),
    ("config", Fix::Envelope, |d| drop(RepoConfig::decode(d))),
    ("index", Fix::Envelope, |d| drop(IndexFile::decode(d))),
    ("version", Fix::Envelope, |d| drop(VersionRecord::decode(d))),
    ("ref", Fix::Envelope, |d| drop(refs::decode(d))),
    ("pack", Fix::None, |d| drop(pack::parse_pack(d))),
    ("blob", Fix::None, |d| {
        // A zstd blob as a pack's entry would describe it (its id is then checked).
        let entry = BlobEntry {
            id: Id::of(b"blob"),
            kind: BlobKind::Data,
            encoding: BlobEncoding::Zstd,
            offset: 0,
            stored_len: d.len() as u32,
            raw_len: 1 << 16,
        };
        drop(pack::decode_blob(&entry, d));
    }),
    ("leaf", Fix::None, |d| drop(Leaf::decode(d))),
    ("interior", Fix::None, |d| drop(Interior::decode(d))),
    ("summary", Fix::Envelope, |d| drop(Summary::decode(d))),
    ("deleted", Fix::Envelope, |d| {
        drop(marker::decode_deleted(d))
    }),
    ("freed", Fix::Envelope, |d| drop(marker::decode_freed(d))),
    ("plan", Fix::Envelope, |d| drop(GcPlan::decode(d))),
    ("leftover", Fix::Envelope, |d| drop(GcLeftover::decode(d))),
    ("quarantine", Fix::Envelope, |d| drop(Quarantine::decode(d))),
    ("session", Fix::Envelope, |d| drop(Session::decode(d))),
    ("gc_lock", Fix::Envelope, |d| {
        drop(marker::decode_gc_lock(d))
    }),
    ("gc_last", Fix::Envelope, |d| {
        drop(marker::decode_gc_last(d))
    }),
    ("key_slot", Fix::None, |d| drop(KeySlot::decode(d))),
    ("sealed", Fix::None, |d| {
        drop(key().open(Domain::Node, "node", d))
    }),
    ("pack_v2", Fix::PackFooter, |d| {
        drop(pack_v2::parse_pack(d, None))
    }),
    ("pack_v2_sealed", Fix::None, |d| {
        drop(pack_v2::parse_pack(d, Some(&key())))
    }),
    ("leaf_v2", Fix::None, |d| drop(RunLeaf::decode(d))),
    ("group_summary", Fix::Envelope, |d| {
        drop(GroupSummary::decode(d))
    }),
    ("merged_summary", Fix::Envelope, |d| {
        if let Ok(mut m) = MergedSummary::decode(d) {
            // Keeping a decoded merge up must not panic either.
            let mut union = GroupSummary::default();
            m.union_into(&mut union);
            let roots: Vec<Id> = m.trees().copied().collect();
            for root in roots {
                let _ = m.remove_tree(&root, &union);
            }
            let _ = m.add_tree(&Id::of(b"x"), &union, &[Id::of(b"c")]);
        }
    }),
    ("summary_delta", Fix::Envelope, |d| {
        if let Ok(delta) = SummaryDelta::decode(d) {
            // Applying a decoded delta to a summary it does not fit must not panic either.
            let mut s = GroupSummary::counted();
            let _ = s.apply(&delta, Some(&mut Before::default()));
        }
    }),
    ("record_bundle", Fix::Envelope, |d| {
        drop(RecordBundle::decode(d))
    }),
    ("index_run", Fix::RunFooter, |d| {
        if let Ok(run) = index_run::parse_run(d, None) {
            let _ = run.all_entries(d, None);
            let _ = run.lookup(d, &Id::of(b"x"), None);
        }
    }),
    ("group", Fix::None, |d| {
        // A group as its pack trailer would describe it: two chunks over the whole input,
        // or (odd lengths) a slot GC dropped between them.
        let half = (d.len() / 2) as u32;
        let dropped = GroupChunk {
            stored: false,
            ..GroupChunk::new(Id::of(b"gone"), 4096)
        };
        let desc = GroupDesc {
            encoding: if d.first().is_some_and(|b| b & 1 == 1) {
                BlobEncoding::Zstd
            } else {
                BlobEncoding::Raw
            },
            sealed: false,
            stored_len: d.len() as u32,
            plain_len: half * 2,
            chunks: if d.len() % 2 == 1 {
                vec![
                    GroupChunk::new(Id::of(b"a"), half),
                    dropped,
                    GroupChunk::new(Id::of(b"b"), half),
                ]
            } else {
                vec![
                    GroupChunk::new(Id::of(b"a"), half),
                    GroupChunk::new(Id::of(b"b"), half),
                ]
            },
        };
        if let Ok(plain) = open_group(&desc, d, None) {
            for slot in 0..4 {
                drop(chunk(&desc, &plain, slot, Id::of));
            }
        }
    }),
    ("pack_salvage", Fix::None, |d| {
        // A pack's groups recovered from their frames, as `repair` does when the trailer
        // is lost: every byte of the pack is untrusted.
        drop(pack_v2::salvage_pack(d, None, Id::of))
    }),
    ("vm_version", Fix::Envelope, |d| drop(VmVersion::decode(d))),
    ("memory_state_header", Fix::Envelope, |d| {
        drop(MemoryLayout::decode(d))
    }),
];

fuzz_target!(|data: &[u8]| {
    if let Some((&which, rest)) = data.split_first() {
        let (_, fix, decode) = DECODERS[usize::from(which) % DECODERS.len()];
        decode(&fixed(fix, rest));
    }
});

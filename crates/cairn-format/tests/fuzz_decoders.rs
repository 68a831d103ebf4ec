//! Property-based fuzzing of every decoder of untrusted bytes: arbitrary input never panics,
//! and any single-bit flip or truncation of a valid checksummed or authenticated structure
//! (format v2's sealed objects included) is rejected.

use cairn_format::config::{Chunker, Compression, RepoConfig};
use cairn_format::crypto::{Domain, KdfParams, KeySlot, MasterKey};
use cairn_format::group::{chunk, open_group, GroupBuilder, GroupChunk, GroupDesc};
use cairn_format::group_summary::{Before, GroupSummary, Resolved, SummaryBuilder, SummaryDelta};
use cairn_format::index::{IndexFile, PackIndex};
use cairn_format::index_run;
use cairn_format::leaf_v2::{LeafDigest, RunExtent, RunLeaf};
use cairn_format::marker::{self, GcPlan};
use cairn_format::memstate::MemoryLayout;
use cairn_format::node::{Extent, Interior, Leaf};
use cairn_format::pack::{self, encode_blob, BlobEncoding, BlobEntry, BlobKind, PackBuilder};
use cairn_format::pack_v2::{self, PackWriter};
use cairn_format::summary::{ProbeKey, Summary};
use cairn_format::version::{CommitStats, VersionRecord};
use cairn_format::vm::{ConfigKind, Freeze, VmDisk, VmVersion};
use cairn_format::{refs, Id};
use proptest::prelude::*;

fn samples() -> Vec<(&'static str, Vec<u8>)> {
    let config = RepoConfig {
        repo_id: [3; 16],
        chunker: Chunker::FastCdc,
        chunk_size: 65536,
        segment_size: 1 << 20,
        fanout: 256,
        compression: Compression::Zstd { level: 3 },
        pack_target: 16 << 20,
        created_ns: 42,
        summary_bits: 24,
        v2: None,
    };
    let entry = BlobEntry {
        id: Id::of(b"x"),
        kind: BlobKind::Data,
        encoding: BlobEncoding::Zstd,
        offset: 16,
        stored_len: 10,
        raw_len: 20,
    };
    let index = IndexFile {
        packs: vec![PackIndex {
            pack: Id::of(b"p"),
            entries: vec![entry; 3],
        }],
    };
    let version = VersionRecord {
        image: "a/b".into(),
        seq: 2,
        parent: Some(Id::of(b"parent")),
        time_ns: 7,
        logical_size: 1 << 30,
        root: Some(Id::of(b"root")),
        height: 2,
        segment_size: 1 << 20,
        fanout: 256,
        stats: CommitStats::default(),
        message: "m".into(),
    };
    let mut p = PackBuilder::new();
    let blob = vec![9u8; 3000];
    let (stored, enc) = encode_blob(&blob, Compression::Zstd { level: 1 });
    p.push(
        Id::of(&blob),
        BlobKind::Data,
        enc,
        &stored,
        blob.len() as u32,
    );
    let (_, pack_bytes, _) = p.finish();
    vec![
        ("config", config.encode()),
        ("index", index.encode()),
        ("version", version.encode()),
        ("ref", refs::encode(&Id::of(b"v"))),
        ("pack", pack_bytes),
        (
            "summary",
            Summary::build(
                vec![ProbeKey::of(&Id::of(b"c"))],
                vec![ProbeKey::of(&Id::of(b"n"))],
                24,
            )
            .encode(),
        ),
        ("deleted", marker::encode_deleted(&Id::of(b"v"), 5)),
        ("freed", marker::encode_freed(&Id::of(b"v"), 6)),
        (
            "plan",
            GcPlan {
                created_ns: 1,
                dead_blobs: vec![Id::of(b"d")],
                superseded_index: vec![Id::of(b"i")],
            }
            .encode(),
        ),
        ("sealed", sealing_key().seal(Domain::Node, b"a sealed node")),
        (
            "key_slot",
            KeySlot::create(
                &sealing_key(),
                b"p",
                KdfParams {
                    memory_kib: 64,
                    passes: 1,
                    lanes: 1,
                },
            )
            .unwrap()
            .encode(),
        ),
        ("pack_v2", pack_v2_sample(None)),
        ("leaf_v2", leaf_v2_sample().encode()),
        ("interior_v2", interior_v2_sample().encode()),
        (
            "group_summary",
            group_summary_sample(GroupSummary::default()).encode(),
        ),
        (
            "group_summary_counted",
            group_summary_sample(GroupSummary::counted()).encode(),
        ),
        ("summary_delta", summary_delta_sample()),
        ("vm_version", vm_version_sample()),
        (
            "boot_profile",
            cairn_format::boot_profile::encode(br#"{"reads":[[0,4096]]}"#, None),
        ),
        (
            "boot_profile_sealed",
            cairn_format::boot_profile::encode(br#"{"reads":[[0,4096]]}"#, Some(&sealing_key())),
        ),
        ("memory_state_header", memory_state_sample()),
        ("index_run", index_run_sample(None)),
        ("index_run_sealed", index_run_sample(Some(&sealing_key()))),
        ("pack_v2_sealed", pack_v2_sample(Some(&sealing_key()))),
    ]
}

/// A VM version of two disks with a configuration.
fn vm_version_sample() -> Vec<u8> {
    VmVersion {
        vm: "web".into(),
        seq: 3,
        parent: Some(Id::of(b"p")),
        time_ns: 7,
        config_kind: ConfigKind::QemuArgs,
        config: "qemu-system-x86_64\n-m\n1024".into(),
        disks: ["disk0", "disk1"]
            .iter()
            .enumerate()
            .map(|(i, n)| VmDisk {
                name: n.to_string(),
                version: Id::of(n.as_bytes()),
                seq: i as u64 + 1,
                node: format!("node{i}"),
                checkpoint: "cairn-cp-9".into(),
            })
            .collect(),
        memory: Some(Id::of(b"m")),
        freeze: Freeze::Frozen,
        freeze_ns: 5,
        message: "m".into(),
    }
    .encode()
}

/// A memory state header of two RAM blocks.
fn memory_state_sample() -> Vec<u8> {
    let mut l = MemoryLayout::plan(
        4096,
        b"QEVM\0\0\0\x03".to_vec(),
        (2, 0, 4),
        &[("pc.ram".into(), 1 << 20), ("pc.bios".into(), 64 << 10)],
    );
    l.tail_len = 99;
    l.encode()
}

/// A v2 pack of a data group and a node group, plain or sealed.
fn pack_v2_sample(key: Option<&MasterKey>) -> Vec<u8> {
    let id_of = |d: &[u8]| key.map_or_else(|| Id::of(d), |k| k.id_of(d));
    let mut w = PackWriter::new(key);
    for (kind, parts) in [
        (BlobKind::Data, vec![vec![1u8; 3000], b"text".repeat(100)]),
        (BlobKind::Node, vec![b"node".to_vec()]),
    ] {
        let mut g = GroupBuilder::new(64 << 10);
        for p in &parts {
            g.push(id_of(p), p);
        }
        w.push(kind, g.finish(Compression::Zstd { level: 1 }, key));
    }
    w.finish().1
}

/// An index run (version 3) of 40 ids in 4 packs: sections of 8 entries, 2 sections a
/// directory block, 3 packs a pack block.
fn index_run_sample(key: Option<&MasterKey>) -> Vec<u8> {
    let locations: Vec<(Id, Id)> = (0u32..40)
        .map(|i| (Id::of(&i.to_le_bytes()), Id::of(&[(i % 4) as u8])))
        .collect();
    let geometry = index_run::Geometry {
        section_entries: 8,
        block_sections: 2,
        packs_per_block: 3,
    };
    index_run::write_run_with(&locations, key, geometry)
}

/// An index run decodes when its meta and every section do.
fn open_index_run(data: &[u8], key: Option<&MasterKey>) -> bool {
    index_run::parse_run(data, key).is_ok_and(|run| run.all_entries(data, key).is_ok())
}

/// A reference summary of a node and two runs that overlap (counted: slots 5..10 repeat).
/// A delta from the counted sample to a summary without its first node and with a group
/// more, at position 3 of a chain.
fn summary_delta_sample() -> Vec<u8> {
    let base = group_summary_sample(GroupSummary::counted());
    let mut new = SummaryBuilder::from(base.clone());
    new.add_run(&Id::of(b"another group"), 3, 9);
    let new = new.finish().unwrap();
    let at_2 = Resolved {
        summary: base,
        position: 2,
        chain: vec![Id::of(b"c0"), Id::of(b"c2")],
        since: Before::default(),
    };
    at_2.next_delta(&new).unwrap()
}

fn group_summary_sample(s: GroupSummary) -> GroupSummary {
    let mut s = SummaryBuilder::from(s);
    s.add_node(&Id::of(b"n"));
    s.add_run(&Id::of(b"g"), 1, 70);
    s.add_run(&Id::of(b"g"), 5, 5);
    s.finish().unwrap()
}

/// A v2 leaf of zero runs and group runs.
fn leaf_v2_sample() -> RunLeaf {
    let mut leaf = RunLeaf::default();
    for (i, e) in [
        RunExtent::Zero { len: 4096 },
        RunExtent::Run {
            group: Id::of(b"g"),
            first: 1,
            count: 3,
            len: 12288,
        },
        RunExtent::Run {
            group: Id::of(b"h"),
            first: 0,
            count: 1,
            len: 777,
        },
    ]
    .into_iter()
    .enumerate()
    {
        leaf.push(e);
        assert_eq!(leaf.extents().len(), i + 1);
    }
    leaf
}

/// A level-1 node carrying one of its two leaves' digests (format 2).
fn interior_v2_sample() -> Interior {
    Interior {
        level: 1,
        children: vec![(2, Id::of(b"a")), (9, Id::of(b"b"))],
        leaf_digests: vec![
            None,
            Some(LeafDigest {
                digest: Id::of(b"d"),
                chunks: 4,
                data_bytes: 16384,
            }),
        ],
    }
}

/// The key the "sealed" sample is sealed with (format v2 encryption).
fn sealing_key() -> MasterKey {
    MasterKey::from_bytes([5; 64])
}

fn decode(kind: &str, data: &[u8]) -> bool {
    match kind {
        "config" => RepoConfig::decode(data).is_ok(),
        "index" => IndexFile::decode(data).is_ok(),
        "version" => VersionRecord::decode(data).is_ok(),
        "ref" => refs::decode(data).is_ok(),
        "pack" => pack::parse_pack(data).is_ok(),
        "summary" => Summary::decode(data).is_ok(),
        "deleted" => marker::decode_deleted(data).is_ok(),
        "freed" => marker::decode_freed(data).is_ok(),
        "plan" => GcPlan::decode(data).is_ok(),
        "sealed" => sealing_key().open(Domain::Node, "node", data).is_ok(),
        // Parsing only: a slot is authenticated by opening it (Argon2id, too slow to run per
        // mutation; the crypto module's tests change every header field and see it refused).
        "key_slot" => KeySlot::decode(data).is_ok(),
        "pack_v2" => pack_v2::parse_pack(data, None).is_ok(),
        "leaf_v2" => RunLeaf::decode(data).is_ok(),
        "interior_v2" => Interior::decode(data).is_ok(),
        "group_summary" | "group_summary_counted" => GroupSummary::decode(data).is_ok(),
        "summary_delta" => SummaryDelta::decode(data).is_ok_and(|d| {
            let mut s = group_summary_sample(GroupSummary::counted());
            let _ = s.apply(&d, Some(&mut Before::default()));
            true
        }),
        "vm_version" => VmVersion::decode(data).is_ok(),
        "boot_profile" => cairn_format::boot_profile::decode(data, None).is_ok(),
        "boot_profile_sealed" => {
            cairn_format::boot_profile::decode(data, Some(&sealing_key())).is_ok()
        }
        "memory_state_header" => MemoryLayout::decode(data).is_ok(),
        "index_run" => open_index_run(data, None),
        "index_run_sealed" => open_index_run(data, Some(&sealing_key())),
        "pack_v2_sealed" => pack_v2::parse_pack(data, Some(&sealing_key())).is_ok(),
        _ => unreachable!(),
    }
}

#[test]
fn samples_decode() {
    for (kind, bytes) in samples() {
        assert!(decode(kind, &bytes), "{kind}");
    }
}

#[test]
fn every_bit_flip_and_truncation_of_an_enveloped_structure_is_rejected() {
    for (kind, bytes) in samples() {
        if kind == "pack"
            || kind.starts_with("pack_v2")
            || kind == "key_slot"
            || kind == "leaf_v2"
            || kind == "interior_v2"
        {
            // packs: covered by the pack module's tests (blobs are checked by id); key slots
            // and leaves carry no checksum of their own (a slot is authenticated when opened,
            // a leaf is checked against its node id when read): only truncations are checked.
            for n in 0..bytes.len() {
                assert!(
                    !decode(kind, &bytes[..n]),
                    "{kind}: truncation to {n} accepted"
                );
            }
            continue;
        }
        for i in 0..bytes.len() {
            for bit in 0..8 {
                let mut bad = bytes.clone();
                bad[i] ^= 1 << bit;
                assert!(
                    !decode(kind, &bad),
                    "{kind}: flip of bit {bit} at {i} accepted"
                );
            }
        }
        for n in 0..bytes.len() {
            assert!(
                !decode(kind, &bytes[..n]),
                "{kind}: truncation to {n} accepted"
            );
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
        for (kind, _) in samples() {
            let _ = decode(kind, &data);
        }
        let _ = Leaf::decode(&data);
        let _ = Interior::decode(&data);
        let _ = pack::parse_footer(&data);
        let _ = pack_v2::salvage_pack(&data, None, Id::of);
    }

    #[test]
    fn mutated_valid_structures_never_panic(
        which in any::<usize>(),
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8),
        cut in any::<usize>(),
    ) {
        let mut all = samples();
        let n = all.len();
        let (kind, mut bytes) = all.swap_remove(which % n);
        for (pos, val) in edits {
            let n = bytes.len();
            bytes[pos % n] = val;
        }
        let n = bytes.len();
        bytes.truncate(cut % (n + 1));
        let _ = decode(kind, &bytes);
        if kind.starts_with("pack_v2") {
            let key = kind.ends_with("sealed").then(sealing_key);
            let id_of = |d: &[u8]| key.as_ref().map_or_else(|| Id::of(d), |k| k.id_of(d));
            let _ = pack_v2::salvage_pack(&bytes, key.as_ref(), id_of);
        }
    }

    #[test]
    fn group_decoding_never_panics_and_never_lies(
        stored in proptest::collection::vec(any::<u8>(), 0..512),
        lens in proptest::collection::vec(0u32..70_000, 0..4),
        zstd in any::<bool>(),
        sealed in any::<bool>(),
    ) {
        let desc = GroupDesc {
            encoding: if zstd { BlobEncoding::Zstd } else { BlobEncoding::Raw },
            sealed,
            stored_len: stored.len() as u32,
            plain_len: lens.iter().sum(),
            chunks: lens.iter().map(|&len| GroupChunk::new(Id::of(b"expected"), len)).collect(),
        };
        let key = sealing_key();
        if let Ok(plain) = open_group(&desc, &stored, Some(&key)) {
            prop_assert_eq!(plain.len() as u32, desc.plain_len);
            for slot in 0..desc.chunks.len() {
                // Random bytes never pass as the expected chunk.
                prop_assert!(chunk(&desc, &plain, slot, Id::of).is_err());
            }
        }
    }

    #[test]
    fn blob_decoding_never_panics_and_never_lies(
        stored in proptest::collection::vec(any::<u8>(), 0..512),
        raw_len in 0u32..100_000,
        zstd in any::<bool>(),
    ) {
        let entry = BlobEntry {
            id: Id::of(b"expected"),
            kind: BlobKind::Data,
            encoding: if zstd { BlobEncoding::Zstd } else { BlobEncoding::Raw },
            offset: 16,
            stored_len: stored.len() as u32,
            raw_len,
        };
        // Random bytes can never hash to the expected id.
        prop_assert!(pack::decode_blob(&entry, &stored).is_err());
    }

    #[test]
    fn leaves_with_random_extents_round_trip(lens in proptest::collection::vec(1u32..100_000, 0..50)) {
        let mut leaf = Leaf::default();
        for (i, len) in lens.iter().enumerate() {
            leaf.push(Extent::Chunk { id: Id::of(&i.to_le_bytes()), len: *len });
        }
        prop_assert_eq!(Leaf::decode(&leaf.encode()).unwrap(), leaf);
    }
}

use super::*;
use crate::crypto::{CryptoError, MasterKey};

fn locations(n: u32) -> Vec<(Id, Id)> {
    (0..n)
        .map(|i| (Id::of(&i.to_le_bytes()), Id::of(&[(i % 3) as u8])))
        .collect()
}

/// Many pieces of every kind: sections of `s` entries, 3 sections a block, 2 packs a block.
fn small(s: usize) -> Geometry {
    Geometry {
        section_entries: s,
        block_sections: 3,
        packs_per_block: 2,
    }
}

#[test]
fn every_id_is_found_in_one_section_and_absent_ids_mostly_are_not() {
    for key in [None, Some(MasterKey::generate())] {
        let key = key.as_ref();
        let locs = locations(2000);
        let run = write_run_with(&locs, key, small(100));
        let whole = parse_run(&run, key).unwrap();
        assert_eq!(whole.entries(), 2000);
        assert_eq!(whole.packs.len(), 3);
        assert_eq!(whole.meta.pack_blocks.len(), 2);
        assert_eq!(whole.sections().count(), 20);
        assert_eq!(whole.meta.blocks.len(), 7, "20 sections in blocks of 3");
        for (id, pack) in &locs {
            assert_eq!(whole.lookup(&run, id, key).unwrap(), vec![*pack]);
        }
        let absent = (2000u32..12000)
            .filter(|i| whole.section_for(&Id::of(&i.to_le_bytes())).is_some())
            .count();
        assert!(
            absent < 300,
            "{absent} of 10,000 absent ids pass the filter"
        );
        for i in 2000u32..2100 {
            assert!(whole
                .lookup(&run, &Id::of(&i.to_le_bytes()), key)
                .unwrap()
                .is_empty());
        }
    }
}

#[test]
fn the_default_geometry_keeps_the_top_level_small() {
    let locs = locations(200_000);
    let run = write_run(&locs, None);
    let whole = parse_run(&run, None).unwrap();
    let footer = parse_footer(&run[run.len() - FOOTER_LEN..]).unwrap();
    // 589 sections in 3 directory blocks: 4 + 4 + 32 + 4 + 3 × 52 + 8 + 32.
    assert_eq!(whole.sections().count(), 589);
    assert_eq!(whole.meta.blocks.len(), 3);
    assert_eq!(footer.meta_len, 4 + 4 + 32 + 4 + 3 * 52 + 8 + 32);
}

#[test]
fn equal_keys_stay_in_one_section_and_all_come_back() {
    // One id in three packs, and ids forged to share a key: never split by a section cut.
    let same = Id::of(b"everywhere");
    let mut locs: Vec<(Id, Id)> = (0..3u8).map(|p| (same, Id::of(&[p]))).collect();
    for i in 0..10u8 {
        let mut forged = *same.as_bytes();
        forged[31] = i;
        locs.push((Id(forged), Id::of(&[9])));
    }
    locs.extend(locations(50));
    let run = write_run_with(&locs, None, small(4));
    let whole = parse_run(&run, None).unwrap();
    let mut packs = whole.lookup(&run, &same, None).unwrap();
    packs.sort();
    let mut want: Vec<Id> = (0..3u8)
        .map(|p| Id::of(&[p]))
        .chain([Id::of(&[9])])
        .collect();
    want.sort();
    assert_eq!(
        packs, want,
        "three packs hold it, and the forged ids are candidates"
    );
}

#[test]
fn an_empty_run_is_valid_and_finds_nothing() {
    let run = write_run(&[], None);
    let whole = parse_run(&run, None).unwrap();
    assert_eq!((whole.entries(), whole.sections().count()), (0, 0));
    assert!(whole.section_for(&Id::of(b"x")).is_none());
    assert!(whole.lookup(&run, &Id::of(b"x"), None).unwrap().is_empty());
}

/// Opens every piece of a run the way a reader does, sections included.
fn opens(run: &[u8], key: Option<&MasterKey>) -> bool {
    parse_run(run, key).is_ok_and(|w| w.all_entries(run, key).is_ok())
}

#[test]
fn damage_anywhere_is_refused() {
    for key in [None, Some(MasterKey::generate())] {
        let key = key.as_ref();
        let run = write_run_with(&locations(50), key, small(4));
        assert!(opens(&run, key));
        for at in 0..run.len() {
            let mut bad = run.clone();
            bad[at] ^= 0x10;
            assert!(!opens(&bad, key), "flip at {at} of {} accepted", run.len());
        }
        for n in 0..run.len() {
            assert!(parse_run(&run[..n], key).is_err(), "truncation to {n}");
        }
    }
}

#[test]
fn a_piece_from_elsewhere_does_not_pass_for_another() {
    let run = write_run_with(&locations(50), None, small(4));
    let whole = parse_run(&run, None).unwrap();
    let (d0, d1) = (&whole.directories[0], &whole.directories[1]);
    let (a, b) = (d0.sections[0].range(), d0.sections[1].range());
    let piece = |r: std::ops::Range<u64>| &run[r.start as usize..r.end as usize];
    assert!(whole.meta.open_section(d0, 0, piece(b), None).is_err());
    assert!(whole
        .meta
        .open_section(d0, 1, piece(a.clone()), None)
        .is_err());
    assert!(whole.meta.open_section(d1, 0, piece(a), None).is_err());
    let at = |b: usize| match &whole.meta.blocks[b].piece {
        Piece::At(at) => at.range.clone(),
        Piece::Held(_) => unreachable!("version 3"),
    };
    assert!(whole.meta.open_directory(1, piece(at(0)), None).is_err());
    let pack_at = |b: usize| match &whole.meta.pack_blocks[b] {
        Piece::At(at) => at.range.clone(),
        Piece::Held(_) => unreachable!("version 3"),
    };
    assert!(whole
        .meta
        .open_pack_block(0, piece(pack_at(1)), None)
        .is_err());
}

#[test]
fn a_sealed_run_needs_its_key_and_hides_its_keys() {
    let key = MasterKey::generate();
    let locs = locations(30);
    let run = write_run(&locs, Some(&key));
    assert!(parse_run(&run, None).is_err());
    assert!(matches!(
        parse_run(&run, Some(&MasterKey::generate())),
        Err(CryptoError::Tampered { .. })
    ));
    let k = key_of(&locs[0].0).to_le_bytes();
    assert!(!run.windows(8).any(|w| w == k), "a key in clear text");
    assert!(
        !run.windows(32).any(|w| w == locs[0].1.as_bytes()),
        "a pack id in clear text"
    );
}

/// Version 2 (written until 2026-11-27; the golden vector built from FORMAT.md): read as one
/// held directory block and one held pack block, and refused if damaged anywhere.
#[test]
fn version_2_is_read_whole_and_damage_is_refused() {
    let hex: String = include_str!("../../tests/golden/v2_index_run_2.hex")
        .split_whitespace()
        .collect();
    let run: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect();
    let whole = parse_run(&run, None).unwrap();
    assert_eq!((whole.version(), whole.entries()), (2, 6));
    assert!(matches!(whole.meta.blocks[0].piece, Piece::Held(_)));
    assert!(whole.meta.filter_at.is_none());
    assert_eq!(whole.all_entries(&run, None).unwrap().len(), 6);
    for at in 0..run.len() {
        let mut bad = run.clone();
        bad[at] ^= 0x10;
        assert!(!opens(&bad, None), "flip at {at} accepted");
    }
}

#[test]
fn a_newer_version_is_refused_as_too_new() {
    let mut run = write_run(&locations(5), None);
    run[8..12].copy_from_slice(&4u32.to_le_bytes());
    assert!(matches!(
        parse_run(&run, None),
        Err(CryptoError::Format(crate::FormatError::TooNew {
            found: 4,
            ..
        }))
    ));
}

/// The legacy writer tests use writes what the golden vector (built from FORMAT.md) holds.
#[test]
fn the_legacy_writer_writes_version_2_as_specified() {
    let hex: String = include_str!("../../tests/golden/v2_index_run_2.hex")
        .split_whitespace()
        .collect();
    let (pa, pb) = (Id::of(b"pack a"), Id::of(b"pack b"));
    let mut locs: Vec<(Id, Id)> = (0u8..5)
        .map(|i| (Id::of(&[i]), if i % 2 == 0 { pa } else { pb }))
        .collect();
    locs.push((Id::of(&[0]), pb));
    let run = write_legacy_run(&locs, None, 2);
    let as_hex: String = run.iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(as_hex, hex);
    let key = MasterKey::generate();
    let sealed = write_legacy_run(&locations(100), Some(&key), 8);
    let whole = parse_run(&sealed, Some(&key)).unwrap();
    assert_eq!((whole.version(), whole.entries()), (2, 100));
    assert_eq!(whole.all_entries(&sealed, Some(&key)).unwrap().len(), 100);
}

#[test]
fn entries_gathered_pack_by_pack_write_the_run_of_their_pairs() {
    // Packs added in any order, a pack twice, an id twice: the same bytes as the pairs give.
    let locs = locations(500);
    let mut gathered = RunEntries::default();
    for p in [2u8, 0, 1] {
        let pack = Id::of(&[p]);
        let ids: Vec<Id> = locs
            .iter()
            .filter(|(_, q)| *q == pack)
            .map(|(i, _)| *i)
            .collect();
        let (a, b) = ids.split_at(ids.len() / 2);
        gathered.add_pack(pack, a);
        gathered.add_pack(pack, b.iter().chain(&a[..3]));
    }
    assert_eq!(gathered.len(), 509);
    assert_eq!(gathered.packs().count(), 6);
    let run = gathered.write_with(None, small(16));
    assert_eq!(run, write_run_with(&locs, None, small(16)));
    assert_eq!(parse_run(&run, None).unwrap().entries(), 500);
}

/// A run written to any sink is the run written to memory, its id the hash of its bytes;
/// a sink that fails makes the writer fail with its error.
#[test]
fn a_run_written_to_a_sink_is_the_run_in_memory_and_a_failing_sink_fails_it() {
    let gathered = || {
        let mut e = RunEntries::default();
        let locs = locations(300);
        for p in [0u8, 1, 2] {
            let pack = Id::of(&[p]);
            e.add_pack(
                pack,
                locs.iter().filter(|(_, q)| *q == pack).map(|(i, _)| i),
            );
        }
        e
    };
    let in_memory = gathered().write_with(None, small(16));
    let (sink, id) = gathered()
        .write_to(std::io::Cursor::new(Vec::new()), None, small(16))
        .unwrap();
    assert_eq!(sink.into_inner(), in_memory);
    assert_eq!(id, Id::of(&in_memory));

    struct Full(usize);
    impl std::io::Write for Full {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            if self.0 < buf.len() {
                return Err(std::io::Error::other("no space left"));
            }
            self.0 -= buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let err = gathered()
        .write_to(Full(100), None, small(16))
        .err()
        .unwrap();
    assert_eq!(err.to_string(), "no space left");
}

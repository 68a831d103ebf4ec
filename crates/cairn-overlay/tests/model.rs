//! Model test: random sequences of write / zero / flush / snapshot / rollback / delete /
//! reopen, with every block compared against an in-memory model after every step, and the
//! snapshot tree (each snapshot's parent, which ones the current state reads through)
//! against the model's tree.
//!
//! Reopen drops the overlay without flushing (a crash as far as the overlay is concerned).
//! The contract then allows each block to be either as at the last durability point (flush
//! or metadata operation) or as last written; the model adopts whatever was found.

mod common;

use std::path::Path;

use cairn_overlay::Overlay;
use common::{pattern, BS};
use proptest::prelude::*;

const NBLOCKS: u64 = 12;
const SIZE: u64 = (NBLOCKS - 1) * BS as u64 + 123;

/// Content of a held block: 0 = zeros, otherwise `pattern(block, seed)`.
type Content = Option<u64>;

#[derive(Debug, Clone)]
enum Op {
    Write { block: u64, seed: u64 },
    Zero { first: u64, count: u64 },
    Flush,
    Snapshot,
    Rollback(usize),
    Delete(usize),
    Reopen,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..NBLOCKS, 1..1000u64).prop_map(|(block, seed)| Op::Write { block, seed }),
        1 => (0..NBLOCKS, 1..4u64).prop_map(|(first, count)| Op::Zero {
            first,
            count: count.min(NBLOCKS - first)
        }),
        2 => Just(Op::Flush),
        2 => Just(Op::Snapshot),
        2 => any::<usize>().prop_map(Op::Rollback),
        2 => any::<usize>().prop_map(Op::Delete),
        1 => Just(Op::Reopen),
    ]
}

fn bytes_of(block: u64, c: Content) -> Option<Vec<u8>> {
    let len = (SIZE - block * BS as u64).min(BS as u64) as usize;
    c.map(|s| {
        if s == 0 {
            vec![0; len]
        } else {
            pattern(block, s, len)
        }
    })
}

fn read(o: &Overlay, block: u64) -> Option<Vec<u8>> {
    common::read(o, block)
}

fn open(dir: &Path) -> Overlay {
    Overlay::open(dir, SIZE, BS, "base").unwrap()
}

/// `copy_on_read`: 0, or the depth from which reads copy blocks up (the checks after each
/// step read every block, so copies happen all the time).
fn run(ops: Vec<Op>, copy_on_read: u16) -> Result<(), TestCaseError> {
    let d = tempfile::tempdir().unwrap();
    let mut o = open(d.path());
    o.set_copy_on_read(copy_on_read);
    let mut current: Vec<Content> = vec![None; NBLOCKS as usize];
    let mut durable = current.clone();
    // Every snapshot: name, contents, parent snapshot.
    let mut snaps: Vec<(String, Vec<Content>, Option<String>)> = Vec::new();
    // The snapshot the writable layer sits on.
    let mut on: Option<String> = None;
    let mut next_name = 0;
    for (step, op) in ops.into_iter().enumerate() {
        match op {
            Op::Write { block, seed } => {
                o.write_block(block, &bytes_of(block, Some(seed)).unwrap())
                    .unwrap();
                current[block as usize] = Some(seed);
            }
            Op::Zero { first, count } => {
                o.zero_blocks(first, count).unwrap();
                for b in first..first + count {
                    current[b as usize] = Some(0);
                }
            }
            Op::Flush => {
                o.flush().unwrap();
                durable = current.clone();
            }
            Op::Snapshot => {
                let name = format!("s{next_name}");
                next_name += 1;
                o.snapshot(&name).unwrap();
                snaps.push((name.clone(), current.clone(), on.replace(name)));
                durable = current.clone();
            }
            Op::Rollback(i) => {
                if snaps.is_empty() {
                    continue;
                }
                let i = i % snaps.len();
                o.rollback(&snaps[i].0).unwrap();
                current = snaps[i].1.clone();
                on = Some(snaps[i].0.clone());
                durable = current.clone();
            }
            Op::Delete(i) => {
                if snaps.is_empty() {
                    continue;
                }
                let i = i % snaps.len();
                o.delete_snapshot(&snaps[i].0).unwrap();
                let (gone, _, parent) = snaps.remove(i);
                for s in &mut snaps {
                    if s.2.as_ref() == Some(&gone) {
                        s.2 = parent.clone();
                    }
                }
                if on.as_ref() == Some(&gone) {
                    on = parent;
                }
                durable = current.clone();
            }
            Op::Reopen => {
                drop(o);
                o = open(d.path());
                o.set_copy_on_read(copy_on_read);
                for b in 0..NBLOCKS {
                    let got = read(&o, b);
                    let (old, new) = (durable[b as usize], current[b as usize]);
                    let c = if got == bytes_of(b, old) {
                        old
                    } else if got == bytes_of(b, new) {
                        new
                    } else {
                        return Err(TestCaseError::fail(format!(
                            "step {step}: after reopen block {b} is neither {old:?} (durable) nor {new:?} (latest)"
                        )));
                    };
                    current[b as usize] = c;
                }
                durable = current.clone();
            }
        }
        for b in 0..NBLOCKS {
            prop_assert_eq!(
                read(&o, b),
                bytes_of(b, current[b as usize]),
                "step {}: block {}",
                step,
                b
            );
        }
        let mut want: Vec<(String, Option<String>, bool)> = snaps
            .iter()
            .map(|(name, _, parent)| {
                let mut under = on.clone();
                while let Some(u) = under.clone().filter(|u| u != name) {
                    under = snaps.iter().find(|s| s.0 == u).and_then(|s| s.2.clone());
                }
                (name.clone(), parent.clone(), under.is_some())
            })
            .collect();
        want.sort();
        let mut got: Vec<(String, Option<String>, bool)> = o
            .snapshot_tree()
            .into_iter()
            .map(|s| (s.name, s.parent, s.current_path))
            .collect();
        got.sort();
        prop_assert_eq!(got, want, "step {}: snapshot tree", step);
        let held = current.iter().filter(|c| c.is_some()).count() as u64;
        prop_assert_eq!(o.stats().blocks_held, held);
        prop_assert!(o.stats().layers > snaps.len());
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn overlay_matches_model(ops in proptest::collection::vec(op(), 1..40), cod in 0..3u16) {
        run(ops, cod)?;
    }
}

//! Model test: random sequences of write / zero / flush / snapshot / rollback / delete /
//! reopen, with every block compared against an in-memory model after every step.
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
        1 => any::<usize>().prop_map(Op::Rollback),
        1 => any::<usize>().prop_map(Op::Delete),
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

fn run(ops: Vec<Op>) -> Result<(), TestCaseError> {
    let d = tempfile::tempdir().unwrap();
    let mut o = open(d.path());
    let mut current: Vec<Content> = vec![None; NBLOCKS as usize];
    let mut durable = current.clone();
    let mut snaps: Vec<(String, Vec<Content>)> = Vec::new();
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
                snaps.push((name, current.clone()));
                durable = current.clone();
            }
            Op::Rollback(i) => {
                if snaps.is_empty() {
                    continue;
                }
                let i = i % snaps.len();
                o.rollback(&snaps[i].0).unwrap();
                current = snaps[i].1.clone();
                snaps.truncate(i + 1);
                durable = current.clone();
            }
            Op::Delete(i) => {
                if snaps.is_empty() {
                    continue;
                }
                let i = i % snaps.len();
                o.delete_snapshot(&snaps[i].0).unwrap();
                snaps.remove(i);
                durable = current.clone();
            }
            Op::Reopen => {
                drop(o);
                o = open(d.path());
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
        let names: Vec<String> = snaps.iter().map(|s| s.0.clone()).collect();
        prop_assert_eq!(o.snapshots(), names);
        let held = current.iter().filter(|c| c.is_some()).count() as u64;
        prop_assert_eq!(o.stats().blocks_held, held);
        prop_assert_eq!(o.stats().layers, snaps.len() + 1);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn overlay_matches_model(ops in proptest::collection::vec(op(), 1..40)) {
        run(ops)?;
    }
}

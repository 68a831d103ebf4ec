//! The integration tests of cairn-engine, one module per concern, linked into one test binary:
//! each binary of its own re-linked the engine and recompiled the shared helpers (`common`),
//! which cost the 2-core CI machine about 11 of the 15 minutes of compile time the engine's 20
//! binaries took (cargo's --timings, 2026-11-26).
//!
//! They are a package of their own (cairn-engine-it) so that the `ci` profile compiles them at
//! opt-level 1 while the engine stays at 3 (see the workspace Cargo.toml).
//!
//!     cargo test -p cairn-engine-it gc::          (one module's tests)

mod commit_plan;
mod common;
mod compact;
mod copy;
mod damage;
mod damage_matrix;
mod dedup_tiers;
mod diff;
mod encrypted;
mod format2;
mod gc;
mod gc_format2;
mod gc_leak;
mod gc_merged;
mod gc_records;
mod healing;
mod history;
mod in_place;
mod incremental;
mod lost_metadata;
mod patch;
mod round_trip;
mod summary_delta;
mod vm_versions;

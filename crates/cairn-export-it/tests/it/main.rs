//! The integration tests of cairn-export, one module per concern, linked into one test binary
//! (one link instead of one per file: minutes of compile time on the 2-core CI machine), in a
//! package of their own (cairn-export-it) so that the `ci` profile compiles them at opt-level 1
//! while the export stays at 3 (see the workspace Cargo.toml).

mod damage_during_export;
mod export_contract;
mod gc_during_export;

//! The integration tests of cairn-export, one module per concern, linked into one test binary
//! (one link instead of one per file: minutes of compile time on the 2-core CI machine).

mod damage_during_export;
mod export_contract;
mod gc_during_export;

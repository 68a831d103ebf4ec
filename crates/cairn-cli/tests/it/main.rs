//! The integration tests of the `cairn` command, one module per concern, linked into one test
//! binary (one link instead of one per file: minutes of compile time on the 2-core CI machine).
//! `cli_s3` stays a binary of its own: the S3 suites (scripts/s3_suite.sh) run it alone against
//! each server.

mod cli_diff;
mod cli_docs;
mod cli_encrypt;
mod cli_errors;
mod cli_export;
mod cli_export_lifecycle;
mod cli_export_tls;
mod cli_files;
mod cli_format2;
mod cli_history;
mod cli_locality;
mod cli_output;
mod cli_profile;
mod cli_safety;
mod cli_seeded;
mod cli_v1_fixture;
mod common;

//! Command-line flags, as typed. Resolution into settings happens in the commands.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// cairn — version control and lazy deployment for virtual-machine disk images.
///
/// Every commit of a disk image becomes a cheap, deduplicated, immutable version that can be
/// restored bit-exact. Start with `cairn init`, then `cairn commit IMAGE disk.raw`.
#[derive(Debug, Parser)]
#[command(
    name = "cairn",
    version,
    propagate_version = true,
    max_term_width = 100
)]
pub struct Cli {
    /// Repository location: a directory path.
    #[arg(long, global = true, env = "CAIRN_REPO", value_name = "PATH")]
    pub repo: Option<String>,

    /// Print machine-readable JSON on stdout instead of text.
    #[arg(long, global = true)]
    pub json: bool,

    /// More log output on stderr (-v info, -vv debug). CAIRN_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,

    /// No progress bars.
    #[arg(short, long, global = true)]
    pub quiet: bool,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create a new, empty repository at --repo.
    Init(InitArgs),
    /// Store the current content of a disk image as a new version of IMAGE.
    ///
    /// SOURCE is a raw image file, a block device, or `-` for standard input. Files are read
    /// sparse-aware: holes are never read. Only chunks the repository does not hold yet are
    /// stored.
    Commit(CommitArgs),
    /// List the versions of an image, newest first.
    Log(LogArgs),
    /// List the images in the repository.
    Images,
    /// Show one version in detail.
    Show(ShowArgs),
    /// Write a version out as a raw image, bit-exact.
    ///
    /// OUTPUT is a file (created or replaced; zero runs become holes), a block device, or `-`
    /// for standard output.
    Restore(RestoreArgs),
    /// Re-read every object and report damage and the versions it affects.
    ///
    /// Exit status 0 when everything is intact, 3 when damage was found.
    Verify,
    /// Repository-wide figures: logical size, stored size, dedup ratio.
    Stats,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ChunkerArg {
    /// Fixed-size chunks aligned to the disk (fast; best for block-aligned images).
    Fixed,
    /// Content-defined chunks (FastCDC) within each segment.
    Fastcdc,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum CompressionArg {
    Zstd,
    None,
}

#[derive(Debug, Args)]
pub struct InitArgs {
    /// Chunk size (a power of two, 4K..4M); the average size with fastcdc.
    #[arg(long, default_value = "16K", value_parser = parse_size)]
    pub chunk_size: u64,
    /// Chunking method.
    #[arg(long, value_enum, default_value = "fixed")]
    pub chunker: ChunkerArg,
    /// Segment size: the unit of change detection and metadata sharing (a power of two).
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    pub segment_size: u64,
    /// Compression of stored chunks.
    #[arg(long, value_enum, default_value = "zstd")]
    pub compression: CompressionArg,
    /// zstd level (negative levels are faster).
    #[arg(long, default_value_t = 3, allow_hyphen_values = true)]
    pub zstd_level: i32,
    /// Target pack size.
    #[arg(long, default_value = "16M", value_parser = parse_size)]
    pub pack_size: u64,
}

#[derive(Debug, Args)]
pub struct CommitArgs {
    /// Image name, e.g. web01/disk0.
    pub image: String,
    /// Raw image file, block device, or `-` for stdin.
    pub source: PathBuf,
    /// Message stored with the version.
    #[arg(short, long, default_value = "")]
    pub message: String,
    /// Hashing and compression threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

#[derive(Debug, Args)]
pub struct LogArgs {
    /// Image name.
    pub image: String,
}

#[derive(Debug, Args)]
pub struct ShowArgs {
    /// IMAGE, IMAGE@N (N-th version), or IMAGE@HEX (id prefix).
    pub version: String,
}

#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// IMAGE, IMAGE@N (N-th version), or IMAGE@HEX (id prefix).
    pub version: String,
    /// Output file, block device, or `-` for stdout.
    pub output: PathBuf,
}

/// Parses sizes like `16K`, `4MiB`, `1048576`.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size (like 16K or 4M)"))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        _ => return Err(format!("{s:?}: unknown unit (use K, M or G)")),
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("16K"), Ok(16384));
        assert_eq!(parse_size("4MiB"), Ok(4 << 20));
        assert_eq!(parse_size("512"), Ok(512));
        assert!(parse_size("12Q").is_err());
    }

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }
}

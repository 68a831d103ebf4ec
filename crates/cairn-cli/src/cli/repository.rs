//! Flags of the commands that work on the repository: init, commit, restore, history, GC, keys.
//!
//! Doc comments here are `--help` text (clap), not rustdoc: brackets in them are shell syntax.
#![allow(rustdoc::broken_intra_doc_links)]

use super::*;

#[derive(Debug, Args)]
pub struct KeyArgs {
    #[command(subcommand)]
    pub action: KeyAction,
}

#[derive(Debug, Subcommand)]
pub enum KeyAction {
    /// List the key slots (the one that opened the repository is marked).
    List,
    /// Add a passphrase: a new key slot opening the same master key.
    Add {
        /// Read the new passphrase from this file (first line).
        #[arg(long, value_name = "PATH")]
        new_password_file: Option<std::path::PathBuf>,
    },
    /// Remove a key slot (its id or a unique prefix, from `cairn key list`). The last slot
    /// is never removed: the repository could not be opened any more.
    Remove { slot: String },
    /// Change the passphrase that opened the repository: adds a slot with the new one, then
    /// removes the slot the old one opened.
    Passwd {
        /// Read the new passphrase from this file (first line).
        #[arg(long, value_name = "PATH")]
        new_password_file: Option<std::path::PathBuf>,
    },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ChunkerArg {
    /// Fixed-size chunks aligned to the disk (fast; best for block-aligned images).
    Fixed,
    /// Content-defined chunks (FastCDC) within each segment.
    Fastcdc,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SourceFormatArg {
    Auto,
    Raw,
    Qcow2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum OutputFormatArg {
    Raw,
    Qcow2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DedupArg {
    /// Find every chunk stored before: the parent's leaf, similar packs, then one index
    /// lookup for each chunk still not found. Nothing is stored twice.
    Exact,
    /// The parent's leaf and similar packs only (at most 4 index lookups a changed 1 MiB
    /// segment): a chunk they miss is stored again.
    Bounded,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum CompressionArg {
    Zstd,
    None,
}

#[derive(Debug, Args)]
pub struct InitArgs {
    /// Repository format: 2, which dedups 4 KiB blocks — data moved inside a guest's file
    /// system is found again — compresses a commit's neighbouring new chunks together in
    /// groups, and can be encrypted. Format 1 (16 KiB chunks, each compressed alone; what
    /// older cairns wrote) is read-only: `init --format 1` is refused, and
    /// `cairn copy --from OLD` moves a format 1 repository into a format 2 one.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=2))]
    pub format: Option<u32>,
    /// Encrypt everything stored (format 2; implied): data, manifests, index runs and
    /// version records sealed with XChaCha20-Poly1305, chunk ids keyed, the master key in a
    /// key slot opened by the passphrase (--password-file, --password-command,
    /// $CAIRN_PASSWORD, or asked twice at the terminal). Lose every passphrase and the data
    /// is lost: keep one safe, or add a second (`cairn key add`).
    #[arg(long)]
    pub encrypt: bool,
    /// Chunk size (a power of two, 4K..4M); the average size with fastcdc. Default: 4K.
    #[arg(long, value_parser = parse_size)]
    pub chunk_size: Option<u64>,
    /// Format 2: a commit's neighbouring new chunks are compressed together in groups of up
    /// to this many bytes (larger groups compress better; a lazy export then fetches more
    /// per guest read). Default: 64K.
    #[arg(long, value_parser = parse_size)]
    pub group_size: Option<u64>,
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
    /// Bits per chunk in each version's reference summary, the Bloom filter that lets
    /// `cairn rm` and `cairn gc` free space without a full mark. Fewer bits: smaller summaries,
    /// more space leaked until `cairn gc --repair` (24 bits leak < 0.01% of deleted chunks).
    #[arg(long, default_value_t = 24, value_parser = clap::value_parser!(u8).range(4..=64))]
    pub summary_bits: u8,
    /// Space a local repository keeps preallocated for deletion: on a full disk `rm`,
    /// `prune` and `gc` release it to free space (commits never use it). 0 disables it.
    #[arg(long, default_value = "32M", value_parser = parse_size)]
    pub reserve: u64,
}

#[derive(Debug, Args)]
pub struct CommitArgs {
    /// Image name, e.g. web01/disk0.
    pub image: String,
    /// Image file (raw or qcow2), block device, NBD URL, or `-` for stdin.
    #[arg(
        required_unless_present = "from_export",
        conflicts_with = "from_export"
    )]
    pub source: Option<String>,
    /// Container format of a file SOURCE (auto: qcow2 if it starts with the qcow2 magic).
    #[arg(long, value_enum, default_value = "auto")]
    pub format: SourceFormatArg,
    /// The version SOURCE changed from: commit only a qcow2 overlay's own clusters (its
    /// backing chain must hold exactly this version), or with --dirty-bitmap only the dirty
    /// extents (default there: IMAGE's newest version).
    #[arg(long, value_name = "VERSION")]
    pub parent: Option<String>,
    /// Read only the extents that the NBD export's `qemu:dirty-bitmap:NAME` context marks
    /// dirty (QEMU changed-block tracking; the bitmap must have been created when the parent
    /// version was taken, and the export must expose it).
    #[arg(long, value_name = "NAME")]
    pub dirty_bitmap: Option<String>,
    /// Cap the source read rate, in MiB/s.
    #[arg(long, value_name = "MIB_PER_S")]
    pub rate_limit: Option<f64>,
    /// Keep what the scan reads in the page cache (default: pages the scan brought in are
    /// dropped again, so it does not evict the host's cache).
    #[arg(long, env = "CAIRN_KEEP_CACHE", value_parser = clap::builder::BoolishValueParser::new())]
    pub keep_cache: bool,
    /// Read raw files and block devices with O_DIRECT, bypassing the page cache.
    #[arg(long, conflicts_with = "keep_cache")]
    pub direct: bool,
    /// Commit what a running writable export holds (its base + the writes in its overlay),
    /// reading and storing only the overlay; the export goes on serving the new version with
    /// an empty overlay. IMAGE may be a new image: its history then starts at the export's base.
    #[arg(long, value_name = "EXPORT")]
    pub from_export: Option<String>,
    /// With --from-export: commit even when the export's base is not IMAGE's newest version
    /// (an export of an older version, or IMAGE moved on since). The new version then rolls
    /// IMAGE back to the base plus the export's writes, on top of the newest (nothing is
    /// lost from the history); without it such a commit is refused.
    #[arg(long, requires = "from_export")]
    pub force: bool,
    /// Message stored with the version.
    #[arg(short, long, default_value = "")]
    pub message: String,
    /// Hashing and compression threads (default: one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Do not merge index runs after the commit. By default a commit that leaves eight small
    /// runs (one per commit) merges them when no other process is using the repository, so
    /// lookups stay fast as history grows; `cairn index compact` does the same by hand.
    #[arg(long)]
    pub no_compact: bool,
    /// How hard a format 2 commit looks for data stored before. `bounded` asks the index a
    /// few times a changed segment instead of once a chunk, and may store a little again
    /// (BENCHMARKS.md, *Dedup tiers*, measures how much). Full and incremental commits take
    /// it. Without it, the mode `CAIRN_DEDUP` names (exact or bounded), else bounded: that
    /// default also holds for commits with no flag of their own (`--from-export`, an
    /// export's COMMIT, `cairn copy`).
    #[arg(long, value_enum)]
    pub dedup: Option<DedupArg>,
}

#[derive(Debug, Args)]
pub struct GcArgs {
    /// The exact pass: mark from every live version and sweep everything else. Removes what
    /// fast deletion leaked, packs of crashed commits, and dead data in packs not worth
    /// repacking; merges the index files. Run it now and then (e.g. weekly).
    #[arg(long)]
    pub repair: bool,
    /// Report what would be reclaimed; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Repack packs whose live fraction (by bytes) is below this.
    #[arg(long, default_value_t = 0.97)]
    pub repack_threshold: f64,
    /// Leave small packs as they are. By default (format 2) GC also merges packs below a
    /// quarter of the pack target, live or not, into full ones, up to four packs' worth a
    /// run, once they fill half a pack or number 32: each commit of a few changed blocks
    /// writes a pack of its own, and after hundreds of them an image's data lies in as many
    /// packs, which commits, restores, exports and GC then each read.
    #[arg(long, conflicts_with = "repack_small")]
    pub no_repack_small: bool,
    /// Merge small packs (the default; kept for scripts that ask for it).
    #[arg(long, hide = true)]
    pub repack_small: bool,
    /// Seconds without a heartbeat after which another process's session counts as dead.
    #[arg(long, default_value_t = 600, env = "CAIRN_SESSION_STALE_SECS")]
    pub stale_after: u64,
    /// Give up (deleting nothing) after waiting this many seconds for older sessions.
    #[arg(long, default_value_t = 3600)]
    pub wait_limit: u64,
    /// Cold recompression: compress the data GC keeps again at this zstd level (19 stores
    /// ~8% less than the default 3, for ~60x its CPU), copying every pack whose groups
    /// shrink; versions are unchanged (a group keeps its id). Runs the exact pass. Commits
    /// after it compress at the repository's level until the next run.
    #[arg(long, value_name = "LEVEL", value_parser = clap::value_parser!(i32).range(1..=22))]
    pub recompress: Option<i32>,
}

#[derive(Debug, Args)]
pub struct IndexArgs {
    #[command(subcommand)]
    pub action: IndexAction,
}

#[derive(Debug, Subcommand)]
pub enum IndexAction {
    /// Merge index runs: each tier of eight runs of a size into one (--all: every run).
    Compact(IndexCompactArgs),
}

#[derive(Debug, Args)]
pub struct IndexCompactArgs {
    /// Merge every run into one, not only the full tiers.
    #[arg(long)]
    pub all: bool,
    /// Report what would be merged; change nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Seconds without a heartbeat after which another process's session counts as dead.
    #[arg(long, default_value_t = 600, env = "CAIRN_SESSION_STALE_SECS")]
    pub stale_after: u64,
    /// Give up (deleting nothing; the merged runs stay, harmlessly, next to their inputs)
    /// after waiting this many seconds for older sessions.
    #[arg(long, default_value_t = 3600)]
    pub wait_limit: u64,
}

#[derive(Debug, Args)]
pub struct LogArgs {
    /// Image name.
    pub image: String,
}

#[derive(Debug, Args)]
pub struct ShowArgs {
    /// IMAGE, IMAGE@N (N-th version), or IMAGE@HEX (id prefix).
    #[arg(value_name = "VERSION")]
    pub spec: String,
}

#[derive(Debug, Args)]
pub struct RestoreArgs {
    /// IMAGE, IMAGE@N (N-th version), or IMAGE@HEX (id prefix).
    #[arg(value_name = "VERSION")]
    pub spec: String,
    /// Output file, block device, or `-` for stdout.
    pub output: PathBuf,
    /// Output format: raw (sparse file, device or stdout) or qcow2 (a compact qcow2 v3 file
    /// whose clusters without data stay unallocated). Default: qcow2 when OUTPUT's name ends
    /// in .qcow2, raw otherwise.
    #[arg(long, value_enum)]
    pub format: Option<OutputFormatArg>,
    /// Replace an existing OUTPUT file, or overwrite a block device.
    #[arg(short, long)]
    pub force: bool,
    /// Restore what is readable of a damaged version: ranges whose data or manifest is
    /// damaged or missing are written as zeros and listed; the exit status is then 3.
    #[arg(long)]
    pub allow_damage: bool,
    /// Turn OUTPUT, an existing raw image file or block device, into the version by writing
    /// only what differs, where it is (its owner, mode and labels stay). When cairn
    /// committed or restored OUTPUT as a version and it has not changed since, what differs
    /// comes from the two versions' trees and OUTPUT is not read; otherwise OUTPUT is read
    /// and compared segment by segment. An interrupted run leaves a marker: OUTPUT is then
    /// taken for no version (commit refuses it) until the same command is run again.
    #[arg(long, conflicts_with_all = ["force", "allow_damage"])]
    pub in_place: bool,
    /// With --in-place: make a regular file of another size the version's size (truncated
    /// or extended) instead of refusing it.
    #[arg(long, requires = "in_place")]
    pub resize: bool,
    /// With --in-place: read and compare OUTPUT even where cairn knows which version it
    /// holds.
    #[arg(long, requires = "in_place")]
    pub compare: bool,
    /// A local image (raw or qcow2: an older restore, a golden image, another VM's disk)
    /// whose blocks are taken where they are the version's, so only the rest is fetched;
    /// repeat it for several, tried in order. Blocks are looked for at the same offset, and
    /// each one taken is checked by its id. A seed that cannot be read is left out with a
    /// warning.
    #[arg(long = "seed", value_name = "PATH", conflicts_with_all = ["in_place", "allow_damage"])]
    pub seeds: Vec<PathBuf>,
    /// Write OUTPUT as a qcow2 overlay on BASE, a local image (raw or qcow2): only the
    /// clusters where the version differs from BASE are stored, and its header names BASE
    /// (by its absolute path) as the backing file, so a VM starts from it at once. BASE is
    /// also the first seed. Implies --format qcow2.
    #[arg(long, value_name = "BASE", conflicts_with_all = ["in_place", "allow_damage"])]
    pub backing: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct RepairArgs {
    /// A disk image (raw or qcow2) to take lost chunks and manifest nodes from.
    #[arg(long, value_name = "IMAGE_FILE")]
    pub from: Option<PathBuf>,
    /// Container format of --from (auto: qcow2 if it starts with the qcow2 magic).
    #[arg(long, value_enum, default_value = "auto", requires = "from")]
    pub format: SourceFormatArg,
    /// Report what would be done; change nothing.
    #[arg(short = 'n', long)]
    pub dry_run: bool,
}

#[derive(Debug, Args)]
pub struct RelayoutArgs {
    /// The version to lay out again: IMAGE, IMAGE@N or IMAGE@TAG.
    #[arg(value_name = "IMAGE[@REF]")]
    pub spec: String,
    /// The proportion of the version's data to store again, most scattered first, in the
    /// batches a restore reads together (4 segments, 4 MiB by default): 0 changes nothing, 1
    /// re-stores every batch a restore reads in more requests than its data would take side
    /// by side. Other batches are never re-stored.
    #[arg(long, value_name = "A")]
    pub alpha: f64,
    /// Report what would be re-stored and what it would cost; write nothing.
    #[arg(short = 'n', long)]
    pub dry_run: bool,
}

#[derive(Debug, Args)]
pub struct VerifyArgs {
    /// Check only these versions: IMAGE (all its versions) or IMAGE@REF.
    #[arg(value_name = "IMAGE[@REF]")]
    pub targets: Vec<String>,
    /// Read only a subset of the packs in full: N% (a random sample) or K/N (part K of N).
    #[arg(long, value_name = "N%|K/N")]
    pub read_data_subset: Option<String>,
}

#[derive(Debug, Args)]
pub struct DiffArgs {
    /// The older version: IMAGE, IMAGE@N, or IMAGE@HEX.
    pub a: String,
    /// The newer version: IMAGE, IMAGE@N, or IMAGE@HEX.
    pub b: String,
    /// Only the summary line (with --json: no "ranges").
    #[arg(long)]
    pub stat: bool,
}

#[derive(Debug, Args)]
pub struct CloneArgs {
    /// The version to start from: IMAGE, IMAGE@N, IMAGE@TAG, or IMAGE@HEX.
    pub source: String,
    /// Name of the new image (must not exist yet).
    pub new_image: String,
    /// Message stored with the new version (default: "clone of IMAGE@N").
    #[arg(short, long)]
    pub message: Option<String>,
}

#[derive(Debug, Args)]
pub struct CopyArgs {
    /// The repository to copy from: a directory or s3://BUCKET/PREFIX.
    #[arg(long, value_name = "REPO")]
    pub from: String,
    /// What to copy: IMAGE (all its versions) or IMAGE@REF (one version). None: every
    /// version of every image.
    #[arg(value_name = "IMAGE[@REF]")]
    pub specs: Vec<String>,
    /// Read the source's passphrase from this file (its first line).
    #[arg(
        long,
        env = "CAIRN_FROM_PASSWORD_FILE",
        value_name = "PATH",
        conflicts_with = "from_password_command"
    )]
    pub from_password_file: Option<std::path::PathBuf>,
    /// Run this shell command and use what it prints (first line) as the source's passphrase.
    #[arg(long, env = "CAIRN_FROM_PASSWORD_COMMAND", value_name = "COMMAND")]
    pub from_password_command: Option<String>,
}

#[derive(Debug, Args)]
pub struct TagArgs {
    /// The version to tag: IMAGE (its newest version), IMAGE@N, IMAGE@TAG, or IMAGE@HEX.
    /// With --delete: the IMAGE whose tag to delete.
    #[arg(value_name = "IMAGE[@REF]")]
    pub spec: String,
    /// Tag name: letters, digits, '.', '_', '+', '-'; not only digits (those are version
    /// numbers).
    pub name: String,
    /// Delete the tag NAME of IMAGE instead of creating it (the version stays).
    #[arg(short, long)]
    pub delete: bool,
}

#[derive(Debug, Args)]
pub struct TagsArgs {
    /// Image name.
    pub image: String,
}

#[derive(Debug, Args)]
pub struct RmArgs {
    /// IMAGE@REF (one version: N, TAG or HEX) or IMAGE (the whole image).
    #[arg(required = true, value_name = "IMAGE[@REF]")]
    pub targets: Vec<String>,
    /// Confirm removing whole images (an IMAGE without @): all their versions go.
    #[arg(long)]
    pub yes: bool,
    /// Only record the deletion; leave the space to a later `cairn gc`.
    #[arg(long)]
    pub no_gc: bool,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["image", "all"])))]
pub struct PruneArgs {
    /// The image to prune.
    pub image: Option<String>,
    /// Prune every image, each with the same policy.
    #[arg(long)]
    pub all: bool,
    #[command(flatten)]
    pub keep: KeepArgs,
    /// Show what would be removed, change nothing.
    #[arg(short = 'n', long)]
    pub dry_run: bool,
    /// Only record the deletions; leave the space to a later `cairn gc`.
    #[arg(long)]
    pub no_gc: bool,
}

/// A retention policy's rules (restic's `forget --keep-*`).
#[derive(Debug, Clone, Args)]
pub struct KeepArgs {
    /// Keep the N newest versions.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub keep_last: u32,
    /// Keep the newest version of each of the N most recent hours with a version.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub keep_hourly: u32,
    /// Keep the newest version of each of the N most recent days with a version.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub keep_daily: u32,
    /// Keep the newest version of each of the N most recent ISO weeks with a version.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub keep_weekly: u32,
    /// Keep the newest version of each of the N most recent months with a version.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub keep_monthly: u32,
}

impl KeepArgs {
    pub fn policy(&self) -> cairn_engine::retention::KeepPolicy {
        cairn_engine::retention::KeepPolicy {
            last: self.keep_last,
            hourly: self.keep_hourly,
            daily: self.keep_daily,
            weekly: self.keep_weekly,
            monthly: self.keep_monthly,
        }
    }
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

#[derive(Debug, Args)]
pub struct CompletionsArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: clap_complete::Shell,
}

#[derive(Debug, Args)]
pub struct ManArgs {
    /// Directory to write the pages into (created if missing); without it, cairn(1) is
    /// printed on stdout.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
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

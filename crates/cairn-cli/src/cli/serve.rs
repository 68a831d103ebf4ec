//! Flags of the commands that serve versions: exports, overlays, mounts, guest files, boot profiles.
//!
//! Doc comments here are `--help` text (clap), not rustdoc: brackets in them are shell syntax.
#![allow(rustdoc::broken_intra_doc_links)]

use super::*;

#[derive(Debug, Args)]
pub struct ExportsArgs {
    #[command(subcommand)]
    pub action: Option<ExportsAction>,
}

#[derive(Debug, Subcommand)]
pub enum ExportsAction {
    /// Stop a running export: SIGTERM, then wait until it has flushed its overlay and removed
    /// its files.
    Stop {
        /// The export name.
        name: String,
    },
}

/// How a lazy reader (an export, a mount) caches and reads ahead.
#[derive(Debug, Args)]
pub struct LazyReadArgs {
    /// Chunk cache directory (default: $CAIRN_CACHE_DIR, else ~/.cache/cairn/chunks).
    #[arg(long)]
    pub cache_dir: Option<std::path::PathBuf>,
    /// Chunk cache size limit; least recently used chunks are evicted beyond it.
    #[arg(long, default_value = "10G", value_parser = parse_size)]
    pub cache_size: u64,
    /// Chunks fetched ahead after a read that missed the cache (default 8). On format 2 it
    /// counts compressed groups and defaults to 0: a miss already fetches a whole group, and
    /// more read-ahead fetched more than the guest read in a measured cold boot
    /// (BENCHMARKS.md, *Lazy deployment over NBD*).
    #[arg(long)]
    pub readahead: Option<usize>,
}

#[derive(Debug, Args)]
pub struct MountArgs {
    /// An existing, empty directory.
    pub mountpoint: std::path::PathBuf,
    #[command(flatten)]
    pub cache: LazyReadArgs,
    /// Let other users read the mount (FUSE's allow_other; without root it needs
    /// user_allow_other in /etc/fuse.conf). By default only you can.
    #[arg(long)]
    pub allow_other: bool,
}

#[derive(Debug, Args)]
pub struct GuestArgs {
    /// IMAGE[@N|@TAG|@HEX]:/path/in/the/guest
    #[arg(value_name = "SPEC")]
    pub spec: String,
    /// The partition holding the file system (1-based, as /dev/sdaN), when the image has more
    /// than one ext file system.
    #[arg(long, value_name = "N")]
    pub partition: Option<u32>,
}

#[derive(Debug, Args)]
pub struct ExportArgs {
    /// IMAGE, IMAGE@N, IMAGE@TAG or IMAGE@HEX; several may be served by one process, each
    /// as VERSION=NAME (the export name; default: the image name).
    #[arg(value_name = "VERSION[=NAME]", required = true)]
    pub specs: Vec<String>,
    /// The NBD export name of a single VERSION (default: the image name).
    #[arg(long)]
    pub name: Option<String>,
    /// Unix socket to listen on.
    #[arg(long, conflicts_with_all = ["listen", "stdio"])]
    pub socket: Option<std::path::PathBuf>,
    /// TCP address to listen on, e.g. 127.0.0.1:10809.
    #[arg(long, conflicts_with = "stdio")]
    pub listen: Option<String>,
    /// Serve a single connection on stdin/stdout (or a socket-activated one).
    #[arg(long)]
    pub stdio: bool,
    #[command(flatten)]
    pub cache: LazyReadArgs,
    /// A local image (raw or qcow2: a golden image, an older restore, another VM's disk)
    /// whose blocks are served where they are the version's, so only the rest is fetched;
    /// repeat it for several, tried in order. Blocks are looked for at the same offset, and
    /// each one served is checked by its id. A seed that cannot be read is left out with a
    /// warning.
    #[arg(long = "seed", value_name = "PATH")]
    pub seeds: Vec<std::path::PathBuf>,
    /// Also record the client's first reads as a boot profile in the file PATH (written
    /// 0600 when the recording is over or the export stops), for --profile elsewhere.
    #[arg(long, value_name = "PATH")]
    pub record_profile: Option<std::path::PathBuf>,
    /// Fetch ahead the reads of the boot profile in the file PATH instead of the image's
    /// stored profile. A profile recorded for another image or size is ignored with a
    /// warning.
    #[arg(long, value_name = "PATH")]
    pub profile: Option<std::path::PathBuf>,
    /// Record this export's first reads as the image's boot profile, replacing the stored
    /// one (which is then not fetched ahead): after the guest's boot changed.
    #[arg(long, conflicts_with = "no_profile")]
    pub new_profile: bool,
    /// Neither fetch the image's stored boot profile ahead nor record one.
    #[arg(long)]
    pub no_profile: bool,
    /// Write the export's counters as JSON to this file every second (and at exit).
    #[arg(long)]
    pub stats_file: Option<std::path::PathBuf>,
    /// Accept writes, into a local overlay (chunk-sized blocks, durable on flush). Commit them
    /// with `cairn commit IMAGE --from-export NAME`.
    #[arg(long)]
    pub writable: bool,
    /// The overlay directory (default: $XDG_STATE_HOME/cairn/overlays/NAME). An overlay left by
    /// an earlier run on the same version is reopened with its flushed writes; an empty one
    /// is moved onto the version served.
    #[arg(long, requires = "writable")]
    pub overlay: Option<std::path::PathBuf>,
    /// Copy-on-demand (iROW): a block the guest reads from DEPTH or more overlay snapshots
    /// below its current state is copied into the current layer, so later reads and deletions
    /// of those snapshots no longer depend on them. Costs overlay space; off by default.
    #[arg(long, value_name = "DEPTH", requires = "writable", value_parser = clap::value_parser!(u16).range(1..))]
    pub copy_on_read: Option<u16>,
    /// Serve only over TLS, with this certificate (PEM; the chain may follow it).
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<std::path::PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<std::path::PathBuf>,
    /// Require client certificates signed by this CA (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_ca: Option<std::path::PathBuf>,
    /// Serve only over TLS with the files of a directory laid out for QEMU's
    /// tls-creds-x509: server-cert.pem, server-key.pem, and ca-cert.pem, which (when present)
    /// makes client certificates signed by it required, as QEMU's verify-peer default does.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["tls_cert", "tls_key", "tls_ca"])]
    pub tls_dir: Option<std::path::PathBuf>,
    /// Allow a writable export on a TCP address without TLS client certificates (anyone
    /// who reaches the address — every local user, on loopback — can then read and
    /// overwrite the disk).
    #[arg(long)]
    pub insecure: bool,
}

#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The export name.
    pub name: String,
}

#[derive(Debug, Args)]
pub struct OverlayArgs {
    #[command(subcommand)]
    pub action: OverlayAction,
}

#[derive(Debug, Subcommand)]
pub enum OverlayAction {
    /// Freeze the overlay's writes so far under NAME (O(1): no data is copied).
    Snapshot { export: String, name: String },
    /// Make the disk what it was at snapshot NAME, discarding the writes since the last
    /// snapshot. Snapshots form a tree: those taken after NAME stay, on a branch you can roll
    /// back to later. Refused while an NBD client is connected unless --force.
    Rollback {
        export: String,
        name: String,
        /// Roll back under connected clients (a running guest must then be restarted before
        /// it writes more: its caches still hold the disk it saw).
        #[arg(long)]
        force: bool,
    },
    /// Delete snapshot NAME; what later snapshots and the disk show stays the same (it is only
    /// marked while others read through it; what they all hide is freed at once).
    Delete { export: String, name: String },
    /// List a running export's snapshots, oldest first; without EXPORT, list the overlays
    /// under the default overlay root ($XDG_STATE_HOME/cairn/overlays): base version, size
    /// held, snapshots, and the export that holds each.
    List { export: Option<String> },
    /// Delete an overlay that no running export holds: its writes are lost. NAME is an export
    /// name (its overlay under the default root) or an overlay directory path.
    Discard {
        name: String,
        /// Really delete it.
        #[arg(long)]
        yes: bool,
    },
}

#[derive(Debug, Args)]
pub struct ProfileArgs {
    #[command(subcommand)]
    pub action: ProfileAction,
}

#[derive(Debug, Subcommand)]
pub enum ProfileAction {
    /// The images that have a boot profile, with its reads and bytes.
    List,
    /// One image's boot profile: its reads and bytes (--json: the profile itself, a file
    /// `cairn export --profile` and `cairn profile set` read).
    Show { image: String },
    /// Store the profile file PATH (from --record-profile or `show --json`) as IMAGE's,
    /// replacing the stored one. It must be recorded for IMAGE and its newest version's size.
    Set {
        image: String,
        #[arg(value_name = "PATH")]
        path: std::path::PathBuf,
    },
    /// Remove an image's boot profile: its exports fetch nothing ahead until the next one
    /// records a new profile.
    Rm { image: String },
}

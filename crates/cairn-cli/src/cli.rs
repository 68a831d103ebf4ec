//! Command-line flags, as typed. Resolution into settings happens in the commands.
//!
//! Doc comments here are `--help` text (clap), not rustdoc: brackets in them are shell syntax.
#![allow(rustdoc::broken_intra_doc_links)]

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// Version control and lazy deployment for virtual-machine disk images.
///
/// Every commit of a disk image becomes a cheap, deduplicated, immutable version that can be
/// restored bit-exact or served to a VM at once over NBD (`cairn export`). Start with
/// `cairn init`, then `cairn commit IMAGE disk.raw`.
#[derive(Debug, Parser)]
#[command(
    name = "cairn",
    version,
    propagate_version = true,
    max_term_width = 100
)]
pub struct Cli {
    /// Repository location: a directory path, or `s3://BUCKET/PREFIX` (settings as URL query:
    /// `?endpoint=URL&region=R&path_style=true`; credentials from `AWS_*` variables).
    #[arg(long, global = true, env = "CAIRN_REPO", value_name = "PATH")]
    pub repo: Option<String>,

    /// Local cache of index files and manifest nodes, so repeated commands on a remote (S3)
    /// repository download only what is new. Default: ~/.cache/cairn/meta for s3:// repositories
    /// ($CAIRN_META_CACHE_DIR or $XDG_CACHE_HOME move it), none for local ones; `off` disables it.
    #[arg(long, global = true, env = "CAIRN_META_CACHE", value_name = "DIR|off")]
    pub meta_cache: Option<String>,

    /// Memory for the format 2 index, in MiB (default 32). The run filters get it whole
    /// (32 MiB: about 20 million entries, 75 GiB of unique data), the pack trailer cache a
    /// quarter (a sixteenth in `commit`, whose workers hold the trailers they use) and the
    /// index piece cache a sixteenth. Past the filter budget the largest runs are
    /// asked through their fence keys, one cached section read a lookup: bounded dedup,
    /// which asks the index a few times a changed segment, barely notices; exact dedup and
    /// verify slow down. Fleet hosts: 16 keeps dedup and holds ~60 MiB.
    #[arg(long, global = true, env = "CAIRN_INDEX_MEMORY", value_name = "MIB")]
    pub index_memory: Option<u64>,

    /// Print machine-readable JSON on stdout instead of text.
    #[arg(long, global = true)]
    pub json: bool,

    /// More log output on stderr (-v info, -vv debug). CAIRN_LOG overrides.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    pub verbose: u8,

    /// No progress bars.
    #[arg(short, long, global = true)]
    pub quiet: bool,

    /// Read an encrypted repository's passphrase from this file (its first line). Without
    /// it: --password-command, then $CAIRN_PASSWORD, then a prompt at the terminal. Never
    /// put a passphrase itself on the command line.
    #[arg(
        long,
        global = true,
        env = "CAIRN_PASSWORD_FILE",
        value_name = "PATH",
        conflicts_with = "password_command"
    )]
    pub password_file: Option<std::path::PathBuf>,

    /// Run this shell command and use what it prints (first line) as the passphrase, e.g.
    /// `pass show backup/cairn` or `secret-tool lookup cairn repo`.
    #[arg(
        long,
        global = true,
        env = "CAIRN_PASSWORD_COMMAND",
        value_name = "COMMAND"
    )]
    pub password_command: Option<String>,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Create a new, empty repository at --repo.
    Init(InitArgs),
    /// Store the current content of a disk image as a new version of IMAGE.
    ///
    /// SOURCE is a raw image file, a qcow2 image (v2/v3, compressed and zero clusters,
    /// backing chains), a block device, an NBD export (`nbd://HOST[:PORT]/EXPORT`,
    /// `nbd+unix:///EXPORT?socket=PATH`: any disk QEMU opens — vmdk, vhdx, vdi… — via qemu-nbd
    /// or qemu-storage-daemon), or `-` for standard input. Only allocated data is read
    /// (holes, zero and unallocated clusters, NBD holes never are), and only chunks the
    /// repository does not hold yet are stored.
    ///
    /// Incremental commits read only what changed since a parent version:
    ///   - a qcow2 overlay whose backing file cairn committed or restored earlier (found
    ///     automatically), or any overlay with --parent: only the overlay's own clusters;
    ///   - an NBD export with --dirty-bitmap NAME: only the extents QEMU's dirty bitmap marks.
    ///
    /// Scans are polite to a live host: pages the scan brings into the page cache are dropped
    /// again (--keep-cache to keep them), --rate-limit caps the read rate, --direct bypasses
    /// the page cache.
    ///
    /// Examples:
    ///   cairn commit web01/disk0 /var/lib/libvirt/images/web01.qcow2
    ///   cairn commit web01/disk0 web01-overlay.qcow2 --parent web01/disk0@7
    ///   cairn commit web01/disk0 'nbd+unix:///disk0?socket=/run/qsd.sock' --dirty-bitmap b0
    #[command(verbatim_doc_comment)]
    Commit(CommitArgs),
    /// List the versions of an image, newest first.
    Log(LogArgs),
    /// Start a new image from an existing version, instantly.
    ///
    /// NEWIMAGE's first version is SOURCE's content: one new version record pointing at the
    /// same manifest, with no data copied, so cloning a 1 TiB image takes as long as cloning
    /// a 1 MiB one. The two images then evolve independently and share every unchanged chunk.
    /// `cairn log NEWIMAGE` shows where it was cloned from.
    ///
    /// Example: cairn clone base/debian12@v1.0 web01/disk0
    Clone(CloneArgs),
    /// Copy versions from another repository into this one (--repo).
    ///
    /// Copies between any two repositories: local and S3, format 1 and format 2, plain and
    /// encrypted (the way to move a repository to a new format or a new master key). Images,
    /// the order of their versions, times, messages and tags are kept; only what changed
    /// between a version and the one before it is read from the source, and the destination
    /// stores only what it lacks. Version numbers are the destination's: each image's
    /// versions are numbered in order there, so vm@3 copied alone becomes vm@1 (the output
    /// pairs each source number with its new one). A version is copied once: its copy is
    /// the version of the same image with the same time, size and message, so a second run
    /// copies nothing and an interrupted one resumes. A tag the destination already has for another version is
    /// left as it is, and reported.
    ///
    /// The source's passphrase (if it is encrypted): --from-password-file,
    /// --from-password-command, $CAIRN_FROM_PASSWORD, or a prompt at the terminal; the
    /// destination's as for any command.
    ///
    /// Examples:
    ///   cairn --repo s3://backups/cairn copy --from /var/lib/cairn
    ///   cairn --repo /srv/cairn-v2 copy --from /srv/cairn web01/disk0 base/debian12@v1.0
    #[command(verbatim_doc_comment)]
    Copy(CopyArgs),
    /// Name a version, or delete a name (--delete).
    ///
    /// A tag is a name for one version of an image; `IMAGE@NAME` then works wherever a version
    /// is expected (restore, show, diff, clone). Tags never move: to point a name elsewhere,
    /// delete it and tag again. A tagged version cannot be removed by `rm` or `prune`, and its
    /// data is kept by `gc`.
    ///
    /// Examples: cairn tag vm@3 v1.0 · cairn tag vm before-upgrade · cairn tag --delete vm v1.0
    Tag(TagArgs),
    /// List the tags of an image.
    Tags(TagsArgs),
    /// Remove versions (IMAGE@REF) or whole images (IMAGE).
    ///
    /// A removed version can no longer be restored or named, and disappears from `log`; the
    /// other versions of the image are unaffected. IMAGE without @ removes the whole image,
    /// every version of it, and asks for --yes. A tagged version is refused, alone or in a
    /// whole image (delete the tag first). Nothing is changed unless every argument can be
    /// removed. The space only they used is then freed at once (fast deletion, as `cairn gc`);
    /// data still used by clones or other versions is kept. --no-gc only records the deletion.
    ///
    /// Examples: cairn rm vm@2 vm@3 · cairn rm old-vm --yes
    Rm(RmArgs),
    /// Remove the versions a retention policy does not keep.
    ///
    /// Versions are taken newest first. --keep-last N keeps the N newest; --keep-hourly,
    /// --keep-daily, --keep-weekly and --keep-monthly N keep the newest version of each of the
    /// N most recent hours, days, ISO weeks or months (UTC) that have a version. A version kept
    /// by any rule is kept; tagged versions are always kept. Every version is listed with
    /// `keep` or `remove` and the reasons. Try --dry-run first. The space of the removed
    /// versions is freed at once, as by `cairn gc` (--no-gc: only record the deletions).
    ///
    /// Example: cairn prune --all --keep-last 3 --keep-daily 7 --keep-weekly 4 --keep-monthly 12
    Prune(PruneArgs),
    /// List the images in the repository.
    Images,
    /// Show one version in detail.
    Show(ShowArgs),
    /// Write a version out as a raw or qcow2 image, bit-exact.
    ///
    /// OUTPUT is a new file (written aside and put in place only when complete; zero runs
    /// become holes), a block device (every byte written, zeros too), or `-` for standard
    /// output. With --format qcow2 the file is a compact qcow2 v3 image: clusters without data
    /// stay unallocated, so it is as small as the version's data and QEMU can boot it directly.
    ///
    /// Nothing is overwritten by surprise: an existing file or a block device needs --force;
    /// a device that is mounted or in use, and a file another process holds locked (QEMU locks
    /// a running VM's images), are refused even then; character devices, FIFOs, sockets and
    /// directories are refused (write to `-` and redirect instead).
    ///
    /// Restoring need not move every byte. --in-place rewrites an existing image or device
    /// where it is, writing only what differs; --seed takes blocks from local images that
    /// already hold them; --backing writes a qcow2 overlay on a local base holding only the
    /// clusters that differ from it.
    ///
    /// Examples:
    ///   cairn restore web01/disk0@7 web01.raw
    ///   cairn restore web01/disk0 web01.qcow2 --format qcow2
    ///   cairn restore web01/disk0 /dev/vg0/web01 --force
    ///   cairn restore web01/disk0@5 /var/lib/libvirt/images/web01.raw --in-place
    ///   cairn restore web01/disk0@7 new.raw --seed old-web01.raw
    ///   cairn restore web01/disk0@7 web01.qcow2 --backing golden.raw
    #[command(verbatim_doc_comment)]
    Restore(RestoreArgs),
    /// Show the byte ranges where two versions may differ.
    ///
    /// A and B are IMAGE, IMAGE@N or IMAGE@HEX (they may name different images). A range is
    /// changed where the chunks covering it differ between A and B: a different chunk, or a
    /// chunk on one side and zeros on the other. Zeros on both sides never count, including
    /// beyond the end of the smaller image. The granularity is the chunk: a rewritten chunk is
    /// reported whole. Unchanged subtrees of the manifest are skipped without being read, so
    /// the cost is proportional to the change, not to the size of the image.
    Diff(DiffArgs),
    /// Re-read every object and report damage and the versions it affects.
    ///
    /// Without arguments the whole repository is checked: every pack is read in full, every
    /// version record, head and tag, and the manifest of every live version. With IMAGE or
    /// IMAGE@REF only those versions and the blobs they use are checked. --read-data-subset
    /// reads only some packs (metadata is always checked whole): `5%` a random sample, `2/7`
    /// the second of seven parts (run 1/7 … 7/7 on successive days to cover everything).
    ///
    /// A damaged copy of a blob is quarantined: no commit deduplicates against it any more,
    /// so the next commit that meets its content stores it again, which heals every version
    /// that uses it (or use `cairn repair --from IMAGE_FILE`).
    ///
    /// Exit status 0 when everything is intact, 3 when damage was found.
    #[command(verbatim_doc_comment)]
    Verify(VerifyArgs),
    /// Repository-wide figures: logical size, stored size, dedup ratio.
    ///
    /// With IMAGE[@REF], where that version's data lies instead: the groups a restore of it
    /// reads, the packs they are in, and the ranged reads a restore makes for them (groups of
    /// one pack near each other share one), per GiB of data: its fragmentation, each read a
    /// seek on a disk or a request on S3. A version whose blocks many commits stored takes
    /// more reads than one committed whole.
    Stats {
        /// The version (IMAGE, IMAGE@N, IMAGE@TAG); none: the whole repository.
        #[arg(value_name = "IMAGE[@REF]")]
        spec: Option<String>,
    },
    /// Rebuild what damage left behind, and say exactly what stays lost.
    ///
    /// Sets aside version records that cannot be read and rebuilds the heads that named them
    /// (from the newest intact version of the image); sets aside unreadable tags; rebuilds
    /// the index from the packs' own trailers where index files are damaged; rebuilds missing
    /// or damaged reference summaries. With --from, reads a disk image (the disk a damaged
    /// version was committed from, or a copy) and stores again every chunk and manifest node
    /// that live versions need and no readable copy holds — one good copy heals every version
    /// that uses it. Damaged objects are moved under `damaged/` in the repository, never
    /// deleted. Exit status 0 when every live version can be restored intact afterwards, 3
    /// when some data stays lost (listed).
    ///
    /// Examples: cairn repair · cairn repair --from /var/lib/libvirt/images/web01.raw
    #[command(verbatim_doc_comment)]
    Repair(RepairArgs),
    /// Reclaim the space of deleted versions and of data no version uses any more.
    ///
    /// By default, fast deletion: the data of versions deleted since the last gc is freed
    /// unless the reference summary of some live version lists it (format 2: the exact slots
    /// of each group a version uses; format 1: a Bloom filter, whose false positives leave a
    /// little dead data behind, well under 0.1% with the default 24 bits per chunk). It reads
    /// the summaries and, on format 2, every pack's trailer — never a pack's data, except
    /// to repack. --repair runs the exact pass: marks every blob that a live version (image
    /// heads, tags and their histories, minus deleted versions) uses and sweeps the rest,
    /// including leaks and packs of crashed commits, and merges the index files.
    ///
    /// Both delete packs with nothing live and repack packs whose live fraction is below
    /// --repack-threshold, reading only metadata except the packs they repack. Safe while other
    /// processes commit: gc publishes its plan and waits for older sessions before deleting.
    Gc(GcArgs),
    /// The index of a format 2 repository: `index compact` merges its runs.
    ///
    /// Every commit writes one index run (where its chunks are), and every lookup asks each
    /// run's filter, so lookups slow down as runs accumulate. `cairn index compact` merges
    /// them in tiers (eight runs of a size into one eight times larger), so N commits leave
    /// O(log N) runs; --all merges every run into one. It reads and writes only index runs
    /// (about 1% of the stored bytes), never a pack. Safe while other processes commit: it
    /// takes the gc lock, publishes a plan and waits for older sessions before deleting the
    /// runs it merged. `cairn gc` merges every run too, when it has deleted something.
    ///
    /// Examples: cairn index compact · cairn index compact --all --json
    #[command(verbatim_doc_comment)]
    Index(IndexArgs),
    /// Serve a version over NBD at once; its data is fetched on demand.
    ///
    /// QEMU or any NBD client sees a plain raw disk (`qemu-system-x86_64 -drive
    /// file=nbd+unix:///NAME?socket=PATH,format=raw`). A chunk is fetched from the repository
    /// the first time it is read (plus the next --readahead chunks) and kept in the host-wide
    /// chunk cache, shared by every export on the host: VMs booting from versions or images
    /// that share data fetch each shared chunk once. Zero ranges are never fetched, and
    /// block status reports them, so `qemu-img convert` and `nbdcopy` skip them.
    ///
    /// Listens on a Unix socket (--socket; the default is NAME.sock in the run directory,
    /// `$XDG_RUNTIME_DIR/cairn` or `$TMPDIR/cairn-UID`, which must be 0700 and yours), on TCP
    /// (--listen HOST:PORT), or serves one connection on stdin (--stdio; also
    /// socket-activated, as `nbdinfo [ cairn export ... ]` starts it). A socket or export name
    /// that a running export holds is refused. With --json, prints one JSON object per export
    /// (name, uri, version, pid) once it serves.
    ///
    /// Runs until SIGTERM or SIGINT (or `cairn exports stop NAME`): then it stops accepting,
    /// flushes the overlay, removes its sockets and state file and exits 0. Under systemd
    /// (`Type=notify`) it reports READY=1 once it serves and STOPPING=1 when it stops.
    ///
    /// TLS (clients use nbds:// URIs): --tls-cert/--tls-key (and --tls-ca to require client
    /// certificates), or --tls-dir with QEMU's file names. Once TLS is configured every client
    /// must start TLS first. X.509 only: TLS with pre-shared keys is not supported (rustls
    /// has no external PSK). A writable export on a TCP address (loopback included) needs TLS
    /// with client certificates or --insecure.
    ///
    /// Examples: cairn export web01/disk0@before-upgrade --socket /tmp/web.sock
    ///           cairn export golden@3=base web01/disk0=web --listen 127.0.0.1:10809
    ///           cairn export vm --writable --listen 0.0.0.0:10809 --tls-dir /etc/pki/qemu
    ///           cairn export web01/disk0@7 --seed /var/lib/images/golden.raw --socket /tmp/w.sock
    ///           cairn export web01/disk0@9 --profile web01.boot.json --socket /tmp/w.sock
    ///
    /// Boot profiles: an export of one version records the order of the client's first
    /// reads (120 s from its first read, each byte once, at most 1 GiB) as the image's boot
    /// profile, stored in the repository, when the image has none; every later export of
    /// the image fetches those reads into the cache at once, in order, several at a time,
    /// ahead of the guest. --new-profile records anew, --no-profile does neither, and
    /// `cairn profile` shows, stores and removes profiles.
    Export(ExportArgs),
    /// The exports running on this host (`cairn exports`), or stop one (`exports stop NAME`).
    ///
    /// Lists name, version, pid, address and overlay of every running export of this user
    /// (state files in the run directory; those of exports that died are removed).
    Exports(ExportsArgs),
    /// Counters of a running export: bytes read and fetched, cache hits, overlay contents.
    Status(StatusArgs),
    /// Overlays: snapshots of a running export's overlay (iROW layers: snapshot, rollback,
    /// delete, list EXPORT), and overlays on disk (list, discard).
    Overlay(OverlayArgs),
    /// Every version as a file: a read-only FUSE mount with a directory per image.
    ///
    /// MOUNTPOINT (an existing, empty directory) shows IMAGE/@N.raw for each live version,
    /// IMAGE/@TAG.raw for each tag and IMAGE/latest.raw for the newest (an image named
    /// web01/disk0 is the directory web01/disk0). A file reads lazily through the same
    /// verified reader and host-wide chunk cache as `cairn export`: opening a 100 GiB version
    /// reads its metadata only, and only the blocks read are fetched. Commits, tags and
    /// deletions show up within a second; a file already open keeps reading its version.
    ///
    /// Runs in the foreground until SIGINT or SIGTERM, then unmounts. A mount in use (an open
    /// file, a loop device, a shell inside it) stays mounted with a note saying so; a second
    /// signal detaches it and serves the open files until they close.
    ///
    /// Files inside a guest: loop-mount a version read-only (as root), e.g.
    ///   mount -o ro,loop,noload /mnt/cairn/web01/disk0/@7.raw /mnt/web01   (a bare file system)
    ///   losetup -r -P --show -f /mnt/cairn/web01/disk0/@7.raw   (partitioned: then mount
    ///   /dev/loopNp1 -o ro)
    /// or, for ext2/3/4 without any mount, `cairn ls` and `cairn cat IMAGE@V:/path`.
    ///
    /// Examples:
    ///   cairn mount /mnt/cairn
    ///   cmp /mnt/cairn/web01/disk0/@5.raw /mnt/cairn/web01/disk0/latest.raw
    #[command(verbatim_doc_comment)]
    Mount(MountArgs),
    /// List a directory inside a version's guest file system (ext2/3/4), without a mount.
    ///
    /// SPEC is IMAGE[@N|@TAG|@HEX]:/path. The file system is the whole image, or the only
    /// ext partition of its GPT or MBR table (--partition N to choose). Only the blocks read
    /// are fetched. A file or symlink is shown as one entry.
    ///
    /// Examples:
    ///   cairn ls web01/disk0@7:/etc
    ///   cairn ls web01/disk0:/var/log --json
    #[command(verbatim_doc_comment)]
    Ls(GuestArgs),
    /// Write a file from inside a version's guest file system (ext2/3/4) to standard output.
    ///
    /// SPEC is IMAGE[@N|@TAG|@HEX]:/path; symlinks are followed. Only the file's blocks (and
    /// the metadata leading to it) are fetched.
    ///
    /// Examples:
    ///   cairn cat web01/disk0@7:/etc/fstab
    ///   cairn cat web01/disk0@before-upgrade:/var/lib/app/db.sqlite > db.sqlite
    #[command(verbatim_doc_comment)]
    Cat(GuestArgs),
    /// Whole VMs: back up every disk of a running VM at one point in time, list and show
    /// VM versions.
    ///
    /// A VM version binds one version of each disk (each disk is an image of its own,
    /// VM/DISK, so restore, export, clone, verify and copy work on it as on any image), the
    /// VM's configuration (its QEMU command line) and how consistent the point in time is.
    ///
    /// Examples:
    ///   cairn vm backup web01 --qmp /run/web01.qmp --guest-agent /run/web01.qga
    ///   cairn vm backup web02 --domain web02
    ///   cairn vm log web01
    ///   cairn vm show web01@3
    ///   cairn restore web01/disk0@5 disk0.raw      # one disk of it, as any image
    #[command(verbatim_doc_comment)]
    Vm(VmArgs),
    /// Boot profiles: the reads an export recorded from a guest's boot, fetched ahead by
    /// the image's next exports (see `cairn export --help`).
    ///
    /// Examples: cairn profile list
    ///           cairn profile show web01/disk0
    ///           cairn profile show web01/disk0 --json > web01.boot.json
    ///           cairn profile set web01/disk0 web01.boot.json
    ///           cairn profile rm web01/disk0
    #[command(verbatim_doc_comment)]
    Profile(ProfileArgs),
    /// Manage the passphrases of an encrypted repository (`cairn init --encrypt`).
    ///
    /// Each passphrase opens a key slot holding the repository's master key (wrapped with
    /// Argon2id); any one slot opens the repository. New passphrases come from
    /// --new-password-file, $CAIRN_NEW_PASSWORD, or are asked twice at the terminal.
    ///
    /// Examples: cairn key list · cairn key add · cairn key passwd · cairn key remove 3f2a9c
    Key(KeyArgs),
    /// Print a shell completion script.
    ///
    /// Install for bash: cairn completions bash > /etc/bash_completion.d/cairn
    /// zsh: cairn completions zsh > "${fpath[1]}/_cairn"   fish: cairn completions fish >
    /// ~/.config/fish/completions/cairn.fish
    #[command(verbatim_doc_comment)]
    Completions(CompletionsArgs),
    /// Write man pages: cairn(1) and one per command (cairn-commit(1), ...).
    ///
    /// Example: cairn man --dir /usr/local/share/man/man1 && man cairn-commit
    Man(ManArgs),
}

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
    /// Discard every write made after snapshot NAME.
    Rollback { export: String, name: String },
    /// Delete snapshot NAME, keeping its writes (merged into the next layer).
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
pub struct VmArgs {
    #[command(subcommand)]
    pub action: VmAction,
}

#[derive(Debug, Subcommand)]
pub enum VmAction {
    /// Back up a running VM: every writable disk at one point in time, incrementally.
    ///
    /// Through a QEMU's QMP socket (--qmp, `-qmp unix:PATH,server,wait=off`) or a libvirt
    /// domain (--domain, libvirt's backup API in pull mode with checkpoints): the guest's file
    /// systems are frozen through the guest agent when it answers (within --agent-timeout;
    /// otherwise the backup goes on crash-consistent, and says so), one QMP transaction (or
    /// libvirt backup job) takes the point in time across every disk and starts a checkpoint,
    /// the guest is thawed at once, and each disk is read over NBD from that point in time
    /// while the VM keeps running: only the blocks written since the last backup's
    /// checkpoint, or the whole disk on the first backup or when the checkpoint is gone (the
    /// hypervisor restarted with a raw disk, a crash left it inconsistent: said, with why).
    /// The disks are committed as images VM/DISK (DISK: the drive or device id), then the VM
    /// version is published: all or nothing. A failed or killed backup commits no VM version,
    /// leaves the VM running and thawed, and the next backup removes what it left in QEMU and
    /// still reads every change since the last published version.
    ///
    /// Scratch images (one per disk, holding the data the guest overwrites during the
    /// backup) go to --scratch-dir; QEMU must be able to open them.
    ///
    /// Several VMs in one run (--qmp VM=PATH repeated, --domain repeated, or --all: every
    /// running libvirt domain) are backed up one after the other, each at its own point in
    /// time; each commit deduplicates against the VMs before it, so VMs cloned from one image
    /// and updated alike store each new block once. A VM that fails is named and the others
    /// go on; the exit status is then 1.
    ///
    /// Examples: cairn vm backup web01 --qmp /run/web01.qmp --guest-agent /run/web01.qga
    ///           cairn vm backup --all --connect qemu:///system
    #[command(verbatim_doc_comment)]
    Backup(VmBackupArgs),
    /// List the versions of a VM, newest first.
    Log { vm: String },
    /// Show one VM version (VM or VM@N): its disks, their versions, the freeze, the config.
    Show {
        /// VM or VM@N.
        #[arg(value_name = "VM[@N]")]
        spec: String,
        /// Also print the recorded configuration (the QEMU command line).
        #[arg(long)]
        config: bool,
    },
    /// List the VMs that have versions.
    List,
    /// Name a VM version (VM@NAME then works wherever a VM version is expected), or delete a
    /// name (--delete VM NAME). A tagged VM version is kept by `vm rm` and `vm prune`.
    ///
    /// Examples: cairn vm tag web01@3 before-upgrade · cairn vm tag --delete web01 before-upgrade
    Tag {
        /// VM@N to name (or, with --delete, the VM).
        #[arg(value_name = "VM[@N]")]
        spec: String,
        /// The tag: 1-80 of A-Z a-z 0-9 . _ + - (not only digits).
        name: String,
        /// Delete the tag instead.
        #[arg(long)]
        delete: bool,
    },
    /// Remove the VM versions a retention policy does not keep (as `cairn prune` for images),
    /// each with the disk versions only it binds.
    ///
    /// Example: cairn vm prune web01 --keep-daily 7 --keep-weekly 4
    Prune(VmPruneArgs),
    /// Start a VM version at once (instant recovery): serve every disk from a lazy, writable
    /// export and print the QEMU command line that runs the VM on them.
    ///
    /// One export process serves each disk VM/DISK under that name on --socket (data fetched
    /// on demand, shared with every export on the host through the chunk cache; writes kept
    /// in local overlays), until SIGINT or SIGTERM, as `cairn export --writable` does. The
    /// printed command line is the recorded one with each `-drive id=DISK` pointed at its
    /// export (adjust what else names the old host: its -qmp socket, its network). `cairn vm
    /// commit VM` then records what the VM wrote as a new VM version.
    ///
    /// A version backed up with --memory resumes where it was: its memory state is written
    /// first (QEMU loads it whole) beside the overlays, and the command line loads it.
    ///
    /// Example: cairn vm start web01@3 --socket /run/web01-restore.sock
    #[command(verbatim_doc_comment)]
    Start {
        /// VM, VM@N or VM@TAG.
        #[arg(value_name = "VM[@N]")]
        spec: String,
        /// The Unix socket the disks are served on (default: vm-VM.sock in the run directory).
        #[arg(long, value_name = "PATH")]
        socket: Option<std::path::PathBuf>,
        /// Serve the disks only, even when the memory state was saved: the guest boots.
        #[arg(long)]
        no_memory: bool,
    },
    /// Record what a VM started with `vm start` wrote as a new VM version.
    ///
    /// Each of the VM's running exports commits its overlay (only what the VM wrote is read
    /// and stored); the disk versions are bound as one VM version on top of the VM's newest.
    /// With --qmp the VM is paused for the commits (its writes drained first) and resumed
    /// after, so every disk is taken at one point in time; without it the disks are committed
    /// one after another while the guest runs (said).
    ///
    /// Example: cairn vm commit web01 --qmp /run/web01-restore.qmp -m "after the fix"
    #[command(verbatim_doc_comment)]
    Commit {
        vm: String,
        /// The running VM's QMP socket: pause it for the commits.
        #[arg(long, value_name = "PATH")]
        qmp: Option<std::path::PathBuf>,
        #[arg(short, long, default_value = "")]
        message: String,
    },
    /// What changed between two VM versions: per disk the changed bytes (as `cairn diff`),
    /// disks added or removed, and whether the configuration changed.
    ///
    /// Example: cairn vm diff web01@3 web01@5
    Diff {
        /// VM@N (older).
        #[arg(value_name = "A")]
        a: String,
        /// VM@N (newer), or VM for its newest version.
        #[arg(value_name = "B")]
        b: String,
    },
    /// Write every disk of a VM version into a directory, and print the QEMU command line
    /// that runs the VM on them.
    ///
    /// Each disk DISK becomes DIR/DISK.raw (or .qcow2 with --format qcow2), written aside and
    /// put in place when complete; an existing file needs --force, and a file another
    /// process holds locked (a running VM's disk) is refused even then. The command line is
    /// the recorded one with each `-drive id=DISK` pointed at its restored file (other forms,
    /// such as -blockdev, are named for you to change).
    ///
    /// A libvirt VM's domain XML is written as DIR/domain.xml, named VM-restored (or the
    /// --define name), without its uuid, its disks pointed at the restored files; --define
    /// defines it.
    ///
    /// A version backed up with --memory also gets DIR/memory.state, QEMU's migration
    /// stream, and the command line loads it (`-incoming`): the guest resumes where it was,
    /// its programs still running. --no-memory restores the disks only (the guest boots).
    ///
    /// Example: cairn vm restore web01@3 --to /var/lib/vms/web01-restored
    #[command(verbatim_doc_comment)]
    Restore {
        /// VM or VM@N.
        #[arg(value_name = "VM[@N]")]
        spec: String,
        /// The directory to write the disks into (created if missing).
        #[arg(long, value_name = "DIR")]
        to: std::path::PathBuf,
        /// The disks' format.
        #[arg(long, value_enum, default_value = "raw")]
        format: VmDiskFormat,
        /// Replace existing files.
        #[arg(long)]
        force: bool,
        /// Restore the disks only, even when the memory state was saved: the guest boots.
        #[arg(long)]
        no_memory: bool,
        /// A libvirt VM: define it again as domain NAME on the restored disks (a new domain,
        /// refused if NAME exists). Its XML is DIR/domain.xml either way.
        #[arg(long, value_name = "NAME")]
        define: Option<String>,
        /// The libvirt connection URI for --define (default: virsh's).
        #[arg(long, value_name = "URI", requires = "define")]
        connect: Option<String>,
    },
    /// Remove VM versions (VM@N ...), and with each the disk versions only it binds.
    ///
    /// A disk version another live VM version binds, or a tag names, stays. The space only
    /// they used is then freed at once (fast deletion, as `cairn gc`); --no-gc only records
    /// the deletion. A disk version a VM version binds cannot be removed on its own (`cairn
    /// rm VM/DISK@N` and `prune` keep it): it goes with its VM version.
    Rm {
        /// VM@N, one or more.
        #[arg(required = true)]
        versions: Vec<String>,
        /// Only mark the versions deleted; `cairn gc` frees their space later.
        #[arg(long)]
        no_gc: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VmDiskFormat {
    Raw,
    Qcow2,
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("hypervisor").required(true).args(["qmp", "domain", "all"])))]
pub struct VmBackupArgs {
    /// The VM's name in the repository (its disks become images VM/DISK); for a libvirt
    /// domain its name by default. Several VMs in one run are named by --qmp VM=PATH, or
    /// after their domains.
    pub vm: Option<String>,
    /// The VM's QMP monitor socket (a QEMU without libvirt). Repeat as VM=PATH to back up
    /// several VMs in one run.
    #[arg(long, value_name = "[VM=]PATH")]
    pub qmp: Vec<String>,
    /// The libvirt domain (its disks are named by target: VM/vda, ...); repeat for several.
    #[arg(long, value_name = "NAME")]
    pub domain: Vec<String>,
    /// Every running domain of the libvirt connection, each as the VM of its name.
    #[arg(long)]
    pub all: bool,
    /// The libvirt connection URI (default: virsh's, usually qemu:///system).
    #[arg(long, value_name = "URI")]
    pub connect: Option<String>,
    /// With one --qmp: the guest agent's socket (the chardev of the VM's
    /// org.qemu.guest_agent.0 port). libvirt reaches the agent through the domain's channel.
    #[arg(long, value_name = "PATH")]
    pub guest_agent: Option<std::path::PathBuf>,
    /// Longest wait for each guest agent exchange, in seconds.
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    pub agent_timeout: f64,
    /// Only these disks (repeat, or comma-separated); all writable disks by default.
    #[arg(long = "disk", value_name = "NAME", value_delimiter = ',')]
    pub disks: Vec<String>,
    /// Where the scratch images go (default: $TMPDIR, else /var/tmp).
    #[arg(long, value_name = "DIR")]
    pub scratch_dir: Option<std::path::PathBuf>,
    /// Cap the read rate of each disk, in MiB/s (polite to a busy host; the scratch images
    /// grow by what the guest overwrites meanwhile).
    #[arg(long, value_name = "MIB_PER_S")]
    pub rate_limit: Option<f64>,
    /// Also save the guest's memory and device state (with --qmp), so that `vm restore`
    /// resumes the guest where it was. The guest runs while its RAM is copied and is paused
    /// for the last pass and the disks' point in time (no guest agent freeze: disks and
    /// memory are one instant). Stored as image VM/.memory: zero pages cost nothing, and
    /// pages are deduplicated against the VM's earlier states.
    #[arg(long)]
    pub memory: bool,
    #[arg(short, long, default_value = "")]
    pub message: String,
    /// How hard to look for chunks stored before (exact: every one; default: $CAIRN_DEDUP,
    /// else bounded).
    #[arg(long, value_enum)]
    pub dedup: Option<DedupArg>,
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

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("which").required(true).args(["vm", "all"])))]
pub struct VmPruneArgs {
    /// The VM to prune.
    pub vm: Option<String>,
    /// Prune every VM, each with the same policy.
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

//! Command-line flags, as typed. Resolution into settings happens in the commands.
//!
//! Doc comments here are `--help` text (clap), not rustdoc: brackets in them are shell syntax.
#![allow(rustdoc::broken_intra_doc_links)]

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

mod repository;
mod serve;
mod vm;

pub use repository::*;
pub use serve::*;
pub use vm::*;

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
    /// Store a version's most scattered data again, side by side, so it restores faster.
    ///
    /// A version whose blocks many commits stored lies in many packs, and a restore makes one
    /// read per run of neighbouring data: a seek on a disk, a request on S3 (`cairn stats
    /// IMAGE@V` counts them). relayout ranks the batches of segments a restore reads
    /// together by the reads each takes and copies the data of the top --alpha of them into
    /// new packs, in the order a restore reads it (CloudVS's fragmentation parameter α). Restores of this version — and of
    /// others sharing that data — read the new copies; no version changes. The space it
    /// spends is the bytes copied, until `cairn gc --repair` gives back the old copies'
    /// packs as they empty. Safe while other processes commit and restore.
    ///
    /// Examples: cairn relayout web01@12 --alpha 0.5 · cairn relayout web01 --alpha 1 -n
    #[command(verbatim_doc_comment)]
    Relayout(RelayoutArgs),
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

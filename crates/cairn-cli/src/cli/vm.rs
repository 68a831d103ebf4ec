//! Flags of `cairn vm`: whole VMs, their disks and memory.
//!
//! Doc comments here are `--help` text (clap), not rustdoc: brackets in them are shell syntax.
#![allow(rustdoc::broken_intra_doc_links)]

use super::*;

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

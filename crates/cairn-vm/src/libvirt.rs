//! The hypervisor side of a backup for a libvirt domain, through `virsh`: libvirt's backup
//! API in pull mode with checkpoints (`backup-begin` takes the point in time across every
//! disk and serves each over NBD, `<incremental>` exports the bitmap of what changed since a
//! checkpoint, merged by libvirt over every later one), the guest agent through libvirt's own
//! channel (`qemu-agent-command --timeout`), and the domain XML as the recorded
//! configuration.
//!
//! `virsh` rather than the C library: it is what every libvirt host has, it speaks to local and
//! remote daemons alike (`--connect`), and a backup makes a dozen calls.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cairn_format::vm::ConfigKind;
use quick_xml::events::Event;

use crate::error::{VmError, VmResult};
use crate::hypervisor::{DiskInfo, Frozen, Hypervisor, Reader, CHECKPOINT_PREFIX};

/// How long one virsh call may take (the guest agent's have their own bound).
const VIRSH_TIMEOUT: Duration = Duration::from_secs(120);

/// A disk as the domain XML describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DomainDisk {
    /// The target device (`vda`): the disk's name, and its NBD export's in pull mode.
    pub target: String,
    /// The source file or device.
    pub source: String,
    /// The driver's format (`qcow2`, `raw`).
    pub format: String,
}

/// A libvirt domain.
pub struct Libvirt {
    domain: String,
    connect: Option<String>,
    scratch: PathBuf,
    vm_key: String,
    nbd_socket: PathBuf,
    job_started: bool,
    disks: Vec<DomainDisk>,
    has_agent: bool,
    xml: String,
}

/// The running domains of `connect` (`virsh list --name --state-running`), sorted: what
/// `cairn vm backup --all` backs up.
pub async fn running_domains(connect: Option<String>) -> VmResult<Vec<String>> {
    let lister = Libvirt::new("(every running one)", connect, Path::new("/"), "")?;
    let out = lister
        .virsh(&["list", "--name", "--state-running"], VIRSH_TIMEOUT)
        .await?;
    let mut names: Vec<String> = out
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_string)
        .collect();
    names.sort();
    Ok(names)
}

/// Defines domain `name` from the XML file `xml` (`virsh define`); refuses when a domain of
/// that name exists (defining over it would change that domain).
pub async fn define(connect: Option<String>, name: &str, xml: &Path) -> VmResult<()> {
    let virsh = Libvirt::new(name, connect, Path::new("/"), "")?;
    if virsh.virsh(&["dominfo", name], VIRSH_TIMEOUT).await.is_ok() {
        return Err(VmError::Repo(cairn_repo::RepoError::Refused(format!(
            "a libvirt domain named {name} exists: restoring defines a new one (--define NAME)"
        ))));
    }
    let path = xml.display().to_string();
    virsh.virsh(&["define", &path], VIRSH_TIMEOUT).await?;
    Ok(())
}

impl Libvirt {
    pub fn new(
        domain: &str,
        connect: Option<String>,
        scratch: &Path,
        vm_key: &str,
    ) -> VmResult<Libvirt> {
        if domain.is_empty() {
            return Err(VmError::BadInput("--domain needs a domain name".into()));
        }
        Ok(Libvirt {
            domain: domain.to_string(),
            connect,
            scratch: scratch.to_path_buf(),
            vm_key: vm_key.to_string(),
            nbd_socket: scratch.join(format!("cairn-nbd-{vm_key}.sock")),
            job_started: false,
            disks: Vec::new(),
            has_agent: false,
            xml: String::new(),
        })
    }

    /// Runs `virsh [--connect URI] ARGS` within `limit`; its standard output.
    async fn virsh(&self, args: &[&str], limit: Duration) -> VmResult<String> {
        let mut cmd = Command::new("virsh");
        cmd.arg("-q");
        if let Some(uri) = &self.connect {
            cmd.args(["--connect", uri]);
        }
        cmd.args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let what = format!("virsh {}", args.first().copied().unwrap_or(""));
        let out = tokio::task::spawn_blocking(move || run_bounded(cmd, limit))
            .await
            .map_err(|e| VmError::State(format!("{what}: {e}")))?
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => VmError::State(
                    "virsh not found (Debian package libvirt-clients): --domain drives libvirt \
                     through it"
                        .into(),
                ),
                _ => VmError::io(what.clone(), e),
            })?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr);
            let line = err
                .lines()
                .map(|l| l.trim_start_matches("error: ").trim())
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join("; ");
            return Err(VmError::State(format!(
                "{what} (domain {}): {line}",
                self.domain
            )));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    async fn agent(&self, command: &str, timeout: Duration) -> VmResult<String> {
        let secs = timeout.as_secs().max(1).to_string();
        let body = format!("{{\"execute\":\"{command}\"}}");
        self.virsh(
            &[
                "qemu-agent-command",
                &self.domain,
                "--timeout",
                &secs,
                &body,
            ],
            timeout + Duration::from_secs(5),
        )
        .await
    }

    fn scratch_file(&self, target: &str) -> PathBuf {
        self.scratch.join(format!(
            "{}{target}.qcow2",
            crate::block::scratch_prefix(&self.vm_key)
        ))
    }

    fn remove_scratch(&self) -> Vec<String> {
        let prefix = crate::block::scratch_prefix(&self.vm_key);
        let mut out = Vec::new();
        if let Ok(dir) = std::fs::read_dir(&self.scratch) {
            for entry in dir.flatten() {
                let name = entry.file_name().to_string_lossy().to_string();
                if name.starts_with(&prefix) && std::fs::remove_file(entry.path()).is_ok() {
                    out.push(format!("scratch file {}", entry.path().display()));
                }
            }
        }
        let _ = std::fs::remove_file(&self.nbd_socket);
        out
    }

    /// The domain's backup XML: pull mode on our socket, each of `disks` full or incremental.
    fn backup_xml(&self, disks: &[DiskInfo], since: &[Option<String>]) -> String {
        let mut xml = format!(
            "<domainbackup mode='pull'>\n  <server transport='unix' socket='{}'/>\n  <disks>\n",
            escape(&self.nbd_socket.display().to_string())
        );
        for d in &self.disks {
            match disks.iter().position(|x| x.name == d.target) {
                None => xml.push_str(&format!(
                    "    <disk name='{}' backup='no'/>\n",
                    escape(&d.target)
                )),
                Some(i) => {
                    let mode = match &since[i] {
                        Some(cp) => {
                            format!("backupmode='incremental' incremental='{}'", escape(cp))
                        }
                        None => "backupmode='full'".to_string(),
                    };
                    xml.push_str(&format!(
                        "    <disk name='{}' backup='yes' type='file' {mode}><scratch file='{}'/></disk>\n",
                        escape(&d.target),
                        escape(&self.scratch_file(&d.target).display().to_string())
                    ));
                }
            }
        }
        xml.push_str("  </disks>\n</domainbackup>\n");
        xml
    }

    /// The checkpoint XML: a bitmap on every backed-up qcow2 disk.
    fn checkpoint_xml(&self, disks: &[DiskInfo], name: &str) -> String {
        let mut xml = format!(
            "<domaincheckpoint>\n  <name>{}</name>\n  <disks>\n",
            escape(name)
        );
        for d in &self.disks {
            let on = d.format == "qcow2" && disks.iter().any(|x| x.name == d.target);
            xml.push_str(&format!(
                "    <disk name='{}' checkpoint='{}'/>\n",
                escape(&d.target),
                if on { "bitmap" } else { "no" }
            ));
        }
        xml.push_str("  </disks>\n</domaincheckpoint>\n");
        xml
    }
}

/// Why `--memory` is refused for a libvirt domain.
pub const MEMORY_WITH_QMP_ONLY: &str =
    "--memory needs --qmp: cairn saves memory through QEMU's monitor, which libvirt keeps to \
     itself (libvirt's own `virsh snapshot-create --memspec` saves it in libvirt's format)";

impl Hypervisor for Libvirt {
    fn describe(&self) -> String {
        format!("libvirt domain {}", self.domain)
    }

    fn lock_key(&self) -> String {
        format!(
            "libvirt:{}:{}",
            self.connect.as_deref().unwrap_or(""),
            self.domain
        )
    }

    async fn check_running(&mut self) -> VmResult<()> {
        let state = self
            .virsh(&["domstate", &self.domain], VIRSH_TIMEOUT)
            .await?;
        let state = state.trim();
        match state {
            "running" | "paused" => Ok(()),
            _ => Err(VmError::State(format!(
                "{} is {state}: a backup needs a running or paused VM",
                self.describe()
            ))),
        }
    }

    async fn clean_stale(&mut self) -> Vec<String> {
        let mut out = Vec::new();
        if let Ok(info) = self
            .virsh(&["domjobinfo", &self.domain], VIRSH_TIMEOUT)
            .await
        {
            let backup_running = info
                .lines()
                .any(|l| l.starts_with("Operation:") && l.contains("Backup"));
            if backup_running
                && self
                    .virsh(&["domjobabort", &self.domain], VIRSH_TIMEOUT)
                    .await
                    .is_ok()
            {
                out.push("a backup job".to_string());
            }
        }
        out.extend(self.remove_scratch());
        out
    }

    async fn disks(&mut self, say: &(dyn Fn(String) + Send + Sync)) -> VmResult<Vec<DiskInfo>> {
        self.xml = self
            .virsh(&["dumpxml", &self.domain], VIRSH_TIMEOUT)
            .await?;
        let (disks, has_agent) = parse_domain(&self.xml)
            .map_err(|e| VmError::State(format!("the XML of {}: {e}", self.describe())))?;
        self.disks = disks;
        self.has_agent = has_agent;
        let listed = self
            .virsh(&["checkpoint-list", &self.domain, "--name"], VIRSH_TIMEOUT)
            .await?;
        let checkpoints: Vec<String> = listed
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with(CHECKPOINT_PREFIX))
            .map(str::to_string)
            .collect();
        let mut out = Vec::new();
        for d in &self.disks {
            let info = self
                .virsh(&["domblkinfo", &self.domain, &d.target], VIRSH_TIMEOUT)
                .await?;
            let size = info
                .lines()
                .find_map(|l| l.strip_prefix("Capacity:"))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    VmError::State(format!("virsh domblkinfo {}: no capacity", d.target))
                })?;
            let persistent = d.format == "qcow2";
            if !persistent {
                say(format!(
                    "{}: a {} disk cannot hold libvirt checkpoints: every backup reads it whole \
                     (qcow2 can)",
                    d.target, d.format
                ));
            }
            out.push(DiskInfo {
                name: d.target.clone(),
                node: d.source.clone(),
                format: d.format.clone(),
                size,
                checkpoints: match persistent {
                    true => checkpoints.clone(),
                    false => Vec::new(),
                },
            });
        }
        Ok(out)
    }

    async fn prepare(&mut self, _disks: &[DiskInfo]) -> VmResult<()> {
        self.remove_scratch();
        Ok(())
    }

    async fn freeze(&mut self, timeout: Duration) -> (Frozen, Option<String>) {
        if !self.has_agent {
            return (
                Frozen::NoAgent,
                Some(format!(
                    "{} has no guest agent channel (org.qemu.guest_agent.0): the disks are \
                     crash-consistent, as after a power cut, not frozen",
                    self.describe()
                )),
            );
        }
        match self.agent("guest-fsfreeze-freeze", timeout).await {
            Ok(_) => (Frozen::Yes, None),
            Err(e) => {
                // A freeze that timed out may still happen: thaw regardless.
                let _ = self.agent("guest-fsfreeze-thaw", timeout).await;
                (
                    Frozen::NoAnswer,
                    Some(format!(
                        "the guest agent did not freeze ({e}): backing up without a freeze \
                         (crash-consistent)"
                    )),
                )
            }
        }
    }

    async fn thaw(&mut self, timeout: Duration) {
        if let Err(e) = self.agent("guest-fsfreeze-thaw", timeout).await {
            tracing::error!("{e}: the guest may still be frozen; the next backup thaws it");
        }
    }

    async fn point_in_time(
        &mut self,
        disks: &[DiskInfo],
        since: &[Option<String>],
        checkpoint: &str,
    ) -> VmResult<()> {
        let backup = self
            .scratch
            .join(format!("cairn-backup-{}.xml", self.vm_key));
        let cp = self
            .scratch
            .join(format!("cairn-checkpoint-{}.xml", self.vm_key));
        write_private(&backup, &self.backup_xml(disks, since))?;
        write_private(&cp, &self.checkpoint_xml(disks, checkpoint))?;
        self.job_started = true;
        let result = self
            .virsh(
                &[
                    "backup-begin",
                    &self.domain,
                    "--backupxml",
                    &backup.display().to_string(),
                    "--checkpointxml",
                    &cp.display().to_string(),
                ],
                VIRSH_TIMEOUT,
            )
            .await;
        let _ = std::fs::remove_file(&backup);
        let _ = std::fs::remove_file(&cp);
        result.map(|_| ())
    }

    async fn save_memory(&mut self) -> VmResult<crate::memory::Saved> {
        Err(VmError::BadInput(MEMORY_WITH_QMP_ONLY.into()))
    }

    async fn resume(&mut self) {}

    async fn expose(
        &mut self,
        disks: &[DiskInfo],
        since: &[Option<String>],
    ) -> VmResult<Vec<Reader>> {
        Ok(disks
            .iter()
            .zip(since)
            .map(|(d, since)| Reader {
                url: format!(
                    "nbd+unix:///{}?socket={}",
                    d.name,
                    self.nbd_socket.display()
                ),
                // libvirt names the exported bitmap after the disk.
                bitmap: since.as_ref().map(|_| format!("backup-{}", d.name)),
            })
            .collect())
    }

    async fn teardown(&mut self) {
        if self.job_started {
            if let Err(e) = self
                .virsh(&["domjobabort", &self.domain], VIRSH_TIMEOUT)
                .await
            {
                tracing::warn!("ending the backup job: {e}");
            }
        }
        self.remove_scratch();
    }

    async fn drop_checkpoints(&mut self, _disks: &[DiskInfo], keep: &str) -> VmResult<()> {
        let listed = self
            .virsh(&["checkpoint-list", &self.domain, "--name"], VIRSH_TIMEOUT)
            .await?;
        for name in listed.lines().map(str::trim) {
            if name.starts_with(CHECKPOINT_PREFIX) && name != keep {
                self.virsh(&["checkpoint-delete", &self.domain, name], VIRSH_TIMEOUT)
                    .await?;
            }
        }
        Ok(())
    }

    async fn config(&mut self) -> (ConfigKind, String) {
        (ConfigKind::LibvirtXml, self.xml.clone())
    }
}

/// Runs `cmd` to completion, killing it past `limit`.
fn run_bounded(mut cmd: Command, limit: Duration) -> std::io::Result<std::process::Output> {
    let mut child = cmd.spawn()?;
    let started = Instant::now();
    loop {
        if child.try_wait()?.is_some() {
            return child.wait_with_output();
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer in {} s", limit.as_secs()),
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn write_private(path: &Path, text: &str) -> VmResult<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| VmError::io(format!("write {}", path.display()), e))?;
    f.write_all(text.as_bytes())
        .map_err(|e| VmError::io(format!("write {}", path.display()), e))
}

/// XML attribute text.
fn escape(s: &str) -> String {
    quick_xml::escape::escape(s).into_owned()
}

/// The writable disks of a domain XML (file or block disks with a target, not read-only),
/// and whether it has a guest agent channel.
pub fn parse_domain(xml: &str) -> Result<(Vec<DomainDisk>, bool), String> {
    let mut reader = quick_xml::Reader::from_str(xml);
    let mut disks = Vec::new();
    let mut agent = false;
    // Inside a <disk device='disk'>: what it has so far, and whether it is read-only.
    let mut current: Option<(DomainDisk, bool)> = None;
    let mut depth_in_disk = 0usize;
    loop {
        let event = reader.read_event().map_err(|e| e.to_string())?;
        let (start, empty) = match &event {
            Event::Start(e) => (Some(e.clone()), false),
            Event::Empty(e) => (Some(e.clone()), true),
            _ => (None, false),
        };
        if let Some(e) = start {
            let attr = |name: &str| -> Option<String> {
                e.try_get_attribute(name).ok().flatten().and_then(|a| {
                    a.normalized_value(quick_xml::XmlVersion::default())
                        .ok()
                        .map(|v| v.into_owned())
                })
            };
            match e.name().as_ref() {
                b"disk"
                    if current.is_none()
                        && !empty
                        && attr("device").as_deref().unwrap_or("disk") == "disk" =>
                {
                    let disk = DomainDisk {
                        target: String::new(),
                        source: String::new(),
                        format: "raw".into(),
                    };
                    current = Some((disk, false));
                    depth_in_disk = 0;
                    continue;
                }
                b"driver" => {
                    if let (Some((d, _)), Some(t)) = (current.as_mut(), attr("type")) {
                        d.format = t;
                    }
                }
                // The disk's own source, not a backing store's (one level deeper).
                b"source" if depth_in_disk == 0 => {
                    if let (Some((d, _)), Some(s)) =
                        (current.as_mut(), attr("file").or_else(|| attr("dev")))
                    {
                        d.source = s;
                    }
                }
                b"target" => {
                    if let (Some((d, _)), Some(t)) = (current.as_mut(), attr("dev")) {
                        d.target = t;
                    }
                }
                b"readonly" => {
                    if let Some((_, ro)) = current.as_mut() {
                        *ro = true;
                    }
                }
                _ => {}
            }
            if e.name().as_ref() == b"target"
                && attr("name").as_deref() == Some("org.qemu.guest_agent.0")
            {
                agent = true;
            }
            if current.is_some() && !empty && e.name().as_ref() != b"disk" {
                depth_in_disk += 1;
            }
            continue;
        }
        match event {
            Event::End(e) if current.is_some() => {
                if e.name().as_ref() == b"disk" && depth_in_disk == 0 {
                    let (d, readonly) = current.take().expect("inside a disk");
                    if !readonly && !d.target.is_empty() {
                        disks.push(d);
                    }
                } else {
                    depth_in_disk = depth_in_disk.saturating_sub(1);
                }
            }
            Event::Eof => break,
            _ => {}
        }
    }
    Ok((disks, agent))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_domain_xml_gives_its_writable_disks_and_agent() {
        let xml = r#"<domain type='kvm'><name>web</name><devices>
          <disk type='file' device='disk'>
            <driver name='qemu' type='qcow2'/>
            <source file='/var/lib/libvirt/images/web.qcow2' index='2'/>
            <backingStore type='file' index='3'><format type='raw'/><source file='/base.raw'/></backingStore>
            <target dev='vda' bus='virtio'/>
          </disk>
          <disk type='block' device='disk'>
            <driver name='qemu' type='raw'/><source dev='/dev/vg/data'/><target dev='vdb'/>
          </disk>
          <disk type='file' device='cdrom'><source file='/x.iso'/><target dev='sda'/><readonly/></disk>
          <disk type='file' device='disk'><source file='/ro.img'/><target dev='vdc'/><readonly/></disk>
          <channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>
        </devices></domain>"#;
        let (disks, agent) = parse_domain(xml).unwrap();
        assert!(agent);
        assert_eq!(
            disks,
            [
                DomainDisk {
                    target: "vda".into(),
                    source: "/var/lib/libvirt/images/web.qcow2".into(),
                    format: "qcow2".into()
                },
                DomainDisk {
                    target: "vdb".into(),
                    source: "/dev/vg/data".into(),
                    format: "raw".into()
                },
            ]
        );
        let (disks, agent) = parse_domain("<domain><devices/></domain>").unwrap();
        assert!(disks.is_empty() && !agent);
        assert!(
            parse_domain("<domain><devices><disk").is_err()
                || parse_domain("<domain><devices><disk").unwrap().0.is_empty()
        );
    }
}

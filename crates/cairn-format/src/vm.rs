//! VM version records: one immutable object per version of a whole VM, at key `vms/<id>` where
//! the id is the BLAKE3 of the object. A VM version binds one version of each of the VM's
//! disks (each disk is an image of its own, `VM/DISK`), the VM's configuration and, when
//! saved, its memory state (an image too), taken at one point in time.
//!
//! Payload (inside an envelope with magic "CRNVMV\0\0"):
//!
//! ```text
//! vm name (u16 len + UTF-8) | seq (u64) | parent VM version id (32, zero = none)
//! time (i64, ns since epoch, the point in time) | config kind (u8) | config (u32 len + UTF-8)
//! disks (u16 n) | n × [ disk name (u16 len + UTF-8) | version id (32) | version seq (u64)
//!                       | node (u16 len + UTF-8) | checkpoint (u16 len + UTF-8, empty = none) ]
//! memory version id (32, zero = none)
//! freeze (u8: 0 not tried, 1 frozen, 2 the guest agent did not answer) | freeze ns (u64)
//! message (u32 len + UTF-8)
//! ```

use crate::codec::{Decoder, Encoder};
use crate::envelope;
use crate::name::validate_image_name;
use crate::{FormatError, FormatResult, Id};

pub const MAGIC: &[u8; 8] = b"CRNVMV\0\0";
const WHAT: &str = "VM version record";
/// Disks one VM version may bind (QEMU's own limits are far lower).
pub const MAX_DISKS: usize = 256;

/// What the configuration text is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConfigKind {
    /// None was recorded.
    None = 0,
    /// A libvirt domain XML.
    LibvirtXml = 1,
    /// A QEMU command line (one argument per line).
    QemuArgs = 2,
}

/// Whether the guest's file systems were frozen for the point in time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Freeze {
    /// No guest agent was asked (none configured).
    NotTried = 0,
    /// The guest agent froze the file systems: the disks are application-consistent.
    Frozen = 1,
    /// A guest agent was configured but did not answer in time: crash-consistent only.
    NoAnswer = 2,
}

/// One disk of a VM version.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmDisk {
    /// The disk's name inside the VM; its image is `VM/NAME`.
    pub name: String,
    /// The image version holding the disk's content at the VM's point in time.
    pub version: Id,
    pub seq: u64,
    /// The QEMU block node (or libvirt target) the disk was read from.
    pub node: String,
    /// The dirty bitmap (libvirt: checkpoint) started at this point in time, from which the
    /// next backup reads only what changed; empty when none was started.
    pub checkpoint: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VmVersion {
    pub vm: String,
    /// 1 for the first version of a VM, parent's + 1 after.
    pub seq: u64,
    pub parent: Option<Id>,
    pub time_ns: i64,
    pub config_kind: ConfigKind,
    pub config: String,
    pub disks: Vec<VmDisk>,
    /// The image version holding the VM's memory and device state, if saved.
    pub memory: Option<Id>,
    pub freeze: Freeze,
    /// How long the guest's file systems stayed frozen (0 when not frozen).
    pub freeze_ns: u64,
    pub message: String,
}

impl VmVersion {
    /// The image that holds disk `disk` of VM `vm`.
    pub fn disk_image(vm: &str, disk: &str) -> String {
        format!("{vm}/{disk}")
    }

    /// Every image version this VM version binds, by its name inside the VM: the disks, then
    /// the memory state (`.memory`) when it was saved.
    pub fn bound(&self) -> Vec<(&str, Id)> {
        let mut out: Vec<(&str, Id)> = self
            .disks
            .iter()
            .map(|d| (d.name.as_str(), d.version))
            .collect();
        if let Some(m) = self.memory {
            out.push((crate::memstate::MEMORY_IMAGE, m));
        }
        out
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut e = Encoder::with_capacity(256 + self.config.len() + self.message.len());
        e.str16(&self.vm)
            .u64(self.seq)
            .id(&self.parent.unwrap_or(Id::ZERO))
            .i64(self.time_ns)
            .u8(self.config_kind as u8)
            .str32(&self.config)
            .u16(self.disks.len() as u16);
        for d in &self.disks {
            e.str16(&d.name)
                .id(&d.version)
                .u64(d.seq)
                .str16(&d.node)
                .str16(&d.checkpoint);
        }
        e.id(&self.memory.unwrap_or(Id::ZERO))
            .u8(self.freeze as u8)
            .u64(self.freeze_ns)
            .str32(&self.message);
        envelope::seal(MAGIC, &e.finish())
    }

    pub fn decode(data: &[u8]) -> FormatResult<Self> {
        let payload = envelope::open(MAGIC, data, WHAT)?;
        let mut d = Decoder::new(payload, WHAT);
        let vm = d.str16()?;
        validate_image_name(&vm)?;
        let seq = d.u64()?;
        let parent = Some(d.id()?).filter(|p| !p.is_zero());
        let time_ns = d.i64()?;
        let config_kind = match d.u8()? {
            0 => ConfigKind::None,
            1 => ConfigKind::LibvirtXml,
            2 => ConfigKind::QemuArgs,
            k => return Err(FormatError::invalid(WHAT, format!("config kind {k}"))),
        };
        let config = d.str32()?;
        let n = d.u16()? as usize;
        if n > MAX_DISKS {
            return Err(FormatError::invalid(WHAT, format!("{n} disks")));
        }
        let mut disks: Vec<VmDisk> = Vec::with_capacity(n);
        for _ in 0..n {
            let disk = VmDisk {
                name: d.str16()?,
                version: d.id()?,
                seq: d.u64()?,
                node: d.str16()?,
                checkpoint: d.str16()?,
            };
            validate_disk_name(&vm, &disk.name)?;
            if disks.iter().any(|o| o.name == disk.name) {
                return Err(FormatError::invalid(
                    WHAT,
                    format!("disk {} named twice", disk.name),
                ));
            }
            if disk.seq == 0 || disk.version.is_zero() {
                return Err(FormatError::invalid(WHAT, "a disk without a version"));
            }
            disks.push(disk);
        }
        let memory = Some(d.id()?).filter(|m| !m.is_zero());
        let freeze = match d.u8()? {
            0 => Freeze::NotTried,
            1 => Freeze::Frozen,
            2 => Freeze::NoAnswer,
            f => return Err(FormatError::invalid(WHAT, format!("freeze {f}"))),
        };
        let freeze_ns = d.u64()?;
        let message = d.str32()?;
        d.finish()?;
        if seq == 0 {
            return Err(FormatError::invalid(WHAT, "seq 0"));
        }
        Ok(VmVersion {
            vm,
            seq,
            parent,
            time_ns,
            config_kind,
            config,
            disks,
            memory,
            freeze,
            freeze_ns,
            message,
        })
    }
}

/// A disk name is one segment (no `/`, not beginning with `.`: names such as `.memory` are
/// the VM's own images) that, after `VM/`, makes a valid image name.
pub fn validate_disk_name(vm: &str, disk: &str) -> FormatResult<()> {
    if disk.is_empty() || disk.contains('/') || disk.starts_with('.') {
        return Err(FormatError::invalid(
            "disk name",
            format!("{disk:?}: one non-empty path segment (no '/', no leading '.')"),
        ));
    }
    validate_image_name(&VmVersion::disk_image(vm, disk))
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn sample() -> VmVersion {
        VmVersion {
            vm: "web01".into(),
            seq: 2,
            parent: Some(Id::of(b"p")),
            time_ns: 1_764_000_000_000_000_000,
            config_kind: ConfigKind::QemuArgs,
            config: "-machine\nq35\n".into(),
            disks: vec![
                VmDisk {
                    name: "disk0".into(),
                    version: Id::of(b"d0"),
                    seq: 5,
                    node: "drive0".into(),
                    checkpoint: "cairn-1".into(),
                },
                VmDisk {
                    name: "data".into(),
                    version: Id::of(b"d1"),
                    seq: 1,
                    node: "drive1".into(),
                    checkpoint: String::new(),
                },
            ],
            memory: None,
            freeze: Freeze::Frozen,
            freeze_ns: 12_000_000,
            message: "nightly ✓".into(),
        }
    }

    #[test]
    fn round_trip() {
        let v = sample();
        assert_eq!(VmVersion::decode(&v.encode()).unwrap(), v);
        let mut m = v;
        m.memory = Some(Id::of(b"mem"));
        m.parent = None;
        m.freeze = Freeze::NoAnswer;
        assert_eq!(VmVersion::decode(&m.encode()).unwrap(), m);
    }

    #[test]
    fn bad_records_are_refused() {
        let mut v = sample();
        v.disks[1].name = "disk0".into();
        assert!(
            VmVersion::decode(&v.encode()).is_err(),
            "a disk named twice"
        );
        let mut v = sample();
        v.disks[0].name = "a/b".into();
        assert!(
            VmVersion::decode(&v.encode()).is_err(),
            "a disk name with '/'"
        );
        let mut v = sample();
        v.seq = 0;
        assert!(VmVersion::decode(&v.encode()).is_err());
        let bytes = sample().encode();
        for cut in [0, 10, bytes.len() - 1] {
            assert!(VmVersion::decode(&bytes[..cut]).is_err());
        }
    }
}

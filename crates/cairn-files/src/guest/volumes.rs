//! Where the file systems of a disk image are: the whole image, or the partitions of its GPT
//! (`gptman`) or MBR (`mbrman`) table, each named by the signature at its start.

use std::fmt;

use crate::error::{FilesError, FilesResult};
use crate::guest::disk::DiskReader;

/// What a volume's first bytes say it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsKind {
    Ext,
    Xfs,
    Ntfs,
    Vfat,
    Swap,
    Unknown,
}

impl fmt::Display for FsKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            FsKind::Ext => "ext2/3/4",
            FsKind::Xfs => "xfs",
            FsKind::Ntfs => "NTFS",
            FsKind::Vfat => "FAT",
            FsKind::Swap => "swap",
            FsKind::Unknown => "unknown",
        })
    }
}

/// Names the file system by its signature (`head` is the volume's first 4 KiB).
pub fn sniff(head: &[u8]) -> FsKind {
    let at = |off: usize, sig: &[u8]| head.get(off..off + sig.len()) == Some(sig);
    if at(1080, &[0x53, 0xef]) {
        FsKind::Ext
    } else if at(0, b"XFSB") {
        FsKind::Xfs
    } else if at(3, b"NTFS    ") {
        FsKind::Ntfs
    } else if at(54, b"FAT1") || at(82, b"FAT32") {
        FsKind::Vfat
    } else if at(4086, b"SWAPSPACE2") {
        FsKind::Swap
    } else {
        FsKind::Unknown
    }
}

/// One file system's place in the image.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    /// The partition's number (1-based, as Linux names `/dev/sdaN`); `None` for the whole image.
    pub number: Option<u32>,
    pub start: u64,
    pub len: u64,
    pub kind: FsKind,
}

impl fmt::Display for Volume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.number {
            Some(n) => write!(f, "partition {n} ({})", self.kind),
            None => write!(f, "the whole image ({})", self.kind),
        }
    }
}

fn kind_at(disk: &DiskReader, start: u64, len: u64) -> FsKind {
    let mut head = vec![0u8; 4096.min(len) as usize];
    match disk.read_at(start, &mut head) {
        Ok(()) => sniff(&head),
        Err(_) => FsKind::Unknown,
    }
}

/// The volumes of `disk`: the whole image when a file system starts at byte 0, else the used
/// partitions of its GPT, else of its MBR (extended and GPT-protective entries left out).
pub fn volumes(disk: &DiskReader) -> FilesResult<Vec<Volume>> {
    let whole = kind_at(disk, 0, disk.len());
    if whole != FsKind::Unknown {
        return Ok(vec![Volume {
            number: None,
            start: 0,
            len: disk.len(),
            kind: whole,
        }]);
    }
    let mut spans = Vec::new();
    if let Ok(gpt) = gptman::GPT::find_from(&mut disk.clone()) {
        for (n, p) in gpt.iter().filter(|(_, p)| p.is_used()) {
            let start = p.starting_lba * gpt.sector_size;
            let len = (p.ending_lba + 1).saturating_sub(p.starting_lba) * gpt.sector_size;
            spans.push((n, start, len));
        }
    } else if let Ok(mbr) = mbrman::MBR::read_from(&mut disk.clone(), 512) {
        for (n, p) in mbr.iter() {
            if p.is_used() && !p.is_extended() && p.sys != 0xee {
                spans.push((
                    n as u32,
                    u64::from(p.starting_lba) * 512,
                    u64::from(p.sectors) * 512,
                ));
            }
        }
    }
    Ok(spans
        .into_iter()
        .filter(|&(_, start, len)| len > 0 && start < disk.len())
        .map(|(n, start, len)| {
            let len = len.min(disk.len() - start);
            Volume {
                number: Some(n),
                start,
                len,
                kind: kind_at(disk, start, len),
            }
        })
        .collect())
}

/// The ext file system to read: partition `asked`, or else the only ext volume there is.
pub fn choose(volumes: &[Volume], asked: Option<u32>) -> FilesResult<Volume> {
    let listing = || {
        volumes
            .iter()
            .map(|v| v.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    };
    let others = "cairn reads ext2/3/4; for another file system use `cairn mount` and a read-only loop mount";
    let chosen = match asked {
        Some(n) => {
            if volumes.iter().any(|v| v.number.is_none()) {
                return Err(FilesError::NoFileSystem(format!(
                    "the image has no partition table ({}): drop --partition",
                    listing()
                )));
            }
            volumes
                .iter()
                .find(|v| v.number == Some(n))
                .ok_or_else(|| {
                    FilesError::NoFileSystem(format!("no partition {n} (found: {})", listing()))
                })?
        }
        None => {
            let ext: Vec<&Volume> = volumes.iter().filter(|v| v.kind == FsKind::Ext).collect();
            match ext.as_slice() {
                [one] => *one,
                [] if volumes.is_empty() => {
                    return Err(FilesError::NoFileSystem(
                        "no file system and no partition table found".into(),
                    ))
                }
                [] => {
                    return Err(FilesError::NoFileSystem(format!(
                        "no ext2/3/4 file system found ({}): {others}",
                        listing()
                    )))
                }
                _ => {
                    return Err(FilesError::NoFileSystem(format!(
                        "several ext file systems ({}): choose one with --partition N",
                        listing()
                    )))
                }
            }
        }
    };
    if chosen.kind != FsKind::Ext {
        return Err(FilesError::NoFileSystem(format!(
            "{chosen} is not ext2/3/4: {others}"
        )));
    }
    Ok(chosen.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vol(number: Option<u32>, kind: FsKind) -> Volume {
        Volume {
            number,
            start: 0,
            len: 1,
            kind,
        }
    }

    #[test]
    fn signatures_name_the_file_system() {
        let mut head = vec![0u8; 4096];
        assert_eq!(sniff(&head), FsKind::Unknown);
        head[1080..1082].copy_from_slice(&[0x53, 0xef]);
        assert_eq!(sniff(&head), FsKind::Ext);
        let mut xfs = vec![0u8; 4096];
        xfs[..4].copy_from_slice(b"XFSB");
        assert_eq!(sniff(&xfs), FsKind::Xfs);
        assert_eq!(sniff(b"\xeb\x52\x90NTFS    "), FsKind::Ntfs);
        assert_eq!(sniff(&[]), FsKind::Unknown);
    }

    #[test]
    fn the_only_ext_volume_is_chosen_and_anything_else_is_one_clear_line() {
        let debian = [
            vol(Some(1), FsKind::Ext),
            vol(Some(14), FsKind::Unknown),
            vol(Some(15), FsKind::Vfat),
        ];
        assert_eq!(choose(&debian, None).unwrap().number, Some(1));
        assert_eq!(choose(&debian, Some(1)).unwrap().number, Some(1));
        assert_eq!(
            choose(&debian, Some(15)).unwrap_err().to_string(),
            "partition 15 (FAT) is not ext2/3/4: cairn reads ext2/3/4; for another file system use `cairn mount` and a read-only loop mount"
        );
        assert_eq!(
            choose(&debian, Some(3)).unwrap_err().to_string(),
            "no partition 3 (found: partition 1 (ext2/3/4), partition 14 (unknown), partition 15 (FAT))"
        );
        let two = [vol(Some(1), FsKind::Ext), vol(Some(2), FsKind::Ext)];
        assert!(choose(&two, None)
            .unwrap_err()
            .to_string()
            .starts_with("several ext file systems"));
        let bare = [vol(None, FsKind::Ext)];
        assert_eq!(choose(&bare, None).unwrap().number, None);
        assert!(choose(&bare, Some(1))
            .unwrap_err()
            .to_string()
            .ends_with("drop --partition"));
        assert_eq!(
            choose(&[], None).unwrap_err().to_string(),
            "no file system and no partition table found"
        );
    }
}

//! The guest's bytes are untrusted: a VM can write anything on its disk, and `cairn ls|cat`
//! then parse it (partition tables, ext4 metadata). Damaged images — a real ext4 file system
//! made by mkfs.ext4, bare and inside a GPT made by sgdisk, with random bytes overwritten in
//! their metadata — must give a result or an error, never a panic or a hang.

use std::path::Path;
use std::process::Command;
use std::sync::{Arc, OnceLock};

use cairn_files::guest::disk::DiskReader;
use cairn_files::guest::GuestFs;
use proptest::prelude::*;

fn tool(name: &str) -> Command {
    let found = Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {name}"))
        .output()
        .is_ok_and(|o| o.status.success());
    assert!(found, "{name} is missing (packages e2fsprogs and gdisk)");
    Command::new(name)
}

/// An 8 MiB ext4 file system with a few directories, files and a symlink.
fn ext4(dir: &Path) -> Vec<u8> {
    let root = dir.join("root");
    std::fs::create_dir_all(root.join("etc/sub")).unwrap();
    std::fs::write(root.join("etc/hostname"), b"web01\n").unwrap();
    std::fs::write(root.join("etc/sub/big"), vec![7u8; 300_000]).unwrap();
    for i in 0..40 {
        std::fs::write(root.join(format!("etc/f{i}")), format!("{i}\n")).unwrap();
    }
    std::os::unix::fs::symlink("sub/big", root.join("etc/link")).unwrap();
    let img = dir.join("fs.img");
    let st = tool("mkfs.ext4")
        .args(["-q", "-F", "-b", "1024", "-d"])
        .arg(&root)
        .arg(&img)
        .arg("8M")
        .status()
        .unwrap();
    assert!(st.success());
    std::fs::read(img).unwrap()
}

/// The bare file system, and the same as partition 1 of a 10 MiB GPT disk.
fn images() -> &'static (Vec<u8>, Vec<u8>) {
    static IMAGES: OnceLock<(Vec<u8>, Vec<u8>)> = OnceLock::new();
    IMAGES.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let fs = ext4(dir.path());
        let disk_path = dir.path().join("disk.img");
        let mut disk = vec![0u8; 10 << 20];
        disk[1 << 20..(1 << 20) + fs.len()].copy_from_slice(&fs);
        std::fs::write(&disk_path, &disk).unwrap();
        let st = tool("sgdisk")
            .args(["-o", "-n", "1:2048:+8M"])
            .arg(&disk_path)
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(st.success());
        (fs, std::fs::read(disk_path).unwrap())
    })
}

/// Everything `ls` and `cat` would do with the image: find the file system, list `/etc`,
/// read every file in it (symlinks followed). Errors are fine; the count of what was read
/// shows the walk got somewhere.
fn walk(image: Vec<u8>) -> usize {
    let disk = DiskReader::over(Arc::new(image));
    let Ok(fs) = GuestFs::open(&disk, None) else {
        return 0;
    };
    let mut read = 0;
    for dir in ["/", "/etc", "/etc/sub"] {
        let Ok(entries) = fs.list(dir) else { continue };
        for e in entries {
            let path = format!("{}/{}", dir.trim_end_matches('/'), e.name);
            if let Ok((mut f, _)) = fs.open_file(&path) {
                let mut sink = Vec::new();
                if std::io::Read::read_to_end(&mut f, &mut sink).is_ok() {
                    read += 1;
                }
            }
        }
    }
    read
}

#[test]
fn the_undamaged_images_read_whole() {
    let (fs, disk) = images();
    // /etc: hostname, link, sub is a directory, f0..f39; /etc/sub: big.
    assert_eq!(walk(fs.clone()), 43);
    assert_eq!(walk(disk.clone()), 43);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, ..ProptestConfig::default() })]

    #[test]
    fn damaged_metadata_gives_an_error_not_a_panic(
        gpt in any::<bool>(),
        flips in proptest::collection::vec((0usize..(2 << 20), any::<u8>()), 1..48),
        cut in proptest::option::of(0usize..(10 << 20)),
    ) {
        let (fs, disk) = images();
        let mut image = if gpt { disk.clone() } else { fs.clone() };
        // Most metadata lies in the first 2 MiB: superblock, group descriptors, bitmaps,
        // inode tables, directories (and the GPT's headers and entries).
        for (at, byte) in flips {
            let at = at % image.len();
            image[at] = byte;
        }
        if let Some(cut) = cut {
            image.truncate(cut.min(image.len()));
        }
        walk(image);
    }
}

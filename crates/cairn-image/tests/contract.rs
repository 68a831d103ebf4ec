//! Every `DiskImage` of this crate keeps the contract (`cairn_image::contract::check`): a
//! sparse raw file, qcow2 images made by qemu-img (flat, compressed, with zero clusters) and a
//! three-layer qcow2 backing chain written with qemu-io.

mod common;

use std::path::Path;
use std::sync::Arc;

use cairn_image::qcow2::{OpenOptions, Qcow2Image};
use cairn_image::{contract, RawImage, RawOptions};
use common::*;

const SIZE: u64 = 6 << 20;

fn qcow2(path: &Path) -> Arc<Qcow2Image> {
    Arc::new(Qcow2Image::open(path, OpenOptions::default()).unwrap())
}

#[test]
fn a_sparse_raw_file_keeps_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("a.raw");
    let data = make_raw(&path, SIZE + 12_345, 1);
    contract::check(
        Arc::new(RawImage::open(&path, RawOptions::default()).unwrap()),
        &data,
    );
}

#[test]
fn qcow2_images_keep_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("a.raw");
    let data = make_raw(&raw, SIZE, 2);
    for (name, opts) in [
        ("plain.qcow2", vec!["-o", "cluster_size=65536"]),
        ("small.qcow2", vec!["-o", "cluster_size=4096"]),
        ("deflate.qcow2", vec!["-c", "-o", "cluster_size=16384"]),
        ("v2.qcow2", vec!["-o", "compat=0.10"]),
    ] {
        let img = dir.path().join(name);
        let mut args = vec!["convert", "-f", "raw", "-O", "qcow2"];
        args.extend(opts);
        args.extend([s(&raw), s(&img)]);
        qemu_img(&args);
        contract::check(qcow2(&img), &data);
    }
    // Zero clusters (written with -z), allocated or not.
    let img = dir.path().join("zeros.qcow2");
    qemu_img(&["convert", "-f", "raw", "-O", "qcow2", s(&raw), s(&img)]);
    qemu_io(&["-f", "qcow2", "-c", "write -z 1M 256k", s(&img)]);
    qemu_io(&["-f", "qcow2", "-c", "write -z -u 3M 128k", s(&img)]);
    let mut zeroed = data.clone();
    zeroed[1 << 20..(1 << 20) + (256 << 10)].fill(0);
    zeroed[3 << 20..(3 << 20) + (128 << 10)].fill(0);
    contract::check(qcow2(&img), &zeroed);
}

#[test]
fn a_qcow2_backing_chain_keeps_the_contract() {
    let dir = tempfile::tempdir().unwrap();
    let layers: [(&str, &[&str]); 3] = [
        ("base", &["write -P 0xaa 0 2M"]),
        ("mid", &["write -P 0xbb 1M 2M"]),
        ("top", &["write -P 0xcc 2560k 64k", "write -z 512k 64k"]),
    ];
    let mut backing: Option<std::path::PathBuf> = None;
    for (name, writes) in layers {
        let path = dir.path().join(format!("{name}.qcow2"));
        match &backing {
            None => qemu_img(&["create", "-f", "qcow2", s(&path), &SIZE.to_string()]),
            Some(b) => qemu_img(&["create", "-f", "qcow2", "-F", "qcow2", "-b", s(b), s(&path)]),
        };
        for w in writes {
            qemu_io(&["-f", "qcow2", "-c", w, s(&path)]);
        }
        backing = Some(path);
    }
    let top = backing.expect("three layers");
    let mut data = vec![0u8; SIZE as usize];
    data[..2 << 20].fill(0xaa);
    data[1 << 20..3 << 20].fill(0xbb);
    data[2560 << 10..2624 << 10].fill(0xcc);
    data[512 << 10..576 << 10].fill(0);
    contract::check(qcow2(&top), &data);
}

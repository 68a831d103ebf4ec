#!/usr/bin/env python3
"""Operator safety on real devices and file systems (needs root: tmpfs and loop mounts).

- Full disk: a repository on a small tmpfs is filled by commits until one fails with the
  one-line "file system is full" error, then the file system is filled to its last block
  with a filler file. `cairn rm` and `cairn gc` must still work there (they release the
  repository's space reserve), free space, and leave every remaining version intact.
- Full disk, encrypted format 2: the commit that does not fit fails with the same line and
  publishes nothing; every earlier version verifies and restores bit-exact. A relayout on
  the full disk fails with the same line and marks nothing; with room again it works.
- A mounted device: `cairn restore --force` (and `--in-place`) onto a loop device whose file
  system is mounted is refused and changes nothing, as is `--in-place` into the file the loop
  device is backed by; once unmounted, the restore works bit-exact, and `--in-place` onto the
  device then writes only the blocks that differ.

    scripts/safety.py [--bin target/release/cairn]

Prints "safety: N passed, M failed" and exits non-zero on any failure.
"""

import argparse
import contextlib
import json
import os
import random
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Cairn, Checks, as_plain, sh, sha  # noqa: E402


def free_bytes(path):
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def tmpfs(work, name, size):
    """A tmpfs of `size` mounted at work/name for the block; unmounted after."""
    mnt = os.path.join(work, name)
    os.makedirs(mnt)
    sh("mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", mnt)
    try:
        yield mnt
    finally:
        sh("umount", mnt, check=False)


def fill_until_full(cairn, src, rng, size, tries):
    """Commits `size` random bytes as a new version of vm until one fails; returns ({seq:
    sha256} of the versions that fit, the failed command or None)."""
    kept = {}
    for _ in range(tries):
        with open(src, "wb") as f:
            f.write(rng.randbytes(size))
        p = cairn.run("--json", "commit", "vm", src, check=False)
        if p.returncode != 0:
            return kept, p
        kept[json.loads(p.stdout)["seq"]] = sha(src)
    return kept, None


def fill_to_the_last_block(mnt):
    """Fills the file system at `mnt` with a file of ones until a write fails; its path."""
    filler = os.path.join(mnt, "filler")
    with open(filler, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\1" * 4096)
        except OSError:
            pass
    return filler


def full_disk_line(repo):
    return (f"cairn: error: the file system of {repo} is full: free space, or delete "
            "versions with `cairn rm` or `cairn prune` (they can run on a full disk)")


def full_disk(binary, work, c):
    print("full disk: rm and gc free space on a 100% full tmpfs")
    with tmpfs(work, "tmpfs", "80m") as mnt:
        repo = os.path.join(mnt, "repo")
        cairn = Cairn(binary, repo)
        cairn.run("init", "--reserve", "8M", "--pack-size", "4M")
        rng = random.Random(3)
        src = os.path.join(work, "disk.raw")  # on the big disk, not on the tmpfs
        kept, failure = fill_until_full(cairn, src, rng, 12 << 20, 39)
        c.ok(failure is not None and len(kept) >= 3,
             f"commits fill the file system ({len(kept)} versions fit)")
        if failure is None:
            return
        lines = as_plain(failure.stderr).strip().splitlines()
        c.ok(len(lines) == 1 and lines[0] == full_disk_line(repo),
             f"a commit on a full disk fails with one line: {failure.stderr.strip()!r}")
        # Fill what is left to the last block.
        filler = fill_to_the_last_block(mnt)
        c.ok(free_bytes(mnt) == 0, f"the file system is 100% full ({free_bytes(mnt)} bytes free)")
        p = cairn.run("verify", check=False)
        c.ok(p.returncode == 0, f"verify works on the full disk: {p.stderr.strip()[-200:]}")

        p = cairn.run("--json", "rm", "vm@1", "vm@2", check=False)
        c.ok(p.returncode == 0, f"rm works on the full disk: {p.stderr.strip()}")
        freed = free_bytes(mnt)
        c.ok(freed > 16 << 20, f"rm freed the space of two versions ({freed} bytes free now)")
        if p.returncode == 0:
            gc = json.loads(p.stdout).get("gc") or {}
            c.ok(gc.get("freed_versions") == 2, f"rm's fast deletion freed both versions: {gc}")
        p = cairn.run("--json", "gc", "--repair", check=False)
        c.ok(p.returncode == 0, f"gc --repair works afterwards: {p.stderr.strip()}")
        reserve = os.path.join(repo, ".cairn-reserve")
        c.ok(os.path.getsize(reserve) >= 8 << 20,
             f"the space reserve is reallocated once there is room "
             f"({os.path.getsize(reserve)} bytes)")
        p = cairn.run("verify", check=False)
        c.ok(p.returncode == 0, f"verify clean after freeing: {p.stdout.strip()[-200:]}")
        out = os.path.join(work, "restored.raw")
        for seq, digest in sorted(kept.items()):
            if seq <= 2:
                continue
            p = cairn.run("restore", f"vm@{seq}", out, "--force", check=False)
            c.ok(p.returncode == 0 and sha(out) == digest,
                 f"vm@{seq} restores bit-exact after the full disk: {p.stderr.strip()}")
        os.remove(filler)
        p = cairn.run("commit", "vm", src, check=False)
        c.ok(p.returncode == 0, f"commits work again once space is freed: {p.stderr.strip()}")


def full_disk_encrypted(binary, work, c):
    """An encrypted format 2 repository on a full tmpfs: the commit that does not fit fails
    with the same one line, nothing it wrote is published, every earlier version verifies
    and restores bit-exact. (`rm` then `gc` on a full file system is checked above, on a
    plain repository.)"""
    print("full disk: an encrypted format 2 commit fails cleanly and loses nothing")
    with tmpfs(work, "tmpfs2", "48m") as mnt:
        repo = os.path.join(mnt, "repo")
        cairn = Cairn(binary, repo)
        cairn.env["CAIRN_PASSWORD"] = "safety passphrase"
        cairn.run("init", "--encrypt", "--reserve", "4M", "--pack-size", "4M")
        rng = random.Random(5)
        # An image whose second version lies in two packs (every other pair of 64 KiB blocks
        # rewritten), for the relayout below.
        scattered = os.path.join(work, "scattered.raw")
        image = bytearray(rng.randbytes(4 << 20))
        with open(scattered, "wb") as f:
            f.write(image)
        cairn.run("commit", "scat", scattered)
        for block in range(64):
            if block % 4 in (1, 2):
                image[block << 16:(block + 1) << 16] = rng.randbytes(1 << 16)
        with open(scattered, "wb") as f:
            f.write(image)
        cairn.run("commit", "scat", scattered)
        scattered_sha = sha(scattered)
        src = os.path.join(work, "disk2.raw")
        kept, failure = fill_until_full(cairn, src, rng, 8 << 20, 29)
        c.ok(failure is not None and len(kept) >= 2,
             f"encrypted commits fill the file system ({len(kept)} versions fit)")
        if failure is None:
            return
        lines = as_plain(failure.stderr).strip().splitlines()
        c.ok(len(lines) == 1 and lines[0] == full_disk_line(repo),
             f"an encrypted commit on a full disk fails with one line: "
             f"{failure.stderr.strip()!r}")
        c.ok(cairn.versions("vm") == len(kept),
             f"the failed commit published nothing ({cairn.versions('vm')} versions listed, "
             f"{len(kept)} committed)")
        p = cairn.run("verify", check=False)
        c.ok(p.returncode == 0, f"verify clean on the full disk: {p.stdout.strip()[-200:]}"
                                f"{p.stderr.strip()[-200:]}")
        out = os.path.join(work, "restored2.raw")
        for seq, digest in sorted(kept.items()):
            p = cairn.run("restore", f"vm@{seq}", out, "--force", check=False)
            c.ok(p.returncode == 0 and sha(out) == digest,
                 f"vm@{seq} restores bit-exact from the full disk: {p.stderr.strip()}")

        # A relayout, which only adds objects, fails the same way and adds nothing.
        filler = fill_to_the_last_block(mnt)
        p = cairn.run("relayout", "scat@2", "--alpha", "1", check=False)
        lines = as_plain(p.stderr).strip().splitlines()
        c.ok(p.returncode != 0 and len(lines) == 1 and lines[0] == full_disk_line(repo),
             f"a relayout on a full disk fails with one line (exit {p.returncode}): "
             f"{p.stderr.strip()!r}")
        layout = os.path.join(repo, "layout")
        c.ok(not os.path.exists(layout) or not os.listdir(layout),
             "the failed relayout marked no pack")
        os.remove(filler)
        p = cairn.run("verify", check=False)
        c.ok(p.returncode == 0, f"verify clean after the failed relayout: "
                                f"{p.stdout.strip()[-200:]}{p.stderr.strip()[-200:]}")
        p = cairn.run("restore", "scat@2", out, "--force", check=False)
        c.ok(p.returncode == 0 and sha(out) == scattered_sha,
             f"scat@2 restores bit-exact after the failed relayout: {p.stderr.strip()}")
        p = cairn.run("--json", "relayout", "scat@2", "--alpha", "1", check=False)
        copied = json.loads(p.stdout)["groups_copied"] if p.returncode == 0 else None
        c.ok(bool(copied), f"with room again, the relayout copies ({copied} groups): "
                           f"{p.stderr.strip()}")


def mounted_device(binary, work, c):
    print("restore onto a mounted loop device is refused")
    repo = os.path.join(work, "repo-dev")
    cairn = Cairn(binary, repo)
    cairn.run("init", "--reserve", "0")
    img = os.path.join(work, "dev.img")
    with open(img, "wb") as f:
        f.truncate(64 << 20)
    # No lazy initialisation, and mounted read-only below: a read-write ext4 mount zeroes its
    # inode tables in the background (ext4lazyinit), which changed the device under the
    # "unchanged" check. A read-only mount holds the device just as exclusively.
    sh("mkfs.ext4", "-q", "-F", "-E", "lazy_itable_init=0,lazy_journal_init=0", img)
    src = os.path.join(work, "small.raw")
    with open(src, "wb") as f:
        f.write(random.Random(4).randbytes(32 << 20))
    cairn.run("commit", "small", src)
    dev = sh("losetup", "--find", "--show", img).stdout.strip()
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt)
    try:
        sh("mount", "-o", "ro", dev, mnt)
        try:
            before = sha(dev)
            p = cairn.run("restore", "small", dev, "--force", check=False)
            lines = p.stderr.strip().splitlines()
            c.ok(p.returncode == 1 and len(lines) == 1 and lines[0] ==
                 f"cairn: error: will not restore to {dev}: the device is in use (mounted, or "
                 "held open exclusively by another process)",
                 f"restore onto a mounted device is refused with one line: {p.stderr.strip()!r}")
            c.ok(sha(dev) == before, "the mounted device is unchanged")
            p = cairn.run("restore", "small", dev, check=False)
            c.ok(p.returncode == 1 and "pass --force" in p.stderr,
                 f"without --force a block device is refused: {p.stderr.strip()!r}")
            p = cairn.run("restore", "small", dev, "--in-place", check=False)
            c.ok(p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1
                 and "the device is in use" in p.stderr,
                 f"an in-place restore onto a mounted device is refused: {p.stderr.strip()!r}")
            p = cairn.run("restore", "small", img, "--in-place", "--resize", check=False)
            c.ok(p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1
                 and f"it backs the loop device {dev}" in p.stderr,
                 f"an in-place restore into the file under a loop device is refused: "
                 f"{p.stderr.strip()!r}")
            c.ok(sha(dev) == before, "the mounted device is still unchanged")
        finally:
            sh("umount", mnt)
        p = cairn.run("restore", "small", dev, "--force", check=False)
        c.ok(p.returncode == 0, f"the unmounted device takes the restore: {p.stderr.strip()}")
        with open(dev, "rb") as f:
            data = f.read(32 << 20)
        with open(src, "rb") as f:
            c.ok(data == f.read(), "the device holds the version bit-exact")
        # In place: a device larger than the version keeps its tail; only what differs is
        # written (zeros as zeros: a device has no holes).
        with open(dev, "r+b") as f:
            f.seek(1 << 20)
            f.write(b"\x55" * 4096)
            f.seek(20 << 20)
            f.write(b"\x66" * 8192)
        p = cairn.run("--json", "restore", "small", dev, "--in-place", check=False)
        r = json.loads(p.stdout) if p.returncode == 0 else {}
        c.ok(r.get("method") == "compare" and r.get("written_bytes") == 3 * 4096,
             f"an in-place restore onto the device writes the three blocks that differ: "
             f"{r or p.stderr.strip()}")
        with open(dev, "rb") as f:
            data = f.read(32 << 20)
        with open(src, "rb") as f:
            c.ok(data == f.read(), "the device holds the version bit-exact after --in-place")
    finally:
        sh("losetup", "-d", dev, check=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.environ.get("CAIRN_BIN", "target/release/cairn"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("safety: needs root (tmpfs and loop mounts)")
    for tool in ("mkfs.ext4", "losetup", "mount"):
        if not shutil.which(tool):
            sys.exit(f"safety: {tool} is missing (Debian packages e2fsprogs, util-linux, mount)")
    binary = os.path.abspath(args.bin)
    work = tempfile.mkdtemp(prefix="cairn-safety-", dir=os.environ.get("CAIRN_TEST_TMP"))
    c = Checks()
    try:
        full_disk(binary, work, c)
        full_disk_encrypted(binary, work, c)
        mounted_device(binary, work, c)
    except Exception as e:  # noqa: BLE001 - one failure line, then the summary
        c.ok(False, f"{type(e).__name__}: {e}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"safety: {c.passed} passed, {c.failed} failed")
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())

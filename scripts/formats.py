#!/usr/bin/env python3
"""Real VM disk formats end to end, against the real QEMU tools.

- qcow2 round trips: each dataset image converted with `qemu-img convert -O qcow2` (v3, v2
  and compressed) is committed and restored; `qemu-img compare` against the raw original
  must report identical. `restore --format qcow2` must pass `qemu-img check` and compare
  identical too.
- Backing chains of three levels (minimal overlays made by `qemu-img rebase`): a full commit
  of the top reads
  through the chain; then the chain is committed level by level, and each overlay commit must
  be incremental (the backing file was committed just before: found automatically), read
  only the overlay's clusters and restore bit-exact; `--parent` does the same explicitly.
- NBD sources: a vmdk served by qemu-nbd is committed over `nbd+unix://`.
- Changed-block tracking: qemu-storage-daemon serves a qcow2 with a persistent dirty bitmap
  created over QMP; after writes through NBD, `commit --dirty-bitmap` reads only the dirty
  extents; restore compares identical. Twice, clearing the bitmap in between.
- Restore onto a block device (a loop device).
- Polite scans: after a commit, the source's pages that the scan brought in are gone from
  the page cache while a busy file stays cached; with --keep-cache they stay; --direct and
  --rate-limit commits restore bit-exact.
- Errors: truncated qcow2, missing backing file, encrypted qcow2, missing dirty bitmap, an
  NBD server killed mid-commit: one line, non-zero exit, no version published, verify clean.

    scripts/formats.py --dataset DIR [--bin target/release/cairn]

Needs root (loop devices) and qemu-utils, qemu-system-common (qemu-storage-daemon),
util-linux (fincore, losetup). Prints "formats: N passed, 0 failed"; exits non-zero on
any failure.
"""

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Cairn, Checks, sh, sha  # noqa: E402
from qemu_helpers import StorageDaemon as Qsd, need_tools, stop, wait_for  # noqa: E402

CHECKS = Checks()
ok = CHECKS.ok


def identical(a, fmt_a, raw_b, what):
    p = sh("qemu-img", "compare", "-f", fmt_a, "-F", "raw", a, raw_b, check=False)
    return ok(p.returncode == 0 and "Images are identical" in p.stdout,
              f"{what}: qemu-img compare: {p.stdout.strip()} {p.stderr.strip()}")


def one_error_line(p, needle, what):
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    good = p.returncode != 0 and len(lines) == 1 and needle in lines[0]
    ok(good, f"{what}: expected one error line containing {needle!r}, got exit {p.returncode}: "
             f"{p.stderr.strip()!r}")
    if good:
        print(f"  {what}: {lines[0]}")


def resident(path):
    out = sh("fincore", "-b", "-n", "-o", "RES", path).stdout.split()
    return int(out[0]) if out else 0


def evict(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def round_trips(c, work, images):
    print("qcow2 round trips")
    variants = [("v3", []), ("v2", ["-o", "compat=0.10"]), ("compressed", ["-c"])]
    for i, raw in enumerate(images):
        name, opts = variants[i % len(variants)]
        q = os.path.join(work, f"rt-{i}-{name}.qcow2")
        sh("qemu-img", "convert", "-O", "qcow2", *opts, raw, q)
        image = f"rt/{i}"
        v = c.json("commit", image, q)
        ok(v["logical_bytes"] == os.path.getsize(raw), f"{name}: logical size")
        ok(v["incremental"] is None, f"{name}: a flat qcow2 is committed in full")
        out = os.path.join(work, f"rt-{i}.raw")
        c.run("restore", image, out, "--force")
        identical(out, "raw", raw, f"{name} qcow2 {os.path.basename(raw)} → commit → restore")
        os.unlink(out)
        os.unlink(q)
        if i == 0:
            oq = os.path.join(work, "rt-out.qcow2")
            c.run("restore", image, oq, "--format", "qcow2", "--force")
            p = sh("qemu-img", "check", oq, check=False)
            ok(p.returncode == 0 and "No errors were found" in p.stdout,
               f"restore --format qcow2: qemu-img check: {p.stdout.strip()} {p.stderr.strip()}")
            identical(oq, "qcow2", raw, "restore --format qcow2")
            size = os.path.getsize(oq)
            data = os.stat(raw).st_blocks * 512
            ok(size <= data * 1.05 + (8 << 20),
               f"restore --format qcow2 is compact: {size} bytes for {data} bytes of data")
            os.unlink(oq)


def chains(c, work, images, state_dir):
    print("backing chains of three levels")
    base, mid, top = (os.path.join(work, f"{n}.qcow2") for n in ("base", "mid", "top"))
    sh("qemu-img", "convert", "-O", "qcow2", images[0], base)
    # Minimal overlays, as a VM writing to an overlay makes them: an empty overlay on the
    # next raw image, rebased (safe mode) onto the previous level, keeps exactly the
    # clusters that differ. (`qemu-img convert -B` would copy every data cluster.)
    for path, raw, backing in ((mid, images[1], base), (top, images[2], mid)):
        sh("qemu-img", "create", "-q", "-f", "qcow2", "-b", raw, "-F", "raw", path)
        sh("qemu-img", "rebase", "-f", "qcow2", "-b", os.path.basename(backing), "-F", "qcow2",
           path, cwd=work)

    # A full commit through the chain (nothing known about its files).
    fresh = Cairn(c.binary, c.repo, os.path.join(state_dir, "fresh"))
    v = fresh.json("commit", "chain-full", top)
    ok(v["incremental"] is None, "an unknown chain is committed in full")
    out = os.path.join(work, "chain.raw")
    fresh.run("restore", "chain-full", out, "--force")
    identical(out, "raw", images[2], "full commit of a 3-level chain")
    # The same with `qemu-img convert -B` chains (every data and zero cluster copied into
    # each level, zero clusters over the backing's data).
    cmid, ctop = os.path.join(work, "cmid.qcow2"), os.path.join(work, "ctop.qcow2")
    sh("qemu-img", "convert", "-O", "qcow2", "-B", "base.qcow2", "-F", "qcow2", images[1], cmid,
       cwd=work)
    sh("qemu-img", "convert", "-O", "qcow2", "-B", "cmid.qcow2", "-F", "qcow2", images[2], ctop,
       cwd=work)
    fresh.run("commit", "chain-b", ctop)
    fresh.run("restore", "chain-b", out, "--force")
    identical(out, "raw", images[2], "full commit of a 3-level `convert -B` chain")
    os.unlink(ctop)
    os.unlink(cmid)

    # Level by level: each overlay's backing file was just committed, so only its clusters
    # are read.
    c.json("commit", "chain", base)
    for level, (path, raw) in enumerate([(mid, images[1]), (top, images[2])], start=2):
        v = c.json("commit", "chain", path)
        inc = v["incremental"]
        ok(inc is not None and f"chain@{level - 1}" in inc["basis"],
           f"overlay level {level} is incremental on chain@{level - 1}: {inc}")
        overlay = sum(r["length"] for r in json.loads(sh(
            "qemu-img", "map", "--output=json", path).stdout) if r["depth"] == 0 and r["data"])
        ok(v["read_bytes"] <= overlay + (1 << 20) and v["read_bytes"] < v["data_bytes"],
           f"level {level} read {v['read_bytes']} bytes; the overlay holds {overlay}, the image "
           f"{v['data_bytes']}")
        c.run("restore", f"chain@{level}", out, "--force")
        identical(out, "raw", raw, f"incremental commit of overlay level {level}")

    # --parent: explicit, with no records.
    explicit = Cairn(c.binary, c.repo, os.path.join(state_dir, "explicit"))
    v = explicit.json("commit", "chain-p", top, "--parent", "chain@2")
    ok(v["incremental"] is not None, "--parent makes an overlay commit incremental")
    explicit.run("restore", "chain-p", out, "--force")
    identical(out, "raw", images[2], "incremental commit with --parent")
    p = explicit.run("commit", "chain-p", images[0], "--parent", "chain@2", check=False)
    one_error_line(p, "--parent needs a qcow2 overlay", "--parent with a raw file")
    # A backing file that changed after it was recorded is no longer trusted: the commit
    # falls back to the deepest layer still unchanged (base, chain@1).
    os.utime(mid)
    v = c.json("commit", "chain-t", top)
    inc = v["incremental"]
    ok(inc is not None and "chain@1" in inc["basis"] and "base.qcow2" in inc["basis"],
       f"a touched backing file is not trusted; base.qcow2 still is: {inc}")
    c.run("restore", "chain-t", out, "--force")
    identical(out, "raw", images[2], "incremental commit on the untouched deeper layer")
    os.unlink(out)
    return base, mid, top


def nbd_source(c, work, raw):
    print("NBD source (a vmdk served by qemu-nbd)")
    vmdk = os.path.join(work, "disk.vmdk")
    sh("qemu-img", "convert", "-O", "vmdk", raw, vmdk)
    sock = os.path.join(work, "nbd.sock")
    srv = subprocess.Popen(["qemu-nbd", "-r", "-f", "vmdk", "-k", sock, "-x", "disk", "-t", vmdk],
                           stderr=subprocess.PIPE, text=True)
    try:
        wait_for(sock, srv, "qemu-nbd")
        url = f"nbd+unix:///disk?socket={sock}"
        v = c.json("commit", "nbd/vmdk", url)
        ok(v["read_bytes"] < v["logical_bytes"], "holes are skipped via base:allocation")
        out = os.path.join(work, "nbd.raw")
        c.run("restore", "nbd/vmdk", out, "--force")
        identical(out, "raw", raw, "vmdk over nbd+unix → commit → restore")
        os.unlink(out)
        p = c.run("commit", "nbd/vmdk", url, "--dirty-bitmap", "nope", check=False)
        one_error_line(p, "nope", "a dirty bitmap the export does not have")
        ok(c.versions("nbd/vmdk") == 1, "nothing published after the bitmap error")
    finally:
        stop(srv)
        os.unlink(vmdk)


class StorageDaemon:
    """qemu-storage-daemon serving one qcow2 as NBD export "disk" on a Unix socket, with a
    QMP monitor and a persistent dirty bitmap b0 (64 KiB granularity) exported with it."""

    def __init__(self, work, disk):
        self.qsd = Qsd(work, [f"driver=file,node-name=file0,filename={disk}",
                              "driver=qcow2,node-name=disk0,file=file0"])
        self.qmp = self.qsd.qmp
        try:
            # The bitmap must exist before the export that exposes it.
            self.qmp.cmd("block-dirty-bitmap-add", node="disk0", name="b0", persistent=True,
                         granularity=65536)
            self.export()
        except Exception:
            self.stop()
            raise
        self.url = self.qsd.url("disk")

    def export(self):
        self.qsd.export("exp0", "disk0", "disk", writable=True, bitmaps=["b0"])

    def clear_bitmap(self):
        """Starts the next round: an exported bitmap is busy, so take the export down, clear
        the bitmap, export again (no writes can happen in between)."""
        self.qmp.cmd("block-export-del", id="exp0")
        for _ in range(100):
            try:
                self.qmp.cmd("block-dirty-bitmap-clear", node="disk0", name="b0")
                break
            except RuntimeError:
                time.sleep(0.05)
        else:
            raise RuntimeError("the export did not release bitmap b0")
        self.export()

    def stop(self):
        self.qsd.stop()


def dirty_bitmaps(c, work, raw):
    print("changed-block tracking: qemu-storage-daemon + QMP dirty bitmap")
    disk = os.path.join(work, "cbt.qcow2")
    sh("qemu-img", "convert", "-O", "qcow2", raw, disk)
    qsd = StorageDaemon(work, disk)
    try:
        url = qsd.url
        c.json("commit", "cbt", url)  # cbt@1: the bitmap was created with it
        size = os.path.getsize(raw)
        for round_ in (1, 2):
            writes = [(size * k // 23 // 65536 * 65536 + 4096 * round_, 192 << 10)
                      for k in range(1, 23, 3)]
            args = []
            for off, n in writes:
                args += ["-c", f"write -P 0x{0x40 + round_:x} {off} {n}"]
            sh("qemu-io", "-f", "raw", url, *args)
            v = c.json("commit", "cbt", url, "--dirty-bitmap", "b0")
            inc = v["incremental"]
            written = sum(n for _, n in writes)
            ok(inc is not None and "dirty bitmap b0" in inc["basis"],
               f"round {round_}: --dirty-bitmap commit is incremental: {inc}")
            ok(v["read_bytes"] <= written + len(writes) * 2 * 65536,
               f"round {round_}: read {v['read_bytes']} bytes for {written} bytes written")
            # Once the version is safe, the operator starts the next round.
            qsd.clear_bitmap()
            out = os.path.join(work, "cbt.raw")
            c.run("restore", f"cbt@{round_ + 1}", out, "--force")
            expect = os.path.join(work, "cbt-expected.raw")
            sh("qemu-img", "convert", "-f", "raw", "-O", "raw", url, expect)
            identical(out, "raw", expect, f"round {round_}: dirty-bitmap commit → restore")
            os.unlink(out)
            os.unlink(expect)
    finally:
        qsd.stop()
        os.unlink(disk)


def block_device(c, work, raw):
    print("restore onto a block device (loop device)")
    backing = os.path.join(work, "loop.img")
    with open(backing, "wb") as f:
        f.truncate(os.path.getsize(raw))
    # Garbage where the image has zeros: the restore must write them.
    with open(backing, "r+b") as f:
        for k in range(0, os.path.getsize(raw), 64 << 20):
            f.seek(k)
            f.write(b"\xee" * 65536)
    dev = sh("losetup", "-f", "--show", backing).stdout.strip()
    try:
        c.run("restore", "rt/0", dev, "--force")
        ok(sha(dev) == sha(raw), f"restore onto {dev} is bit-exact (zeros written)")
        p = c.run("restore", "rt/0", dev, "--format", "qcow2", "--force", check=False)
        one_error_line(p, "a block device takes raw output", "--format qcow2 onto a device")
    finally:
        sh("losetup", "-d", dev, check=False)
        os.unlink(backing)


def polite(c, work, raw):
    print("polite scans: page cache, --rate-limit, --direct")
    busy = os.path.join(work, "busy.bin")
    with open(busy, "wb") as f:
        f.write(os.urandom(64 << 20))
    with open(busy, "rb") as f:
        while f.read(1 << 22):
            pass
    busy_before = resident(busy)
    evict(raw)
    data = os.stat(raw).st_blocks * 512
    c.run("commit", "polite", raw)
    after = resident(raw)
    ok(after <= data * 0.02, f"after a commit {after} of {data} bytes of the source stay cached")
    ok(resident(busy) >= busy_before * 0.99,
       f"the busy file stays cached ({resident(busy)} of {busy_before} bytes)")
    print(f"  page cache after commit: source {after} / {data} bytes, busy file "
          f"{resident(busy)} / {busy_before} bytes")
    evict(raw)
    c.run("commit", "polite", raw, "--keep-cache")
    ok(resident(raw) >= data * 0.5, f"--keep-cache: {resident(raw)} of {data} bytes cached")
    out = os.path.join(work, "polite.raw")
    c.run("commit", "polite", raw, "--direct")
    c.run("restore", "polite", out, "--force")
    ok(sha(out) == sha(raw), "--direct commit restores bit-exact")
    small = os.path.join(work, "small.raw")
    with open(small, "wb") as f:
        f.write(os.urandom(48 << 20))
    started = time.monotonic()
    c.run("commit", "polite-rate", small, "--rate-limit", "64")
    took = time.monotonic() - started
    ok(took >= 0.6, f"--rate-limit 64 MiB/s: 48 MiB took {took:.2f} s (≥ 0.65 s expected)")
    c.run("restore", "polite-rate", out, "--force")
    ok(sha(out) == sha(small), "--rate-limit commit restores bit-exact")
    for p in (out, small, busy):
        os.unlink(p)


def errors(c, work, raw, base, mid, top):
    print("errors: one line, non-zero exit, nothing published")
    before = c.versions("err")
    trunc = os.path.join(work, "trunc.qcow2")
    shutil.copy(base, trunc)
    os.truncate(trunc, os.path.getsize(base) * 6 // 10)
    one_error_line(c.run("commit", "err", trunc, check=False), "past the end of the file",
                   "truncated qcow2")
    lonely = os.path.join(work, "lonely")
    os.makedirs(lonely)
    shutil.copy(top, os.path.join(lonely, "top.qcow2"))
    one_error_line(c.run("commit", "err", os.path.join(lonely, "top.qcow2"), check=False),
                   "backing file", "missing backing file")
    enc = os.path.join(work, "enc.qcow2")
    # QEMU 7.2 times a PBKDF2 run with the thread's CPU clock to pick LUKS iterations, and gives
    # up ("Unable to get accurate CPU usage") when that clock has not ticked; try again then.
    for attempt in range(5):
        p = sh("qemu-img", "create", "-f", "qcow2", "--object", "secret,id=sec0,data=abc",
               "-o", "encrypt.format=luks,encrypt.key-secret=sec0", enc, "16M",
               check=(attempt == 4))
        if p.returncode == 0:
            break
        if "Unable to get accurate CPU usage" not in p.stderr:
            raise RuntimeError(f"qemu-img create (LUKS): exit {p.returncode}: {p.stderr.strip()}")
    one_error_line(c.run("commit", "err", enc, check=False), "encrypted", "encrypted qcow2")
    # An NBD server killed in the middle of a (rate-limited, so slow) commit.
    sock = os.path.join(work, "kill.sock")
    srv = subprocess.Popen(["qemu-nbd", "-r", "-f", "raw", "-k", sock, "-x", "disk", raw],
                           stderr=subprocess.PIPE, text=True)
    wait_for(sock, srv, "qemu-nbd")
    p = subprocess.Popen([c.binary, "--repo", c.repo, "-q", "commit", "err",
                          f"nbd+unix:///disk?socket={sock}", "--rate-limit", "40"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=c.env)
    time.sleep(1.5)
    srv.kill()
    srv.wait()
    _, err = p.communicate(timeout=120)
    p.stderr = err
    one_error_line(p, "disk", "NBD server killed mid-commit")
    ok(c.versions("err") == before, "no version published by any failed commit")
    v = c.run("verify", check=False)
    ok(v.returncode == 0, f"verify is clean after the failures: {v.stderr.strip()}")
    shutil.rmtree(lonely)
    for f in (trunc, enc):
        os.unlink(f)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--bin", default=os.path.join(os.path.dirname(__file__), "..", "target",
                                                  "release", "cairn"))
    args = ap.parse_args()
    need_tools("formats", "qemu-img", "qemu-io", "qemu-nbd", "qemu-storage-daemon", "fincore",
               "losetup")
    images = sorted(glob.glob(os.path.join(os.path.abspath(args.dataset), "su-*.raw")))[:3]
    if len(images) < 3:
        sys.exit(f"formats: need 3 su-*.raw images in {args.dataset}")
    work = os.path.abspath(tempfile.mkdtemp(prefix="cairn-formats-",
                                            dir=os.environ.get("CAIRN_TEST_TMP")))
    try:
        repo, state = os.path.join(work, "repo"), os.path.join(work, "state")
        c = Cairn(os.path.abspath(args.bin), repo, os.path.join(state, "main"))
        c.run("init")
        round_trips(c, work, images)
        base, mid, top = chains(c, work, images, state)
        nbd_source(c, work, images[0])
        dirty_bitmaps(c, work, images[1])
        block_device(c, work, images[0])
        polite(c, work, images[1])
        errors(c, work, images[2], base, mid, top)
        v = c.run("verify", check=False)
        ok(v.returncode == 0, f"final verify: {v.stderr.strip()}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"formats: {CHECKS.passed} passed, {CHECKS.failed} failed")
    sys.exit(1 if CHECKS.failed else 0)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Overlay snapshots against the disk's size (issue 56 item 5; iROW's Figs. 20–22): snapshot
create, rollback and delete on cairn's overlay and on a qcow2 image (`qemu-img snapshot`,
internal snapshots), written the same way, for disks of 1 to 64 GiB.

Per size, both sides do iROW's sequence, scaled so that 64 GiB fits this machine's disk:
1. fill: one 4 KiB block written in every MiB of the disk (every qcow2 L2 table and 1/16 of
   its clusters in use); **create** snapshot s1;
2. change: 4096 blocks written at random places; **rollback** to s1;
3. rewrite: the fill's blocks written again; **delete** s1.

cairn's side runs in one process (`cairn-overlay-bench`, the overlay API an export's NBD
writes use; flushed before each timed operation). qcow2's side writes through `qemu-io` and
times each `qemu-img snapshot` process; `qemu-img info` on the same image is timed too, so the
process start and image open (part of every `qemu-img` run) can be told apart from the
operation's own work.

    bench/overlay_snapshots.py --bin-dir target/ci [--sizes 1,2,4,8,16,32,64]
        [--dir SCRATCH] [--out FILE]

Prints one JSON document (also written to --out).
"""

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

GIB = 1 << 30
MIB = 1 << 20
CHANGES = 4096


def timed(cmd):
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t


def qemu_io(image, offsets, pattern):
    """Writes 4 KiB of `pattern` at each offset, one qemu-io process for all of them."""
    cmds = "".join(f"write -P {pattern} {o} 4k\n" for o in offsets)
    subprocess.run(["qemu-io", "-f", "qcow2", image], input=cmds.encode(), check=True,
                   stdout=subprocess.DEVNULL)


def best(f, n=3):
    return min(f() for _ in range(n))


def qcow2_side(work, gib):
    image = os.path.join(work, f"disk-{gib}g.qcow2")
    size = gib * GIB
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", image, str(size)], check=True)
    fill = list(range(0, size, MIB))
    rng = random.Random(gib)
    changes = [rng.randrange(size // 4096) * 4096 for _ in range(CHANGES)]
    qemu_io(image, fill, "0x5a")
    info_s = best(lambda: timed(["qemu-img", "info", image]))
    create_s = timed(["qemu-img", "snapshot", "-c", "s1", image])
    qemu_io(image, changes, "0x33")
    rollback_s = timed(["qemu-img", "snapshot", "-a", "s1", image])
    qemu_io(image, fill, "0x77")
    before = os.stat(image).st_blocks * 512
    delete_s = timed(["qemu-img", "snapshot", "-d", "s1", image])
    after = os.stat(image).st_blocks * 512
    os.unlink(image)
    return {"info_s": info_s, "create_s": create_s, "rollback_s": rollback_s,
            "delete_s": delete_s, "allocated_before_delete": before,
            "allocated_after_delete": after}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin-dir", required=True)
    p.add_argument("--sizes", default="1,2,4,8,16,32,64")
    p.add_argument("--dir")
    p.add_argument("--out")
    a = p.parse_args()
    sizes = [int(x) for x in a.sizes.split(",")]
    work = tempfile.mkdtemp(prefix="overlay-snapshots-", dir=a.dir)
    bench = os.path.join(a.bin_dir, "cairn-overlay-bench")
    qemu = subprocess.run(["qemu-img", "--version"], capture_output=True, text=True,
                          check=True).stdout.splitlines()[0]
    runs = []
    try:
        for gib in sizes:
            print(f"{gib} GiB: cairn", file=sys.stderr, flush=True)
            out = subprocess.run([bench, work, str(gib), "--changes", str(CHANGES)],
                                 check=True, capture_output=True, text=True).stdout
            cairn = json.loads(out)
            print(f"{gib} GiB: qcow2", file=sys.stderr, flush=True)
            qcow2 = qcow2_side(work, gib)
            runs.append({"size_gib": gib, "cairn": cairn, "qcow2": qcow2})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    first = runs[0]
    for r in runs:
        for op in ("create_s", "rollback_s", "delete_s"):
            r.setdefault("cairn_vs_smallest", {})[op] = r["cairn"][op] / first["cairn"][op]
            r.setdefault("qcow2_vs_smallest", {})[op] = r["qcow2"][op] / first["qcow2"][op]
            r.setdefault("cairn_vs_qcow2", {})[op] = r["cairn"][op] / r["qcow2"][op]
    doc = {"date": time.strftime("%Y-%m-%d"), "qemu": qemu, "block": 4096, "fill_stride": MIB,
           "changes": CHANGES, "runs": runs}
    text = json.dumps(doc, indent=1)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Restore locality over a long history (issue 56 item 4, CloudVS's fragmentation): one image
changed day by day for --versions days, committed to cairn after each day and kept beside it
as a qcow2 chain (one overlay a day, the way external snapshots pile up); then the oldest, a
middle and the newest version restored by each, with `cairn stats IMAGE@V`'s ranged reads per
GiB (seeks on a disk, requests on S3).

A day's change, seeded and the same for both: about 1% of the image's data rewritten in runs of
4–64 blocks of 4 KiB (a file updated or written), half of them blocks copied from elsewhere in
the image (data moved or duplicated), half existing blocks with a tenth of their bytes changed
(data edited). The image starts as the dataset's newest su-* image.

    bench/history_locality.py --dataset .data/small --bin target/ci/cairn [--versions 50]
        [--alphas 0,0.5,1] [--s3] [--dir SCRATCH] [--out FILE]
    scripts/minio.sh run bench/history_locality.py ... --s3     # the repository on MinIO

Then CloudVS's fragmentation parameter (§3.3): the newest version laid out again with
`cairn relayout vm@N --alpha A` for each α of --alphas in turn (each on top of the last: α = 1
after α = 0.5 re-stores what 0.5 left scattered), then the oldest at the largest α; after
each, `cairn gc --repair` (which gives back the old copies' packs) and the restores measured
again, with the bytes the relayout copied and the stored bytes before and after the GC.
(Relayout keeps one copy per id, so laying out every version in turn would only move shared
data from one version's order to the next's.)

Restores go to a file on the same disk and end with fsync; each is the best of two, with the
page cache warm (what is compared is the work of each reader, not the disk's). With --s3 the
repository is $CAIRN_TEST_S3_URL (scripts/minio.sh sets it) and the qcow2 chain stays local.
"""

import argparse
import glob
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from floor import BLOCK, data_extents  # noqa: E402


def data_blocks(path):
    """Indexes of the 4 KiB blocks in the allocated extents of a file."""
    with open(path, "rb") as f:
        return [b for start, stop in data_extents(f)
                for b in range(start // BLOCK, (stop + BLOCK - 1) // BLOCK)]


def day_changes(rng, img, blocks, fraction=0.01):
    """[(offset, bytes)] of one day's writes, read from the image as it is."""
    budget = max(1, int(len(blocks) * fraction))
    writes = []
    with open(img, "rb") as f:
        while budget > 0:
            n = min(budget, rng.randint(4, 64))
            at = rng.choice(blocks)
            if rng.random() < 0.5:
                src = rng.choice(blocks)
                f.seek(src * BLOCK)
                data = f.read(n * BLOCK)
            else:
                f.seek(at * BLOCK)
                data = bytearray(f.read(n * BLOCK))
                for _ in range(len(data) // 10):
                    data[rng.randrange(len(data))] = rng.randrange(256)
                data = bytes(data)
            data = data.ljust(n * BLOCK, b"\0")
            writes.append((at * BLOCK, data))
            budget -= n
    return writes


def timed(cmd, **kw):
    t = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, **kw)
    return time.perf_counter() - t


def fsynced(path):
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)


def best_of_two(run, out):
    times = []
    for _ in range(2):
        if os.path.exists(out):
            os.unlink(out)
        t = time.perf_counter()
        run(out)
        fsynced(out)
        times.append(time.perf_counter() - t)
    os.unlink(out)
    return min(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--bin", required=True)
    ap.add_argument("--versions", type=int, default=50)
    ap.add_argument("--dir")
    ap.add_argument("--out")
    ap.add_argument("--alphas", default="0,0.5,1",
                    type=lambda v: [float(x) for x in v.split(",")])
    ap.add_argument("--s3", action="store_true",
                    help="the repository at $CAIRN_TEST_S3_URL (scripts/minio.sh run sets it)")
    a = ap.parse_args()
    source = sorted(glob.glob(os.path.join(a.dataset, "su-*.raw")))[-1]
    work = tempfile.mkdtemp(prefix="history-", dir=a.dir)
    try:
        img = os.path.join(work, "vm.raw")
        subprocess.run(["cp", "--sparse=always", source, img], check=True)
        repo = os.environ["CAIRN_TEST_S3_URL"] if a.s3 else os.path.join(work, "repo")
        cairn = [a.bin, "--repo", repo, "-q"]
        subprocess.run([*cairn, "init"], check=True, stdout=subprocess.DEVNULL)
        chain = [os.path.join(work, "day-0.qcow2")]
        subprocess.run(["qemu-img", "convert", "-O", "qcow2", img, chain[0]], check=True)
        subprocess.run([*cairn, "commit", "vm", img], check=True, stdout=subprocess.DEVNULL)
        blocks = data_blocks(img)
        rng = random.Random(56)
        scratch = os.path.join(work, "write.bin")
        for day in range(1, a.versions):
            writes = day_changes(rng, img, blocks)
            with open(img, "r+b") as f:
                for off, data in writes:
                    f.seek(off)
                    f.write(data)
            layer = os.path.join(work, f"day-{day}.qcow2")
            subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", chain[-1],
                            "-F", "qcow2", layer], check=True)
            cmds = []
            for i, (off, data) in enumerate(writes):
                p = f"{scratch}.{i}"
                with open(p, "wb") as f:
                    f.write(data)
                cmds.append(f"write -q -s {p} {off} {len(data)}\n")
            subprocess.run(["qemu-io", "-f", "qcow2", layer], input="".join(cmds).encode(),
                           check=True, stdout=subprocess.DEVNULL)
            for p in glob.glob(scratch + ".*"):
                os.unlink(p)
            chain.append(layer)
            subprocess.run([*cairn, "commit", "vm", img], check=True, stdout=subprocess.DEVNULL)
            print(f"day {day}", file=sys.stderr, flush=True)
        n = len(chain)
        picks = {"oldest": 1, "middle": (n + 1) // 2, "newest": n}
        out = os.path.join(work, "out.raw")
        chain_s = {name: best_of_two(lambda o, seq=seq: subprocess.run(
            ["qemu-img", "convert", "-O", "raw", chain[seq - 1], o], check=True), out)
            for name, seq in picks.items()}

        def cairn_json(*args):
            return json.loads(subprocess.run([a.bin, "--repo", repo, "--json", *args],
                                             check=True, capture_output=True, text=True).stdout)

        def stored():
            return cairn_json("stats")["stored_bytes"]

        def restores(label):
            rows = {}
            for name, seq in picks.items():
                stats = cairn_json("stats", f"vm@{seq}")
                c = best_of_two(lambda o: subprocess.run([*cairn, "restore", f"vm@{seq}", o],
                                                         check=True), out)
                q = chain_s[name]
                rows[name] = {"version": seq, "chain_depth": seq, "cairn_restore_s": c,
                              "qcow2_chain_s": q, "cairn_vs_chain": c / q, "stats": stats}
                print(f"{label} {name}: cairn {c:.2f} s ({stats['reads_per_gib']:.0f} reads/GiB),"
                      f" chain {q:.2f} s", file=sys.stderr, flush=True)
            return rows

        steps = [{"alpha": 0, "relayout_of": None, "stored_bytes": stored(),
                  "restores": restores("alpha 0")}]
        # CloudVS's α on the version an operator restores most: the newest, each α on top of
        # the last; then the oldest at the largest α. Each relayout is followed by
        # `gc --repair`, which gives back the old copies (the space a relayout spends lasts
        # until then: `stored_before_gc`).
        plan = [(n, alpha) for alpha in a.alphas if alpha > 0]
        if plan:
            plan.append((1, plan[-1][1]))
        for seq, alpha in plan:
            t = time.perf_counter()
            r = cairn_json("relayout", f"vm@{seq}", "--alpha", str(alpha))
            took = time.perf_counter() - t
            before_gc = stored()
            t = time.perf_counter()
            gc = cairn_json("gc", "--repair")
            gc_s = time.perf_counter() - t
            label = f"alpha {alpha} of vm@{seq}"
            print(f"{label}: copied {r['bytes_copied']} bytes in {took:.0f} s, gc {gc_s:.0f} s",
                  file=sys.stderr, flush=True)
            steps.append({"alpha": alpha, "relayout_of": seq, "relayout_s": took,
                          "bytes_copied": r["bytes_copied"], "reads_before": r["before"]["reads"],
                          "reads_after": r["after"]["reads"], "stored_before_gc": before_gc,
                          "gc_s": gc_s, "gc_packs_repacked": gc["packs_repacked"],
                          "stored_bytes": stored(), "restores": restores(label)})
        chain_bytes = sum(os.stat(p).st_blocks * 512 for p in chain)
        doc = {"date": time.strftime("%Y-%m-%d"), "versions": n, "source": source,
               "store": "minio" if a.s3 else "local",
               "chain_bytes": chain_bytes, "steps": steps}
        text = json.dumps(doc, indent=1)
        print(text)
        if a.out:
            with open(a.out, "w") as f:
                f.write(text + "\n")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

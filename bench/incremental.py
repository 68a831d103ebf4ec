#!/usr/bin/env python3
"""Change tracking pays: incremental commits of a qcow2 overlay and of a dirty-bitmap NBD
source against full-scan commits of the same data.

A 2 GiB dataset image (su-0 of the full dataset) gets 1% changes: 20 writes of 1 MiB of
random data at offsets spread over its data. The same change is presented four ways:

  full raw        `cairn commit IMG modified.raw`: the changed image as a sparse raw file, full
                  scan of its data (holes are skipped already)
  full thick      the same bytes fully allocated (`cp --sparse=never`), as a block device or a
                  thick volume is: the full scan reads all 2 GiB
  full chain      `cairn commit IMG overlay.qcow2` with no record of its backing file: a full
                  scan through the backing chain
  overlay         `cairn commit IMG overlay.qcow2` after `base.qcow2` was committed: only the
                  overlay's clusters are read
  nbd full        the changed qcow2 served by qemu-storage-daemon, committed over NBD in full
  dirty bitmap    the same export, `--dirty-bitmap b0`: only the extents QEMU marked dirty

Every method commits into its own fresh repository that already holds the parent (the
unchanged image), so each dedups against the same data. Each figure is the median of RUNS
counted runs (default 3) after one warm-up, once with the sources in the page cache (warm)
and once evicted before each commit (cold: the state a polite scan of a live host leaves
them in). Reports wall time, bytes read from the source (cairn's own count) and their
ratios; the targets are < 3% of the image read and
< 10% of the full scan's time.

    bench/incremental.py [--dataset DIR] [--bin PATH]

The Markdown report goes to stdout and bench/results/incremental-<date>.md.
"""

import argparse
import datetime
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from formats import StorageDaemon, evict  # noqa: E402

# Peers read through the page cache and leave it warm: so does cairn here (its default
# drops the pages a scan brought in, to be polite to a live host).
os.environ["CAIRN_KEEP_CACHE"] = "1"

CHANGES = 20
CHANGE_LEN = 1 << 20


def sh(*cmd):
    subprocess.run([str(c) for c in cmd], check=True, capture_output=True)


class Cairn:
    def __init__(self, binary, repo, state):
        self.binary, self.repo = binary, repo
        self.env = dict(os.environ, CAIRN_STATE_DIR=state)

    def run(self, *args):
        p = subprocess.run([self.binary, "--repo", self.repo, "-q", *map(str, args)],
                           capture_output=True, text=True, env=self.env)
        if p.returncode != 0:
            raise RuntimeError(f"cairn {' '.join(map(str, args))}: {p.stderr.strip()}")
        return p

    def commit(self, *args):
        """Commits; returns (seconds, read_bytes, incremental?)."""
        started = time.monotonic()
        v = json.loads(self.run("--json", "commit", *args).stdout)
        return time.monotonic() - started, v["read_bytes"], v["incremental"] is not None


def change_offsets(raw, rng):
    """CHANGES offsets (1 MiB aligned) inside the image's data extents, spread out."""
    size = os.path.getsize(raw)
    fd = os.open(raw, os.O_RDONLY)
    extents, pos = [], 0
    try:
        while pos < size:
            try:
                d = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            h = os.lseek(fd, d, os.SEEK_HOLE)
            if h - d >= CHANGE_LEN * 2:
                extents.append((d, h))
            pos = h
    finally:
        os.close(fd)
    picks = sorted(rng.sample(range(len(extents)), min(CHANGES, len(extents))))
    offs = []
    for i in picks:
        d, h = extents[i]
        offs.append((d + rng.randrange(0, h - d - CHANGE_LEN)) // CHANGE_LEN * CHANGE_LEN)
    while len(offs) < CHANGES:  # few large extents: spread inside the biggest
        d, h = max(extents, key=lambda e: e[1] - e[0])
        offs.append((d + rng.randrange(0, h - d - CHANGE_LEN)) // CHANGE_LEN * CHANGE_LEN)
    return sorted(set(offs))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default=os.path.join(ROOT, ".data", "full"))
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "cairn"))
    args = ap.parse_args()
    runs = int(os.environ.get("RUNS", "3"))
    raw = os.path.join(args.dataset, "su-0.raw")
    binary = os.path.abspath(args.bin)
    size = os.path.getsize(raw)
    work = tempfile.mkdtemp(prefix="bench-incremental-", dir=os.path.join(ROOT, ".data"))
    rng = random.Random(6)
    try:
        base = os.path.join(work, "base.qcow2")
        sh("qemu-img", "convert", "-O", "qcow2", raw, base)
        offsets = change_offsets(raw, rng)
        chunks = []
        for k, _ in enumerate(offsets):
            p = os.path.join(work, f"change-{k}.bin")
            with open(p, "wb") as f:
                f.write(rng.randbytes(CHANGE_LEN))
            chunks.append(p)
        writes = [a for k, off in enumerate(offsets)
                  for a in ("-c", f"write -s {chunks[k]} {off} {CHANGE_LEN}")]
        modified = os.path.join(work, "modified.raw")
        sh("cp", "--sparse=always", raw, modified)
        with open(modified, "r+b") as f:
            for k, off in enumerate(offsets):
                f.seek(off)
                with open(chunks[k], "rb") as c:
                    f.write(c.read())
        thick = os.path.join(work, "thick.raw")
        sh("cp", "--sparse=never", modified, thick)
        overlay = os.path.join(work, "overlay.qcow2")
        sh("qemu-img", "create", "-f", "qcow2", "-b", base, "-F", "qcow2", overlay)
        sh("qemu-io", "-f", "qcow2", overlay, *writes)
        sh("qemu-img", "compare", "-f", "qcow2", "-F", "raw", overlay, modified)
        changed = len(offsets) * CHANGE_LEN

        methods = ("full thick", "full raw", "full chain", "overlay", "nbd full", "dirty bitmap")
        results = {cache: {k: [] for k in methods} for cache in ("warm", "cold")}

        def measure(run, cache):
            """One commit per method; `cold` evicts the sources from the page cache first."""
            def fresh(name, record=True):
                # A fresh repository holding the parent (base.qcow2's content as vm@1), so
                # every method dedups against the same data.
                state = os.path.join(work, f"state-{run}-{cache}-{name}")
                c = Cairn(binary, os.path.join(work, f"repo-{run}-{cache}-{name}"), state)
                c.run("init")
                c.run("commit", "vm", base)
                if not record:
                    shutil.rmtree(state, ignore_errors=True)
                return c

            def prep(*files):
                if cache == "cold":
                    for f in files:
                        evict(f)

            got = {}
            c = fresh("thick")
            prep(thick)
            got["full thick"] = c.commit("vm", thick)
            c = fresh("raw")
            prep(modified)
            got["full raw"] = c.commit("vm", modified)
            c = fresh("chain", record=False)
            prep(base, overlay)
            got["full chain"] = c.commit("vm", overlay)
            c = fresh("overlay")
            prep(base, overlay)
            got["overlay"] = c.commit("vm", overlay)
            # Changed-block tracking over NBD: the export starts as base.qcow2's content, the
            # bitmap is created with it, then the same change is written through NBD.
            nbd_full, dirty = fresh("nbd"), fresh("dirty")
            disk = os.path.join(work, "cbt.qcow2")
            shutil.copy(base, disk)
            qsd = StorageDaemon(work, disk)
            try:
                url = qsd.url
                sh("qemu-io", "-f", "raw", url, *writes)
                prep(disk)
                got["nbd full"] = nbd_full.commit("vm", url)
                prep(disk)
                got["dirty bitmap"] = dirty.commit("vm", url, "--dirty-bitmap", "b0")
            finally:
                qsd.stop()
                os.unlink(disk)
            for k in ("overlay", "dirty bitmap"):
                if not got[k][2]:
                    raise RuntimeError(f"{k}: the commit was not incremental")
            for d in os.listdir(work):
                if d.startswith(("repo-", "state-")):
                    shutil.rmtree(os.path.join(work, d))
            return got

        for run in range(runs + 1):
            for cache in ("warm", "cold"):
                got = measure(run, cache)
                if run > 0:
                    for k, v in got.items():
                        results[cache][k].append(v)
                print(f"run {run}{' (warm-up)' if run == 0 else ''} {cache}: " + ", ".join(
                    f"{k} {v[0]:.2f} s" for k, v in got.items()), file=sys.stderr)

        lines = [
            f"# bench/incremental.py — {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC",
            "",
            f"Command: `bench/incremental.py` (RUNS={runs}). Machine: {os.cpu_count()} cores. "
            f"Image: {os.path.basename(raw)}, {size / 2**30:.0f} GiB, "
            f"{os.stat(raw).st_blocks * 512 / 2**20:.0f} MiB allocated; change: {len(offsets)} "
            f"× 1 MiB of random data = {changed / 2**20:.0f} MiB ({changed * 100 / size:.2f}% "
            "of the image). Medians. *warm*: the sources are in the page cache; *cold*: they "
            "were evicted before each commit (a live host whose scans are polite).",
        ]
        full_of = {"full thick": "full thick", "full raw": "full raw",
                   "full chain": "full chain", "overlay": "full chain", "nbd full": "nbd full",
                   "dirty bitmap": "nbd full"}
        for cache in ("cold", "warm"):
            med = {k: (statistics.median(t for t, _, _ in v),
                       statistics.median(r for _, r, _ in v))
                   for k, v in results[cache].items()}
            lines += [
                "",
                f"**{cache} page cache**",
                "",
                "| commit | time | read from source | read ÷ image | time ÷ its full scan "
                "| time ÷ full thick scan |",
                "|---|---|---|---|---|---|",
            ]
            for k, (t, r) in med.items():
                ref = med[full_of[k]][0]
                lines.append(f"| {k} | {t:.2f} s | {r / 2**20:.1f} MiB | {r * 100 / size:.2f}% "
                             f"| {t / ref:.3f}× | {t / med['full thick'][0]:.3f}× |")
        report = "\n".join(lines) + "\n"
        print(report)
        os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
        out = os.path.join(ROOT, "bench", "results",
                           f"incremental-{datetime.date.today():%Y-%m-%d}.md")
        with open(out, "w") as f:
            f.write(report)
        print(f"report written to {out}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

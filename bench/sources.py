#!/usr/bin/env python3
"""Sources and outputs: what reading qcow2 or NBD and writing qcow2 cost against raw, and
what a polite scan leaves in the page cache.

On one dataset image (default su-2 of the full dataset: 2 GiB, the most data):

  commit from  raw file · qcow2 · compressed qcow2 (deflate) · NBD (qemu-nbd serving the raw
               file over a Unix socket) — each into a fresh repository, page cache warm
  restore to   raw file · qcow2 (--format qcow2), fsynced
  reference    `qemu-img convert -O qcow2` of the raw file, and `qemu-img convert -O raw`
               of the qcow2 (QEMU's own tools doing the copy)
  page cache   the source's resident bytes after a commit (fincore), cold start: default
               (polite) against --keep-cache

Medians of RUNS counted runs (default 3) after one warm-up. The Markdown report goes to
stdout and bench/results/formats-<date>.md.

    bench/sources.py [--image PATH] [--bin PATH]
"""

import argparse
import datetime
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from formats import evict, resident, stop, wait_for  # noqa: E402

os.environ["CAIRN_KEEP_CACHE"] = "1"  # warm page cache for every timed commit, like peers


def sh(*cmd):
    subprocess.run([str(c) for c in cmd], check=True, capture_output=True)


def timed(fn):
    started = time.monotonic()
    fn()
    return time.monotonic() - started


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--image", default=os.path.join(ROOT, ".data", "full", "su-2.raw"))
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "cairn"))
    args = ap.parse_args()
    runs = int(os.environ.get("RUNS", "3"))
    raw, binary = os.path.abspath(args.image), os.path.abspath(args.bin)
    data = os.stat(raw).st_blocks * 512
    work = tempfile.mkdtemp(prefix="bench-formats-", dir=os.path.join(ROOT, ".data"))

    def cairn(repo, *a, env=None):
        p = subprocess.run([binary, "--repo", repo, "-q", *map(str, a)], capture_output=True,
                           text=True, env=env)
        if p.returncode != 0:
            raise RuntimeError(f"cairn {' '.join(map(str, a))}: {p.stderr.strip()}")
        return p

    try:
        q, qc = os.path.join(work, "img.qcow2"), os.path.join(work, "img-c.qcow2")
        sh("qemu-img", "convert", "-O", "qcow2", raw, q)
        sh("qemu-img", "convert", "-O", "qcow2", "-c", raw, qc)
        sock = os.path.join(work, "nbd.sock")
        srv = subprocess.Popen(["qemu-nbd", "-r", "-f", "raw", "-t", "-k", sock, "-x", "disk",
                                raw], stderr=subprocess.PIPE, text=True)
        wait_for(sock, srv, "qemu-nbd")
        sources = {"raw": raw, "qcow2": q, "qcow2 (compressed)": qc,
                   "NBD (qemu-nbd, unix)": f"nbd+unix:///disk?socket={sock}"}
        times = {k: [] for k in [*sources, "restore raw", "restore qcow2",
                                 "qemu-img convert raw→qcow2", "qemu-img convert qcow2→raw"]}
        try:
            for run in range(runs + 1):
                got = {}
                for name, src in sources.items():
                    repo = os.path.join(work, "repo")
                    cairn(repo, "init")
                    got[name] = timed(lambda: cairn(repo, "commit", "vm", src))
                    shutil.rmtree(repo)
                repo = os.path.join(work, "repo")
                cairn(repo, "init")
                cairn(repo, "commit", "vm", raw)
                out = os.path.join(work, "out")
                got["restore raw"] = timed(lambda: cairn(repo, "restore", "vm", out, "--force"))
                os.unlink(out)
                got["restore qcow2"] = timed(
                    lambda: cairn(repo, "restore", "vm", out, "--format", "qcow2", "--force"))
                if run == 0:
                    p = subprocess.run(["qemu-img", "check", out], capture_output=True, text=True)
                    if "No errors were found" not in p.stdout:
                        raise RuntimeError(f"restored qcow2 fails qemu-img check: {p.stdout}")
                    qcow2_out_size = os.path.getsize(out)
                os.unlink(out)
                shutil.rmtree(repo)
                got["qemu-img convert raw→qcow2"] = timed(
                    lambda: sh("qemu-img", "convert", "-O", "qcow2", raw, out))
                os.unlink(out)
                got["qemu-img convert qcow2→raw"] = timed(
                    lambda: sh("qemu-img", "convert", "-f", "qcow2", "-O", "raw", q, out))
                os.unlink(out)
                if run > 0:
                    for k, v in got.items():
                        times[k].append(v)
                print(f"run {run}{' (warm-up)' if run == 0 else ''}: " + ", ".join(
                    f"{k} {v:.2f} s" for k, v in got.items()), file=sys.stderr)
        finally:
            stop(srv)

        # Page cache after a cold commit: polite default against --keep-cache.
        cache = {}
        for label, extra in (("default (polite)", "0"), ("--keep-cache", "1")):
            repo = os.path.join(work, "repo")
            cairn(repo, "init")
            evict(raw)
            cairn(repo, "commit", "vm", raw, env=dict(os.environ, CAIRN_KEEP_CACHE=extra))
            cache[label] = resident(raw)
            shutil.rmtree(repo)

        med = {k: statistics.median(v) for k, v in times.items()}
        mib = data / 2**20
        lines = [
            f"# bench/sources.py — {datetime.datetime.utcnow():%Y-%m-%d %H:%M} UTC",
            "",
            f"Command: `bench/sources.py` (RUNS={runs}). Machine: {os.cpu_count()} cores. "
            f"Image: {os.path.basename(raw)}, {os.path.getsize(raw) / 2**30:.0f} GiB, "
            f"{mib:.0f} MiB allocated. Medians; page cache warm; each commit into a fresh "
            "repository.",
            "",
            "| operation | time | MiB/s of data | ÷ raw |",
            "|---|---|---|---|",
        ]
        for k in sources:
            lines.append(f"| commit from {k} | {med[k]:.2f} s | {mib / med[k]:.0f} | "
                         f"{med[k] / med['raw']:.2f}× |")
        for k in ("restore raw", "restore qcow2"):
            lines.append(f"| {k} | {med[k]:.2f} s | {mib / med[k]:.0f} | "
                         f"{med[k] / med['restore raw']:.2f}× |")
        for k in ("qemu-img convert raw→qcow2", "qemu-img convert qcow2→raw"):
            lines.append(f"| {k} (reference) | {med[k]:.2f} s | {mib / med[k]:.0f} | |")
        lines += [
            "",
            f"Restored qcow2: {qcow2_out_size / 2**20:.0f} MiB for {mib:.0f} MiB of data "
            f"(qemu-img's own convert: {os.path.getsize(q) / 2**20:.0f} MiB); "
            "`qemu-img check` clean.",
            "",
            "Page cache after one commit from a cold start (the source's resident bytes):",
            "",
            "| commit | source resident afterwards |",
            "|---|---|",
        ]
        for k, v in cache.items():
            lines.append(f"| {k} | {v / 2**20:.1f} MiB of {mib:.0f} MiB |")
        report = "\n".join(lines) + "\n"
        print(report)
        os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
        with open(os.path.join(ROOT, "bench", "results",
                               f"sources-{datetime.date.today():%Y-%m-%d}.md"), "w") as f:
            f.write(report)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Fast deletion against the VM-centric paper's leak model (§3.2, equations 1 and 2, Table 6).

A study of format 1's Bloom-filter summaries: it needs a cairn that still writes format 1
(`--bin` of a build from before issue 53, e.g. commit c778d08). Format 2's summaries list the
slots each tree uses exactly, so its fast deletion has no false positives to measure (and its
`gc --json` has no `summary_fp_rate`).

One image of SIZE bytes (u chunks) keeps h = 10 versions; every step commits a new version that
rewrites Δu/u = 2.5% of the chunks at random, then `cairn prune --keep-last 10` deletes the
oldest, which runs fast deletion (`gc`, with --repack-threshold 1 so that every dead blob
the summaries reject is really removed, and what stays is the filters' leak alone). After
each step `cairn gc --repair --dry-run` counts the blobs still stored that no live version
uses: the accumulated leak L. The prediction is the paper's L = R·ε·Δu, with ε from
equation (1) for the merged summaries (z bits, j probes, U = u + (h−1)Δu items).

Runs once per summary size (bits per chunk) and then times fast deletion against the exact
pass on the final repository.

    bench/deletion.py [--size 1G] [--steps 20] [--bits 8,24] [--bin target/release/cairn]
"""

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time

CHUNK = 16384
H = 10
CHANGE = 0.025

# Peers read through the page cache and leave it warm: so does cairn here (its default
# drops the pages a scan brought in, to be polite to a live host).
os.environ["CAIRN_KEEP_CACHE"] = "1"


def run(binary, repo, *args):
    p = subprocess.run([binary, "--repo", repo, "-q", *args], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"cairn {' '.join(args)}: {p.stderr.strip()}")
    return p.stdout


def timed(binary, repo, *args):
    """(json output, wall seconds, peak RSS MiB) of one cairn command."""
    tf = tempfile.NamedTemporaryFile(delete=False)
    tf.close()
    t = time.time()
    p = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", tf.name, binary, "--repo", repo, "-q",
                        "--json", *args], capture_output=True, text=True)
    wall = time.time() - t
    if p.returncode != 0:
        sys.exit(f"cairn {' '.join(args)}: {p.stderr.strip()}")
    rss = int(open(tf.name).read().split()[-1]) / 1024
    os.unlink(tf.name)
    return json.loads(p.stdout), wall, rss


def mutate(path, chunks, rng):
    with open(path, "r+b") as f:
        for c in rng.sample(range(chunks), int(chunks * CHANGE)):
            f.seek(c * CHUNK)
            f.write(rng.randbytes(CHUNK))


def eq1(bits, probes, items):
    return (1 - (1 - 1 / bits) ** (probes * items)) ** probes


def series(binary, work, size, steps, bits):
    repo = os.path.join(work, f"repo-{bits}")
    img = os.path.join(work, "disk.raw")
    rng = random.Random(bits)
    u = size // CHUNK
    du = int(u * CHANGE)
    with open(img, "wb") as f:
        for _ in range(size // (1 << 20)):
            f.write(rng.randbytes(1 << 20))
    run(binary, repo, "init", "--summary-bits", str(bits))
    for _ in range(H):
        run(binary, repo, "commit", "vm", img)
        mutate(img, u, rng)
    # The paper's parameters for our filters: z = 2^ceil(log2(bits·u)), j = bits/2.
    z = 1 << math.ceil(math.log2(bits * u))
    j = max(1, bits // 2)
    big_u = u + (H - 1) * du
    eps = eq1(z, j, big_u)
    rows = []
    fast_times = []
    for r in range(1, steps + 1):
        run(binary, repo, "commit", "vm", img)
        mutate(img, u, rng)
        run(binary, repo, "prune", "vm", "--keep-last", str(H), "--no-gc")
        fast, wall, rss = timed(binary, repo, "gc", "--repack-threshold", "1")
        fast_times.append((wall, rss, fast))
        exact, _, _ = timed(binary, repo, "gc", "--repair", "--dry-run")
        rows.append((r, exact["dead_blobs"], fast["summary_fp_rate"]))
    return repo, rows, eps, du, big_u, z, j, fast_times


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="1G")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--bits", default="8,24")
    ap.add_argument("--bin", default="target/release/cairn")
    args = ap.parse_args()
    size = int(args.size.rstrip("GMgm")) << (30 if args.size[-1] in "Gg" else 20)
    binary = os.path.abspath(args.bin)
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".data")
    os.makedirs(root, exist_ok=True)
    work = tempfile.mkdtemp(prefix="deletion-bench.", dir=root)
    try:
        print(f"# Fast deletion vs the paper's leak model — {time.strftime('%Y-%m-%d', time.gmtime())}, "
              f"`bench/deletion.py --size {args.size} --steps {args.steps} --bits {args.bits}`\n")
        print(f"One image of {args.size}B (u = {size // CHUNK} chunks of 16 KiB), h = {H} live versions, "
              f"Δu/u = {CHANGE}; each step commits one version and deletes the oldest.\n")
        last = None
        for bits in [int(b) for b in args.bits.split(",")]:
            repo, rows, eps, du, big_u, z, j, fast_times = series(binary, work, size, args.steps, bits)
            print(f"## {bits} bits per chunk: z = 2^{int(math.log2(z))} bits per summary, j = {j}, "
                  f"U = {big_u}, ε (eq. 1) = {eps:.2e}\n")
            print("| deletions R | predicted L = RεΔu (blobs) | measured leak (blobs) | predicted L/U | measured L/U | ε from filter fill |")
            print("|---|---|---|---|---|---|")
            for r, leak, fill_eps in rows:
                if r in (1, 3, 5, 7, 9) or r % 5 == 0:
                    pred = r * eps * du
                    print(f"| {r} | {pred:.1f} | {leak} | {pred / big_u:.4%} | {leak / big_u:.4%} | {fill_eps:.2e} |")
            walls = [w for w, _, _ in fast_times]
            rss = max(m for _, m, _ in fast_times)
            summ = sum(f["summary_bytes"] for _, _, f in fast_times) / len(fast_times)
            meta = sum(f.get("metadata_read_bytes", f.get("metadata_bytes_read")) for _, _, f in fast_times) / len(fast_times)
            print(f"\nFast deletion per step: median {sorted(walls)[len(walls) // 2]:.2f} s wall, "
                  f"peak RSS {rss:.0f} MiB, reads {summ / 1024:.0f} KiB of summaries and "
                  f"{meta / 1024:.0f} KiB of the deleted version's manifest.\n")
            last = repo
        # Fast vs exact on the same state: one more deletion, then each mode on its own copy.
        run(binary, last, "prune", "vm", "--keep-last", str(H - 1), "--no-gc")
        copy = last + "-exact"
        shutil.copytree(last, copy)
        fast, fw, fr = timed(binary, last, "gc")
        exact, ew, er = timed(binary, copy, "gc", "--repair")
        print("| one deletion, same repository | wall s | peak RSS MiB | metadata read KiB | reclaimed MiB |")
        print("|---|---|---|---|---|")
        print(f"| `cairn gc` (fast) | {fw:.2f} | {fr:.0f} | {(fast['summary_bytes'] + fast.get('metadata_read_bytes', fast.get('metadata_bytes_read'))) / 1024:.0f} | {fast.get('reclaimed_bytes', fast.get('bytes_reclaimed')) / 2**20:.1f} |")
        print(f"| `cairn gc --repair` (exact) | {ew:.2f} | {er:.0f} | {exact.get('metadata_read_bytes', exact.get('metadata_bytes_read')) / 1024:.0f} | {exact.get('reclaimed_bytes', exact.get('bytes_reclaimed')) / 2**20:.1f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

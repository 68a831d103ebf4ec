#!/usr/bin/env python3
"""A/B of two or more cairn builds on the scaling axes of `compare.py --parts scaling`, in one
run (figures from different days are not comparable): the same images, the same guest writes,
each build on a fresh repository.

- image size: an image of SIZE GiB with 1 MiB of data per 16 MiB (built from the dataset's
  last step, as compare.py builds it), committed, then 256 scattered 4 KiB writes per GiB into
  its data, committed again: time and peak RSS of both commits, and what the second found in
  the parent's leaves (`parent_chunks`);
- history: a 1 GiB image (64 MiB of data) committed N times with four 4 KiB writes into its
  data before each: the median commit time of the last five before 10, 100, 1,000 versions,
  and the index runs left;
- on both axes, export start: from `cairn export` launched to the end of a first 4 KiB read
  of the image's data through qemu-io (median of three), and the export's peak RSS.

    bench/ab_scaling.py --bin NAME=PATH [--bin NAME=PATH ...] [--sizes 4,16,64]
                        [--versions 1000] [--dataset .data/small] [--out results.json]

A build is NAME=PATH[:ARGS], ARGS extra `commit` arguments separated by commas (for instance
`new-nocompact=target/ci/cairn:--no-compact`).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import GIB, data_extents, make_scaled_image, scribble  # noqa: E402


def timed(cmd: list[str]) -> tuple[float, int, str]:
    """Runs cmd; returns (seconds, peak RSS in MiB, stdout)."""
    t = time.monotonic()
    p = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed: {p.stderr.strip()[-500:]}")
    rss = int(p.stderr.strip().splitlines()[-1]) // 1024
    return time.monotonic() - t, rss, p.stdout


def export_start(binary: str, repo: Path, image: str, offset: int, tries: int = 3) -> tuple[float, int]:
    """Starts `cairn export IMAGE` on a Unix socket and reads 4 KiB at `offset` through
    qemu-io as soon as the export serves: (median seconds from the start to the read's end,
    the export's peak RSS in MiB after it)."""
    times, rss = [], 0
    for _ in range(tries):
        sock = repo.parent / "export.sock"
        t = time.monotonic()
        p = subprocess.Popen([binary, "--repo", str(repo), "--json", "export", image,
                              "--no-profile", "--socket", str(sock)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        try:
            if not p.stdout.readline():  # one JSON line once it serves
                sys.exit(f"cairn export {image} did not start: {p.stderr.read()[-500:]}")
            uri = f"nbd+unix:///{image}?socket={sock}"
            subprocess.run(["qemu-io", "-f", "raw", "-r", "-c", f"read {offset} 4k", uri],
                           check=True, capture_output=True)
            times.append(time.monotonic() - t)
            status = Path(f"/proc/{p.pid}/status").read_text()
            hwm = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
            rss = max(rss, int(hwm.split()[1]) // 1024)
        finally:
            p.terminate()
            p.wait()
    return statistics.median(times), rss


def first_data(path: Path) -> int:
    """The offset of the image's first data block (an export start reads it)."""
    return data_extents(path)[0][0]


def builds(specs: list[str]) -> list[tuple[str, str, list[str]]]:
    out = []
    for spec in specs:
        name, _, rest = spec.partition("=")
        path, _, extra = rest.partition(":")
        out.append((name, str(Path(path).resolve()), [a for a in extra.split(",") if a]))
    return out


def size_axis(bins, sizes, source: Path, work: Path) -> list[dict]:
    rows = []
    for gib in sizes:
        for name, binary, extra in bins:
            img = work / "img.raw"
            data = make_scaled_image(img, gib * GIB, source, seed=gib)
            repo = work / "repo"
            shutil.rmtree(repo, ignore_errors=True)
            base = [binary, "--repo", str(repo)]
            subprocess.run([*base, "-q", "init"], check=True)
            t1, r1, _ = timed([*base, "--json", "commit", *extra, "vm", str(img)])
            scribble(img, random.Random(0), 256 * gib)
            t2, r2, out = timed([*base, "--json", "commit", *extra, "vm", str(img)])
            second = json.loads(out)
            e_s, e_rss = export_start(binary, repo, "vm", first_data(img))
            row = dict(build=name, gib=gib, data=data, first_s=t1, first_rss=r1, second_s=t2,
                       second_rss=r2, export_s=e_s, export_rss=e_rss,
                       parent_chunks=second.get("parent_chunks"),
                       reused_segments=second.get("reused_segments"),
                       similar_chunks=second.get("similar_chunks"),
                       index_chunks=second.get("index_chunks"),
                       fetched=second.get("fetched"))
            print(json.dumps(row), flush=True)
            rows.append(row)
            shutil.rmtree(repo)
            img.unlink()
    return rows


def history_axis(bins, versions: int, source: Path, work: Path) -> list[dict]:
    marks = [m for m in (10, 100, 1000, 10000) if m <= versions]
    rows = []
    for name, binary, extra in bins:
        img = work / "versions.raw"
        make_scaled_image(img, GIB, source, seed=7)
        repo = work / "repo"
        shutil.rmtree(repo, ignore_errors=True)
        base = [binary, "--repo", str(repo)]
        subprocess.run([*base, "-q", "init"], check=True)
        rng = random.Random(1)
        times = []
        for n in range(1, versions + 1):
            scribble(img, rng, 4)
            t, rss, _ = timed([*base, "-q", "commit", *extra, "vm", str(img)])
            times.append((t, rss))
            if n in marks:
                last = times[-5:]
                e_s, e_rss = export_start(binary, repo, "vm", first_data(img))
                row = dict(build=name, versions=n,
                           commit_s=statistics.median(x[0] for x in last),
                           commit_rss=max(x[1] for x in last),
                           export_s=e_s, export_rss=e_rss,
                           index_runs=len(list((repo / "index-runs").iterdir())))
                print(json.dumps(row), flush=True)
                rows.append(row)
        shutil.rmtree(repo)
        img.unlink()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", action="append", required=True, help="NAME=PATH[:ARGS]")
    ap.add_argument("--sizes", default="4,16,64", help="GiB, comma-separated ('' to skip)")
    ap.add_argument("--versions", type=int, default=1000, help="0 to skip the history axis")
    ap.add_argument("--dataset", default=".data/small")
    ap.add_argument("--out", help="write the rows here as JSON")
    args = ap.parse_args()
    bins = builds(args.bin)
    steps = sorted(Path(args.dataset).glob("su-*.raw"))
    if not steps:
        sys.exit(f"no su-*.raw in {args.dataset}: run scripts/build-dataset.sh first")
    source = steps[-1]
    work = Path(tempfile.mkdtemp(prefix="ab-scaling-", dir=Path(args.dataset).parent))
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s]
        result = dict(date=time.strftime("%Y-%m-%d"), source=source.name,
                      builds=[dict(name=n, path=p, args=a) for n, p, a in bins],
                      size=size_axis(bins, sizes, source, work),
                      history=history_axis(bins, args.versions, source, work)
                      if args.versions else [])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

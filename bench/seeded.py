#!/usr/bin/env python3
"""Seeded restore and qcow2 overlays on a local base against a plain restore (issue 56:
bytes fetched <= 1.1x the difference; an overlay `qemu-img compare` finds equal, <= 1.2x the
difference in size).

The dataset's `su-*` images are committed in order as versions of one image. With U the
newest (su-5 in the full dataset, su-2 in the small one) and V the one before, it measures,
in one run:

- `restore U OUT` (the baseline: every chunk fetched);
- `restore U OUT --seed V.raw` (V's file as the seed: only the chunks V does not hold,
  at the same place or at any other 4 KiB-aligned one, are fetched);
- `restore U OUT.qcow2 --backing V.raw`: a qcow2 overlay holding only the clusters where U
  differs from V, checked with `qemu-img compare` against U's file;
- `export U` read whole by `nbdcopy`, without and with `--seed V.raw` (each with a cache of
  its own): the export's counters say what was fetched and what the seed served.

"The difference" is the 4 KiB blocks in which U and V differ (their plain bytes); fetched
bytes are what was read from the store (compressed groups). The least a seeded restore can
fetch is the plain restore's fetch in the share of U's data the seed does not hold
(`seeded_fetched_vs_ideal`). With `--s3` the repository is a
prefix under $CAIRN_TEST_S3_URL (run under scripts/minio.sh).

    bench/seeded.py --dataset .data/small --bin target/ci/cairn [--s3] [--out FILE]

Prints one JSON document (also written to --out).
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from in_place import differing_blocks, emit, parse_args, series_repo, sha  # noqa: E402


def seed_holds(u_file, v_file):
    """Bytes of U's non-zero 4 KiB blocks that V holds at the same place, and at any 4 KiB-
    aligned place."""
    block = 4096
    zero = bytes(block)
    held = set()
    with open(v_file, "rb") as v:
        while b := v.read(block):
            if b != zero:
                held.add(hashlib.blake2b(b, digest_size=16).digest())
    same = anywhere = 0
    with open(u_file, "rb") as u, open(v_file, "rb") as v:
        while b := u.read(block):
            there = v.read(block)
            if b == zero:
                continue
            if b == there:
                same += len(b)
            if hashlib.blake2b(b, digest_size=16).digest() in held:
                anywhere += len(b)
    return same, anywhere


def export_run(c, work, spec, name, extra, want):
    """`cairn export SPEC EXTRA...` read whole by nbdcopy into a file; its counters."""
    run = os.path.join(work, f"export-{name}")
    os.makedirs(run)
    sock, stats, out = (os.path.join(run, f) for f in ("e.sock", "stats.json", "out.raw"))
    proc = subprocess.Popen(c.args("--json", "export", spec, "--no-profile", "--name", "disk", "--socket", sock,
                                   "--cache-dir", os.path.join(run, "cache"),
                                   "--stats-file", stats, *extra),
                            env=dict(c.env, CAIRN_RUN_DIR=os.path.join(run, "run")),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not proc.stdout.readline():
        sys.exit(f"export {name} did not start: {proc.stderr.read().strip()}")
    t = time.monotonic()
    subprocess.run(["nbdcopy", f"nbd+unix:///disk?socket={sock}", out], check=True)
    seconds = time.monotonic() - t
    proc.send_signal(signal.SIGTERM)
    proc.wait()
    with open(stats) as f:
        s = json.load(f)
    return {"seconds": round(seconds, 2), "fetched_bytes": s["fetched_bytes"],
            "seeded_bytes": s["seeded_bytes"], "bit_exact": sha(out) == want}


def main():
    args, images = parse_args(__doc__)
    work = tempfile.mkdtemp(prefix="cairn-seeded-", dir=os.environ.get("BENCH_WORK"))
    try:
        c = series_repo(args, images, work, "seeded")
        u = f"su@{len(images)}"
        v_file, u_file = images[-2], images[-1]
        differing = differing_blocks(v_file, u_file)
        same_place, anywhere = seed_holds(u_file, v_file)
        result = {"date": time.strftime("%Y-%m-%d"), "store": "s3" if args.s3 else "local",
                  "version": os.path.basename(u_file)[:-4],
                  "seed": os.path.basename(v_file)[:-4],
                  "image_bytes": os.path.getsize(u_file), "differing_bytes": differing,
                  "seed_holds_same_place_bytes": same_place,
                  "seed_holds_anywhere_bytes": anywhere}
        want = sha(u_file)
        runs = {}
        for name, extra, out in [("plain", [], "out.raw"),
                                 ("seeded", ["--seed", v_file], "out.raw"),
                                 ("backing", ["--backing", v_file], "out.qcow2")]:
            path = os.path.join(work, out)
            if os.path.exists(path):
                os.unlink(path)
            r, seconds = c.json("restore", u, path, *extra)
            run = {"seconds": round(seconds, 2), "data_bytes": r["data_bytes"],
                   "fetched_bytes": r["fetched_bytes"],
                   "fetched_vs_differing": round(r["fetched_bytes"] / max(1, differing), 3),
                   "seeded_bytes": r["seeded_bytes"]}
            if name == "backing":
                same = subprocess.run(["qemu-img", "compare", "-q", "-F", "raw", path, u_file])
                run["qemu_img_compare_equal"] = same.returncode == 0
                run["file_bytes"] = os.path.getsize(path)
                run["file_vs_differing"] = round(run["file_bytes"] / max(1, differing), 3)
            else:
                run["bit_exact"] = sha(path) == want
            runs[name] = run
        result["runs"] = runs
        exports = {"plain": export_run(c, work, u, "plain", [], want),
                   "seeded": export_run(c, work, u, "seeded", ["--seed", v_file], want)}
        exports["seeded_fetched_vs_plain"] = round(
            exports["seeded"]["fetched_bytes"] / max(1, exports["plain"]["fetched_bytes"]), 3)
        result["exports"] = exports
        result["seeded_fetched_vs_plain"] = round(
            runs["seeded"]["fetched_bytes"] / max(1, runs["plain"]["fetched_bytes"]), 3)
        # The least a seeded restore can fetch: the plain restore's fetch, in the share of
        # the version's data the seed does not hold (compression taken as even).
        s = runs["seeded"]
        ideal = runs["plain"]["fetched_bytes"] * (s["data_bytes"] - s["seeded_bytes"]) \
            / max(1, s["data_bytes"])
        result["seeded_fetched_vs_ideal"] = round(s["fetched_bytes"] / max(1, ideal), 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(result, args.out)


if __name__ == "__main__":
    main()

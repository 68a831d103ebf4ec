#!/usr/bin/env python3
"""GC after `rm` on one repository, copied for each build, in one run (issue 17's GC scaling):
a sparse image of GIB GiB (1 MiB of data per 16 MiB, built from the dataset as compare.py
builds it) committed N times by the first build, WRITES 4 KiB writes into its data before each
commit after the first; then for each build, on a copy: `rm IMAGE@1` with its GC (apart: a
repository that is collected regularly has had a GC before, which keeps the merged summaries),
then `rm --no-gc IMAGE@max(2, N/2)`, a `sync`, and a timed `gc --json` (wall seconds, peak RSS,
and what it read: summaries, version records, index bytes). N >= 3. The first `rm` is timed
too (`first_rm_s`): its GC reads every live tree's summary to build the image's merge.

    bench/gc_after_rm.py WORK N NAME=PATH [NAME=PATH ...]
    GC_AB_GIB=16 GC_AB_WRITES=4096 bench/gc_after_rm.py WORK 2 before=B after=A

WORK must not exist yet, unless it holds the repository an earlier run built with the same N
(WORK/repo, reused as it is: the phases of one repository measured again). Results are JSON
lines on stdout, with `gc --json`'s time per GC step (`phases_s`).
"""
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import GIB, make_scaled_image, scribble  # noqa: E402

DATASET = Path(os.environ.get("CAIRN_DATASET", ".data/small")) / "su-2.raw"


def timed(cmd):
    t = time.monotonic()
    p = subprocess.run(["/usr/bin/time", "-f", "%M", *cmd], capture_output=True, text=True)
    if p.returncode:
        sys.exit(p.stderr[-500:])
    return time.monotonic() - t, int(p.stderr.strip().splitlines()[-1]) // 1024, p.stdout


def main():
    work, n, bins = Path(sys.argv[1]), int(sys.argv[2]), [b.split("=", 1) for b in sys.argv[3:]]
    gib = int(os.environ.get("GC_AB_GIB", "1"))
    writes = int(os.environ.get("GC_AB_WRITES", "4"))
    img, repo = work / "img.raw", work / "repo"
    if not repo.exists():
        work.mkdir(parents=True)
        make_scaled_image(img, gib * GIB, DATASET, 7)
        first = bins[0][1]
        subprocess.run([first, "--repo", str(repo), "init"], check=True, capture_output=True)
        rng = random.Random(3)
        for i in range(n):
            if i:
                scribble(img, rng, writes)
            subprocess.run([first, "--repo", str(repo), "commit", "vm", str(img)], check=True,
                           capture_output=True)
    for name, binary in bins:
        copy = work / f"repo-{name}"
        shutil.copytree(repo, copy)
        os.sync()
        first_s, first_rss, _ = timed([binary, "--repo", str(copy), "rm", "vm@1"])
        subprocess.run([binary, "--repo", str(copy), "rm", "--no-gc", f"vm@{max(2, n // 2)}"],
                       check=True, capture_output=True)
        # A repository at rest has nothing dirty in the page cache: without this, the GC's
        # first fsync also wrote back the copy just made (more of it at 1,000 versions).
        os.sync()
        s, rss, out = timed([binary, "--repo", str(copy), "--json", "gc"])
        r = json.loads(out)
        print(json.dumps({"build": name, "versions": n, "gib": gib,
                          "first_rm_s": round(first_s, 3), "first_rm_rss": first_rss,
                          "gc_s": round(s, 3),
                          "gc_rss": rss, "trailers_read": r.get("trailers_read"),
                          "summaries_read": r.get("summaries_read"),
                          "summary_bytes": r.get("summary_bytes"),
                          "records_read": r.get("records_read"),
                          "record_bundle_bytes": r.get("record_bundle_bytes"),
                          "index_read_bytes": r.get("index_read_bytes", r.get("index_bytes_read")),
                          "packs_deleted": r.get("packs_deleted"),
                          "packs_repacked": r.get("packs_repacked"),
                          "reclaimed_bytes": r.get("reclaimed_bytes", r.get("bytes_reclaimed")),
                          "gc_duration_s": r.get("duration_s"),
                          "phases_s": r.get("phases_s")}), flush=True)
        shutil.rmtree(copy)


if __name__ == "__main__":
    main()

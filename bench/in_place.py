#!/usr/bin/env python3
"""In-place restore against a full restore (issue 56: bytes written <= 1.2x the bytes that
differ, time <= 0.2x a full restore; killed mid-way, run again, bit-exact).

The dataset's `su-*` images are committed in order as versions of one image. With V the
second-to-last and U the last (su-4 and su-5 in the full dataset; su-1 and su-2 in the small
one), it measures, in one run:

- a full restore of V, and of U, to a new file (the baselines, the best of two each);
- `restore V TARGET --in-place` where TARGET is a fresh restore of U: by diff (cairn
  restored TARGET, so it knows TARGET holds U) and by compare (`--compare`: TARGET read and
  hashed segment by segment);
- the same the other way (U over a restore of V: rolling forward);
- a rollback after the VM ran: V restored, 32 MiB written over it (2,048 scattered 4 KiB
  blocks and a 24 MiB run), then V in place again (by compare: the file changed);
- an in-place restore killed with SIGKILL while it writes, then run again: the target must
  hold V bit for bit.

"Bytes that differ" are the 4 KiB blocks in which U and V differ (what a block-granular
writer must write at least), counted by reading both images. Times include the syncs each
command makes. With `--s3` the repository is a prefix under $CAIRN_TEST_S3_URL (run under
scripts/minio.sh).

    bench/in_place.py --dataset .data/small --bin target/ci/cairn [--s3] [--out FILE]

Prints one JSON document (also written to --out).
"""

import argparse
import glob
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid

BLOCK = 4096


def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def differing_blocks(a, b):
    """Bytes in the 4 KiB blocks where files a and b differ (the shorter read as zeros)."""
    n = 0
    with open(a, "rb") as fa, open(b, "rb") as fb:
        while True:
            x, y = fa.read(1 << 20), fb.read(1 << 20)
            if not x and not y:
                return n
            if x == y:
                continue
            size = max(len(x), len(y))
            x, y = x.ljust(size, b"\0"), y.ljust(size, b"\0")
            n += sum(BLOCK for i in range(0, size, BLOCK) if x[i:i + BLOCK] != y[i:i + BLOCK])


class Cairn:
    def __init__(self, binary, repo, state):
        self.binary, self.repo = binary, repo
        self.env = dict(os.environ, CAIRN_STATE_DIR=state)

    def args(self, *args):
        return [self.binary, "--repo", self.repo, *args]

    def run(self, *args):
        t = time.monotonic()
        p = subprocess.run(self.args(*args), capture_output=True, text=True, env=self.env)
        if p.returncode != 0:
            sys.exit(f"cairn {' '.join(args)}: {p.stderr.strip()}")
        return p.stdout, time.monotonic() - t

    def json(self, *args):
        out, seconds = self.run("--json", *args)
        return json.loads(out), seconds


def in_place(c, version, target, u, compare):
    """Restores `u` to `target` in full, then `version` over it in place."""
    c.run("-q", "restore", u, target, "--force")
    r, seconds = c.json("restore", version, target, "--in-place",
                        *(["--compare"] if compare else []))
    return r, seconds


def killed_mid_way(c, version, target, u, seconds, state):
    """An in-place restore killed while it writes, then run again."""
    markers = os.path.join(state, "in-place")
    c.run("-q", "restore", u, target, "--force")
    before = sha(target)
    proc = subprocess.Popen(c.args("-q", "restore", version, target, "--in-place", "--compare"),
                            env=c.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while proc.poll() is None and not (os.path.isdir(markers) and os.listdir(markers)):
        time.sleep(0.001)
    time.sleep(seconds * 0.6)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    torn = sha(target)
    r, rerun_seconds = c.json("restore", version, target, "--in-place")
    return {"killed": proc.returncode == -signal.SIGKILL, "target_changed": torn != before,
            "rerun_method": r["method"], "rerun_seconds": round(rerun_seconds, 2),
            "rerun_written_bytes": r["written_bytes"] + r["zeroed_bytes"],
            "bit_exact_after_rerun": sha(target)}


def emit(result, out):
    """Prints the result as JSON, and writes it to `out` when given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text + "\n")


def parse_args(doc):
    """The arguments the restore benchmarks share, and the dataset's su-* images in order."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--bin", default="target/ci/cairn")
    ap.add_argument("--s3", action="store_true", help="the repository under $CAIRN_TEST_S3_URL")
    ap.add_argument("--out")
    args = ap.parse_args()
    images = sorted(glob.glob(os.path.join(args.dataset, "su-*.raw")),
                    key=lambda p: int(os.path.basename(p)[3:-4]))
    if len(images) < 2:
        sys.exit(f"{args.dataset}: fewer than two su-* images")
    return args, images


def series_repo(args, images, work, name):
    """A new repository (under $CAIRN_TEST_S3_URL with --s3, else in `work`) holding the
    images, in order, as versions of the image `su`."""
    if args.s3:
        url = os.environ.get("CAIRN_TEST_S3_URL") or sys.exit("--s3: CAIRN_TEST_S3_URL unset")
        base, _, query = url.partition("?")
        repo = f"{base.rstrip('/')}/{name}-{uuid.uuid4().hex[:8]}?{query}"
    else:
        repo = os.path.join(work, "repo")
    c = Cairn(os.path.abspath(args.bin), repo, os.path.join(work, "state"))
    c.run("init")
    for image in images:
        c.run("-q", "commit", "su", image)
    return c


def main():
    args, images = parse_args(__doc__)
    work = tempfile.mkdtemp(prefix="cairn-in-place-", dir=os.environ.get("BENCH_WORK"))
    try:
        c = series_repo(args, images, work, "in-place")
        state = os.path.join(work, "state")
        names = [os.path.basename(i)[:-4] for i in images]
        n = len(images)
        v, u = f"su@{n - 1}", f"su@{n}"
        v_file, u_file = images[-2], images[-1]
        result = {"date": time.strftime("%Y-%m-%d"), "store": "s3" if args.s3 else "local",
                  "version": names[-2], "over": names[-1],
                  "image_bytes": os.path.getsize(v_file),
                  "differing_bytes": differing_blocks(v_file, u_file)}
        want = {v: sha(v_file), u: sha(u_file)}
        fresh = os.path.join(work, "full.raw")
        full = {}
        for ver in (v, u):
            times = []
            for _ in range(2):
                if os.path.exists(fresh):
                    os.unlink(fresh)
                times.append(c.json("restore", ver, fresh)[1])
            os.unlink(fresh)
            full[ver] = round(min(times), 2)
        result["full_restore_seconds"] = {names[-2]: full[v], names[-1]: full[u]}
        target = os.path.join(work, "target.raw")
        runs = {}
        # back: V over a restore of U (a rollback); forward: U over a restore of V.
        for name, (ver, over) in {"back": (v, u), "forward": (u, v)}.items():
            for compare in (False, True):
                r, seconds = in_place(c, ver, target, over, compare)
                ok = sha(target) == want[ver]
                runs[f"{name}_{r['method']}"] = {
                    "seconds": round(seconds, 2),
                    "vs_full_restore": round(seconds / full[ver], 3),
                    "written_bytes": r["written_bytes"], "zeroed_bytes": r["zeroed_bytes"],
                    "written_vs_differing": round((r["written_bytes"] + r["zeroed_bytes"])
                                                  / max(1, result["differing_bytes"]), 3),
                    "target_read_bytes": r["target_read_bytes"],
                    "fetched_bytes": r["fetched_bytes"], "bit_exact": ok}
        # A rollback after the VM ran: V restored, then 2,048 scattered 4 KiB blocks and one
        # 24 MiB run written over it (32 MiB, as a guest's day of logs and updates might),
        # then V in place again (by compare: the file changed since cairn wrote it).
        c.run("-q", "restore", v, target, "--force")
        rng = random.Random(56)
        size = os.path.getsize(target)
        with open(target, "r+b") as f:
            for _ in range(2048):
                f.seek(rng.randrange(0, size // BLOCK) * BLOCK)
                f.write(rng.randbytes(BLOCK))
            f.seek(rng.randrange(0, (size - (24 << 20)) // BLOCK) * BLOCK)
            f.write(rng.randbytes(24 << 20))
        written = differing_blocks(target, v_file)
        r, seconds = c.json("restore", v, target, "--in-place")
        runs["rollback_after_writes"] = {
            "differing_bytes": written, "seconds": round(seconds, 2),
            "vs_full_restore": round(seconds / full[v], 3),
            "written_bytes": r["written_bytes"], "zeroed_bytes": r["zeroed_bytes"],
            "written_vs_differing": round((r["written_bytes"] + r["zeroed_bytes"])
                                          / max(1, written), 3),
            "target_read_bytes": r["target_read_bytes"], "fetched_bytes": r["fetched_bytes"],
            "bit_exact": sha(target) == want[v]}
        result["in_place"] = runs
        k = killed_mid_way(c, v, target, u, runs["back_compare"]["seconds"], state)
        k["bit_exact_after_rerun"] = k["bit_exact_after_rerun"] == want[v]
        result["killed_mid_way"] = k
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(result, args.out)


if __name__ == "__main__":
    main()

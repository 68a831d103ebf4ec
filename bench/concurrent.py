#!/usr/bin/env python3
"""A fleet committed at once against the same fleet committed one by one, and what the
everyday `cairn gc` gives back (issue 55: within 1.05x of one by one, no `--repair`).

Every `su-*` (and, in the full dataset, `pa-*`) image of the dataset is committed as its own
image, twice, into fresh repositories:

- one by one: one `cairn commit` after the other (each dedups against those before it);
- at once: one `cairn commit` process per image, all started together (none sees what the
  others have not published yet, so each stores the shared data again).

Then `cairn gc` (fast deletion; no version was deleted) runs on the at-once repository, and
`cairn gc --repair --dry-run` says what the exact pass would still free. Stored bytes come
from `cairn stats --json`. With `--repo-url` the repositories are prefixes under that S3 URL
(run under scripts/minio.sh, which exports CAIRN_TEST_S3_URL), else local directories.

    bench/concurrent.py --dataset .data/small --bin target/ci/cairn [--s3] [--out FILE]

Prints one JSON document (also written to --out).
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid


def cairn(binary, repo, *args, env=None):
    p = subprocess.run([binary, "--repo", repo, *args], capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"cairn {' '.join(args)}: {p.stderr.strip()}")
    return p.stdout


def stored(binary, repo):
    return json.loads(cairn(binary, repo, "--json", "stats"))["stored_bytes"]


def fresh_repo(base, name, s3):
    if s3:
        url, _, query = base.partition("?")
        return f"{url.rstrip('/')}/{name}-{uuid.uuid4().hex[:8]}?{query}"
    return os.path.join(base, name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--bin", default="target/ci/cairn")
    ap.add_argument("--s3", action="store_true", help="repositories under $CAIRN_TEST_S3_URL")
    ap.add_argument("--out")
    args = ap.parse_args()
    images = sorted(glob.glob(os.path.join(args.dataset, "su-*.raw")))
    images += sorted(glob.glob(os.path.join(args.dataset, "pa-*.raw")))
    if len(images) < 2:
        sys.exit(f"{args.dataset}: fewer than two su-*/pa-* images")
    binary = os.path.abspath(args.bin)
    work = tempfile.mkdtemp(prefix="cairn-concurrent-", dir=os.environ.get("BENCH_WORK", ".data"))
    env = dict(os.environ)
    if args.s3:
        base = os.environ.get("CAIRN_TEST_S3_URL") or sys.exit("--s3: CAIRN_TEST_S3_URL is not set")
    else:
        base = work
    names = [os.path.basename(i)[: -len(".raw")] for i in images]
    result = {"date": time.strftime("%Y-%m-%d"), "store": "s3" if args.s3 else "local",
              "images": names, "image_bytes": sum(os.path.getsize(i) for i in images)}

    one = fresh_repo(base, "one-by-one", args.s3)
    cairn(binary, one, "init", env=env)
    t = time.monotonic()
    for image, name in zip(images, names):
        cairn(binary, one, "-q", "commit", name, image, env=env)
    result["one_by_one"] = {"seconds": round(time.monotonic() - t, 2),
                            "stored_bytes": stored(binary, one)}

    at_once = fresh_repo(base, "at-once", args.s3)
    cairn(binary, at_once, "init", env=env)
    t = time.monotonic()
    procs = [subprocess.Popen([binary, "--repo", at_once, "-q", "commit", name, image],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
             for image, name in zip(images, names)]
    for p in procs:
        _, err = p.communicate()
        if p.returncode != 0:
            sys.exit(f"a concurrent commit failed: {err.decode().strip()}")
    before = stored(binary, at_once)
    result["at_once"] = {"seconds": round(time.monotonic() - t, 2), "stored_bytes": before}
    t = time.monotonic()
    report = json.loads(cairn(binary, at_once, "--json", "gc", env=env))
    after = stored(binary, at_once)
    result["gc"] = {"seconds": round(time.monotonic() - t, 2), "stored_bytes": after,
                    "duplicate_blobs": report["duplicate_blobs"],
                    "duplicate_packs": report["duplicate_packs"],
                    "packs_deleted": report["packs_deleted"],
                    "packs_repacked": report["packs_repacked"],
                    "repacked_bytes": report["repacked_bytes"]}
    exact = json.loads(cairn(binary, at_once, "--json", "gc", "--repair", "--dry-run", env=env))
    result["repair_would_free"] = exact["reclaimed_bytes"]
    sequential = result["one_by_one"]["stored_bytes"]
    result["ratio_before_gc"] = round(before / sequential, 3)
    result["ratio_after_gc"] = round(after / sequential, 3)
    cairn(binary, at_once, "verify", env=env)
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    if not args.s3:
        subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    main()

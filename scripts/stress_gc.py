#!/usr/bin/env python3
"""Concurrency stress test: committers and a garbage collector on one repository.

Four processes commit their own changing image in a loop while a fifth runs `cairn prune
--all --keep-last 3` (which frees space at once) and `cairn gc` / `cairn gc --repair` in a
loop, for a bounded time. Afterwards:

- `cairn verify` must be clean;
- every version a committer was told was committed, and that prune kept, must restore
  bit-exact (and the last three of every image must all still be there);
- every gc must have succeeded, and the repository must be smaller than the sum of what the
  commits wrote (space really came back).

Then 20 trials kill -9 a gc at a random moment; after each, verify must be clean and the live
versions must restore.

Then the leak check, on a fresh repository: six committers, each cycling through three
variants of its image (so commits keep reusing data of versions prune just deleted), run
while a pruner keeps the last two versions of every image with fast deletion only (`prune`,
no `--repair`); afterwards
the exact pass may find at most 1% of the repository left to reclaim. (Fast deletion used to
keep whole doomed packs for the few blobs concurrent commits rescued from them: 24% and more.)

    scripts/stress_gc.py [--seconds 60] [--leak-seconds 40] [--bin target/release/cairn] [--repo URL]
                         [--encrypted] [--leak-writers 6] [--leak-deleters 1] [--leak-max-percent 1]

With --seconds 0 only the leak check runs. With --repo s3://... (e.g. under scripts/minio.sh
run) the same runs on a bucket; with
--encrypted on encrypted repositories (`init --encrypt`, the passphrase in $CAIRN_PASSWORD).

Prints "stress_gc: N passed, 0 failed" and exits non-zero on any failure.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks, sha  # noqa: E402

IMAGE_SIZE = 64 << 20
CHANGE = 1 << 20


def run(binary, repo, *args, check=True):
    p = subprocess.run([binary, "--repo", repo, "-q", *args], capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"cairn {' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def make_image(path, rng):
    with open(path, "wb") as f:
        f.truncate(IMAGE_SIZE)
        for _ in range(16):
            f.seek(rng.randrange(0, IMAGE_SIZE - CHANGE, 4096))
            f.write(rng.randbytes(CHANGE))


def mutate(path, rng):
    with open(path, "r+b") as f:
        f.seek(rng.randrange(0, IMAGE_SIZE - CHANGE, 4096))
        f.write(rng.randbytes(CHANGE))


class Results:
    def __init__(self):
        self.lock = threading.Lock()
        self.committed = {}  # image -> [(id, sha)]
        self.errors = []
        self.gc_runs = 0
        self.stored = 0

    def error(self, msg):
        with self.lock:
            self.errors.append(msg)


def committer(binary, repo, work, n, deadline, results):
    rng = random.Random(1000 + n)
    image = f"stress/w{n}"
    path = os.path.join(work, f"w{n}.raw")
    make_image(path, rng)
    while time.time() < deadline:
        digest = sha(path)
        p = run(binary, repo, "--json", "commit", image, path, check=False)
        if p.returncode != 0:
            results.error(f"commit {image}: {p.stderr.strip()}")
            return
        out = json.loads(p.stdout)
        with results.lock:
            results.committed.setdefault(image, []).append((out["id"], digest))
            results.stored += out["stored_bytes"]
        mutate(path, rng)


def collector(binary, repo, deadline, results):
    # prune frees what it deleted at once (fast deletion); every other round also runs the
    # exact pass, so both GC modes race the committers.
    rounds = 0
    while time.time() < deadline:
        rounds += 1
        gc = ["--json", "gc", "--repair"] if rounds % 2 == 0 else ["--json", "gc"]
        for args in (["prune", "--all", "--keep-last", "3"], gc):
            p = run(binary, repo, *args, check=False)
            if p.returncode != 0:
                results.error(f"{args[-1]}: {p.stderr.strip()}")
                return
        with results.lock:
            results.gc_runs += 1
        time.sleep(0.2)


def cycling_committer(binary, repo, work, n, deadline, results):
    """Commits three variants of one image in turn, as a fleet cycling through a few golden
    images does: every version's data recurs, so commits keep reusing blobs of versions that
    prune has just deleted — what makes GC rescue blobs."""
    rng = random.Random(5000 + n)
    image = f"leak/w{n}"
    paths = []
    base = os.path.join(work, f"c{n}-0.raw")
    make_image(base, rng)
    for v in range(3):
        path = os.path.join(work, f"c{n}-{v}.raw")
        if v:
            shutil.copyfile(paths[-1], path)
            for _ in range(4):
                mutate(path, rng)
        paths.append(path)
    digests = [sha(p) for p in paths]
    i = 0
    while time.time() < deadline:
        p = run(binary, repo, "--json", "commit", image, paths[i % 3], check=False)
        if p.returncode != 0:
            results.error(f"commit {image}: {p.stderr.strip()}")
            return
        out = json.loads(p.stdout)
        with results.lock:
            results.committed.setdefault(image, []).append((out["id"], digests[i % 3]))
        i += 1


def pruner(binary, repo, deadline, results):
    """Fast deletion only: prune (which frees at once) in a loop."""
    while time.time() < deadline:
        p = run(binary, repo, "prune", "--all", "--keep-last", "2", check=False)
        if p.returncode != 0:
            results.error(f"prune: {p.stderr.strip()}")
            return
        with results.lock:
            results.gc_runs += 1


ENCRYPT = []  # ["--encrypt"] with --encrypted


def leak_check(binary, repo, work, seconds, checks, writers=6, deleters=1, max_left=0.01):
    """Commits during prunes: what fast deletion leaves for the exact pass."""
    run(binary, repo, "init", "--pack-size", "4M", *ENCRYPT)
    results = Results()
    deadline = time.time() + seconds
    threads = [threading.Thread(target=cycling_committer, args=(binary, repo, work, n, deadline, results))
               for n in range(writers)]
    threads += [threading.Thread(target=pruner, args=(binary, repo, deadline, results))
                for _ in range(deleters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    commits = sum(len(v) for v in results.committed.values())
    checks.ok(not results.errors, f"no command failed during the leak run: {results.errors[:3]}")
    checks.ok(results.gc_runs >= 3, f"prune ran repeatedly during the commits ({results.gc_runs})")
    run(binary, repo, "prune", "--all", "--keep-last", "2")
    exact = json.loads(run(binary, repo, "--json", "gc", "--repair").stdout)
    left = exact["reclaimed_bytes"] / max(1, exact["before_bytes"])
    print(f"leak check ({writers} writers, {deleters} deleters): {commits} commits, "
          f"{results.gc_runs} prunes; gc --repair reclaimed "
          f"{exact['reclaimed_bytes']} of {exact['before_bytes']} bytes ({100 * left:.2f}%)", flush=True)
    if left > max_left:  # what the exact pass found, to tell which kind of leak it was
        print("  gc --repair: " + json.dumps({k: v for k, v in exact.items()
                                              if isinstance(v, (int, float)) and v}), flush=True)
    checks.ok(left <= max_left, f"fast deletion during commits leaves at most {100 * max_left:g}% "
              f"to gc --repair ({100 * left:.2f}%)")
    p = run(binary, repo, "verify", check=False)
    checks.ok(p.returncode == 0, f"verify clean after the leak run: {p.stdout.strip()[-300:]}")


def restore_matches(binary, repo, spec, digest, work):
    out = os.path.join(work, "restored.raw")
    p = run(binary, repo, "restore", spec, out, "--force", check=False)
    if p.returncode != 0:
        return False, p.stderr.strip()
    same = sha(out) == digest
    os.remove(out)
    return same, "content differs"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60,
                    help="length of the stress run (0: skip it and its kill -9 trials)")
    ap.add_argument("--leak-seconds", type=float, default=40,
                    help="length of the leak check (0: skip it)")
    ap.add_argument("--bin", default=os.environ.get("CAIRN_BIN", "target/release/cairn"))
    ap.add_argument("--repo", help="repository URL (e.g. s3://BUCKET/PREFIX?...); "
                    "default: a fresh directory")
    ap.add_argument("--leak-writers", type=int, default=6, help="committers of the leak check")
    ap.add_argument("--leak-deleters", type=int, default=1,
                    help="concurrent pruners (fast deletion) of the leak check")
    ap.add_argument("--leak-max-percent", type=float, default=1.0,
                    help="the most of the repository the exact pass may reclaim after it")
    ap.add_argument("--encrypted", action="store_true",
                    help="encrypted repositories (the passphrase in $CAIRN_PASSWORD)")
    args = ap.parse_args()
    if args.encrypted:
        ENCRYPT.append("--encrypt")
        os.environ["CAIRN_PASSWORD"] = "stress passphrase"
    binary = os.path.abspath(args.bin)
    work = tempfile.mkdtemp(prefix="cairn-stress-", dir=os.environ.get("CAIRN_STRESS_DIR"))
    repo = args.repo or os.path.join(work, "repo")
    checks = Checks()
    try:
        if args.seconds > 0:  # 0: the leak check alone
            run(binary, repo, "init", "--pack-size", "1M", *ENCRYPT)
            results = Results()
            deadline = time.time() + args.seconds
            threads = [threading.Thread(target=committer, args=(binary, repo, work, n, deadline, results)) for n in range(4)]
            threads.append(threading.Thread(target=collector, args=(binary, repo, deadline, results)))
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            total = sum(len(v) for v in results.committed.values())
            print(f"stress: {total} commits, {results.gc_runs} prune+gc rounds in {args.seconds:.0f} s", flush=True)
            for e in results.errors:
                print(f"  error: {e}", flush=True)
            checks.ok(not results.errors, "no command failed during the stress run")
            checks.ok(results.gc_runs >= 2, f"gc ran repeatedly ({results.gc_runs})")
            checks.ok(all(len(v) >= 3 for v in results.committed.values()) and len(results.committed) == 4,
                      "every committer committed at least 3 versions")
            p = run(binary, repo, "verify", check=False)
            checks.ok(p.returncode == 0, f"verify is clean after the stress run: {p.stdout.strip()[-400:]}")

            # Every committed version is either deleted by prune or restores bit-exact.
            restored = 0
            for image, versions in sorted(results.committed.items()):
                for i, (vid, digest) in enumerate(versions):
                    spec = f"{image}@{vid}"
                    show = run(binary, repo, "show", spec, check=False)
                    newest_three = i >= len(versions) - 3
                    if show.returncode != 0:
                        checks.ok("was deleted" in show.stderr and not newest_three,
                                  f"{spec} is gone only because prune deleted it: {show.stderr.strip()}")
                        continue
                    same, why = restore_matches(binary, repo, spec, digest, work)
                    checks.ok(same, f"{spec} restores bit-exact ({why})")
                    restored += 1
            checks.ok(restored >= 12, f"at least the newest 3 versions of each image restored ({restored})")
            if args.repo:  # remote: what the repository's index and metadata hold
                size = json.loads(run(binary, repo, "--json", "stats").stdout)["stored_bytes"]
            else:
                size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(repo) for f in fs)
            checks.ok(size < results.stored, f"gc gave space back: repository {size} < written {results.stored}")

            # kill -9 of gc at random moments.
            rng = random.Random(7)
            latest = {image: versions[-1] for image, versions in results.committed.items()}
            for trial in range(20):
                run(binary, repo, "prune", "--all", "--keep-last", "1", "--no-gc")
                mode = ["--repair"] if trial % 2 else []
                gc = subprocess.Popen([binary, "--repo", repo, "-q", "gc", "--stale-after", "1", *mode],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                time.sleep(rng.uniform(0.0, 0.25))
                gc.send_signal(signal.SIGKILL)
                gc.wait()
                p = run(binary, repo, "verify", check=False)
                checks.ok(p.returncode == 0, f"trial {trial}: verify clean after kill -9 of gc: {p.stdout.strip()[-300:]}")
                if trial % 5 == 4:
                    for image, (vid, digest) in sorted(latest.items()):
                        same, why = restore_matches(binary, repo, f"{image}@{vid}", digest, work)
                        checks.ok(same, f"trial {trial}: {image} newest restores ({why})")
                # A commit between trials, so later gcs have new garbage to chew on.
                if trial % 4 == 0:
                    path = os.path.join(work, "w0.raw")
                    mutate(path, rng)
                    digest = sha(path)
                    out = json.loads(run(binary, repo, "--json", "commit", "stress/w0", path).stdout)
                    latest["stress/w0"] = (out["id"], digest)
            time.sleep(1.2)  # let the killed gcs' sessions go stale (--stale-after 1)
            p = run(binary, repo, "--json", "gc", "--repair", "--stale-after", "1", check=False)
            checks.ok(p.returncode == 0, f"a final gc completes: {p.stderr.strip()}")
            p = run(binary, repo, "verify", check=False)
            checks.ok(p.returncode == 0, "verify clean at the end")
            for image, (vid, digest) in sorted(latest.items()):
                same, why = restore_matches(binary, repo, f"{image}@{vid}", digest, work)
                checks.ok(same, f"{image} newest restores at the end ({why})")

        if args.leak_seconds > 0:
            leak_work = os.path.join(work, "leak")
            os.makedirs(leak_work)
            if args.repo:  # a sibling prefix: ".../stress?query" -> ".../stress-leak?query"
                base, sep, query = args.repo.partition("?")
                leak_repo = f"{base}-leak{sep}{query}"
            else:
                leak_repo = os.path.join(leak_work, "repo")
            leak_check(binary, leak_repo, leak_work, args.leak_seconds, checks,
                       args.leak_writers, args.leak_deleters, args.leak_max_percent / 100)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"stress_gc: {checks.passed} passed, {checks.failed} failed")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Multideployment and multisnapshotting (issue 56, BlobSeer's Figs. 4 and 5): N VMs start at
once from one image; N running VMs are committed at once.

The dataset's `su-*` images are committed in order as versions of one image; U is the newest.
A boot of the version before U over `cairn export` records the boot profile (the order of the
guest's first reads; or `--profile-in FILE`), stored with the image by `cairn profile set`.
Then, for each N in --n (default 1, 8, 32), N "VMs" start at once, each replaying the
profile's reads in order, one at a time, by `qemu-io` (an NBD client), as a booting guest
would. Real guests are left out: under TCG on this 2-core machine one boot takes ~25 s of CPU,
so N of them would measure the CPU, not the store. Ways of starting them:

- `lazy`: one export per VM with a cache of its own (N hosts), `--no-profile`: fetched on
  demand, in the guest's order (BlobSeer's multideployment);
- `lazy_profile`: the same, each export fetching the stored profile ahead (no flag);
- `lazy_shared_cache`: N exports on one host sharing its chunk cache, with the profile;
- `copy_then_boot`: N `cairn restore`s of U at once, then each VM's reads from its local
  copy (prepropagation).

Reported per N and way: seconds from the start to the last VM's last read, and the bytes
fetched from the repository in all.

Multisnapshotting: N writable exports of U, each client writes 16 MiB of its own random data
(16 writes of 1 MiB spread over the disk), then the N exports are committed at once, each as a
new image (`cairn commit vm-I --from-export`): seconds to the last commit, and bytes stored
against the 16 MiB × N written. Everything shares one machine (2 cores), and on MinIO
the store too: times are this machine's, not a cluster's; the bytes do not depend on it.

    bench/multideploy.py --dataset .data/small --bin target/ci/cairn [--s3] [--out FILE]
        [--profile-in FILE] [--n 1,8,32]

Prints one JSON document (also written to --out).
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from boot_profile import Export, boot, replay  # noqa: E402
from in_place import emit, parse_args, series_repo  # noqa: E402


def own_args():
    """This benchmark's own options, taken out of argv before the shared parser sees it."""
    out = {"profile_in": None, "n": [1, 8, 32]}
    rest = [sys.argv[0]]
    it = iter(sys.argv[1:])
    for a in it:
        if a == "--profile-in":
            out["profile_in"] = next(it)
        elif a == "--n":
            out["n"] = [int(x) for x in next(it).split(",")]
        else:
            rest.append(a)
    sys.argv = rest
    return out


def at_once(jobs):
    """Runs the callables at once, each in a thread; their results in order."""
    results = [None] * len(jobs)

    def run(i, job):
        results[i] = job()

    threads = [threading.Thread(target=run, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def lazy(c, work, u, reads, n, name, flags, cache=None):
    """N exports started at once (each with a cache of its own, or all with `cache`), each
    replaying `reads` as soon as it serves; seconds to the last read, and bytes fetched."""
    t = time.monotonic()

    def vm(i):
        e = Export(c, work, u, f"{name}-{n}-{i}", flags, cache=cache)
        replay(e.uri, reads)
        return e

    exports = at_once([lambda i=i: vm(i) for i in range(n)])
    seconds = time.monotonic() - t
    stats = [e.stop() for e in exports]
    return {"seconds": round(seconds, 2),
            "fetched_bytes": sum(s["fetched_bytes"] for s in stats),
            "prefetched_bytes": sum(s["prefetched_bytes"] for s in stats)}


def copy_then_boot(c, work, u, reads, n):
    """N restores of U at once, then each VM's reads from its copy; (seconds, fetched)."""
    t = time.monotonic()

    def vm(i):
        path = os.path.join(work, f"copy-{n}-{i}.raw")
        out = subprocess.run(c.args("--json", "restore", u, path), env=c.env,
                             capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"restore: {out.stderr.strip()}")
        fetched = json.loads(out.stdout)["fetched_bytes"]
        cmds = []
        for off, length in reads:
            cmds += ["-c", f"read -q {off} {length}"]
        subprocess.run(["qemu-io", "-r", "-f", "raw", *cmds, path], check=True,
                       capture_output=True)
        os.remove(path)
        return fetched

    fetched = at_once([lambda i=i: vm(i) for i in range(n)])
    return {"seconds": round(time.monotonic() - t, 2), "fetched_bytes": sum(fetched)}


WRITE = 16 << 20
PIECE = 1 << 20


def multisnapshot(c, work, u, n, size):
    """N writable exports each written, then committed at once; seconds and bytes stored."""
    exports = []
    stride = size // (WRITE // PIECE)
    for i in range(n):
        name = f"snap-{n}-{i}"
        e = Export(c, work, u, name, ["--no-profile", "--writable", "--overlay",
                                      os.path.join(work, name, "overlay")])
        cmds = []
        for k in range(WRITE // PIECE):
            # Each piece random bytes of its own (qemu-io writes a pattern file's start).
            data = os.path.join(work, name, f"piece-{k}")
            with open(data, "wb") as f:
                f.write(os.urandom(PIECE))
            cmds += ["-c", f"write -q -s {data} {k * stride} {PIECE}"]
        subprocess.run(["qemu-io", "-f", "raw", *cmds, e.uri], check=True, capture_output=True)
        exports.append((e, name))
    t = time.monotonic()

    def commit(e, name):
        env = dict(c.env, CAIRN_RUN_DIR=os.path.join(e.dir, "run"))
        out = subprocess.run(c.args("--json", "commit", f"vm-{name}", "--from-export", "disk"),
                             env=env, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"commit --from-export {name}: {out.stderr.strip()}")
        return json.loads(out.stdout)["stored_bytes"]

    stored = at_once([lambda e=e, name=name: commit(e, name) for e, name in exports])
    seconds = time.monotonic() - t
    for e, _ in exports:
        e.stop()
    return {"seconds": round(seconds, 2), "written_bytes": n * WRITE,
            "stored_bytes": sum(stored),
            "stored_vs_written": round(sum(stored) / (n * WRITE), 3)}


def main():
    own = own_args()
    args, images = parse_args(__doc__)
    work = tempfile.mkdtemp(prefix="cairn-multideploy-", dir=os.environ.get("BENCH_WORK"))
    try:
        c = series_repo(args, images, work, "multideploy")
        count = len(images)
        u, v = f"su@{count}", f"su@{count - 1}"
        profile = os.path.join(work, "su.boot.json")
        if own["profile_in"]:
            shutil.copy(own["profile_in"], profile)
        else:
            e = Export(c, work, v, "record", ["--no-profile", "--record-profile", profile])
            boot(args.dataset, f"file={e.uri}", os.path.join(work, "record.log"))
            e.stop()
        c.run("profile", "set", "su", profile)
        with open(profile) as f:
            reads = json.load(f)["reads"]
        result = {"date": time.strftime("%Y-%m-%d"), "store": "s3" if args.s3 else "local",
                  "image": os.path.basename(images[-1])[:-4],
                  "image_bytes": os.path.getsize(images[-1]),
                  "profile": {"reads": len(reads), "bytes": sum(x[1] for x in reads)},
                  "runs": {}}
        for n in own["n"]:
            runs = {
                "lazy": lazy(c, work, u, reads, n, "lazy", ["--no-profile"]),
                "lazy_profile": lazy(c, work, u, reads, n, "profile", []),
                "lazy_shared_cache": lazy(c, work, u, reads, n, "shared", [],
                                          cache=os.path.join(work, f"cache-{n}")),
                "copy_then_boot": copy_then_boot(c, work, u, reads, n),
            }
            base = runs["copy_then_boot"]
            for r in runs.values():
                if "fetched_bytes" not in r:
                    continue
                r["time_vs_copy"] = round(r["seconds"] / base["seconds"], 3)
                r["bytes_vs_copy"] = round(r["fetched_bytes"] / max(base["fetched_bytes"], 1), 3)
            runs["multisnapshot"] = multisnapshot(c, work, u, n, result["image_bytes"])
            result["runs"][str(n)] = runs
            print(f"N={n}: {json.dumps(runs)}", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(result, args.out)


if __name__ == "__main__":
    main()

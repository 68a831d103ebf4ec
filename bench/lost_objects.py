#!/usr/bin/env python3
"""What one lost or damaged metadata object costs (issue 53), measured with the real binary.

For each damage below, a fresh local repository gets seven versions of one image (a 16 MiB
disk of random data, 64 blocks of 4 KiB changed per version), the object is damaged, and
the operator's day follows: `cairn verify`, `cairn gc`, `cairn gc --repair`, `cairn repair`,
then a commit of the newest data again. Reported per damage: how many of the seven versions
restore bit-exact right after the damage, after the two GCs, and after repair; whether
`verify` said anything; whether `restore IMAGE` returned a wrong version with exit 0; the
stored bytes before and after.

    bench/lost_objects.py [--bin target/ci/cairn] [--old-bin OLD] [--out bench/results/lost-objects.json]

With --old-bin the same runs with a second binary (e.g. a build of an earlier commit), in the
same run, for a before/after table. Prints a Markdown table.
"""

import argparse
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

VERSIONS = 7
SIZE = 16 << 20


def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


class Repo:
    def __init__(self, binary, path):
        self.binary, self.path = binary, path

    def run(self, *args):
        return subprocess.run([self.binary, "--repo", self.path, *args], capture_output=True,
                              text=True, env=dict(os.environ, CAIRN_LOG="off"))

    def stored(self):
        return sum(os.path.getsize(os.path.join(d, f))
                   for d, _, fs in os.walk(self.path) for f in fs)


def series(work, rng):
    """The seven images and their digests."""
    data = bytearray(rng.randbytes(SIZE))
    images = []
    for v in range(VERSIONS):
        for _ in range(64):
            at = rng.randrange(SIZE // 4096) * 4096
            data[at:at + 4096] = rng.randbytes(4096)
        path = os.path.join(work, f"v{v}.raw")
        with open(path, "wb") as f:
            f.write(data)
        images.append((path, sha(path)))
    return images


def ids(repo):
    p = repo.run("--json", "log", "vm")
    return [v["id"] for v in json.loads(p.stdout)] if p.returncode == 0 else []


def restorable(repo, work, versions):
    """How many of the versions (id, digest) restore bit-exact; raises on wrong bytes."""
    out, ok = os.path.join(work, "out.raw"), 0
    for vid, digest in versions:
        p = repo.run("restore", f"vm@{vid}", out, "--force")
        if p.returncode == 0:
            if sha(out) != digest:
                raise SystemExit(f"vm@{vid[:12]} restored wrong bytes with exit 0")
            ok += 1
    return ok


def largest(repo, prefix):
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(repo.path, prefix))
             for f in fs if not f.startswith(".")]
    return max(files, key=os.path.getsize)


def flip(path, offset):
    with open(path, "r+b") as f:
        size = os.path.getsize(path)
        f.seek(offset % size)
        b = f.read(1)
        f.seek(offset % size)
        f.write(bytes([b[0] ^ 1]))


def damage_index_runs(repo, _):
    for d, _, fs in os.walk(os.path.join(repo.path, "index-runs")):
        for f in fs:
            os.remove(os.path.join(d, f))


def damage_head_deleted(repo, _):
    os.remove(os.path.join(repo.path, "refs", "heads", "vm"))


def damage_head_moved_back(repo, state):
    shutil.copy(state["head@2"], os.path.join(repo.path, "refs", "heads", "vm"))


def damage_newest_record(repo, state):
    os.remove(os.path.join(repo.path, "versions", state["newest"]))


def damage_trailer(repo, _):
    flip(largest(repo, "packs"), -100)


def damage_group(repo, _):
    flip(largest(repo, "packs"), 5000)


def damage_footer(repo, _):
    flip(largest(repo, "packs"), -10)


def damage_tail(repo, _):
    path = largest(repo, "packs")
    os.truncate(path, os.path.getsize(path) - 60)


def damage_pack_deleted(repo, _):
    os.remove(largest(repo, "packs"))


def smallest(repo, prefix):
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(repo.path, prefix))
             for f in fs if not f.startswith(".")]
    return min(files, key=os.path.getsize)


def damage_node(repo, _):
    flip(smallest(repo, "packs"), 100)  # past a version 3 pack's first frame (20 + 33)


def damage_index_section(repo, _):
    flip(largest(repo, "index-runs"), 30)


def damage_summary_deleted(repo, _):
    os.remove(largest(repo, "summaries"))


def damage_gc_plan(repo, _):
    os.makedirs(os.path.join(repo.path, "gc", "plans"), exist_ok=True)
    with open(os.path.join(repo.path, "gc", "plans", "0" * 64), "wb") as f:
        f.write(b"garbage")


DAMAGES = [
    ("every index run deleted", damage_index_runs),
    ("head ref deleted", damage_head_deleted),
    ("head ref moved back to @2", damage_head_moved_back),
    ("newest version record deleted", damage_newest_record),
    ("a byte of the first pack's trailer", damage_trailer),
    ("a byte of the first pack's footer", damage_footer),
    ("the first pack cut 60 bytes short", damage_tail),
    ("the first pack deleted", damage_pack_deleted),
    ("a byte of a group of the first pack", damage_group),
    ("a byte of a manifest node (the smallest pack)", damage_node),
    ("a byte of an index run's section", damage_index_section),
    ("a reference summary deleted", damage_summary_deleted),
    ("a garbage gc plan", damage_gc_plan),
]


def one(binary, work, images, name, damage):
    path = os.path.join(work, "repo")
    shutil.rmtree(path, ignore_errors=True)
    repo = Repo(binary, path)
    repo.run("init", "--reserve", "0")
    state = {}
    for v, (img, _) in enumerate(images):
        repo.run("commit", "vm", img)
        if v == 1:
            state["head@2"] = os.path.join(work, "head@2")
            shutil.copy(os.path.join(path, "refs", "heads", "vm"), state["head@2"])
    vids = ids(repo)[::-1]  # oldest first
    versions = list(zip(vids, [d for _, d in images]))
    state["newest"] = vids[-1]
    before = repo.stored()
    damage(repo, state)
    row = {"damage": name, "binary": binary, "versions": VERSIONS}
    row["restore_after_damage"] = restorable(repo, work, versions)
    v = repo.run("verify")
    row["verify_exit"] = v.returncode
    out = os.path.join(work, "newest.raw")
    p = repo.run("restore", "vm", out, "--force")
    row["restore_image_exit"] = p.returncode
    row["restore_image_wrong_version"] = p.returncode == 0 and sha(out) != images[-1][1]
    for mode in ([], ["--repair"]):
        repo.run("gc", *mode)
    row["restore_after_gc"] = restorable(repo, work, versions)
    repo.run("repair")
    row["restore_after_repair"] = restorable(repo, work, versions)
    p = repo.run("commit", "vm", images[-1][0])
    row["recommit_exit"] = p.returncode
    # Does the new version hold the data (a commit that reused damaged leaves would not)?
    q = repo.run("restore", "vm", out, "--force")
    row["recommit_restores"] = p.returncode == 0 and q.returncode == 0 and sha(out) == images[-1][1]
    row["stored_before"], row["stored_after"] = before, repo.stored()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default="target/ci/cairn")
    ap.add_argument("--old-bin")
    ap.add_argument("--label", default="after", help="what to call --bin in the table")
    ap.add_argument("--old-label", default="before", help="what to call --old-bin")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="cairn-lost-")
    try:
        images = series(work, random.Random(53))
        rows = []
        for binary, label in [(args.old_bin, args.old_label), (args.bin, args.label)]:
            if not binary:
                continue
            for name, damage in DAMAGES:
                rows.append(one(os.path.abspath(binary), work, images, name, damage))
                rows[-1]["label"] = label
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    print("| damage | cairn | restore after damage | verify exit | `restore IMAGE` | after gc + gc --repair | after repair | re-commit restores |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: [n for n, _ in DAMAGES].index(r["damage"])):
        newest = ("wrong version, exit 0" if r["restore_image_wrong_version"]
                  else f"exit {r['restore_image_exit']}")
        print(f"| {r['damage']} | {r['label']} | {r['restore_after_damage']}/{VERSIONS} | "
              f"{r['verify_exit']} | {newest} | {r['restore_after_gc']}/{VERSIONS} | "
              f"{r['restore_after_repair']}/{VERSIONS} | "
              f"{'yes' if r['recommit_restores'] else 'NO'} |")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Metadata a commit writes when one 4 KiB block of a dense image changed (issue 54, item 2).

    bench/summary_delta.py [--bin target/ci/cairn] [--sizes 2,64] [--commits 8] [--out FILE]

Each image is dense and incompressible by dedup: nbdkit's `pattern` plugin (every 8 bytes
hold their own offset), streamed by `nbdcopy` into `cairn commit IMAGE -`, so no image file
is written however large. Each later version writes 4 KiB at a random
offset (one byte repeated, a different one each version) through nbdkit's `cow` filter. For every commit the script reports the new objects of
the repository by kind: the reference summary, the index run and the version record (the
metadata), and the packs. Position 0 of a summary chain is a whole summary: what every
commit wrote before summary deltas.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def files(repo: Path) -> dict:
    out = {}
    for p in repo.rglob("*"):
        if p.is_file():
            out[str(p.relative_to(repo))] = p.stat().st_size
    return out


def kind(key: str) -> str:
    for prefix, name in (("summaries/", "summary"), ("index-runs/", "index"),
                         ("versions/", "record"), ("packs/", "packs")):
        if key.startswith(prefix):
            return name
    return "other"


def run(size_gib: int, commits: int, cairn: str, work: Path) -> list:
    repo = work / f"repo-{size_gib}"
    env = dict(os.environ, CAIRN_REPO=str(repo))
    subprocess.run([cairn, "init"], check=True, env=env, capture_output=True)
    sock = work / f"nbd-{size_gib}.sock"
    server = subprocess.Popen(["nbdkit", "-f", "--filter=cow", "-U", str(sock), "pattern",
                               f"size={size_gib}G"])
    try:
        for _ in range(100):
            if sock.exists():
                break
            time.sleep(0.1)
        rng = random.Random(size_gib)
        rows = []
        for k in range(commits):
            if k > 0:
                at = rng.randrange(size_gib << 18) * 4096
                subprocess.run(["qemu-io", "-f", "raw", "-c", f"write -P {k % 200 + 17} {at} 4k",
                                f"nbd+unix:///?socket={sock}"], check=True,
                               capture_output=True)
            before = files(repo)
            start = time.monotonic()
            copy = subprocess.Popen(["nbdcopy", f"nbd+unix:///?socket={sock}", "-"],
                                    stdout=subprocess.PIPE)
            subprocess.run([cairn, "commit", "--json", "bench", "-"], stdin=copy.stdout,
                           check=True, env=env, capture_output=True)
            copy.wait()
            seconds = time.monotonic() - start
            new = {key: size for key, size in files(repo).items() if key not in before}
            by_kind = {}
            for key, size in new.items():
                by_kind[kind(key)] = by_kind.get(kind(key), 0) + size
            summary = [key for key in new if key.startswith("summaries/")]
            whole = all((repo / key).read_bytes()[:8] == b"CRNSUM2\0" for key in summary)
            rows.append({"size_gib": size_gib, "commit": k + 1, "seconds": round(seconds, 1),
                         "summary_bytes": by_kind.get("summary", 0),
                         "summary_whole": whole,
                         "index_bytes": by_kind.get("index", 0),
                         "record_bytes": by_kind.get("record", 0),
                         "metadata_bytes": sum(by_kind.get(x, 0) for x in ("summary", "index", "record")),
                         "pack_bytes": by_kind.get("packs", 0)})
            print(json.dumps(rows[-1]), flush=True)
        return rows
    finally:
        server.terminate()
        server.wait()
        subprocess.run(["rm", "-rf", str(repo)])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default="target/ci/cairn")
    ap.add_argument("--sizes", default="2,64")
    ap.add_argument("--commits", type=int, default=8)
    ap.add_argument("--out")
    args = ap.parse_args()
    cairn = str(Path(args.bin).resolve())
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as work:
        rows = []
        for size in map(int, args.sizes.split(",")):
            rows += run(size, args.commits, cairn, Path(work))
    result = {"date": time.strftime("%Y-%m-%d"), "command": " ".join(sys.argv), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

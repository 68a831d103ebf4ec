#!/usr/bin/env python3
"""The practical floor of stored bytes for a series of images (issue 56 item 4): every distinct
non-zero 4 KiB block once, in the order first met, compressed as one stream by
`zstd -9 --long=27` (a 128 MiB window, so near-duplicates far apart are found too). No store
that keeps blocks addressable can expect to beat it by much; cairn's bytes are compared with it.

    bench/floor.py IMAGE... [--level 9] [--long 27] [--json]

Raw images only; holes are skipped (SEEK_DATA/SEEK_HOLE), as every tool reads them.
Prints the floor in bytes, with the distinct and non-zero block counts.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys

BLOCK = 4096
ZERO = bytes(BLOCK)


def data_extents(f):
    """(start, end) of the allocated extents of an open file."""
    fd = f.fileno()
    end = os.fstat(fd).st_size
    pos = 0
    while pos < end:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:
            return
        stop = os.lseek(fd, start, os.SEEK_HOLE)
        yield start - start % BLOCK, stop
        pos = stop


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("images", nargs="+")
    ap.add_argument("--level", type=int, default=9)
    ap.add_argument("--long", type=int, default=27)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    zstd = subprocess.Popen(
        ["zstd", f"-{a.level}", f"--long={a.long}", "-T0", "-q", "-c"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    counted = {"bytes": 0}

    import threading

    def count():
        while True:
            b = zstd.stdout.read(1 << 20)
            if not b:
                return
            counted["bytes"] += len(b)

    t = threading.Thread(target=count)
    t.start()
    seen = set()
    nonzero = distinct = 0
    for path in a.images:
        with open(path, "rb") as f:
            for start, stop in data_extents(f):
                f.seek(start)
                left = stop - start
                while left > 0:
                    buf = f.read(min(left, 16 << 20))
                    if not buf:
                        break
                    left -= len(buf)
                    for i in range(0, len(buf), BLOCK):
                        blk = buf[i:i + BLOCK]
                        if blk == ZERO[:len(blk)]:
                            continue
                        nonzero += 1
                        h = hashlib.blake2b(blk, digest_size=16).digest()
                        if h in seen:
                            continue
                        seen.add(h)
                        distinct += 1
                        zstd.stdin.write(blk)
    zstd.stdin.close()
    zstd.wait()
    t.join()
    out = {"images": a.images, "floor_bytes": counted["bytes"], "distinct_blocks": distinct,
           "nonzero_blocks": nonzero, "level": a.level, "long": a.long}
    if a.json:
        print(json.dumps(out))
    else:
        print(f"floor {counted['bytes']} bytes: {distinct} distinct of {nonzero} non-zero "
              f"4 KiB blocks, zstd -{a.level} --long={a.long}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

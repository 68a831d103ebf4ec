#!/usr/bin/env python3
"""What group frames cost (pack version 3, issue 53): commits the su-* series into a fresh
plain repository and reads every pack's trailer to sum the bytes between groups (the frames)
against the bytes stored. A sealed frame is 32 bytes longer per stored part (nonce and tag
where the plain one has an 8-byte checksum), so the encrypted cost follows from the same
count, which this script prints too.

    python3 bench/pack_frames.py [--bin target/ci/cairn] [--data .data/small] [--json OUT]
"""

import argparse
import glob
import json
import os
import struct
import subprocess
import tempfile

FOOTER = 48
HEADER = 20


def pack_frames(path):
    """(pack bytes, frame bytes, groups, listed frames) of one plain version 3 pack."""
    data = open(path, "rb").read()
    version = struct.unpack_from("<I", data, 8)[0]
    assert version == 3, f"{path}: pack version {version}"
    groups, trailer_len = struct.unpack_from("<II", data, len(data) - FOOTER)
    start = len(data) - FOOTER - trailer_len
    at, end_of_last, frames, listed = start + 8, HEADER, 0, 0
    for _ in range(groups):
        offset, stored = struct.unpack_from("<II", data, at)
        gap = offset - end_of_last
        frames += gap
        listed += gap > 33
        end_of_last = offset + stored
        at += 16
    return len(data), frames, groups, listed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/ci/cairn")
    ap.add_argument("--data", default=".data/small")
    ap.add_argument("--json")
    args = ap.parse_args()
    images = sorted(glob.glob(os.path.join(args.data, "su-*.raw")))
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(args.data))) as work:
        repo = os.path.join(work, "repo")
        subprocess.run([args.bin, "--repo", repo, "-q", "init", "--reserve", "0"], check=True)
        for image in images:
            subprocess.run([args.bin, "--repo", repo, "-q", "commit", "su", image], check=True)
        total = frames = groups = listed = 0
        for path in glob.glob(os.path.join(repo, "packs", "*", "*")):
            t, f, g, n = pack_frames(path)
            total, frames, groups, listed = total + t, frames + f, groups + g, listed + n
        stored = sum(os.path.getsize(p) for p in glob.glob(os.path.join(repo, "**"), recursive=True)
                     if os.path.isfile(p))
    sealed = frames + 32 * (groups + listed)
    result = {
        "images": [os.path.basename(i) for i in images],
        "repository_bytes": stored,
        "pack_bytes": total,
        "groups": groups,
        "listed_frames": listed,
        "frame_bytes": frames,
        "frame_percent_of_repository": round(100 * frames / stored, 3),
        "sealed_frame_bytes": sealed,
        "sealed_frame_percent_of_repository": round(100 * sealed / stored, 3),
    }
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

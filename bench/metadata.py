#!/usr/bin/env python3
"""Where a local repository's bytes go: data, manifest trees, pack trailers, index, summaries.

    bench/metadata.py REPO_DIR [--json]

Reads the repository's files directly (a plain repository on a local directory; sealed packs
are counted whole, their trailers cannot be parsed without the key). Pack layouts are the ones
docs/FORMAT.md gives: a version 1 pack ends in a 48-byte footer `n | L | BLAKE3 | CRNPKEND`
after n 48-byte blob entries (kind byte 1 = manifest node); a version 2 pack ends in
`G | L | BLAKE3 | CRNPKEND` after a trailer of G 16-byte group entries (kind byte 1 = node)
and 37-byte slot entries. The issue 16 budget: metadata (trees, index, summaries, records)
at most 1.5% of the stored bytes; pack trailers are reported apart, as they are the
groups' descriptors, which a format needs wherever it keeps them.
"""
import json
import os
import struct
import sys
from pathlib import Path

FOOTER = 48


def pack_breakdown(path: Path) -> dict:
    """Bytes of one pack by role: data groups/blobs, node groups/blobs, trailer+footer, header."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(20)
        f.seek(size - FOOTER)
        foot = f.read(FOOTER)
        if head[:8] != b"CRNPACK\0" or foot[40:] != b"CRNPKEND":
            raise SystemExit(f"{path}: not a cairn pack")
        version = struct.unpack_from("<I", head, 8)[0]
        count, tlen = struct.unpack_from("<II", foot, 0)
        f.seek(size - FOOTER - tlen)
        trailer = f.read(tlen)
    out = {"version": version, "data": 0, "node": 0, "trailer": tlen + FOOTER, "sealed": 0}
    if version == 1:
        out["header"] = 16
        for i in range(count):
            kind = trailer[i * 48 + 32]
            stored = struct.unpack_from("<I", trailer, i * 48 + 40)[0]
            out["node" if kind == 1 else "data"] += stored
        return out
    out["header"] = 20
    flags = struct.unpack_from("<I", head, 16)[0]
    if flags & 1:  # sealed: the trailer is ciphertext
        out["sealed"] = size - 20 - tlen - FOOTER
        return out
    groups = struct.unpack_from("<I", trailer, 0)[0]
    for g in range(groups):
        _off, stored, _plain, kind = struct.unpack_from("<IIIB", trailer, 8 + g * 16)
        out["node" if kind == 1 else "data"] += stored
    return out


def tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file()) if root.exists() else 0


def measure(repo: Path) -> dict:
    packs = {"data": 0, "node": 0, "trailer": 0, "header": 0, "sealed": 0, "count": 0}
    for p in sorted((repo / "packs").rglob("*")):
        if p.is_file():
            b = pack_breakdown(p)
            packs["count"] += 1
            for k in ("data", "node", "trailer", "header", "sealed"):
                packs[k] += b[k]
    other = {k: tree_bytes(repo / k) for k in ("index", "index-runs", "summaries", "versions")}
    total = sum(p.stat().st_size for p in repo.rglob("*")
                if p.is_file() and p.name != ".cairn-reserve")
    meta = packs["node"] + sum(other.values())
    rest = total - sum(packs[k] for k in ("data", "node", "trailer", "header", "sealed")) \
        - sum(other.values())
    return {"total": total, "packs": packs, **other, "refs_and_other": rest,
            "metadata": meta, "metadata_share": meta / total if total else 0.0,
            "trailer_share": packs["trailer"] / total if total else 0.0}


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    m = measure(Path(sys.argv[1]))
    if "--json" in sys.argv[2:]:
        print(json.dumps(m))
        return
    mib = 1 << 20
    t = m["total"]
    rows = [("data (groups / chunks)", m["packs"]["data"]),
            ("manifest trees (node groups / blobs)", m["packs"]["node"]),
            ("pack trailers + footers", m["packs"]["trailer"]),
            ("pack headers", m["packs"]["header"]),
            ("sealed (encrypted, not split)", m["packs"]["sealed"]),
            ("index files (format 1)", m["index"]), ("index runs (format 2)", m["index-runs"]),
            ("reference summaries", m["summaries"]), ("version records", m["versions"]),
            ("refs, config, other", m["refs_and_other"])]
    for name, b in rows:
        if b:
            print(f"{name:<38} {b / mib:10.2f} MiB {100 * b / t:7.3f}%")
    print(f"{'total':<38} {t / mib:10.2f} MiB")
    print(f"metadata (trees+index+summaries+records) {100 * m['metadata_share']:.3f}%,"
          f" trailers {100 * m['trailer_share']:.3f}%")


if __name__ == "__main__":
    main()

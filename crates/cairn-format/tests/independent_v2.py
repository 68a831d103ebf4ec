#!/usr/bin/env python3
"""Builds format-v2 golden vectors independently of cairn's Rust code, from FORMAT.md alone,
so that the Rust tests (tests/golden.rs) check the code against the document and not against
itself. Needs Python's blake3 (pip install blake3).

    python3 crates/cairn-format/tests/independent_v2.py   # checks; --write rewrites

Covers v2_pack_plain, v2_leaf_runs and the pinned ids of v2_group_ids. (The sealed vectors
v2_sealed_*, v2_key_slot and v2_group_sealed_raw were computed with PyNaCl and argon2-cffi.)
"""
import os
import struct
import sys

import blake3

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")


def bid(b):
    return blake3.blake3(b).digest()


def pack_plain():
    """A plain v2 pack: a data group of two incompressible 1 KiB chunks and a node group, both
    raw, salt 0x01020304; every slot stored."""
    data = b"".join(bid(bytes([i])) for i in range(64))
    out = b"CRNPACK\0" + struct.pack("<III", 2, 0x01020304, 0)
    groups = []
    for kind, chunks in ((0, [data[:1024], data[1024:]]), (1, [b"a manifest node"])):
        offset, plain = len(out), b"".join(chunks)
        out += plain
        groups.append((offset, len(plain), len(plain), kind, 0, chunks))
    trailer = struct.pack("<II", len(groups), sum(len(g[5]) for g in groups))
    for offset, stored, plain, kind, encoding, chunks in groups:
        trailer += struct.pack("<IIIBBH", offset, stored, plain, kind, encoding, len(chunks))
    for g in groups:
        for c in g[5]:
            trailer += bid(c) + struct.pack("<I", len(c)) + b"\x01"
    return out + trailer + struct.pack("<II", len(groups), len(trailer)) + bid(trailer) + b"CRNPKEND"


def leaf_runs():
    g1, g2 = bid(b"g1"), bid(b"g2")
    extents = [(0, 8192, None), (2, 12288, (g1, 0, 3)), (2, 4096, (g2, 5, 1)),
               (2, 5000, (g1, 4, 2)), (0, 4096, None)]
    out = b"CL" + bytes([2, 0]) + struct.pack("<I", len(extents))
    for kind, length, run in extents:
        out += bytes([kind]) + struct.pack("<I", length)
        if run:
            out += run[0] + struct.pack("<HH", run[1], run[2])
    return out


def group_ids():
    context = "cairn 2026-11-25 v2 group id"
    listing = bid(b"a") + struct.pack("<I", 4096) + bid(b"b") + struct.pack("<I", 100)
    id_key = bytes(range(64))[32:]
    key = blake3.blake3(id_key, derive_key_context=context).digest()
    return {
        "plain": blake3.blake3(listing, derive_key_context=context).hexdigest(),
        "keyed": blake3.blake3(listing, key=key).hexdigest(),
    }


def as_hex(b):
    h = b.hex()
    return "\n".join(h[i:i + 64] for i in range(0, len(h), 64)) + "\n"


def main():
    ok = True
    for name, data in (("v2_pack_plain", pack_plain()), ("v2_leaf_runs", leaf_runs())):
        path = os.path.join(HERE, name + ".hex")
        if "--write" in sys.argv:
            open(path, "w").write(as_hex(data))
        elif bytes.fromhex(open(path).read()) != data:
            print(f"{name}: the checked-in vector differs from FORMAT.md's bytes")
            ok = False
    for kind, value in group_ids().items():
        print(f"{kind} group id (pinned in golden.rs v2_group_ids): {value}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

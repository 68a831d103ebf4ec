#!/usr/bin/env python3
"""Builds format-v2 golden vectors independently of cairn's Rust code, from FORMAT.md alone,
so that the Rust tests (tests/golden.rs) check the code against the document and not against
itself. Needs Python's blake3 (pip install blake3).

    python3 crates/cairn-format/tests/independent_v2.py   # checks; --write rewrites

Covers v2_pack_plain, v2_pack_3_plain, v2_leaf_runs, v2_leaf_digest, v2_interior_digests, v2_index_run (version 1),
v2_index_run_2, v2_index_run_3, v2_group_summary (version 1), v2_group_summary_counted (version 2),
v2_merged_summary (version 1), v2_merged_summary_chains (version 2), v2_summary_delta,
v2_record_bundle, vm_version, memory_state_header and the
pinned ids of v2_group_ids. (The sealed vectors
v2_sealed_*, v2_key_slot and v2_group_sealed_raw were computed with PyNaCl and argon2-cffi.)
"""
import os
import struct
import sys

import blake3

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")


def bid(b):
    return blake3.blake3(b).digest()


def frame(kind, encoding, stored, chunks):
    """A group's frame in a plain version 3 pack (every slot stored): uniform when all slots
    but the last have one length, else listed; each part followed by 8 bytes of its BLAKE3."""
    plain, lens = sum(map(len, chunks)), [len(c) for c in chunks]
    uniform = all(n == lens[0] for n in lens[:-1])
    listing = b"" if uniform else b"".join(struct.pack("<IB", n, 1) for n in lens)
    length, last = (lens[0], lens[-1]) if uniform else (0, 0)
    fixed = struct.pack("<BBIIHBIII", kind, encoding, stored, plain, len(chunks),
                        1 if uniform else 0, length, last, len(listing))
    out = fixed + bid(fixed)[:8]
    if listing:
        out += listing + bid(listing)[:8]
    return out


def pack_plain(version):
    """A plain v2 pack, salt 0x01020304: a data group of two incompressible 1 KiB chunks and
    a node group, both raw; version 3 adds a data group of chunks of 100, 200 and 50 bytes and
    puts every group behind its frame. Every slot stored."""
    data = b"".join(bid(bytes([i])) for i in range(64))
    out = b"CRNPACK\0" + struct.pack("<III", version, 0x01020304, 0)
    groups = []
    parts = [(0, [data[:1024], data[1024:]]), (1, [b"a manifest node"])]
    if version >= 3:
        parts.append((0, [data[:100], data[100:300], data[300:350]]))
    for kind, chunks in parts:
        plain = b"".join(chunks)
        if version >= 3:
            out += frame(kind, 0, len(plain), chunks)
        offset = len(out)
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


def leaf_digest():
    """A leaf of one group run with the segment digest (flags bit 0)."""
    g1 = bid(b"g1")
    out = b"CL" + bytes([2, 1]) + struct.pack("<I", 2) + bid(b"segment bytes")
    out += bytes([2]) + struct.pack("<I", 8192) + g1 + struct.pack("<HH", 0, 2)
    out += bytes([0]) + struct.pack("<I", 4096)
    return out


def interior_digests():
    """A level-1 interior node of format 2 carrying two of its three leaves' digests."""
    children = [(0, bid(b"leaf 0"), (bid(b"segment 0"), 256, 1048576)),
                (3, bid(b"leaf 3"), None),
                (255, bid(b"leaf 255"), (bid(b"segment 255"), 3, 5000))]
    out = b"CI" + bytes([2, 1]) + struct.pack("<H", len(children))
    for slot, child, digest in children:
        out += struct.pack("<H", slot) + child
        if digest is None:
            out += bytes([0])
        else:
            out += bytes([1]) + digest[0] + struct.pack("<II", digest[1], digest[2])
    return out


def index_run(version):
    """A plain index run: ids BLAKE3([i]) for i in 0..5, in "pack a" (even i) or "pack b"
    (odd i), id 0 in both; sections of 2 entries (cut later while keys are equal). Version 1's
    filter hashes the full ids (one insert per location), versions 2 and 3 the distinct keys.
    Version 3 puts 2 sections in a directory block and 1 pack id in a pack block."""
    pa, pb = bid(b"pack a"), bid(b"pack b")
    locations = [(bid(bytes([i])), pa if i % 2 == 0 else pb) for i in range(5)]
    locations.append((bid(bytes([0])), pb))
    packs = sorted({p for _, p in locations})
    key = lambda i: struct.unpack("<Q", i[:8])[0]
    entries = sorted({(key(i), packs.index(p)) for i, p in locations})
    out = b"CRNIRUN\0" + struct.pack("<II", version, 0)
    sections, at = [], 0
    while at < len(entries):
        n = min(2, len(entries) - at)
        while at + n < len(entries) and entries[at + n][0] == entries[at + n - 1][0]:
            n += 1
        body = b"".join(struct.pack("<QI", k, p) for k, p in entries[at:at + n])
        sections.append((entries[at][0], n, len(out), len(body), bid(body)))
        out += body
        at += n
    # Bloom filter: 10 bits per location (version 1) or entry (versions 2, 3) rounded up to a
    # power of two (at least 2^9), 7 probes at (h1 + i*h2) mod bits. Version 1: h1 = id[0:8],
    # h2 = id[8:16] | 1, little-endian; versions 2, 3: h1 = the key, h2 = (key *
    # 0x9E3779B97F4A7C15 mod 2^64) rotated left 32 bits, | 1.
    if version == 1:
        want = len(locations) * 10
        probes = [struct.unpack("<QQ", i[:16]) for i, _ in locations]
    else:
        want = len(entries) * 10
        m = (1 << 64) - 1

        def h2(k):
            x = (k * 0x9E3779B97F4A7C15) & m
            return ((x << 32) | (x >> 32)) & m

        probes = [(k, h2(k)) for k in sorted({k for k, _ in entries})]
    log2 = max(9, min(36, (want - 1).bit_length()))
    bits = bytearray(1 << (log2 - 3))
    for h1, h2 in probes:
        for probe in range(7):
            pos = (h1 + probe * (h2 | 1)) % (1 << log2)
            bits[pos // 8] |= 1 << (pos % 8)
    filt = bytes([log2, 7]) + bytes(bits)
    if version == 3:
        # Directory blocks (2 sections each), pack blocks (1 id each), the filter, then the
        # top level; no offsets, every place follows from the counts.
        top = struct.pack("<II", len(packs), 1)
        blocks = []
        for b in range(0, len(sections), 2):
            part = sections[b:b + 2]
            body = b"".join(struct.pack("<QI", f, n) + c for f, n, _, _, c in part)
            blocks.append((part[0][0], len(part), sum(n for _, n, _, _, _ in part), bid(body)))
            out += body
        for p in packs:
            top += bid(p)
            out += p
        top += struct.pack("<I", len(blocks))
        for first, count, n, checksum in blocks:
            top += struct.pack("<QIQ", first, count, n) + checksum
        top += struct.pack("<Q", len(filt)) + bid(filt)
        out += filt
        meta = top
    else:
        meta = struct.pack("<I", len(packs)) + b"".join(packs) + struct.pack("<I", len(sections))
        for first, n, offset, length, checksum in sections:
            meta += struct.pack("<QIII", first, n, offset, length) + checksum
        meta += filt
    return out + meta + struct.pack("<IQ", len(meta), len(entries)) + bid(meta) + b"CRNIREND"


def envelope(magic, version, payload):
    head = magic + struct.pack("<II", version, len(payload)) + payload
    return head + bid(head)


def group_summary(counted):
    """A reference summary. Version 1: two nodes, group g1 slots 0..3 and 64, g2 slots 5..7,
    3 stale slots. Version 2 (counted): one node; g1's leaves reference slots 0..3 twice,
    slot 1 a third time and slot 64 once; g2's slot 5 once."""
    key = lambda i: struct.unpack("<Q", i[:8])[0]
    g1, g2 = bid(b"g1"), bid(b"g2")
    if counted:
        nodes = [bid(b"n1")]
        slots = {key(g1): [0, 1, 2, 64], key(g2): [5]}
        repeats = {(key(g1), 0): 1, (key(g1), 1): 2, (key(g1), 2): 1}
    else:
        nodes = [bid(b"n1"), bid(b"n2")]
        slots = {key(g1): [0, 1, 2, 64], key(g2): [5, 6]}
    out = struct.pack("<Q", 0 if counted else 3)
    out += struct.pack("<I", len(nodes)) + b"".join(struct.pack("<Q", k) for k in sorted(map(key, nodes)))
    out += struct.pack("<I", len(slots))
    for k in sorted(slots):
        bits = bytearray(max(slots[k]) // 8 + 1)
        for s in slots[k]:
            bits[s // 8] |= 1 << (s % 8)
        out += struct.pack("<QH", k, len(bits)) + bytes(bits)
    if not counted:
        return envelope(b"CRNSUM2\0", 1, out)
    out += struct.pack("<I", len(repeats))
    for (k, s), n in sorted(repeats.items()):
        out += struct.pack("<QHI", k, s, n)
    return envelope(b"CRNSUM2\0", 2, out)


def slot_set(slots):
    bits = bytearray(max(slots) // 8 + 1)
    for s in slots:
        bits[s // 8] |= 1 << (s % 8)
    return struct.pack("<H", len(bits)) + bytes(bits)


def merged_summary(chains=False):
    """A merged summary of image "vm" counting two trees: r1 with the counted summary above,
    r2 with the version 1 one. n1 is used by both, n2 by r2; g1's slots 0..3 and 64 by both
    (common 2); g2's slot 5 by both and slot 6 by r2 (a tie: common 1, slot 5 an exception).
    With chains (version 2): each tree's chain length, and r1's summary is resolved through
    those of c0 and c4 (their keys: first 8 bytes)."""
    key = lambda i: struct.unpack("<Q", i[:8])[0]
    trees = sorted([(bid(b"r1"), bid(group_summary(True))), (bid(b"r2"), bid(group_summary(False)))])
    out = struct.pack("<H", 2) + b"vm" + struct.pack("<I", len(trees))
    for root, summary in trees:
        out += root + summary
        if chains:
            chain = [bid(b"c0"), bid(b"c4")] if root == bid(b"r1") else []
            out += struct.pack("<B", len(chain)) + b"".join(c[:8] for c in chain)
    nodes = sorted([(key(bid(b"n1")), 2), (key(bid(b"n2")), 1)])
    out += struct.pack("<I", len(nodes)) + b"".join(struct.pack("<QI", k, n) for k, n in nodes)
    g1, g2 = key(bid(b"g1")), key(bid(b"g2"))
    groups = {g1: ([0, 1, 2, 64], 2, []), g2: ([5, 6], 1, [(5, 2)])}
    out += struct.pack("<I", len(groups))
    for k in sorted(groups):
        slots, common, exceptions = groups[k]
        bits = bytearray(max(slots) // 8 + 1)
        for s_ in slots:
            bits[s_ // 8] |= 1 << (s_ % 8)
        out += struct.pack("<QH", k, len(bits)) + bytes(bits) + struct.pack("<IH", common, len(exceptions))
        out += b"".join(struct.pack("<HI", slot, n) for slot, n in exceptions)
    return envelope(b"CRNMSUM\0", 2 if chains else 1, out)


def summary_delta():
    """A summary delta at position 6 (chain: c0, c4) from the counted summary above to a tree
    that adds node n3, keeps g1's slots 0, 1 and 64 with slot 0 referenced twice, drops g2 and
    uses g3's slot 7."""
    key = lambda i: struct.unpack("<Q", i[:8])[0]
    out = struct.pack("<I", 6) + bid(b"c0") + bid(b"c4")
    out += struct.pack("<I", 0) + struct.pack("<IQ", 1, key(bid(b"n3")))
    changes = {key(bid(b"g1")): ([0, 1, 64], [(0, 1)]), key(bid(b"g2")): None,
               key(bid(b"g3")): ([7], [])}
    out += struct.pack("<I", len(changes))
    for k in sorted(changes):
        if changes[k] is None:
            out += struct.pack("<QB", k, 0)
            continue
        slots, repeats = changes[k]
        out += struct.pack("<QB", k, 1) + slot_set(slots) + struct.pack("<H", len(repeats))
        out += b"".join(struct.pack("<HI", s, n) for s, n in repeats)
    return envelope(b"CRNSUMD\0", 1, out)


def record_bundle():
    """A version record bundle of two records (any bytes: the bundle does not read them), in
    ascending order of their ids."""
    records = sorted([b"a version record", b"another version record"], key=bid)
    out = struct.pack("<I", len(records))
    out += b"".join(struct.pack("<I", len(r)) + r for r in records)
    return envelope(b"CRNRECS\0", 1, out)


def group_ids():
    context = "cairn 2026-11-25 v2 group id"
    listing = bid(b"a") + struct.pack("<I", 4096) + bid(b"b") + struct.pack("<I", 100)
    id_key = bytes(range(64))[32:]
    key = blake3.blake3(id_key, derive_key_context=context).digest()
    return {
        "plain": blake3.blake3(listing, derive_key_context=context).hexdigest(),
        "keyed": blake3.blake3(listing, key=key).hexdigest(),
    }


def vm_version():
    """web01@2: disk0@5 (node drive0, checkpoint cairn-cp-1) and data@1 (node #block123, no
    checkpoint), a QEMU command line, no memory, frozen 12 ms, message "nightly"."""
    s16 = lambda t: struct.pack("<H", len(t.encode())) + t.encode()
    s32 = lambda t: struct.pack("<I", len(t.encode())) + t.encode()
    out = s16("web01") + struct.pack("<Q", 2) + bid(b"p") + struct.pack("<q", 1764000000000000000)
    out += struct.pack("<B", 2) + s32("qemu-system-x86_64\n-machine\nq35") + struct.pack("<H", 2)
    for name, vid, seq, node, cp in (("disk0", b"d0", 5, "drive0", "cairn-cp-1"),
                                     ("data", b"d1", 1, "#block123", "")):
        out += s16(name) + bid(vid) + struct.pack("<Q", seq) + s16(node) + s16(cp)
    out += bytes(32) + struct.pack("<BQ", 1, 12000000) + s32("nightly")
    return envelope(b"CRNVMV\0\0", 1, out)


def memory_state_header():
    """Page size 4096, footers, prefix QEVM v3 + configuration "pc-q35-7.2", RAM section
    2/0/4, pc.ram 128 MiB at 2 MiB, pc.bios 256 KiB at 130 MiB, tail 12345 bytes at 132 MiB."""
    prefix = b"QEVM\0\0\0\x03\x07" + struct.pack(">I", 10) + b"pc-q35-7.2"
    out = struct.pack("<IBI", 4096, 1, len(prefix)) + prefix + struct.pack("<IIIH", 2, 0, 4, 2)
    for name, length, offset in ((b"pc.ram", 128 << 20, 2 << 20),
                                 (b"pc.bios", 256 << 10, 130 << 20)):
        out += struct.pack("<B", len(name)) + name + struct.pack("<QQ", length, offset)
    out += struct.pack("<QQ", 132 << 20, 12345)
    return envelope(b"CRNMEM\0\0", 1, out)


def as_hex(b):
    h = b.hex()
    return "\n".join(h[i:i + 64] for i in range(0, len(h), 64)) + "\n"


def main():
    ok = True
    vectors = (("v2_pack_plain", pack_plain(2)), ("v2_pack_3_plain", pack_plain(3)),
               ("v2_leaf_runs", leaf_runs()),
               ("v2_leaf_digest", leaf_digest()), ("v2_index_run", index_run(1)),
               ("v2_index_run_2", index_run(2)),
               ("v2_index_run_3", index_run(3)), ("v2_interior_digests", interior_digests()),
               ("v2_group_summary", group_summary(False)),
               ("v2_group_summary_counted", group_summary(True)),
               ("v2_merged_summary", merged_summary()),
               ("v2_merged_summary_chains", merged_summary(chains=True)),
               ("v2_summary_delta", summary_delta()),
               ("v2_record_bundle", record_bundle()),
               ("vm_version", vm_version()),
               ("memory_state_header", memory_state_header()))
    for name, data in vectors:
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

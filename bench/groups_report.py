#!/usr/bin/env python3
"""Markdown tables of a `bench/groups.sh` run: bench/groups_report.py RESULTS.jsonl

Writes RESULTS.md beside the input (and prints it). Each input line is one object printed by
`cairn-groups` plus a "scenario" field ("series", "golden", "levels", "estimate"). Stored
bytes are compared with the v1 layout (16 KiB chunks, each compressed alone) of the same
scenario in the same run.
"""
import collections
import json
import os
import sys

MIB = 1 << 20


def name(path):
    return os.path.basename(path).removesuffix(".raw")


def size(n):
    return f"{n // 1024} KiB" if n else "alone"


def grouped(rows):
    """(chunk, group, level, skip_test) → {"steps": {file: stored}, "sum": Counter}."""
    out = collections.OrderedDict()
    for r in rows:
        key = (r["chunk"], r["group"], r["level"], r["skip_test"])
        a = out.setdefault(key, {"steps": {}, "sum": collections.Counter()})
        a["steps"][name(r["file"])] = r["stored_bytes"]
        for f in ("stored_bytes", "new_bytes", "new_chunks", "leaf_extents",
                  "merged_extents", "groups", "raw_groups", "skipped_groups",
                  "new_leaves", "new_leaf_refs", "new_leaf_runs"):
            a["sum"][f] += r[f]
        a["sum"]["cpu_ms"] += round(r["compress_cpu_s"] * 1000)
    return out


def v1_total(by_config):
    return by_config[(16384, 0, 3, False)]["sum"]["stored_bytes"]


def sizes_table(rows, title):
    by = grouped(rows)
    files = list(dict.fromkeys(name(r["file"]) for r in rows))
    base = v1_total(by)
    lines = [f"#### {title}", "",
             "| chunk | group | " + " | ".join(files)
             + " | total MiB | ÷ v1 | index entries | leaf extents | merged extents |",
             "|---|---|" + "---:|" * (len(files) + 5)]
    for (c, g, _, _), a in by.items():
        s = a["sum"]
        cells = " | ".join(f"{a['steps'][f] / MIB:.1f}" for f in files)
        lines.append(
            f"| {size(c)} | {size(g)} | {cells} | {s['stored_bytes'] / MIB:.1f} | "
            f"{s['stored_bytes'] / base:.3f} | {s['new_chunks']:,} | {s['leaf_extents']:,} | "
            f"{s['merged_extents']:,} |")
    return lines


def levels_table(rows, v1_rows):
    base_by = grouped(v1_rows)
    base = v1_total(base_by)
    b = base_by[(16384, 0, 3, False)]["sum"]
    lines = ["#### zstd level, and the cheap estimate (su-0 … su-5, 4 KiB chunks)", "",
             "| chunk | group | level | estimate | stored MiB | ÷ v1 | raw groups | skipped "
             "| zstd CPU s | MiB/s per core |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
             f"| 16 KiB | alone (v1) | 3 | no | {b['stored_bytes'] / MIB:.1f} | 1.000 | "
             f"{b['raw_groups']:,} of {b['groups']:,} | 0 | {b['cpu_ms'] / 1000:.2f} | "
             f"{b['new_bytes'] / MIB / (b['cpu_ms'] / 1000):.0f} |"]
    for (c, g, level, skip), a in grouped(rows).items():
        s = a["sum"]
        secs = s["cpu_ms"] / 1000
        lines.append(
            f"| {size(c)} | {size(g)} | {level} | {'yes' if skip else 'no'} | "
            f"{s['stored_bytes'] / MIB:.1f} | {s['stored_bytes'] / base:.3f} | "
            f"{s['raw_groups']:,} of {s['groups']:,} | {s['skipped_groups']:,} | {secs:.2f} | "
            f"{s['new_bytes'] / MIB / secs:.0f} |")
    return lines


def metadata_table(rows):
    """Leaf and index bytes as a share of stored bytes, from the counts (estimates: v1's
    leaf encoding of 8 bytes per leaf and 37 per chunk reference; a merged run as 41 bytes —
    first id, count, length; index entries of 48 bytes (v1) or 22 (a 16-byte key)."""
    lines = ["#### Metadata the series stores (estimates from the counts)", "",
             "Leaves: 8 bytes each plus 37 per chunk reference (v1's encoding), or 41 per run "
             "of consecutive chunks of one group; index: 48 bytes per chunk (v1) or 22 (a "
             "16-byte key). Zero runs and interior nodes are not counted.", "",
             "| chunk | group | stored MiB | new leaves | references | runs | leaves, an id "
             "per chunk | leaves, a run per extent | index 48 B | index 22 B |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for (c, g, _, _), a in grouped(rows).items():
        s = a["sum"]
        stored = s["stored_bytes"]
        per_ref = s["new_leaves"] * 8 + s["new_leaf_refs"] * 37
        per_run = s["new_leaves"] * 8 + s["new_leaf_runs"] * 41
        pct = lambda n: f"{n / stored * 100:.2f}%"
        lines.append(
            f"| {size(c)} | {size(g)} | {stored / MIB:.1f} | {s['new_leaves']:,} | "
            f"{s['new_leaf_refs']:,} | {s['new_leaf_runs']:,} | {pct(per_ref)} | "
            f"{pct(per_run)} | {pct(s['new_chunks'] * 48)} | {pct(s['new_chunks'] * 22)} |")
    return lines


def boot_table(rows):
    base = next(r for r in rows if r["chunk"] == 16384 and r["group"] == 0)
    read = base["guest_read_bytes"]
    lines = ["#### A cold lazy boot of su-1: what whole groups cost (no read-ahead)", "",
             f"The guest read {read / MIB:.1f} MiB; fetched counts stored (compressed) bytes of every group holding a chunk it read, "
             "once.", "",
             "| chunk | group | su-1 stored MiB | groups fetched | fetched MiB | fetched ÷ read "
             "| ÷ v1's fetch |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {size(r['chunk'])} | {size(r['group'])} | {r['stored_bytes'] / MIB:.1f} | "
            f"{r['groups_fetched']:,} | {r['fetched_bytes'] / MIB:.1f} | "
            f"{r['fetched_bytes'] / read:.2f} | {r['fetched_bytes'] / base['fetched_bytes']:.2f} |")
    return lines


def main():
    path = sys.argv[1]
    rows = [json.loads(line) for line in open(path)]
    by_scenario = collections.defaultdict(list)
    for r in rows:
        by_scenario[r["scenario"]].append(r)
    lines = sizes_table(by_scenario["series"], "Stored MiB per step, su-0 … su-5 in one repository (zstd 3)")
    lines += [""] + sizes_table(by_scenario["golden"],
                                "Stored MiB: su-1, its clones pa-a…pa-c, then su-1-rebuilt (zstd 3)")
    lines += [""] + metadata_table(by_scenario["series"])
    lines += [""] + levels_table(by_scenario["levels"] + by_scenario["estimate"],
                                 [r for r in by_scenario["series"] if r["chunk"] == 16384])
    if by_scenario["boot"]:
        lines += [""] + boot_table(by_scenario["boot"])
    text = "\n".join(lines) + "\n"
    with open(path.removesuffix(".jsonl") + ".md", "w") as out:
        out.write(text)
    print(text, end="")


if __name__ == "__main__":
    main()

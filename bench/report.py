#!/usr/bin/env python3
"""BENCHMARKS.md from the results under bench/results/: the current figures, one page.

    python3 bench/report.py [--out PATH]      (default: BENCHMARKS.md at the repository root)

Each topic of the page is a file under bench/results/current/ (TOPICS below gives their order).
A topic holds tables; a table names the command that produced it, its date and its result
files, and gets its rows either from raw results (a renderer below reads them: compare-*.json,
ab-scaling-*.json, gc-*/…jsonl, dedup-tiers-*.json, trace-*/…json, format2-*.jsonl,
lost-objects-*.json, pack-frames-*.json, vm-backup-*.json, vm-memory-*.json, or a table of a
script's Markdown report) or, where no raw results were kept, from rows transcribed into the topic
file. The output depends on those files only (no clock, no environment), so a second run writes the same
bytes; scripts/test.sh checks that the committed BENCHMARKS.md is what this makes. Standard
library only.

Checks while rendering (an error stops it): every result file and plot a topic names exists,
every `bench/…` or `scripts/…` path in a command exists, every link of the first table names a
topic heading.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import textwrap
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
CURRENT = BENCH / "results" / "current"
sys.path.insert(0, str(BENCH))
import compare_report  # noqa: E402

MIB = 1 << 20
WIDTH = 120

# (heading, file under bench/results/current/), in the page's order.
TOPICS = [
    ("What holds today", "targets.json"),
    ("Stored bytes, commit and restore against peers", "peers.json"),
    ("Scaling with image size and history", "scaling.json"),
    ("Dedup tiers", "dedup.json"),
    ("Version history and GC", "gc.json"),
    ("Lazy deployment over NBD", "nbd.json"),
    ("Repositories on S3", "s3.json"),
    ("Real VM disk sources", "sources.json"),
    ("Backing up a running VM", "vm-backup.json"),
    ("Getting a VM back", "restore.json"),
    ("Format 2 against format 1", "format2.json"),
    ("Encryption", "encryption.json"),
    ("Lost or damaged objects", "lost-objects.json"),
    ("Studies behind the design", "studies.json"),
]

NOT_IN_REPO = "command not in the repository; to be re-measured"


class ReportError(Exception):
    pass


def rel(path: str) -> Path:
    p = ROOT / path
    if not p.exists():
        raise ReportError(f"{path}: no such file in the repository")
    return p


def load_json(path: str):
    return json.loads(rel(path).read_text())


def load_jsonl(path: str) -> list[dict]:
    return [json.loads(line) for line in rel(path).read_text().splitlines() if line.strip()]


def anchor(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = re.sub(r"[^\w\- ]", "", heading.lower())
    return "#" + s.replace(" ", "-")


def check_command(command: str) -> None:
    for path in re.findall(r"(?<![\w/.])((?:bench|scripts)/[\w./-]+\.(?:py|sh))", command):
        rel(path)


def wrap(text: str) -> list[str]:
    if text.startswith("- "):
        return textwrap.wrap(text, WIDTH, initial_indent="", subsequent_indent="  ",
                             break_long_words=False, break_on_hyphens=False)
    return textwrap.wrap(text, WIDTH, break_long_words=False, break_on_hyphens=False)


def md_table(header: list[str], rows: list[list], left: bool = False) -> list[str]:
    """A Markdown table; numbers right-aligned after the first column unless `left`."""
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" if i == 0 or left else "---:" for i in range(len(header))) + "|"]
    for r in rows:
        if len(r) != len(header):
            raise ReportError(f"row {r} has {len(r)} cells for {len(header)} columns {header}")
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return out


def parse_md_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every Markdown table in text: (header, rows)."""
    tables, cur = [], None
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if cur is None:
                cur = (cells, [])
            elif not all(re.fullmatch(r":?-+:?", c) for c in cells):
                cur[1].append(cells)
        elif cur is not None:
            tables.append(cur)
            cur = None
    return tables


def select(header, rows, columns):
    """The named columns of a table, in the given order."""
    if not columns:
        return header, rows
    idx = []
    for c in columns:
        if c not in header:
            raise ReportError(f"no column {c!r} in {header}")
        idx.append(header.index(c))
    return [header[i] for i in idx], [[r[i] for i in idx] for r in rows]


def secs(x: float) -> str:
    """Seconds as the page writes them: three decimals below 0.1 s, else two."""
    return f"{x:.3f}" if x < 0.1 else f"{x:.2f}"


# ---------------------------------------------------------------------------------------------
# Renderers of raw results: each takes the table's "from" object and returns (header, rows).


def r_compare(spec):
    """bench/compare.py's measurements through bench/compare_report.py's own tables."""
    D = compare_report.Data(load_json(spec["file"]))
    part = spec["part"]
    if part == "added":
        text = compare_report.per_step_table(D, "added", MIB, 1)
    elif part == "wall":
        text = compare_report.per_step_table(D, "wall", 1, 2, compare_report.TARGET_COMMIT)
    elif part == "restore":
        text = next(s for s in compare_report.restore_section(D) if s.startswith("|"))
        if spec.get("figures"):  # some of the figures of each version
            header, rows = parse_md_tables(text)[0]
            out, version, shown = [], "", None
            for r in rows:
                version = r[0] or version
                if r[1] in spec["figures"]:
                    out.append(["" if version == shown else version] + r[1:])
                    shown = version
            return header, out
    elif part == "fleet":
        text = next(s for s in compare_report.fleet_section(D) if s.startswith("|"))
    elif part in ("scaling-size", "scaling-versions"):
        tables = [s for s in compare_report.scaling_section(D) if s.startswith("|")]
        text = tables[0 if part == "scaling-size" else 1]
    elif part == "commit":
        # Wall time per step, then the series' CPU (user + sys) and its largest peak RSS: the
        # last rows of the report's CPU and RSS tables.
        header, rows = parse_md_tables(
            compare_report.per_step_table(D, "wall", 1, 2, compare_report.TARGET_COMMIT))[0]
        for key, scale, digits, agg, name in (("cpu", 1, 2, sum, "CPU s, series"),
                                              ("rss_kib", 1024, 0, max, "peak RSS MiB, largest")):
            last = parse_md_tables(compare_report.per_step_table(D, key, scale, digits,
                                                                 agg=agg))[0][1][-1]
            rows.append([name] + [c.replace("**", "") for c in last[1:]])
        return header, rows
    else:
        raise ReportError(f"unknown compare part {part}")
    header, rows = parse_md_tables(text)[0]
    return select(header, rows, spec.get("columns"))


def r_md_table(spec):
    """A table of a script's Markdown report, optionally some columns and a prefix cell."""
    header, rows = parse_md_tables(rel(spec["file"]).read_text())[spec.get("index", 0)]
    header, rows = select(header, rows, spec.get("columns"))
    prefix = spec.get("prefix", [])
    return [c for c, _ in prefix] + header, [[v for _, v in prefix] + r for r in rows]


def r_ab_size(spec):
    """bench/ab_scaling.py's image-size axis, one build."""
    d = load_json(spec["file"])
    header = ["image", "data", "first commit s", "its peak RSS MiB", "re-commit s",
              "its peak RSS MiB", "chunks found in the parent's leaves", "export start ms",
              "its peak RSS MiB"]
    rows = []
    for r in d["size"]:
        if r["build"] != spec["build"]:
            continue
        rows.append([f"{r['gib']} GiB", f"{r['data'] // MIB:,} MiB", secs(r["first_s"]),
                     r["first_rss"], secs(r["second_s"]), r["second_rss"],
                     f"{r['parent_chunks']:,}", f"{r['export_s'] * 1000:.1f}", r["export_rss"]])
    return header, rows


def r_ab_history(spec):
    """bench/ab_scaling.py's history axis, one build."""
    d = load_json(spec["file"])
    header = ["versions", "commit s (median of the last five)", "its peak RSS MiB",
              "export start ms", "its peak RSS MiB", "index runs"]
    rows = [[f"{r['versions']:,}", secs(r["commit_s"]), r["commit_rss"],
             f"{r['export_s'] * 1000:.1f}", r["export_rss"], r["index_runs"]]
            for r in d["history"] if r["build"] == spec["build"]]
    return header, rows


def r_gc_rounds(spec):
    """bench/gc_after_rm.py's rounds of one build: medians over the rounds."""
    rows_in = [r for r in load_jsonl(spec["file"]) if r["build"] == spec["build"]]
    header = ["versions", "rounds", "process wall ms, median (min)", "`gc`'s own duration ms, median",
              "peak RSS MiB"]
    rows, med = [], {}
    for v in sorted({r["versions"] for r in rows_in}):
        rs = [r for r in rows_in if r["versions"] == v]
        wall = statistics.median(r["gc_s"] for r in rs) * 1000
        dur = statistics.median(r["gc_duration_s"] for r in rs) * 1000
        med[v] = (wall, dur)
        lo, hi = min(r["gc_rss"] for r in rs), max(r["gc_rss"] for r in rs)
        rows.append([f"{v:,}", len(rs), f"{wall:.1f} ({min(r['gc_s'] for r in rs) * 1000:.0f})",
                     f"{dur:.1f}", f"{lo}–{hi}" if lo != hi else lo])
    first, last = min(med), max(med)
    rows.append([f"{last:,} ÷ {first:,}", "", f"**{med[last][0] / med[first][0]:.2f}×**",
                 f"**{med[last][1] / med[first][1]:.2f}×**", ""])
    return header, rows


def r_dedup_scenarios(spec):
    """bench/dedup_tiers.py: each scenario's bytes in exact and bounded mode."""
    rows_in = load_json(spec["file"])["rows"]
    header = ["scenario", "exact MiB", "bounded MiB", "bounded ÷ exact", "worst step",
              "chunks only exact's index lookup found", "commit s, exact / bounded",
              "peak RSS MiB, exact / bounded"]
    rows = []
    for sc in dict.fromkeys(r["scenario"] for r in rows_in):
        ex = {r["step"]: r for r in rows_in if r["scenario"] == sc and r["mode"] == "exact"}
        bo = {r["step"]: r for r in rows_in if r["scenario"] == sc and r["mode"] == "bounded"}
        te, tb = sum(r["added"] for r in ex.values()), sum(r["added"] for r in bo.values())
        worst = max(ex, key=lambda s: bo[s]["added"] / ex[s]["added"])
        rows.append([f"{sc} ({len(ex)} commits)", f"{te / MIB:.1f}", f"{tb / MIB:.1f}",
                     f"**{tb / te:.3f}**",
                     f"{bo[worst]['added'] / ex[worst]['added']:.3f} ({worst})",
                     f"{sum(r['index_chunks'] for r in ex.values()):,}",
                     f"{sum(r['seconds'] for r in ex.values()):.2f} / "
                     f"{sum(r['seconds'] for r in bo.values()):.2f}",
                     f"{max(r['rss_mib'] for r in ex.values())} / "
                     f"{max(r['rss_mib'] for r in bo.values())}"])
    return header, rows


def r_dedup_steps(spec):
    """bench/dedup_tiers.py: per step, bytes of both modes and what bounded mode's tiers found."""
    rows_in = load_json(spec["file"])["rows"]
    header = ["scenario", "step", "exact MiB", "bounded MiB",
              "bounded: chunks in the parent's leaf / in similar packs", "trailers read"]
    rows = []
    for sc in dict.fromkeys(r["scenario"] for r in rows_in):
        ex = {r["step"]: r for r in rows_in if r["scenario"] == sc and r["mode"] == "exact"}
        bo = {r["step"]: r for r in rows_in if r["scenario"] == sc and r["mode"] == "bounded"}
        for s in ex:
            if s in spec.get("skip_steps", []):
                continue
            b = bo[s]
            rows.append([sc, s, f"{ex[s]['added'] / MIB:.1f}", f"{b['added'] / MIB:.1f}",
                         f"{b['parent_chunks']:,} / {b['similar_chunks']:,}", b["trailers"]])
    return header, rows


def r_trace(spec):
    """cairn-trace runs: one row per filter budget it costed."""
    header = ["measured", "VMs", "mode", "stored ÷ exact", "index budget MiB",
              "peak commit MiB (claims / filters / trailers / pieces)", "raw:RAM (host)",
              "index MB read per GiB"]
    rows = []
    for f in spec["files"]:
        d = load_json(f)
        for run in d["runs"]:
            entries = [(d["index_memory_mib"], run["peak_memory"], run["peak_memory_bytes"],
                        run["raw_to_ram_host"], run["per_gib_through_tiers"]["index_bytes_read"])]
            entries += [(o["index_memory_mib"], o["peak_memory"], o["peak_memory_bytes"],
                         o["raw_to_ram_host"], o["index_bytes_read_per_gib"])
                        for o in run.get("other_index_memory", [])]
            for budget, pm, peak, ratio, read in entries:
                if "budgets" in spec and budget not in spec["budgets"]:
                    continue
                rows.append([spec["date"], f"{d['fleet']['vms']:,}", run["mode"],
                             f"{run['stored_over_exact']:.5f}",
                             f"{budget}" + (f" ({spec.get('default_label', 'default')})"
                                            if budget == spec.get("default") else ""),
                             f"{peak / MIB:.1f} ({pm['claims'] / MIB:.1f} / "
                             f"{pm['filters'] / MIB:.0f} / {pm['trailers'] / MIB:.0f} / "
                             f"{pm['sections'] / MIB:.0f})",
                             f"{ratio / 1000:.0f}K:1", f"{read / 1e6:.0f}"])
    return header, rows


def r_format2_series(spec):
    """bench/format2.sh: stored bytes and commit time per step of both formats."""
    rows_in = load_jsonl(spec["file"])
    get = {(r["format"], r["scenario"], r["step"]): r for r in rows_in}
    header = ["step", "f1 stored MiB", "f2 stored MiB", "f1 commit s", "f2 commit s"]
    steps = [r["step"] for r in rows_in if r["format"] == 2 and r["scenario"] == "series"
             and r["op"] == "commit"]
    rows, tot = [], {1: [0, 0.0], 2: [0, 0.0]}
    for s in steps:
        a, b = get[(1, "series", s)], get[(2, "series", s)]
        for f, r in ((1, a), (2, b)):
            tot[f][0] += r["stored"]
            tot[f][1] += r["seconds"]
        rows.append([s, f"{a['stored'] / MIB:.1f}", f"{b['stored'] / MIB:.1f}",
                     f"{a['seconds']:.2f}", f"{b['seconds']:.2f}"])
    rows.append(["**series**", f"**{tot[1][0] / MIB:.1f}**",
                 f"**{tot[2][0] / MIB:.1f} ({tot[2][0] / tot[1][0]:.3f}×)**",
                 f"{tot[1][1]:.2f}", f"{tot[2][1]:.2f}"])
    a, b = get[(1, "rebuilt", "su-1-rebuilt")], get[(2, "rebuilt", "su-1-rebuilt")]
    rows.append(["su-1-rebuilt after su-1 (adds)", f"{a['stored'] / MIB:.1f}",
                 f"**{b['stored'] / MIB:.1f}**", f"{a['seconds']:.2f}", f"{b['seconds']:.2f}"])
    return header, rows


def r_format2_metadata(spec):
    """bench/metadata.py's breakdown as bench/format2.sh records it."""
    m = {r["format"]: r for r in load_jsonl(spec["file"]) if r["op"] == "metadata"}

    def share(f, n):
        return f"{n / m[f]['total'] * 100:.3f}%"

    header = ["share of stored bytes", f"format 1 ({m[1]['total'] / MIB:.1f} MiB)",
              f"format 2 ({m[2]['total'] / MIB:.1f} MiB)"]
    rows = [["manifest trees (leaves and interior nodes)"] +
            [share(f, m[f]["packs"]["node"]) for f in (1, 2)],
            ["index (format 1's files of 48-byte entries; format 2's runs)"] +
            [share(f, m[f]["index"] + m[f]["index-runs"]) for f in (1, 2)],
            ["reference summaries"] + [share(f, m[f]["summaries"]) for f in (1, 2)],
            ["version records"] + [share(f, m[f]["versions"]) for f in (1, 2)],
            ["**issue 16's metadata (≤ 1.5%)**"] +
            [f"**{m[f]['metadata_share'] * 100:.2f}%**" for f in (1, 2)],
            ["pack trailers (every chunk's id and length)"] +
            [f"{m[f]['trailer_share'] * 100:.3f}%" for f in (1, 2)]]
    return header, rows


def r_lost_objects(spec):
    """bench/lost_objects.py's rows of one build."""
    n = None
    header = ["damage", "restore after damage", "verify exit", "`restore IMAGE`",
              "after gc + gc --repair", "after repair", "re-commit restores"]
    rows = []
    for r in load_json(spec["file"]):
        if r["label"] != spec["label"]:
            continue
        n = r["versions"]
        newest = ("wrong version, exit 0" if r["restore_image_wrong_version"]
                  else f"exit {r['restore_image_exit']}")
        rows.append([r["damage"], f"{r['restore_after_damage']}/{n}", r["verify_exit"], newest,
                     f"{r['restore_after_gc']}/{n}", f"{r['restore_after_repair']}/{n}",
                     "yes" if r["recommit_restores"] else "NO"])
    return header, rows


def r_pack_frames(spec):
    d = load_json(spec["file"])
    header = ["images", "repository bytes", "groups", "frame bytes", "share", "sealed frame bytes",
              "sealed share"]
    rows = [[", ".join(i.removesuffix(".raw") for i in d["images"]),
             f"{d['repository_bytes']:,}", f"{d['groups']:,}", f"{d['frame_bytes']:,}",
             f"**{d['frame_percent_of_repository']:.2f}%**", f"{d['sealed_frame_bytes']:,}",
             f"**{d['sealed_frame_percent_of_repository']:.2f}%**"]]
    return header, rows


def r_summary_delta(spec):
    header = ["dense image", "summary of the first commit (whole)",
              "summary of each later commit: median (max)",
              "metadata of each later commit: median (max)", "later commits"]
    rows = []
    for f in spec["files"]:
        d = load_json(f)
        first, later = d["rows"][0], d["rows"][1:]

        def med_max(key):
            xs = [r[key] for r in later]
            return f"{statistics.median(xs):,.0f} ({max(xs):,})"

        rows.append([f"{first['size_gib']} GiB", f"{first['summary_bytes']:,}",
                     med_max("summary_bytes"), med_max("metadata_bytes"), str(len(later))])
    return header, rows


def vm_backup_rows(d):
    """bench/vm_backup.py's runs: medians of the first and the incremental backup, of cairn
    and of restic (its second backup; in parentheses, with every page of its files cached)."""
    runs = d["runs"]

    def med(f):
        return statistics.median(f(r) for r in runs)

    def mib(f):
        return f"{med(f) / MIB:.1f}"

    header = ["backup", "cairn s", "restic s (every page cached)", "cairn ÷ restic (÷ cached)",
              "guest wrote MiB", "read MiB: cairn / restic", "dirty MiB",
              "stored MiB: cairn / restic (its data_added)", "guest paused ms"]
    rows = []
    for label, ours, theirs in (("first (full)", "first", "first"),
                                ("incremental", "incremental", "second")):
        cached = theirs + "_cached"

        def ratio(key):
            return med(lambda r: r["cairn"][ours]["wall_s"] / r["restic"][key]["wall_s"])

        rows.append([
            label,
            secs(med(lambda r: r["cairn"][ours]["wall_s"])),
            f"{secs(med(lambda r: r['restic'][theirs]['wall_s']))} "
            f"({secs(med(lambda r: r['restic'][cached]['wall_s']))})",
            f"**{ratio(theirs):.2f}×** ({ratio(cached):.2f}×)",
            "–" if ours == "first" else mib(lambda r: sum(r["cairn"]["guest_wrote"].values())),
            f"{mib(lambda r: r['cairn'][ours]['read_bytes'])} / "
            f"{mib(lambda r: r['restic'][theirs]['total_bytes_processed'])}",
            "–" if ours == "first" else mib(lambda r: r["cairn"][ours]["dirty_bytes"]),
            f"{mib(lambda r: r['cairn'][ours]['stored_bytes'])} / "
            f"{mib(lambda r: r['restic'][theirs]['stored_bytes'])} "
            f"({mib(lambda r: r['restic'][theirs]['data_added'])})",
            f"{med(lambda r: r['cairn'][ours]['paused_s']) * 1000:.1f}"])
    return header, rows


def r_vm_backup(spec):
    return vm_backup_rows(load_json(spec["file"]))


def r_vm_memory(spec):
    """bench/vm_memory.py's rounds: a memory state's bytes stored by cairn against the raw
    migration stream, zstd of it and a qcow2 `savevm`, and the guest's pause."""
    d = load_json(spec["file"])
    header = ["state", "RAM MiB", "pages with data MiB", "stream MiB", "zstd -3 / -12 MiB",
              "savevm MiB", "cairn stored MiB", "cairn ÷ stream / zstd -12 / savevm",
              "guest paused: savevm s / cairn ms"]
    rows = []
    for r in d["rounds"]:
        rows.append([
            str(r["round"]), f"{r['ram_bytes'] / MIB:.0f}", f"{r['data_bytes'] / MIB:.0f}",
            f"{r['stream_bytes'] / MIB:.0f}",
            f"{r['zstd3_bytes'] / MIB:.0f} / {r['zstd12_bytes'] / MIB:.0f}",
            f"{r['savevm_grew_bytes'] / MIB:.0f}", f"{r['cairn_stored_bytes'] / MIB:.1f}",
            f"**{r['cairn_stored_bytes'] / r['stream_bytes']:.3f}** / "
            f"{r['cairn_stored_bytes'] / r['zstd12_bytes']:.3f} / "
            f"{r['cairn_stored_bytes'] / r['savevm_grew_bytes']:.3f}",
            f"{r['savevm_s']:.2f} / {r['cairn_paused_s'] * 1000:.0f}"])
    return header, rows


def r_concurrent(spec):
    """bench/concurrent.py's runs: a fleet committed at once against one by one, and the
    everyday `cairn gc` after it."""
    d = load_json(spec["file"])
    header = ["store", "images", "one by one MiB", "at once MiB (÷ one by one)",
              "after `gc` MiB (÷ one by one)", "`gc` s", "copies found: groups and nodes / packs",
              "repacked MiB", "`gc --repair` would free MiB"]
    rows = []
    for r in d["runs"]:
        one = r["one_by_one"]["stored_bytes"]
        rows.append([
            "MinIO" if r["store"] == "s3" else "local directory", ", ".join(r["images"]),
            f"{one / MIB:.1f}",
            f"{r['at_once']['stored_bytes'] / MIB:.1f} ({r['ratio_before_gc']:.3f}×)",
            f"{r['gc']['stored_bytes'] / MIB:.1f} (**{r['ratio_after_gc']:.3f}×**)",
            f"{r['gc']['seconds']:.2f}",
            f"{r['gc']['duplicate_blobs']} / {r['gc']['duplicate_packs']}",
            f"{r['gc']['repacked_bytes'] / MIB:.1f}", f"{r['repair_would_free'] / MIB:.2f}"])
    return header, rows


def r_in_place(spec):
    """bench/in_place.py's run: `restore --in-place` (by diff, by compare) against a full
    restore, and what it wrote against the bytes that differ."""
    d = load_json(spec["file"])
    v, u = d["version"], d["over"]
    what = {
        "back_diff": (f"{v} over a restore of {u}", "diff"),
        "back_compare": (f"{v} over a restore of {u}", "compare"),
        "forward_diff": (f"{u} over a restore of {v}", "diff"),
        "forward_compare": (f"{u} over a restore of {v}", "compare"),
        "rollback_after_writes": (f"{v} over itself after 32 MiB of writes", "compare"),
    }
    header = ["restore", "method", "differing MiB", "written + zeroed MiB (÷ differing)",
              "TARGET read MiB", "fetched MiB", "s (÷ full restore)", "bit-exact"]
    rows = []
    for key, (label, method) in what.items():
        r = d["in_place"][key]
        differing = r.get("differing_bytes", d["differing_bytes"])
        full = d["full_restore_seconds"][u if key.startswith("forward") else v]
        rows.append([
            label, method, f"{differing / MIB:.1f}",
            f"{(r['written_bytes'] + r['zeroed_bytes']) / MIB:.1f} "
            f"(**{r['written_vs_differing']:.2f}×**)",
            f"{r['target_read_bytes'] / MIB:.0f}", f"{r['fetched_bytes'] / MIB:.1f}",
            f"{r['seconds']:.2f} ({r['vs_full_restore']:.2f}× of {full:.2f})",
            "yes" if r["bit_exact"] else "**no**"])
    k = d["killed_mid_way"]
    rows.append([f"{v} over {u}, killed with SIGKILL mid-way, then run again", k["rerun_method"],
                 "", f"{k['rerun_written_bytes'] / MIB:.1f} by the rerun", "", "",
                 f"{k['rerun_seconds']:.2f} (the rerun)",
                 "yes" if k["bit_exact_after_rerun"] else "**no**"])
    return header, rows


def r_seeded(spec):
    """bench/seeded.py's runs (one file per store): a plain restore, one with the previous
    image as a seed, a qcow2 overlay on it, and (when measured) an export read whole without
    and with the seed."""
    header = ["store", "restore", "fetched MiB (÷ plain)", "from the seed MiB",
              "output MiB (÷ differing)", "s", "exact"]
    rows = []
    for file in spec["files"]:
        d = load_json(file)
        store = "MinIO" if d["store"] == "s3" else "local directory"
        plain = d["runs"]["plain"]["fetched_bytes"]
        for key, label in [("plain", f"{d['version']}"),
                           ("seeded", f"{d['version']} --seed {d['seed']}.raw"),
                           ("backing", f"{d['version']} --backing {d['seed']}.raw (qcow2)")]:
            r = d["runs"][key]
            out = (f"{r['file_bytes'] / MIB:.1f} (**{r['file_vs_differing']:.2f}×**)"
                   if "file_bytes" in r else "")
            exact = r.get("bit_exact", r.get("qemu_img_compare_equal"))
            rows.append([store, label,
                         f"{r['fetched_bytes'] / MIB:.1f} ({r['fetched_bytes'] / plain:.2f}×)",
                         f"{r['seeded_bytes'] / MIB:.1f}", out, f"{r['seconds']:.2f}",
                         ("yes" if exact else "**no**")
                         + (" (`qemu-img compare`)" if key == "backing" else "")])
        exports = d.get("exports")
        if exports:
            eplain = exports["plain"]["fetched_bytes"]
            for key, label in [("plain", f"export {d['version']} (nbdcopy)"),
                               ("seeded", f"export {d['version']} --seed {d['seed']}.raw")]:
                r = exports[key]
                rows.append([store, label,
                             f"{r['fetched_bytes'] / MIB:.1f} ({r['fetched_bytes'] / eplain:.2f}×)",
                             f"{r['seeded_bytes'] / MIB:.1f}", "", f"{r['seconds']:.2f}",
                             "yes" if r["bit_exact"] else "**no**"])
    return header, rows


def r_boot_profile(spec):
    """bench/boot_profile.py's runs (one file per store): TCG boots of the newest image from
    its file and over cold exports without and with the profile a boot of the image before
    recorded, and that profile's reads replayed one at a time by qemu-io, as fast as they go
    and at the guest's pace (its recorded think time before each read)."""
    header = ["store", "run", "s (÷ local)", "waited s (÷ local)", "guest read MiB",
              "fetched MiB (÷ read)", "fetched ahead MiB"]
    rows = []
    for file in spec["files"]:
        d = load_json(file)
        store = "MinIO" if d["store"] == "s3" else "local directory"
        labels = {"local": f"boot {d['booted']} from its file",
                  "cold": f"boot {d['booted']}, cold export",
                  "cold_with_profile": f"boot {d['booted']}, cold export `--profile`"}
        for key, b in d.get("boots", {}).items():
            read = b.get("read_bytes")
            rows.append([store, labels[key], f"{b['wall_s']:.1f} ({b['vs_local']:.2f}×)", "",
                         f"{read / MIB:.1f}" if read else "",
                         f"{b['fetched_bytes'] / MIB:.1f} ({b['fetched_vs_read']:.2f}×)"
                         if read else "",
                         f"{b['prefetched_bytes'] / MIB:.1f}" if read else ""])
        p = d["profile"]
        rlabels = {"qemu_nbd_local_file": "qemu-nbd on the file",
                   "cold": "cold export",
                   "cold_with_profile": "cold export `--profile`"}
        for pace, what in [("", "replay, full speed"), ("paced_", "replay, guest's pace")]:
            for key, r in d.get(f"{pace}replays", {}).items():
                fetched = r.get("fetched_bytes")
                rows.append([store, f"{what}: {rlabels[key]} ({p['reads']} reads)",
                             f"{r['seconds']:.2f} ({r['vs_local']:.2f}×)",
                             f"{r['waited_s']:.2f} ({r['waited_vs_local']:.2f}×)",
                             f"{p['bytes'] / MIB:.1f}",
                             f"{fetched / MIB:.1f} ({fetched / p['bytes']:.2f}×)" if fetched else "",
                             f"{r['prefetched_bytes'] / MIB:.1f}" if fetched else ""])
    return header, rows


def r_multideploy(spec):
    """bench/multideploy.py: N VMs starting at once from one image (the boot profile's reads
    replayed by N clients), and N writable exports committed at once."""
    d = load_json(spec["file"])
    header = ["N", "way", "s to the last (÷ copy)", "fetched MiB (÷ copy)", "per VM MiB"]
    labels = {"lazy": "lazy, a cache per VM, no profile",
              "lazy_profile": "lazy, a cache per VM, stored profile",
              "lazy_shared_cache": "lazy, one host cache, stored profile",
              "copy_then_boot": "copy then boot (N restores)"}
    rows = []
    for n, runs in d["runs"].items():
        for key, label in labels.items():
            r = runs[key]
            rows.append([n, label, f"{r['seconds']:.2f} ({r['time_vs_copy']:.2f}×)",
                         f"{r['fetched_bytes'] / MIB:.0f} ({r['bytes_vs_copy']:.3f}×)",
                         f"{r['fetched_bytes'] / int(n) / MIB:.1f}"])
        m = runs.get("multisnapshot")
        if m:
            rows.append([n, f"multisnapshot: {n} exports committed at once",
                         f"{m['seconds']:.2f}", "",
                         f"stored {m['stored_bytes'] / int(n) / MIB:.1f} of "
                         f"{m['written_bytes'] / int(n) / MIB:.0f} written "
                         f"({m['stored_vs_written']:.2f}×)"])
    return header, rows


def r_recompress(spec):
    """bench/recompress.sh: stored bytes before and after `gc --recompress`, against the floor."""
    d = load_json(spec["file"])
    header = ["", "stored MiB", "÷ floor", "÷ before"]
    return header, [
        ["floor (`bench/floor.py`)", f"{d['floor_bytes'] / MIB:.1f}", "1.000", ""],
        ["committed (zstd 3)", f"{d['before_bytes'] / MIB:.1f}",
         f"{d['before_vs_floor']:.3f}", "1.000"],
        [f"after `gc --recompress {d['level']}` ({d['packs_recompressed']} packs, "
         f"{d['gc_seconds']:.0f} s)", f"{d['after_bytes'] / MIB:.1f}",
         f"{d['after_vs_floor']:.3f}", f"{d['after_vs_before']:.3f}"],
    ]


def r_history_locality(spec):
    """bench/history_locality.py: the oldest, a middle and the newest of a long history
    restored by cairn and read out of a qcow2 chain, with cairn's ranged reads per GiB, as
    committed and after each `cairn relayout` (+ `gc --repair`)."""
    d = load_json(spec["file"])
    header = ["step", "version", "cairn restore s", "qcow2 chain s (depth)",
              "cairn ÷ chain", "ranged reads (per GiB)", "stored MiB (÷ chain)"]
    rows = []
    for step in d["steps"]:
        if step.get("relayout_of") is None:
            label = f"as committed ({d['store']})"
        else:
            label = (f"`relayout vm@{step['relayout_of']} --alpha {step['alpha']:g}` + "
                     f"`gc --repair` ({d['store']}): copied "
                     f"{step['bytes_copied'] / MIB:.0f} MiB in {step['relayout_s']:.0f} s, "
                     f"{step['stored_before_gc'] / MIB:.0f} MiB stored until the GC "
                     f"({step['gc_s']:.0f} s)")
        stored = (f"{step['stored_bytes'] / MIB:.0f} "
                  f"({step['stored_bytes'] / d['chain_bytes']:.2f}×)")
        for i, (name, r) in enumerate(step["restores"].items()):
            st = r["stats"]
            rows.append([label if i == 0 else "",
                         f"{name}: vm@{r['version']} of {d['versions']}",
                         f"{r['cairn_restore_s']:.2f}",
                         f"{r['qcow2_chain_s']:.2f} ({r['chain_depth']})",
                         f"{r['cairn_vs_chain']:.2f}×",
                         f"{st['reads']} ({st['reads_per_gib']:.0f})",
                         stored if i == 0 else ""])
    return header, rows


def r_overlay_snapshots(spec):
    """bench/overlay_snapshots.py: snapshot create, rollback and delete against the disk's size,
    cairn's overlay beside qcow2 internal snapshots (`qemu-img snapshot`)."""
    d = load_json(spec["file"])
    header = ["disk", "cairn create / rollback / delete ms",
              "qcow2 create / rollback / delete ms", "qemu-img open ms",
              "cairn ÷ qcow2", "cairn ÷ its 1 GiB figure"]
    rows = []
    ms = lambda x: f"{x * 1000:.1f}"  # noqa: E731
    for r in d["runs"]:
        c, q = r["cairn"], r["qcow2"]
        ops = ("create_s", "rollback_s", "delete_s")
        rows.append([f"{r['size_gib']} GiB",
                     " / ".join(ms(c[o]) for o in ops),
                     " / ".join(ms(q[o]) for o in ops),
                     ms(q["info_s"]),
                     " / ".join(f"{r['cairn_vs_qcow2'][o]:.3f}" for o in ops),
                     " / ".join(f"{r['cairn_vs_smallest'][o]:.2f}" for o in ops)])
    return header, rows


RENDERERS = {
    "recompress": r_recompress,
    "history-locality": r_history_locality,
    "overlay-snapshots": r_overlay_snapshots,
    "multideploy": r_multideploy,
    "boot-profile": r_boot_profile,
    "seeded": r_seeded,
    "in-place": r_in_place,
    "concurrent": r_concurrent,
    "compare": r_compare,
    "md-table": r_md_table,
    "ab-size": r_ab_size,
    "ab-history": r_ab_history,
    "gc-rounds": r_gc_rounds,
    "dedup-scenarios": r_dedup_scenarios,
    "dedup-steps": r_dedup_steps,
    "trace": r_trace,
    "format2-series": r_format2_series,
    "format2-metadata": r_format2_metadata,
    "lost-objects": r_lost_objects,
    "pack-frames": r_pack_frames,
    "summary-delta": r_summary_delta,
    "vm-backup": r_vm_backup,
    "vm-memory": r_vm_memory,
}


def rows_of(spec) -> tuple[list[str], list[list]]:
    kind = spec["from"]
    if kind not in RENDERERS:
        raise ReportError(f"no renderer {kind!r}")
    return RENDERERS[kind](spec)


# ---------------------------------------------------------------------------------------------
# The page


def render_table(t: dict) -> list[str]:
    """A table: its title, date, command and results, the rows, then its notes."""
    for f in t.get("results", []):
        rel(f)
    head = f"**{t['title']}** — {t['date']}"
    if t.get("results"):
        head += ", " + ", ".join(f"[{'results' if i == 0 else Path(f).name}]({f})"
                                 for i, f in enumerate(t["results"]))
    head += "."
    if t.get("command"):
        check_command(t["command"])
        head += f" Command: `{t['command']}`"
        head += f" ({t['command_note']})." if t.get("command_note") else "."
    if t.get("not_in_repository"):
        head += f" **{NOT_IN_REPO[0].upper() + NOT_IN_REPO[1:]}** ({t['not_in_repository']})."
    # The title, command and the notes that explain the table come before it; bullets after.
    prose = [n for n in t.get("notes", []) if not n.startswith("- ")]
    bullets = [n for n in t.get("notes", []) if n.startswith("- ")]
    out = wrap(" ".join([head] + prose[:1])) + [""]
    for n in prose[1:]:
        out += wrap(n) + [""]
    header, rows = None, []
    if "columns" in t:
        header = t["columns"]
    for r in t["rows"]:
        if isinstance(r, dict):
            h, rs = rows_of(r)
            if header is None:
                header = h
            elif len(h) != len(header):
                raise ReportError(f"{t['title']}: rows of {r['from']} have columns {h}")
            rows += rs
        else:
            rows.append(r)
    out += md_table(header, rows, t.get("align") == "left") + [""]
    for n in bullets:
        out += wrap(n)
    if bullets:
        out.append("")
    return out


def render_topic(heading: str, topic: dict, headings: list[str]) -> list[str]:
    out = [f"## {heading}", ""]
    for p in topic.get("intro", []):
        out += wrap(p)
        if not p.startswith("- "):
            out.append("")
    if out[-1] != "":
        out.append("")
    if "targets" in topic:  # the first table: a row per target, linked to its topic
        header = topic["columns"]
        rows = []
        for r in topic["targets"]:
            if r["topic"] not in headings:
                raise ReportError(f"target {r['target']!r} links to no topic {r['topic']!r}")
            rows.append([r["target"], r["figure"], r["against"], r["met"], r["date"],
                         f"[{r['topic']}]({anchor(r['topic'])})"])
        out += md_table(header, rows, left=True) + [""]
        for n in topic.get("notes", []):
            out += wrap(n) + [""]
    for t in topic.get("tables", []):
        out += render_table(t)
    for s in topic.get("studies", []):
        # One paragraph: the title links to the study's results, the first of them.
        for f in s["results"]:
            rel(f)
        if s.get("command"):
            check_command(s["command"])
        text = f"**[{s['title']}]({s['results'][0]})** ({s['date']}; "
        text += "; ".join(([f"`{s['command']}`"] if s.get("command") else []) +
                          ([f"{s['not_in_repository']}: {NOT_IN_REPO}"]
                           if s.get("not_in_repository") else []))
        text += "). " + s["paragraph"]
        if s["results"][1:]:
            text += " Also: " + ", ".join(f"[`{f.removeprefix('bench/results/')}`]({f})"
                                          for f in s["results"][1:]) + "."
        out += wrap(text) + [""]
    if topic.get("plots"):
        for p in topic["plots"]:
            rel(p["file"])
            out.append(f"![{p['alt']}]({p['file']})")
        out.append("")
    return out


def render() -> str:
    headings = [h for h, _ in TOPICS]
    head = json.loads((CURRENT / "header.json").read_text())
    out = [f"# {head['title']}", ""]
    for p in head["paragraphs"]:
        out += wrap(p)
        if not p.startswith("- "):
            out.append("")
    if out[-1] != "":
        out.append("")
    for heading, name in TOPICS:
        topic = json.loads((CURRENT / name).read_text())
        if topic.get("heading") != heading:
            raise ReportError(f"{name}: heading {topic.get('heading')!r}, expected {heading!r}")
        out += render_topic(heading, topic, headings)
    while out and out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    a = ap.parse_args()
    try:
        text = render()
    except ReportError as e:
        sys.exit(f"bench/report.py: {e}")
    a.out.write_text(text)


if __name__ == "__main__":
    main()

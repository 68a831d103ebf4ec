#!/usr/bin/env python3
"""Tables and plots from bench/compare.py's measurements.

    bench/compare_report.py bench/results/compare-DATE.json

Writes compare-DATE.md next to the JSON (and prints it), and the PNG plots to
bench/results/plots/. Medians are over the counted runs (run ≥ 1); run 0 is the warm-up.
"Best peer" is the peer with the smallest figure for that row (cairn itself, cairn on MinIO
and the cp yardstick are not peers); a ratio below 1 means cairn is better.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

MIB = 1 << 20
NOT_PEERS = {"cairn", "cairn-f1", "cairn-s3", "cp"}
# Issue 16's targets for the default (format 2), against the best peer and cairn's format 1.
TARGET_STORED = 0.85
TARGET_REBUILT = 0.5
TARGET_NEW_DATA_SPEEDUP = 1.3
NEW_DATA_STEPS = ("su-0", "su-1", "su-2")
CHAIN = "qcow2-chain"
# Targets of issue 7, on the su-* series.
TARGET_COMMIT = 1 / 3
TARGET_RESTORE = 1 / 2


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, digits=2):
    return "–" if x is None else f"{x:,.{digits}f}"


def ratio_cell(x, target=None):
    if x is None:
        return "–"
    s = f"{x:.2f}"
    if target is not None:
        s += " ✓" if x <= target else " ✗"
    return s


class Data:
    def __init__(self, d: dict):
        self.d = d
        self.labels = d["labels"]
        series = d.get("series", [])
        self.tools = [t for t in self.labels if t != "cp" and any(r["tool"] == t for r in series)]
        self.peers = [t for t in self.tools if t not in NOT_PEERS]
        self.steps = list(dict.fromkeys(r["step"] for r in series))
        self.limits = d.get("limits", {})

    def counted(self, rows):
        return [r for r in rows if r.get("run", 1) >= 1]

    def _median(self, part, key, **match):
        """Median over the counted runs of `part`'s rows matching `match`; key "cpu" is
        user + sys."""
        rows = [r for r in self.counted(self.d.get(part, []))
                if all(r[k] == v for k, v in match.items())]
        if key == "cpu":
            return median(r["user"] + r["sys"] for r in rows)
        return median(r[key] for r in rows)

    def step(self, tool, step, key):
        return self._median("series", key, tool=tool, step=step)

    def restore(self, tool, which, key):
        return self._median("restore", key, tool=tool, which=which)

    def data_bytes(self, image):
        return self.limits.get(image, {}).get("data_bytes")

    def best_peer(self, values: dict, backup_only: bool = False):
        """The peer with the smallest value; backup_only leaves out the qcow2 chain (a
        hypervisor's snapshot, not a backup tool: no dedup, no compression, no checksums)."""
        peers = {t: v for t, v in values.items() if t in self.peers and v is not None
                 and not (backup_only and t == CHAIN)}
        if not peers:
            return None, None
        t = min(peers, key=peers.get)
        return t, peers[t]


def table(header, rows):
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(out)


def per_step_table(D: Data, key, scale, digits, target=None, total=True, agg=sum):
    """One row per step, one column per tool, then cairn's ratio to the best peer and, where
    the chain is in the run, to the best backup tool."""
    chain = CHAIN in D.tools
    header = ["step"] + D.tools + ["best peer", "cairn ÷ best"]
    if chain:
        header += ["best backup tool", "cairn ÷ it"]

    def ratios(vals, bold=""):
        out = []
        for backup_only in ([False, True] if chain else [False]):
            bt, bv = D.best_peer(vals, backup_only)
            r = vals["cairn"] / bv if bv and vals.get("cairn") is not None else None
            out += [bt or "–", f"{bold}{ratio_cell(r, target)}{bold}"]
        return out

    rows, totals = [], {t: [] for t in D.tools}
    for s in D.steps:
        vals = {t: D.step(t, s, key) for t in D.tools}
        for t in D.tools:
            totals[t].append(vals[t])
        rows.append([s] + [fmt(vals[t] / scale if vals[t] is not None else None, digits)
                           for t in D.tools] + ratios(vals))
    if total:
        vals = {t: agg(v for v in totals[t] if v is not None) for t in D.tools}
        rows.append(["**all**"] + [f"**{fmt(vals[t] / scale, digits)}**" for t in D.tools]
                    + ratios(vals, "**"))
    return table(header, rows)


def series_section(D: Data) -> list[str]:
    out = []
    labels = "\n".join(f"- `{t}`: {D.labels[t]}" for t in D.tools)
    out += ["## The su-* series: one VM's history, committed in order", "",
            "Tools:", "", labels, "",
            "### Bytes added to the repository per step (MiB)", "",
            per_step_table(D, "added", MIB, 1), ""]
    totals = {t: median(r["total"] for r in D.counted(D.d["series"])
                        if r["tool"] == t and r["step"] == D.steps[-1]) for t in D.tools}
    bt, bv = D.best_peer(totals)
    out += [f"Total repository size after the series: "
            + ", ".join(f"{t} {totals[t] / MIB:,.1f} MiB" for t in D.tools)
            + (f". cairn ÷ best peer ({bt}): **{totals['cairn'] / bv:.2f}**." if bv else "."),
            ""]
    out += ["### Commit wall time per step (s); target cairn ≤ 1/3 of the fastest peer", "",
            per_step_table(D, "wall", 1, 2, TARGET_COMMIT), ""]
    out += ["### Commit CPU time per step (user + sys, s)", "",
            per_step_table(D, "cpu", 1, 2), ""]
    out += ["### Commit peak RSS per step (MiB); the last row is the largest", "",
            per_step_table(D, "rss_kib", 1024, 0, agg=max), ""]
    # Throughput against the limits.
    header = ["step", "data MiB", "read limit MiB/s", "BLAKE3 limit MiB/s"] + \
        [f"{t} MiB/s" for t in D.tools] + ["cairn ÷ min(limits)"]
    rows = []
    for s in D.steps:
        lim = D.limits.get(s, {})
        db = D.data_bytes(s)
        tp = {t: (db / MIB / D.step(t, s, "wall")) if D.step(t, s, "wall") else None
              for t in D.tools}
        lo = min(lim.get("read_mib_s", 0), lim.get("blake3_chunks_all_cores_mib_s", 0)) or None
        rows.append([s, fmt(db / MIB, 0), fmt(lim.get("read_mib_s"), 0),
                     fmt(lim.get("blake3_chunks_all_cores_mib_s"), 0)]
                    + [fmt(tp[t], 0) for t in D.tools]
                    + [fmt(tp["cairn"] / lo if lo and tp["cairn"] else None, 2)])
    out += ["### Commit throughput over each image's data bytes, against the machine's limits",
            "", "Limits (cairn-limits, same run): reading the image's allocated extents from "
            "the page cache, and BLAKE3 of 16 KiB chunks on all cores.", "",
            table(header, rows), ""]
    return out


def restore_section(D: Data) -> list[str]:
    tools = D.tools + ["cp"]
    chain = CHAIN in D.tools
    header = ["version", "figure"] + tools + ["best peer", "cairn ÷ best"]
    if chain:
        header += ["best backup tool", "cairn ÷ it"]
    rows = []
    for which in ("newest", "oldest"):
        step = next((r["step"] for r in D.d["restore"] if r["which"] == which), "?")
        db = D.data_bytes(step) or 0
        for key, name, scale, digits, target in (
                ("wall", "wall s", 1, 2, TARGET_RESTORE), ("cpu", "CPU s", 1, 2, None),
                ("rss_kib", "peak RSS MiB", 1024, 0, None), ("tput", "MiB/s", 1, 0, None)):
            if key == "tput":
                vals = {t: (db / MIB / w) if (w := D.restore(t, which, "wall")) else None
                        for t in tools}
            else:
                vals = {t: D.restore(t, which, key) for t in tools}
            cells = []
            for backup_only in ([False, True] if chain else [False]):
                if key == "tput":  # higher is better: the ratio is cairn's time ÷ theirs
                    bt, bv = max(((t, v) for t, v in vals.items() if t in D.peers and v
                                  and not (backup_only and t == CHAIN)),
                                 key=lambda x: x[1], default=(None, None))
                    r = bv / vals["cairn"] if bv and vals["cairn"] else None
                else:
                    bt, bv = D.best_peer(vals, backup_only)
                    r = vals["cairn"] / bv if bv and vals["cairn"] is not None else None
                cells += [bt or "–", ratio_cell(r, target)]
            rows.append([f"{which} ({step}, {db / MIB:,.0f} MiB data)" if key == "wall" else "",
                         name] + [fmt(vals[t] / scale if vals[t] is not None else None, digits)
                                  for t in tools] + cells)
    return ["## Restore of the newest and the oldest version (to a file, fsynced)", "",
            "From the repository holding the whole series. Throughput is over the version's "
            "data bytes; its ratio is the time ratio (fastest peer ÷ cairn inverted). "
            "`cp` copies the image itself: the yardstick for writing it out.", "",
            table(header, rows), ""]


def fleet_section(D: Data) -> list[str]:
    rows_in = D.d.get("fleet", [])
    if not rows_in:
        return []
    tools = list(dict.fromkeys(r["tool"] for r in rows_in))
    steps = list(dict.fromkeys(r["step"] for r in rows_in))
    get = {(r["tool"], r["step"]): r for r in rows_in}
    header = ["image"] + tools + ["best peer", "cairn ÷ best"]
    rows = []
    for s in steps + ["**all**"]:
        if s == "**all**":
            vals = {t: sum(get[(t, x)]["added"] for x in steps) for t in tools}
        else:
            vals = {t: get[(t, s)]["added"] for t in tools}
        bt, bv = D.best_peer(vals)
        r = vals["cairn"] / bv if bv else None
        rows.append([s] + [fmt(vals[t] / MIB, 1) for t in tools] + [bt or "–", ratio_cell(r)])
    return ["## Golden image, clones and a rebuilt layout (MiB added, one run)", "",
            "su-1, then its clones pa-a, pa-b, pa-c (each su-1 plus different packages and "
            "user files), then su-1-rebuilt (su-1's files written by `mkfs.ext4 -d` into a new "
            "layout), into one fresh repository per tool. The qcow2 chain stacks each image "
            "on the one before it.", "", table(header, rows), ""]


def scaling_section(D: Data) -> list[str]:
    out = []
    size_rows = D.d.get("scaling_size", [])
    if size_rows:
        header = ["image", "data", "first commit s", "MiB/s", "peak RSS MiB",
                  "re-commit after 1 MiB/GiB written s", "re-commit RSS MiB", "restore s",
                  "stored MiB", "tree nodes", "tree KiB", "index + records KiB"]
        rows = []
        for gib in sorted({r["gib"] for r in size_rows}):
            rs = D.counted([r for r in size_rows if r["gib"] == gib])
            m = lambda f: median(f(r) for r in rs)  # noqa: E731
            first = m(lambda r: r["first"]["wall"])
            rows.append([f"{gib} GiB", f"{rs[0]['data'] / MIB:,.0f} MiB", fmt(first),
                         fmt(rs[0]["data"] / MIB / first, 0),
                         fmt(m(lambda r: r["first"]["rss_kib"]) / 1024, 0),
                         fmt(m(lambda r: r["second"]["wall"])),
                         fmt(m(lambda r: r["second"]["rss_kib"]) / 1024, 0),
                         fmt(m(lambda r: r["restore"]["wall"])),
                         fmt(m(lambda r: r["stats"]["stored_bytes"]) / MIB, 1),
                         fmt(m(lambda r: r["stats"]["tree_nodes"]), 0),
                         fmt(m(lambda r: r["stats"]["tree_bytes"]) / 1024, 0),
                         fmt(m(lambda r: r["stats"]["metadata_bytes"]) / 1024, 0)])
            if "verify" in rs[0]:
                rows[-1] += [fmt(m(lambda r: r["verify"]["wall"])),
                             fmt(m(lambda r: r["verify"]["rss_kib"]) / 1024, 0),
                             fmt(m(lambda r: r["gc"]["wall"])),
                             fmt(m(lambda r: r["gc"]["rss_kib"]) / 1024, 0)]
        readers = "verify" in size_rows[0]
        if readers:
            header += ["verify s", "verify RSS MiB", "gc s", "gc RSS MiB"]
        # Results from before 2026-11-26's fix say nothing (their writes went anywhere).
        where = " inside the data" if D.d.get("scribble_into") == "data" else ""
        out += ["## Scaling with image size (cairn)", "",
                "Sparse images with 1 MiB of real data (dataset bytes, made unique per copy) in "
                "every 16 MiB; a first commit into a fresh repository, then a re-commit after "
                "1 MiB of 4 KiB writes per GiB" + where + ", then a restore of the head. Two "
                "versions are "
                "stored at the end." + (" Then a full `verify`, and `gc` after `rm vm@1`."
                                        if readers else ""), "", table(header, rows), ""]
    ver_rows = D.d.get("scaling_versions", [])
    if ver_rows:
        marks = [r for r in ver_rows if "stats" in r]
        header = ["versions", "commit s (median of the last 5)", "commit peak RSS MiB",
                  "added per commit KiB", "stored MiB", "tree nodes", "tree KiB",
                  "index + records KiB", "`log` s", "restore oldest s"]
        rows = []
        for mrow in marks:
            n = mrow["n"]
            last = [r for r in ver_rows if n - 5 < r["n"] <= n]
            rows.append([n, fmt(median(r["commit"]["wall"] for r in last), 3),
                         fmt(median(r["commit"]["rss_kib"] for r in last) / 1024, 0),
                         fmt(median(r["added"] for r in last) / 1024, 0),
                         fmt(mrow["stats"]["stored_bytes"] / MIB, 1),
                         fmt(mrow["stats"]["tree_nodes"], 0),
                         fmt(mrow["stats"]["tree_bytes"] / 1024, 0),
                         fmt(mrow["stats"]["metadata_bytes"] / 1024, 0),
                         fmt(mrow["log"]["wall"], 3), fmt(mrow["restore_oldest"]["wall"], 2)])
            if "verify" in mrow:
                rows[-1] += [fmt(mrow["verify"]["wall"], 2),
                             fmt(mrow["verify"]["rss_kib"] / 1024, 0),
                             fmt(mrow["gc"]["wall"], 2), fmt(mrow["gc"]["rss_kib"] / 1024, 0)]
        readers = "verify" in marks[0] if marks else False
        if readers:
            header += ["verify s", "verify RSS MiB", "gc s", "gc RSS MiB"]
        out += ["## Scaling with the number of versions (cairn)", "",
                "One 1 GiB image (64 MiB of data); before each commit, four random 4 KiB "
                "blocks are overwritten (a quiet VM between snapshots)" +
                (", inside the data, so the image keeps its 64 data segments."
                 if D.d.get("scribble_into") == "data" else ".") +
                (" At each mark, a full `verify`, then `gc` after `rm` of the version before "
                 "the head." if readers else ""), "",
                table(header, rows), ""]
    return out


def targets_section(D: Data) -> list[str]:
    out = ["## Targets (issue 7, su-* series)", ""]
    if not D.peers:
        return out + ["No peer was in this run.", ""]
    chain = CHAIN in D.tools
    kinds = [False, True] if chain else [False]
    name = {False: "best peer", True: "best backup tool"}
    totals = {t: median(r["total"] for r in D.counted(D.d["series"])
                        if r["tool"] == t and r["step"] == D.steps[-1]) for t in D.tools}
    kinds = [k for k in kinds if D.best_peer(totals, k)[1]]  # a run may lack one kind
    for k in kinds:
        bt, bv = D.best_peer(totals, k)
        r = totals["cairn"] / bv
        out.append(f"- Total stored bytes ≤ the {name[k]}'s: cairn ÷ {bt} = **{r:.2f}**, "
                   f"{'met' if r <= 1 else 'NOT met'}.")
    for k in kinds:
        missed = []
        for s in D.steps:
            vals = {t: D.step(t, s, "wall") for t in D.tools}
            bt, bv = D.best_peer(vals, k)
            rr = vals["cairn"] / bv
            if rr > TARGET_COMMIT:
                missed.append(f"{s}: {rr:.2f} of {bt}")
        out.append(f"- Commit time of each step ≤ 1/3 of the {name[k]}'s: "
                   + ("**met** on every step." if not missed else
                      f"**NOT met** on {len(missed)} of {len(D.steps)} steps "
                      f"({'; '.join(missed)})."))
    for which in ("newest", "oldest"):
        for k in kinds:
            vals = {t: D.restore(t, which, "wall") for t in D.tools}
            bt, bv = D.best_peer(vals, k)
            rr = vals["cairn"] / bv
            out.append(f"- Restore of the {which} version ≤ 1/2 of the {name[k]}'s: cairn ÷ "
                       f"{bt} = **{rr:.2f}**, {'met' if rr <= TARGET_RESTORE else 'NOT met'}.")
    if chain:
        out.append("- A *backup tool* is every peer but the qcow2 chain: the chain neither "
                   "deduplicates, compresses nor checksums, and its snapshot is taken by the "
                   "hypervisor while the VM runs; its commit time here is what `qemu-img` needs "
                   "to build the same chain from the full images.")
    return out + [""]


def format2_section(D: Data) -> list[str]:
    """Issue 16's checks, where the run has cairn's format 1 beside its default."""
    if "cairn-f1" not in D.tools or not D.peers:
        return []
    out = ["## Targets (issue 16: format 2, the default, against the peers and format 1)", ""]
    totals = {t: median(r["total"] for r in D.counted(D.d["series"])
                        if r["tool"] == t and r["step"] == D.steps[-1]) for t in D.tools}
    bt, bv = D.best_peer(totals)
    r = totals["cairn"] / bv
    out.append(f"- Stored bytes over the series ≤ {TARGET_STORED} × the best peer's: cairn ÷ "
               f"{bt} = **{r:.3f}**, {'met' if r <= TARGET_STORED else 'NOT met'} "
               f"(format 1: {totals['cairn-f1'] / bv:.3f}).")
    fleet = {(row["tool"], row["step"]): row["added"] for row in D.d.get("fleet", [])}
    if ("cairn", "su-1-rebuilt") in fleet and ("casync", "su-1-rebuilt") in fleet:
        rr = fleet[("cairn", "su-1-rebuilt")] / fleet[("casync", "su-1-rebuilt")]
        out.append(f"- su-1-rebuilt adds ≤ {TARGET_REBUILT} × what casync adds: "
                   f"{fleet[('cairn', 'su-1-rebuilt')] / MIB:.1f} ÷ "
                   f"{fleet[('casync', 'su-1-rebuilt')] / MIB:.1f} MiB = **{rr:.3f}**, "
                   f"{'met' if rr <= TARGET_REBUILT else 'NOT met'}.")
    pa = [s for s in ("su-1", "pa-a", "pa-b", "pa-c")]
    tools = {t for t, _ in fleet}
    if all(("cairn", s) in fleet for s in pa):
        sums = {t: sum(fleet.get((t, s), 0) for s in pa) for t in tools}
        bt, bv = D.best_peer(sums)
        if bv:
            rr = sums["cairn"] / bv
            out.append(f"- The golden image and its clones (su-1, pa-a, pa-b, pa-c) store no "
                       f"more than the best peer: cairn ÷ {bt} = **{rr:.3f}**, "
                       f"{'met' if rr <= 1 else 'NOT met'}.")
    new = [s for s in NEW_DATA_STEPS if s in D.steps]
    if new:
        f2 = sum(D.step("cairn", s, "wall") for s in new)
        f1 = sum(D.step("cairn-f1", s, "wall") for s in new)
        speedup = f1 / f2
        out.append(f"- Commit throughput on the steps that bring new data ({', '.join(new)}) "
                   f"≥ {TARGET_NEW_DATA_SPEEDUP} × format 1's: format 1 ÷ format 2 wall = "
                   f"{f1:.2f} ÷ {f2:.2f} s = **{speedup:.2f}**, "
                   f"{'met' if speedup >= TARGET_NEW_DATA_SPEEDUP else 'NOT met'}.")
    for which in ("newest", "oldest"):
        f2 = D.restore("cairn", which, "wall")
        f1 = D.restore("cairn-f1", which, "wall")
        out.append(f"- Restore of the {which} version no slower than format 1's: "
                   f"{f2:.2f} s against {f1:.2f} s = **{f1 / f2:.2f}×** its throughput, "
                   f"{'met' if f2 <= f1 else 'NOT met'}.")
    return out + [""]


# ---------------------------------------------------------------------------------------------
# Plots


def plots(D: Data, plot_dir: Path, stem: str) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("compare_report: matplotlib is missing (apt-get install python3-matplotlib); "
              "no plots", file=sys.stderr)
        return []
    plot_dir.mkdir(parents=True, exist_ok=True)
    made = []

    def save(fig, name):
        path = plot_dir / f"{stem}-{name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        made.append(path)

    if D.tools:
        series_plots(D, plt, save)
    scaling_plot(D, plt, save)
    return made


def series_plots(D: Data, plt, save) -> None:
    style = {"cairn": dict(color="black", linewidth=2.5, marker="o")}

    # Stored bytes over the series.
    fig, ax = plt.subplots(figsize=(8, 5))
    for t in D.tools:
        ys = [D.step(t, s, "total") for s in D.steps]
        ax.plot(D.steps, [y / MIB for y in ys], label=t, **style.get(t, dict(marker=".")))
    ax.set_ylabel("repository size after the step (MiB)")
    ax.set_title("Stored bytes over the su-* series (smaller is better)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, "stored")

    # Commit throughput per step, with the limits.
    fig, ax = plt.subplots(figsize=(8, 5))
    for t in D.tools:
        ys = [(D.data_bytes(s) or 0) / MIB / w if (w := D.step(t, s, "wall")) else None
              for s in D.steps]
        ax.plot(D.steps, ys, label=t, **style.get(t, dict(marker=".")))
    for key, name, ls in (("read_mib_s", "limit: read allocated extents", "--"),
                          ("blake3_chunks_all_cores_mib_s", "limit: BLAKE3, all cores", ":")):
        ax.plot(D.steps, [D.limits.get(s, {}).get(key) for s in D.steps], color="red",
                linestyle=ls, label=name)
    ax.set_yscale("log")
    ax.set_ylabel("MiB of image data per second (log)")
    ax.set_title("Commit throughput per step (higher is better)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    save(fig, "commit-throughput")

    # Restore throughput.
    fig, ax = plt.subplots(figsize=(9, 5))
    tools = D.tools + ["cp"]
    width = 0.4
    for i, which in enumerate(("newest", "oldest")):
        step = next((r["step"] for r in D.d["restore"] if r["which"] == which), None)
        db = D.data_bytes(step) or 0
        ys = [db / MIB / w if (w := D.restore(t, which, "wall")) else 0 for t in tools]
        ax.bar([x + i * width for x in range(len(tools))], ys, width,
               label=f"{which} ({step})", color="tab:blue" if i == 0 else "tab:orange")
        read = D.limits.get(step, {}).get("read_mib_s")
        if read:
            ax.axhline(read, color="red", linestyle="--" if i == 0 else ":",
                       label=f"limit: read {step}'s extents")
    ax.set_xticks([x + width / 2 for x in range(len(tools))], tools, rotation=30, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("MiB of image data per second (log)")
    ax.set_title("Restore throughput to a file, fsynced (higher is better)")
    ax.grid(alpha=0.3, axis="y", which="both")
    ax.legend(fontsize=8)
    save(fig, "restore-throughput")



def scaling_plot(D: Data, plt, save) -> None:
    size_rows = D.d.get("scaling_size", [])
    ver_rows = D.d.get("scaling_versions", [])
    if size_rows and ver_rows:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
        ax = axes[0]
        gibs = sorted({r["gib"] for r in size_rows})
        med = lambda f, g: median(f(r) for r in D.counted(size_rows) if r["gib"] == g)  # noqa
        ax.plot(gibs, [med(lambda r: r["first"]["wall"], g) for g in gibs], "o-",
                label="first commit (s)")
        ax.plot(gibs, [med(lambda r: r["second"]["wall"], g) for g in gibs], "s-",
                label="re-commit (s)")
        ax.plot(gibs, [med(lambda r: r["first"]["rss_kib"], g) / 1024 / 100 for g in gibs],
                "^--", label="peak RSS (100 MiB)")
        ax.plot(gibs, [med(lambda r: r["stats"]["tree_bytes"], g) / MIB for g in gibs],
                "d:", label="tree nodes (MiB)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("image size (GiB), 1/16 data")
        ax.set_title("cairn vs image size")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
        ax = axes[1]
        ns = [r["n"] for r in ver_rows]
        ax.plot(ns, [r["commit"]["wall"] for r in ver_rows], ".", markersize=3, alpha=0.6,
                label="commit (s), each")
        ax2 = ax.twinx()
        ax2.plot(ns, [r["commit"]["rss_kib"] / 1024 for r in ver_rows], color="tab:green",
                 linewidth=0.8, label="commit peak RSS (MiB)")
        marks = [r for r in ver_rows if "stats" in r]
        ax2.plot([r["n"] for r in marks],
                 [(r["stats"]["tree_bytes"] + r["stats"]["metadata_bytes"]) / MIB
                  for r in marks], "ko-", label="metadata (MiB)")
        ax.set_xlabel("versions of one 1 GiB image")
        ax.set_ylabel("commit wall time (s)")
        ax2.set_ylabel("MiB")
        ax.set_title("cairn vs number of versions")
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="lower right", fontsize=8)
        ax.grid(alpha=0.3)
        save(fig, "scaling")


def main() -> None:
    path = Path(sys.argv[1])
    d = json.loads(path.read_text())
    D = Data(d)
    m = d["machine"]
    out = [f"# cairn against its peers — {d['date']}", "",
           f"Command: `{d['command']}` ({d['runs']} counted runs after a warm-up; medians; "
           f"{d.get('elapsed_s', 0) / 60:.0f} min). Machine: {m['cpu']}, {m['cores']} cores, "
           f"{m['mem_gib']} GiB, kernel {m['kernel']}, load before the run "
           f"{', '.join(f'{x:.2f}' for x in m['load_before'])}.", "",
           "Versions: " + "; ".join(f"{k} `{v}`" for k, v in d["versions"].items()) + ".", ""]
    if D.tools:
        out += (targets_section(D) + format2_section(D) + series_section(D)
                + restore_section(D))
    out += fleet_section(D) + scaling_section(D)
    stem = path.stem
    made = plots(D, path.parent / "plots", stem)
    if made:
        out += ["## Plots", ""] + [f"![{p.stem}](plots/{p.name})" for p in made] + [""]
    text = "\n".join(out)
    path.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

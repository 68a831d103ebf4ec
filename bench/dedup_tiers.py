#!/usr/bin/env python3
"""Dedup tiers on the real dataset (issue 17): what `commit --dedup bounded` stores against
`--dedup exact`, in one run, and what each tier found.

Three scenarios, each into a fresh repository per mode:

- series: su-0 … su-5 as versions of one image (a VM updated in place);
- fleet:  su-1, pa-a, pa-b, pa-c, su-1-rebuilt as versions of one image (compare.py's
          fleet: each clone's parent is the image before it);
- clones: the same five images as five images of their own (no parent: only similarity
          across images can find what they share).

For every commit: the bytes the repository grew by, wall time, peak RSS, the chunks each
tier found (`parent_chunks`, `similar_chunks`, `index_chunks`), the hooks looked up and the
index sections and pack trailers read.

    bench/dedup_tiers.py --bin target/release/cairn [--before OLD_CAIRN] [--dataset .data/bench]
                         [--scenarios series,fleet,clones] [--modes exact,bounded] [--out F]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab_scaling import timed  # noqa: E402
from compare import dir_bytes  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = {
    "series": [("vm", f"su-{i}") for i in range(6)],
    "fleet": [("vm", s) for s in ["su-1", "pa-a", "pa-b", "pa-c", "su-1-rebuilt"]],
    "clones": [(s, s) for s in ["su-1", "pa-a", "pa-b", "pa-c", "su-1-rebuilt"]],
}


def repo_bytes(repo: Path) -> int:
    """What a repository occupies, less the space reserve `init` preallocates (not data)."""
    reserve = repo / ".cairn-reserve"
    return dir_bytes(repo) - (reserve.stat().st_size if reserve.exists() else 0)


def run(binary: str, dataset: Path, scenario: str, mode: str, work: Path) -> list[dict]:
    """Commits the scenario's steps with `--dedup mode` (mode "before": `binary` is an older
    build without the flag, run as it is)."""
    repo = work / f"repo-{scenario}-{mode}"
    shutil.rmtree(repo, ignore_errors=True)
    base = [binary, "--repo", str(repo), "-q"]
    subprocess.run([*base, "init"], check=True, stdout=subprocess.DEVNULL)
    rows = []
    before = repo_bytes(repo)
    for image, step in SCENARIOS[scenario]:
        flag = [] if mode == "before" else ["--dedup", mode]
        secs, rss, out = timed([*base, "--json", "commit", "--no-compact", *flag,
                                image, str(dataset / f"{step}.raw")])
        r = json.loads(out)
        after = repo_bytes(repo)
        fetched = r.get("fetched") or {}
        row = dict(scenario=scenario, mode=mode, step=step, added=after - before,
                   seconds=round(secs, 3), rss_mib=rss,
                   parent_chunks=r.get("parent_chunks"),
                   similar_chunks=r.get("similar_chunks"),
                   index_chunks=r.get("index_chunks"), hook_lookups=r.get("hook_lookups"),
                   index_sections=fetched.get("index_sections"),
                   trailers=fetched.get("trailers"))
        print(json.dumps(row), flush=True)
        rows.append(row)
        before = after
    shutil.rmtree(repo)
    return rows


def report(rows: list[dict]) -> str:
    mib = 1 << 20
    out = []
    for scenario in dict.fromkeys(r["scenario"] for r in rows):
        rs = [r for r in rows if r["scenario"] == scenario]
        modes = list(dict.fromkeys(r["mode"] for r in rs))
        steps = list(dict.fromkeys(r["step"] for r in rs))
        out.append(f"\n{scenario} (MiB added; tiers: parent/similar/index chunks, hooks, "
                   "index sections read)\n")
        out.append("| step | " + " | ".join(modes) + " | bounded ÷ exact | " +
                   " | ".join(f"{m} tiers" for m in modes) + " |")
        out.append("|---|" + "---:|" * (2 * len(modes) + 1))
        total = {m: 0 for m in modes}
        for step in steps:
            by = {r["mode"]: r for r in rs if r["step"] == step}
            for m in modes:
                total[m] += by[m]["added"]
            ratio = (by["bounded"]["added"] / by["exact"]["added"]
                     if {"exact", "bounded"} <= by.keys() and by["exact"]["added"] else None)
            tiers = [f'{by[m]["parent_chunks"]}/{by[m]["similar_chunks"]}/'
                     f'{by[m]["index_chunks"]}, {by[m]["hook_lookups"]}, '
                     f'{by[m]["index_sections"]}' for m in modes]
            out.append(f"| {step} | " + " | ".join(f'{by[m]["added"] / mib:.1f}' for m in modes)
                       + f" | {'' if ratio is None else f'{ratio:.3f}'} | "
                       + " | ".join(tiers) + " |")
        ratio = (total["bounded"] / total["exact"]
                 if {"exact", "bounded"} <= total.keys() else None)
        out.append("| **all** | " + " | ".join(f"{total[m] / mib:.1f}" for m in modes)
                   + f" | {'' if ratio is None else f'**{ratio:.3f}**'} |" + " |" * len(modes))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=str(ROOT / "target/release/cairn"))
    ap.add_argument("--dataset", type=Path, default=ROOT / ".data/bench")
    ap.add_argument("--scenarios", default="series,fleet,clones")
    ap.add_argument("--modes", default="exact,bounded")
    ap.add_argument("--before", default=None,
                    help="an older cairn (no --dedup) to run first, as mode 'before'")
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    a.work = a.work.resolve() if a.work else None
    work = Path(tempfile.mkdtemp(prefix="cairn-dedup-", dir=a.work))
    rows = []
    try:
        for scenario in a.scenarios.split(","):
            if a.before:
                rows += run(str(Path(a.before).resolve()), a.dataset, scenario, "before", work)
            for mode in a.modes.split(","):
                rows += run(str(Path(a.bin).resolve()), a.dataset, scenario, mode, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(report(rows))
    if a.out:
        a.out.write_text(json.dumps(dict(date=str(date.today()), rows=rows), indent=1) + "\n")


if __name__ == "__main__":
    main()

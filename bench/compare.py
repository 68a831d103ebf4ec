#!/usr/bin/env python3
"""cairn against the tools people use, on the same real disk images, in one run.

    bench/compare.py [--runs N] [--parts series,fleet,scaling] [--quick] [--tools a,b,...]

One command reproduces the tables and plots of BENCHMARKS.md's "Stored bytes, commit and restore
against peers" (and, with --parts scaling, those of "Scaling with image size and history" it
names): it installs the peers (scripts/peers.sh), builds cairn and cairn-limits, builds or
reuses the dataset (scripts/build-dataset.sh), starts a throw-away MinIO (scripts/minio.sh)
for cairn's S3 row, measures, and writes

    bench/results/compare-DATE.json     every measurement (the report can be redone from it)
    bench/results/compare-DATE.md       the tables, ratios and targets
    bench/results/plots/*.png           the plots linked from BENCHMARKS.md

Parts:
  series   the su-0 … su-5 history committed in order by every tool into a fresh repository,
           then the newest and the oldest version restored (to a file on disk, fsynced).
           1 warm-up + RUNS counted runs per tool, interleaved; medians. The warm-up run also
           checks every restore bit for bit against its source image.
  fleet    su-1, its three clones pa-a/b/c and su-1-rebuilt (same files, new layout) into one
           fresh repository per tool: what deduplication across images and layouts saves.
           Stored bytes do not vary between runs, so this part runs once.
  scaling  cairn alone: commit time, peak memory and metadata size against image size
           (1, 4, 16, 64 GiB sparse, 1/16 of it data) and against history length (10, 100, 1000
           small versions of one image).

Every timed command runs under `/usr/bin/time -v` (wall, user, sys, peak RSS) after a sync of
the scratch file system. Images are read from the page cache by every tool (cairn runs with
CAIRN_KEEP_CACHE=1, as its polite default would otherwise drop the pages it brought in).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SERIES = ["su-0", "su-1", "su-2", "su-3", "su-4", "su-5"]
FLEET = ["su-1", "pa-a", "pa-b", "pa-c", "su-1-rebuilt"]
GIB = 1 << 30
MIB = 1 << 20


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] compare: {msg}", file=sys.stderr, flush=True)


def die(msg: str) -> None:
    log(f"error: {msg}")
    sys.exit(1)


def sh(cmd: list[str] | str, **kw) -> str:
    """Runs a set-up command; its stdout is returned, a failure ends the benchmark."""
    shell = isinstance(cmd, str)
    kw.setdefault("stdout", subprocess.PIPE)
    p = subprocess.run(cmd, shell=shell, text=True, **kw)
    if p.returncode != 0:
        die(f"{cmd if shell else ' '.join(map(str, cmd))} failed with status {p.returncode}")
    return p.stdout


# ---------------------------------------------------------------------------------------------
# Measuring


class Timer:
    """Runs commands under /usr/bin/time -v after syncing the scratch file system."""

    def __init__(self, work: Path):
        self.work = work

    def run(self, cmd: list[str], cwd: Path | None = None, durable: Path | None = None) -> dict:
        """durable: a path on the repository's file system, synced as part of the measured
        command: a commit counts once its data is on disk, whichever tool made it."""
        sh(["sync", "-f", str(self.work)])
        if durable is not None:
            cmd = ["sh", "-c", 'd=$1; shift; "$@" && sync -f "$d"', "sh", durable, *cmd]
        tfile = self.work / "time.txt"
        p = subprocess.run(["/usr/bin/time", "-v", "-o", str(tfile)] + [str(c) for c in cmd],
                           cwd=cwd, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        if p.returncode != 0:
            sys.stderr.write(p.stderr[-4000:])
            die(f"command failed with status {p.returncode}: {' '.join(map(str, cmd))}")
        return dict(parse_time_v(tfile.read_text()), stdout=p.stdout)


def parse_time_v(text: str) -> dict:
    """Wall, user, sys seconds and peak RSS (KiB) from GNU time's -v report."""
    def field(name: str) -> str:
        m = re.search(rf"^\s*{re.escape(name)}: (.*)$", text, re.M)
        if not m:
            die(f"/usr/bin/time -v printed no '{name}'")
        return m.group(1).strip()

    wall = 0.0
    for part in field("Elapsed (wall clock) time (h:mm:ss or m:ss)").split(":"):
        wall = wall * 60 + float(part)
    return dict(wall=wall, user=float(field("User time (seconds)")),
                sys=float(field("System time (seconds)")),
                rss_kib=int(field("Maximum resident set size (kbytes)")))


def dir_bytes(path: Path) -> int:
    """Apparent bytes of every file under path (what a repository occupies)."""
    if path.is_file():
        return path.stat().st_size
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except FileNotFoundError:
                pass
    return total


def same_file(a: Path, b: Path) -> bool:
    return subprocess.run(["cmp", "-s", str(a), str(b)]).returncode == 0


# ---------------------------------------------------------------------------------------------
# The tools. Each knows how to make a repository, commit an image (given as the file
# SRC/disk.raw, the same path at every step, as a VM's disk would be) and restore a step.


class Tool:
    name = ""
    label = ""
    peer = True  # False for cairn itself

    def __init__(self, env: "Env", repo: Path):
        self.env, self.repo = env, repo

    def init(self) -> None: ...
    def commit(self, step: str) -> list[str]: ...  # the command to time
    def restore(self, step: str, out: Path) -> tuple[list[str], Path]: ...
    def size(self) -> int:
        return dir_bytes(self.repo)
    def cwd(self) -> Path | None:
        return None


class Cairn(Tool):
    name, label, peer = "cairn", "cairn (local dir)", False

    def __init__(self, env, repo):
        super().__init__(env, repo)
        self.url = str(repo)
        self.steps: list[str] = []

    def cli(self, *args) -> list[str]:
        return [self.env.cairn, "--repo", self.url, "-q", *args]

    def init(self):
        sh(self.cli("init"), stdout=subprocess.DEVNULL)

    def commit(self, step):
        self.steps.append(step)
        return self.cli("--json", "commit", "vm", self.env.src)

    def restore(self, step, out):
        n = self.steps.index(step) + 1
        return self.cli("restore", f"vm@{n}", out / "disk.raw", "--force"), out / "disk.raw"

    def size(self) -> int:
        # Not the space reserve a local repository keeps for deleting on a full disk (32 MiB
        # preallocated, not data; `init --reserve`).
        reserve = self.repo / ".cairn-reserve"
        return dir_bytes(self.repo) - (reserve.stat().st_size if reserve.exists() else 0)

    def stats(self) -> dict:
        return json.loads(sh(self.cli("--json", "stats")))


class CairnS3(Cairn):
    name, label = "cairn-s3", "cairn (MinIO)"

    def __init__(self, env, repo):
        super().__init__(env, repo)
        base, _, query = os.environ["CAIRN_TEST_S3_URL"].partition("?")
        self.url = f"{base}-{repo.name}?{query}"
        # A new host each run: the metadata cache starts empty.
        os.environ["CAIRN_META_CACHE"] = str(repo) + "-meta"

    def size(self):
        return self.stats()["stored_bytes"]


class Restic(Tool):
    name, label = "restic", "restic 0.14 (zstd auto)"

    def init(self):
        sh(["restic", "-q", "-r", self.repo, "init", "--repository-version", "2"],
           stdout=subprocess.DEVNULL)

    def commit(self, step):
        return ["restic", "-q", "-r", self.repo, "backup", "--compression", "auto",
                "--tag", step, self.env.src]

    def restore(self, step, out):
        script = 'restic -q -r "$1" restore latest --tag "$2" --target "$3" && ' \
                 'find "$3" -type f -exec sync {} +'
        return ["sh", "-c", script, "sh", self.repo, step, out], out / self.env.src.relative_to("/")


class Borg(Tool):
    name, label = "borg", "borg 1.2 (default ~2 MiB chunks, lz4)"
    chunker: list[str] = []

    def init(self):
        sh(["borg", "init", "-e", "none", self.repo], stdout=subprocess.DEVNULL)

    def commit(self, step):
        return ["borg", "create", *self.chunker, f"{self.repo}::{step}", self.env.src]

    def restore(self, step, out):
        script = 'cd "$3" && borg extract --sparse "$1::$2" && find . -type f -exec sync {} +'
        return ["sh", "-c", script, "sh", self.repo, step, out], out / self.env.src.relative_to("/")


class Borg64k(Borg):
    name, label = "borg-64k", "borg 1.2 (~64 KiB chunks, lz4)"
    chunker = ["--chunker-params", "buzhash,14,18,16,4095"]


class Casync(Tool):
    """casync/desync: a chunk store plus one .caibx index per version."""
    name, label = "casync", "casync 2 (64 KiB avg chunks, zstd: its default)"

    def init(self):
        (self.repo / "store").mkdir(parents=True)

    def make(self) -> list[str]:
        return ["casync", "make", f"--store={self.repo / 'store'}"]

    def extract(self) -> list[str]:
        return ["casync", "extract", f"--store={self.repo / 'store'}"]

    def commit(self, step):
        return [*self.make(), self.repo / f"{step}.caibx", self.env.src]

    def restore(self, step, out):
        target = out / "disk.raw"
        script = '"$@" && sync "$TARGET"'
        cmd = [*self.extract(), self.repo / f"{step}.caibx", target]
        return ["env", f"TARGET={target}", "sh", "-c", script, "sh", *cmd], target


class Desync(Casync):
    name, label = "desync", "desync 0.9.6 (64 KiB avg chunks, zstd)"

    def make(self):
        return [self.env.peers["desync"], "make", "-s", self.repo / "store"]

    def extract(self):
        return [self.env.peers["desync"], "extract", "-s", self.repo / "store"]


class Kopia(Tool):
    name, label = "kopia", "Kopia 0.21.1 (zstd)"

    def cli(self, *args) -> list[str]:
        w = self.repo.parent
        return [self.env.peers["kopia"], f"--config-file={w / (self.repo.name + '.kopia.config')}",
                f"--log-dir={w / (self.repo.name + '.kopia-logs')}", *args]

    def init(self):
        cache = self.repo.parent / (self.repo.name + ".kopia-cache")
        sh(self.cli("repository", "create", "filesystem", f"--path={self.repo}",
                    f"--cache-directory={cache}", "--no-persist-credentials"),
           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # Kopia stores data uncompressed by default; zstd is the setting a user would pick.
        sh(self.cli("policy", "set", "--global", "--compression=zstd"),
           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def commit(self, step):
        return self.cli("snapshot", "create", self.env.src.parent, f"--tags=step:{step}")

    def restore(self, step, out):
        snaps = json.loads(sh(self.cli("snapshot", "list", self.env.src.parent, "--json")))
        ids = [s["id"] for s in snaps if (s.get("tags") or {}).get("tag:step") == step]
        if len(ids) != 1:
            die(f"kopia: expected one snapshot tagged {step}, found {len(ids)}")
        script = '"$@" && find "$TARGET" -type f -exec sync {} +'
        cmd = self.cli("snapshot", "restore", ids[0], out, "--write-sparse-files")
        return ["env", f"TARGET={out}", "sh", "-c", script, "sh", *cmd], out / "disk.raw"


class Qcow2Chain(Tool):
    """External snapshot chain: each step is a qcow2 overlay on the step before it, holding
    exactly the 64 KiB clusters that differ from it, as a hypervisor's live snapshot would
    (it records the clusters the guest wrote). Built from the images with `qemu-img rebase`:
    an empty overlay over the new image is rebased, in safe mode, onto the previous step, so
    qemu-img copies in the clusters that differ. A hypervisor pays nothing at snapshot time;
    the commit time here is what qemu-img needs to build the same chain from full images.
    A restore flattens the chain to raw."""
    name, label = "qcow2-chain", "qcow2 external snapshot chain (qemu-img 7.2)"

    def init(self):
        self.repo.mkdir(parents=True)
        self.prev: str | None = None

    def cwd(self):
        return self.repo

    def commit(self, step):
        prev, self.prev = self.prev, f"{step}.qcow2"
        if prev is None:
            return ["qemu-img", "convert", "-O", "qcow2", self.env.src, self.prev]
        script = ('qemu-img create -q -f qcow2 -b "$1" -F raw "$3" && '
                  'qemu-img rebase -f qcow2 -b "$2" -F qcow2 "$3"')
        return ["sh", "-c", script, "sh", self.env.src, prev, self.prev]

    def restore(self, step, out):
        target = out / "disk.raw"
        script = 'qemu-img convert -O raw "$1" "$2" && sync "$2"'
        return ["sh", "-c", script, "sh", self.repo / f"{step}.qcow2", target], target


class Copy(Tool):
    """Not a tool: `cp --sparse=always` + fsync of the image itself, the restore yardstick."""
    name, label, peer = "cp", "cp --sparse=always + fsync (yardstick)", False

    def restore(self, step, out):
        target = out / "disk.raw"
        script = 'cp --sparse=always "$1" "$2" && sync "$2"'
        return ["sh", "-c", script, "sh", self.env.dataset / f"{step}.raw", target], target


TOOLS = {t.name: t for t in [Cairn, CairnS3, Restic, Borg, Borg64k, Casync, Desync,
                             Kopia, Qcow2Chain]}


# ---------------------------------------------------------------------------------------------
# The environment: binaries, dataset, scratch space


class Env:
    def __init__(self, args):
        self.args = args
        self.dataset = Path(args.dataset).resolve()
        bench_work = Path(os.environ.get("BENCH_WORK", ROOT / ".data"))
        bench_work.mkdir(parents=True, exist_ok=True)
        self.work = Path(tempfile.mkdtemp(prefix="bench-compare.", dir=bench_work))
        fs = sh(["findmnt", "-n", "-o", "FSTYPE", "-T", str(self.work)]).strip()
        if fs == "tmpfs":
            die(f"{self.work} is on tmpfs; set BENCH_WORK to a directory on disk")
        self.src = self.work / "src" / "disk.raw"
        self.src.parent.mkdir()
        # Copies, so that a rebuild during the run cannot change the binary under measurement.
        (self.work / "bin").mkdir()
        self.cairn = str(shutil.copy2(os.environ["CAIRN_BIN"], self.work / "bin" / "cairn"))
        self.limits_bin = str(shutil.copy2(os.environ["CAIRN_LIMITS"],
                                           self.work / "bin" / "cairn-limits"))
        self.peers = dict(line.split("\t") for line in
                          os.environ["CAIRN_PEERS"].strip().splitlines())
        self.timer = Timer(self.work)

    def use_image(self, image: str) -> None:
        """Points SRC/disk.raw at a dataset image (a hard link: no copy, same page cache)."""
        if self.src.exists():
            self.src.unlink()
        os.link(self.dataset / f"{image}.raw", self.src)

    def remove(self, prefix: str) -> None:
        """Removes everything in the scratch directory whose name starts with `prefix` (a
        repository and the files its tool keeps beside it)."""
        for q in self.work.glob(prefix + "*"):
            shutil.rmtree(q) if q.is_dir() else q.unlink()

    def fresh(self, name: str) -> Path:
        self.remove(name)
        return self.work / name

    def cleanup(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


def steps_present(env: Env) -> list[str]:
    steps = [s for s in SERIES if (env.dataset / f"{s}.raw").exists()]
    if len(steps) < 2:
        die(f"{env.dataset} holds no su-0, su-1, … series")
    return steps


def run_series(env: Env, tools: list[str], runs: int, out: dict) -> None:
    steps = steps_present(env)
    rows = out["series"] = []
    restore_rows = out["restore"] = []
    for run in range(runs + 1):
        for name in tools + ["cp"]:
            log(f"series: {name}, run {run} of {runs} (0 = warm-up)")
            if name == "cp":
                tool = Copy(env, env.work / "none")
            else:
                tool = TOOLS[name](env, env.fresh(f"repo-{name}-{run}"))
                tool.init()
                rows += commit_steps(env, tool, steps, tool=name, run=run)
                if isinstance(tool, Cairn) and run == 0:
                    out.setdefault("cairn_stats", {})[name] = tool.stats()
            for which, step in (("newest", steps[-1]), ("oldest", steps[0])):
                dest = env.fresh("restore-out")
                dest.mkdir()
                cmd, target = tool.restore(step, dest)
                t = env.timer.run(cmd, cwd=tool.cwd())
                t.pop("stdout")
                if run == 0 and not same_file(target, env.dataset / f"{step}.raw"):
                    die(f"{name} restored {step} to {target}, and it differs from the image")
                restore_rows.append(dict(tool=name, run=run, which=which, step=step, **t))
                shutil.rmtree(dest)
            if name != "cp":
                env.remove(f"repo-{name}-{run}")


def commit_steps(env: Env, repo: Tool, steps: list[str], **tags) -> list[dict]:
    """Commits each image in turn (durably, timed); one row per step with the bytes added."""
    rows = []
    for step in steps:
        env.use_image(step)
        before = repo.size()
        t = env.timer.run(repo.commit(step), cwd=repo.cwd(), durable=env.work)
        t.pop("stdout")
        after = repo.size()
        rows.append(dict(tags, step=step, added=after - before, total=after, **t))
    return rows


def run_fleet(env: Env, tools: list[str], out: dict) -> None:
    rows = out["fleet"] = []
    for name in tools:
        log(f"fleet: {name}")
        tool = TOOLS[name](env, env.fresh(f"fleet-{name}"))
        tool.init()
        rows += commit_steps(env, tool, FLEET, tool=name)
        env.remove(f"fleet-{name}")


# ---------------------------------------------------------------------------------------------
# Scaling (cairn alone)


def make_scaled_image(path: Path, size: int, source: Path, seed: int) -> int:
    """A sparse image of `size` bytes with one MiB of data in every 16 MiB.

    The data is real: the allocated bytes of a dataset image, reused cyclically, with 8 bytes
    of every 4 KiB block overwritten by a per-copy counter so that no two copies deduplicate
    (the image is 1/16 data, as big as it is, and compresses like a real disk). Returns the
    data bytes written."""
    src = source.read_bytes()
    # The non-zero MiBs of the source, as the pool to draw from.
    pool = [src[i:i + MIB] for i in range(0, len(src), MIB) if src[i:i + MIB].strip(b"\0")]
    rng = random.Random(seed)
    written = 0
    with open(path, "wb") as f:
        f.truncate(size)
        for n, off in enumerate(range(0, size, 16 * MIB)):
            block = bytearray(pool[n % len(pool)])
            tag = (n * 2654435761 + seed).to_bytes(8, "little")
            for b in range(0, MIB, 4096):
                block[b:b + 8] = tag
            f.seek(off + rng.randrange(0, 15) * MIB)
            f.write(block)
            written += MIB
        f.flush()
        os.fsync(f.fileno())
    return written


def data_extents(path: Path) -> list:
    """The (start, end) byte ranges the file holds data in (SEEK_DATA / SEEK_HOLE)."""
    out = []
    with open(path, "rb") as f:
        fd, end, pos = f.fileno(), os.fstat(f.fileno()).st_size, 0
        while pos < end:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:  # ENXIO: no data after pos
                break
            pos = os.lseek(fd, start, os.SEEK_HOLE)
            out.append((start, pos))
    return out


def scribble(path: Path, rng: random.Random, count: int, size: int = 4096) -> None:
    """Overwrites `count` random 4 KiB-aligned blocks *inside the file's data* with random
    bytes: a guest rewriting its own files. (Writes into holes would add segments, so the
    image itself would grow with every version — until 2026-11-26 they did, and the
    versions axis then measured a 1 GiB image filling up: 64 data segments at the start,
    about 1,000 after 1,000 versions.)"""
    blocks = [(a // size, b // size) for a, b in data_extents(path) if b // size > a // size]
    weights = [b - a for a, b in blocks]
    with open(path, "r+b") as f:
        for _ in range(count):
            first, end = rng.choices(blocks, weights)[0]
            f.seek(rng.randrange(first, end) * size)
            f.write(rng.randbytes(size))


def run_scaling(env: Env, runs: int, out: dict) -> None:
    sizes = [1, 4, 16, 64] if not env.args.quick else [1, 4]
    counts = [10, 100, 1000] if not env.args.quick else [10, 30]
    source = env.dataset / f"{steps_present(env)[-1]}.raw"
    rows = out["scaling_size"] = []
    out["scribble_into"] = "data"  # where the guest writes land (the report says so)
    for gib in sizes:
        img = env.work / f"scale-{gib}g.raw"
        data = make_scaled_image(img, gib * GIB, source, seed=gib)
        log(f"scaling: {gib} GiB image with {data / MIB:.0f} MiB of data")
        for run in range(runs + 1):
            repo = env.fresh("scale-repo")
            c = Cairn(env, repo)
            c.init()
            t1 = env.timer.run(c.cli("--json", "commit", "vm", img))
            s1 = json.loads(t1.pop("stdout"))
            # A re-commit after a small guest write: 1 MiB of 4 KiB writes per GiB, into data.
            scribble(img, random.Random(run), 256 * gib)
            t2 = env.timer.run(c.cli("--json", "commit", "vm", img))
            t2.pop("stdout")
            dest = env.fresh("restore-out")
            dest.mkdir()
            t3 = env.timer.run(c.cli("restore", "vm", dest / "disk.raw", "--force"))
            t3.pop("stdout")
            if run == 0 and not same_file(dest / "disk.raw", img):
                die(f"cairn restored the {gib} GiB image wrong")
            shutil.rmtree(dest)
            st = c.stats()
            # What every other reader costs at this size: a full verify (every pack read),
            # then a GC after the first version is removed (fast deletion).
            t4 = env.timer.run(c.cli("verify"))
            t4.pop("stdout")
            sh(c.cli("rm", "--no-gc", "vm@1"), stdout=subprocess.DEVNULL)
            t5 = env.timer.run(c.cli("gc"))
            t5.pop("stdout")
            rows.append(dict(gib=gib, run=run, data=data, first=t1, second=t2, restore=t3,
                             stored=s1["stored_bytes"], stats=st, verify=t4, gc=t5))
            shutil.rmtree(repo)
        img.unlink()

    rows = out["scaling_versions"] = []
    img = env.work / "versions.raw"
    make_scaled_image(img, GIB, source, seed=7)
    repo = env.fresh("versions-repo")
    c = Cairn(env, repo)
    c.init()
    rng = random.Random(1)
    log(f"scaling: {counts[-1]} versions of a 1 GiB image (64 MiB data), 16 KiB written each")
    for n in range(1, counts[-1] + 1):
        scribble(img, rng, 4)
        t = env.timer.run(c.cli("--json", "commit", "vm", img))
        rep = json.loads(t.pop("stdout"))
        row = dict(n=n, commit=t, added=rep["stored_bytes"])
        if n in counts:
            row["stats"] = c.stats()
            row["log"] = env.timer.run(c.cli("--json", "log", "vm"))
            row["log"].pop("stdout")
            dest = env.fresh("restore-out")
            dest.mkdir()
            row["restore_oldest"] = env.timer.run(c.cli("restore", "vm@1", dest / "disk.raw", "--force"))
            row["restore_oldest"].pop("stdout")
            shutil.rmtree(dest)
            row["verify"] = env.timer.run(c.cli("verify"))
            row["verify"].pop("stdout")
            # Fast deletion of one version (the one before the head) among n: its cost
            # should follow what is deleted, not how many versions live.
            sh(c.cli("rm", "--no-gc", f"vm@{n - 1}"), stdout=subprocess.DEVNULL)
            row["gc"] = env.timer.run(c.cli("gc"))
            row["gc"].pop("stdout")
            log(f"scaling: {n} versions, repository {row['stats']['stored_bytes'] / MIB:.1f} MiB")
        rows.append(row)
    shutil.rmtree(repo)
    img.unlink()


# ---------------------------------------------------------------------------------------------


def machine() -> dict:
    cpu = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    mem = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
    return dict(cpu=cpu, cores=os.cpu_count(), mem_gib=round(mem / 1048576),
                kernel=platform.release(), load_before=os.getloadavg())


def versions(env: Env) -> dict:
    def first_line(cmd):
        p = subprocess.run(cmd, text=True, capture_output=True)
        return (p.stdout or p.stderr).strip().splitlines()[0] if p.returncode == 0 else "?"
    return {
        "cairn": sh(["git", "-C", str(ROOT), "describe", "--always", "--dirty"]).strip(),
        "restic": first_line(["restic", "version"]),
        "borg": first_line(["borg", "--version"]),
        "casync": first_line(["casync", "--version"]),
        "desync": Path(env.peers["desync"] + ".version").read_text().strip(),
        "kopia": first_line([env.peers["kopia"], "--version"]),
        "qemu-img": first_line(["qemu-img", "--version"]),
    }


def setup(args) -> None:
    """Everything a fresh machine needs; then runs the parts (this script with --inner) and
    the report."""
    lib = f"source {ROOT}/scripts/lib.sh"
    sh(["bash", "-c", f"{lib}; ensure_apt_packages time python3-matplotlib curl"])
    peers = sh([str(ROOT / "scripts" / "peers.sh"), "install"])
    cairn = sh(["bash", "-c", f"{lib}; cairn_bin"]).strip()
    log("cargo build --release -p cairn-bench")
    sh(["cargo", "build", "--release", "-q", "-p", "cairn-bench"], cwd=ROOT,
       stdout=sys.stderr)
    target = os.environ.get("CARGO_TARGET_DIR", str(ROOT / "target"))
    limits = str(Path(target if os.path.isabs(target) else ROOT / target)
                 / "release" / "cairn-limits")
    dataset = args.dataset or sh(["bash", "-c", f"{lib}; dataset_dir "
                                  f"{'small' if args.quick else 'full'}"]).strip()
    env = dict(os.environ, CAIRN_BIN=cairn, CAIRN_LIMITS=limits, CAIRN_PEERS=peers,
               CAIRN_KEEP_CACHE="1", RESTIC_PASSWORD="cairn-bench", KOPIA_PASSWORD="cairn-bench",
               KOPIA_CHECK_FOR_UPDATES="false",
               BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK="yes",
               BORG_RELOCATED_REPO_ACCESS_IS_OK="yes",
               CAIRN_COMPARE_COMMAND=" ".join(["bench/compare.py", *sys.argv[1:]]))
    out = args.out or str(RESULTS / f"compare-{dt.date.today().isoformat()}"
                               f"{'-quick' if args.quick else ''}.json")
    base = [sys.executable, __file__, "--inner", "--dataset", dataset, "--out", out,
            "--runs", str(args.runs), "--tools", args.tools] + (["--quick"] if args.quick else [])
    parts = args.parts.split(",")
    # The series and the fleet run under a throw-away MinIO (for cairn's S3 row). Scaling is
    # cairn on local disk alone and runs after MinIO is gone: run in the same process right
    # after the series, with the server holding the gigabytes the series left in it, every
    # small commit took ~0.3 s more system time than it does on a quiet machine.
    steps = []
    with_s3 = [p for p in parts if p in ("series", "fleet")]
    if with_s3:
        cmd = base + ["--parts", ",".join(with_s3)]
        if "cairn-s3" in args.tools.split(","):
            cmd = [str(ROOT / "scripts" / "minio.sh"), "run", *cmd]
        steps.append(cmd)
    if "scaling" in parts:
        steps.append(base + ["--parts", "scaling", "--merge"] if with_s3 else
                     base + ["--parts", "scaling"])
    for cmd in steps:
        rc = subprocess.run(cmd, env=env).returncode
        if rc != 0:
            sys.exit(rc)
    report(Path(out))
    sys.exit(0)


def report(path: Path) -> None:
    # Debian's python3-matplotlib belongs to the system interpreter.
    python = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    rc = subprocess.run([python, str(ROOT / "bench" / "compare_report.py"), str(path)]).returncode
    if rc != 0:
        die(f"bench/compare_report.py {path} failed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=int(os.environ.get("RUNS", 3)),
                    help="counted runs after one warm-up (default 3)")
    ap.add_argument("--parts", default="series,fleet,scaling")
    ap.add_argument("--tools", default=",".join(TOOLS))
    ap.add_argument("--quick", action="store_true",
                    help="small dataset, 3 steps, small scaling points: checks the driver")
    ap.add_argument("--dataset", help="dataset directory (default: .data/full, built if missing)")
    ap.add_argument("--out", help="results JSON (default: bench/results/compare-DATE.json)")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--merge", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if not args.inner:
        setup(args)
    env = Env(args)
    parts = args.parts.split(",")
    tools = args.tools.split(",")
    for t in tools:
        if t not in TOOLS:
            die(f"unknown tool {t!r}; known: {', '.join(TOOLS)}")
    started = time.time()
    path = Path(args.out) if args.out else \
        RESULTS / f"compare-{dt.date.today().isoformat()}{'-quick' if args.quick else ''}.json"
    if args.merge and path.exists():  # a later part of the same command
        out = json.loads(path.read_text())
        started -= out.get("elapsed_s", 0)
    else:
        out = dict(date=dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                   command=os.environ.get("CAIRN_COMPARE_COMMAND", "bench/compare.py"),
                   machine=machine(), versions=versions(env), runs=args.runs,
                   labels={n: TOOLS[n].label for n in tools} | {"cp": Copy.label})
    RESULTS.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every part: a failure later keeps what was measured
        out["elapsed_s"] = round(time.time() - started)
        path.write_text(json.dumps(out, indent=1) + "\n")

    try:
        if "limits" not in out:
            images = sorted({*SERIES, *FLEET} & {p.stem for p in env.dataset.glob("*.raw")})
            log(f"machine limits (cairn-limits) on {' '.join(images)}")
            lim = sh([env.limits_bin, *[str(env.dataset / f"{i}.raw") for i in images]])
            out["limits"] = {Path(d["file"]).stem: d for d in map(json.loads, lim.splitlines())}
        if "series" in parts:
            run_series(env, tools, args.runs, out)
            save()
        if "fleet" in parts and not args.quick:
            run_fleet(env, tools, out)
            save()
        if "scaling" in parts:
            run_scaling(env, args.runs, out)
            save()
    finally:
        env.cleanup()
    log(f"measurements in {path}")


if __name__ == "__main__":
    main()

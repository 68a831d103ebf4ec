#!/usr/bin/env python3
"""Whole-VM backups of a running QEMU VM: `cairn vm backup` against restic (issue 55, item 6).

The VM: qemu-system-x86_64 with `-machine none` (QEMU's block layer, QMP, jobs and bitmaps,
no guest OS) and two qcow2 disks, `-drive if=none`: `disk0` made from the dataset's su-0.raw
(`qemu-img convert -O qcow2`; a 1 GiB Debian disk image) and `disk1`, a 256 MiB data disk
holding 64 MiB of random data in 1 MiB pieces. A QMP socket for cairn, a second monitor for
the "guest", which writes through QEMU's own block layer (HMP `qemu-io`). No guest agent: the
backups are crash-consistent, and the guest's pause is the QMP transaction alone (cairn's
`paused_s`, which is its `point_in_time_s`).

Each run, in a fresh repository:
1. first backup (full), `cairn --json vm backup vm --qmp SOCK`: wall time from start to the
   process's exit (the VM version committed), bytes read, stored bytes, the pause;
2. the guest changes its disks: into disk0 the 64 KiB blocks where su-1.raw differs from
   su-0.raw, with su-1's bytes (`write -s FILE OFF LEN`, contiguous blocks in writes of at
   most 4 MiB; disk0 is then checked to equal su-1.raw), and 1% of disk1 in random 4 KiB
   writes of random data;
3. incremental backup: wall time, bytes read (both disks) against the bytes the guest wrote,
   the dirty bytes of QEMU's bitmaps, the pause.

The peer, restic: the two disk states as raw files (`qemu-img convert -U -O raw` of the live
qcow2s after an HMP `qemu-io DISK "flush"`; not timed) backed up with `restic backup --json`,
the second state at the same paths (on the first as its parent snapshot): wall times,
`total_bytes_processed`, `data_added` (before compression) and what the repository grew by.
Two passes, each into a fresh repository: the raw files as a backup meets them (their data in
the page cache, their holes never read: restic reads them whole, and the kernel fills the
holes' pages as it goes), then with every page cached, holes too. cairn's times are given as
a ratio of restic's (the issue's target: an incremental backup in 0.1× restic's time).

Both tools read warm data (QEMU's qcow2 files, restic's raw files, just written), with no
dirty page left to write back (`sync` before each timed command). The machine is shared with
compiles and tests: before every timed command the script waits until, for 20 s, no `rustc`
or `cargo` process ran (by name, as `pgrep -x`) and no other process (neither the script's
nor the kernel's) used over 10% of a core; it watches during the command, and takes the run
again (up to 8 times) when a compiler appeared or others used more than max(0.1 s, 10% of
the command's time) of CPU. The binary is copied first: a rebuild meanwhile does not mix
builds. Medians of RUNS runs (default 3).

    bench/vm_backup.py [--bin target/ci/cairn] [--dataset DIR] [--runs 3] [--out FILE]

The dataset: --dataset, else $CAIRN_DATASET, else .data/small, else the small dataset a
build on this host cached (~/.cache/cairn/datasets/small-*). Needs qemu-system-x86 and
qemu-utils; installs restic (scripts/lib.sh's ensure_apt_packages, as root) when missing.
Prints a Markdown table; writes bench/results/vm-backup-<date>.json (bench/report.py's
`vm-backup` renderer reads it).
"""

import argparse
import datetime
import glob
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from checks import Cairn, sh  # noqa: E402
from qemu_helpers import Qmp, need_tools, stop, wait_for  # noqa: E402

MIB = 1 << 20
BLOCK = 64 << 10  # the unit su-0 and su-1 are compared in
PIECE = 4 << 20  # the largest guest write into disk0
DATA_DISK = 256 << 20
DATA_RANDOM = 64  # MiB of random data on disk1 before the first backup
SMALL = 4096  # the guest's random writes on disk1
SMALL_SHARE = 0.01
DISKS = ("disk0", "disk1")
QUIET_S = 20
COMPILERS = ("rustc", "cargo")
ATTEMPTS = 8


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] vm_backup: {msg}", file=sys.stderr, flush=True)


# --- a machine shared with compiles ---------------------------------------------------------

HZ = os.sysconf("SC_CLK_TCK")
BUSY = 0.10  # another process busier than this share of a core: the machine is not quiet


def others():
    """{pid: (name, CPU ticks)} of every process that is neither this script's (it or its
    descendants) nor a kernel thread."""
    procs = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        procs[int(pid)] = (name, int(fields[1]), int(fields[11]) + int(fields[12]))
    mine, kernel = {os.getpid()}, {2}
    grew = True
    while grew:
        grew = False
        for pid, (_, ppid, _) in procs.items():
            for group in (mine, kernel):
                if ppid in group and pid not in group:
                    group.add(pid)
                    grew = True
    return {pid: (name, ticks) for pid, (name, _, ticks) in procs.items()
            if pid not in mine and pid not in kernel}


class Sampler:
    """What other processes did since the last sample: a compiler seen (`rustc`, `cargo` by
    name, as `pgrep -x`), and the CPU seconds they used (a new process: all of its own)."""

    def __init__(self):
        self.last = others()

    def sample(self):
        now = others()
        busy = sum(t - self.last.get(pid, (None, 0))[1] for pid, (_, t) in now.items()) / HZ
        names = sorted({n for n, _ in now.values() if n in COMPILERS})
        top = max(now.items(), key=lambda kv: kv[1][1] - self.last.get(kv[0], (None, 0))[1],
                  default=(None, ("", 0)))[1][0]
        self.last = now
        return names, max(busy, 0.0), top


def wait_quiet():
    """Waits until, for QUIET_S seconds, no compiler ran and no other process used more than
    BUSY of a core; returns the seconds waited."""
    started = time.monotonic()
    quiet_since, told = started, started
    sampler = Sampler()
    while time.monotonic() - quiet_since < QUIET_S:
        time.sleep(0.5)
        names, busy, top = sampler.sample()
        if names or busy > BUSY * 0.5:
            quiet_since = time.monotonic()
            if quiet_since - told > 60:
                why = ", ".join(names) if names else f"{top} ({busy * 200:.0f}% of a core)"
                log(f"waiting for a quiet machine: {why} ({quiet_since - started:.0f} s so far)")
                told = quiet_since
    return time.monotonic() - started


class Watch:
    """Timed commands: each waits for a quiet machine first, and notes what ran meanwhile."""

    def __init__(self):
        self.waited, self.disturbed = [], []

    def timed(self, fn):
        """(seconds, fn's result), after a quiet wait, with a watch on other processes
        running. Dirty pages (the raw states just converted, the last repository) are written
        first: their writeback, 30 s after the writes, would otherwise fall into the timed
        command."""
        os.sync()
        self.waited.append(round(wait_quiet(), 1))
        os.sync()
        stop_ev = threading.Event()
        sampler = Sampler()
        seen, cpu = set(), [0.0]

        def watch():
            while not stop_ev.wait(0.25):
                names, busy, _ = sampler.sample()
                seen.update(names)
                cpu[0] += busy

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        started = time.monotonic()
        try:
            out = fn()
        finally:
            seconds = time.monotonic() - started
            stop_ev.set()
            t.join()
        names, busy, _ = sampler.sample()
        seen.update(names)
        cpu[0] += busy
        if seen or cpu[0] > max(0.1, BUSY * seconds):
            self.disturbed.append(f"{', '.join(sorted(seen)) or 'other processes'}: "
                                  f"{cpu[0]:.2f} CPU s in {seconds:.2f} s")
        return seconds, out


def attempts(what, part):
    """Runs part(watch) until nothing else ran during its timed commands (ATTEMPTS at most).
    Returns (part's result, seconds waited, why runs were discarded, disturbed?)."""
    waited, discarded = [], []
    for _ in range(ATTEMPTS):
        watch = Watch()
        out = part(watch)
        waited += watch.waited
        if not watch.disturbed:
            return out, waited, discarded, False
        discarded.append(f"{what}: " + "; ".join(watch.disturbed))
        log(f"{what}: disturbed ({'; '.join(watch.disturbed)}); taken again")
    return out, waited, discarded, True


# --- the dataset, the disks and the guest's writes ----------------------------------------


def find_dataset(given):
    tried = []
    for d in [given, os.environ.get("CAIRN_DATASET"), os.path.join(ROOT, ".data", "small")]:
        if d:
            tried.append(d)
            if all(os.path.exists(os.path.join(d, f"su-{i}.raw")) for i in (0, 1)):
                return os.path.abspath(d)
    # scripts/lib.sh's _dataset_cache: keyed by the builder's text; then any complete one.
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")),
                         "cairn", "datasets")
    with open(os.path.join(ROOT, "scripts", "build-dataset.sh"), "rb") as f:
        key = hashlib.sha256(f.read()).hexdigest()[:16]
    cached = [os.path.join(cache, f"small-{key}")]
    cached += sorted(glob.glob(os.path.join(cache, "small-*")))
    for d in cached:
        tried.append(d)
        if all(os.path.exists(os.path.join(d, f)) for f in (".complete", "su-0.raw", "su-1.raw")):
            return d
    sys.exit(f"vm_backup: no dataset with su-0.raw and su-1.raw (tried {', '.join(tried)}); "
             "run scripts/build-dataset.sh .data/small --small, or give --dataset")


def allocated(path):
    return os.stat(path).st_blocks * 512


def tree_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def disk0_changes(su0, su1, into):
    """The su-1 bytes of every BLOCK where su-1 differs from su-0, as files of at most PIECE
    bytes (contiguous blocks coalesced): [(offset, length, file)]."""
    runs = []
    with open(su0, "rb") as a, open(su1, "rb") as b:
        off = 0
        while True:
            x, y = a.read(BLOCK), b.read(BLOCK)
            if not x and not y:
                break
            if x != y:
                if runs and runs[-1][0] + len(runs[-1][1]) == off and len(runs[-1][1]) < PIECE:
                    runs[-1][1].extend(y)
                else:
                    runs.append((off, bytearray(y)))
            off += BLOCK
    out = []
    for k, (off, data) in enumerate(runs):
        path = os.path.join(into, f"d0-{k}.bin")
        with open(path, "wb") as f:
            f.write(data)
        out.append((off, len(data), path))
    return out


def disk1_changes(rng, into):
    """SMALL_SHARE of disk1 in SMALL random writes of random data, at distinct offsets."""
    n = int(DATA_DISK * SMALL_SHARE) // SMALL
    out = []
    for k, blk in enumerate(sorted(rng.sample(range(DATA_DISK // SMALL), n))):
        path = os.path.join(into, f"d1-{k}.bin")
        with open(path, "wb") as f:
            f.write(rng.randbytes(SMALL))
        out.append((blk * SMALL, SMALL, path))
    return out


def data_disk(path, rng, work):
    """disk1 before the first backup: DATA_RANDOM MiB of random data in 1 MiB pieces."""
    raw = os.path.join(work, "disk1-base.raw")
    with open(raw, "wb") as f:
        f.truncate(DATA_DISK)
        for piece in sorted(rng.sample(range(DATA_DISK // MIB), DATA_RANDOM)):
            f.seek(piece * MIB)
            f.write(rng.randbytes(MIB))
    sh("qemu-img", "convert", "-O", "qcow2", raw, path)
    os.unlink(raw)


class Vm:
    """QEMU, `-machine none`, with the disks work/disk0.qcow2 and work/disk1.qcow2: a QMP
    socket for cairn and a second monitor for the guest's writes."""

    def __init__(self, work):
        self.qmp_sock = os.path.join(work, "qmp.sock")
        self.io_sock = os.path.join(work, "io.sock")
        args = ["qemu-system-x86_64", "-machine", "none", "-nodefaults", "-display", "none",
                "-qmp", f"unix:{self.qmp_sock},server=on,wait=off",
                "-chardev", f"socket,id=io,path={self.io_sock},server=on,wait=off",
                "-mon", "chardev=io,mode=control"]
        for d in DISKS:
            args += ["-drive", f"if=none,id={d},format=qcow2,file={os.path.join(work, d)}.qcow2"]
        self.io = None
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            wait_for(self.qmp_sock, self.proc, "qemu-system-x86_64")
            wait_for(self.io_sock, self.proc, "qemu-system-x86_64")
            self.io = Qmp(self.io_sock)
        except Exception:
            self.stop()
            raise

    def hmp(self, line):
        out = self.io.cmd("human-monitor-command", **{"command-line": line})
        if out.strip() and "wrote" not in out:
            raise RuntimeError(f"HMP {line}: {out.strip()}")
        return out

    def write(self, disk, changes):
        """The guest writes each (offset, length, file): the file's bytes at offset."""
        for off, length, path in changes:
            self.hmp(f'qemu-io {disk} "write -s {path} {off} {length}"')
        return sum(length for _, length, _ in changes)

    def flush(self):
        for d in DISKS:
            self.hmp(f'qemu-io {d} "flush"')

    def stop(self):
        if self.io is not None:
            self.io.close()
        stop(self.proc)


# --- one run of each tool ------------------------------------------------------------------


def cairn_backup(cairn, vm, scratch, message):
    p = cairn.run("--json", "vm", "backup", "vm", "--qmp", vm.qmp_sock, "--scratch-dir", scratch,
                  "-m", message)
    return json.loads(p.stdout)


def backup_figures(seconds, out, repo):
    disks = out["disks"]
    return {
        "wall_s": round(seconds, 4),
        "cairn_duration_s": round(out["duration_s"], 4),
        "point_in_time_s": round(out["point_in_time_s"], 6),
        "paused_s": round(out["paused_s"], 6),
        "freeze": out["freeze"],
        "read_bytes": sum(d["read_bytes"] for d in disks),
        "dirty_bytes": sum(d["dirty_bytes"] for d in disks),
        "stored_bytes": sum(d["stored_bytes"] for d in disks),
        "new_chunk_bytes": sum(d["new_chunk_bytes"] for d in disks),
        "repo_bytes": tree_bytes(repo),
        "disks": [{k: d[k] for k in ("disk", "incremental", "full_because", "dirty_bytes",
                                     "read_bytes", "logical_bytes", "new_chunk_bytes",
                                     "stored_bytes", "duration_s")} for d in disks],
    }


def prime_data(path):
    """A file's data in the page cache, none of its holes: as after its writes, whoever read
    it before."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        size, pos = os.fstat(fd).st_size, 0
        while pos < size:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            for off in range(start, end, 1 << 22):
                os.pread(fd, min(1 << 22, end - off), off)
            pos = end
    finally:
        os.close(fd)


def prime_all(path):
    """Every page of a file in the page cache, its holes' too."""
    with open(path, "rb") as f:
        while f.read(1 << 22):
            pass


def convert_state(work, into):
    """The live disks as raw files (the VM flushed first)."""
    os.makedirs(into, exist_ok=True)
    for d in DISKS:
        sh("qemu-img", "convert", "-U", "-f", "qcow2", "-O", "raw",
           os.path.join(work, f"{d}.qcow2"), os.path.join(into, f"{d}.raw"))


def cairn_run(run, binary, base, d0, d1, su1, work):
    """One run of cairn: the VM, a full backup, the guest's writes, an incremental backup.
    Leaves the raw states in work/state1 and work/state2 for restic."""

    def part(watch):
        for d in ("repo", "state", "scratch", "state1", "state2"):
            shutil.rmtree(os.path.join(work, d), ignore_errors=True)
        for d in DISKS:
            shutil.copyfile(base[d], os.path.join(work, f"{d}.qcow2"))
        scratch = os.path.join(work, "scratch")
        os.makedirs(scratch)
        repo = os.path.join(work, "repo")
        cairn = Cairn(binary, repo, state=os.path.join(work, "state"), timeout=1800)
        cairn.run("init")
        vm = Vm(work)
        try:
            t, out = watch.timed(lambda: cairn_backup(cairn, vm, scratch, "first"))
            if out["seq"] != 1 or any(d["incremental"] for d in out["disks"]):
                raise RuntimeError(f"the first backup was not full: {out}")
            first = backup_figures(t, out, repo)
            vm.flush()
            convert_state(work, os.path.join(work, "state1"))
            started = time.monotonic()
            wrote = {"disk0": vm.write("disk0", d0), "disk1": vm.write("disk1", d1)}
            guest_s = time.monotonic() - started
            vm.flush()
            convert_state(work, os.path.join(work, "state2"))
            cmp = sh("qemu-img", "compare", "-f", "raw", "-F", "raw",
                     os.path.join(work, "state2", "disk0.raw"), su1, check=False)
            if cmp.returncode != 0:
                raise RuntimeError(f"disk0 after the guest's writes is not su-1: {cmp.stdout}")
            t, out = watch.timed(lambda: cairn_backup(cairn, vm, scratch, "second"))
            if not all(d["incremental"] for d in out["disks"]):
                raise RuntimeError(f"the second backup was not incremental: {out}")
            incr = backup_figures(t, out, repo)
        finally:
            vm.stop()
        cairn.run("verify")
        return {"first": first, "incremental": incr, "guest_wrote": wrote,
                "guest_write_s": round(guest_s, 2)}

    return attempts(f"run {run} (cairn)", part)


def restic_run(run, work):
    """One run of restic: state1, then state2 at the same paths, into a fresh repository."""
    env = dict(os.environ, RESTIC_PASSWORD="bench", RESTIC_REPOSITORY=os.path.join(work, "restic"),
               RESTIC_CACHE_DIR=os.path.join(work, "restic-cache"))

    def backup(src):
        p = subprocess.run(["restic", "backup", "--json", "--host", "bench", src],
                           capture_output=True, text=True, env=env)
        if p.returncode != 0:
            raise RuntimeError(f"restic backup: {p.stderr.strip()}")
        return next(m for m in map(json.loads, p.stdout.splitlines())
                    if m.get("message_type") == "summary")

    def part(watch):
        src = os.path.join(work, "vm")
        out = {}
        # Two passes, each into a fresh repository: the files as a backup meets them (their
        # data in the page cache, their holes never read: restic reads them, and the kernel
        # fills their pages), then with every page cached (holes too).
        for suffix, warm in (("", prime_data), ("_cached", prime_all)):
            for d in ("restic", "restic-cache"):
                shutil.rmtree(os.path.join(work, d), ignore_errors=True)
            sh("restic", "init", env=env)
            before = tree_bytes(os.path.join(work, "restic"))
            for key, state in (("first", "state1"), ("second", "state2")):
                shutil.rmtree(src, ignore_errors=True)
                os.makedirs(src)
                for d in DISKS:
                    path = os.path.join(work, state, f"{d}.raw")
                    warm(path)
                    os.link(path, os.path.join(src, f"{d}.raw"))
                t, s = watch.timed(lambda: backup(src))
                after = tree_bytes(os.path.join(work, "restic"))
                # data_added: the new data before compression; stored_bytes: what the
                # repository grew by (packed, compressed: as cairn's stored_bytes).
                out[key + suffix] = {
                    "wall_s": round(t, 4), "total_duration_s": s["total_duration"],
                    "total_bytes_processed": s["total_bytes_processed"],
                    "data_added": s["data_added"], "stored_bytes": after - before,
                    "repo_bytes": after}
                before = after
        return out

    return attempts(f"run {run} (restic)", part)


# --- the report ----------------------------------------------------------------------------


def medians(runs):
    def med(f):
        return statistics.median(f(r) for r in runs)

    m = {}
    for key in ("first", "incremental"):
        m[f"cairn_{key}"] = {k: med(lambda r: r["cairn"][key][k]) for k in
                             ("wall_s", "cairn_duration_s", "point_in_time_s", "paused_s",
                              "read_bytes", "dirty_bytes", "stored_bytes", "repo_bytes")}
    for key in ("first", "second", "first_cached", "second_cached"):
        m[f"restic_{key}"] = {k: med(lambda r: r["restic"][key][k]) for k in
                              ("wall_s", "total_duration_s", "total_bytes_processed",
                               "data_added", "stored_bytes", "repo_bytes")}
    m["cairn_first"]["over_restic"] = med(
        lambda r: r["cairn"]["first"]["wall_s"] / r["restic"]["first"]["wall_s"])
    m["cairn_incremental"]["over_restic"] = med(
        lambda r: r["cairn"]["incremental"]["wall_s"] / r["restic"]["second"]["wall_s"])
    m["cairn_first"]["over_restic_cached"] = med(
        lambda r: r["cairn"]["first"]["wall_s"] / r["restic"]["first_cached"]["wall_s"])
    m["cairn_incremental"]["over_restic_cached"] = med(
        lambda r: r["cairn"]["incremental"]["wall_s"] / r["restic"]["second_cached"]["wall_s"])
    return m


def table(result):
    """The Markdown table (bench/report.py's `vm-backup` renderer makes the same rows)."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    import report  # noqa: E402

    header, rows = report.vm_backup_rows(result)
    return "\n".join(report.md_table(header, rows))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "ci", "cairn"))
    ap.add_argument("--dataset")
    ap.add_argument("--runs", type=int, default=int(os.environ.get("RUNS", "3")))
    ap.add_argument("--out", default=os.path.join(
        ROOT, "bench", "results", f"vm-backup-{datetime.date.today():%Y-%m-%d}.json"))
    args = ap.parse_args()
    need_tools("vm_backup", "qemu-system-x86_64", "qemu-img")
    if shutil.which("restic") is None:
        subprocess.run(["bash", "-c", f". {ROOT}/scripts/lib.sh && ensure_apt_packages restic"],
                       check=True)
    dataset = find_dataset(args.dataset)
    su0, su1 = (os.path.join(dataset, f"su-{i}.raw") for i in (0, 1))
    work = tempfile.mkdtemp(prefix="bench-vm-backup-")
    try:
        binary = os.path.join(work, "cairn")
        shutil.copy2(os.path.abspath(args.bin), binary)
        with open(binary, "rb") as f:
            bin_sha = hashlib.sha256(f.read()).hexdigest()
        git = sh("git", "-C", ROOT, "describe", "--always", "--dirty", check=False).stdout.strip()
        rng = random.Random(55)
        base = {"disk0": os.path.join(work, "base-disk0.qcow2"),
                "disk1": os.path.join(work, "base-disk1.qcow2")}
        sh("qemu-img", "convert", "-O", "qcow2", su0, base["disk0"])
        data_disk(base["disk1"], rng, work)
        changes = os.path.join(work, "changes")
        os.makedirs(changes)
        d0 = disk0_changes(su0, su1, changes)
        d1 = disk1_changes(rng, changes)
        log(f"dataset {dataset}; guest writes: disk0 {len(d0)} writes, "
            f"{sum(n for _, n, _ in d0) / MIB:.1f} MiB; disk1 {len(d1)} writes, "
            f"{sum(n for _, n, _ in d1) / MIB:.2f} MiB")
        runs, waited, discarded, contended = [], [], [], False
        for run in range(1, args.runs + 1):
            c, w1, n1, x1 = cairn_run(run, binary, base, d0, d1, su1, work)
            r, w2, n2, x2 = restic_run(run, work)
            runs.append({"cairn": c, "restic": r})
            waited += w1 + w2
            discarded += n1 + n2
            contended |= x1 or x2
            log(f"run {run}: cairn first {c['first']['wall_s']:.2f} s, incremental "
                f"{c['incremental']['wall_s']:.2f} s; restic {r['first']['wall_s']:.2f} s, "
                f"{r['second']['wall_s']:.2f} s")
        result = {
            "date": f"{datetime.date.today():%Y-%m-%d}",
            "command": " ".join(["bench/vm_backup.py"] + sys.argv[1:]),
            "cairn": {"bin": args.bin, "sha256": bin_sha, "git": git},
            "dataset": dataset,
            "machine": {"cores": os.cpu_count(),
                        "qemu": sh("qemu-system-x86_64", "--version").stdout.split("\n")[0],
                        "restic": sh("restic", "version").stdout.strip()},
            "quiet": {"rule": f"before every timed command (after a sync), {QUIET_S} s with "
                              "no rustc or cargo process (by name, as `pgrep -x`) and no "
                              "other process (neither this script's nor the kernel's) using "
                              f"over {BUSY:.0%} of a core; watched during it: a run in which "
                              "a compiler appeared or other processes used more than "
                              f"max(0.1 s, {BUSY:.0%} of the command's time) of CPU was "
                              f"discarded and taken again (at most {ATTEMPTS} times)",
                      "quiet_s": QUIET_S, "waited_s": waited, "discarded_runs": discarded,
                      "disturbed_run_kept": contended},
            "vm": {"machine": "qemu-system-x86_64 -machine none, two qcow2 -drive if=none",
                   "guest_agent": None,
                   "freeze": "no guest agent: crash-consistent; paused_s is the QMP "
                             "transaction alone (point_in_time_s)",
                   "disk0": {"from": os.path.basename(su0), "size": os.path.getsize(su0),
                             "allocated": allocated(su0)},
                   "disk1": {"size": DATA_DISK, "random_data": DATA_RANDOM * MIB},
                   "guest_writes": {
                       "disk0": {"what": f"the {BLOCK // 1024} KiB blocks where su-1.raw "
                                         "differs from su-0.raw, su-1's bytes",
                                 "writes": len(d0), "bytes": sum(n for _, n, _ in d0)},
                       "disk1": {"what": f"{SMALL_SHARE:.0%} of the disk in random "
                                         f"{SMALL // 1024} KiB writes of random data",
                                 "writes": len(d1), "bytes": sum(n for _, n, _ in d1)}}},
            "restic": "the same disk states as raw files (qemu-img convert after a flush, not "
                      "timed), the second at the same paths (restic's parent snapshot); two "
                      "passes, each into a fresh repository: first/second with the files' data "
                      "in the page cache and their holes never read, first_cached/"
                      "second_cached with every page cached",
            "runs": runs,
        }
        result["medians"] = medians(runs)
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")
        print(table(result))
        log(f"results written to {args.out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

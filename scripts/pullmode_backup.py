#!/usr/bin/env python3
"""The hypervisor workflow, tested: a libvirt/QEMU pull-mode incremental backup of a running
disk into cairn, end to end, against a real qemu-storage-daemon.

The "running VM": qemu-storage-daemon opens a qcow2 (node disk0) with a QMP monitor on a Unix
socket and serves it as a writable NBD export ("live"); a writer changes it through that
export with qemu-io, the way a guest would.

Every round takes a point-in-time view the way libvirt's pull mode (`virsh backup-begin`)
does on QEMU 7.2 — fleecing: a scratch qcow2 (node fleece0) whose backing is disk0 and a
`blockdev-backup sync=none` job from disk0 into it, so a guest write first copies the old
data into the scratch image. The job starts in one QMP `transaction` with the bitmap
operations, so the point in time and the bitmap boundary are the same instant:

- round 0: the transaction adds the persistent dirty bitmap b0; the fleecing node is exported
  read-only ("backup") and `cairn commit vm/disk0 nbd+unix:///backup?...` stores it in full;
- round r >= 1: the writer changes blocks; the transaction adds b<r> and disables b<r-1>; the
  export carries bitmap b<r-1>, and `cairn commit ... --dirty-bitmap b<r-1>` reads only what
  the bitmap marks;
- while the commit (and a copy of the view with nbdcopy) runs, the writer keeps writing to
  the live disk, half of it over the very blocks the commit reads (the commits are
  rate-limited so that they last about a second);
- then the export, the job and the fleecing node are torn down and b<r-1> is removed.

Checks per round: the point-in-time export holds exactly what the disk held when the
transaction ran (read from the live export with the writer paused, just before); every
version committed so far restores byte for byte to its round's content; an incremental
commit's --json says it is incremental on the bitmap and read about the bytes of the 64 KiB
blocks written since the previous round (not the disk); writes landed during the commit.
At the end: verify is clean and only the newest bitmap is left on the disk. The QMP commands
of backup 1 (the NBD server started over QMP, then the round) are exactly the recipe in
docs/PULL-MODE.md, read from there.

(Also possible on QEMU 7.2: a copy-before-write filter + snapshot-access node. It has to be
inserted above the node the guest writes to — qom-set of a device's drive, or blockdev-reopen
of a pass-through node here — and neither can be an action of a transaction, so the bitmap
rotation could not be atomic with the point in time. blockdev-backup can.)

    scripts/pullmode_backup.py [--bin target/release/cairn] [--rounds 4]

Needs qemu-system-common (qemu-storage-daemon), qemu-utils (qemu-img, qemu-io) and libnbd-bin
(nbdcopy); installs nothing. Prints "pullmode_backup: N passed, 0 failed"; exits non-zero on
any failure.
"""

import argparse
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Cairn, Checks, sha  # noqa: E402
from checks import sh as _sh  # noqa: E402


def sh(*cmd, **kw):
    """checks.sh with a time limit: no tool may hang the script."""
    kw.setdefault("timeout", 120)
    return _sh(*cmd, **kw)
from qemu_helpers import StorageDaemon, need_tools  # noqa: E402

CHECKS = Checks()
ok = CHECKS.ok

DISK_SIZE = 128 << 20
GRANULARITY = 64 << 10  # of the dirty bitmaps
IMAGE = "vm/disk0"
# The commits read at most this fast (MiB/s: the full one, the incremental ones), so that the
# writer's writes land while they read.
RATE_LIMIT = ("16", "4")


class Writer:
    """The guest: writes random patterns at random places through the live NBD export with
    qemu-io. `batch()` writes once; `start()`/`stop()` keep writing in a thread. Every write
    is recorded as (offset, length, finished-at)."""

    def __init__(self, url, rng):
        self.url, self.rng = url, rng
        self.writes = []
        self.thread, self.running, self.error = None, False, None
        self.targets = []  # extents the next background writes aim at (half of them)

    def batch(self, n=4, aim=()):
        args, extents = [], []
        for _ in range(n):
            if aim and self.rng.random() < 0.5:
                off, length = self.rng.choice(aim)
                length = min(length, 64 << 10)
            else:
                length = self.rng.choice((4, 16, 64, 100, 256)) << 10
                off = self.rng.randrange(0, DISK_SIZE - length, 4096)
            args += ["-c", f"write -P 0x{self.rng.randrange(1, 256):02x} {off} {length}"]
            extents.append((off, length))
        sh("qemu-io", "-f", "raw", self.url, *args)
        now = time.monotonic()
        self.writes += [(off, length, now) for off, length in extents]

    def _loop(self):
        try:
            while self.running:
                self.batch(n=2, aim=self.targets)
                time.sleep(0.1)
        except Exception as e:  # noqa: BLE001 - reported by stop()
            self.error = e

    def start(self, aim=()):
        self.targets = list(aim)
        self.running = True
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def stop(self):
        if self.thread is not None:
            self.running = False
            self.thread.join()
            self.thread = None
        if self.error is not None:
            raise RuntimeError(f"the writer failed: {self.error}")

    def since(self, t):
        return [(off, length) for off, length, at in self.writes if at > t]

    def between(self, t0, t1):
        return sum(1 for _, _, at in self.writes if t0 < at <= t1)


def blocks(extents):
    """The bitmap blocks the extents touch."""
    out = set()
    for off, length in extents:
        out.update(range(off // GRANULARITY, (off + length - 1) // GRANULARITY + 1))
    return out


def exact_bytes(extents):
    """Bytes covered by the extents (overlaps counted once)."""
    total, end = 0, 0
    for off, length in sorted(extents):
        if off + length > end:
            total += off + length - max(off, end)
            end = off + length
    return total


def initial_disk(path, rng):
    """A 128 MiB raw disk with 24 MiB of random data in 1 MiB runs; converted to qcow2."""
    raw = path + ".raw"
    with open(raw, "wb") as f:
        f.truncate(DISK_SIZE)
        for _ in range(24):
            f.seek(rng.randrange(0, DISK_SIZE - (1 << 20), 65536))
            f.write(rng.randbytes(1 << 20))
    sh("qemu-img", "convert", "-f", "raw", "-O", "qcow2", raw, path)
    os.unlink(raw)


class PullBackup:
    """One round's point-in-time view: fleecing node + backup job + read-only export."""

    def __init__(self, qsd, work):
        self.qsd, self.work = qsd, work
        self.scratch = os.path.join(work, "fleece.qcow2")

    def begin(self, bitmap_actions, export_bitmap):
        q = self.qsd.qmp
        sh("qemu-img", "create", "-q", "-f", "qcow2", self.scratch, str(DISK_SIZE))
        q.cmd("blockdev-add", **{"driver": "qcow2", "node-name": "fleece0",
                                 "file": {"driver": "file", "filename": self.scratch},
                                 "backing": "disk0"})
        q.transaction(("blockdev-backup", {"job-id": "fleece", "device": "disk0",
                                           "target": "fleece0", "sync": "none"}),
                      *bitmap_actions)
        self.qsd.export("backup", "fleece0", "backup",
                        bitmaps=[export_bitmap] if export_bitmap else [])
        return self.qsd.url("backup")

    def end(self):
        q = self.qsd.qmp
        self.qsd.export_del("backup")
        q.cmd("block-job-cancel", device="fleece")
        for _ in range(200):
            if not q.cmd("query-block-jobs"):
                break
            time.sleep(0.05)
        else:
            raise RuntimeError("the fleecing job did not go away")
        q.cmd("blockdev-del", **{"node-name": "fleece0"})
        os.unlink(self.scratch)


def bitmaps(qsd):
    for node in qsd.qmp.cmd("query-named-block-nodes", flat=True):
        if node["node-name"] == "disk0":
            return sorted(b["name"] for b in node.get("dirty-bitmaps", []))
    return []


README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "PULL-MODE.md")
README_SECTION = "## The recipe"
README_SCRATCH = "/var/tmp/fleece.qcow2"
README_SOCKET = "/run/qemu-nbd.sock"


def readme_qmp():
    """The QMP commands of the README's pull-mode recipe, as (command, arguments) in order:
    every JSON object in the section's code blocks (`#` comments and `cairn` lines skipped)."""
    text = open(README).read()
    section = text[text.index(README_SECTION):]
    end = section.find("\n## ", 1)
    section = section if end < 0 else section[:end]
    commands, pending = [], ""
    for line in section.splitlines():
        if not pending and not line.startswith("{"):
            continue
        pending += line + "\n"
        try:
            obj = json.loads(pending)
        except json.JSONDecodeError:
            continue
        commands.append((obj["execute"], obj.get("arguments", {})))
        pending = ""
    if pending:
        raise RuntimeError(f"README: a QMP command does not parse: {pending!r}")
    return commands


def check_readme_recipe(sent, paths):
    """What this run sent over QMP for backup 1 (queries left out, its own paths in the
    README's names) is exactly the README's recipe."""
    def named(value):
        if isinstance(value, dict):
            return {k: named(v) for k, v in value.items()}
        if isinstance(value, list):
            return [named(v) for v in value]
        return paths.get(value, value)
    ours = [(c, named(a)) for c, a in sent
            if not c.startswith("query-") and c != "qmp_capabilities"
            and not (c == "block-export-add" and a.get("id") == "live")]
    theirs = readme_qmp()
    ok(ours == theirs, "the README's pull-mode QMP commands are exactly the ones this backup "
                       f"sent:\n  sent   {ours}\n  README {theirs}")


def on_signal(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.environ.get("CAIRN_BIN", os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "target", "release", "cairn")))
    ap.add_argument("--rounds", type=int, default=4, help="incremental rounds (at least 3)")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    need_tools("pullmode_backup", "qemu-storage-daemon", "qemu-img", "qemu-io", "nbdcopy")
    binary = os.path.abspath(args.bin)
    if not os.access(binary, os.X_OK):
        sys.exit(f"pullmode_backup: no cairn binary at {binary} (build it: "
                 "cargo build --release -p cairn-cli, or pass --bin)")
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    print(f"pullmode_backup: seed {seed} (--seed {seed} repeats this run)")
    rng = random.Random(seed)
    signal.signal(signal.SIGTERM, on_signal)
    started = time.monotonic()
    work = os.path.abspath(tempfile.mkdtemp(prefix="cairn-pullmode-",
                                            dir=os.environ.get("CAIRN_TEST_TMP")))
    qsd = writer = None
    try:
        c = Cairn(binary, os.path.join(work, "repo"), os.path.join(work, "state"), timeout=300)
        c.run("init")
        disk = os.path.join(work, "disk0.qcow2")
        initial_disk(disk, rng)
        qsd = StorageDaemon(work, [f"driver=file,node-name=file0,filename={disk}",
                                   "driver=qcow2,node-name=disk0,file=file0"],
                            nbd_over_qmp=True)
        setup_sent = list(qsd.qmp.sent)
        qsd.export("live", "disk0", "live", writable=True)
        writer = Writer(qsd.url("live"), rng)
        pull = PullBackup(qsd, work)
        expected = {}  # version number -> sha256 of the disk at its point in time
        frozen_at = None
        for r in range(args.rounds + 1):
            print(f"round {r}")
            if r > 0:
                for _ in range(3):
                    writer.batch(n=6)
            # What the disk holds at the point in time: read with the writer paused.
            snap = os.path.join(work, "expected.raw")
            sh("nbdcopy", qsd.url("live"), snap)
            want = sha(snap)
            os.unlink(snap)
            dirty = writer.since(frozen_at) if frozen_at is not None else []
            frozen_at = time.monotonic()
            round_start = len(qsd.qmp.sent)
            if r == 0:
                url = pull.begin([("block-dirty-bitmap-add", {
                    "node": "disk0", "name": "b0", "persistent": True,
                    "granularity": GRANULARITY})], None)
                commit_args = []
            else:
                url = pull.begin([
                    ("block-dirty-bitmap-add", {"node": "disk0", "name": f"b{r}",
                                                "persistent": True,
                                                "granularity": GRANULARITY}),
                    ("block-dirty-bitmap-disable", {"node": "disk0", "name": f"b{r - 1}"}),
                ], f"b{r - 1}")
                commit_args = ["--dirty-bitmap", f"b{r - 1}"]
            # The guest goes on writing — half of it over the blocks this round reads.
            writer.start(aim=dirty)
            try:
                got = os.path.join(work, "pit.raw")
                sh("nbdcopy", url, got)
                t0 = time.monotonic()
                v = c.json("commit", IMAGE, url, *commit_args,
                           "--rate-limit", RATE_LIMIT[0] if r == 0 else RATE_LIMIT[1],
                           "-m", f"round {r}")
                t1 = time.monotonic()
            finally:
                writer.stop()
            ok(sha(got) == want, f"round {r}: the point-in-time export holds the disk as it "
                                 "was at the transaction, while the guest writes")
            os.unlink(got)
            landed = writer.between(t0, t1)
            ok(landed > 0, f"round {r}: the guest wrote to the live disk during the commit "
                           f"({landed} writes)")
            print(f"  {landed} guest writes landed during the commit ({t1 - t0:.2f} s); "
                  f"read {v['read_bytes']} bytes")
            expected[r + 1] = want
            if r == 0:
                ok(v["incremental"] is None, f"round 0: a full commit: {v['incremental']}")
            else:
                inc = v["incremental"]
                ok(inc is not None and f"dirty bitmap b{r - 1}" in inc.get("basis", ""),
                   f"round {r}: the commit is incremental on bitmap b{r - 1}: {inc}")
                marked = len(blocks(dirty)) * GRANULARITY
                written = exact_bytes(dirty)
                ok(written <= v["read_bytes"] <= marked,
                   f"round {r}: read {v['read_bytes']} bytes; {written} bytes were written "
                   f"since round {r - 1} in {marked} bytes of bitmap blocks "
                   f"(the disk holds {v['data_bytes']})")
                print(f"  bitmap b{r - 1}: {len(dirty)} writes, {written} bytes in "
                      f"{marked // GRANULARITY} blocks of 64 KiB")
            pull.end()
            if r > 0:
                qsd.qmp.cmd("block-dirty-bitmap-remove", node="disk0", name=f"b{r - 1}")
            if r == 1:
                sent = setup_sent + qsd.qmp.sent[round_start:]
                check_readme_recipe(sent, {pull.scratch: README_SCRATCH, qsd.sock: README_SOCKET})
            # Every version so far restores to its round's content.
            out = os.path.join(work, "restored.raw")
            for n, digest in sorted(expected.items()):
                c.run("restore", f"{IMAGE}@{n}", out, "--force")
                ok(sha(out) == digest, f"round {r}: {IMAGE}@{n} restores byte for byte")
                os.unlink(out)
        log = c.json("log", IMAGE)
        ok(len(log) == args.rounds + 1, f"{len(log)} versions for {args.rounds + 1} rounds")
        ok(bitmaps(qsd) == [f"b{args.rounds}"],
           f"only the newest bitmap is left: {bitmaps(qsd)}")
        p = c.run("verify", check=False)
        ok(p.returncode == 0, f"verify is clean: {p.stdout.strip()[-300:]} {p.stderr.strip()}")
    except Exception as e:  # noqa: BLE001 - one failure line, then the summary
        ok(False, f"{type(e).__name__}: {e}")
    except KeyboardInterrupt as e:
        ok(False, f"interrupted ({e})")
    finally:
        if writer is not None:
            try:
                writer.stop()
            except RuntimeError:
                pass
        if qsd is not None:
            qsd.stop()
        shutil.rmtree(work, ignore_errors=True)
    if CHECKS.failed:
        print(f"pullmode_backup: seed {seed}")
    print(f"pullmode_backup: {CHECKS.passed} passed, {CHECKS.failed} failed "
          f"({time.monotonic() - started:.0f} s)")
    sys.exit(1 if CHECKS.failed else 0)


if __name__ == "__main__":
    main()

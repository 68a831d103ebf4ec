#!/usr/bin/env python3
"""`cairn vm backup` against a real running QEMU, end to end, through its QMP socket.

The VM: qemu-system-x86_64 with `-machine none` (QEMU's whole block layer, QMP, jobs and
bitmaps, without a guest OS: it starts in a moment) and two qcow2 disks, `-drive if=none`
(`disk0`, `disk1`). The "guest" writes through QEMU's own block layer (HMP `qemu-io` over a
second QMP connection), continuously, in lock step across the two disks: log block k of
disk0, then log block k of disk1, then k+1 ... (each block filled with a byte derived from
k), plus random blocks elsewhere.

Checks:
- every VM version's disks restore to a state consistent across both disks: if disk1 holds
  log block k, disk0 does too, and disk0 is at most one block ahead (no disk holds a write
  the other's snapshot lacks);
- the first backup reads each disk whole; later ones only what changed: bytes read at most
  1.2x the log blocks the guest wrote between the two versions + one 64 KiB granule per
  dirty area, plus the random blocks;
- with the writer stopped, a backup restores bit for bit to the live disks (qemu-img compare);
- `cairn vm log/show --json` list the versions with their disks; each disk is an image
  (`cairn log vm/disk0`); after each backup QEMU keeps exactly one cairn checkpoint bitmap
  per disk and nothing else of cairn's (no job, export, node, scratch file);
- kill -9 of cairn while it reads: no VM version published; the next backup says what it
  removed, discards the disk versions the killed one committed, and still reads only what
  changed since the last published version;
- a guest agent socket that never answers: the backup goes on unfrozen, says so, and records
  `freeze: no_answer`;
- kill -9 of QEMU mid-backup: one clear error, nothing published; QEMU started again on the
  same disks: the next backup reads whole (the persistent bitmaps are inconsistent) and says
  why;
- a QMP socket nobody listens on: one clear error line, exit 1;
- the repository's file system full mid-backup (a tmpfs; needs root): one clear line,
  nothing published or left in QEMU, and the next backup with room succeeds.

    scripts/vm_backup.py [--bin target/ci/cairn]

Needs qemu-system-x86 (qemu-system-x86_64) and qemu-utils (qemu-img); installs nothing.
Prints "vm_backup: N passed, 0 failed"; exits non-zero on any failure.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Cairn, Checks, sh, sha  # noqa: E402
from qemu_helpers import Qmp, need_tools, stop, vm_start, wait_for  # noqa: E402

CHECKS = Checks()
ok = CHECKS.ok

DISK = 96 << 20
BLOCK = 4096
GRANULE = 64 << 10
LOG_START = 16 << 20  # the log region of each disk; random writes go below it
LOG_BLOCKS = (DISK - LOG_START) // BLOCK
DISKS = ("disk0", "disk1")


def log_byte(k):
    return k % 251 + 1


class Vm:
    """QEMU with two qcow2 disks, a QMP monitor for cairn and one for the writer."""

    def __init__(self, work, agent=False):
        self.work = work
        self.qmp_sock = os.path.join(work, "qmp.sock")
        self.io_sock = os.path.join(work, "io.sock")
        self.qga_sock = os.path.join(work, "qga.sock")
        args = ["qemu-system-x86_64", "-machine", "none", "-nodefaults", "-display", "none",
                "-qmp", f"unix:{self.qmp_sock},server=on,wait=off",
                "-chardev", f"socket,id=io,path={self.io_sock},server=on,wait=off",
                "-mon", "chardev=io,mode=control"]
        for d in DISKS:
            args += ["-drive", f"if=none,id={d},format=qcow2,file={os.path.join(work, d)}.qcow2"]
        if agent:
            # The agent's chardev with no guest behind it: connections are accepted and
            # nothing ever answers, as with a guest whose agent hangs.
            args += ["-chardev", f"socket,id=qga0,path={self.qga_sock},server=on,wait=off"]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        wait_for(self.qmp_sock, self.proc, "qemu-system-x86_64")
        wait_for(self.io_sock, self.proc, "qemu-system-x86_64")
        self.io = Qmp(self.io_sock)
        self.lock = threading.Lock()

    def hmp(self, line):
        with self.lock:
            out = self.io.cmd("human-monitor-command", **{"command-line": line})
        if out.strip() and "wrote" not in out:
            raise RuntimeError(f"HMP {line}: {out.strip()}")
        return out

    def write(self, disk, offset, byte, length=BLOCK):
        self.hmp(f'qemu-io {disk} "write -P {byte} {offset} {length}"')

    def ours(self):
        """What of cairn's QEMU still holds: (jobs, exports, nodes, bitmaps by disk). Asked on
        the writer's monitor: a QMP socket serves one client at a time, and cairn holds the
        other."""
        with self.lock:
            q = self.io
            jobs = [j["device"] for j in q.cmd("query-block-jobs")]
            exports = [e["id"] for e in q.cmd("query-block-exports")]
            nodes = [n["node-name"] for n in q.cmd("query-named-block-nodes", flat=True)
                     if n["node-name"].startswith("cairn-")]
            bitmaps = {b["device"]: sorted(m.get("name", "") for m in b["inserted"].get("dirty-bitmaps", []) if m.get("name"))
                       for b in q.cmd("query-block") if "inserted" in b}
        return jobs, exports, nodes, bitmaps

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def stop(self):
        self.io.close()
        stop(self.proc)


class Writer(threading.Thread):
    """The guest: log blocks in lock step across both disks, and random blocks below the
    log region."""

    def __init__(self, vm, start=0):
        super().__init__(daemon=True)
        self.vm, self.k, self.rng = vm, start, random.Random(start)
        self.running = threading.Event()
        self.running.set()
        self.quit = False
        self.error = None

    def run(self):
        try:
            while not self.quit and self.k < LOG_BLOCKS:
                self.running.wait()
                for d in DISKS:
                    self.vm.write(d, LOG_START + self.k * BLOCK, log_byte(self.k))
                if self.k % 8 == 0:
                    d = DISKS[self.rng.randrange(2)]
                    self.vm.write(d, self.rng.randrange(LOG_START // BLOCK) * BLOCK,
                                  self.rng.randrange(1, 256))
                self.k += 1
                time.sleep(0.002)
        except Exception as e:  # noqa: BLE001 - reported by the checks
            self.error = e

    def finish(self):
        self.quit = True
        self.join(30)


def log_length(path):
    """How many leading log blocks of a restored disk hold their log byte."""
    n = 0
    with open(path, "rb") as f:
        f.seek(LOG_START)
        while n < LOG_BLOCKS:
            block = f.read(BLOCK)
            if len(block) < BLOCK or block != bytes([log_byte(n)]) * BLOCK:
                break
            n += 1
    return n


class Backups:
    def __init__(self, cairn, vm, work):
        self.cairn, self.vm, self.work = cairn, vm, work
        self.scratch = os.path.join(work, "scratch")
        os.makedirs(self.scratch, exist_ok=True)

    def reading(self, writer, disk, binary, repo):
        """A backup started in the background, once it reads: 4 MiB newly written on `disk`
        (the writer paused meanwhile) read at 2 MiB/s, so that it lasts."""
        writer.running.clear()
        time.sleep(0.1)
        for i in range(LOG_START // GRANULE // 4):
            self.vm.write(disk, i * GRANULE, (i * 7 + len(disk)) % 255 + 1, GRANULE)
        writer.running.set()
        p = subprocess.Popen([binary, "--repo", repo, "-q", *self.args("--rate-limit", "2")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=self.cairn.env)
        deadline = time.time() + 60
        while time.time() < deadline and p.poll() is None and not self.vm.ours()[1]:
            time.sleep(0.01)
        time.sleep(0.5)
        return p

    def flush(self):
        """Makes QEMU write its cached qcow2 metadata, so that the files can be compared."""
        for d in DISKS:
            self.vm.hmp(f'qemu-io {d} "flush"')

    def args(self, *extra):
        return ["vm", "backup", "web", "--qmp", self.vm.qmp_sock, "--scratch-dir", self.scratch,
                *extra]

    def run(self, *extra, check=True):
        p = self.cairn.run("--json", *self.args(*extra), check=check)
        return (json.loads(p.stdout) if p.returncode == 0 else None), p

    def restore(self, seq):
        """The disks of web@seq restored: {disk: path}."""
        show = self.cairn.json("vm", "show", f"web@{seq}")
        out = {}
        for d in show["disks"]:
            path = os.path.join(self.work, f"r{seq}-{d['disk']}.raw")
            if os.path.exists(path):
                os.remove(path)
            self.cairn.run("restore", f"{d['image']}@{d['seq']}", path)
            out[d["disk"]] = path
        return out

    def clean_in_qemu(self, what):
        jobs, exports, nodes, bitmaps = self.vm.ours()
        ok(not jobs and not exports and not nodes,
           f"{what}: nothing of cairn's left in QEMU (jobs {jobs}, exports {exports}, "
           f"nodes {nodes})")
        for d in DISKS:
            cps = [b for b in bitmaps.get(d, []) if b.startswith("cairn-")]
            ok(len(cps) == 1 and cps[0].startswith("cairn-cp-"),
               f"{what}: one checkpoint bitmap on {d}, not {cps}")
        left = os.listdir(self.scratch)
        ok(not left, f"{what}: no scratch file left ({left})")


def consistent(paths, what):
    a, b = log_length(paths["disk0"]), log_length(paths["disk1"])
    ok(a == b or a == b + 1, f"{what}: the disks are one point in time (disk0 holds {a} log "
                             f"blocks, disk1 {b})")
    return a


def instant_recovery(cairn, work, seq, restored):
    """`vm start web@seq`, a QEMU on its exports that writes, `vm commit web --qmp`: the new
    VM version restores to web@seq's disks with those writes, bit for bit."""
    sock = os.path.join(work, "instant.sock")
    starter, plan = vm_start(cairn, f"web@{seq}", sock)
    qemu = None
    try:
        drives = [a for i, a in enumerate(plan["qemu_args"]) if plan["qemu_args"][i - 1] == "-drive"]
        ok(len(drives) == 2 and all(f"socket={sock}" in d for d in drives),
           f"vm start points every -drive at its export: {drives}")
        qmp_sock = os.path.join(work, "instant-qmp.sock")
        args = ["qemu-system-x86_64", "-machine", "none", "-nodefaults", "-display", "none",
                "-qmp", f"unix:{qmp_sock},server=on,wait=off"]
        for d in drives:
            args += ["-drive", d]
        qemu = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        wait_for(qmp_sock, qemu, "qemu on the exports")
        q = Qmp(qmp_sock)
        expected = {}
        for i, d in enumerate(DISKS):
            with open(restored[d], "rb") as f:
                expected[d] = bytearray(f.read())
            for k in range(4):
                off, byte = (k * 7 + i) * GRANULE + 4096 * i, 0x40 + k + i
                out = q.cmd("human-monitor-command",
                            **{"command-line": f'qemu-io {d} "write -P {byte} {off} 8192"'})
                ok(not out.strip() or "wrote" in out,
                   f"the recovered VM writes {d}: {out.strip()}")
                expected[d][off:off + 8192] = bytes([byte]) * 8192
        q.close()
        done = cairn.run("--json", "vm", "commit", "web", "--qmp", qmp_sock, "-m", "recovered",
                         check=False)
        ok(done.returncode == 0, f"vm commit: {done.stderr.strip()}")
        if done.returncode == 0:
            v = json.loads(done.stdout)
            ok(v["message"] == "recovered" and len(v["disks"]) == 2,
               f"vm commit published a VM version of both disks: {v}")
            back = {}
            for d in v["disks"]:
                path = os.path.join(work, f"instant-{d['disk']}.raw")
                cairn.run("restore", f"{d['image']}@{d['seq']}", path)
                with open(path, "rb") as f:
                    back[d["disk"]] = f.read()
            for d in DISKS:
                ok(back.get(d) == bytes(expected[d]),
                   f"web@{v['seq']} {d}: web@{seq}'s disk with the recovered VM's writes")
    finally:
        if qemu is not None:
            stop(qemu)
        starter.send_signal(signal.SIGTERM)
        try:
            starter.wait(30)
        except subprocess.TimeoutExpired:
            starter.kill()
        ok(starter.returncode == 0, f"vm start stops cleanly on SIGTERM ({starter.returncode}): "
                                    f"{starter.stderr.read().strip()[-300:]}")


def fleet(cairn, work):
    """Several VMs in one run: two QEMUs whose disks are clones of one golden image (qcow2
    over it) updated alike; `vm backup --qmp fa=… --qmp fb=…` stores the second's new blocks
    not at all. A VM of the batch that fails is named; the others are backed up."""
    golden, update = os.path.join(work, "golden.raw"), os.path.join(work, "update.bin")
    with open(golden, "wb") as f:
        f.write(random.randbytes(8 << 20))
        f.truncate(32 << 20)
    with open(update, "wb") as f:
        f.write(random.randbytes(2 << 20))
    procs, socks = [], {}
    try:
        for name in ("fa", "fb"):
            disk = os.path.join(work, f"{name}.qcow2")
            sh("qemu-img", "create", "-q", "-f", "qcow2", "-b", golden, "-F", "raw", disk)
            sock, io = os.path.join(work, f"{name}.qmp"), os.path.join(work, f"{name}-io.qmp")
            procs.append(subprocess.Popen(
                ["qemu-system-x86_64", "-machine", "none", "-nodefaults", "-display", "none",
                 "-qmp", f"unix:{sock},server=on,wait=off",
                 "-qmp", f"unix:{io},server=on,wait=off",
                 "-drive", f"if=none,id=d0,format=qcow2,file={disk}"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                text=True, start_new_session=True))
            wait_for(io, procs[-1], "qemu-system-x86_64")
            q = Qmp(io)
            q.cmd("human-monitor-command",
                  **{"command-line": f'qemu-io d0 "write -s {update} {16 << 20} {2 << 20}"'})
            q.close()
            socks[name] = sock
        p = cairn.run("--json", "vm", "backup", "--qmp", f"fa={socks['fa']}",
                      "--qmp", f"fb={socks['fb']}", "--scratch-dir", work, check=False)
        out = json.loads(p.stdout) if p.returncode == 0 else []
        ok([o.get("vm") for o in out] == ["fa", "fb"], f"a batch backs up both VMs: {p.stderr}")
        if len(out) == 2:
            a, b = (o["disks"][0]["stored_bytes"] for o in out)
            ok(a > (8 << 20) and b < a / 20,
               f"the second clone's blocks are stored once: fa {a} bytes, fb {b}")
        p = cairn.run("--json", "vm", "backup", "--qmp", f"fa={socks['fa']}",
                      "--qmp", f"gone={os.path.join(work, 'none.qmp')}", "--scratch-dir", work,
                      check=False)
        out = json.loads(p.stdout) if p.stdout.strip() else []
        ok(p.returncode == 1 and [o.get("seq") for o in out] == [2, None]
           and "error" in out[1] and "1 of 2 VM backups failed: gone" in p.stderr,
           f"a failing VM is named, the others backed up: {p.returncode} {out} {p.stderr}")
        p = cairn.run("vm", "backup", "--qmp", socks["fa"], "--qmp", socks["fb"], check=False)
        ok(p.returncode == 2 and "VM=PATH" in p.stderr,
           f"several unnamed --qmp: a usage error: {p.stderr.strip()}")
    finally:
        for proc in procs:
            stop(proc)


def full_disk(binary, work):
    """A repository whose file system fills up during `vm backup`: one clear line, nothing
    published, nothing of cairn's left in QEMU and the repository clean; once there is room
    (the tmpfs grown), the next backup succeeds and restores to the live disk bit for bit."""
    mnt = os.path.join(work, "small-fs")
    os.makedirs(mnt)
    sh("mount", "-t", "tmpfs", "-o", "size=56m", "tmpfs", mnt)  # 32 MiB of it the reserve
    proc = q = None
    try:
        repo = os.path.join(mnt, "repo")
        cairn = Cairn(binary, repo, state=os.path.join(work, "full-state"), timeout=300)
        cairn.run("init")
        disk, data = os.path.join(work, "full.qcow2"), os.path.join(work, "full-data.bin")
        sh("qemu-img", "create", "-q", "-f", "qcow2", disk, 64 << 20)
        with open(data, "wb") as f:
            f.write(random.randbytes(40 << 20))
        sock, io = os.path.join(work, "full.qmp"), os.path.join(work, "full-io.qmp")
        proc = subprocess.Popen(
            ["qemu-system-x86_64", "-machine", "none", "-nodefaults", "-display", "none",
             "-qmp", f"unix:{sock},server=on,wait=off", "-qmp", f"unix:{io},server=on,wait=off",
             "-drive", f"if=none,id=d0,format=qcow2,file={disk}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, start_new_session=True)
        wait_for(io, proc, "qemu-system-x86_64")
        q = Qmp(io)
        q.cmd("human-monitor-command", **{"command-line": f'qemu-io d0 "write -s {data} 0 40M"'})
        scratch = os.path.join(work, "full-scratch")
        os.makedirs(scratch)
        backup = ("vm", "backup", "full", "--qmp", sock, "--scratch-dir", scratch)
        p = cairn.run(*backup, check=False)
        errors = [x for x in p.stderr.splitlines() if x.startswith("cairn: error:")]
        ok(p.returncode == 1 and len(errors) == 1 and f"the file system of {repo} is full"
           in errors[0], f"a full disk during vm backup: one line, exit 1: "
                         f"{p.returncode} {p.stderr.strip()[-400:]}")
        ok(proc.poll() is None, "the VM runs on after the failed backup")
        jobs = [j["device"] for j in q.cmd("query-block-jobs")]
        exports = [e["id"] for e in q.cmd("query-block-exports")]
        nodes = [n["node-name"] for n in q.cmd("query-named-block-nodes", flat=True)
                 if n["node-name"].startswith("cairn-")]
        ok(not jobs and not exports and not nodes and not os.listdir(scratch),
           f"a full disk: nothing of cairn's left in QEMU or the scratch directory "
           f"({jobs} {exports} {nodes} {os.listdir(scratch)})")
        ok(cairn.json("vm", "list") == [], "a full disk: no VM version published")
        p = cairn.run("verify", check=False)
        ok(p.returncode == 0, f"a full disk: the repository verifies clean: {p.stdout[-300:]}")
        sh("mount", "-o", "remount,size=256m", mnt)
        p = cairn.run("--json", *backup, check=False)
        out = json.loads(p.stdout) if p.returncode == 0 else {}
        ok(out.get("seq") == 1, f"with room again the backup succeeds: {p.stderr.strip()[-300:]}")
        if out:
            q.cmd("human-monitor-command", **{"command-line": 'qemu-io d0 "flush"'})
            d = out["disks"][0]
            path = os.path.join(work, "full-restored.raw")
            cairn.run("restore", f"{d['image']}@{d['seq']}", path)
            cmp = sh("qemu-img", "compare", "-U", "-f", "raw", "-F", "qcow2", path, disk,
                     check=False)
            ok(cmp.returncode == 0, f"... and restores to the live disk bit for bit: "
                                    f"{cmp.stdout.strip()} {cmp.stderr.strip()}")
    finally:
        if q is not None:
            q.close()
        if proc is not None:
            stop(proc)
        sh("umount", mnt, check=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/ci/cairn")
    args = ap.parse_args()
    need_tools("vm_backup", "qemu-system-x86_64", "qemu-img")
    binary = os.path.abspath(args.bin)
    work = tempfile.mkdtemp(prefix="cairn-vm-backup-")
    vm = None
    try:
        repo = os.path.join(work, "repo")
        cairn = Cairn(binary, repo, state=os.path.join(work, "state"), timeout=300)
        # Exports' run files (vm start) in the work directory, not the user's.
        cairn.env["XDG_RUNTIME_DIR"] = os.path.join(work, "run")
        cairn.env["XDG_STATE_HOME"] = os.path.join(work, "state-home")
        os.makedirs(cairn.env["XDG_RUNTIME_DIR"], mode=0o700)
        cairn.run("init")
        for d in DISKS:
            sh("qemu-img", "create", "-q", "-f", "qcow2", os.path.join(work, f"{d}.qcow2"), DISK)
        vm = Vm(work)
        # Some content before the first backup.
        for i in range(64):
            vm.write(DISKS[i % 2], i * GRANULE, i + 1, GRANULE)
        backups = Backups(cairn, vm, work)
        writer = Writer(vm)
        writer.start()
        time.sleep(0.5)

        # 1. First backup while the guest writes: full reads, one point in time.
        first, _ = backups.run("-m", "first")
        ok(first["seq"] == 1 and len(first["disks"]) == 2, f"web@1 with two disks: {first}")
        ok(all(not d["incremental"] and d["full_because"] for d in first["disks"]),
           "the first backup reads every disk whole, and says why")
        ok(first["freeze"] == "not_tried", "no guest agent: not frozen, and recorded so")
        backups.clean_in_qemu("after web@1")
        counts = {1: consistent(backups.restore(1), "web@1")}

        # 2. Incremental backups while the guest writes.
        for seq in (2, 3):
            time.sleep(1.0)
            out, _ = backups.run()
            ok(out["seq"] == seq, f"web@{seq} published")
            ok(all(d["incremental"] for d in out["disks"]), f"web@{seq}: only changes read")
            counts[seq] = consistent(backups.restore(seq), f"web@{seq}")
            vd = cairn.json("vm", "diff", f"web@{seq - 1}", f"web@{seq}")
            ok(all(d["status"] == "changed" and 0 < d["changed_bytes"] for d in vd["disks"])
               and not vd["config_changed"], f"vm diff web@{seq - 1} web@{seq}: {vd}")
            written = (counts[seq] - counts[seq - 1]) * BLOCK
            for d in out["disks"]:
                # Random blocks: one per 8 log blocks, each its own dirty area (a granule).
                allowed = 1.2 * written + (written // BLOCK // 8 + 2) * GRANULE
                ok(d["read_bytes"] <= allowed and d["read_bytes"] > 0,
                   f"web@{seq} {d['disk']}: read {d['read_bytes']} bytes for "
                   f"{written} written (<= {allowed:.0f})")
            backups.clean_in_qemu(f"after web@{seq}")

        # 3. kill -9 of cairn while it reads.
        p = backups.reading(writer, "disk0", binary, repo)
        # A second backup of the same VM meanwhile is refused, and disturbs nothing.
        second = cairn.run(*backups.args(), check=False)
        ok(second.returncode == 1 and "another `cairn vm backup` of VM web is running"
           in second.stderr, f"a concurrent backup of the VM is refused: {second.stderr.strip()}")
        p.kill()
        p.wait()
        log = cairn.json("vm", "log", "web")
        ok(len(log) == 3, f"a killed backup publishes no VM version ({len(log)} versions)")
        time.sleep(0.5)
        out, proc = backups.run()
        ok(out is not None and out["seq"] == 4, f"the backup after a kill succeeds: {proc.stderr}")
        ok(p.returncode == -signal.SIGKILL, "cairn was killed while it read")
        ok("removed what an earlier backup left" in proc.stderr,
           f"the backup after a kill says what it cleaned up: {proc.stderr.strip()}")
        ok(all(d["incremental"] for d in out["disks"]),
           "after a kill the next backup still reads only what changed")
        counts[4] = consistent(backups.restore(4), "web@4 (after a kill)")
        backups.clean_in_qemu("after the backup that followed a kill")

        # SIGINT while it reads: it stops at once, tears down in QEMU, publishes nothing.
        p = backups.reading(writer, "disk1", binary, repo)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        ok(p.returncode == 130 and "interrupted by SIGINT" in err,
           f"SIGINT mid-backup: exit 130, said: {p.returncode} {err.strip()[-300:]}")
        ok(len(cairn.json("vm", "log", "web")) == 4, "SIGINT mid-backup: nothing published")
        jobs, exports, nodes, _ = vm.ours()
        ok(not jobs and not exports and not nodes,
           f"SIGINT mid-backup: QEMU cleaned up at once ({jobs} {exports} {nodes})")
        for d in DISKS:
            versions = cairn.json("log", f"web/{d}")
            bound = {x["id"] for v in cairn.json("vm", "log", "web") for x in v["disks"]
                     if x["disk"] == d}
            ok({v["id"] for v in versions} == bound,
               f"web/{d}: every live version belongs to a VM version "
               f"({len(versions)} live, {len(bound)} bound)")

        # 4. Writer stopped: a backup restores bit for bit to the live disks.
        writer.finish()
        ok(writer.error is None, f"the guest's writes all succeeded: {writer.error}")
        out, _ = backups.run("-m", "quiet")
        restored = backups.restore(out["seq"])
        backups.flush()
        for d in DISKS:
            cmp = sh("qemu-img", "compare", "-U", "-f", "raw", "-F", "qcow2", restored[d],
                     os.path.join(work, f"{d}.qcow2"), check=False)
            ok(cmp.returncode == 0, f"web@{out['seq']} {d} is bit for bit the live disk: "
                                    f"{cmp.stdout.strip()} {cmp.stderr.strip()}")
        # The whole VM restored into a directory, with the command line that runs it there.
        into = os.path.join(work, "restored-vm")
        whole = cairn.json("vm", "restore", f"web@{out['seq']}", "--to", into)
        for d in DISKS:
            path = os.path.join(into, f"{d}.raw")
            ok(sha(path) == sha(restored[d]), f"vm restore wrote {d} as restore does")
            ok(any(f"id={d}," in a and f"file={path},format=raw" in a for a in whole["qemu_args"]),
               f"the printed command line runs the VM on {path}: {whole['qemu_args']}")
        p = cairn.run("vm", "restore", f"web@{out['seq']}", "--to", into, check=False)
        ok(p.returncode != 0 and "exists" in p.stderr,
           f"vm restore over existing files needs --force: {p.stderr.strip()}")
        p = cairn.run("vm", "restore", f"web@{out['seq']}", "--to", work, "--format", "qcow2",
                      "--force", check=False)
        ok(p.returncode != 0 and "lock" in p.stderr,
           f"vm restore never writes over the running VM's disks: {p.stderr.strip()}")
        for d in DISKS:
            cmp = sh("qemu-img", "compare", "-U", "-f", "raw", "-F", "qcow2", restored[d],
                     os.path.join(work, f"{d}.qcow2"), check=False)
            ok(cmp.returncode == 0, f"{d}: the running VM's disk is untouched")
        show = cairn.json("vm", "show", f"web@{out['seq']}")
        ok(show["message"] == "quiet" and "qemu-system-x86_64" in show["config"],
           "vm show has the message and the QEMU command line")
        txt = cairn.run("vm", "log", "web").stdout
        ok(txt.count("web@") == out["seq"], f"vm log lists every version:\n{txt}")

        # 4b. Instant recovery: web@N served from lazy writable exports, a second QEMU runs on
        # them (the printed -drive options), writes, and vm commit records a new VM version.
        instant_recovery(cairn, work, out["seq"], restored)
        fleet(cairn, work)
        full_disk(binary, work)

        # 5. kill -9 of QEMU mid-backup, then QEMU again on the same disks.
        before = len(cairn.json("vm", "log", "web"))
        vm.hmp('qemu-io disk1 "write -P 9 0 8M"')
        p = subprocess.Popen([binary, "--repo", repo, "-q", *backups.args("--rate-limit", "2")],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=cairn.env)
        deadline = time.time() + 60
        while time.time() < deadline and p.poll() is None:
            if vm.ours()[1]:
                break
            time.sleep(0.01)
        time.sleep(0.5)
        vm.kill()
        _, err = p.communicate(timeout=120)
        errors = [x for x in err.splitlines() if x.startswith("cairn: error:")]
        ok(p.returncode != 0 and len(errors) == 1,
           f"QEMU killed mid-backup: one error line, exit {p.returncode}: {err.strip()}")
        n = len(cairn.json("vm", "log", "web"))
        ok(n == before, f"QEMU killed mid-backup: nothing published ({n} versions)")
        vm = Vm(work, agent=True)
        backups.vm = vm
        out2, proc = backups.run("--guest-agent", vm.qga_sock, "--agent-timeout", "1")
        ok(out2 is not None and all(not d["incremental"] for d in out2["disks"]),
           "after QEMU was killed the next backup reads whole")
        ok("reading the whole disk: " in proc.stderr, f"... and says why: {proc.stderr.strip()}")
        ok(out2["freeze"] == "no_answer" and "guest agent" in proc.stderr,
           f"a guest agent that never answers: unfrozen, said, recorded: {proc.stderr.strip()}")
        restored = backups.restore(out2["seq"])
        backups.flush()
        for d in DISKS:
            cmp = sh("qemu-img", "compare", "-U", "-f", "raw", "-F", "qcow2", restored[d],
                     os.path.join(work, f"{d}.qcow2"), check=False)
            ok(cmp.returncode == 0, f"web@{out2['seq']} {d} is the live disk after the restart")
        backups.clean_in_qemu("after QEMU restarted")

        # 6. Removal: a disk version goes with its VM version, never alone.
        log = cairn.json("vm", "log", "web")
        oldest = log[-1]
        disk0 = next(d for d in oldest["disks"] if d["disk"] == "disk0")
        p = cairn.run("rm", f"web/disk0@{disk0['seq']}", check=False)
        ok(p.returncode == 1 and f"is a disk of VM version web@{oldest['seq']}" in p.stderr,
           f"rm of a bound disk version is refused: {p.stderr.strip()}")
        p = cairn.run("--json", "prune", "web/disk0", "--keep-last", "1", check=False)
        pruned = json.loads(p.stdout) if p.returncode == 0 else None
        ok(pruned is not None and len(cairn.json("log", "web/disk0")) == len(log),
           f"prune keeps every bound disk version: {p.stdout[-300:]} {p.stderr.strip()}")
        gone = cairn.json("vm", "rm", f"web@{oldest['seq']}")
        removed = {d["image"] for v in gone["versions"] for d in v["removed_disks"]}
        ok(removed == {"web/disk0", "web/disk1"} and gone["gc"] is not None,
           f"vm rm removes the VM version and its disk versions, then frees: {gone}")
        ok(len(cairn.json("vm", "log", "web")) == len(log) - 1, "vm log no longer lists it")
        ids = {v["id"] for v in cairn.json("log", "web/disk0")}
        ok(disk0["id"] not in ids, "its disk version is gone from the image's log")

        # A tagged VM version is kept by vm rm and vm prune, and named by its tag.
        oldest = cairn.json("vm", "log", "web")[-1]
        cairn.run("vm", "tag", f"web@{oldest['seq']}", "keep-me")
        ok(cairn.json("vm", "show", "web@keep-me")["id"] == oldest["id"], "web@TAG names it")
        p = cairn.run("vm", "rm", "web@keep-me", check=False)
        ok(p.returncode == 1 and "vm tag --delete web keep-me" in p.stderr,
           f"vm rm of a tagged VM version is refused: {p.stderr.strip()}")
        dry = cairn.json("vm", "prune", "web", "--keep-last", "2", "--dry-run")
        ok(next(v for v in dry["versions"] if v["seq"] == oldest["seq"])["reasons"]
           == ["tagged keep-me"], f"prune keeps the tagged VM version: {dry}")
        cairn.run("vm", "tag", "--delete", "web", "keep-me")
        dry = cairn.json("vm", "prune", "web", "--keep-last", "2", "--dry-run")
        ok(len(cairn.json("vm", "log", "web")) == len(log) - 1
           and sum(not v["keep"] for v in dry["versions"]) == len(log) - 3,
           f"vm prune --dry-run changes nothing: {dry}")
        cairn.json("vm", "prune", "web", "--keep-last", "2")
        left = cairn.json("vm", "log", "web")
        bound = {d["id"] for v in left for d in v["disks"]}
        live = {v["id"] for d in DISKS for v in cairn.json("log", f"web/{d}")}
        ok(len(left) == 2 and live == bound,
           f"vm prune keeps 2 VM versions and exactly their disks ({len(left)}, "
           f"{len(live)} live disk versions, {len(bound)} bound)")

        # 7. Bad input.
        p = cairn.run("vm", "backup", "web", "--qmp", os.path.join(work, "nothing.sock"),
                      check=False)
        ok(p.returncode == 1 and p.stderr.count("\n") == 1 and "cannot connect" in p.stderr,
           f"no QMP socket: one line, exit 1: {p.stderr.strip()}")
        p = cairn.run("vm", "show", "web@.x", check=False)
        ok(p.returncode == 2, f"a bad VM version: usage error: {p.stderr.strip()}")
        p = cairn.run("verify", check=False)
        ok(p.returncode == 0, f"verify is clean: {p.stdout[-300:]} {p.stderr.strip()}")
    finally:
        if vm is not None:
            vm.kill()
        shutil.rmtree(work, ignore_errors=True)
    print(f"vm_backup: {CHECKS.passed} passed, {CHECKS.failed} failed")
    sys.exit(1 if CHECKS.failed else 0)


if __name__ == "__main__":
    main()

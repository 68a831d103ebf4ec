#!/usr/bin/env python3
"""`cairn vm backup` freezes a real guest: a Debian VM (the dataset's vm-agent.raw, with
qemu-guest-agent) booted under QEMU (TCG), writing to its root file system all the time, is
backed up through QMP with its guest agent.

Checks:
- the guest agent answers and the backup says `freeze: frozen`, with the time the guest was
  paused (reported, not asserted: speed lives in benchmarks);
- each version's root disk restores to a clean ext4 (`e2fsck -fn` finds nothing to do, not
  even a journal to recover): the file system was frozen at the point in time, so the copy is
  application-consistent, although the guest never stopped writing;
- the second backup is incremental and frozen too, and the guest's writer kept going through
  both (its log grew);
- the guest is left thawed (the agent says `thawed`);
- `--memory`: while the guest prints a counter on its serial port, two backups save its memory
  (zero pages not stored as data, the second deduplicated against the first; a bound memory
  state cannot be removed alone); a backup killed mid-save leaves the guest running, or
  paused with its marker, and the next backup resumes it; verify reads every VM version;
- the VM killed, `vm restore` and then `vm start` (lazy exports) each resume the guest: the
  counter goes on from where the backup took it, the agent answers, no boot happened;
- `vm start --no-memory`: the guest boots from lazy exports, writes a file, `vm commit`
  records it, and the new version's restored root disk holds the file (debugfs).

    scripts/vm_freeze.py [--bin target/ci/cairn] [--dataset .data/small]

Needs qemu-system-x86 (qemu-system-x86_64), qemu-utils and e2fsprogs (e2fsck, debugfs);
installs nothing.
Prints "vm_freeze: N passed, 0 failed".
"""

import argparse
import base64
import glob
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Cairn, Checks, sh  # noqa: E402
from qemu_helpers import Qmp, need_tools, stop, vm_start, wait_for  # noqa: E402

CHECKS = Checks()
ok = CHECKS.ok
BOOT_LIMIT = 600  # seconds for the guest agent to answer under TCG


class Agent:
    """A guest agent client over the chardev socket (QEMU serves one client at a time)."""

    def __init__(self, path):
        self.path = path

    def call(self, command, args=None, timeout=10):
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(timeout)
        try:
            s.connect(self.path)
            token = int(time.time() * 1000) % 1000000
            s.sendall(b"\xff" + json.dumps({"execute": "guest-sync-delimited",
                                            "arguments": {"id": token}}).encode() + b"\n")
            buf = b""
            while b"\xff" not in buf:
                buf += s.recv(4096)
            buf = buf.split(b"\xff", 1)[1]
            while True:
                while b"\n" not in buf:
                    buf += s.recv(4096)
                line, buf = buf.split(b"\n", 1)
                if json.loads(line).get("return") == token:
                    break
            msg = {"execute": command}
            if args:
                msg["arguments"] = args
            s.sendall(json.dumps(msg).encode() + b"\n")
            while b"\n" not in buf:
                buf += s.recv(4096)
            reply = json.loads(buf.split(b"\n", 1)[0])
            if "error" in reply:
                raise RuntimeError(f"guest agent {command}: {reply['error']}")
            return reply.get("return")
        finally:
            s.close()

    def wait(self, limit):
        deadline = time.time() + limit
        while time.time() < deadline:
            try:
                self.call("guest-ping", timeout=5)
                return True
            except (OSError, RuntimeError, ValueError):
                time.sleep(2)
        return False

    def run(self, shell, capture=False):
        """Starts `sh -c shell` in the guest (not waited for)."""
        return self.call("guest-exec", {"path": "/bin/sh", "arg": ["-c", shell],
                                        "capture-output": capture})

    def output(self, shell):
        pid = self.run(shell, capture=True)["pid"]
        for _ in range(100):
            st = self.call("guest-exec-status", {"pid": pid})
            if st.get("exited"):
                return base64.b64decode(st.get("out-data", "")).decode()
            time.sleep(0.2)
        raise RuntimeError(f"guest command did not finish: {shell}")


def counters(path):
    """The values the guest's counter printed on the serial port, in order."""
    with open(path, "rb") as f:
        text = f.read().decode(errors="replace")
    return [int(w.split()[1]) for w in text.splitlines()
            if w.startswith("cairn-counter ") and len(w.split()) == 2 and w.split()[1].isdigit()]


def memory_state(cairn, work, qemu, agent, qmp):
    """`vm backup --memory`, then the VM killed and resumed from `vm restore`: the guest's
    counter goes on from where the backup took it, without a boot. Returns the QEMU now
    running (for the caller to stop)."""
    serial = os.path.join(work, "serial.log")
    agent.run("i=0; while :; do i=$((i+1)); echo cairn-counter $i > /dev/ttyS0; "
              "sleep 0.1; done")
    time.sleep(3)
    backup = ["--json", "vm", "backup", "guest", "--qmp", qmp, "--scratch-dir", work,
              "--memory"]
    outs = []
    for n in (1, 2):
        before = max(counters(serial), default=0)
        p = cairn.run(*backup, check=False)
        after = max(counters(serial), default=0)
        out = json.loads(p.stdout) if p.returncode == 0 else None
        ok(out is not None and out.get("memory_state") is not None,
           f"memory backup {n}: {p.stderr.strip()[-500:]}")
        if out is None:
            return qemu
        m = out["memory_state"]
        print(f"  memory backup {n}: RAM {m['ram_bytes'] >> 20} MiB, pages with data "
              f"{m['data_bytes'] >> 20} MiB, stream {m['stream_bytes'] >> 20} MiB, new "
              f"{m['new_chunk_bytes'] >> 20} MiB, stored {m['stored_bytes'] >> 20} MiB; "
              f"last pass {m['downtime_s'] * 1000:.0f} ms, guest paused "
              f"{out['paused_s'] * 1000:.0f} ms")
        ok(0 < m["data_bytes"] < m["ram_bytes"] and m["stream_bytes"] > m["data_bytes"],
           f"memory backup {n}: zero pages are not stored as data ({m})")
        ok(out["freeze"] == "not_tried", f"memory backup {n}: no freeze ({out['freeze']})")
        ok(all(d["incremental"] for d in out["disks"]),
           f"memory backup {n}: the disks are read incrementally")
        outs.append((out, before, after))
        time.sleep(1)
    first, second = outs[0][0]["memory_state"], outs[1][0]["memory_state"]
    ok(second["new_chunk_bytes"] < first["new_chunk_bytes"] / 2,
       f"the second memory state is deduplicated against the first (new "
       f"{second['new_chunk_bytes']} against {first['new_chunk_bytes']} bytes)")
    ok(counters(serial)[-1] > outs[1][2], "the guest ran on after the backups")
    interrupted(cairn, qmp, serial, backup)
    v = cairn.json("verify")
    ok(v["clean"] and v["vm_versions_checked"] >= 5,
       f"verify is clean and read every VM version ({v['vm_versions_checked']}): {v['problems']}")
    # The memory state is an image of its own, bound like a disk: not removable alone.
    mem = outs[0][0]["memory_state"]
    p = cairn.run("rm", f"{mem['image']}@{mem['seq']}", check=False)
    ok(p.returncode == 1 and "disk of VM version guest@" in p.stderr,
       f"rm of a bound memory state is refused: {p.returncode} {p.stderr.strip()}")
    # The VM goes; its last version brings it back, running.
    out, before, after = outs[1]
    stop(qemu)
    restored = os.path.join(work, "restored")
    p = cairn.run("--json", "vm", "restore", f"guest@{out['seq']}", "--to", restored,
                  check=False)
    ok(p.returncode == 0, f"vm restore: {p.stderr.strip()}")
    r = json.loads(p.stdout)
    args = r["qemu_args"]
    ok(r["memory_state"] is not None and "-incoming" in args,
       f"the restore wrote the memory state and the command line loads it ({args[-2:]})")
    qemu = resumed(args, serial, agent, before, after, "vm restore")
    # Instant recovery resumes it too: `vm start` serves the disks lazily and writes the
    # memory state for the command line to load.
    stop(qemu)
    sock = os.path.join(work, "instant.sock")
    starter, plan = vm_start(cairn, f"guest@{out['seq']}", sock)
    try:
        ok(plan["memory_state"] is not None and "-incoming" in plan["qemu_args"],
           "vm start wrote the memory state and its command line loads it")
        qemu = resumed(plan["qemu_args"], serial, agent, before, after, "vm start")
        stop(qemu)
    finally:
        stop(starter)
    boot_from_exports(cairn, work, agent, out["seq"])
    return None


def boot_from_exports(cairn, work, agent, seq):
    """Instant recovery without the memory state: `vm start --no-memory` serves the disks
    lazily, the guest boots from them (TCG), writes a file, and `vm commit` records what it
    wrote as a new VM version, whose restored root disk holds the file."""
    starter, plan = vm_start(cairn, f"guest@{seq}", os.path.join(work, "boot.sock"),
                             "--no-memory")
    qemu = None
    try:
        args = plan["qemu_args"]
        ok("-incoming" not in args and plan["memory_state"] is None,
           "vm start --no-memory: the guest boots")
        qemu = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)
        started = time.time()
        up = agent.wait(BOOT_LIMIT)
        ok(up, f"the guest boots from lazy exports ({time.time() - started:.0f} s)")
        if not up:
            return
        agent.output("echo cairn-instant-recovery > /root/instant.txt && sync && echo ok")
        qmp = next(a.split(",")[0][len("unix:"):] for i, a in enumerate(args)
                   if args[i - 1] == "-qmp")
        p = cairn.run("--json", "vm", "commit", "guest", "--qmp", qmp, check=False)
        ok(p.returncode == 0, f"vm commit records what the booted guest wrote: {p.stderr}")
        if p.returncode != 0:
            return
        new = json.loads(p.stdout)["seq"]
    finally:
        if qemu is not None:
            stop(qemu)
        stop(starter)
    root = os.path.join(work, "committed-root.raw")
    disk = next(d for d in cairn.json("vm", "show", f"guest@{new}")["disks"] if d["disk"] == "root")
    cairn.run("restore", f"{disk['image']}@{disk['seq']}", root)
    text = sh("debugfs", "-R", "cat /root/instant.txt", root, check=False).stdout.strip()
    ok(text == "cairn-instant-recovery",
       f"guest@{new}'s root disk holds the file the booted guest wrote ({text!r})")
    os.remove(root)


def interrupted(cairn, qmp, serial, backup):
    """A memory backup killed at any point leaves the guest running, or resumed by the next
    backup: killed mid-copy (QEMU's migration fails, the guest never stopped), and killed
    while it held the guest paused (simulated: the guest stopped and cairn's marker left)."""
    p = subprocess.Popen([cairn.binary, "--repo", cairn.repo, *backup[1:]], env=cairn.env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.7)
    p.kill()
    p.wait()
    time.sleep(1)
    a = max(counters(serial), default=0)
    time.sleep(1.5)
    run = cairn.env["XDG_RUNTIME_DIR"]
    locks = glob.glob(os.path.join(run, "cairn", "backup-vm-*.lock"))
    ok(len(locks) == 1, f"one VM lock in the run directory ({locks})")
    marker = locks[0][:-len(".lock")] + ".paused"
    # Killed mid-copy, the guest never stopped; killed after QEMU's last pass, cairn held it
    # paused, and its marker says so (the next backup resumes it, as below).
    ok(max(counters(serial), default=0) > a or os.path.exists(marker),
       "killed mid-copy the guest runs on; killed while paused, the marker is left")
    with open(marker, "w") as f:
        json.dump({"was_running": True, "bandwidth": 128 << 20}, f)
    q = Qmp(qmp)
    q.cmd("stop")
    q.close()  # QEMU serves one monitor client at a time
    a = max(counters(serial), default=0)
    time.sleep(1)
    ok(max(counters(serial), default=0) <= a + 1, "the guest is paused")
    p = cairn.run(*backup, check=False)
    ok(p.returncode == 0 and "paused to save its memory (resumed)" in p.stderr,
       f"the next backup resumes a guest a killed one left paused: {p.stderr.strip()[-400:]}")
    a = max(counters(serial), default=0)
    time.sleep(1.5)
    ok(max(counters(serial), default=0) > a and not os.path.exists(marker),
       "and the guest runs again")


def resumed(args, serial, agent, before, after, how):
    """Starts QEMU with `args` (which load a memory state) and checks that the guest goes on
    where the backup took it; returns the QEMU."""
    if os.path.exists(serial):
        os.remove(serial)
    qemu = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        check_resumed(qemu, serial, agent, before, after, how)
    except BaseException:
        stop(qemu)
        raise
    return qemu


def check_resumed(qemu, serial, agent, before, after, how):
    deadline = time.time() + 120
    while time.time() < deadline and not (os.path.exists(serial) and counters(serial)):
        if qemu.poll() is not None:
            break
        time.sleep(0.5)
    seen = counters(serial) if os.path.exists(serial) else []
    ok(bool(seen), f"{how}: the resumed guest prints its counter again "
                   f"({qemu.stderr.read()[-500:] if qemu.poll() is not None else 'running'})")
    if seen:
        print(f"  {how}: the counter went on at {seen[0]} (the backup began at {before}, "
              f"ended at {after})")
        ok(before <= seen[0] <= after + 1,
           f"{how}: the counter goes on from where the backup took it: {seen[0]} (the "
           f"backup began at {before} and ended at {after})")
        time.sleep(2)
        ok(counters(serial)[-1] > seen[0], f"{how}: and keeps counting")
    ok(agent.wait(60), f"{how}: the resumed guest's agent answers")
    uptime = float(agent.output("cut -d' ' -f1 /proc/uptime").strip() or 0)
    ok(uptime > 10, f"{how}: the guest did not boot again (uptime {uptime:.0f} s)")
    return qemu


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/ci/cairn")
    ap.add_argument("--dataset", default=os.environ.get("CAIRN_DATASET", ".data/small"))
    args = ap.parse_args()
    need_tools("vm_freeze", "qemu-system-x86_64", "qemu-img", "e2fsck", "debugfs")
    dataset = os.path.abspath(args.dataset)
    image = os.path.join(dataset, "vm-agent.raw")
    if not os.path.exists(image):
        sys.exit(f"vm_freeze: {image} is missing: build the dataset (scripts/build-dataset.sh)")
    binary = os.path.abspath(args.bin)
    work = tempfile.mkdtemp(prefix="cairn-vm-freeze-")
    qemu = None
    try:
        repo = os.path.join(work, "repo")
        cairn = Cairn(binary, repo, state=os.path.join(work, "state"), timeout=600)
        cairn.env["XDG_RUNTIME_DIR"] = os.path.join(work, "run")
        cairn.env["XDG_STATE_HOME"] = os.path.join(work, "xdg-state")  # overlays
        os.makedirs(cairn.env["XDG_RUNTIME_DIR"], mode=0o700)
        cairn.run("init")
        root = os.path.join(work, "root.qcow2")
        sh("qemu-img", "create", "-q", "-f", "qcow2", "-b", image, "-F", "raw", root)
        data = os.path.join(work, "data.qcow2")
        sh("qemu-img", "create", "-q", "-f", "qcow2", data, str(64 << 20))
        qmp, qga = os.path.join(work, "qmp.sock"), os.path.join(work, "qga.sock")
        qemu = subprocess.Popen(
            ["qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", "-cpu", "max",
             "-smp", "2", "-m", "512", "-nic", "none", "-display", "none", "-monitor", "none",
             "-serial", f"file:{os.path.join(work, 'serial.log')}",
             "-kernel", os.path.join(dataset, "boot", "vmlinuz"),
             "-initrd", os.path.join(dataset, "boot", "initrd.img"),
             "-append", "root=/dev/vda ro console=ttyS0",
             "-drive", f"if=none,id=root,format=qcow2,file={root}",
             "-device", "virtio-blk-pci,drive=root",
             "-drive", f"if=none,id=data,format=qcow2,file={data}",
             "-device", "virtio-blk-pci,drive=data",
             "-device", "virtio-serial-pci",
             "-chardev", f"socket,id=qga0,path={qga},server=on,wait=off",
             "-device", "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0",
             "-qmp", f"unix:{qmp},server=on,wait=off"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, start_new_session=True)
        wait_for(qga, qemu, "qemu-system-x86_64")
        agent = Agent(qga)
        started = time.time()
        up = agent.wait(BOOT_LIMIT)
        ok(up, f"the guest agent answers after boot ({time.time() - started:.0f} s)")
        if not up:
            return
        # The guest writes to its root file system all the time.
        agent.run("while :; do date +%s.%N >> /var/log/cairn-writer.log; sleep 0.01; done")
        time.sleep(2)
        backup = ["--json", "vm", "backup", "guest", "--qmp", qmp, "--guest-agent", qga,
                  "--scratch-dir", work, "--agent-timeout", "20"]
        lines = []
        for seq in (1, 2):
            p = cairn.run(*backup, check=False)
            out = json.loads(p.stdout) if p.returncode == 0 else None
            ok(out is not None, f"backup {seq}: {p.stderr.strip()}")
            if out is None:
                return
            ok(out["freeze"] == "frozen",
               f"backup {seq}: frozen by the guest agent ({out['freeze']}): {p.stderr.strip()}")
            print(f"  backup {seq}: guest paused {out['paused_s'] * 1000:.1f} ms, point in time "
                  f"{out['point_in_time_s'] * 1000:.1f} ms, {out['duration_s']:.1f} s in all")
            incremental = [d["incremental"] for d in out["disks"]]
            ok(incremental == [seq == 2] * 2, f"backup {seq}: incremental {incremental}")
            disk = next(d for d in out["disks"] if d["disk"] == "root")
            restored = os.path.join(work, f"root-{seq}.raw")
            cairn.run("restore", f"{disk['image']}@{disk['seq']}", restored)
            fsck = sh("e2fsck", "-fn", restored, check=False)
            ok(fsck.returncode == 0, f"backup {seq}: the root file system is clean, nothing to "
                                     f"recover (e2fsck {fsck.returncode}: "
                                     f"{(fsck.stdout + fsck.stderr).strip()[-300:]})")
            os.remove(restored)
            lines.append(int(agent.output("wc -l < /var/log/cairn-writer.log").strip() or 0))
            time.sleep(1)
        ok(lines[1] > lines[0] > 0, f"the guest kept writing through the backups ({lines})")
        status = agent.call("guest-fsfreeze-status")
        ok(status == "thawed", f"the guest is left thawed ({status})")
        qemu = memory_state(cairn, work, qemu, agent, qmp)
    finally:
        if qemu is not None:
            stop(qemu)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
    print(f"vm_freeze: {CHECKS.passed} passed, {CHECKS.failed} failed")
    sys.exit(1 if CHECKS.failed else 0)

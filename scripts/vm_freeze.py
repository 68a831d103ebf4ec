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
- the guest is left thawed (the agent says `thawed`).

    scripts/vm_freeze.py [--bin target/ci/cairn] [--dataset .data/small]

Needs qemu-system-x86 (qemu-system-x86_64), qemu-utils and e2fsprogs; installs nothing.
Prints "vm_freeze: N passed, 0 failed".
"""

import argparse
import base64
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
from qemu_helpers import need_tools, stop, wait_for  # noqa: E402

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/ci/cairn")
    ap.add_argument("--dataset", default=os.environ.get("CAIRN_DATASET", ".data/small"))
    args = ap.parse_args()
    need_tools("vm_freeze", "qemu-system-x86_64", "qemu-img", "e2fsck")
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
    finally:
        if qemu is not None:
            stop(qemu)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
    print(f"vm_freeze: {CHECKS.passed} passed, {CHECKS.failed} failed")
    sys.exit(1 if CHECKS.failed else 0)

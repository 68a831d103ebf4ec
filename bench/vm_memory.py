#!/usr/bin/env python3
"""A running VM's memory state: what `cairn vm backup --memory` stores, against the raw
migration stream, zstd of it, and QEMU's own `savevm` into a qcow2 (iROW's baseline, and the
way qcow2 users save a VM's memory today) (issue 55, item 3).

The VM: the dataset's vm-agent.raw (Debian with qemu-guest-agent) booted under QEMU (KVM
when QEMU can run on /dev/kvm, else TCG), 1 GiB of RAM, its root disk a qcow2 over the raw
image. Through the guest agent it gets a working set: the page cache of /usr (every file read once), 192 MiB
of random bytes in /dev/shm (incompressible, unlike most RAM), and a writer appending to a
log. Then three rounds, each after the guest changed some memory (64 MiB more random bytes in
/dev/shm, the page cache of /var read, in round 3 the first 64 MiB of random bytes rewritten):

1. the raw stream: QMP `migrate` to `exec:cat > FILE` (live; the guest then runs on, `cont`),
   its bytes, and `zstd -3` and `zstd -12 --long=30` of it (`-T0`);
2. `savevm`: QEMU's internal snapshot into the root qcow2 (stop-and-copy: the guest is paused
   for the whole save): its wall time and the bytes the qcow2 file grew by (allocated);
3. `cairn --json vm backup --memory`: the memory image's stored bytes (new for this version),
   the pause (QEMU's last pass + the disks' point in time), the copy's time.

One run (bytes do not vary; times are single samples, shown as such).

    bench/vm_memory.py [--bin target/ci/cairn] [--dataset DIR] [--out FILE]

Prints a Markdown table; writes bench/results/vm-memory-<date>.json (bench/report.py's
`vm-memory` renderer reads it).
"""

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
from checks import Cairn, sh  # noqa: E402
from qemu_helpers import Qmp, need_tools, stop, wait_for  # noqa: E402
from vm_freeze import Agent  # noqa: E402

MIB = 1 << 20
RAM_MIB = 1024


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] vm_memory: {msg}", file=sys.stderr, flush=True)


def dataset_dir(arg):
    for d in [arg, os.environ.get("CAIRN_DATASET"), os.path.join(ROOT, ".data/small")]:
        if d and os.path.exists(os.path.join(d, "vm-agent.raw")):
            return os.path.abspath(d)
    sys.exit("vm_memory: no dataset with vm-agent.raw (scripts/build-dataset.sh)")


def accel():
    """kvm when QEMU can run a vCPU on /dev/kvm (it may open and still fail: nested hosts),
    else tcg."""
    try:
        p = subprocess.run(["qemu-system-x86_64", "-machine", "q35", "-accel", "kvm", "-cpu",
                            "max", "-m", "64", "-nodefaults", "-display", "none", "-S",
                            "-qmp", "stdio"], input='{"execute":"qmp_capabilities"}\n'
                           '{"execute":"cont"}\n{"execute":"quit"}\n', capture_output=True,
                           text=True, timeout=20)
        return "kvm" if p.returncode == 0 else "tcg"
    except (OSError, subprocess.TimeoutExpired):
        return "tcg"


def guest(agent, shell, limit=600):
    """Runs `sh -c shell` in the guest and waits for it (at most `limit` seconds)."""
    pid = agent.run(shell)["pid"]
    deadline = time.time() + limit
    while time.time() < deadline:
        if agent.call("guest-exec-status", {"pid": pid}).get("exited"):
            return
        time.sleep(1)
    raise RuntimeError(f"guest command did not finish in {limit} s: {shell}")


def allocated(path):
    return os.stat(path).st_blocks * 512


def zstd_bytes(path, *level):
    p = subprocess.run(["zstd", "-q", "-c", "-T0", *level, path], stdout=subprocess.PIPE,
                       check=True)
    return len(p.stdout)


def raw_stream(q, path):
    """The live migration stream into `path`; the guest runs on after. Returns its bytes."""
    q.cmd("migrate", uri=f"exec:cat > {path}")
    while True:
        st = q.cmd("query-migrate")
        if st["status"] == "completed":
            break
        if st["status"] in ("failed", "cancelled"):
            raise RuntimeError(f"migrate: {st}")
        time.sleep(0.05)
    q.cmd("cont")
    return os.path.getsize(path)


def savevm(q, root, name):
    """QEMU's internal snapshot (vmstate into the root qcow2); (seconds, bytes it grew by)."""
    before = allocated(root)
    started = time.monotonic()
    out = q.cmd("human-monitor-command", **{"command-line": f"savevm {name}"})
    seconds = time.monotonic() - started
    if out.strip():
        raise RuntimeError(f"savevm: {out.strip()}")
    return seconds, allocated(root) - before


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/ci/cairn")
    ap.add_argument("--dataset")
    ap.add_argument("--out")
    args = ap.parse_args()
    need_tools("vm_memory", "qemu-system-x86_64", "qemu-img", "zstd")
    dataset = dataset_dir(args.dataset)
    work = tempfile.mkdtemp(prefix="cairn-vm-memory-", dir="/var/tmp")
    binary = os.path.join(work, "cairn")
    shutil.copy(args.bin, binary)
    cairn = Cairn(binary, os.path.join(work, "repo"), state=os.path.join(work, "state"),
                  timeout=900)
    cairn.env["XDG_RUNTIME_DIR"] = os.path.join(work, "run")
    os.makedirs(cairn.env["XDG_RUNTIME_DIR"], mode=0o700)
    cairn.run("init")
    root = os.path.join(work, "root.qcow2")
    sh("qemu-img", "create", "-q", "-f", "qcow2", "-b",
       os.path.join(dataset, "vm-agent.raw"), "-F", "raw", root)
    qmp_sock, qga = os.path.join(work, "qmp.sock"), os.path.join(work, "qga.sock")
    mon = os.path.join(work, "mon.sock")  # the bench's own monitor (cairn holds the other)
    how = accel()
    qemu = subprocess.Popen(
        ["qemu-system-x86_64", "-machine", "q35", "-accel", how, "-cpu", "max",
         "-smp", "2", "-m", str(RAM_MIB), "-nic", "none", "-display", "none",
         "-monitor", "none", "-serial", "none",
         "-kernel", os.path.join(dataset, "boot", "vmlinuz"),
         "-initrd", os.path.join(dataset, "boot", "initrd.img"),
         "-append", "root=/dev/vda ro console=ttyS0",
         "-drive", f"if=none,id=root,format=qcow2,file={root}",
         "-device", "virtio-blk-pci,drive=root",
         "-device", "virtio-serial-pci",
         "-chardev", f"socket,id=qga0,path={qga},server=on,wait=off",
         "-device", "virtserialport,chardev=qga0,name=org.qemu.guest_agent.0",
         "-qmp", f"unix:{qmp_sock},server=on,wait=off",
         "-qmp", f"unix:{mon},server=on,wait=off"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    rounds = []
    try:
        wait_for(qga, qemu, "qemu-system-x86_64")
        agent = Agent(qga)
        log(f"booting ({how})")
        deadline = time.time() + 900
        while not agent.wait(10):
            if qemu.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"the guest agent never answered: {qemu.stderr.read()}")
        log("the working set")
        guest(agent, "find /usr -type f -size -8M -exec cat {} + > /dev/null 2>&1; "
                     "head -c 192M /dev/urandom > /dev/shm/r0")
        agent.run("while :; do date +%s.%N >> /var/log/cairn-writer.log; sleep 0.05; done")
        q = Qmp(mon)
        changes = ["head -c 64M /dev/urandom > /dev/shm/r1",
                   "find /var -type f -size -8M -exec cat {} + > /dev/null 2>&1",
                   "dd if=/dev/urandom of=/dev/shm/r0 bs=1M count=64 conv=notrunc "
                   "2>/dev/null"]
        for n in (1, 2, 3):
            if n > 1:
                guest(agent, changes[n - 2] + "; " + (changes[2] if n == 3 else "true"))
            time.sleep(2)
            log(f"round {n}: raw stream, zstd")
            stream = os.path.join(work, f"stream-{n}")
            r = {"round": n, "stream_bytes": raw_stream(q, stream)}
            r["zstd3_bytes"] = zstd_bytes(stream, "-3")
            r["zstd12_bytes"] = zstd_bytes(stream, "-12", "--long=30")
            os.remove(stream)
            log(f"round {n}: savevm")
            r["savevm_s"], r["savevm_grew_bytes"] = savevm(q, root, f"s{n}")
            log(f"round {n}: cairn vm backup --memory")
            started = time.monotonic()
            out = json.loads(cairn.run("--json", "vm", "backup", "guest", "--qmp", qmp_sock,
                                       "--scratch-dir", work, "--memory").stdout)
            r["cairn_wall_s"] = time.monotonic() - started
            m = out["memory_state"]
            r.update({
                "ram_bytes": m["ram_bytes"], "data_bytes": m["data_bytes"],
                "cairn_stream_bytes": m["stream_bytes"],
                "cairn_new_chunk_bytes": m["new_chunk_bytes"],
                "cairn_stored_bytes": m["stored_bytes"],
                "cairn_copy_s": m["copy_s"], "cairn_downtime_s": m["downtime_s"],
                "cairn_paused_s": out["paused_s"],
            })
            rounds.append(r)
            log(json.dumps(r))
    finally:
        stop(qemu)
        shutil.rmtree(work, ignore_errors=True)
    day = datetime.date.today().isoformat()
    result = {"date": day, "accel": how, "ram_mib": RAM_MIB, "rounds": rounds}
    out = args.out or os.path.join(ROOT, "bench", "results", f"vm-memory-{day}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print("| round | RAM MiB | pages with data MiB | stream MiB | zstd -3 | zstd -12 | "
          "savevm grew | cairn stored | savevm pause s | cairn pause ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rounds:
        print(f"| {r['round']} | {r['ram_bytes'] / MIB:.0f} | {r['data_bytes'] / MIB:.1f} | "
              f"{r['stream_bytes'] / MIB:.1f} | {r['zstd3_bytes'] / MIB:.1f} | "
              f"{r['zstd12_bytes'] / MIB:.1f} | {r['savevm_grew_bytes'] / MIB:.1f} | "
              f"{r['cairn_stored_bytes'] / MIB:.1f} | {r['savevm_s']:.2f} | "
              f"{r['cairn_paused_s'] * 1000:.0f} |")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

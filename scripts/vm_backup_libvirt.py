#!/usr/bin/env python3
"""`cairn vm backup --domain` against a real libvirt daemon, end to end.

Uses the host's libvirt daemon when one answers on qemu:///system; otherwise starts its own
(virtlogd and libvirtd as children, creating the libvirt-qemu user and group Debian's
libvirt-daemon-system package would create; needs root) and stops it at the end. The domain
is transient (`virsh create`): machine `pc` under TCG with no operating system (the BIOS finds
nothing to boot and waits), two qcow2 disks (vda, vdb) and a guest agent channel with no
agent behind it. The "guest" writes through HMP `qemu-io` over `virsh qemu-monitor-command`.

Checks:
- the first backup reads each disk whole, the next only what was written (libvirt's
  incremental backup from the checkpoint the last VM version started), and each VM version's
  disks restore bit for bit to the domain's disks at that point (written nothing meanwhile);
- a guest agent channel nobody answers: the backup goes on unfrozen after --agent-timeout and
  records `no_answer`;
- after each backup libvirt holds no backup job, exactly one cairn checkpoint, and no
  scratch file is left;
- kill -9 of cairn while it reads: no VM version; the next backup ends the stale job, says
  so, and still reads only what changed;
- the recorded configuration is the domain XML; a domain that does not exist is one clear
  error line;
- `--all` backs up every running domain as the VM of its name;
- `vm restore --define NAME` defines a new domain on the restored disks, which starts; a
  domain of that name is never defined over;
- `--memory` is refused in one line, committing nothing;
- with --dataset: the dataset's vm-agent.raw booted as a second domain, its guest agent
  answering through libvirt: backups are frozen by the agent, the root file system restores
  e2fsck-clean, and the guest is left thawed.

    scripts/vm_backup_libvirt.py [--bin target/ci/cairn] [--dataset .data/small]

Needs libvirt-daemon, libvirt-daemon-driver-qemu, libvirt-clients, qemu-system-x86 and
qemu-utils; installs nothing. Prints "vm_backup_libvirt: N passed, 0 failed".
"""

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Cairn, Checks, sh  # noqa: E402
from qemu_helpers import need_tools, stop  # noqa: E402

CHECKS = Checks()
ok = CHECKS.ok

DISK = 64 << 20
DOMAIN = "cairn-vm-backup-test"
TARGETS = ("vda", "vdb")
URI = "qemu:///system"


def virsh(*args, check=True):
    return sh("virsh", "-q", "--connect", URI, *args, check=check, timeout=120)


class Daemons:
    """The host's libvirt when it answers, else our own virtlogd + libvirtd."""

    def __init__(self):
        self.procs = []
        if virsh("version", check=False).returncode == 0:
            return
        if os.geteuid() != 0:
            sys.exit("vm_backup_libvirt: no libvirt daemon answers and starting one needs root")
        if subprocess.run(["getent", "group", "libvirt-qemu"], capture_output=True).returncode:
            sh("groupadd", "--system", "libvirt-qemu")
        if subprocess.run(["id", "libvirt-qemu"], capture_output=True).returncode:
            sh("useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
               "-g", "libvirt-qemu", "libvirt-qemu")
        for d in ("/var/log/libvirt", "/run/libvirt", "/var/lib/libvirt/qemu"):
            os.makedirs(d, exist_ok=True)
        for cmd in (["virtlogd"], ["libvirtd"]):
            self.procs.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL,
                                               stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL,
                                               start_new_session=True))
        for _ in range(200):
            if virsh("version", check=False).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError("libvirtd did not answer in 20 s (see /var/log/libvirt/libvirtd.log)")

    def stop(self):
        for p in reversed(self.procs):
            stop(p)


def domain_xml(work):
    disks = "".join(
        f"""<disk type='file' device='disk'><driver name='qemu' type='qcow2'/>
          <source file='{work}/{t}.qcow2'/><target dev='{t}' bus='virtio'/></disk>"""
        for t in TARGETS)
    return f"""<domain type='qemu'><name>{DOMAIN}</name><memory unit='MiB'>64</memory>
      <vcpu>1</vcpu><os><type arch='x86_64' machine='pc'>hvm</type></os>
      <devices><emulator>/usr/bin/qemu-system-x86_64</emulator>{disks}
        <channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>
      </devices></domain>"""


def write(target, offset, byte, length):
    idx = TARGETS.index(target)
    out = virsh("qemu-monitor-command", DOMAIN, "--hmp",
                f'qemu-io -d /machine/peripheral/virtio-disk{idx}/virtio-backend '
                f'"write -P {byte} {offset} {length}"').stdout
    if out.strip() and "wrote" not in out:
        raise RuntimeError(f"qemu-io on {target}: {out.strip()}")


def flush():
    for i in range(len(TARGETS)):
        virsh("qemu-monitor-command", DOMAIN, "--hmp",
              f'qemu-io -d /machine/peripheral/virtio-disk{i}/virtio-backend "flush"')


GUEST = "cairn-vm-agent-test"
BOOT_LIMIT = 300


def agent(*command, check=True):
    """A guest agent command through libvirt (which owns the agent's channel)."""
    msg = {"execute": command[0]}
    if len(command) > 1:
        msg["arguments"] = command[1]
    p = virsh("qemu-agent-command", GUEST, json.dumps(msg), check=check)
    return json.loads(p.stdout)["return"] if p.returncode == 0 else None


def real_guest(cairn, work, scratch, dataset):
    """The dataset's vm-agent.raw booted under libvirt (TCG), its guest agent running and a
    writer appending to a log: backups frozen by the agent through libvirt's freeze, the
    root file system restoring e2fsck-clean (nothing to recover), the guest left thawed and
    still writing."""
    image = os.path.join(dataset, "vm-agent.raw")
    if not os.path.exists(image):
        ok(False, f"{image} is missing: build the dataset (scripts/build-dataset.sh)")
        return
    # libvirt hands every file of the disk's chain and the kernel to QEMU's user: copies,
    # never the dataset's own files.
    files = {}
    for name, src in (("base.raw", image),
                      ("vmlinuz", os.path.join(dataset, "boot", "vmlinuz")),
                      ("initrd.img", os.path.join(dataset, "boot", "initrd.img"))):
        files[name] = os.path.join(work, f"guest-{name}")
        sh("cp", "--sparse=always", src, files[name])
    root = os.path.join(work, "guest-root.qcow2")
    sh("qemu-img", "create", "-q", "-f", "qcow2", "-b", files["base.raw"], "-F", "raw", root)
    xml = os.path.join(work, "guest.xml")
    with open(xml, "w") as f:
        f.write(f"""<domain type='qemu'><name>{GUEST}</name><memory unit='MiB'>512</memory>
          <vcpu>2</vcpu><os><type arch='x86_64' machine='q35'>hvm</type>
          <kernel>{files['vmlinuz']}</kernel><initrd>{files['initrd.img']}</initrd>
          <cmdline>root=/dev/vda ro console=ttyS0</cmdline></os>
          <devices><emulator>/usr/bin/qemu-system-x86_64</emulator>
            <disk type='file' device='disk'><driver name='qemu' type='qcow2'/>
              <source file='{root}'/><target dev='vda' bus='virtio'/></disk>
            <channel type='unix'><target type='virtio' name='org.qemu.guest_agent.0'/></channel>
          </devices></domain>""")
    try:
        virsh("create", xml)
        started, up = time.time(), False
        while not up and time.time() - started < BOOT_LIMIT:
            up = agent("guest-ping", check=False) is not None
            time.sleep(2)
        ok(up, f"the guest's agent answers through libvirt ({time.time() - started:.0f} s)")
        if not up:
            return
        agent("guest-exec", {"path": "/bin/sh", "arg": [
            "-c", "while :; do date +%s.%N >> /var/log/cairn-writer.log; sleep 0.01; done"]})
        time.sleep(2)
        for seq in (1, 2):
            p = cairn.run("--json", "vm", "backup", "guest", "--domain", GUEST, "--connect",
                          URI, "--scratch-dir", scratch, "--agent-timeout", "20", check=False)
            out = json.loads(p.stdout) if p.returncode == 0 else None
            ok(out is not None, f"libvirt backup {seq} of a booted guest: {p.stderr.strip()}")
            if out is None:
                return
            ok(out["freeze"] == "frozen", f"backup {seq}: frozen by the guest agent through "
                                          f"libvirt ({out['freeze']}): {p.stderr.strip()}")
            ok([d["incremental"] for d in out["disks"]] == [seq == 2],
               f"backup {seq}: {'only changes' if seq == 2 else 'whole'} read")
            disk = out["disks"][0]
            restored = os.path.join(work, f"guest-root-{seq}.raw")
            cairn.run("restore", f"{disk['image']}@{disk['seq']}", restored)
            fsck = sh("e2fsck", "-fn", restored, check=False)
            ok(fsck.returncode == 0, f"backup {seq}: the root file system is clean, nothing to "
                                     f"recover (e2fsck {fsck.returncode}: "
                                     f"{(fsck.stdout + fsck.stderr).strip()[-300:]})")
            os.remove(restored)
        status = agent("guest-fsfreeze-status")
        ok(status == "thawed", f"the guest is left thawed ({status})")
    finally:
        virsh("destroy", GUEST, check=False)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/ci/cairn")
    ap.add_argument("--dataset", help="also back up the dataset's vm-agent.raw booted")
    args = ap.parse_args()
    need_tools("vm_backup_libvirt", "virsh", "libvirtd", "virtlogd", "qemu-system-x86_64",
               "qemu-img")
    binary = os.path.abspath(args.bin)
    work = tempfile.mkdtemp(prefix="cairn-vm-libvirt-")
    os.chmod(work, 0o755)  # QEMU runs as libvirt-qemu and opens the disks here
    scratch = os.path.join(work, "scratch")
    os.makedirs(scratch)
    os.chmod(scratch, 0o777)  # libvirt creates the scratch images for QEMU's user
    daemons = Daemons()
    try:
        repo = os.path.join(work, "repo")
        cairn = Cairn(binary, repo, state=os.path.join(work, "state"), timeout=300)
        cairn.env["XDG_RUNTIME_DIR"] = os.path.join(work, "run")
        os.makedirs(cairn.env["XDG_RUNTIME_DIR"], mode=0o700)
        cairn.run("init")
        for t in TARGETS:
            sh("qemu-img", "create", "-q", "-f", "qcow2", os.path.join(work, f"{t}.qcow2"), DISK)
        xml = os.path.join(work, "domain.xml")
        with open(xml, "w") as f:
            f.write(domain_xml(work))
        virsh("create", xml)
        for i in range(16):
            write(TARGETS[i % 2], i * (1 << 20), i + 1, 1 << 20)
        backup = ["vm", "backup", "lv", "--domain", DOMAIN, "--connect", URI,
                  "--scratch-dir", scratch, "--agent-timeout", "1"]

        def run_backup(*extra):
            p = cairn.run("--json", *backup, *extra, check=False)
            return (json.loads(p.stdout) if p.returncode == 0 else None), p

        def clean(what):
            job = virsh("domjobinfo", DOMAIN, check=False).stdout
            ok("Backup" not in job, f"{what}: no backup job left in libvirt")
            cps = [c for c in virsh("checkpoint-list", DOMAIN, "--name").stdout.split()
                   if c.startswith("cairn-")]
            ok(len(cps) == 1, f"{what}: one cairn checkpoint, not {cps}")
            left = [f for f in os.listdir(scratch)]
            ok(not left, f"{what}: no scratch file left ({left})")

        def same_as_live(seq, what):
            flush()
            show = cairn.json("vm", "show", f"lv@{seq}")
            for d in show["disks"]:
                path = os.path.join(work, f"r{seq}-{d['disk']}.raw")
                cairn.run("restore", f"{d['image']}@{d['seq']}", path)
                cmp = sh("qemu-img", "compare", "-U", "-f", "raw", "-F", "qcow2", path,
                         os.path.join(work, f"{d['disk']}.qcow2"), check=False)
                ok(cmp.returncode == 0, f"{what}: lv@{seq} {d['disk']} is the domain's disk "
                                        f"bit for bit: {cmp.stdout.strip()}")

        first, p = run_backup("-m", "first")
        ok(first is not None, f"the first libvirt backup: {p.stderr.strip()}")
        ok(all(not d["incremental"] for d in first["disks"])
           and {d["disk"] for d in first["disks"]} == set(TARGETS),
           f"the first backup reads vda and vdb whole: {first['disks']}")
        ok(first["freeze"] == "no_answer" and "did not freeze" in p.stderr,
           f"an agent channel nobody answers: unfrozen, said, recorded: {p.stderr.strip()}")
        same_as_live(1, "first")
        clean("after lv@1")

        write("vda", 5 << 20, 0x51, 64 << 10)
        write("vdb", 9 << 20, 0x52, 128 << 10)
        second, p = run_backup()
        ok(second is not None and all(d["incremental"] for d in second["disks"]),
           f"the second backup is incremental: {p.stderr.strip()}")
        if second:
            reads = {d["disk"]: d["read_bytes"] for d in second["disks"]}
            ok(reads["vda"] <= 2 * (64 << 10) and reads["vdb"] <= 3 * (64 << 10)
               and reads["vda"] > 0, f"only the written blocks are read: {reads}")
        same_as_live(2, "incremental")
        clean("after lv@2")

        # kill -9 of cairn while it reads.
        write("vda", 0, 0x61, 16 << 20)
        proc = subprocess.Popen([binary, "--repo", repo, "-q", *backup, "--rate-limit", "2"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                env=cairn.env)
        deadline = time.time() + 60
        while time.time() < deadline and proc.poll() is None:
            if "Backup" in virsh("domjobinfo", DOMAIN, check=False).stdout:
                break
            time.sleep(0.05)
        time.sleep(1)
        proc.kill()
        proc.wait()
        ok(proc.returncode == -signal.SIGKILL, "cairn was killed while it read")
        ok(len(cairn.json("vm", "log", "lv")) == 2, "a killed backup publishes nothing")
        third, p = run_backup()
        ok(third is not None and "removed what an earlier backup left: a backup job" in p.stderr,
           f"the next backup ends the stale job and says so: {p.stderr.strip()}")
        ok(third is not None and all(d["incremental"] for d in third["disks"]),
           "... and still reads only what changed")
        same_as_live(3, "after a kill")
        clean("after lv@3")

        show = cairn.json("vm", "show", "lv@3")
        ok(show["config_kind"] == "libvirt_xml" and f"<name>{DOMAIN}</name>" in show["config"],
           "the domain XML is the recorded configuration")
        p = cairn.run("vm", "backup", "lv", "--domain", "no-such-domain", "--connect", URI,
                      check=False)
        ok(p.returncode == 1 and p.stderr.count("cairn: error:") == 1
           and "no-such-domain" in p.stderr, f"an unknown domain: one line: {p.stderr.strip()}")
        p = cairn.run("--json", "vm", "backup", "--all", "--connect", URI, "--scratch-dir",
                      scratch, "--agent-timeout", "1", check=False)
        out = json.loads(p.stdout) if p.returncode == 0 else []
        ok([o.get("vm") for o in out] == [DOMAIN] and out[0]["seq"] == 1,
           f"--all backs up every running domain as the VM of its name: {p.stderr.strip()}")
        # Restore with --define: a new domain on the restored disks, which starts.
        restored = os.path.join(work, "restored")
        p = cairn.run("--json", "vm", "restore", "lv@3", "--to", restored, "--define",
                      "lv-restored", "--connect", URI, check=False)
        out = json.loads(p.stdout) if p.returncode == 0 else {}
        ok(out.get("domain", {}).get("defined") is True, f"vm restore --define: {p.stderr}")
        if out:
            blk = virsh("domblklist", "lv-restored", check=False).stdout
            ok(all(os.path.join(restored, f"{t}.raw") in blk for t in TARGETS),
               f"the defined domain's disks are the restored files:\n{blk}")
            st = virsh("start", "lv-restored", check=False)
            ok(st.returncode == 0, f"the defined domain starts: {st.stderr.strip()}")
            virsh("destroy", "lv-restored", check=False)
            p = cairn.run("vm", "restore", "lv@3", "--to", restored, "--force", "--define",
                          "lv-restored", "--connect", URI, check=False)
            ok(p.returncode == 1 and "lv-restored exists" in p.stderr,
               f"a domain of that name is never defined over: {p.stderr.strip()}")
            virsh("undefine", "lv-restored", check=False)
        p = cairn.run(*backup, "--memory", check=False)
        ok(p.returncode == 2 and "--memory needs --qmp" in p.stderr
           and p.stderr.count("cairn: error:") == 1,
           f"--memory through libvirt is refused in one line: {p.stderr.strip()}")
        ok(cairn.json("vm", "log", "lv")[0]["seq"] == 3, "and commits nothing")
        ok(cairn.run("verify", check=False).returncode == 0, "verify is clean")
        if args.dataset:
            real_guest(cairn, work, scratch, os.path.abspath(args.dataset))
    finally:
        virsh("destroy", DOMAIN, check=False)
        daemons.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(f"vm_backup_libvirt: {CHECKS.passed} passed, {CHECKS.failed} failed")
    sys.exit(1 if CHECKS.failed else 0)


if __name__ == "__main__":
    main()

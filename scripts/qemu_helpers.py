"""QEMU helpers shared by cairn's Python test scripts (formats.py, pullmode_backup.py).

- `need_tools(script, *tools)`: exits with one clear line naming the missing tools (and the
  Debian packages that hold them); the scripts install nothing themselves.
- `Qmp`: a minimal QMP client over a Unix socket (commands, transactions, events kept).
- `wait_for(path, proc, what)`: waits for a socket a child process creates.
- `stop(proc)`: SIGTERM, then SIGKILL, of a child (its whole process group when it has one).
- `vm_start(cairn, spec, socket)`: `cairn vm start` in the background, with the plan it
  printed, once its exports serve.
- `StorageDaemon`: a qemu-storage-daemon with block nodes given as `--blockdev` options, an
  NBD server and a QMP monitor, both on Unix sockets.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

# Where Debian 12 keeps each tool these scripts use.
PACKAGES = {
    "qemu-storage-daemon": "qemu-system-common",
    "qemu-img": "qemu-utils",
    "qemu-io": "qemu-utils",
    "qemu-nbd": "qemu-utils",
    "nbdcopy": "libnbd-bin",
    "nbdinfo": "libnbd-bin",
    "fincore": "util-linux",
    "losetup": "mount",
}


def need_tools(script, *tools):
    """Exits (status 1) with one line if any of `tools` is not on PATH."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pkgs = sorted({PACKAGES.get(t, t) for t in missing})
        sys.exit(f"{script}: missing tool(s): {', '.join(missing)} "
                 f"(install: apt-get install {' '.join(pkgs)})")


class Qmp:
    """A minimal QMP client over a unix socket. Events that arrive while waiting for a
    command's answer are kept in `events`."""

    def __init__(self, path):
        for _ in range(100):
            try:
                self.s = socket.socket(socket.AF_UNIX)
                self.s.connect(path)
                break
            except OSError:
                self.s.close()
                time.sleep(0.1)
        else:
            raise RuntimeError(f"QMP socket {path} did not appear")
        self.f = self.s.makefile("rw")
        json.loads(self.f.readline())  # greeting
        self.events = []
        self.sent = []  # every (command, arguments) sent, in order
        self.cmd("qmp_capabilities")

    def cmd(self, command, **args):
        self.sent.append((command, args))
        self.f.write(json.dumps({"execute": command, "arguments": args}) + "\n")
        self.f.flush()
        while True:
            line = self.f.readline()
            if not line:
                raise RuntimeError(f"QMP {command}: the monitor closed the connection")
            msg = json.loads(line)
            if "return" in msg:
                return msg["return"]
            if "error" in msg:
                raise RuntimeError(f"QMP {command}: {msg['error']}")
            if "event" in msg:
                self.events.append(msg)

    def close(self):
        """Lets another client have the monitor (QEMU serves one at a time)."""
        self.f.close()
        self.s.close()

    def transaction(self, *actions):
        """Runs `actions` ((type, data) pairs) atomically: all or none."""
        return self.cmd("transaction", actions=[{"type": t, "data": d} for t, d in actions])

    def close(self):
        try:
            self.f.close()
            self.s.close()
        except OSError:
            pass


def wait_for(path, proc, what):
    for _ in range(200):
        if os.path.exists(path):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited: {proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.05)
    raise RuntimeError(f"{what}: {path} did not appear")


def stop(proc):
    """Stops a child: SIGTERM, then SIGKILL after 10 s. A child started with
    `start_new_session=True` is stopped with its whole process group."""
    if proc.poll() is not None:
        return

    def signal_it(sig):
        try:
            if os.getpgid(proc.pid) == proc.pid:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except ProcessLookupError:
            pass

    signal_it(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        signal_it(signal.SIGKILL)
        proc.wait()


def vm_start(cairn, spec, socket, *extra):
    """Starts `cairn --json vm start SPEC --socket SOCKET EXTRA...` (a `checks.Cairn`'s
    binary, repository and environment); returns (process, plan) once its exports serve. The
    caller stops the process."""
    starter = subprocess.Popen([cairn.binary, "--repo", cairn.repo, "--json", "vm", "start",
                                spec, "--socket", socket, *extra],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=cairn.env, start_new_session=True)
    try:
        text = ""
        while True:  # the plan: one JSON object, printed over several lines
            line = starter.stdout.readline()
            if not line:
                raise RuntimeError(f"vm start printed no plan: {starter.stderr.read()}")
            text += line
            try:
                plan = json.loads(text)
                break
            except ValueError:
                continue
        wait_for(socket, starter, "cairn vm start")
    except BaseException:
        stop(starter)
        raise
    return starter, plan


class StorageDaemon:
    """qemu-storage-daemon with the given `--blockdev` option strings, an NBD server on
    `work/<prefix>nbd.sock` and a QMP monitor on `work/<prefix>qmp.sock` (connected: `qmp`).
    Exports are added over QMP (`export`)."""

    def __init__(self, work, blockdevs, prefix="qsd-", nbd_over_qmp=False):
        """`nbd_over_qmp`: start the NBD server with QMP's nbd-server-start, as on a QEMU
        started without one, rather than on the command line."""
        self.sock = os.path.join(work, f"{prefix}nbd.sock")
        self.qmp_sock = os.path.join(work, f"{prefix}qmp.sock")
        args = ["qemu-storage-daemon"]
        for b in blockdevs:
            args += ["--blockdev", b]
        if not nbd_over_qmp:
            args += ["--nbd-server", f"addr.type=unix,addr.path={self.sock}"]
        args += ["--chardev", f"socket,id=qmp0,path={self.qmp_sock},server=on,wait=off",
                 "--monitor", "chardev=qmp0"]
        self.qmp = None
        self.proc = subprocess.Popen(args, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        try:
            wait_for(self.qmp_sock, self.proc, "qemu-storage-daemon")
            self.qmp = Qmp(self.qmp_sock)
            if nbd_over_qmp:
                self.qmp.cmd("nbd-server-start",
                             addr={"type": "unix", "data": {"path": self.sock}})
        except Exception:
            self.stop()
            raise

    def url(self, name):
        return f"nbd+unix:///{name}?socket={self.sock}"

    def export(self, export_id, node, name, writable=False, bitmaps=()):
        args = {"type": "nbd", "id": export_id, "node-name": node, "name": name,
                "writable": writable}
        if bitmaps:
            args["bitmaps"] = list(bitmaps)
        self.qmp.cmd("block-export-add", **args)

    def export_del(self, export_id):
        """Removes an export and waits until it is gone (its clients disconnected), so the
        nodes and bitmaps it used are free again."""
        self.qmp.cmd("block-export-del", id=export_id)
        for _ in range(200):
            if all(e["id"] != export_id for e in self.qmp.cmd("query-block-exports")):
                return
            time.sleep(0.05)
        raise RuntimeError(f"export {export_id} did not go away")

    def stop(self):
        if self.qmp is not None:
            self.qmp.close()
        stop(self.proc)
        for s in (self.sock, self.qmp_sock):
            if os.path.exists(s):
                os.unlink(s)

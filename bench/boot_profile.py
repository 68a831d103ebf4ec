#!/usr/bin/env python3
"""Boot profiles (issue 56): a cold lazy boot with and without the profile an earlier boot
recorded, and the recorded reads replayed by an NBD client.

The dataset's `su-*` images are committed in order as versions of one image; U is the newest,
V the one before. In one run:

- QEMU (TCG: no KVM here) boots U's file to the systemd marker (the local baseline);
- V boots over `cairn export --record-profile P` with a cold cache (this records P);
- U boots over a cold export, without P and then with `--profile P`;
- P's reads are replayed in order, one at a time, by `qemu-io` (an NBD client) against
  `qemu-nbd` serving U's file, a cold export of U, and a cold export of U with `--profile P`:
  once as fast as they go (the export's share bare: under TCG the guest's own slowness hides
  most of it in a boot), and once at the guest's pace, each read after the think time P
  recorded before it (`think_us`: the time the guest spent with no read outstanding). Each
  replay reports its wall time and the sum of its reads' latencies (the time it waited on
  the disk).

Every export has a cache of its own. With `--s3` the repository is a prefix under
$CAIRN_TEST_S3_URL (run under scripts/minio.sh).

    bench/boot_profile.py --dataset .data/small --bin target/ci/cairn [--s3] [--out FILE]
        [--no-boots] [--profile-in FILE | --profile-out FILE]

`--profile-in` replays a profile recorded before instead of recording one (no boot needed);
`--profile-out` keeps the one recorded; `--no-boots` measures the replays only.

Prints one JSON document (also written to --out).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from in_place import emit, parse_args, series_repo  # noqa: E402

EXTRA = ("--no-boots", "--profile-in", "--profile-out")


def extra_args():
    """This benchmark's own options, taken out of argv before the shared parser sees it."""
    out = {"no_boots": False, "profile_in": None, "profile_out": None}
    rest = [sys.argv[0]]
    it = iter(sys.argv[1:])
    for a in it:
        if a == "--no-boots":
            out["no_boots"] = True
        elif a in ("--profile-in", "--profile-out"):
            out[a[2:].replace("-", "_")] = next(it)
        else:
            rest.append(a)
    sys.argv = rest
    return out


def boot(dataset, drive, log):
    """Boots to the systemd marker under TCG; (wall seconds, guest uptime at the marker)."""
    start = time.monotonic()
    qemu = subprocess.Popen(
        ["qemu-system-x86_64", "-machine", "q35", "-accel", "tcg", "-cpu", "max", "-smp", "2",
         "-m", "1024", "-nic", "none", "-display", "none", "-monitor", "none",
         "-serial", f"file:{log}", "-no-reboot",
         "-kernel", os.path.join(dataset, "boot", "vmlinuz"),
         "-initrd", os.path.join(dataset, "boot", "initrd.img"),
         "-append", "root=/dev/vda ro console=ttyS0 quiet",
         "-drive", f"{drive},format=raw,if=virtio,snapshot=on"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            text = open(log, errors="replace").read() if os.path.exists(log) else ""
            if "SYSTEMD-MARKER-REACHED" in text:
                wall = time.monotonic() - start
                up = float(text.split("SYSTEMD-MARKER-REACHED uptime=")[1].split()[0])
                return round(wall, 2), up
            if qemu.poll() is not None:
                sys.exit(f"qemu exited before the marker: {text[-400:]}")
            if time.monotonic() - start > 600:
                sys.exit("no marker after 600 s")
            time.sleep(0.1)
    finally:
        qemu.kill()
        qemu.wait()


class Export:
    """`cairn export SPEC EXTRA...` on a socket, with a cache of its own (or `cache`)."""

    def __init__(self, c, work, spec, name, extra=(), cache=None):
        self.dir = os.path.join(work, name)
        os.makedirs(self.dir)
        self.sock = os.path.join(self.dir, "e.sock")
        self.stats_file = os.path.join(self.dir, "stats.json")
        self.proc = subprocess.Popen(
            c.args("--json", "export", spec, "--name", "disk", "--socket", self.sock,
                   "--cache-dir", cache or os.path.join(self.dir, "cache"),
                   "--stats-file", self.stats_file, *extra),
            env=dict(c.env, CAIRN_RUN_DIR=os.path.join(self.dir, "run")),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        if not self.proc.stdout.readline():
            sys.exit(f"export {name} did not start: {self.proc.stderr.read().strip()}")
        self.uri = f"nbd+unix:///disk?socket={self.sock}"

    def stop(self):
        """Stops it; its counters."""
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait()
        with open(self.stats_file) as f:
            s = json.load(f)
        return {k: s[k] for k in ("read_bytes", "fetched_bytes", "prefetched_bytes",
                                  "cache_hits", "cache_misses")}


def replay(uri, reads, think_us=None):
    """P's reads, in order, one at a time, by qemu-io, each after its think time when
    `think_us` is given (qemu-io sleeps whole milliseconds: the remainder carries over);
    {seconds, waited_s: the sum of the reads' latencies}."""
    cmds = []
    owed_us = 0
    for i, (off, length) in enumerate(reads):
        if think_us:
            owed_us += think_us[i]
            if owed_us >= 1000:
                cmds += ["-c", f"sleep {owed_us // 1000}"]
                owed_us %= 1000
        cmds += ["-c", f"read {off} {length}"]
    t = time.monotonic()
    p = subprocess.run(["qemu-io", "-r", "-f", "raw", *cmds, uri], capture_output=True, text=True)
    if p.returncode != 0 or "failed" in p.stdout + p.stderr:
        sys.exit(f"replay against {uri}: {p.stderr.strip()[-400:]}")
    seconds = time.monotonic() - t
    # Each read prints "..., 1 ops; 00.00 sec (... and R ops/sec)": its latency is 1/R.
    rates = [float(line.rsplit(" and ", 1)[1].split()[0])
             for line in p.stdout.splitlines() if line.endswith("ops/sec)")]
    if len(rates) != len(reads):
        sys.exit(f"replay against {uri}: {len(rates)} timings for {len(reads)} reads")
    return {"seconds": round(seconds, 3), "waited_s": round(sum(1 / r for r in rates), 3)}


def main():
    extra = extra_args()
    args, images = parse_args(__doc__)
    work = tempfile.mkdtemp(prefix="cairn-boot-profile-", dir=os.environ.get("BENCH_WORK"))
    try:
        c = series_repo(args, images, work, "boot-profile")
        n = len(images)
        u_file = images[-1]
        u, v = f"su@{n}", f"su@{n - 1}"
        ds = args.dataset
        profile = os.path.join(work, "su.boot.json")
        result = {"date": time.strftime("%Y-%m-%d"), "store": "s3" if args.s3 else "local",
                  "booted": os.path.basename(u_file)[:-4],
                  "recorded_on": os.path.basename(images[-2])[:-4]}
        boots = {}
        if extra["profile_in"]:
            shutil.copy(extra["profile_in"], profile)
        else:
            e = Export(c, work, v, "record", ["--record-profile", profile])
            boot(ds, f"file={e.uri}", os.path.join(work, "record.log"))
            e.stop()
        if extra["profile_out"]:
            shutil.copy(profile, extra["profile_out"])
        with open(profile) as f:
            p = json.load(f)
        think = p.get("think_us")
        result["profile"] = {"reads": len(p["reads"]),
                             "bytes": sum(length for _, length in p["reads"]),
                             "think_s": round(sum(think) / 1e6, 2) if think else None}
        if not extra["no_boots"]:
            boots["local"] = dict(zip(("wall_s", "uptime_s"),
                                      boot(ds, f"file={u_file}", os.path.join(work, "local.log"))))
            for name, flags in [("cold", ["--no-profile"]), ("cold_with_profile", ["--profile", profile])]:
                e = Export(c, work, u, f"boot-{name}", flags)
                wall, up = boot(ds, f"file={e.uri}", os.path.join(work, f"{name}.log"))
                boots[name] = {"wall_s": wall, "uptime_s": up, **e.stop()}
            result["boots"] = boots

        paces = [("", None)] + ([("paced_", think)] if think else [])
        for pace, times in paces:
            replays = {}
            sock = os.path.join(work, f"{pace}qemu-nbd.sock")
            qnbd = subprocess.Popen(["qemu-nbd", "-r", "-f", "raw", "-k", sock, "-x", "disk",
                                     u_file], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            while not os.path.exists(sock):
                time.sleep(0.05)
            replays["qemu_nbd_local_file"] = replay(f"nbd+unix:///disk?socket={sock}",
                                                    p["reads"], times)
            qnbd.terminate()
            qnbd.wait()
            for name, flags in [("cold", ["--no-profile"]),
                                ("cold_with_profile", ["--profile", profile])]:
                e = Export(c, work, u, f"{pace}replay-{name}", flags)
                replays[name] = {**replay(e.uri, p["reads"], times), **e.stop()}
            base = replays["qemu_nbd_local_file"]
            for r in replays.values():
                r["vs_local"] = round(r["seconds"] / max(base["seconds"], 1e-9), 3)
                r["waited_vs_local"] = round(r["waited_s"] / max(base["waited_s"], 1e-9), 2)
            result[f"{pace}replays"] = replays
        for b in boots.values() if boots else []:
            b["vs_local"] = round(b["wall_s"] / boots["local"]["wall_s"], 3)
            if "fetched_bytes" in b and b["read_bytes"]:
                b["fetched_vs_read"] = round(b["fetched_bytes"] / b["read_bytes"], 2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    emit(result, args.out)


if __name__ == "__main__":
    main()

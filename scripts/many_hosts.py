#!/usr/bin/env python3
"""Many hosts, one repository: concurrent committers, an export and a GC on one bucket.

Stand-ins for compute nodes, each a separate cairn process with its own metadata and chunk
cache directories, all on one repository (normally an S3 bucket: run it under
scripts/minio.sh or scripts/ceph.sh, which export CAIRN_TEST_S3_URL):

- host 0 commits the first dataset image as `golden`; a reader host then serves golden@1
  over NBD (`cairn export`) and copies it with nbdcopy again and again, checking every copy
  against the image, while
- four committer hosts each commit two dataset images (a different rotation per host) as
  their own image, and
- a collector host removes one committed version and runs `cairn gc` while they work.

Afterwards `cairn verify` must be clean, every version that was committed and not removed
must restore bit-exact, and the export must have served at least one full copy.

    scripts/many_hosts.py --dataset DIR [--repo URL] [--bin target/release/cairn]

--repo defaults to a fresh prefix under $CAIRN_TEST_S3_URL. Prints "many_hosts: N passed,
0 failed" and exits non-zero on any failure.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks, sha  # noqa: E402

HOSTS = 4


class Host:
    """One stand-in compute node: its own cache directories."""

    def __init__(self, binary, repo, work, name):
        self.binary, self.repo, self.name = binary, repo, name
        self.env = dict(os.environ)
        self.env["CAIRN_META_CACHE"] = os.path.join(work, name, "meta")
        self.env["CAIRN_CACHE_DIR"] = os.path.join(work, name, "chunks")
        self.env["CAIRN_RUN_DIR"] = os.path.join(work, name, "run")
        # Private, as cairn requires of a run directory (it refuses one others can enter).
        os.makedirs(self.env["CAIRN_RUN_DIR"], mode=0o700, exist_ok=True)

    def run(self, *args, check=True):
        p = subprocess.run([self.binary, "--repo", self.repo, "-q", *args],
                           capture_output=True, text=True, env=self.env)
        if check and p.returncode != 0:
            raise RuntimeError(f"{self.name}: cairn {' '.join(args)}: {p.stderr.strip()}")
        return p

    def popen(self, *args, **kw):
        return subprocess.Popen([self.binary, "--repo", self.repo, "-q", *args], env=self.env, **kw)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dataset", required=True)
    ap.add_argument("--repo")
    ap.add_argument("--bin", default=os.environ.get("CAIRN_BIN", "target/release/cairn"))
    a = ap.parse_args()
    binary = os.path.abspath(a.bin)
    images = sorted(os.path.join(a.dataset, f) for f in os.listdir(a.dataset)
                    if f.startswith("su-") and f.endswith(".raw") and "rebuilt" not in f)
    if len(images) < 2:
        sys.exit(f"many_hosts: need at least two su-*.raw images in {a.dataset}")
    repo = a.repo
    if not repo:
        url = os.environ.get("CAIRN_TEST_S3_URL")
        if not url:
            sys.exit("many_hosts: pass --repo or run under scripts/minio.sh run (CAIRN_TEST_S3_URL)")
        base, _, query = url.partition("?")
        repo = f"{base.rstrip('/')}/many-hosts-{time.time_ns():x}?{query}"
    digests = {img: sha(img) for img in images}
    checks = Checks()
    work = tempfile.mkdtemp(prefix="cairn-many-hosts.")
    export = None
    committed, copies = [], []  # (image, seq, source); one bool per NBD copy
    try:
        first = Host(binary, repo, work, "host-0")
        first.run("init", "--pack-size", "4M")
        first.run("commit", "golden", images[0])

        # The reader host: serve golden@1 and copy it over NBD until the committers finish.
        reader = Host(binary, repo, work, "reader")
        sock = os.path.join(work, "golden.sock")
        export = reader.popen("export", "golden@1=golden", "--socket", sock,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        for _ in range(600):
            if os.path.exists(sock) or export.poll() is not None:
                break
            time.sleep(0.05)
        if not checks.ok(os.path.exists(sock), "the export listens"):
            if export.poll() is not None:
                print(f"  export: {export.stderr.read().decode(errors='replace').strip()}")

        done = threading.Event()
        lock = threading.Lock()

        def committer(n):
            host = Host(binary, repo, work, f"host-{n + 1}")
            for k in range(2):
                src = images[(n + k) % len(images)]
                try:
                    out = json.loads(host.run("--json", "commit", f"host{n + 1}", src).stdout)
                    with lock:
                        committed.append((f"host{n + 1}", out["seq"], src))
                except Exception as e:  # noqa: BLE001 - reported as a failed check
                    checks.ok(False, f"commit by host-{n + 1}: {e}")

        def copier():
            out = os.path.join(work, "copy.raw")
            while True:
                last = done.is_set()
                p = subprocess.run(["nbdcopy", f"nbd+unix:///golden?socket={sock}", out],
                                   capture_output=True, text=True)
                if p.returncode != 0:
                    checks.ok(False, f"nbdcopy from the export: {p.stderr.strip()}")
                    return
                copies.append(sha(out) == digests[images[0]])
                os.remove(out)
                if last:
                    return

        def collector():
            # Remove host1's first version once it exists, then collect garbage twice while
            # the others are still committing.
            host = Host(binary, repo, work, "collector")
            while not any(c[0] == "host1" for c in committed) and not done.is_set():
                time.sleep(0.2)
            try:
                if any(c[:2] == ("host1", 1) for c in committed):
                    host.run("rm", "--no-gc", "host1@1")
                    with lock:
                        committed[:] = [c for c in committed if c[:2] != ("host1", 1)]
                for _ in range(2):
                    host.run("gc")
            except Exception as e:  # noqa: BLE001
                checks.ok(False, f"collector: {e}")

        threads = [threading.Thread(target=committer, args=(n,)) for n in range(HOSTS)]
        threads.append(threading.Thread(target=collector))
        copy_thread = threading.Thread(target=copier)
        copy_thread.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        copy_thread.join()
        checks.ok(len(copies) >= 1 and all(copies),
                  f"every NBD copy of golden@1 is bit-exact ({copies.count(True)}/{len(copies)})")
        checks.ok(len(committed) >= 2 * HOSTS - 1, f"all commits landed: {committed}")

        # Afterwards, from a fresh host: verify, and every version restores bit-exact.
        auditor = Host(binary, repo, work, "auditor")
        p = auditor.run("verify", check=False)
        checks.ok(p.returncode == 0, f"verify is clean: {p.stdout.strip()} {p.stderr.strip()}")
        out = os.path.join(work, "restore.raw")
        for image, seq, src in [("golden", 1, images[0])] + committed:
            p = auditor.run("restore", f"{image}@{seq}", out, "--force", check=False)
            checks.ok(p.returncode == 0 and sha(out) == digests[src],
                      f"{image}@{seq} restores bit-exact ({p.stderr.strip()})")
            if os.path.exists(out):
                os.remove(out)
        p = auditor.run("restore", "host1@1", out, "--force", check=False)
        checks.ok(p.returncode != 0, "the removed version is gone")
    finally:
        if export is not None:
            export.kill()
            export.wait()
        shutil.rmtree(work, ignore_errors=True)
    print(f"many_hosts: {len(committed)} versions committed by {HOSTS} hosts, "
          f"{len(copies)} NBD copies of golden@1 meanwhile")
    print(f"many_hosts: {checks.passed} passed, {checks.failed} failed")
    sys.exit(1 if checks.failed else 0)


if __name__ == "__main__":
    main()

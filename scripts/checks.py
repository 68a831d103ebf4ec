"""Helpers shared by cairn's Python test scripts: sha(), Checks, sh() and the Cairn runner."""

import hashlib
import json
import os
import subprocess
import threading


def sha(path):
    """SHA-256 of a file, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


class Checks:
    """Counts passed and failed checks (thread-safe); prints each failure at once."""

    def __init__(self):
        self.passed, self.failed = 0, 0
        self.lock = threading.Lock()

    def ok(self, cond, what):
        with self.lock:
            if cond:
                self.passed += 1
            else:
                self.failed += 1
                print(f"  FAIL  {what}", flush=True)
        return cond


def sh(*cmd, check=True, timeout=None, **kw):
    """Runs a command (text output captured); raises with its stderr if it fails and `check`."""
    p = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                       **kw)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))}: exit {p.returncode}: {p.stderr.strip()}")
    return p


class Cairn:
    """`cairn --repo REPO -q ARGS...` with the host state (provenance) in `state`."""

    def __init__(self, binary, repo, state=None, timeout=None):
        self.binary, self.repo, self.timeout = binary, repo, timeout
        self.env = dict(os.environ)
        if state:
            self.env["CAIRN_STATE_DIR"] = state

    def run(self, *args, check=True):
        p = subprocess.run([self.binary, "--repo", self.repo, "-q", *map(str, args)],
                           capture_output=True, text=True, env=self.env, timeout=self.timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"cairn {' '.join(map(str, args))}: {p.stderr.strip()}")
        return p

    def json(self, *args):
        return json.loads(self.run("--json", *args).stdout)

    def versions(self, image):
        p = self.run("--json", "log", image, check=False)
        return len(json.loads(p.stdout)) if p.returncode == 0 else 0

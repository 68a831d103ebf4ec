"""Helpers shared by cairn's Python test scripts: sha(), Checks, sh(), the Cairn runner, and
as_plain()/error_code() for the errors of `--json` commands."""

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


def _json_error(line):
    """The `error` object of a `--json` error line, or None for any other line."""
    try:
        v = json.loads(line)
    except ValueError:
        return None
    return v.get("error") if isinstance(v, dict) and isinstance(v.get("error"), dict) else None


def as_plain(stderr):
    """stderr with each `--json` error object (`{"error": {"code", "message", "exit_code"}}`)
    written as the line cairn prints without --json (`cairn: error: MESSAGE`, or
    `cairn: MESSAGE` when interrupted), so checks compare one text for both forms."""
    out = []
    for line in stderr.splitlines():
        e = _json_error(line)
        if e is None:
            out.append(line)
        elif e.get("code") == "interrupted":
            out.append(f"cairn: {e.get('message')}")
        else:
            out.append(f"cairn: error: {e.get('message')}")
    return "\n".join(out) + ("\n" if stderr.endswith("\n") else "")


def error_code(stderr):
    """The stable code of a `--json` error on stderr (None if there is none)."""
    for line in stderr.splitlines():
        e = _json_error(line)
        if e is not None:
            return e.get("code")
    return None


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

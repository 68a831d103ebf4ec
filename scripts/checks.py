"""Helpers shared by cairn's Python test scripts (stress_gc.py, many_hosts.py, s3_faults.py)."""

import hashlib
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

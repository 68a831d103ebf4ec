#!/usr/bin/env python3
"""kill -9 loops: commit, gc, rm/prune, restore, compaction, in-place restore and relayout
killed at random moments.

One local repository, one small synthetic image (a 32 MiB sparse file with 4 MiB of random
data, 512 KiB of it rewritten before every commit). Seven loops, each measuring the operation's typical
duration first and then killing it with SIGKILL after a random delay between 0 and that
(1.5 times that for gc, so that some trials finish and their reports show that the gc the
others were killed in was merging small packs: a check):

  1. `cairn commit`                              (--trials: 30 by default; every third
                                                  trial is a SIGINT instead)
  2. `cairn gc` / `gc --repair` / `gc --no-repack-small` (format 2), after versions were
     removed with `rm --no-gc` and three small commits left small packs to merge      (25)
  3. `cairn rm IMAGE@V` / `cairn prune IMAGE --keep-last K`                             (25)
  4. `cairn restore --force` to a file, over an earlier restore (every third: SIGTERM)  (20)
  5. `cairn index compact --all` after two more commits (format 2 only)                 (12)
  6. `cairn restore --in-place` over a file holding another version of an image of its
     own, killed while it writes (every other trial with --compare, the rest by diff
     where the last run finished)                                                       (12)
  7. `cairn relayout IMAGE --alpha 1` after three commits of small scattered writes (the
     newest version's scattered data copied side by side); every other trial then runs
     `gc --repair`, after which every layout marker must name a pack and a restore must read
     about as many pieces as the relayout left, at most 10% + 2 more (GC keeps the copies,
     and their order)                                                                    (8)

An interrupted (SIGINT/SIGTERM) command must exit 128+signal with one line on stderr, its
session closed and no temporary or partial file left, at once.

After every trial: `cairn verify` exits 0 and every version `cairn --json log` lists restores
bit-exact (to the sha256 of the source its commit read, found by the id the commit's --json
output printed; a version a killed commit published before it could print is the trial's). After a killed restore the target
is absent or holds a whole version (the old or the new one). After a killed in-place
restore that left its target torn (neither version), `cairn commit` of the target is refused
with one line saying so, and running the restore again makes it the version, bit-exact.

After every killed commit or gc, "gc after a killed X does not wait for the dead session":
the next `cairn gc` (default settings, with a deletion pending so it has work) must finish
within CAIRN_KILL_GC_TIMEOUT seconds (60) with exit 0. If it does not, the check fails once
and is not repeated in that loop (each would wait the whole timeout). Elsewhere the script
clears dead sessions with a plain `gc` (after a commit and an `rm --no-gc`, so that the gc
reaches its sweep, where it removes the sessions of processes that are gone).

At the end: `cairn gc --repair`; then no `.tmp-*` file may remain anywhere under the
repository, no `.*.cairn-partial-*` file in the restore target directory, and a second
`cairn gc --repair` must reclaim nothing.

    scripts/kill_loops.py [--bin target/release/cairn] [--dir DIR] [--seed N]
                          [--trials 30,25,25,20,12,12,8] [--encrypted]

The repository is `cairn init`'s default (format 2). --encrypted runs the same loops and
checks on an encrypted format 2 repository (`init --encrypt`, the passphrase in
$CAIRN_PASSWORD). (Format 1 is read-only, so it has no loop of its own.)

Prints per-loop timings and "kill_loops: N passed, M failed"; exits non-zero on any failure.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import Checks, as_plain, sha  # noqa: E402

IMAGE_SIZE = 32 << 20
IMAGE = "kill/disk"
LIVE = 3  # versions kept between trials
SMALL_COMMITS = 3  # small commits before each gc trial (format 2): small packs to merge
CHILDREN = set()  # every process started and not yet reaped


class Timeout(Exception):
    pass


def kill_group(proc):
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def spawn(args, env):
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    CHILDREN.add(proc)
    return proc


def reap(proc, timeout=None):
    """Waits for a child; on timeout kills its group and raises Timeout."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.communicate()
        CHILDREN.discard(proc)
        raise Timeout
    CHILDREN.discard(proc)
    return out, err


def on_signal(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


class Repo:
    def __init__(self, binary, path, state, encrypted=False):
        self.binary, self.path, self.encrypted = binary, path, encrypted
        self.env = dict(os.environ, CAIRN_STATE_DIR=state)
        if encrypted:
            self.env["CAIRN_PASSWORD"] = "kill loops passphrase"
        # The gc-wait checks are about the default staleness limit.
        self.env.pop("CAIRN_SESSION_STALE_SECS", None)

    def args(self, *args):
        return [self.binary, "--repo", self.path, "-q", *map(str, args)]

    def run(self, *args, check=True, timeout=300):
        proc = spawn(self.args(*args), self.env)
        try:
            out, err = reap(proc, timeout)
        except Timeout:
            raise RuntimeError(f"cairn {' '.join(map(str, args))}: no answer in {timeout} s")
        p = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check and p.returncode != 0:
            raise RuntimeError(f"cairn {' '.join(map(str, args))}: exit {p.returncode}: "
                               f"{err.strip()}")
        return p

    def json(self, *args):
        return json.loads(self.run("--json", *args).stdout)

    def listed(self, image):
        """Version ids of `image`, oldest first."""
        return [v["id"] for v in sorted(self.json("log", image), key=lambda v: v["seq"])]


class Run:
    def __init__(self, repo, work, rng, checks):
        self.repo, self.work, self.rng, self.checks = repo, work, rng, checks
        self.known = {}  # version id -> sha256 of what was committed
        self.source = os.path.join(work, "src", "disk.raw")
        self.targets = os.path.join(work, "restore")  # loop 4's restore target directory
        self.scratch = os.path.join(work, "check")
        for d in (os.path.dirname(self.source), self.targets, self.scratch):
            os.makedirs(d, exist_ok=True)
        self.last_kill = 0.0
        self.killed = 0
        self.interrupted = 0
        self.finished = 0
        self.gc_wait_failed = set()  # loops whose gc-wait check failed (not repeated)
        self.repacked_small = 0  # small packs merged by unkilled gc trials (format 2)
        self.spent = {"checks": 0.0, "clearing dead sessions": 0.0, "gc-wait checks": 0.0}

    def ok(self, cond, what):
        return self.checks.ok(cond, what)

    # --- images and commits -------------------------------------------------------------

    def make_image(self):
        with open(self.source, "wb") as f:
            f.truncate(IMAGE_SIZE)
            for _ in range(4):
                f.seek(self.rng.randrange(0, IMAGE_SIZE - (1 << 20), 4096))
                f.write(self.rng.randbytes(1 << 20))

    def mutate(self):
        with open(self.source, "r+b") as f:
            for _ in range(2):
                f.seek(self.rng.randrange(0, IMAGE_SIZE - (256 << 10), 4096))
                f.write(self.rng.randbytes(256 << 10))

    def commit(self):
        """A commit that is not killed; returns its id."""
        self.mutate()
        return self.commit_as_is(sha(self.source))

    def small_commits(self):
        """Commits of 192 KiB of new data each: a data pack and a node pack below a quarter of
        the 1 MiB pack target apiece, three commits' worth past half a pack together, so the
        next gc that merges small packs has some to merge (`gc --json`'s `small_packs`)."""
        for _ in range(SMALL_COMMITS):
            with open(self.source, "r+b") as f:
                f.seek(self.rng.randrange(0, IMAGE_SIZE - (192 << 10), 4096))
                f.write(self.rng.randbytes(192 << 10))
            self.commit_as_is(sha(self.source))

    def commit_as_is(self, digest):
        v = self.repo.json("commit", IMAGE, self.source)
        self.known[v["id"]] = digest
        return v["id"]

    def drop_oldest(self):
        """Records the deletion of the oldest version (`rm --no-gc`): a gc has work then."""
        ids = self.repo.listed(IMAGE)
        if len(ids) > 1:
            self.repo.run("rm", "--no-gc", f"{IMAGE}@{ids[0]}")

    def trim(self, keep=LIVE):
        ids = self.repo.listed(IMAGE)
        for vid in ids[:max(0, len(ids) - keep)]:
            self.repo.run("rm", "--no-gc", f"{IMAGE}@{vid}")

    def clear_dead_sessions(self):
        t = time.monotonic()
        try:
            self._clear_dead_sessions()
        finally:
            self.spent["clearing dead sessions"] += time.monotonic() - t

    def _clear_dead_sessions(self):
        """Removes the sessions (and gc lock) the killed processes left: a gc (which knows a
        session whose process is gone for dead at once), given a pending deletion so it
        reaches its sweep, where it removes them."""
        self.commit()
        self.drop_oldest()
        self.repo.run("gc", timeout=120)

    # --- killing ------------------------------------------------------------------------

    def kill_at_random(self, args, typical):
        """Starts `cairn args`, kills it with SIGKILL after uniform(0, typical) seconds.
        Returns (killed, exit status, stdout)."""
        proc = spawn(self.repo.args(*args), self.repo.env)
        time.sleep(self.rng.uniform(0.0, typical))
        return self.kill_now(proc)

    def kill_now(self, proc):
        """SIGKILLs `proc` (unless it ended) and counts it. Returns (killed, exit status,
        stdout)."""
        kill_group(proc)
        out, _ = reap(proc, 60)
        self.last_kill = time.monotonic()
        killed = proc.returncode == -signal.SIGKILL
        if killed:
            self.killed += 1
        else:
            self.finished += 1
        return killed, proc.returncode, out

    def interrupt_at_random(self, args, typical, sig, label):
        """Starts `cairn args` and sends it `sig` (SIGINT or SIGTERM) after uniform(0,
        typical) seconds. It must end with 0 (finished first) or 128+sig and, if interrupted,
        exactly one line on stderr, with no session and no temporary file left behind.
        Returns (interrupted, stdout)."""
        sessions = os.path.join(self.repo.path, "refs", "sessions")

        def leftovers():
            found = set(os.listdir(sessions)) if os.path.isdir(sessions) else set()
            return found | {os.path.join(d, f) for d, _, files in os.walk(self.repo.path)
                            for f in files if f.startswith(".tmp-")}
        before = leftovers()  # what earlier SIGKILLed trials left is not this one's
        proc = spawn(self.repo.args(*args), self.repo.env)
        time.sleep(self.rng.uniform(0.0, typical))
        try:
            proc.send_signal(sig)
        except ProcessLookupError:
            pass
        out, err = reap(proc, 60)
        name = signal.Signals(sig).name
        interrupted = proc.returncode == 128 + sig
        # -sig: the signal came before cairn installed its handler (the first milliseconds of
        # the process, before it opened anything): the default disposition ended it.
        self.ok(proc.returncode in (0, 128 + sig, -sig),
                f"{label}: {name} ends {args[0] if args[0] != '--json' else args[1]} "
                f"with 0 or {128 + sig} (exit {proc.returncode}: {err.strip()[-200:]})")
        if proc.returncode == -sig:
            self.ok(not (leftovers() - before),
                    f"{label}: a process ended by {name} before it started left nothing")
            return False, out
        if interrupted:
            self.interrupted += 1
            self.ok(as_plain(err).strip() == f"cairn: interrupted by {name}; stopped cleanly, nothing "
                                   "half-done was kept",
                    f"{label}: one line says it was interrupted: {err.strip()[-300:]}")
            new = sorted(leftovers() - before)
            self.ok(not new, f"{label}: the interrupted process closed its session and left "
                             f"no temporary file ({new[:3]})")
        else:
            self.finished += 1
        return interrupted, out

    def typical(self, what, op, prepare=lambda: None, n=3):
        """The median duration of `op` (after an untimed `prepare`), unkilled."""
        durations = []
        for _ in range(n):
            prepare()
            t = time.monotonic()
            op()
            durations.append(time.monotonic() - t)
        d = sorted(durations)[n // 2]
        print(f"  typical {what}: {d:.3f} s", flush=True)
        return d

    # --- checks after every trial -------------------------------------------------------

    def check_all(self, label):
        t = time.monotonic()
        try:
            self._check_all(label)
        finally:
            self.spent["checks"] += time.monotonic() - t

    def _check_all(self, label):
        p = self.repo.run("verify", check=False)
        self.ok(p.returncode == 0, f"{label}: verify exits 0 (exit {p.returncode}): "
                                   f"{(p.stdout + p.stderr).strip()[-300:]}")
        out = os.path.join(self.scratch, "restored.raw")
        for vid in self.repo.listed(IMAGE):
            want = self.known.get(vid)
            if not self.ok(want is not None, f"{label}: {IMAGE}@{vid[:12]} is listed but no "
                                             "commit made it"):
                continue
            p = self.repo.run("restore", f"{IMAGE}@{vid}", out, check=False)
            self.ok(p.returncode == 0 and sha(out) == want,
                    f"{label}: {IMAGE}@{vid[:12]} restores bit-exact "
                    f"(exit {p.returncode}: {p.stderr.strip()})")
            if os.path.exists(out):
                os.unlink(out)

    def gc_does_not_wait(self, loop, what, label, timeout):
        """The next gc after a killed `what` (with a deletion pending) finishes promptly.
        Returns True if it did (then the dead session is no obstacle any more)."""
        if loop in self.gc_wait_failed:
            return False
        started = time.monotonic()
        try:
            return self._gc_does_not_wait(loop, what, label, timeout)
        finally:
            self.spent["gc-wait checks"] += time.monotonic() - started

    def _gc_does_not_wait(self, loop, what, label, timeout):
        self.commit()
        self.drop_oldest()
        t = time.monotonic()
        try:
            p = self.repo.run("--json", "gc", check=False, timeout=timeout)
            took = time.monotonic() - t
            waited = json.loads(p.stdout).get("waited_s") if p.returncode == 0 else None
            passed = p.returncode == 0
            why = (f"exit 0 in {took:.1f} s (waited {waited:.1f} s)" if passed else
                   f"exit {p.returncode} in {took:.1f} s: {p.stderr.strip()}")
        except RuntimeError:
            passed, why = False, f"still waiting after {timeout} s; killed"
            self.last_kill = time.monotonic()
        self.ok(passed, f"gc after a killed {what} does not wait for the dead session "
                        f"({label}): {why}")
        if passed:
            print(f"  {label}: the next gc: {why}", flush=True)
        else:
            self.gc_wait_failed.add(loop)
            print(f"  (not repeated in this loop: each would take up to {timeout} s)",
                  flush=True)
        return passed

    # --- the four loops -----------------------------------------------------------------

    def loop_commit(self, trials, gc_timeout):
        digest = []
        typical = self.typical("commit", lambda: self.commit_as_is(digest.pop()),
                               lambda: (self.mutate(), digest.append(sha(self.source))))
        for trial in range(trials):
            label = f"commit trial {trial}"
            self.trim()
            before = set(self.repo.listed(IMAGE))
            self.mutate()
            digest = sha(self.source)
            if trial % 3 == 2:  # SIGINT (Ctrl-C) instead of SIGKILL
                _, out = self.interrupt_at_random(["--json", "commit", IMAGE, self.source],
                                                  typical, signal.SIGINT, label)
                if out.strip():
                    self.known[json.loads(out)["id"]] = digest
                self.ok(len(set(self.repo.listed(IMAGE)) - before - set(self.known)) == 0,
                        f"{label}: an interrupted commit published nothing")
                self.check_all(label)
                continue
            killed, rc, out = self.kill_at_random(
                ["--json", "commit", IMAGE, self.source], typical)
            if not killed:
                self.ok(rc == 0, f"{label}: an unkilled commit succeeds (exit {rc})")
                if rc == 0:
                    self.known[json.loads(out)["id"]] = digest
            new = set(self.repo.listed(IMAGE)) - before
            unknown = [v for v in new if v not in self.known]
            self.ok(len(unknown) <= 1, f"{label}: at most one version appeared: {unknown}")
            for v in unknown:  # published, then killed before it printed
                self.known[v] = digest
            self.check_all(label)
            if killed:
                self.gc_does_not_wait(1, "commit", label, gc_timeout)

    def loop_gc(self, trials, gc_timeout):
        self.clear_dead_sessions()
        # gc and gc --repair merge small packs (format 2, the default): with 1 MiB packs,
        # those below 256 KiB are small, and once they fill half a pack or number 32 a gc
        # rewrites them (`small_packs` in its --json report). Before each trial three small
        # commits leave enough (format 2), so a killed gc is often killed in such a merge;
        # every third trial leaves them (`--no-repack-small`).
        modes = [[], ["--repair"], ["--no-repack-small"]]
        merging = 0  # unkilled trials that merge small packs

        def garbage():
            self.small_commits()
            self.commit()
            self.trim()
        typical = self.typical("gc --repair (after small commits, a commit and an rm --no-gc)",
                               lambda: self.repo.run("gc", "--repair"), garbage)
        for trial in range(trials):
            label = f"gc trial {trial}"
            self.clear_dead_sessions()
            garbage()  # new garbage: removed versions, and small packs to merge
            mode = modes[trial % len(modes)]
            # A window past the typical duration lets some trials finish, whose reports show
            # that the gc the others were killed in was merging small packs.
            killed, rc, out = self.kill_at_random(["--json", "gc", *mode], typical * 1.5)
            if not killed:
                self.ok(rc == 0, f"{label}: an unkilled gc {' '.join(mode)} succeeds (exit {rc})")
                if "--no-repack-small" not in mode and rc == 0:
                    merging += 1
                    self.repacked_small += json.loads(out).get("small_packs", 0)
            self.check_all(label)
            if killed:
                self.gc_does_not_wait(2, "gc", label, gc_timeout)
        print(f"  small packs merged by the {merging} unkilled gc and gc --repair trials: "
              f"{self.repacked_small}", flush=True)
        self.ok(merging == 0 or self.repacked_small >= merging * 2 * SMALL_COMMITS,
                f"every unkilled merging gc merged the small commits' packs "
                f"({self.repacked_small} small packs in {merging} trials)")

    def loop_rm(self, trials):
        self.clear_dead_sessions()
        image = IMAGE

        oldest = []
        typical = self.typical("rm", lambda: self.repo.run("rm", f"{image}@{oldest.pop()}"),
                               lambda: (self.commit(), oldest.append(self.repo.listed(image)[0])))
        for trial in range(trials):
            label = f"rm/prune trial {trial}"
            self.clear_dead_sessions()
            while len(self.repo.listed(image)) < LIVE + 2:
                self.commit()
            ids = self.repo.listed(image)
            if trial % 2:
                args = ["prune", image, "--keep-last", str(len(ids) - 2)]
            else:
                args = ["rm", f"{image}@{self.rng.choice(ids[:-1])}"]
            killed, rc, _ = self.kill_at_random(args, typical)
            if not killed:
                self.ok(rc == 0, f"{label}: an unkilled {args[0]} succeeds (exit {rc})")
            self.check_all(label)
        self.trim()

    def loop_restore(self, trials):
        image = IMAGE
        target = os.path.join(self.targets, "disk.raw")
        ids = self.repo.listed(image)
        typical = self.typical("restore", lambda: self.repo.run(
            "restore", f"{image}@{ids[-1]}", target, "--force"))
        os.unlink(target)
        for trial in range(trials):
            label = f"restore trial {trial}"
            ids = self.repo.listed(image)
            old = sha(target) if os.path.exists(target) else None
            vid = self.rng.choice(ids)
            if trial % 3 == 2:  # SIGTERM instead of SIGKILL
                self.interrupt_at_random(["restore", f"{image}@{vid}", target, "--force"],
                                         typical, signal.SIGTERM, label)
                partial = [f for f in os.listdir(self.targets) if ".cairn-partial-" in f]
                self.ok(not partial, f"{label}: an interrupted restore removes its partial "
                                     f"file ({partial})")
                now = sha(target) if os.path.exists(target) else None
                self.ok(now in (old, self.known[vid]),
                        f"{label}: the target holds a whole version (the old or the new)")
                self.check_all(label)
                continue
            killed, rc, _ = self.kill_at_random(["restore", f"{image}@{vid}", target, "--force"],
                                                typical)
            if not killed:
                self.ok(rc == 0, f"{label}: an unkilled restore succeeds (exit {rc})")
            now = sha(target) if os.path.exists(target) else None
            self.ok(now in (old, self.known[vid]),
                    f"{label}: the target holds a whole version (the old or the new), "
                    f"never a torn one")
            self.check_all(label)

    def loop_compact(self, trials):
        """Index compaction killed at random: every run merged into one while the old runs
        are deleted; a kill at any point must lose no location (check_all restores every
        version) and the next compaction must finish the job."""
        self.clear_dead_sessions()
        typical = self.typical("index compact --all (after two commits)",
                               lambda: self.repo.run("index", "compact", "--all"),
                               lambda: (self.commit(), self.commit()))
        for trial in range(trials):
            label = f"compact trial {trial}"
            self.commit()
            self.commit()
            killed, rc, _ = self.kill_at_random(["index", "compact", "--all"], typical)
            if not killed:
                self.ok(rc == 0, f"{label}: an unkilled compaction succeeds (exit {rc})")
            self.check_all(label)
            # The next compaction takes over the dead one's lock and leaves one run.
            p = self.repo.run("--json", "index", "compact", "--all", check=False, timeout=120)
            runs = (json.loads(p.stdout)["runs_after"] if p.returncode == 0 else None)
            self.ok(runs == 1, f"{label}: the next compaction succeeds and leaves one run "
                               f"(exit {p.returncode}, {runs} runs: {p.stderr.strip()[-200:]})")
            self.trim()

    def loop_relayout(self, trials):
        """Relayout killed at random while it copies the newest version's scattered segments
        into layout packs: only additions, so a kill anywhere loses nothing, and the next
        relayout does the work. Every other trial, a GC afterwards must keep the new copies
        and their order."""
        self.clear_dead_sessions()
        if IMAGE not in self.repo.run("--json", "images").stdout:
            for _ in range(LIVE):  # the loop runs on its own
                self.commit()
        typical = self.typical("relayout --alpha 1 (after scattered writes)",
                               lambda: self.repo.run("relayout", IMAGE, "--alpha", "1"),
                               self.scatter_commits)
        collected = 0  # trials whose GC was checked for keeping the layout
        for trial in range(trials):
            label = f"relayout trial {trial}"
            self.scatter_commits()
            scattered = self.repo.json("stats", IMAGE)["reads"]
            killed, rc, _ = self.kill_at_random(["relayout", IMAGE, "--alpha", "1"], typical)
            if not killed:
                self.ok(rc == 0, f"{label}: an unkilled relayout succeeds (exit {rc})")
            self.check_all(label)
            p = self.repo.run("--json", "relayout", IMAGE, "--alpha", "1", check=False,
                              timeout=120)
            if self.ok(p.returncode == 0, f"{label}: the next relayout succeeds "
                                          f"({p.stderr.strip()[-200:]})"):
                report = json.loads(p.stdout)
                if trial % 2 and report["groups_copied"] > 0:
                    collected += 1
                    # (A GC knows the killed relayout's session for dead at once.)
                    g = self.repo.run("gc", "--repair", check=False, timeout=300)
                    self.ok(g.returncode == 0, f"{label}: gc --repair succeeds "
                                               f"({g.stderr.strip()[-200:]})")
                    # GC keeps the layout copies, in their order even when it repacks them
                    # (their old groups hold slots only older versions used).
                    laid_out = report["after"]["reads"]
                    now = self.repo.json("stats", IMAGE)["reads"]
                    self.ok(now <= laid_out * 1.1 + 2 and now < scattered,
                            f"{label}: after gc a restore reads {now} pieces (the relayout "
                            f"left {laid_out}, {scattered} before it)")
                    marked = self.layout_packs()
                    gone = [p for p in marked if not os.path.exists(self.pack_path(p))]
                    self.ok(not gone, f"{label}: every layout marker names a pack "
                                      f"({len(marked)} marked, {len(gone)} gone)")
                    self.check_all(label + " after gc")
            self.trim()
        print(f"  relayout: {collected} trials ran gc --repair after a relayout", flush=True)
        self.ok(trials < 2 or collected > 0, "some relayout trial laid out and collected")

    def scatter_commits(self):
        """Three commits of 48 small writes (8 KiB) each, at random: the newest version's
        data then lies in many packs."""
        for _ in range(3):
            with open(self.source, "r+b") as f:
                for _ in range(48):
                    f.seek(self.rng.randrange(0, IMAGE_SIZE - (8 << 10), 4096))
                    f.write(self.rng.randbytes(8 << 10))
            self.commit_as_is(sha(self.source))

    def layout_packs(self):
        """The packs the repository's layout markers (`layout/<pack>/<time>`) name."""
        d = os.path.join(self.repo.path, "layout")
        return sorted(p for p in (os.listdir(d) if os.path.isdir(d) else [])
                      if os.listdir(os.path.join(d, p)))

    def pack_path(self, pack):
        return os.path.join(self.repo.path, "packs", pack[:2], pack)

    def loop_in_place(self, trials):
        """In-place restores among three versions of an image of their own (24 MiB, two
        thirds of it rewritten from one version to the next, so that a restore writes for
        long enough to be cut short), killed while they write."""
        if IMAGE not in self.repo.run("--json", "images").stdout:
            for _ in range(LIVE):  # the loop runs on its own (--trials 0,0,0,0,0,N)
                self.commit()
        image = "kill/in-place"
        source = os.path.join(self.work, "src", "in-place.raw")
        target = os.path.join(self.targets, "in-place.raw")
        known = {}
        data = bytearray(self.rng.randbytes(24 << 20))
        for _ in range(3):
            for piece in range(24):
                if self.rng.random() < 2 / 3:
                    data[piece << 20:(piece + 1) << 20] = self.rng.randbytes(1 << 20)
            with open(source, "wb") as f:
                f.write(data)
            known[self.repo.json("commit", image, source)["id"]] = sha(source)
        ids = list(known)
        self.repo.run("restore", f"{image}@{ids[0]}", target, "--force")
        typical = self.typical("restore --in-place --compare", lambda: self.repo.run(
            "restore", f"{image}@{self.rng.choice(ids)}", target, "--in-place", "--compare"))
        torn_seen = 0
        for trial in range(trials):
            label = f"in-place trial {trial}"
            old = sha(target)
            vid = self.rng.choice([i for i in ids if known[i] != old] or ids)
            args = ["restore", f"{image}@{vid}", target, "--in-place"]
            killed, rc = self.kill_once_marked(args + (["--compare"] if trial % 2 else []),
                                               typical)
            if not killed:
                self.ok(rc == 0, f"{label}: an unkilled in-place restore succeeds (exit {rc})")
            now = sha(target)
            if now not in (old, known[vid]):
                torn_seen += 1
                p = self.repo.run("commit", "kill/torn", target, check=False)
                err = as_plain(p.stderr).strip()
                self.ok(p.returncode != 0 and len(err.splitlines()) == 1
                        and "in-place restore" in err and "was interrupted" in err,
                        f"{label}: a torn target is refused as a commit source with one line "
                        f"(exit {p.returncode}: {err[-300:]})")
            # Running it again finishes the job, whatever the kill left.
            p = self.repo.run(*args, check=False)
            self.ok(p.returncode == 0 and sha(target) == known[vid],
                    f"{label}: the rerun makes the target the version, bit-exact "
                    f"(exit {p.returncode}: {p.stderr.strip()[-200:]})")
            self.check_all(label)
        print(f"  in-place: {torn_seen} of {trials} trials left the target torn", flush=True)

    def kill_once_marked(self, args, typical):
        """Starts `cairn args` (an in-place restore) and kills it with SIGKILL at a random
        moment after its marker appeared (so while it writes), within `typical` seconds.
        Returns (killed, exit status)."""
        markers = os.path.join(self.repo.env["CAIRN_STATE_DIR"], "in-place")
        proc = spawn(self.repo.args(*args), self.repo.env)
        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            if os.path.isdir(markers) and os.listdir(markers):
                break
            time.sleep(0.0005)
        time.sleep(self.rng.uniform(0.0, typical))
        killed, rc, _ = self.kill_now(proc)
        return killed, rc

    def finish(self):
        # GC removes only the temporaries older than every live session, less the 1 s
        # clock-skew margin (a younger one may be a live writer's): let the last killed
        # writer's age past it first, or the leak check below fails by timing alone.
        time.sleep(max(0.0, 1.5 - (time.monotonic() - self.last_kill)))
        self.clear_dead_sessions()
        p = self.repo.run("--json", "gc", "--repair", check=False, timeout=120)
        self.ok(p.returncode == 0, f"final gc --repair succeeds: {p.stderr.strip()}")
        if p.returncode == 0:
            r = json.loads(p.stdout)
            print(f"  final gc --repair: {r['before_bytes']} -> {r['after_bytes']} bytes, "
                  f"{r['orphan_packs_deleted']} orphan packs deleted")
        tmp = [os.path.relpath(os.path.join(d, f), self.repo.path)
               for d, dirs, files in os.walk(self.repo.path)
               for f in files + dirs if f.startswith(".tmp-")]
        self.ok(not tmp, f"no .tmp-* file is left in the repository after gc --repair "
                         f"({len(tmp)} left: {tmp[:5]})")
        partial = [f for f in os.listdir(self.targets)
                   if f.startswith(".") and ".cairn-partial-" in f]
        self.ok(not partial, f"no .*.cairn-partial-* file is left in the restore target "
                             f"directory after killed restores ({len(partial)} left: "
                             f"{partial[:5]})")
        p = self.repo.run("--json", "gc", "--repair", check=False, timeout=120)
        if self.ok(p.returncode == 0, f"second gc --repair succeeds: {p.stderr.strip()}"):
            r = json.loads(p.stdout)
            self.ok(r["before_bytes"] == r["after_bytes"],
                    f"a second gc --repair reclaims nothing ({r['before_bytes']} -> "
                    f"{r['after_bytes']} bytes)")
        self.check_all("at the end")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", default=os.environ.get("CAIRN_BIN", os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "target", "release", "cairn")))
    ap.add_argument("--dir", help="where the repository and images go (default: a new "
                    "temporary directory under $CAIRN_TEST_TMP or /tmp, removed at the end)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--trials", default=None,
                    help="trials of the commit, gc, rm/prune, restore, index compaction, "
                    "in-place restore and relayout loops (default 30,25,25,20,12,12,8; with "
                    "--encrypted 15,12,8,8,6,6,4)")
    ap.add_argument("--encrypted", action="store_true",
                    help="an encrypted format 2 repository")
    args = ap.parse_args()
    default = "15,12,8,8,6,6,4" if args.encrypted else "30,25,25,20,12,12,8"
    trials = [int(x) for x in (args.trials or default).split(",")]
    if not 4 <= len(trials) <= 7:
        sys.exit("kill_loops: --trials takes four to seven numbers "
                 "(commit,gc,rm,restore[,compact[,in-place[,relayout]]])")
    trials += [0] * (7 - len(trials))
    binary = os.path.abspath(args.bin)
    if not os.access(binary, os.X_OK):
        sys.exit(f"kill_loops: no cairn binary at {binary} (build it: "
                 "cargo build --release -p cairn-cli, or pass --bin)")
    gc_timeout = float(os.environ.get("CAIRN_KILL_GC_TIMEOUT", "60"))
    seed = args.seed if args.seed is not None else random.randrange(1 << 32)
    print(f"kill_loops: seed {seed} (--seed {seed} repeats the choices), "
          f"{sum(trials)} trials", flush=True)
    signal.signal(signal.SIGTERM, on_signal)
    if args.dir:
        os.makedirs(args.dir, exist_ok=True)
        work = tempfile.mkdtemp(prefix="cairn-kill-", dir=os.path.abspath(args.dir))
    else:
        work = tempfile.mkdtemp(prefix="cairn-kill-", dir=os.environ.get("CAIRN_TEST_TMP"))
    checks = Checks()
    started = time.monotonic()
    timings = []
    try:
        repo = Repo(binary, os.path.join(work, "repo"), os.path.join(work, "state"),
                    args.encrypted)
        repo.run("init", "--pack-size", "1M", *(["--encrypt"] if args.encrypted else []))
        run = Run(repo, work, random.Random(seed), checks)
        run.make_image()
        loops = [("commit", lambda: run.loop_commit(trials[0], gc_timeout)),
                 ("gc", lambda: run.loop_gc(trials[1], gc_timeout)),
                 ("rm/prune", lambda: run.loop_rm(trials[2])),
                 ("restore", lambda: run.loop_restore(trials[3])),
                 ("index compact", lambda: run.loop_compact(trials[4])),
                 ("restore --in-place", lambda: run.loop_in_place(trials[5])),
                 ("relayout", lambda: run.loop_relayout(trials[6])),
                 ("final gc --repair and leak checks", run.finish)]
        for (name, loop), n in zip(loops, trials + [0]):
            if n == 0 and name != loops[-1][0]:
                continue
            print(f"{name}" + (f": {n} trials" if n else ""), flush=True)
            t, k, i, f = time.monotonic(), run.killed, run.interrupted, run.finished
            failed, spent = checks.failed, dict(run.spent)
            loop()
            timings.append((name, time.monotonic() - t))
            extra = (f", {run.killed - k} killed, {run.interrupted - i} interrupted, "
                     f"{run.finished - f} finished before the signal" if n else "")
            print(f"  {name}: {timings[-1][1]:.1f} s{extra}, "
                  f"{checks.failed - failed} checks failed", flush=True)
            print("    of which " + ", ".join(f"{k} {v - spent[k]:.1f} s"
                                             for k, v in run.spent.items()), flush=True)
    except Exception as e:  # noqa: BLE001 - one failure line, then the summary
        checks.ok(False, f"{type(e).__name__}: {e}")
    except KeyboardInterrupt as e:
        checks.ok(False, f"interrupted ({e})")
    finally:
        for proc in list(CHILDREN):
            kill_group(proc)
            proc.wait()
        shutil.rmtree(work, ignore_errors=True)
    print("kill_loops: timings: " + ", ".join(f"{n} {t:.0f} s" for n, t in timings) +
          f"; total {time.monotonic() - started:.0f} s")
    if checks.failed:
        print(f"kill_loops: seed {seed}")
    print(f"kill_loops: {checks.passed} passed, {checks.failed} failed")
    return 1 if checks.failed else 0


if __name__ == "__main__":
    sys.exit(main())

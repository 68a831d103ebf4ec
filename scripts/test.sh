#!/usr/bin/env bash
# The test command for cairn.
#
#   scripts/test.sh           everything: apt deps, small dataset (.data/small), fmt, clippy,
#                             cargo test (profile ci, the dataset required), the S3 suite
#                             against a local MinIO (built by go install the first time) and a
#                             local Ceph RGW (apt), the S3 fault tests, the disk-format tests
#                             (qcow2, NBD, dirty bitmaps), operator safety (full disk, mounted
#                             device), the kill -9 loops, the pull-mode backup of a running
#                             disk, a bounded fuzz run of the qcow2 parser, scripts/e2e.sh,
#                             the GC stress and leak test; the benchmark scripts parse and the
#                             committed peer report regenerates
#   scripts/test.sh --quick   cargo test --workspace only (no root, no dataset, no e2e)
#
# The full run needs root the first time (apt-get, debootstrap, loop mounts for the dataset).
# Exits non-zero at the first failing step.
set -euo pipefail

# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

QUICK=0
for a in "$@"; do
  case "$a" in
    --quick) QUICK=1 ;;
    -h | --help)
      sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *) echo "test.sh: unknown argument: $a (try --help)" >&2; exit 2 ;;
  esac
done

cd "$ROOT"
export CARGO_TERM_COLOR=${CARGO_TERM_COLOR:-auto}
START=$(date +%s)
CURRENT_STEP="setup"

on_exit() {
  local rc=$?
  if [ "$rc" -ne 0 ]; then
    echo >&2
    echo "test.sh: FAILED at step: $CURRENT_STEP (exit $rc)" >&2
  fi
}
trap on_exit EXIT

step() { # step NAME: announce a step
  CURRENT_STEP=$1
  printf '\n==> %s  [%ss]\n' "$1" "$(($(date +%s) - START))" >&2
}

if [ "$QUICK" -eq 1 ]; then
  step "cargo test --workspace (quick)"
  cargo test --workspace
  echo "test.sh: quick mode: only cargo test --workspace was run"
  echo "test.sh: all checks passed"
  exit 0
fi

step "apt packages"
ensure_apt_packages e2fsprogs debootstrap qemu-utils qemu-system-common libnbd-bin zstd time util-linux jq diffutils curl python3-matplotlib

step "small dataset (.data/small)"
DATASET=$(dataset_dir small)
ls -ls "$DATASET" >&2

step "cargo fmt --all -- --check"
cargo fmt --all -- --check

step "cargo clippy --workspace --all-targets -- -D warnings"
cargo clippy --workspace --all-targets -- -D warnings

step "benchmark scripts: syntax; each committed peer report regenerates from its measurements"
for f in bench/*.sh scripts/*.sh; do bash -n "$f"; done
python3 -c 'import ast, sys; [ast.parse(open(f).read(), f) for f in sys.argv[1:]]' bench/*.py scripts/*.py
for json in bench/results/compare-*.json; do
  [ -e "$json" ] || continue
  scratch=$(mktemp -d)
  cp "$json" "$scratch/"
  /usr/bin/python3 bench/compare_report.py "$scratch/$(basename "$json")" >/dev/null
  diff -u "${json%.json}.md" "$scratch/$(basename "${json%.json}").md" \
    || { rm -rf "$scratch"; die "${json%.json}.md is not what bench/compare_report.py makes of $json"; }
  rm -rf "$scratch"
done

# The `ci` profile: optimized without LTO or debug info (minutes less to compile on 2 cores),
# with clap's debug checks on so that `cli_is_consistent` checks the command definitions.
# Every later cargo invocation of the suite uses it too (CAIRN_PROFILE), so nothing is built
# twice.
export CAIRN_PROFILE=ci
step "cargo test --workspace --profile ci (CAIRN_DATASET=$DATASET, CAIRN_REQUIRE_DATASET=1)"
CAIRN_DATASET="$DATASET" CAIRN_REQUIRE_DATASET=1 cargo test --workspace --profile ci

CAIRN_BIN=$(CAIRN_PROFILE=ci cairn_bin)
export CAIRN_BIN

step "S3 on MinIO: conformance, CLI, many hosts, GC stress (scripts/minio.sh run scripts/s3_suite.sh)"
bash "$ROOT/scripts/minio.sh" run bash "$ROOT/scripts/s3_suite.sh" "$DATASET"

step "S3 on Ceph RGW: the same suite (scripts/ceph.sh: single-node cluster on loopback)"
bash "$ROOT/scripts/ceph.sh" install >/dev/null
bash "$ROOT/scripts/ceph.sh" run bash "$ROOT/scripts/s3_suite.sh" "$DATASET"

step "S3 faults: the server killed, hung, throttled or full mid-commit (scripts/s3_faults.py)"
python3 "$ROOT/scripts/s3_faults.py"

step "disk formats: qcow2 in and out, backing chains, NBD, dirty bitmaps, polite scans (scripts/formats.py)"
CAIRN_TEST_TMP="$ROOT/.data" python3 "$ROOT/scripts/formats.py" --dataset "$DATASET" --bin "$CAIRN_BIN"

step "operator safety as root: a 100% full tmpfs freed by rm and gc, a mounted device refused (scripts/safety.py)"
CAIRN_TEST_TMP="$ROOT/.data" python3 "$ROOT/scripts/safety.py" --bin "$CAIRN_BIN"

step "kill -9 loops: 100 trials of commit, gc, rm/prune and restore killed or interrupted (scripts/kill_loops.py)"
CAIRN_TEST_TMP="$ROOT/.data" python3 "$ROOT/scripts/kill_loops.py" --bin "$CAIRN_BIN"

step "pull-mode incremental backup of a running disk with qemu-storage-daemon (scripts/pullmode_backup.py)"
CAIRN_TEST_TMP="$ROOT/.data" python3 "$ROOT/scripts/pullmode_backup.py" --bin "$CAIRN_BIN"

step "fuzz the qcow2 parser for ${CAIRN_FUZZ_SECONDS:-60} s (scripts/fuzz.sh)"
bash "$ROOT/scripts/fuzz.sh" "${CAIRN_FUZZ_SECONDS:-60}"

step "scripts/e2e.sh"
CAIRN_BIN="$CAIRN_BIN" CAIRN_DATASET="$DATASET" bash "$ROOT/scripts/e2e.sh"

step "scripts/stress_gc.py (4 committers + prune/gc for 60 s, 20 kill -9 of gc, then the fast-deletion leak check)"
CAIRN_BIN="$CAIRN_BIN" CAIRN_STRESS_DIR="$ROOT/.data" python3 "$ROOT/scripts/stress_gc.py" --seconds 60

CURRENT_STEP="done"
echo
echo "test.sh: finished in $(($(date +%s) - START)) s"
echo "test.sh: all checks passed"

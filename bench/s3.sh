#!/usr/bin/env bash
# Object-store benchmark: cairn on S3 servers (MinIO, Ceph RGW) against cairn on a local
# directory and against restic's S3 backend on the same server, in one run.
#
#   bench/s3.sh [DATASET_DIR]      (default: .data/full, built if missing)
#
# For each server (SERVERS="minio ceph"; ceph only where scripts/ceph.sh can run it), started
# fresh on loopback by scripts/<server>.sh:
#   1. the series su-0 … su-5 committed in order by cairn into a local directory, by cairn
#      into the bucket, and by restic (repository v2, --compression auto) into the bucket:
#      wall time per step, throughput over the images' data bytes;
#   2. restore of su-5 (newest) and su-0 (oldest) from each, to a file on disk plus fsync;
#   3. S3 requests per GiB of image data, counted by the server itself (MinIO's metrics,
#      RGW's perf counters) around each phase.
# cairn on S3 runs with a fresh metadata cache per counted run (as a new host would).
# RUNS counted runs of the whole series (default 3) after one warm-up; medians are reported.
# The Markdown report goes to stdout and to bench/results/s3-<date>.md; progress to stderr.
#
# Environment: RUNS=3, SERVERS="minio ceph", CAIRN_BIN= (use this binary), BENCH_WORK= (scratch
# directory parent; default .data — a real disk).
set -euo pipefail
# Peers read their sources through the page cache and leave it there: so does cairn here
# (its default drops the pages a scan brought in, to be polite to a live host).
export CAIRN_KEEP_CACHE=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"

if [ "${1:-}" = "--inner" ]; then
  INNER=1
  shift
  SERVER=$1
  shift
else
  INNER=
fi
DS=$(cd "${1:-$(dataset_dir full)}" && pwd)
RUNS=${RUNS:-3}
# The series: su-0, su-1, … as far as the dataset goes (the full dataset has su-0 … su-5).
series=()
for i in 0 1 2 3 4 5 6 7 8 9; do
  [ -f "$DS/su-$i.raw" ] && series+=("su-$i")
done
[ "${#series[@]}" -ge 2 ] || die "$DS holds no su-0, su-1, … series"
NEWEST=${series[-1]}

if [ -z "$INNER" ]; then
  ensure_apt_packages time jq python3 restic curl
  CAIRN_BIN=$(cairn_bin)
  export CAIRN_BIN RUNS
  SERVERS=${SERVERS:-minio ceph}
  OUT="$ROOT/bench/results/s3-$(date +%Y-%m-%d).md"
  mkdir -p "$ROOT/bench/results"
  {
    echo "# bench/s3.sh — $(date -u +'%Y-%m-%d %H:%M UTC')"
    echo
    echo "Command: \`bench/s3.sh${*:+ $*}\` (RUNS=$RUNS). Machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo)."
    echo "Series su-0, su-1, … from $DS; data bytes are the images' allocated extents."
    for server in $SERVERS; do
      script="$ROOT/scripts/$server.sh"
      if [ ! -f "$script" ]; then
        log "skipping $server: $script is missing"
        continue
      fi
      log "=== $server"
      bash "$script" install >/dev/null
      bash "$script" run bash "$ROOT/bench/s3.sh" --inner "$server" "$DS"
    done
  } | tee "$OUT"
  log "report written to $OUT"
  exit 0
fi

# ---- inner part: runs with the server up and CAIRN_TEST_S3_URL, AWS_* exported ----
CAIRN=$CAIRN_BIN
mkdir -p "${BENCH_WORK:-$ROOT/.data}"
WORK=$(mktemp -d "${BENCH_WORK:-$ROOT/.data}/bench-s3.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
BUCKET_URL=${CAIRN_TEST_S3_URL%%\?*}            # s3://BUCKET/PREFIX
QUERY=${CAIRN_TEST_S3_URL#*\?}
BUCKET=${BUCKET_URL#s3://}
BUCKET=${BUCKET%%/*}
export RESTIC_PASSWORD=bench-only-password RESTIC_CACHE_DIR="$WORK/restic-cache"

# Total S3 requests the server has answered so far (empty if it cannot say).
requests() {
  case "$SERVER" in
    minio)
      # Metrics v3 are live (v2 is cached for ~10 s).
      curl -fsS "$AWS_ENDPOINT_URL/minio/metrics/v3/api/requests" 2>/dev/null \
        | awk '/^minio_api_requests_total\{.*type="s3"/ {s += $NF} END {printf "%d\n", s}'
      ;;
    *)
      if [ -n "${CAIRN_TEST_S3_REQUESTS_CMD:-}" ]; then
        bash -c "$CAIRN_TEST_S3_REQUESTS_CMD"
      fi
      ;;
  esac
}

# Data bytes of an image: its allocated extents.
data_bytes() {
  python3 - "$1" <<'EOF'
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
size = os.fstat(fd).st_size
off = total = 0
while off < size:
    try:
        d = os.lseek(fd, off, os.SEEK_DATA)
    except OSError:
        break
    h = os.lseek(fd, d, os.SEEK_HOLE)
    total += h - d
    off = h
print(total)
EOF
}

# timed CMD...: runs CMD after a sync; sets ELAPSED (s). Fails loudly with CMD's stderr.
timed() {
  sync -f "$WORK"
  local t0 t1
  t0=$(date +%s.%N)
  if ! "$@" >"$WORK/t.out" 2>"$WORK/t.err"; then
    cat "$WORK/t.err" >&2
    die "failed: $*"
  fi
  t1=$(date +%s.%N)
  ELAPSED=$(python3 -c "print(f'{$t1 - $t0:.3f}')")
}

declare -A DATA
total_data=0
for img in "${series[@]}"; do
  DATA[$img]=$(data_bytes "$DS/$img.raw")
  total_data=$((total_data + DATA[$img]))
done
for img in "${series[@]}"; do cat "$DS/$img.raw"; done >/dev/null # warm the page cache: every tool reads from memory

# One counted (or warm-up) run of TOOL; appends "tool phase seconds requests" lines to $RESULTS.
run_tool() {
  local tool=$1 run=$2 repo req0 req1
  case "$tool" in
    cairn-local) repo="$WORK/local-$run" ;;
    cairn-s3) repo="$BUCKET_URL-$run?$QUERY" ;;
    restic-s3) repo="s3:$AWS_ENDPOINT_URL/$BUCKET/restic-$run" ;;
  esac
  # A new host each run: the metadata cache starts empty (local repositories need none).
  [ "$tool" = cairn-s3 ] && export CAIRN_META_CACHE="$WORK/meta-$run" || export CAIRN_META_CACHE=off
  case "$tool" in
    cairn-*) "$CAIRN" --repo "$repo" -q init >/dev/null ;;
    restic-s3) restic -q -r "$repo" init --repository-version 2 >/dev/null ;;
  esac
  for img in "${series[@]}"; do
    req0=$(requests)
    case "$tool" in
      cairn-*) timed "$CAIRN" --repo "$repo" -q commit vm "$DS/$img.raw" ;;
      restic-s3) timed restic -q -r "$repo" backup --compression auto --tag "$img" "$DS/$img.raw" ;;
    esac
    req1=$(requests)
    echo "$tool $run commit:$img $ELAPSED $((${req1:-0} - ${req0:-0}))" >>"$RESULTS"
  done
  local which seq out
  for which in "$NEWEST" su-0; do
    out="$WORK/restored.raw"
    rm -rf "$out" "$WORK/restic-out"
    req0=$(requests)
    case "$tool" in
      cairn-*)
        [ "$which" = su-0 ] && seq=1 || seq=${#series[@]}
        timed bash -c '"$1" --repo "$2" -q restore "vm@$3" "$4" && sync "$4"' _ "$CAIRN" "$repo" "$seq" "$out"
        cmp "$out" "$DS/$which.raw" || die "$tool restored $which wrong"
        ;;
      restic-s3)
        timed bash -c 'restic -q -r "$1" restore latest --tag "$2" --target "$3" && find "$3" -type f -exec sync {} +' _ "$repo" "$which" "$WORK/restic-out"
        ;;
    esac
    req1=$(requests)
    echo "$tool $run restore:$which $ELAPSED $((${req1:-0} - ${req0:-0}))" >>"$RESULTS"
  done
  rm -rf "$WORK/restored.raw" "$WORK/restic-out" "$WORK/local-$run" "$WORK/meta-$run"
}

RESULTS="$WORK/results.txt"
: >"$RESULTS"
for run in $(seq 0 "$RUNS"); do # run 0 is the warm-up
  for tool in cairn-local cairn-s3 restic-s3; do
    log "$SERVER: $tool run $run"
    run_tool "$tool" "$run"
  done
done

python3 - "$RESULTS" "$SERVER" "$total_data" "${DATA[$NEWEST]}" "$NEWEST" "${#series[@]}" <<'EOF'
import statistics, sys
from collections import defaultdict
path, server, total, d5, newest, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], int(sys.argv[6])
t = defaultdict(list); req = defaultdict(list)
for line in open(path):
    tool, run, phase, secs, reqs = line.split()
    if run == "0":
        continue
    t[(tool, phase)].append(float(secs)); req[(tool, phase)].append(int(reqs))
tools = ["cairn-local", "cairn-s3", "restic-s3"]
med = lambda xs: statistics.median(xs) if xs else float("nan")
def series(tool, what):
    phases = [p for (tl, p) in t if tl == tool and p.startswith("commit:")]
    return sum(med(t[(tool, p)]) for p in phases), sum(med(req[(tool, p)]) for p in phases)
gib = total / 2**30
print(f"\n## {server}\n")
print(f"Series data: {total/2**20:.0f} MiB over {n} images (su-0 … {newest}). Medians of the counted runs.\n")
print(f"| tool | commit series s | MiB/s | requests/GiB | restore {newest} s | MiB/s | restore su-0 s | requests/GiB (restore {newest}) |")
print("|---|---|---|---|---|---|---|---|")
rows = {}
for tool in tools:
    cs, cr = series(tool, "commit")
    r5 = med(t[(tool, "restore:" + newest)]); r0 = med(t[(tool, "restore:su-0")])
    rr5 = med(req[(tool, "restore:" + newest)])
    rows[tool] = (cs, r5, r0)
    reqs = "n/a" if server != "minio" and cr == 0 else f"{cr/gib:.0f}"
    rreqs = "n/a" if server != "minio" and rr5 == 0 else f"{rr5/(d5/2**30):.0f}"
    print(f"| {tool} | {cs:.1f} | {total/2**20/cs:.0f} | {reqs} | {r5:.1f} | {d5/2**20/r5:.0f} | {r0:.1f} | {rreqs} |")
cl, cs3, rs = rows["cairn-local"], rows["cairn-s3"], rows["restic-s3"]
print()
print(f"- cairn on {server} commits at **{cl[0]/cs3[0]:.2f}×** the local-directory rate (target ≥ 0.7×) and "
      f"**{rs[0]/cs3[0]:.1f}×** restic's rate on the same server.")
print(f"- Restore of {newest} from {server}: {cl[1]/cs3[1]:.2f}× the local rate, {rs[1]/cs3[1]:.1f}× restic's.")
print("\nPer step (medians, s): " + "; ".join(
    f"{p.split(':')[1]}: " + " / ".join(f"{med(t[(tool, p)]):.1f}" for tool in tools)
    for p in [f"commit:su-{i}" for i in range(n)]) + " (cairn-local / cairn-s3 / restic-s3)")
EOF

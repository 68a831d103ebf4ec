#!/usr/bin/env bash
# Throughput benchmark: how fast cairn commits and restores compared with the machine's limits
# and with its peers (restic, borg), all measured in one run on the same machine.
#
#   bench/throughput.sh [DATASET_DIR]     (default: .data/full, built if missing)
#
# What it measures (images su-0 … su-5 are one image's history, pa-a and su-1-rebuilt are extra
# single images):
#   1. machine limits per image with cairn-limits (crates/cairn-bench): read of the allocated
#      extents from a warm page cache, BLAKE3 of 16 KiB chunks on all cores;
#   2. `cairn commit` of each image into a fresh repository: wall time, throughput over the
#      image's data bytes, peak RSS, stored bytes; 1 warm-up + 3 counted runs, medians;
#   3. the series su-0 … su-5 committed in order by cairn, restic and borg (default chunker and
#      ~64 KiB chunks): wall time and repository growth (du -sb) per step;
#   4. restore of su-5 (newest) and su-0 (oldest) by cairn vs `cp --sparse=always` + sync, and
#      su-5 by restic and borg, each to a file on the same disk, followed by an fsync.
#
# Every timed command starts after a `sync -f` so it does not pay for earlier writes. Images
# are read from the page cache (the machine has the RAM; cairn-limits measures the same way).
# The Markdown report goes to stdout and to bench/results/throughput-<date>.md; progress goes
# to stderr.
#
# Environment:
#   RUNS=3            counted runs of cairn and cp (after one warm-up run)
#   PEER_RUNS=        counted runs of restic and borg; default 3, or 1 when 3 would push the
#                     whole run past TIME_BUDGET_S (decided after the peers' warm-up run)
#   TIME_BUDGET_S=1500
#   CAIRN_BIN=, CAIRN_LIMITS=  use these binaries instead of building cairn and cairn-limits
#   BENCH_WORK=       where the temporary scratch directory is made (default: .data; it must
#                     be on a real disk, not tmpfs)
set -euo pipefail
# Peers read their sources through the page cache and leave it there: so does cairn here
# (its default drops the pages a scan brought in, to be polite to a live host).
export CAIRN_KEEP_CACHE=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"

START=$(date +%s)
CMDLINE="bench/throughput.sh${*:+ $*}"
DS=$(cd "${1:-$(dataset_dir full)}" && pwd)
RUNS=${RUNS:-3}
TIME_BUDGET_S=${TIME_BUDGET_S:-1500}

ensure_apt_packages time jq python3 restic borgbackup
CAIRN_PRESET=${CAIRN_BIN:-}
CAIRN=$(cairn_bin)
if [ -n "${CAIRN_LIMITS:-}" ] && [ -x "$CAIRN_LIMITS" ]; then
  LIMITS=$CAIRN_LIMITS
else
  log "cargo build --release -p cairn-bench"
  (cd "$ROOT" && cargo build --release -p cairn-bench >&2) || die "cargo build -p cairn-bench failed"
  LIMITS="$(_cargo_target_dir)/release/cairn-limits"
  [ -x "$LIMITS" ] || die "$LIMITS is missing after the build"
fi

series=(su-0 su-1 su-2 su-3 su-4 su-5)
singles=("${series[@]}" pa-a su-1-rebuilt)
for img in "${singles[@]}"; do
  [ -f "$DS/$img.raw" ] || die "missing image $DS/$img.raw"
done

# Scratch space on the same disk as the dataset, never on tmpfs.
mkdir -p "${BENCH_WORK:-$ROOT/.data}"
WORK=$(mktemp -d "${BENCH_WORK:-$ROOT/.data}/bench-throughput.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
WORK_FS=$(findmnt -n -o FSTYPE -T "$WORK")
[ "$WORK_FS" != tmpfs ] || die "$WORK is on tmpfs; set BENCH_WORK to a directory on disk"
if [ "$(findmnt -n -o SOURCE -T "$WORK")" != "$(findmnt -n -o SOURCE -T "$DS")" ]; then
  log "warning: $WORK and $DS are on different file systems"
fi

RAW="$WORK/raw.tsv"     # one line per measurement, tab-separated (see the report script)
LIMITS_JSON="$WORK/limits.jsonl"
: >"$RAW"

# Peers: no encryption prompts, caches and keys inside the scratch directory.
export RESTIC_PASSWORD=cairn-bench
export BORG_UNKNOWN_UNENCRYPTED_REPO_ACCESS_IS_OK=yes BORG_RELOCATED_REPO_ACCESS_IS_OK=yes

# timed CMD...: runs CMD after a sync of the scratch file system; its stdout is left in
# $WORK/t.out, and T_WALL, T_USER, T_SYS (seconds) and T_RSS (peak RSS, KiB) are set.
timed() {
  sync -f "$WORK"
  if ! /usr/bin/time -o "$WORK/t.time" -f '%e %U %S %M' "$@" >"$WORK/t.out" 2>"$WORK/t.err"; then
    cat "$WORK/t.err" >&2
    die "command failed: $*"
  fi
  read -r T_WALL T_USER T_SYS T_RSS <"$WORK/t.time"
}

# record FIELD...: appends one tab-separated line to the raw measurements.
record() {
  local IFS=$'\t'
  printf '%s\n' "$*" >>"$RAW"
}

repo_bytes() { du -sb "$1" | cut -f1; }
field() { jq -r ".$1" "$WORK/t.out"; }

# ---------------------------------------------------------------------------------------------
log "machine limits (cairn-limits) for ${singles[*]}"
limit_files=()
for img in "${singles[@]}"; do limit_files+=("$DS/$img.raw"); done
"$LIMITS" "${limit_files[@]}" >"$LIMITS_JSON"

# ---------------------------------------------------------------------------------------------
# cairn commit of each image into a fresh repository. Run 0 is the warm-up.
for run in $(seq 0 "$RUNS"); do
  log "cairn commit, single images, run $run of $RUNS (0 = warm-up)"
  for img in "${singles[@]}"; do
    R="$WORK/cairn-single"
    rm -rf "$R"
    "$CAIRN" --repo "$R" -q init >/dev/null
    timed "$CAIRN" --repo "$R" -q --json commit vm "$DS/$img.raw"
    record image cairn "$img" "$run" "$T_WALL" "$T_USER" "$T_SYS" "$T_RSS" \
      "$(field data_bytes)" "$(field stored_bytes)"
  done
  rm -rf "$WORK/cairn-single"
done

# ---------------------------------------------------------------------------------------------
OUT="$WORK/out"

# Restores run as `sh -c SCRIPT sh ARG...` under GNU time, so that the fsync of the written
# file is part of the measurement. "$1", "$2" are expanded by that sh.
# shellcheck disable=SC2016
{
  CP_SYNC='cp --sparse=always "$1" "$2" && sync "$2"'
  RESTIC_RESTORE='restic -q -r "$1" restore latest --target "$2" && find "$2" -type f -exec sync {} +'
  BORG_EXTRACT='cd "$2" && borg extract --sparse "$1::su-5" && find . -type f -exec sync {} +'
}

# restore_run TOOL VERSION RUN CMD...: times CMD (which writes into $OUT) and records it.
restore_run() {
  local tool=$1 version=$2 run=$3
  shift 3
  rm -rf "$OUT"
  mkdir -p "$OUT"
  timed "$@"
  record restore "$tool" "$version" "$run" "$T_WALL" "$T_USER" "$T_SYS" "$T_RSS" - -
  rm -rf "$OUT"
}

# The series in cairn, then restores from that repository and cp of the same images.
for run in $(seq 0 "$RUNS"); do
  log "cairn series + restore, cp, run $run of $RUNS (0 = warm-up)"
  R="$WORK/cairn-series"
  rm -rf "$R"
  "$CAIRN" --repo "$R" -q init >/dev/null
  for img in "${series[@]}"; do
    before=$(repo_bytes "$R")
    timed "$CAIRN" --repo "$R" -q --json commit vm "$DS/$img.raw"
    after=$(repo_bytes "$R")
    record series cairn "$img" "$run" "$T_WALL" "$T_USER" "$T_SYS" "$T_RSS" \
      $((after - before)) "$(field stored_bytes)"
  done
  restore_run cairn su-5 "$run" "$CAIRN" --repo "$R" -q --json restore vm@6 "$OUT/su-5.raw"
  restore_run cp su-5 "$run" sh -c "$CP_SYNC" sh "$DS/su-5.raw" "$OUT/su-5.raw"
  restore_run cairn su-0 "$run" "$CAIRN" --repo "$R" -q --json restore vm@1 "$OUT/su-0.raw"
  restore_run cp su-0 "$run" sh -c "$CP_SYNC" sh "$DS/su-0.raw" "$OUT/su-0.raw"
  rm -rf "$R"
done

# ---------------------------------------------------------------------------------------------
# Peers. restic: repository format 2 with --compression auto. borg: no encryption, lz4
# (default), default chunker (buzhash,19,23,21,4095: ~2 MiB) and ~64 KiB chunks.
peers=(restic borg borg-64k)

peer_init() { # TOOL REPO
  case $1 in
    restic) restic -q -r "$2" init --repository-version 2 >/dev/null ;;
    borg | borg-64k) borg init -e none "$2" >/dev/null ;;
  esac
}

peer_commit() { # TOOL REPO IMAGE
  case $1 in
    restic) timed restic -q -r "$2" backup --compression auto --tag "$3" "$DS/$3.raw" ;;
    borg) timed borg create "$2::$3" "$DS/$3.raw" ;;
    borg-64k) timed borg create --chunker-params buzhash,14,18,16,4095 "$2::$3" "$DS/$3.raw" ;;
  esac
}

# Restores su-5 (the newest archive/snapshot) into $OUT, then fsyncs the restored file.
peer_restore() { # TOOL REPO RUN
  case $1 in
    restic)
      restore_run "$1" su-5 "$3" sh -c "$RESTIC_RESTORE" sh "$2" "$OUT"
      ;;
    borg | borg-64k)
      restore_run "$1" su-5 "$3" sh -c "$BORG_EXTRACT" sh "$2" "$OUT"
      ;;
  esac
}

peer_run() { # TOOL RUN
  local tool=$1 run=$2 R="$WORK/peer-$1" img before after
  rm -rf "$R" "$WORK/peer-cache"
  export RESTIC_CACHE_DIR="$WORK/peer-cache/restic" BORG_BASE_DIR="$WORK/peer-cache/borg"
  peer_init "$tool" "$R"
  for img in "${series[@]}"; do
    before=$(repo_bytes "$R")
    peer_commit "$tool" "$R" "$img"
    after=$(repo_bytes "$R")
    record series "$tool" "$img" "$run" "$T_WALL" "$T_USER" "$T_SYS" "$T_RSS" \
      $((after - before)) -
  done
  peer_restore "$tool" "$R" "$run"
  rm -rf "$R" "$WORK/peer-cache"
}

peer_start=$(date +%s)
for tool in "${peers[@]}"; do
  log "$tool series + restore, warm-up run"
  peer_run "$tool" 0
done
now=$(date +%s)
warm=$((now - peer_start))
projected=$((now - START + 3 * warm))
if [ -n "${PEER_RUNS:-}" ]; then
  PEER_NOTE="$PEER_RUNS counted run(s) (set by PEER_RUNS)"
elif [ "$projected" -le "$TIME_BUDGET_S" ]; then
  PEER_RUNS=3
  PEER_NOTE="3 counted runs after 1 warm-up"
else
  PEER_RUNS=1
  PEER_NOTE="1 counted run after 1 warm-up (3 would have taken the whole run to ~${projected} s, over the ${TIME_BUDGET_S} s budget)"
fi
log "peers: warm-up took ${warm} s; $PEER_NOTE"
for run in $(seq 1 "$PEER_RUNS"); do
  for tool in "${peers[@]}"; do
    log "$tool series + restore, run $run of $PEER_RUNS"
    peer_run "$tool" "$run"
  done
done

# ---------------------------------------------------------------------------------------------
END=$(date +%s)
DATE=$(date +%F)
mkdir -p "$ROOT/bench/results"
REPORT="$ROOT/bench/results/throughput-$DATE.md"
CPU_MODEL=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
NPROC=$(nproc)
KERNEL=$(uname -r)
MEM=$(free -g | awk '/^Mem:/ {print $2 " GiB"}')
CAIRN_REV=$(git -C "$ROOT" describe --always --dirty 2>/dev/null || echo unknown)
[ -z "$CAIRN_PRESET" ] || CAIRN_REV="binary $CAIRN (CAIRN_BIN; tree at $CAIRN_REV)"
RESTIC_V=$(restic version | cut -d' ' -f2)
BORG_V=$(borg --version | cut -d' ' -f2)
LOADAVG=$(cut -d' ' -f1-3 /proc/loadavg)
export CMDLINE DS RUNS PEER_RUNS PEER_NOTE START END WORK_FS
export CPU_MODEL NPROC KERNEL MEM CAIRN_REV RESTIC_V BORG_V LOADAVG

python3 - "$RAW" "$LIMITS_JSON" <<'PY' | tee "$REPORT"
import json, os, statistics, sys, time

raw_path, limits_path = sys.argv[1], sys.argv[2]
E = os.environ
MIB = 1024 * 1024
SERIES = ["su-0", "su-1", "su-2", "su-3", "su-4", "su-5"]
SINGLES = SERIES + ["pa-a", "su-1-rebuilt"]
PEERS = ["restic", "borg", "borg-64k"]
TOOLS = ["cairn"] + PEERS

rows = []
with open(raw_path) as f:
    for line in f:
        kind, tool, item, run, wall, user, sys_, rss, a, b = line.rstrip("\n").split("\t")
        rows.append(dict(kind=kind, tool=tool, item=item, run=int(run), wall=float(wall),
                         cpu=float(user) + float(sys_), rss=int(rss), a=a, b=b))
limits = {}
with open(limits_path) as f:
    for line in f:
        d = json.loads(line)
        limits[os.path.basename(d["file"]).removesuffix(".raw")] = d


def counted(kind, tool, item):
    return [r for r in rows if r["kind"] == kind and r["tool"] == tool and r["item"] == item
            and r["run"] > 0]


def med(kind, tool, item, key):
    rs = counted(kind, tool, item)
    if not rs:
        return None
    return statistics.median(float(r[key]) for r in rs)


def mib(b):
    return f"{b / MIB:,.1f}"


def secs(s):
    return "–" if s is None else f"{s:.2f}"


def ratio(x):
    return "–" if x is None else f"{x:.2f}"


out = []
p = out.append
p("# cairn throughput benchmark")
p("")
p(f"- Command: `{E['CMDLINE']}` (dataset `{E['DS']}`)")
p(f"- Date: {time.strftime('%Y-%m-%d %H:%M %Z', time.localtime(int(E['START'])))}, "
  f"total run time {(int(E['END']) - int(E['START'])) / 60:.1f} min")
p(f"- Machine: {E['CPU_MODEL']}, {E['NPROC']} cores, {E['MEM']} RAM, Linux {E['KERNEL']}; "
  f"scratch on {E['WORK_FS']} (same disk as the dataset); load average at the end "
  f"{E['LOADAVG']}")
p(f"- Versions: cairn {E['CAIRN_REV']} (release build, default repository: fixed 16 KiB "
  f"chunks, zstd level 3), restic {E['RESTIC_V']} (repository v2, --compression auto), "
  f"borg {E['BORG_V']} (-e none, lz4)")
p(f"- Runs: cairn and cp: {E['RUNS']} counted runs after 1 warm-up, medians; restic/borg: "
  f"{E['PEER_NOTE']}, medians.")
p("- All figures are wall-clock on a shared 2-core machine with other work running: they are "
  "noisy (expect ±10–20 %); compare within this report, not across reports.")
p("- Images are read from a warm page cache, for the limits and for every tool alike. "
  "MiB = 2^20 bytes.")
p("")

p("## 1. Commit throughput vs machine limits (each image into a fresh repository)")
p("")
p("Limits from `cairn-limits` (crates/cairn-bench): *read* = pread of the allocated extents "
  "in 4 MiB blocks, second (warm) pass; *BLAKE3 chunks* = 16 KiB chunks hashed in parallel "
  "on all cores (cairn's per-chunk hashing); *update_rayon* = one tree hash of the whole "
  "buffer on all cores; *1 core* = 16 KiB chunks on one core. cairn MiB/s = cairn's "
  "`data_bytes` (non-zero chunks, ≈ allocated bytes) ÷ wall time of the whole `cairn commit` "
  "process. *vs limit* = cairn MiB/s ÷ min(read, BLAKE3 chunks). *data MiB* = the extents "
  "SEEK_DATA reports; on ext4 that includes unwritten (preallocated) extents only while they "
  "are in the page cache, so it can differ between runs (cairn reads them, finds zeros, and "
  "stores nothing for them).")
p("")
p("| image | data MiB | read limit MiB/s | BLAKE3 chunks MiB/s | update_rayon MiB/s "
  "| BLAKE3 1 core MiB/s | cairn commit MiB/s | vs limit | wall s | CPU s | peak RSS MiB "
  "| stored MiB |")
p("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for img in SINGLES:
    lim = limits[img]
    wall = med("image", "cairn", img, "wall")
    data = med("image", "cairn", img, "a")
    rate = data / MIB / wall if wall else None
    bound = min(lim["read_mib_s"], lim["blake3_chunks_all_cores_mib_s"])
    p(f"| {img} | {mib(lim['data_bytes'])} | {lim['read_mib_s']:,.0f} "
      f"| {lim['blake3_chunks_all_cores_mib_s']:,.0f} | {lim['blake3_rayon_mib_s']:,.0f} "
      f"| {lim['blake3_chunks_one_core_mib_s']:,.0f} | {rate:,.0f} | {rate / bound:.3f} "
      f"| {secs(wall)} | {secs(med('image', 'cairn', img, 'cpu'))} "
      f"| {med('image', 'cairn', img, 'rss') / 1024:,.0f} "
      f"| {mib(med('image', 'cairn', img, 'b'))} |")
p("")

p("## 2. The series su-0 … su-5 committed in order into one repository")
p("")
p("Bytes added = growth of the repository directory (`du -sb`) per step, all files "
  "included (packs, indexes, metadata). borg = default chunker (buzhash,19,23,21,4095, "
  "~2 MiB chunks); borg-64k = `--chunker-params buzhash,14,18,16,4095`. *cairn ÷ best peer*: "
  "below 1 means cairn stores less / is faster.")
p("")
p("### 2a. Bytes added per step (MiB)")
p("")
p("| step | " + " | ".join(TOOLS) + " | cairn ÷ best peer |")
p("|---|" + "---:|" * (len(TOOLS) + 1))


def series_line(label, vals):
    have = [vals[t] for t in PEERS if vals[t] is not None]
    best = min(have) if have else None
    cells = ["–" if vals[t] is None else f"{vals[t] / MIB:,.1f}" for t in TOOLS]
    r = vals["cairn"] / best if best else None
    return f"| {label} | " + " | ".join(cells) + f" | {ratio(r)} |"


totals = {t: 0.0 for t in TOOLS}
for img in SERIES:
    vals = {t: med("series", t, img, "a") for t in TOOLS}
    for t in TOOLS:
        totals[t] = None if totals[t] is None or vals[t] is None else totals[t] + vals[t]
    p(series_line(img, vals))
p(series_line("**total**", totals))
p("")
p("### 2b. Commit wall time per step (s)")
p("")
p("| step | " + " | ".join(TOOLS) + " | cairn ÷ best peer |")
p("|---|" + "---:|" * (len(TOOLS) + 1))
tt = {t: 0.0 for t in TOOLS}
for img in SERIES:
    vals = {t: med("series", t, img, "wall") for t in TOOLS}
    for t in TOOLS:
        tt[t] = None if tt[t] is None or vals[t] is None else tt[t] + vals[t]
    have = [vals[t] for t in PEERS if vals[t] is not None]
    cells = [secs(vals[t]) for t in TOOLS]
    p(f"| {img} | " + " | ".join(cells) + f" | {ratio(vals['cairn'] / min(have))} |")
have = [tt[t] for t in PEERS if tt[t] is not None]
p("| **total** | " + " | ".join(f"**{secs(tt[t])}**" for t in TOOLS)
  + f" | **{ratio(tt['cairn'] / min(have))}** |")
rss = {t: max((r["rss"] for r in rows if r["kind"] == "series" and r["tool"] == t
               and r["run"] > 0), default=None) for t in TOOLS}
cpu = {t: sum(med("series", t, i, "cpu") or 0 for i in SERIES) for t in TOOLS}
p("| CPU s (user+sys, sum) | " + " | ".join(f"{cpu[t]:.2f}" for t in TOOLS) + " | |")
p("| peak RSS MiB (max) | " + " | ".join("–" if rss[t] is None else f"{rss[t] / 1024:,.0f}"
                                         for t in TOOLS) + " | |")
p("")

p("## 3. Restore to a file on the same disk, including the fsync")
p("")
p("cairn fsyncs its output; `cp --sparse=always SRC DST && sync DST` is the floor for "
  "producing the same sparse file; restic and borg are followed by `sync` of the restored "
  "file. borg uses `extract --sparse`; restic 0.14 has no sparse restore and writes the "
  "whole 2 GiB. MiB/s over the image's data bytes. *speed vs X* = X's time ÷ cairn's time "
  "(above 1: cairn faster).")
p("")
p("| version | data MiB | cairn s | cairn MiB/s | cp s | speed vs cp | restic s | speed vs "
  "restic | borg s | speed vs borg | borg-64k s | speed vs borg-64k | cairn peak RSS MiB |")
p("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for ver, label in (("su-5", "su-5 (newest, vm@6)"), ("su-0", "su-0 (oldest, vm@1)")):
    c = med("restore", "cairn", ver, "wall")
    data = limits[ver]["data_bytes"]
    cells = []
    for t in ["cp"] + PEERS:
        v = med("restore", t, ver, "wall")
        cells += [secs(v), ratio(v / c if v else None)]
    p(f"| {label} | {mib(data)} | {secs(c)} | {data / MIB / c:,.0f} | " + " | ".join(cells)
      + f" | {med('restore', 'cairn', ver, 'rss') / 1024:,.0f} |")
p("")
print("\n".join(out))
PY
log "report written to $REPORT (took $(((END - START) / 60)) min)"

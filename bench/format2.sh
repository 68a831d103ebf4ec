#!/usr/bin/env bash
# Format 2 as written by cairn itself (issue 16), against format 1, in one run on the same
# images: the su-* series committed into a format 1 and a format 2 repository (stored bytes,
# commit time and throughput per step), the rebuilt golden image after su-1 (what moved data
# costs), then a restore of the newest version from each (time and throughput) and where the
# repository's bytes go (bench/metadata.py).
#
#   bench/format2.sh [DATASET_DIR]     (default: .data/full, built if missing)
#
# This cairn writes format 2 only (format 1 is read-only since 2026-12-02): the format 1 rows
# need CAIRN_V1_BIN, a cairn built from an earlier commit (e.g. c778d08); without it only
# format 2 runs.
#
# Writes bench/results/format2-DATE.jsonl (one line per step) and prints a table.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/scripts/lib.sh"
DS=${1:-$(dataset_dir full)}
cargo build -q --release -p cairn-cli --manifest-path "$ROOT/Cargo.toml"
CAIRN="$(_cargo_target_dir)/release/cairn"
FORMATS="2"
[ -n "${CAIRN_V1_BIN:-}" ] && FORMATS="1 2"
bin_for() { if [ "$1" = 1 ]; then echo "$CAIRN_V1_BIN"; else echo "$CAIRN"; fi; }
OUT="$ROOT/bench/results/format2-$(date -u +%F).jsonl"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/cairn-format2.XXXXXX"); trap 'rm -rf "$WORK"' EXIT
: >"$OUT"

run() { # FORMAT SCENARIO IMAGE...
  local format=$1 scenario=$2; shift 2
  local repo="$WORK/f$format-$scenario" bin
  bin=$(bin_for "$format")
  "$bin" -q --repo "$repo" init --format "$format" --reserve 0
  for img in "$@"; do
    sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
    "$bin" --json --repo "$repo" commit vm "$img" | python3 -c '
import json, sys
d = json.loads(sys.stdin.read())
print(json.dumps({"format": int(sys.argv[1]), "scenario": sys.argv[2], "step": sys.argv[3],
  "op": "commit", "seconds": d["duration_s"], "read": d["read_bytes"], "data": d["data_bytes"],
  "new": d["new_chunk_bytes"], "stored": d["stored_bytes"]}))' "$format" "$scenario" "$(basename "$img" .raw)" >>"$OUT"
  done
  if [ "$scenario" = series ]; then
    sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true
    local t0 t1
    t0=$(date +%s.%N)
    "$bin" -q --repo "$repo" restore vm "$WORK/out.raw"
    t1=$(date +%s.%N)
    python3 -c 'import json,sys,os
print(json.dumps({"format": int(sys.argv[1]), "scenario": "series", "step": "restore su-5", "op": "restore",
  "seconds": float(sys.argv[3]) - float(sys.argv[2]), "read": os.path.getsize(sys.argv[4])}))' \
      "$format" "$t0" "$t1" "$WORK/out.raw" >>"$OUT"
    cmp "$WORK/out.raw" "${@: -1}" || die "format $format: restore differs from $(basename "${@: -1}")"
    rm -f "$WORK/out.raw"
    python3 "$ROOT/bench/metadata.py" "$repo" --json | python3 -c '
import json, sys
m = json.loads(sys.stdin.read())
print(json.dumps({"format": int(sys.argv[1]), "scenario": "series", "step": "metadata", "op": "metadata", **m}))' "$format" >>"$OUT"
  fi
  rm -rf "$repo"
}

for f in $FORMATS; do
  run "$f" series "$DS"/su-{0,1,2,3,4,5}.raw
  run "$f" rebuilt "$DS"/su-1.raw "$DS"/su-1-rebuilt.raw
done

python3 - "$OUT" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
mib = 1 << 20
print(f"{'format':>6} {'scenario':>8} {'step':>13} {'op':>7} {'stored MiB':>10} {'new MiB':>8} {'s':>6} {'MiB/s':>7}")
for r in rows:
    if r["op"] == "metadata":
        continue
    stored = r.get("stored", 0) / mib
    new = r.get("new", 0) / mib
    rate = r["read"] / mib / r["seconds"] if r["seconds"] else 0
    print(f"{r['format']:>6} {r['scenario']:>8} {r['step']:>13} {r['op']:>7} {stored:>10.1f} {new:>8.1f} {r['seconds']:>6.2f} {rate:>7.0f}")
for f in sorted({r["format"] for r in rows}):
    s = sum(r.get("stored", 0) for r in rows if r["format"] == f and r["scenario"] == "series")
    print(f"format {f}: su-0..su-5 stored {s / mib:.1f} MiB")
    for m in (r for r in rows if r["format"] == f and r["op"] == "metadata"):
        print(f"format {f}: metadata (trees, index, summaries, records) {100 * m['metadata_share']:.2f}%"
              f" of {m['total'] / mib:.1f} MiB; pack trailers {100 * m['trailer_share']:.2f}%")
EOF
echo "results: $OUT"

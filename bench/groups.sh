#!/usr/bin/env bash
# Format-v2 study (issue 16): what 4/8/16 KiB dedup inside compressed chunk groups of
# 64–256 KiB would store, and at what zstd cost, simulated over the real images by
# `cairn-groups` (crates/cairn-bench/src/groups.rs) before the format is written.
#
#   bench/groups.sh [DATASET_DIR]     (default: .data/full, built if missing)
#
# Writes bench/results/groups-DATE.jsonl and .md (tables by bench/groups_report.py).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/scripts/lib.sh"
DS=${1:-$(dataset_dir full)}
cargo build -q --release -p cairn-bench --manifest-path "$ROOT/Cargo.toml"
G="$(_cargo_target_dir)/release/cairn-groups"
OUT="$ROOT/bench/results/groups-$(date -u +%F).jsonl"
series=("$DS"/su-{0,1,2,3,4,5}.raw)
golden=("$DS"/su-1.raw "$DS"/pa-a.raw "$DS"/pa-b.raw "$DS"/pa-c.raw "$DS"/su-1-rebuilt.raw)
tag() { python3 -c 'import json,sys
for l in sys.stdin: d=json.loads(l); d["scenario"]=sys.argv[1]; print(json.dumps(d, sort_keys=True))' "$1"; }
{
  "$G" --chunk 4096,8192,16384 --group 0,65536,131072,262144 --level 3 "${series[@]}" | tag series
  "$G" --chunk 4096,8192,16384 --group 0,65536,131072,262144 --level 3 "${golden[@]}" | tag golden
  "$G" --chunk 4096 --group 65536,131072,262144 --level 1,3,6,9 "${series[@]}" | tag levels
  "$G" --chunk 4096 --group 65536,262144 --level 3 --skip-test "${series[@]}" | tag estimate
} > "$OUT"
python3 "$ROOT/bench/groups_report.py" "$OUT"

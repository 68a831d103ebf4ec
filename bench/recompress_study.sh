#!/usr/bin/env bash
# What cold recompression could store (issue 56 item 4), before the format changes: the
# practical floor of the series (bench/floor.py: distinct non-zero 4 KiB blocks once, one
# `zstd -9 --long=27` stream) beside `cairn-groups` replays of the commits with groups of
# 64 KiB (today's) and 1 MiB, compressed at zstd 3 (today's), 12 and 19. Data bytes only
# (no pack headers, trailers or manifest). Writes one JSON document to OUT.
#
#   bench/recompress_study.sh [DATASET_DIR] [OUT]     (default .data/small, stdout)
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-.data/small}
out=${2:-/dev/stdout}
images=("$data"/su-*.raw)
cargo build -q --profile ci -p cairn-bench
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 bench/floor.py "${images[@]}" --json > "$tmp/floor.json"
for level in 3 12 19; do
    target/ci/cairn-groups --chunk 4096 --group 65536,1048576 --level "$level" "${images[@]}" \
        > "$tmp/groups-$level.jsonl"
done
python3 - "$tmp" > "$out" <<'PY'
import json, sys, glob, os
tmp = sys.argv[1]
floor = json.load(open(os.path.join(tmp, "floor.json")))
configs = {}
for f in sorted(glob.glob(os.path.join(tmp, "groups-*.jsonl"))):
    for line in open(f):
        d = json.loads(line)
        k = f"{d['group']}:{d['level']}"
        c = configs.setdefault(k, {"group": d["group"], "level": d["level"],
                                   "stored_bytes": 0, "compress_cpu_s": 0.0, "new_bytes": 0})
        c["stored_bytes"] += d["stored_bytes"]
        c["compress_cpu_s"] += d["compress_cpu_s"]
        c["new_bytes"] += d["new_bytes"]
rows = sorted(configs.values(), key=lambda c: (c["group"], c["level"]))
for c in rows:
    c["vs_floor"] = c["stored_bytes"] / floor["floor_bytes"]
today = configs["65536:3"]["stored_bytes"]
for c in rows:
    c["vs_today"] = c["stored_bytes"] / today
print(json.dumps({"floor": floor, "configs": rows}, indent=1))
PY

#!/usr/bin/env bash
# Cold recompression measured (issue 56 item 4): the dataset's su-* images committed in
# order, then `cairn gc --recompress LEVEL`: stored bytes before and after against the
# practical floor (bench/floor.py), the GC's time, and every version restored and compared
# with its image. Writes one JSON document to OUT.
#
#   bench/recompress.sh [DATASET_DIR] [OUT] [LEVEL]     (default .data/small, stdout, 19)
set -euo pipefail
cd "$(dirname "$0")/.."
data=${1:-.data/small}
out=${2:-/dev/stdout}
level=${3:-19}
images=("$data"/su-*.raw)
cargo build -q --profile ci -p cairn-cli
bin=target/ci/cairn
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
repo=$tmp/repo
$bin --repo "$repo" -q init --reserve 0
for img in "${images[@]}"; do $bin --repo "$repo" -q commit vm "$img"; done
start=$(date +%s.%N)
$bin --repo "$repo" --json gc --recompress "$level" > "$tmp/gc.json"
end=$(date +%s.%N)
n=0
for img in "${images[@]}"; do
    n=$((n + 1))
    $bin --repo "$repo" -q restore "vm@$n" "$tmp/out.raw"
    cmp "$tmp/out.raw" "$img"
    rm "$tmp/out.raw"
done
python3 bench/floor.py "${images[@]}" --json > "$tmp/floor.json"
python3 - "$tmp" "$level" "$start" "$end" "${images[@]}" > "$out" <<'PY'
import json, os, sys
tmp, level, start, end, images = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), sys.argv[5:]
gc = json.load(open(os.path.join(tmp, "gc.json")))
floor = json.load(open(os.path.join(tmp, "floor.json")))["floor_bytes"]
print(json.dumps({
    "images": images, "level": level, "gc_seconds": end - start,
    "before_bytes": gc["before_bytes"], "after_bytes": gc["after_bytes"],
    "packs_recompressed": gc["packs_recompressed"], "floor_bytes": floor,
    "before_vs_floor": gc["before_bytes"] / floor, "after_vs_floor": gc["after_bytes"] / floor,
    "after_vs_before": gc["after_bytes"] / gc["before_bytes"],
    "versions_restored_bit_exact": len(images),
}, indent=1))
PY

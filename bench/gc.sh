#!/usr/bin/env bash
# GC cost against repository size: commits the first K images of the full dataset (K = 3, 6,
# 10) as versions of one image, deletes every version but the newest, runs `cairn gc`, and
# reports wall time, peak RSS, manifest bytes read, bytes before/after, and the ratio of the
# collected repository to a fresh repository holding only the newest version.
#
#   bench/gc.sh [DATASET_DIR]     (default: .data/full, built if missing)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck disable=SC1091
source "$ROOT/scripts/lib.sh"
DS=${1:-$(dataset_dir full)}
CAIRN=$(cairn_bin)
WORK=$(mktemp -d -p "$ROOT/.data" gc-bench.XXXXXX); trap 'rm -rf "$WORK"' EXIT
images=(su-0 su-1 su-2 su-3 su-4 su-5 pa-a pa-b pa-c su-1-rebuilt)
j() { python3 -c "import json,sys; d=json.load(sys.stdin); print(d['$1'])"; }
mib() { python3 -c "print(f'{$1/1048576:.1f}')"; }

echo "# cairn gc cost vs repository size — $(date -u +%F), \`bench/gc.sh\`"
echo
echo '| versions | repo before MiB | after MiB | fresh (newest only) MiB | after ÷ fresh | gc wall s | gc peak RSS MiB | manifest read KiB | packs deleted / repacked |'
echo '|---|---|---|---|---|---|---|---|---|'
for k in 3 6 10; do
  R="$WORK/r$k"; "$CAIRN" --repo "$R" -q init >/dev/null
  for ((i = 0; i < k; i++)); do "$CAIRN" --repo "$R" -q commit vm "$DS/${images[$i]}.raw" >/dev/null; done
  for ((i = 1; i < k; i++)); do "$CAIRN" --repo "$R" -q rm "vm@$i" >/dev/null; done
  before=$(du -sb "$R" | cut -f1)
  /usr/bin/time -f '%e %M' -o "$WORK/time" "$CAIRN" --repo "$R" -q --json gc > "$WORK/gc.json"
  read -r wall rss < "$WORK/time"
  after=$(du -sb "$R" | cut -f1)
  F="$WORK/f$k"; "$CAIRN" --repo "$F" -q init >/dev/null
  "$CAIRN" --repo "$F" -q commit vm "$DS/${images[$((k - 1))]}.raw" >/dev/null
  fresh=$(du -sb "$F" | cut -f1)
  "$CAIRN" --repo "$R" -q verify >/dev/null
  printf '| %s | %s | %s | %s | %.3f | %s | %s | %s | %s / %s |\n' "$k" "$(mib "$before")" "$(mib "$after")" \
    "$(mib "$fresh")" "$(python3 -c "print($after/$fresh)")" "$wall" "$((rss / 1024))" \
    "$(( $(j metadata_bytes_read < "$WORK/gc.json") / 1024 ))" "$(j packs_deleted < "$WORK/gc.json")" "$(j packs_repacked < "$WORK/gc.json")"
  rm -rf "$R" "$F"
done

#!/usr/bin/env bash
# GC cost against repository size: commits the first K images of the full dataset (K = 3, 6,
# 10) as versions of one image, deletes every version but the newest (`rm --no-gc`), then runs
# fast deletion (`cairn gc`) on the repository and the exact pass (`cairn gc --repair`) on a
# copy of it, and reports for each: wall time, peak RSS, metadata bytes read, and the ratio of
# the collected repository to a fresh repository holding only the newest version.
#
#   bench/gc.sh [DATASET_DIR]     (default: .data/full, built if missing)
set -euo pipefail
# Peers read their sources through the page cache and leave it there: so does cairn here
# (its default drops the pages a scan brought in, to be polite to a live host).
export CAIRN_KEEP_CACHE=1
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
echo '| versions | mode | repo before MiB | after MiB | fresh (newest only) MiB | after ÷ fresh | gc wall s | gc peak RSS MiB | metadata read KiB | packs deleted / repacked |'
echo '|---|---|---|---|---|---|---|---|---|---|'
for k in 3 6 10; do
  R="$WORK/r$k"; "$CAIRN" --repo "$R" -q init >/dev/null
  for ((i = 0; i < k; i++)); do "$CAIRN" --repo "$R" -q commit vm "$DS/${images[$i]}.raw" >/dev/null; done
  for ((i = 1; i < k; i++)); do "$CAIRN" --repo "$R" -q rm --no-gc "vm@$i" >/dev/null; done
  before=$(du -sb "$R" | cut -f1)
  F="$WORK/f$k"; "$CAIRN" --repo "$F" -q init >/dev/null
  "$CAIRN" --repo "$F" -q commit vm "$DS/${images[$((k - 1))]}.raw" >/dev/null
  fresh=$(du -sb "$F" | cut -f1)
  cp -a "$R" "$R-exact"
  for mode in fast repair; do
    repo="$R"; flags=()
    if [ "$mode" = repair ]; then repo="$R-exact"; flags=(--repair); fi
    /usr/bin/time -f '%e %M' -o "$WORK/time" "$CAIRN" --repo "$repo" -q --json gc "${flags[@]}" > "$WORK/gc.json"
    read -r wall rss < "$WORK/time"
    after=$(du -sb "$repo" | cut -f1)
    "$CAIRN" --repo "$repo" -q verify >/dev/null
    meta=$(python3 -c "import json; d=json.load(open('$WORK/gc.json')); print((d['metadata_bytes_read'] + d['summary_bytes']) // 1024)")
    printf '| %s | %s | %s | %s | %s | %.3f | %s | %s | %s | %s / %s |\n' "$k" "$mode" "$(mib "$before")" "$(mib "$after")" \
      "$(mib "$fresh")" "$(python3 -c "print($after/$fresh)")" "$wall" "$((rss / 1024))" \
      "$meta" "$(j packs_deleted < "$WORK/gc.json")" "$(j packs_repacked < "$WORK/gc.json")"
  done
  rm -rf "$R" "$R-exact" "$F"
done

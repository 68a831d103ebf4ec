#!/usr/bin/env bash
# Chunk-size study: stored bytes, metadata bytes and commit throughput of cairn for chunk
# sizes 4 KiB … 1 MiB, on the in-place series (su-0 … su-5) and on the rebuilt-layout image
# (su-1-rebuilt committed after su-1). Prints a Markdown table.
#
#   bench/chunking.sh [DATASET_DIR]     (default: .data/full, built if missing)
set -euo pipefail
# Peers read their sources through the page cache and leave it there: so does cairn here
# (its default drops the pages a scan brought in, to be polite to a live host).
export CAIRN_KEEP_CACHE=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/scripts/lib.sh"
DS=${1:-$(dataset_dir full)}
CAIRN=$(cairn_bin)
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
series=(su-0 su-1 su-2 su-3 su-4 su-5)
json() { python3 -c "import json,sys; d=json.load(sys.stdin); print(d['$1'])"; }

printf '| chunk | segment | su-0 stored | su-1 added | su-2..5 added | series total | metadata | su-1-rebuilt added | commit MiB/s (su-0) |\n'
printf '|---|---|---|---|---|---|---|---|---|\n'
for cs in 4K 8K 16K 32K 64K 128K 256K 1M; do
  seg=1M; [ "$cs" = 1M ] && seg=4M
  R="$WORK/repo-$cs"
  "$CAIRN" --repo "$R" -q init --chunk-size "$cs" --segment-size "$seg" >/dev/null
  declare -A added=()
  t0=0
  for s in "${series[@]}"; do
    out=$("$CAIRN" --repo "$R" -q --json commit vm "$DS/$s.raw")
    added[$s]=$(json stored_bytes <<<"$out")
    [ "$s" = su-0 ] && t0=$(python3 -c "import json,sys; d=json.load(sys.stdin); print(round(d['data_bytes']/d['duration_s']/1048576))" <<<"$out")
  done
  total=$("$CAIRN" --repo "$R" -q --json stats | json stored_bytes)
  packs=$("$CAIRN" --repo "$R" -q --json stats | json pack_bytes)
  meta=$(du -sb "$R"/index "$R"/versions | awk '{s+=$1} END {print s}')
  # Node packs are part of pack_bytes; measure manifest bytes from the node-only packs is
  # not separable by name, so report index + version objects here and tree bytes below.
  rest=$(( added[su-2] + added[su-3] + added[su-4] + added[su-5] ))
  R2="$WORK/rebuilt-$cs"
  "$CAIRN" --repo "$R2" -q init --chunk-size "$cs" --segment-size "$seg" >/dev/null
  "$CAIRN" --repo "$R2" -q --json commit vm "$DS/su-1.raw" >/dev/null
  rb=$("$CAIRN" --repo "$R2" -q --json commit vm "$DS/su-1-rebuilt.raw" | json stored_bytes)
  mib() { python3 -c "print(f'{$1/1048576:.1f} MiB')"; }
  printf '| %s | %s | %s | %s | %s | %s | %s | %s | %s |\n' "$cs" "$seg" "$(mib "${added[su-0]}")" \
    "$(mib "${added[su-1]}")" "$(mib $rest)" "$(mib "$total")" "$(mib "$meta")" "$(mib "$rb")" "$t0"
  unset added
  rm -rf "$R" "$R2"
done

#!/usr/bin/env bash
# GC on format 1 and format 2 (issue 16): the su-* series committed into each, su@1…su@3
# removed with `rm --no-gc`, then `cairn gc` (fast deletion by reference summaries: format 1's
# Bloom filters of chunks, format 2's tables of group slots) and `gc --repair` (the exact
# mark). Reports the summaries' size against the stored bytes, each GC's time, peak RSS,
# bytes before and after, what was repacked, summary and manifest bytes read, and the stored
# bytes against a repository holding only su-3…su-5; checks su@4 and su@6 bit-exact after
# the GCs.
#
#   bench/gc.sh [DATASET_DIR]     (default: .data/full, built if missing)
#
# This cairn writes format 2 only (format 1 is read-only since 2026-12-02): the format 1 run
# needs CAIRN_V1_BIN, a cairn built from an earlier commit (e.g. c778d08); without it only
# format 2 runs.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/scripts/lib.sh"
DS=${1:-$(dataset_dir full)}
cargo build -q --release -p cairn-cli --manifest-path "$ROOT/Cargo.toml"
CAIRN="$(_cargo_target_dir)/release/cairn"
C=$CAIRN
FORMATS="2"
[ -n "${CAIRN_V1_BIN:-}" ] && FORMATS="1 2"
W=$(mktemp -d "${TMPDIR:-/tmp}/cairn-gc.XXXXXX"); trap 'rm -rf "$W"' EXIT

# One GC, timed: "<seconds> <peak RSS KiB>" on fd 3, its --json report in $W/gc.json.
timed_gc() {
  /usr/bin/time -f "%e %M" -o "$W/time" "$C" -q --json --repo "$1" gc "${@:2}" >"$W/gc.json"
  cat "$W/time"
}
for fmt in $FORMATS; do
  R="$W/v$fmt"; F="$W/fresh$fmt"
  if [ "$fmt" = 1 ]; then C=$CAIRN_V1_BIN; else C=$CAIRN; fi
  $C -q --repo "$R" init --format "$fmt" --reserve 0
  $C -q --repo "$F" init --format "$fmt" --reserve 0
  for i in 0 1 2 3 4 5; do
    $C -q --repo "$R" commit su "$DS/su-$i.raw" >/dev/null
    [ "$i" -ge 3 ] && $C -q --repo "$F" commit su "$DS/su-$i.raw" >/dev/null
  done
  sums=$(du -sb "$R/summaries" | cut -f1); all=$(du -sb "$R" | cut -f1)
  echo "format $fmt: 6 reference summaries $sums B of $all B stored ($(echo "scale=4; 100 * $sums / $all" | bc)%)"
  $C -q --repo "$R" rm --no-gc su@1 su@2 su@3 >/dev/null
  for mode in "" "--repair"; do
    read -r secs rss < <(timed_gc "$R" $mode)
    python3 - "$W/gc.json" "$fmt" "gc $mode" "$secs" "$rss" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
fmt, what, secs, rss = sys.argv[2], sys.argv[3].strip(), float(sys.argv[4]), int(sys.argv[5])
mib = lambda b: b / 2**20
print(f"format {fmt} {what:12s} {secs:6.2f} s  peak RSS {rss/1024:6.1f} MiB  "
      f"{mib(r['before_bytes']):7.1f} -> {mib(r['after_bytes']):7.1f} MiB  "
      f"packs deleted {r['packs_deleted']}, repacked {r['packs_repacked']} "
      f"({mib(r['repacked_bytes']):.1f} MiB copied), written {r['packs_written']}; "
      f"read {mib(r['summary_bytes']):.2f} MiB of summaries, "
      f"{mib(r['metadata_read_bytes']):.2f} MiB of manifests")
PY
  done
  kept=$(du -sb "$R" | cut -f1); fresh=$(du -sb "$F" | cut -f1)
  echo "format $fmt: repository after gc $kept B; holding su-3…su-5 only $fresh B ($(echo "scale=3; $kept / $fresh" | bc)x)"
  for v in 4 6; do
    $C -q --repo "$R" restore "su@$v" "$W/out.raw" --force
    cmp "$W/out.raw" "$DS/su-$((v-1)).raw" && echo "format $fmt: su@$v bit-exact after gc"
  done
done

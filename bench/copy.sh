#!/usr/bin/env bash
# `cairn copy` (issue 16, slice 5): the su-* series committed into a format 1 repository,
# then copied into a new format 2 repository, against committing the same images into a
# format 2 repository directly. Reports time, bytes read from the source, stored bytes, the
# second run (which must copy nothing), and checks the first and last copies bit-exact.
#
#   CAIRN_V1_BIN=OLD bench/copy.sh [DATASET_DIR]     (default: .data/full, built if missing)
#
# This cairn no longer writes format 1 (read-only since 2026-12-02): OLD, a cairn built from
# an earlier commit (e.g. c778d08), writes the format 1 source; this one copies it.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/scripts/lib.sh"
DS=${1:-$(dataset_dir full)}
cargo build -q --release -p cairn-cli --manifest-path "$ROOT/Cargo.toml"
C="$(_cargo_target_dir)/release/cairn"
V1=${CAIRN_V1_BIN:?set CAIRN_V1_BIN to a cairn built before 2026-12-02: it writes the format 1 source}
W=$(mktemp -d "${TMPDIR:-/tmp}/cairn-copy.XXXXXX"); trap 'rm -rf "$W"' EXIT
drop() { sync; echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || true; }
secs() { local s; s=$(date +%s.%N); "$@" >/dev/null; echo "$(date +%s.%N) - $s" | bc; }

$V1 -q --repo "$W/v1" init --format 1 --reserve 0
$C -q --repo "$W/v2" init --format 2 --reserve 0
$C -q --repo "$W/cp" init --format 2 --reserve 0
direct=0
for i in 0 1 2 3 4 5; do
  drop; $V1 -q --repo "$W/v1" commit su "$DS/su-$i.raw" -m "su-$i" >/dev/null
  drop; t=$(secs $C -q --repo "$W/v2" commit su "$DS/su-$i.raw" -m "su-$i")
  direct=$(echo "$direct + $t" | bc)
done
drop
t0=$(date +%s.%N)
$C -q --json --repo "$W/cp" copy --from "$W/v1" >"$W/copy.json"
copy=$(echo "$(date +%s.%N) - $t0" | bc)
again=$(secs $C -q --repo "$W/cp" copy --from "$W/v1")
data=$($C --json --repo "$W/v1" log su | python3 -c 'import json,sys; print(sum(v["data_bytes"] for v in json.load(sys.stdin)))')
python3 - "$W/copy.json" "$data" "$direct" "$copy" "$again" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
data, direct, copy, again = int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]), float(sys.argv[5])
print(f"versions copied: {len(r['copied'])}; data in them {data/2**20:.1f} MiB; "
      f"read from the source {r['read_bytes']/2**20:.1f} MiB ({r['read_bytes']/data:.2f}x)")
print(f"direct format 2 commits: {direct:.2f} s; copy: {copy:.2f} s ({copy/direct:.2f}x); second copy: {again:.2f} s")
PY
du -sb "$W/v1" "$W/v2" "$W/cp"
for i in 1 6; do
  $C -q --repo "$W/cp" restore "su@$i" "$W/out.raw" --force
  cmp "$W/out.raw" "$DS/su-$((i-1)).raw" && echo "su@$i bit-exact"
done

#!/usr/bin/env bash
# Runs cairn's main job end to end on real Debian VM disk images:
#
#   scripts/demo.sh           small dataset (.data/small, 1 GiB images; built if missing, needs root)
#   scripts/demo.sh --full    full dataset (.data/full, 2 GiB images)
#
# Makes a fresh repository in .data/demo-repo, commits su-0, su-1, su-2 as versions of the image
# demo/vm, shows the log and stats, restores the newest version to .data/demo-restore.raw,
# compares it with su-2.raw, verifies the repository and prints a summary.
set -euo pipefail

# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

KIND=small
for a in "$@"; do
  case "$a" in
    --full) KIND=full ;;
    --small) KIND=small ;;
    -h | --help)
      sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
      exit 0
      ;;
    *) echo "demo.sh: unknown argument: $a (try --help)" >&2; exit 2 ;;
  esac
done

cd "$ROOT"
banner() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
[ -t 1 ] || banner() { printf '\n== %s\n' "$*"; }
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
now_ms() { echo $(($(date +%s%N) / 1000000)); }
secs() { awk -v ms="$1" 'BEGIN { printf "%.2f s", ms / 1000 }'; }

banner "dataset ($KIND)"
ensure_apt_packages jq diffutils qemu-utils libnbd-bin
DS=$(dataset_dir "$KIND")
for i in 0 1 2; do
  [ -f "$DS/su-$i.raw" ] || die "$DS/su-$i.raw missing"
done
cat "$DS/SIZES.txt"

banner "build cairn (release)"
BIN=$(cairn_bin)
echo "$BIN"
cairn() { "$BIN" --repo "$REPO" "$@"; }

REPO="$ROOT/.data/demo-repo"
OUT="$ROOT/.data/demo-restore.raw"
banner "fresh repository $REPO"
rm -rf "$REPO" "$OUT"
cairn init

declare -a STORED TIMES
for i in 0 1 2; do
  banner "commit su-$i.raw as demo/vm"
  t0=$(now_ms)
  json=$(cairn --json commit demo/vm "$DS/su-$i.raw" -m "su-$i")
  TIMES[i]=$(($(now_ms) - t0))
  echo "$json"
  STORED[i]=$(jq -r '.stored_bytes' <<<"$json")
  printf 'version %s (id %s): %s logical, %s newly stored, %s\n' \
    "$(jq -r .seq <<<"$json")" "$(jq -r .id <<<"$json" | cut -c1-12)" \
    "$(mib "$(jq -r .logical_bytes <<<"$json")")" "$(mib "${STORED[i]}")" "$(secs "${TIMES[i]}")"
done

banner "cairn log demo/vm"
cairn log demo/vm

banner "cairn stats"
cairn stats
STATS=$(cairn --json stats)

banner "restore the newest version to $OUT"
t0=$(now_ms)
cairn restore demo/vm "$OUT" --force
RESTORE_MS=$(($(now_ms) - t0))
ls -ls "$OUT"
if cmp "$OUT" "$DS/su-2.raw"; then
  echo "cmp: restored image is byte-identical to su-2.raw"
else
  die "restored image differs from su-2.raw"
fi

banner "serve demo/vm@1 over NBD (lazy) and read it with nbdcopy"
SOCK="$ROOT/.data/demo-nbd.sock"
NBD_OUT="$ROOT/.data/demo-nbd.raw"
rm -rf "$ROOT/.data/demo-cache" "$NBD_OUT"
export CAIRN_RUN_DIR="$ROOT/.data/demo-run"
READY="$ROOT/.data/demo-export.json"
rm -f "$READY"
# The binary itself in the background (not the `cairn` shell function, whose subshell would
# be what $! names), printing one JSON line once it serves.
"$BIN" --repo "$REPO" --json export demo/vm@1 --name demo --socket "$SOCK" \
  --cache-dir "$ROOT/.data/demo-cache" >"$READY" &
EXPORT_PID=$!
# On every way out: stop it (it flushes and removes its files), or kill it if that fails.
stop_export() {
  "$BIN" exports stop demo >/dev/null 2>&1 || kill "$EXPORT_PID" 2>/dev/null || true
  wait "$EXPORT_PID" 2>/dev/null || true
}
trap stop_export EXIT
for _ in $(seq 600); do
  [ -s "$READY" ] && break
  kill -0 "$EXPORT_PID" 2>/dev/null || die "the export did not start"
  sleep 0.05
done
[ -s "$READY" ] || die "the export did not start serving"
URI=$(jq -r .uri <"$READY")
nbdinfo --map "$URI" | head -5
t0=$(now_ms)
nbdcopy "$URI" "$NBD_OUT"
NBD_MS=$(($(now_ms) - t0))
cmp "$NBD_OUT" "$DS/su-0.raw" || die "the export differs from su-0.raw"
echo "cmp: the export of demo/vm@1 is byte-identical to su-0.raw"
cairn status demo
"$BIN" exports
"$BIN" exports stop demo
wait "$EXPORT_PID" 2>/dev/null || true
trap - EXIT
rm -f "$NBD_OUT"

banner "cairn verify"
cairn verify
echo "verify: ok"

banner "summary"
SIZE=$(stat -c %s "$DS/su-0.raw")
DATA=0
for i in 0 1 2; do
  DATA=$((DATA + $(du -k "$DS/su-$i.raw" | cut -f1) * 1024))
done
LOGICAL=$(jq -r .logical_bytes <<<"$STATS")
STORED_TOTAL=$(jq -r .stored_bytes <<<"$STATS")
printf '  images:           3 versions of demo/vm, %s each (su-0, su-1, su-2)\n' "$(mib "$SIZE")"
printf '  allocated data:   %s in the three source files\n' "$(mib "$DATA")"
printf '  commits:          su-0 %s (+%s), su-1 %s (+%s), su-2 %s (+%s)\n' \
  "$(secs "${TIMES[0]}")" "$(mib "${STORED[0]}")" "$(secs "${TIMES[1]}")" "$(mib "${STORED[1]}")" \
  "$(secs "${TIMES[2]}")" "$(mib "${STORED[2]}")"
printf '  repository:       %s logical, %s stored (%s on disk)\n' \
  "$(mib "$LOGICAL")" "$(mib "$STORED_TOTAL")" "$(du -sh "$REPO" | cut -f1)"
awk -v l="$LOGICAL" -v s="$STORED_TOTAL" 'BEGIN { if (s > 0) printf "  reduction:        %.1fx\n", l / s }'
printf '  restore:          %s, byte-identical to su-2.raw (%s)\n' "$(secs "$RESTORE_MS")" "$OUT"
printf '  nbd export:       demo/vm@1 copied by nbdcopy in %s, byte-identical to su-0.raw\n' "$(secs "$NBD_MS")"
printf '  verify:           ok\n'
echo
echo "demo: done"

#!/usr/bin/env bash
# A real boot over a cairn export (issue 4): QEMU (TCG) boots su-1.raw of the full dataset to
# the systemd marker, from a local raw file and then from `cairn export` with a cold chunk
# cache; then pa-a.raw from a second export sharing that cache. Reports boot times (wall
# clock to the marker, and the guest's uptime at the marker), bytes the guest read, and bytes
# fetched from the repository. Finally su-1 boots from a *writable* export (no snapshot=on):
# what the guest wrote is committed back as su-1@2, which must restore byte for byte to what
# the export showed.
#
# The repository is the default format 2 (4 KiB chunks in compressed groups: a miss fetches a
# whole group). The exports pass --no-profile, so every boot is cold; boots and trace replays
# with and without a boot profile, on a local directory and on MinIO, are
# bench/boot_profile.py's.
#
#   bench/boot.sh [DATASET_DIR]     (default: .data/full, built if missing; ~2-3 minutes)
#   CAIRN_READAHEAD=N bench/boot.sh the exports' --readahead (default: cairn's)
set -euo pipefail
# Peers read their sources through the page cache and leave it there: so does cairn here
# (its default drops the pages a scan brought in, to be polite to a live host).
export CAIRN_KEEP_CACHE=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck disable=SC1091
source "$ROOT/scripts/lib.sh"
ensure_apt_packages qemu-system-x86 qemu-utils libnbd-bin jq bc
DS=${1:-$(dataset_dir full)}
CAIRN=$(cairn_bin)
WORK=$(mktemp -d -p "$ROOT/.data" boot-bench.XXXXXX)
PIDS=()
cleanup() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$WORK"; }
trap cleanup EXIT

# boot DRIVE LOG: boots to the systemd marker; prints "wall_seconds guest_uptime".
boot() {
  local drive=$1 log=$2 start end
  start=$(date +%s.%N)
  timeout 300 qemu-system-x86_64 -machine q35 -accel tcg -cpu max -smp 2 -m 1024 -nic none \
    -display none -monitor none -serial "file:$log" -no-reboot \
    -kernel "$DS/boot/vmlinuz" -initrd "$DS/boot/initrd.img" \
    -append 'root=/dev/vda ro console=ttyS0 quiet' \
    -drive "$drive,format=raw,if=virtio${SNAPSHOT-,snapshot=on}" >/dev/null 2>&1 &
  local qemu=$!
  until grep -q SYSTEMD-MARKER-REACHED "$log" 2>/dev/null; do
    kill -0 "$qemu" 2>/dev/null || { echo "qemu exited before the marker: $(tail -5 "$log")" >&2; exit 1; }
    sleep 0.1
  done
  end=$(date +%s.%N)
  kill "$qemu" 2>/dev/null || true
  wait "$qemu" 2>/dev/null || true
  printf '%.1f %s\n' "$(echo "$end - $start" | bc)" "$(grep -o 'SYSTEMD-MARKER-REACHED uptime=[0-9.]*' "$log" | cut -d= -f2)"
}

# serve SPEC TAG [FLAGS...]: serves SPEC on a Unix socket with the shared cache; sets DRIVE.
serve() {
  local spec=$1 tag=$2
  shift 2
  CAIRN_RUN_DIR="$WORK/run" "$CAIRN" --repo "$WORK/repo" -q export "$spec" --name "$tag" \
    --socket "$WORK/$tag.sock" --cache-dir "$WORK/cache" --stats-file "$WORK/$tag.json" --no-profile ${CAIRN_READAHEAD:+--readahead "$CAIRN_READAHEAD"} "$@" \
    >"$WORK/$tag.out" 2>&1 &
  PIDS+=($!)
  until [ -S "$WORK/$tag.sock" ]; do sleep 0.05; done
  DRIVE="file=nbd+unix:///$tag?socket=$WORK/$tag.sock"
}

stat_of() { sleep 1.2; jq -r ".$2" "$WORK/$1.json"; }
mib() { echo "scale=1; $1 / 1048576" | bc; }

"$CAIRN" --repo "$WORK/repo" -q init >/dev/null
"$CAIRN" --repo "$WORK/repo" -q commit su-1 "$DS/su-1.raw" >/dev/null
"$CAIRN" --repo "$WORK/repo" -q commit pa-a "$DS/pa-a.raw" >/dev/null

read -r local_wall local_up < <(boot "file=$DS/su-1.raw" "$WORK/local.log")
serve su-1 su1
read -r cold_wall cold_up < <(boot "$DRIVE" "$WORK/su1.log")
su1_read=$(stat_of su1 read_bytes); su1_fetched=$(stat_of su1 fetched_bytes)
serve pa-a paa
read -r pa_wall pa_up < <(boot "$DRIVE" "$WORK/paa.log")
pa_read=$(stat_of paa read_bytes); pa_fetched=$(stat_of paa fetched_bytes)
pa_hits=$(stat_of paa cache_hits); pa_miss=$(stat_of paa cache_misses)

# A writable boot: the guest's writes land in the overlay, then become su-1@2.
serve su-1 w1 --writable --overlay "$WORK/overlay"
SNAPSHOT='' boot "$DRIVE" "$WORK/w1.log" >/dev/null
w_written=$(stat_of w1 written_bytes)
nbdcopy "nbd+unix:///w1?socket=$WORK/w1.sock" "$WORK/after-boot.raw"
commit_json=$(CAIRN_RUN_DIR="$WORK/run" "$CAIRN" --repo "$WORK/repo" --json commit su-1 --from-export w1 -m "after a boot")
"$CAIRN" --repo "$WORK/repo" -q restore su-1@2 "$WORK/restored.raw" >/dev/null
cmp "$WORK/after-boot.raw" "$WORK/restored.raw" || { echo "su-1@2 differs from what the export showed" >&2; exit 1; }
changed=$(cmp -l "$DS/su-1.raw" "$WORK/restored.raw" | wc -l || true)

echo "# Boot over cairn export — $(date -u +%F), \`bench/boot.sh\`"
echo
echo "QEMU $(qemu-system-x86_64 --version | head -1 | awk '{print $4}') TCG, 2 vCPUs, systemd boot to the marker; the guest disk opened with snapshot=on."
echo
echo '| boot | wall to marker s | guest uptime at marker s | guest read MiB | fetched from repository MiB | fetched ÷ read |'
echo '|---|---|---|---|---|---|'
echo "| su-1, local raw file | $local_wall | $local_up | – | – | – |"
echo "| su-1, cairn export, cold cache | $cold_wall | $cold_up | $(mib "$su1_read") | $(mib "$su1_fetched") | $(echo "scale=2; $su1_fetched / $su1_read" | bc) |"
echo "| pa-a next, same host cache | $pa_wall | $pa_up | $(mib "$pa_read") | $(mib "$pa_fetched") | $(echo "scale=2; $pa_fetched / $pa_read" | bc) |"
echo
echo "Writable boot of su-1 (no snapshot=on): the guest wrote $((w_written / 1024)) KiB; \`cairn commit su-1 --from-export\` stored $(($(jq -r .stored_bytes <<<"$commit_json") / 1024)) KiB in $(jq -r .new_chunks <<<"$commit_json") new chunks as su-1@2."
echo "su-1@2 restores byte for byte to what the writable export showed after the boot ($changed bytes differ from su-1)."
echo "Boot time over the export ÷ local: $(echo "scale=2; $cold_wall / $local_wall" | bc) (wall), $(echo "scale=2; $cold_up / $local_up" | bc) (guest uptime). pa-a cache hits $pa_hits, misses $pa_miss."

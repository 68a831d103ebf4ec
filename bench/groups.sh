#!/usr/bin/env bash
# Format-v2 study (issue 16): what 4/8/16 KiB dedup inside compressed chunk groups of
# 64–256 KiB would store, and at what zstd cost, simulated over the real images by
# `cairn-groups` (crates/cairn-bench/src/groups.rs) before the format is written.
#
#   bench/groups.sh [DATASET_DIR]     (default: .data/full, built if missing)
#
# Writes bench/results/groups-DATE.jsonl and .md (tables by bench/groups_report.py), and
# groups-DATE.trace: the reads of a guest booting su-1 to the systemd marker (QEMU's
# blk_co_preadv trace), replayed against each layout to show what a cold lazy boot fetches.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
source "$ROOT/scripts/lib.sh"
ensure_apt_packages qemu-system-x86
DS=${1:-$(dataset_dir full)}
cargo build -q --release -p cairn-bench --manifest-path "$ROOT/Cargo.toml"
G="$(_cargo_target_dir)/release/cairn-groups"
OUT="$ROOT/bench/results/groups-$(date -u +%F).jsonl"
TRACE="${OUT%.jsonl}.trace"
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT

# The guest's reads during a boot of su-1 (TCG, as bench/boot.sh boots it).
timeout 300 qemu-system-x86_64 -machine q35 -accel tcg -cpu max -smp 2 -m 1024 -nic none \
  -display none -monitor none -serial "file:$WORK/serial.log" -no-reboot \
  -kernel "$DS/boot/vmlinuz" -initrd "$DS/boot/initrd.img" \
  -append 'root=/dev/vda ro console=ttyS0 quiet' \
  -drive "file=$DS/su-1.raw,format=raw,if=virtio,snapshot=on" \
  -trace "enable=blk_co_preadv,file=$WORK/trace.log" >/dev/null 2>&1 &
qemu=$!
until grep -q SYSTEMD-MARKER-REACHED "$WORK/serial.log" 2>/dev/null; do
  kill -0 "$qemu" 2>/dev/null || die "qemu exited before the marker: $(tail -5 "$WORK/serial.log")"
  sleep 0.2
done
kill "$qemu"; wait "$qemu" 2>/dev/null || true
cp "$WORK/trace.log" "$TRACE"
series=("$DS"/su-{0,1,2,3,4,5}.raw)
golden=("$DS"/su-1.raw "$DS"/pa-a.raw "$DS"/pa-b.raw "$DS"/pa-c.raw "$DS"/su-1-rebuilt.raw)
tag() { python3 -c 'import json,sys
for l in sys.stdin: d=json.loads(l); d["scenario"]=sys.argv[1]; print(json.dumps(d, sort_keys=True))' "$1"; }
{
  "$G" --chunk 4096,8192,16384 --group 0,65536,131072,262144 --level 3 "${series[@]}" | tag series
  "$G" --chunk 4096,8192,16384 --group 0,65536,131072,262144 --level 3 "${golden[@]}" | tag golden
  "$G" --chunk 4096 --group 65536,131072,262144 --level 1,3,6,9 "${series[@]}" | tag levels
  "$G" --chunk 4096 --group 65536,262144 --level 3 --skip-test "${series[@]}" | tag estimate
  "$G" --chunk 4096,16384 --group 0,32768,65536,131072,262144 --level 3 --reads "$TRACE" \
    "$DS/su-1.raw" | tag boot
} > "$OUT"
python3 "$ROOT/bench/groups_report.py" "$OUT"

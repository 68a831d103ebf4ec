#!/usr/bin/env bash
# Fuzzes the qcow2 parser for a bounded time: malformed images must give an error, never a
# panic, a hang or a huge allocation.
#
#   scripts/fuzz.sh [SECONDS]      (default 60)
#
# With a nightly toolchain (rustup), coverage-guided: cargo-fuzz (libFuzzer) runs the target
# crates/cairn-image/fuzz/fuzz_targets/qcow2_parse.rs, seeded with small images made by
# qemu-img (v2, v3, compressed, zero clusters, a backing file name); cargo-fuzz is installed
# with `cargo install` the first time. Without nightly, the stable mutation fuzzer
# (crates/cairn-image/tests/fuzz_qcow2.rs: bit flips, overwrites, truncations of real
# images) runs instead, with a case count sized to about that time.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

SECONDS_LIMIT=${1:-60}
FUZZ_DIR="$ROOT/crates/cairn-image/fuzz"

if rustup run nightly rustc --version >/dev/null 2>&1 || rustup toolchain install nightly --profile minimal >/dev/null 2>&1; then
  if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    log "cargo install cargo-fuzz --locked (once)"
    cargo install cargo-fuzz --locked >&2
  fi
  corpus=$(mktemp -d)
  trap 'rm -rf "$corpus"' EXIT
  raw="$corpus/src.raw"
  python3 - "$raw" <<'PY'
import random, sys
r = random.Random(1)
with open(sys.argv[1], "wb") as f:
    f.truncate(2 << 20)
    for off in (0, 300_000, 1_200_000):
        f.seek(off)
        f.write(bytes(r.getrandbits(8) for _ in range(70_000)))
PY
  qemu-img convert -O qcow2 -o cluster_size=4096 "$raw" "$corpus/v3.qcow2"
  qemu-img convert -O qcow2 -o compat=0.10,cluster_size=4096 "$raw" "$corpus/v2.qcow2"
  qemu-img convert -O qcow2 -c -o cluster_size=4096 "$raw" "$corpus/deflate.qcow2"
  qemu-img convert -O qcow2 -c -o cluster_size=4096,compression_type=zstd "$raw" "$corpus/zstd.qcow2"
  qemu-img create -q -f qcow2 -o cluster_size=4096 -b v3.qcow2 -F qcow2 "$corpus/overlay.qcow2"
  qemu-io -f qcow2 -c "write -z 8192 65536" -c "write -P 0x11 200000 5000" "$corpus/overlay.qcow2" >/dev/null
  rm -f "$raw"
  mkdir -p "$corpus/run"
  cp "$corpus"/*.qcow2 "$corpus/run/"
  log "cargo +nightly fuzz run qcow2_parse for ${SECONDS_LIMIT} s (libFuzzer)"
  (cd "$FUZZ_DIR" && cargo +nightly fuzz run qcow2_parse "$corpus/run" -- \
    -max_total_time="$SECONDS_LIMIT" -rss_limit_mb=2048 -max_len=1048576 -timeout=10 >&2)
  echo "fuzz: cargo-fuzz ran qcow2_parse for ${SECONDS_LIMIT} s without a finding"
else
  # About 4,000 cases per second on 2 cores.
  cases=$((SECONDS_LIMIT * 4000))
  log "no nightly toolchain: running the stable mutation fuzzer, $cases cases"
  CAIRN_FUZZ_CASES=$cases cargo test --profile "${CAIRN_PROFILE:-release}" --workspace --test fuzz_qcow2 >&2
  echo "fuzz: the mutation fuzzer ran $cases cases without a finding"
fi

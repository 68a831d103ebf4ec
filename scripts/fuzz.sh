#!/usr/bin/env bash
# Fuzzes the qcow2 parser, the NBD server's network-facing decoding (option haggling,
# transmission requests), the NBD client's decoding of server replies and every decoder of
# repository bytes, each for a bounded time:
# malformed images, hostile client bytes and damaged objects
# must give an error (an NBD error reply, a closed connection), never a panic, a hang or a
# huge allocation.
#
#   scripts/fuzz.sh [SECONDS]      (default 60, per target)
#
# With a nightly toolchain (rustup), coverage-guided: cargo-fuzz (libFuzzer) builds the four
# targets of the crate fuzz/ at once (one compile of their dependencies), then runs
# fuzz/fuzz_targets/qcow2_parse.rs, seeded with small images made by qemu-img (v2, v3,
# compressed, zero clusters, a backing file name), fuzz/fuzz_targets/nbd_server.rs, seeded
# with valid client sessions, fuzz/fuzz_targets/nbd_client.rs (from a dictionary of the
# protocol's magics) and fuzz/fuzz_targets/format_decoders.rs (every decoder of repository
# bytes), seeded with the golden vectors;
# cargo-fuzz is installed with `cargo install` the first time. Without nightly, the stable
# mutation fuzzers (crates/cairn-image/tests/fuzz_qcow2.rs: bit flips, overwrites,
# truncations of real images; crates/cairn-nbd/tests/fuzz_server.rs: the same over client
# sessions, with checks of the replies; crates/cairn-nbd/tests/fuzz_client.rs: over a
# recorded server transcript) run instead, with case counts sized to about that
# time.
set -euo pipefail
# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

SECONDS_LIMIT=${1:-60}
# The cargo-fuzz crate (its own workspace: fuzz/Cargo.toml); cargo fuzz runs from its parent.
FUZZ_DIR="$ROOT/fuzz"
# Its build lives in the user's cache, not the checkout: a fresh clone then rebuilds only what
# changed (cargo's fingerprints decide) instead of the whole nightly ASan build (~6 minutes on
# 2 cores). CAIRN_FUZZ_TARGET_DIR overrides it.
FUZZ_TARGET=${CAIRN_FUZZ_TARGET_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/cairn/fuzz-target}

if rustup run nightly rustc --version >/dev/null 2>&1 || rustup toolchain install nightly --profile minimal >/dev/null 2>&1; then
  if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    log "cargo install cargo-fuzz --locked (once)"
    cargo install cargo-fuzz --locked >&2
  fi
  log "cargo +nightly fuzz build (the four targets, one compile)"
  (cd "$ROOT" && cargo +nightly fuzz build --target-dir "$FUZZ_TARGET" >&2)
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

  # The NBD server: seeds are whole client sessions (client flags, options, requests).
  nbd_corpus="$corpus/nbd"
  mkdir -p "$nbd_corpus"
  python3 - "$nbd_corpus" <<'PY'
import struct, sys
out = sys.argv[1]
def opt(o, data=b""):
    return b"IHAVEOPT" + struct.pack(">II", o, len(data)) + data
def s(x):
    return struct.pack(">I", len(x)) + x
def info(name, infos=()):
    return s(name) + struct.pack(">H", len(infos)) + b"".join(struct.pack(">H", i) for i in infos)
def meta(name, queries):
    return s(name) + struct.pack(">I", len(queries)) + b"".join(s(q) for q in queries)
def req(cmd, cookie, off, length, flags=0, payload=b""):
    return struct.pack(">IHHQQI", 0x25609513, flags, cmd, cookie, off, length) + payload
flags = struct.pack(">I", 3)
seeds = {
    "structured": flags + opt(8) + opt(10, meta(b"disk", [b"base:allocation"]))
    + opt(7, info(b"disk", [1, 3])) + req(0, 1, 0, 4096) + req(1, 2, 512, 16, 1, bytes(range(16)))
    + req(3, 3, 0, 0) + req(4, 4, 4096, 4096) + req(6, 5, 8192, 512, 2) + req(7, 6, 0, 65536)
    + req(7, 7, 30000, 8192, 8) + req(5, 8, 0, 4096) + req(0, 9, 60000, 100, 4) + req(2, 10, 0, 0),
    "export_name": struct.pack(">I", 1) + opt(1, b"disk") + req(0, 1, 100, 200)
    + req(1, 2, 0, 8, 0, b"12345678") + req(0, 3, 65536 - 8, 8) + req(2, 4, 0, 0),
    "haggle": flags + opt(3) + opt(6, info(b"ro", [1, 2, 3])) + opt(9, meta(b"", []))
    + opt(8) + opt(9, meta(b"disk", [b"base:"])) + opt(5) + opt(77, b"xyz") + opt(2),
}
for name, data in seeds.items():
    with open(f"{out}/{name}", "wb") as f:
        f.write(data)
PY
  printf '%s\n' '"IHAVEOPT"' '"\x25\x60\x95\x13"' '"base:allocation"' '"base:"' '"disk"' \
    '"\x00\x00\x00\x07"' '"\xff\xff\xff\xff"' >"$corpus/nbd.dict"

  # Every decoder of cairn-format: the first byte picks the decoder, so each golden vector
  # seeds each decoder (one line per decoder in the target's DECODERS table).
  format_corpus="$corpus/format"
  mkdir -p "$format_corpus"
  decoders=$(grep -c '^    ("' "$FUZZ_DIR/fuzz_targets/format_decoders.rs")
  python3 - "$format_corpus" "$decoders" "$ROOT"/crates/cairn-format/tests/golden/*.hex <<'PY'
import os, sys
out, n = sys.argv[1], int(sys.argv[2])
for path in sys.argv[3:]:
    data = bytes.fromhex(open(path).read())
    name = os.path.basename(path)[:-4]
    for which in range(n):
        with open(f"{out}/{which:02}-{name}", "wb") as f:
            f.write(bytes([which]) + data)
PY

  # The NBD client: what a server sends (greeting, option replies, transmission replies).
  client_corpus="$corpus/nbd-client"
  mkdir -p "$client_corpus"
  printf '%s\n' '"NBDMAGIC"' '"IHAVEOPT"' '"\x00\x03\xe8\x89\x04\x55\x65\xa9"' \
    '"\x67\x44\x66\x98"' '"\x66\x8e\x33\xef"' '"base:allocation"' '"\x00\x00\x00\x01"' \
    '"\xff\xff\xff\xff"' >"$corpus/nbd-client.dict"

  # The four fuzzers run at once (each libFuzzer process is single-threaded; three on two
  # cores take a third of the wall time of one after another), each into its own log; a
  # finding fails the script with the end of that log (the crash and its reproducer's path).
  fuzz_run() { # fuzz_run TARGET CORPUS LIBFUZZER_ARG...
    local target=$1 dir=$2
    shift 2
    (cd "$ROOT" && exec cargo +nightly fuzz run --target-dir "$FUZZ_TARGET" "$target" "$dir" -- \
      -max_total_time="$SECONDS_LIMIT" -rss_limit_mb=2048 -timeout=10 "$@") \
      >"$corpus/$target.log" 2>&1
  }
  log "cargo +nightly fuzz run qcow2_parse, nbd_server, format_decoders ($decoders decoders) and nbd_client, ${SECONDS_LIMIT} s each, at once (libFuzzer)"
  fuzz_run qcow2_parse "$corpus/run" -max_len=1048576 &
  local_pids=("$!")
  # No allocation of the server's may come near 512 MiB (options are capped at 64 KiB, WRITE
  # payloads at 32 MiB); a hostile 32-bit length would ask for up to 4 GiB.
  fuzz_run nbd_server "$nbd_corpus" -dict="$corpus/nbd.dict" -malloc_limit_mb=512 \
    -max_len=65536 &
  local_pids+=("$!")
  fuzz_run format_decoders "$format_corpus" -malloc_limit_mb=512 -max_len=262144 &
  local_pids+=("$!")
  # The client caps every reply length it accepts (a read's payload at the request's 4 MiB,
  # block status at 8 MiB): a hostile 32-bit length would ask for up to 4 GiB.
  fuzz_run nbd_client "$client_corpus" -dict="$corpus/nbd-client.dict" -malloc_limit_mb=512 \
    -max_len=65536 &
  local_pids+=("$!")
  found=0
  for i in 0 1 2 3; do
    target=$(echo qcow2_parse nbd_server format_decoders nbd_client | cut -d' ' -f$((i + 1)))
    if wait "${local_pids[$i]}"; then
      grep -E '^Done [0-9]+ runs' "$corpus/$target.log" >&2 || true
      echo "fuzz: cargo-fuzz ran $target for ${SECONDS_LIMIT} s without a finding"
    else
      echo "fuzz: $target FAILED; the end of its log:" >&2
      tail -n 60 "$corpus/$target.log" >&2
      found=1
    fi
  done
  [ "$found" -eq 0 ]
else
  # About 4,000 cases per second on 2 cores.
  cases=$((SECONDS_LIMIT * 4000))
  log "no nightly toolchain: running the stable mutation fuzzer, $cases cases"
  CAIRN_FUZZ_CASES=$cases cargo test --profile "${CAIRN_PROFILE:-release}" --workspace --test fuzz_qcow2 >&2
  echo "fuzz: the mutation fuzzer ran $cases cases without a finding"
  # About 250 sessions per second on 2 cores; the file has 4 properties.
  nbd_cases=$((SECONDS_LIMIT * 250 / 4))
  log "running the stable NBD server mutation fuzzer, $nbd_cases cases per property"
  CAIRN_FUZZ_CASES=$nbd_cases cargo test --profile "${CAIRN_PROFILE:-release}" -p cairn-nbd --test fuzz_server >&2
  echo "fuzz: the NBD server mutation fuzzer ran $nbd_cases cases per property without a finding"
  # Thousands of cases a second: the same count as the qcow2 fuzzer, per property.
  log "running the stable NBD client mutation fuzzer, $cases cases per property"
  CAIRN_FUZZ_CASES=$cases cargo test --profile "${CAIRN_PROFILE:-release}" -p cairn-nbd --test fuzz_client >&2
  echo "fuzz: the NBD client mutation fuzzer ran $cases cases per property without a finding"
fi

#!/usr/bin/env bash
# End-to-end test of the cairn CLI on the small dataset (real Debian images, real tools).
#
#   scripts/e2e.sh
#
# Environment:
#   CAIRN_BIN=PATH       use this binary instead of building target/release/cairn
#   CAIRN_DATASET=DIR    use this dataset (su-0.raw su-1.raw su-2.raw) instead of .data/small
#   CAIRN_E2E_KEEP=1     keep the temporary repository for inspection
#
# Every step is an assertion. Failures are printed and the run continues where that makes sense;
# the last line is "e2e: N passed, M failed" and the exit status is 1 if anything failed.
set -euo pipefail

# shellcheck source=lib.sh
. "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

# --- setup (problems here are fatal, not assertions) ---------------------------------------------
ensure_apt_packages jq qemu-utils diffutils coreutils
DS=${CAIRN_DATASET:-}
[ -n "$DS" ] || DS=$(dataset_dir small)
for i in 0 1 2; do
  [ -f "$DS/su-$i.raw" ] || die "dataset image $DS/su-$i.raw missing"
done
BIN=$(cairn_bin)
[ -x "$BIN" ] || die "cairn binary $BIN not executable"

mkdir -p "$ROOT/.data"
T=$(mktemp -d -p "$ROOT/.data" e2e.XXXXXX)
cleanup() {
  if [ -n "${CAIRN_E2E_KEEP:-}" ]; then
    log "keeping $T"
  else
    rm -rf "$T"
  fi
}
trap cleanup EXIT
REPO="$T/repo" # does not exist yet: `cairn init` creates it

log "binary:  $BIN"
log "dataset: $DS"
log "repo:    $REPO"

# --- assertion helpers ----------------------------------------------------------------------------
PASSED=0
FAILED=0
FAILURES=()
pass() {
  PASSED=$((PASSED + 1))
  printf '  ok    %s\n' "$1"
}
fail() { # fail DESC [DETAIL...]
  FAILED=$((FAILED + 1))
  FAILURES+=("$1")
  printf '  FAIL  %s\n' "$1"
  shift
  local d
  for d in "$@"; do printf '        %s\n' "$d"; done
}
section() { printf '\n== %s\n' "$*"; }

RC=0
run() { # run CMD...: stdout -> $T/out, stderr -> $T/err, exit status -> RC
  RC=0
  "$@" >"$T/out" 2>"$T/err" || RC=$?
}
err_excerpt() { head -c 600 "$T/err" | sed 's/^/stderr: /'; }

expect_ok() { # expect_ok DESC CMD...: CMD exits 0
  local d=$1
  shift
  run "$@"
  if [ "$RC" -eq 0 ]; then
    pass "$d"
  else
    fail "$d" "exit $RC: $*" "$(err_excerpt)"
  fi
}
expect_fail() { # expect_fail DESC CMD...: CMD exits non-zero, without a panic (101) or signal
  local d=$1
  shift
  run "$@"
  if [ "$RC" -eq 0 ]; then
    fail "$d" "exit 0 (expected an error): $*"
  elif [ "$RC" -eq 101 ] || [ "$RC" -ge 128 ]; then
    fail "$d" "exit $RC (panic or signal, expected a clean error): $*" "$(err_excerpt)"
  else
    pass "$d"
  fi
}
check() { # check DESC CMD...: assertion holds when CMD succeeds (output hidden)
  local d=$1
  shift
  if "$@" >/dev/null 2>&1; then pass "$d"; else fail "$d" "false: $*"; fi
}
jtest() { # jtest DESC FILTER [FILE]: jq -e FILTER is true for FILE (default $T/out)
  local d=$1 f=$2 file=${3:-$T/out}
  if jq -e "$f" "$file" >/dev/null 2>&1; then
    pass "$d"
  else
    fail "$d" "jq -e '$f' is not true for: $(head -c 400 "$file")"
  fi
}
jget() { # jget FILTER [FILE]: raw value, empty if absent or invalid JSON
  jq -r "$1 // empty" "${2:-$T/out}" 2>/dev/null || true
}
is_uint() { [[ $1 =~ ^[0-9]+$ ]]; }

now_ms() { echo $(($(date +%s%N) / 1000000)); }
size_of() { stat -c %s "$1"; }
alloc_kib() { du -k "$1" | cut -f1; }
SIZE=$(size_of "$DS/su-0.raw")

cairn() { "$BIN" "$@"; }

# Restore an image to a file and compare it with the source: content, sparseness.
restore_and_compare() { # DESC-PREFIX SPEC SOURCE [qemu]
  local d=$1 spec=$2 src=$3 mode=${4:-} out="$T/restored.raw"
  rm -f "$out"
  expect_ok "$d: cairn restore $spec exits 0" cairn --repo "$REPO" restore "$spec" "$out" --force
  if [ "$RC" -ne 0 ] || [ ! -f "$out" ]; then
    fail "$d: restored file exists" "$out missing"
    return 0
  fi
  if cmp "$out" "$src" >"$T/cmp" 2>&1; then
    pass "$d: restored bytes equal $(basename "$src") (cmp)"
  else
    fail "$d: restored bytes equal $(basename "$src") (cmp)" "$(head -c 300 "$T/cmp")" \
      "sizes: restored $(size_of "$out"), source $(size_of "$src")"
  fi
  if [ "$mode" = qemu ]; then
    expect_ok "$d: qemu-img compare -f raw -F raw says identical" \
      qemu-img compare -f raw -F raw "$out" "$src"
  fi
  local got want
  got=$(alloc_kib "$out")
  want=$(($(alloc_kib "$src") + 1024))
  if [ "$got" -le "$want" ]; then
    pass "$d: restored file is sparse (${got} KiB allocated <= ${want} KiB)"
  else
    fail "$d: restored file is sparse" "${got} KiB allocated, source $(alloc_kib "$src") KiB (+1 MiB allowed)"
  fi
  rm -f "$out"
}

# --- 1. init ----------------------------------------------------------------------------------------
section "init"
expect_ok "cairn init exits 0" cairn --repo "$REPO" init
check "repository directory exists after init" test -d "$REPO"
expect_ok "cairn images on an empty repository exits 0 (repo from CAIRN_REPO)" \
  env CAIRN_REPO="$REPO" "$BIN" images

# --- 2. three versions of vm/disk0 ------------------------------------------------------------------
declare -A ID
for i in 0 1 2; do
  n=$((i + 1))
  src="$DS/su-$i.raw"
  section "commit su-$i.raw as vm/disk0 (expect seq $n)"
  t0=$(now_ms)
  expect_ok "commit su-$i exits 0" cairn --repo "$REPO" --json commit vm/disk0 "$src" -m "su-$i"
  t=$(($(now_ms) - t0))
  printf '        (%d.%03d s)\n' $((t / 1000)) $((t % 1000))
  cp "$T/out" "$T/commit-$n.json"
  jtest "commit su-$i prints exactly one JSON object" 'length == 1 and (.[0] | type == "object")' \
    <(jq -s . "$T/commit-$n.json" 2>/dev/null || echo null)
  jtest "commit su-$i: seq is $n" ".seq == $n" "$T/commit-$n.json"
  jtest "commit su-$i: id is a hex string of >= 8 chars" \
    '(.id | type == "string") and (.id | test("^[0-9a-f]{8,}$"))' "$T/commit-$n.json"
  jtest "commit su-$i: logical_bytes == file size ($SIZE)" ".logical_bytes == $SIZE" "$T/commit-$n.json"
  jtest "commit su-$i: 0 <= stored_bytes < logical_bytes" \
    '(.stored_bytes | type == "number") and .stored_bytes >= 0 and .stored_bytes < .logical_bytes' \
    "$T/commit-$n.json"
  ID[$n]=$(jget .id "$T/commit-$n.json")
  printf '        id=%s stored_bytes=%s\n' "${ID[$n]}" "$(jget .stored_bytes "$T/commit-$n.json")"
done
jtest "first commit stores data (stored_bytes > 0)" '.stored_bytes > 0' "$T/commit-1.json"

# --- 3. restore every version --------------------------------------------------------------------------
for n in 1 2 3; do
  section "restore vm/disk0@$n"
  mode=""
  [ "$n" -eq 2 ] && mode=qemu
  restore_and_compare "@$n" "vm/disk0@$n" "$DS/su-$((n - 1)).raw" "$mode"
done

section "restore by id prefix and without a ref"
if [ -n "${ID[2]:-}" ]; then
  restore_and_compare "@<id prefix>" "vm/disk0@${ID[2]:0:10}" "$DS/su-1.raw"
else
  fail "@<id prefix>: restore by version id prefix" "no id from commit 2"
fi
restore_and_compare "newest (no ref)" "vm/disk0" "$DS/su-2.raw"

section "show"
expect_ok "cairn show vm/disk0 exits 0" cairn --repo "$REPO" show vm/disk0
check "cairn show vm/disk0 prints something" test -s "$T/out"
expect_ok "cairn show vm/disk0@1 exits 0" cairn --repo "$REPO" show vm/disk0@1
expect_fail "cairn show vm/disk0@99 (no such version) fails" cairn --repo "$REPO" show vm/disk0@99
expect_fail "cairn restore vm/disk0@99 (no such version) fails" \
  cairn --repo "$REPO" restore vm/disk0@99 "$T/never.raw"
expect_fail "cairn restore no/such-image fails" cairn --repo "$REPO" restore no/such-image "$T/never.raw"

# --- 4. unchanged re-commit stores (almost) nothing -----------------------------------------------------
section "re-commit su-2.raw unchanged"
expect_ok "re-commit su-2 exits 0" cairn --repo "$REPO" --json commit vm/disk0 "$DS/su-2.raw" -m "su-2 again"
cp "$T/out" "$T/commit-4.json"
jtest "re-commit: seq is 4" '.seq == 4' "$T/commit-4.json"
stored=$(jget .stored_bytes "$T/commit-4.json")
if is_uint "$stored" && [ $((stored * 1000)) -lt "$SIZE" ]; then
  pass "re-commit: stored_bytes $stored < 0.1% of $SIZE"
else
  fail "re-commit: stored_bytes < 0.1% of image size" "stored_bytes='$stored', limit $((SIZE / 1000))"
fi

# --- 5. stdin and stdout ----------------------------------------------------------------------------------
section "commit from stdin, restore to stdout"
RC=0
# shellcheck disable=SC2002  # the point is a pipe, not a file
cat "$DS/su-0.raw" | "$BIN" --repo "$REPO" --json commit stdin/img - >"$T/out" 2>"$T/err" || RC=$?
if [ "$RC" -eq 0 ]; then pass "cat su-0.raw | cairn commit stdin/img - exits 0"; else
  fail "cat su-0.raw | cairn commit stdin/img - exits 0" "exit $RC" "$(err_excerpt)"
fi
jtest "stdin commit: seq is 1" '.seq == 1'
jtest "stdin commit: logical_bytes == $SIZE" ".logical_bytes == $SIZE"
set +o pipefail
"$BIN" --repo "$REPO" restore stdin/img - 2>"$T/err" | cmp - "$DS/su-0.raw" >"$T/cmp" 2>&1
ps=("${PIPESTATUS[@]}")
set -o pipefail
if [ "${ps[0]}" -eq 0 ]; then pass "cairn restore stdin/img - exits 0"; else
  fail "cairn restore stdin/img - exits 0" "exit ${ps[0]}" "$(err_excerpt)"
fi
if [ "${ps[1]}" -eq 0 ]; then pass "restore to stdout equals su-0.raw (cmp)"; else
  fail "restore to stdout equals su-0.raw (cmp)" "$(head -c 300 "$T/cmp")"
fi

# --- 6. listing, verify, log, stats -------------------------------------------------------------------------
section "images, verify, log, stats"
expect_ok "cairn images exits 0" cairn --repo "$REPO" images
check "cairn images lists vm/disk0" grep -qF vm/disk0 "$T/out"
check "cairn images lists stdin/img" grep -qF stdin/img "$T/out"

expect_ok "cairn verify exits 0 on a clean repository" cairn --repo "$REPO" verify

expect_ok "cairn log vm/disk0 exits 0" cairn --repo "$REPO" log vm/disk0
check "cairn log vm/disk0 prints something" test -s "$T/out"
expect_ok "cairn log vm/disk0 --json exits 0" cairn --repo "$REPO" log vm/disk0 --json
cp "$T/out" "$T/log.json"
jtest "log --json is an array of 4 entries" 'type == "array" and length == 4' "$T/log.json"
jtest "log --json is newest first (seq 4,3,2,1)" '[.[].seq] == [4,3,2,1]' "$T/log.json"
jtest "log --json entries have id, seq, time, logical_bytes, stored_bytes, message" \
  'all(.[]; has("id") and has("seq") and has("time") and has("logical_bytes") and has("stored_bytes") and has("message"))' \
  "$T/log.json"
jtest "log --json: messages are the commit messages" \
  '[.[].message] == ["su-2 again", "su-2", "su-1", "su-0"]' "$T/log.json"
if [ -n "${ID[1]:-}" ]; then
  jtest "log --json: seq 1 has the id commit printed" ".[3].id == \"${ID[1]}\"" "$T/log.json"
fi

expect_ok "cairn stats --json exits 0" cairn --repo "$REPO" stats --json
cp "$T/out" "$T/stats.json"
jtest "stats --json: logical_bytes and stored_bytes are positive numbers" \
  '(.logical_bytes | type == "number") and (.stored_bytes | type == "number") and .logical_bytes > 0 and .stored_bytes > 0' \
  "$T/stats.json"
jtest "stats --json: stored_bytes < logical_bytes" '.stored_bytes < .logical_bytes' "$T/stats.json"
expect_ok "cairn stats (human) exits 0" cairn --repo "$REPO" stats

# --- 7. errors ------------------------------------------------------------------------------------------------
section "error cases"
missing="$T/no-such-dir/no-such-image.raw"
expect_fail "commit of a missing source fails" cairn --repo "$REPO" commit vm/disk0 "$missing"
lines=$(grep -c . "$T/err" || true)
if [ "$lines" -eq 1 ]; then pass "missing source: exactly one line on stderr"; else
  fail "missing source: exactly one line on stderr" "got $lines lines:" "$(err_excerpt)"
fi
check "missing source: stderr names the path" grep -qF "$missing" "$T/err"
run cairn --repo "$REPO" --json log vm/disk0
jtest "missing source: no version was added (log still has 4)" 'length == 4'

nonexist=/nonexistent
existed=0
[ -e "$nonexist" ] && existed=1
expect_fail "cairn --repo /nonexistent log x fails" cairn --repo "$nonexist" log x
if [ "$existed" -eq 0 ]; then
  check "cairn --repo /nonexistent did not create it" test ! -e "$nonexist"
fi

for bad in ../evil a/../../evil; do
  expect_fail "image name '$bad' is rejected" cairn --repo "$REPO" commit "$bad" "$DS/su-0.raw"
done
check "nothing was written outside the repository" test -z "$(find "$T" -maxdepth 2 -name '*evil*' -print -quit)"
run cairn --repo "$REPO" images
check "rejected names are not listed by cairn images" test -z "$(grep -F evil "$T/out" || true)"

# --- 7a. block devices as source and target ---------------------------------------------------------------------
section "block device: restore onto a loop device, commit from it"
if [ "$(id -u)" -eq 0 ] && command -v losetup >/dev/null; then
  backing="$T/loop-backing.raw"
  truncate -s "$(size_of "$DS/su-0.raw")" "$backing"
  # Fill the device with garbage first: a device restore must write the zeros explicitly.
  head -c $((8 << 20)) /dev/urandom | dd of="$backing" conv=notrunc status=none
  if loopdev=$(losetup -f --show "$backing" 2>/dev/null); then
    expect_ok "cairn restore vm/disk0@1 onto $loopdev" cairn --repo "$REPO" -q restore vm/disk0@1 "$loopdev" --force
    check "the loop device equals su-0.raw (cmp)" cmp -s "$loopdev" "$DS/su-0.raw"
    expect_ok "cairn commit from the block device $loopdev" cairn --repo "$REPO" -q commit blockdev/img "$loopdev"
    restore_and_compare "from a block device:" blockdev/img "$DS/su-0.raw"
    losetup -d "$loopdev"
  else
    fail "block device" "losetup could not attach a loop device"
  fi
else
  echo "        (skipped: needs root and losetup)"
fi

# --- 7b. kill -9 in the middle of a commit ----------------------------------------------------------------------
section "kill -9 mid-commit leaves the repository consistent"
before=$(cairn --repo "$REPO" --json log vm/disk0 | jq length)
killed=0
# --rate-limit keeps each commit running for seconds (su-2 is deduplicated against vm/disk0
# and would otherwise finish within the first delay on a fast machine), so every kill lands
# mid-commit, whatever the machine's speed.
for delay in 0.2 0.5 1.0; do
  "$BIN" --repo "$REPO" -q commit killed/img "$DS/su-2.raw" --rate-limit 50 >/dev/null 2>&1 &
  pid=$!
  sleep "$delay"
  if kill -9 "$pid" 2>/dev/null; then killed=$((killed + 1)); fi
  wait "$pid" 2>/dev/null || true
done
check "every commit was killed mid-way ($killed of 3)" test "$killed" -eq 3
expect_ok "cairn verify is clean after kill -9" cairn --repo "$REPO" verify
check "vm/disk0 history is unchanged after kill -9" \
  test "$(cairn --repo "$REPO" --json log vm/disk0 | jq length)" = "$before"
expect_ok "a commit after kill -9 succeeds" cairn --repo "$REPO" -q commit killed/img "$DS/su-2.raw"
restore_and_compare "after kill -9:" killed/img "$DS/su-2.raw"

# --- 8. damage is detected ------------------------------------------------------------------------------------
section "verify detects damage"
victim=$(find "$REPO/packs" -type f -printf '%s\t%p\n' | sort -rn | awk 'NR == 1' | cut -f2-)
if [ -n "$victim" ] && [ "$(size_of "$victim")" -gt 0 ]; then
  vsize=$(size_of "$victim")
  off=$((vsize / 2))
  orig=$(od -An -tu1 -j "$off" -N1 "$victim" | tr -d ' ')
  printf '%b' "\\0$(printf '%03o' $(((orig ^ 255) & 255)))" |
    dd of="$victim" bs=1 seek="$off" count=1 conv=notrunc status=none
  printf '        flipped byte %s of %s (%s bytes)\n' "$off" "${victim#"$REPO"/}" "$vsize"
  expect_fail "cairn verify fails after a byte of the largest pack is flipped" \
    cairn --repo "$REPO" verify
  check "verify exits 3 (damage found), not 1 (could not run): got $RC" test "$RC" -eq 3
else
  fail "verify detects damage" "no files found in $REPO"
fi

# --- summary -----------------------------------------------------------------------------------------------------
echo
if [ "$FAILED" -gt 0 ]; then
  echo "failures:"
  for f in "${FAILURES[@]}"; do echo "  - $f"; done
fi
echo "e2e: $PASSED passed, $FAILED failed"
[ "$FAILED" -eq 0 ]
